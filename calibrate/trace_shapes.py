"""Where real traces spend simulated time, by op and shape: the weights of `calibrate.fit_analytic`.

``python -m calibrate.trace_shapes`` runs the shipped scenarios of real traces (`SCENARIOS`: the
Azure conversation trace on Llama-3.1-8B, ``scenarios/default.yaml``; the Mooncake conversation
trace on Llama-3.1-70B TP 8, ``scenarios/mooncake_70b.yaml``, its first 3,000 requests) with the
analytic model, stepping one by one (``sim.fast_forward: false``, so every priced step ran), and
records for each step the seconds of its GEMMs (by the step's token count), of its prefill chunks'
attention (by chunk length and cached prefix) and of its decode attention (by batch and mean
context). It writes the seconds summed per shape, on a grid of eighth-octaves, to
``calibrate/trace_shapes.json`` (about a minute; rerun when the scenarios or the engine change).
The fit weights each measured point by the share of this time its shape takes (`weights`).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PATH = Path(__file__).resolve().parent / "trace_shapes.json"
COMMAND = "python -m calibrate.trace_shapes"
# name: (scenario, overrides, the (model, tp) whose shapes it runs)
SCENARIOS = {
    "azure-conv-llama-3.1-8b": ("scenarios/default.yaml", (), ("llama-3.1-8b", 1)),
    "mooncake-conv-llama-3.1-70b-tp8": (
        "scenarios/mooncake_70b.yaml",
        ("workload.max_requests=3000",),
        ("llama-3.1-70b", 8),
    ),
}
STEPS_PER_OCTAVE = 8


def grid(x: float) -> float:
    """``x`` rounded to the nearest eighth-octave (x >= 1)."""
    return float(2.0 ** (round(math.log2(max(x, 1.0)) * STEPS_PER_OCTAVE) / STEPS_PER_OCTAVE))


def record(scenario: str, overrides: tuple[str, ...]) -> dict[str, Any]:
    """Seconds per op and shape over the steps of one run."""
    from kvsim.costs.analytic import AnalyticCostModel
    from kvsim.costs.base import ForwardBatch, SeqKind, StepPrice
    from kvsim.run import run_scenario
    from kvsim.spec.scenario import load_scenario

    sc = load_scenario(ROOT / scenario, [*overrides, "sim.fast_forward=false", "cost_model.kind=analytic"])
    gemm: dict[float, float] = defaultdict(float)
    prefill: dict[tuple[float, float], float] = defaultdict(float)
    decode: dict[tuple[float, float], float] = defaultdict(float)
    total = [0.0]
    price = AnalyticCostModel.price

    def recording(self: AnalyticCostModel, batch: ForwardBatch) -> StepPrice:
        out = price(self, batch)
        total[0] += out.seconds
        gemm[grid(batch.num_tokens)] += self._gemm_time(batch.num_tokens, batch.num_sampling)
        dec_n, dec_ctx = 0, 0
        for kind, n, c in zip(batch.kinds, batch.num_new, batch.ctx_before, strict=True):
            if kind is SeqKind.DECODE:
                dec_n, dec_ctx = dec_n + 1, dec_ctx + c
            else:
                prefill[(grid(n), grid(c + 1) if c else 0.0)] += self._prefill_attn_time(n, c)
        if dec_n:
            t = float(self._decode_attn_time(dec_n, np.array([float(dec_ctx)]))[0])
            decode[(grid(dec_n), grid(dec_ctx / dec_n))] += t
        return out

    AnalyticCostModel.price = recording  # type: ignore[method-assign]
    try:
        run_scenario(sc)
    finally:
        AnalyticCostModel.price = price  # type: ignore[method-assign]
    return {
        "steps_s": total[0],
        "gemm": sorted([m, s] for m, s in gemm.items()),
        "prefill_attn": sorted([n, c, s] for (n, c), s in prefill.items()),
        "decode_attn": sorted([b, c, s] for (b, c), s in decode.items()),
    }


def load() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(PATH.read_text())
    return data


def shares(data: dict[str, Any], model: str, tp: int) -> dict[str, Any] | None:
    """The recorded seconds of the run whose shapes are (model, tp), or of the run of the same
    model at another TP degree (the token counts and contexts a trace makes do not depend on TP),
    or None."""
    runs = data["runs"]
    for name in runs:
        if runs[name]["model"] == model and runs[name]["tp"] == tp:
            return dict(runs[name])
    for name in runs:
        if runs[name]["model"] == model:
            return dict(runs[name])
    return None


def main() -> int:
    runs: dict[str, Any] = {}
    for name, (scenario, overrides, (model, tp)) in SCENARIOS.items():
        rec = record(scenario, overrides)
        runs[name] = {"scenario": scenario, "overrides": list(overrides), "model": model, "tp": tp, **rec}
        print(f"{name}: {rec['steps_s']:,.0f} simulated step-seconds")
    content = {
        "generated_by": COMMAND,
        "about": "simulated seconds per op and shape (eighth-octave grid) of the analytic model's runs "
        "of real traces, stepping one by one: gemm [tokens, s], prefill_attn [chunk, prefix+1 (0: none), "
        "s], decode_attn [batch, mean context, s]",
        "runs": runs,
    }
    PATH.write_text(json.dumps(content, indent=0) + "\n")
    print(f"wrote {PATH.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

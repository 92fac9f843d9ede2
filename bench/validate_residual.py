"""Where a `kvsim validate` run's per-step error comes from: measured - priced per step, regressed on
the step's composition (BENCHMARKS.md, "The step's rest, measured").

Each executed step (``records*.json``) is priced by the profile calibrated for its round
(``profile*.json``) for its own batch, as ``validate.json``'s per-step error is; the residual
(measured - priced seconds) is then fitted by least squares and by least absolute deviations on
(1, tokens, decode rows, prefill rows), and summarised by composition (decode rows; prefill tokens).
Needs no torch:

    python bench/validate_residual.py OUT_DIR      # a `kvsim validate --out` folder
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvsim import validation as V
from kvsim.costs.base import ForwardBatch, SeqKind
from kvsim.run import make_cost_model


def residuals(out: Path) -> np.ndarray:
    """Rows of (measured s, priced s, tokens, decode rows, prefill rows) over every recorded step."""
    data = json.loads((out / "validate.json").read_text())
    setup = V._read_setup(Path(data["scenario"]))
    model_path = next((out / "model").glob("*/config.json"))
    scaled = V._scenario(setup, model_ref=str(model_path), num_blocks=None)
    fmt, bs = scaled.kv.format, scaled.kv.block_size
    block_bytes = scaled.model.kv_bytes_per_token(fmt) * scaled.model.kv_share(1) * bs
    rows = []
    for rec in sorted(out.glob("records*.json")):
        tag = rec.stem.removeprefix("records")
        sc = V._scenario(
            setup,
            model_ref=str(model_path),
            num_blocks=data["num_blocks"],
            block_bytes=block_bytes,
            weight_bytes=math.ceil(scaled.model.weight_bytes),
            cost_model={"kind": "profile", "profile": str(out / f"profile{tag}.json"), "force": True},
        )
        cost = make_cost_model(sc)
        for run in json.loads(rec.read_text())["runs"]:
            for st in run["steps"]:
                dec, new, ctx, smp = st[2], st[3], st[4], st[5]
                kinds = (SeqKind.DECODE,) * len(dec) + (SeqKind.PREFILL,) * len(new)
                b = ForwardBatch(kinds, (1,) * len(dec) + tuple(new), tuple(dec) + tuple(ctx), int(smp))
                rows.append((st[1], cost.price(b).seconds, len(dec) + sum(new), len(dec), len(new)))
    return np.asarray(rows, dtype=np.float64)


def lad(x: np.ndarray, y: np.ndarray, iters: int = 50) -> np.ndarray:
    """Least absolute deviations by iteratively reweighted least squares."""
    w = np.ones_like(y)
    coef = np.zeros(x.shape[1])
    for _ in range(iters):
        sw = np.sqrt(w)
        coef = np.linalg.lstsq(x * sw[:, None], y * sw, rcond=None)[0]
        w = 1.0 / np.maximum(np.abs(y - x @ coef), 1e-5)
    return coef


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    a = residuals(p.parse_args().out)
    meas, priced, tok, dec, pre = a.T
    res = meas - priced
    print(f"{len(a)} steps: measured - priced median {np.median(res) * 1e3:+.3f} ms "
          f"({np.median(res / meas) * 100:+.1f}% of the step), mean {res.mean() * 1e3:+.3f} ms")  # fmt: skip
    x = np.column_stack([np.ones_like(tok), tok, dec, pre])
    ols = np.linalg.lstsq(x, res, rcond=None)[0]
    r2 = 1 - ((res - x @ ols) ** 2).sum() / ((res - res.mean()) ** 2).sum()
    for name, c in (("least squares", ols), ("least absolute deviations", lad(x, res))):
        terms = [f"{c[0] * 1e3:.3f} ms"] + [
            f"{'-' if v < 0 else '+'} {abs(v) * 1e6:.1f} us/{what}"
            for v, what in zip(c[1:], ("token", "decode row", "prefill row"), strict=True)
        ]
        print(f"{name}: {' '.join(terms)}" + (f" (R^2 {r2:.3f})" if c is ols else ""))
    only = pre == 0
    for label, mask in (("decode-only", only), ("with a prefill", ~only)):
        if mask.any():
            print(f"{label}: {mask.sum()} steps, median residual {np.median(res[mask]) * 1e3:+.3f} ms")
    for b in sorted(set(dec[only].astype(int))):
        m = only & (dec == b)
        print(f"  {b} decode rows: {m.sum()} steps, residual {np.median(res[m]) * 1e3:+.3f} ms "
              f"(measured {np.median(meas[m]) * 1e3:.2f}, priced {np.median(priced[m]) * 1e3:.2f} ms)")  # fmt: skip
    for lo, hi in ((1, 64), (64, 128), (128, 256), (256, 400), (400, 1 << 30)):
        m = ~only & (tok >= lo) & (tok < hi)
        if m.any():
            print(f"  prefill steps of {lo}-{min(hi, 10**6) - 1} tokens: {m.sum()}, residual "
                  f"{np.median(res[m]) * 1e3:+.3f} ms")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

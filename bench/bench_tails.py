"""Tails of the analytic cost model against runs priced from NVIDIA's measured tables (issue 29).

Each case runs one scenario twice, in a fresh process each: with the analytic model (``cost_model:
{kind: analytic}``, fitted to aiconfigurator-core's tables for the GPU) and with a profile imported
from the same tables (``kvsim calibrate import --from-aiconfigurator``, the vllm backend's, into a
temporary folder), and prints the analytic run's error against the table run at p50, p90 and p99 of
TTFT, TPOT and E2E. FP8 pairs print the effect of an fp8 KV cache on each model (fp8 / bf16 - 1) and
whether the two agree in sign. Usage (needs ``pip install 'kvsim[aiconfigurator]'``):

    python bench/bench_tails.py [--case NAME ...] [--json out.json]

Cases: the Mooncake conversation trace on 8 replicas of Llama-3.1-70B TP 8 (64 H100, and the same
on H200); the default scenario (Azure conversation trace, Llama-3.1-8B, one GPU) at 8x its arrival
rate, the first 400 requests, on H100 and H200, bf16 and fp8 KV; the Vidur-like A100 case
(`bench/scenarios/azure_a100_overloaded.yaml`, Llama-2-7B at half its rate, the first 2,000
requests). aiconfigurator has no A100 attention rows for Llama-2-7B's 32 KV heads per GPU, so its
table run uses the Llama-3.1-8B TP 1 import scaled by FLOPs and bytes (``cost_model.force``): a
check of the GEMM side and the ramps more than of attention.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
METRICS = ("ttft_s", "tpot_s", "e2e_s")
PCTS = ("p50", "p90", "p99")
LOAD_8B = ("workload.rate_scale=8", "workload.max_requests=400")
# name: (scenario, overrides, (aiconfigurator system, model, tp) of the table run's profile)
CASES: dict[str, tuple[str, tuple[str, ...], tuple[str, str, int]]] = {
    "mooncake-70b-h100": ("scenarios/mooncake_70b.yaml", (), ("h100_sxm", "llama-3.1-70b", 8)),
    "mooncake-70b-h200": (
        "scenarios/mooncake_70b.yaml",
        ("cluster.gpu=h200-sxm",),
        ("h200_sxm", "llama-3.1-70b", 8),
    ),
    "default-8b-h100-8x": ("scenarios/default.yaml", LOAD_8B, ("h100_sxm", "llama-3.1-8b", 1)),
    "default-8b-h100-8x-fp8": (
        "scenarios/default.yaml",
        (*LOAD_8B, "kv.format=fp8_e4m3"),
        ("h100_sxm", "llama-3.1-8b", 1),
    ),
    "default-8b-h200-8x": (
        "scenarios/default.yaml",
        (*LOAD_8B, "cluster.gpu=h200-sxm"),
        ("h200_sxm", "llama-3.1-8b", 1),
    ),
    "default-8b-h200-8x-fp8": (
        "scenarios/default.yaml",
        (*LOAD_8B, "cluster.gpu=h200-sxm", "kv.format=fp8_e4m3"),
        ("h200_sxm", "llama-3.1-8b", 1),
    ),
    "vidur-a100-llama2-7b-half": (
        "bench/scenarios/azure_a100_overloaded.yaml",
        ("workload.rate_scale=0.5", "workload.max_requests=2000", "cost_model.force=true"),
        ("a100_sxm", "llama-3.1-8b", 1),
    ),
}
FP8_PAIRS = (
    ("default-8b-h100-8x", "default-8b-h100-8x-fp8"),
    ("default-8b-h200-8x", "default-8b-h200-8x-fp8"),
)

CHILD = """
import json, sys
from kvsim.spec.scenario import load_scenario
from kvsim.run import run_scenario
s = run_scenario(load_scenario(sys.argv[1], sys.argv[2:])).summary
keys = ("ttft_s", "tpot_s", "e2e_s")
print(json.dumps({**{k: {p: s[k][p] for p in ("p50", "p90", "p99")} for k in keys},
                  "completed": s["requests"]["completed"], "warnings": s["warnings"],
                  "cost_model": s["config"]["cost_model"]}))
"""


def run(scenario: str, *overrides: str) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(ROOT / scenario), *overrides],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    result: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    return result


def profile(tmp: Path, system: str, model: str, tp: int) -> Path:
    out = tmp / f"{system}-{model}-tp{tp}.json"
    if not out.is_file():
        subprocess.run(
            [
                *(sys.executable, "-m", "kvsim", "calibrate", "import", "--from-aiconfigurator"),
                *(
                    "--system",
                    system,
                    "--backend",
                    "vllm",
                    "--model",
                    model,
                    "--tp",
                    str(tp),
                    "--out",
                    str(out),
                ),
            ],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            check=True,
            capture_output=True,
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="default: all")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    names = args.case or list(CASES)
    results: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory() as d:
        for name in names:
            scenario, overrides, (system, model, tp) = CASES[name]
            prof = profile(Path(d), system, model, tp)
            table = run(scenario, *overrides, "cost_model.kind=profile", f"cost_model.profile={prof}")
            analytic = run(scenario, *[o for o in overrides if not o.startswith("cost_model.")])
            err = {
                m: {p: analytic[m][p] / table[m][p] - 1.0 for p in PCTS}  # type: ignore[index]
                for m in METRICS
            }
            results[name] = {"analytic": analytic, "table": table, "error": err}
            cells = "  ".join(f"{m[:-2]} " + " ".join(f"{err[m][p]:+6.1%}" for p in PCTS) for m in METRICS)
            print(f"{name:28} {cells}", flush=True)
    print("\nFP8 KV's effect (fp8 / bf16 - 1) on TPOT and TTFT, analytic vs tables:")
    for a, b in FP8_PAIRS:
        if a in results and b in results:
            for m in ("tpot_s", "ttft_s"):
                for p in ("p50", "p99"):
                    fx = {
                        k: results[b][k][m][p] / results[a][k][m][p] - 1.0  # type: ignore[index]
                        for k in ("analytic", "table")
                    }
                    same = "same sign" if fx["analytic"] * fx["table"] > 0 else "OPPOSITE sign"
                    print(f"  {a:22} {m[:-2]} {p}: {fx['analytic']:+6.1%} vs {fx['table']:+6.1%}  {same}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

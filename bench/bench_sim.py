"""Simulator speed and memory on the two target workloads (issue: simulator core).

Runs each case N times, each in a fresh process (so peak RSS is the run's own), and prints the
median wall time, simulated seconds per wall second and peak RSS, plus the fast-forward speed-up
measured side by side (fast_forward on/off alternating in one session). Usage:

    python bench/bench_sim.py [--repeats 3] [--json out.json]

Targets (2-core machine): Mooncake conversation trace on 8 x (Llama-3.1-70B, 8 x H100, TP 8) under
10 s; Azure 2023 conversation trace on one H100 with Llama-3.1-8B under 5 s; peak RSS under 1 GiB.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from simrun import run_child

ROOT = Path(__file__).resolve().parent.parent
CASES: dict[str, tuple[str, ...]] = {
    "mooncake-70b-64xh100": ("scenarios/mooncake_70b.yaml",),
    "azure-conv-8b-1xh100": ("scenarios/default.yaml",),
    # The same trace on an H200 priced from NVIDIA's measured tables (the profile cost model). An
    # override's path is relative to the working directory (the checkout; trees before this rule
    # read it relative to scenarios/ and need profiles/... instead).
    "azure-conv-8b-1xh200-profile": (
        "scenarios/default.yaml",
        "cluster.gpu=h200-sxm",
        "cost_model.kind=profile",
        "cost_model.profile=scenarios/profiles/aiconfigurator-h200_sxm-vllm-llama-3.1-8b-tp1.json",
    ),
}


def run_once(scenario: str, *overrides: str) -> dict[str, float]:
    return run_child(ROOT, scenario, *overrides)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results = {}
    for name, case in CASES.items():
        ff, step = [], []
        for _ in range(args.repeats):
            ff.append(run_once(*case))
            step.append(run_once(*case, "sim.fast_forward=false"))
        med = {k: statistics.median(r[k] for r in ff) for k in ff[0]}
        med_step = statistics.median(r["wall_s"] for r in step)
        ratios = [s["wall_s"] / f["wall_s"] for f, s in zip(ff, step, strict=True)]
        results[name] = {
            **med,
            "sim_per_wall": med["simulated_s"] / med["wall_s"],
            "wall_s_no_fast_forward": med_step,
            "fast_forward_speedup": statistics.median(ratios),
            "events_no_fast_forward": step[0]["events"],
        }
        r = results[name]
        print(
            f"{name}: {r['requests']:.0f} requests, wall {r['wall_s']:.2f} s (median of {args.repeats}), "
            f"{r['sim_per_wall']:,.0f}x real time, peak RSS {r['rss_mib']:.0f} MiB, "
            f"events {r['events']:,.0f} vs {r['events_no_fast_forward']:,.0f} without fast-forward "
            f"({r['fast_forward_speedup']:.2f}x faster)"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

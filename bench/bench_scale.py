"""Cluster scale: wall time, memory and engine events over requests x replicas.

The synthetic workload of ``bench/scenarios/cluster_scale.yaml`` (lognormal prompts of about 1,200
tokens, answers of about 250, Poisson arrivals) on Llama-3.1-8B H100 replicas, with the arrival rate
scaled with the GPU count (100 requests/s per 32 GPUs) so that every replica carries the same load
at every size. Each point runs in a fresh process. Events per request should not grow with the
replica count (an arrival cuts only the window of the replica it is routed to). Usage:

    python bench/bench_scale.py [--requests 10000,100000,1000000] [--gpus 8,32,256] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from simrun import run_child

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = ROOT / "bench" / "scenarios" / "cluster_scale.yaml"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=_ints, default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--gpus", type=_ints, default=[8, 32, 256], help="multiples of 8 (8 GPUs a node)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = []
    for gpus in args.gpus:
        for n in args.requests:
            over = [
                f"workload.synthetic.num_requests={n}",
                f"workload.synthetic.rate={100 * gpus / 32:g}",
                f"cluster.nodes={gpus // 8}",
            ]
            r = {"gpus": gpus, **run_child(ROOT, SCENARIO, *over)}
            rows.append(r)
            print(
                f"{gpus:4d} GPUs, {n:>9,} requests: {r['wall_s']:7.1f} s wall, {r['rss_mib']:6.0f} MiB, "
                f"{r['events']:>11,} events ({r['events'] / n:.2f} per request), "
                f"{r['simulated_s'] / r['wall_s']:,.0f}x real time",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

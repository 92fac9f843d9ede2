"""Simulator speed side by side against an earlier checkout (issue 8's targets).

Runs each case alternately in this tree and in ``--base DIR`` (a git worktree of the commit to
compare with, e.g. ``git worktree add /tmp/base bbec2e2``), each run in a fresh process, and prints
medians of wall time and peak RSS, the ratio of the medians, and engine events and steps beside
them. Scenario paths are looked up in each tree; a case missing in the base tree uses this tree's
file (its sections must be ones the base reads). Usage:

    python bench/bench_compare.py --base /tmp/base [--repeats 3] [--case NAME ... | --issue20] [--json out.json]

Cases: the Mooncake conversation trace on 64 H100s; one A100 overloaded with Llama-2-7B from its
config.json; cluster scale, 10,000 synthetic requests on 32 H100 replicas (``cluster-100k`` runs
the 100,000-request version: minutes on the commit before this wave).
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
    "azure-a100-llama2-7b-overloaded": ("bench/scenarios/azure_a100_overloaded.yaml",),
    "azure-conv-8b-1xh100": ("scenarios/default.yaml",),
    "cluster-10k-32xh100": ("bench/scenarios/cluster_scale.yaml", "workload.synthetic.num_requests=10000"),
    "cluster-100k-32xh100": ("bench/scenarios/cluster_scale.yaml",),
    "mooncake-70b-64xh100-offload-global": (
        "scenarios/mooncake_70b.yaml",
        "kv.offload.enabled=true",
        "kv.offload.host_bytes=256GiB",
        "kv.prefix_cache.scope=global",
    ),
}
DEFAULT = ("mooncake-70b-64xh100", "azure-a100-llama2-7b-overloaded", "cluster-10k-32xh100")
# Issue 20's targets: 2x less CPU than 5f78f27 on these (bench/README: `--issue20`).
ISSUE20 = (
    "mooncake-70b-64xh100",
    "azure-conv-8b-1xh100",
    "azure-a100-llama2-7b-overloaded",
    "mooncake-70b-64xh100-offload-global",
)


def run_once(tree: Path, scenario: str, *overrides: str) -> dict[str, float]:
    path = tree / scenario
    return run_child(tree, path if path.is_file() else ROOT / scenario, *overrides)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, required=True, help="checkout of the commit to compare with")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="default: " + ", ".join(DEFAULT))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--issue20", action="store_true", help="the cases: " + ", ".join(ISSUE20))
    args = ap.parse_args()
    results = {}
    for name in args.case or (ISSUE20 if args.issue20 else DEFAULT):
        runs: dict[str, list[dict[str, float]]] = {"now": [], "base": []}
        for _ in range(args.repeats):  # alternate, so drift on a shared machine hits both alike
            runs["now"].append(run_once(ROOT, *CASES[name]))
            runs["base"].append(run_once(args.base.resolve(), *CASES[name]))
        row = {}
        for side, rs in runs.items():
            row[side] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        row["speedup"] = row["base"]["wall_s"] / row["now"]["wall_s"]
        # CPU seconds of run_scenario (steadier than wall time on a shared machine), pair by pair.
        row["cpu_ratio"] = statistics.median(
            a["cpu_s"] / b["cpu_s"] for a, b in zip(runs["now"], runs["base"], strict=True)
        )
        results[name] = row
        n, b = row["now"], row["base"]
        print(
            f"{name}: now {n['cpu_s']:.2f} s CPU ({1e6 * n['cpu_s'] / n['events']:.0f} us/event), "
            f"{n['rss_mib']:.0f} MiB, {n['events']:,.0f} events / {n['steps']:,.0f} steps "
            f"({n['events'] / n['requests']:.2f} events per request); base {b['cpu_s']:.2f} s CPU "
            f"({1e6 * b['cpu_s'] / b['events']:.0f} us/event), {b['rss_mib']:.0f} MiB, "
            f"{b['events']:,.0f} events / {b['steps']:,.0f} steps ({b['events'] / b['requests']:.2f} "
            f"per request); CPU now/base {row['cpu_ratio']:.2f} (median of {args.repeats} pairs, "
            f"alternating); wall {row['speedup']:.2f}x"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

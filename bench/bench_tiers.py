"""The memory hierarchy's cost in simulator speed: the Mooncake 64-GPU case with host-DRAM offload
and the global prefix pool on against off, side by side in one session (issue 10: within 2x).

Each run in a fresh process (`simrun.run_child`), the variants alternating, N rounds:

    python bench/bench_tiers.py [--repeats 3] [--json out.json] [--only VARIANT ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from simrun import run_child

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = "scenarios/mooncake_70b.yaml"
VARIANTS: dict[str, tuple[str, ...]] = {
    "off": (),
    "offload": ("kv.offload.enabled=true", "kv.offload.host_bytes=256GiB"),
    "global": ("kv.prefix_cache.scope=global",),
    "offload+global": (
        "kv.offload.enabled=true",
        "kv.offload.host_bytes=256GiB",
        "kv.prefix_cache.scope=global",
    ),
    "offload+global lfu": (
        "kv.offload.enabled=true",
        "kv.offload.host_bytes=256GiB",
        "kv.offload.eviction=lfu",
        "kv.prefix_cache.scope=global",
        "kv.prefix_cache.pool_eviction=lfu",
    ),
    "offload+global fair": (
        "kv.offload.enabled=true",
        "kv.offload.host_bytes=256GiB",
        "kv.prefix_cache.scope=global",
        "cluster.topology.sharing=fair",
    ),
    "offload+pool nodes": (  # the pool on 2 dedicated pool nodes (2 TiB, 2 NICs each)
        "kv.offload.enabled=true",
        "kv.offload.host_bytes=256GiB",
        "kv.prefix_cache.scope=global",
        "kv.prefix_cache.pool_nodes=2",
    ),
    "swap": ("scheduler.preemption=swap",),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--only", nargs="+", choices=list(VARIANTS), help="these variants (off always)")
    args = ap.parse_args()
    names = ["off", *(n for n in args.only if n != "off")] if args.only else list(VARIANTS)
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in names}
    for _ in range(args.repeats):
        for name in names:
            runs[name].append(run_child(ROOT, SCENARIO, *VARIANTS[name]))
    base = statistics.median(r["wall_s"] for r in runs["off"])
    print(f"{'variant':<20} {'wall (median)':>14} {'x off':>7} {'events':>9} {'rss MiB':>8}")
    out = {}
    for name, rs in runs.items():
        wall = statistics.median(r["wall_s"] for r in rs)
        out[name] = {
            "wall_s": wall,
            "ratio": wall / base,
            "events": rs[0]["events"],
            "rss_mib": max(r["rss_mib"] for r in rs),
        }
        print(
            f"{name:<20} {wall:>12.2f} s {wall / base:>6.2f}x {int(rs[0]['events']):>9,} {out[name]['rss_mib']:>8.0f}"
        )
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()

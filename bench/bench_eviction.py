"""Token eviction's cost to the simulator: a scenario with H2O on against the same without it.

Each case runs alternately without and with ``kv.eviction`` (H2O, 20% heavy hitters + 128 recent,
hybrid pages), each run in a fresh process; prints medians of wall time, engine events and steps,
and the ratio of the medians (target: H2O on within 1.5x). Usage:

    python bench/bench_eviction.py [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from simrun import off_on

ROOT = Path(__file__).resolve().parent.parent
H2O = ("kv.eviction.policy=h2o", "kv.eviction.heavy_ratio=0.2", "kv.eviction.recent_tokens=128")
CASES: dict[str, tuple[str, ...]] = {
    "azure-conv-8b-1xh100": ("scenarios/default.yaml",),
    "azure-a100-llama2-7b-overloaded": ("bench/scenarios/azure_a100_overloaded.yaml",),
}
EXTRA: dict[str, tuple[str, ...]] = {
    "azure-conv-8b-1xh100-physical": ("scenarios/default.yaml", "kv.eviction.pages=physical"),
    "azure-conv-8b-1xh100-pressure": (
        "scenarios/default.yaml",
        "kv.eviction.trigger=pressure",
        "kv.eviction.pressure_threshold=0.5",
    ),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = []
    cases = {
        **{k: (v[0], (), v[1:]) for k, v in CASES.items()},
        **{k: (v[0], (), v[1:]) for k, v in EXTRA.items()},
    }
    for name, (scenario, base, extra) in cases.items():
        off, on, med = off_on(ROOT, ROOT / scenario, base, (*base, *H2O, *extra), args.repeats)
        w_off, w_on, c_off, c_on = med["off_wall_s"], med["on_wall_s"], med["off_cpu_s"], med["on_cpu_s"]
        row = {
            "case": name,
            **med,
            "preemptions": (off[0]["preemptions"], on[0]["preemptions"]),
            "off_events": off[0]["events"],
            "on_events": on[0]["events"],
            "off_steps": off[0]["steps"],
            "on_steps": on[0]["steps"],
            "completed": (off[0]["completed"], on[0]["completed"]),
        }
        rows.append(row)
        print(
            f"{name}: off {w_off:.2f} s ({row['off_events']:,} events, {row['off_steps']:,} steps), "
            f"H2O {w_on:.2f} s ({row['on_events']:,} events, {row['on_steps']:,} steps): {row['ratio']:.2f}x; "
            f"CPU {c_off:.2f} s vs {c_on:.2f} s: {row['cpu_ratio']:.2f}x",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""Sliding windows and the format switch: their cost to the simulator, each against the same
scenario without it (issue 11: they must keep decode fast-forward).

The default scenario (one hour of Azure conversations, Llama-3.1-8B on one H100) alternately
without and with ``kv.format_switch`` (bf16, then kvquant4 past 1,024 tokens), and Mistral-7B on the
same trace with a 512-token window on every layer against ``sliding_window: 0`` (every token kept);
each run in a fresh process. Prints medians of wall and CPU time, engine events, steps, preemptions
and the ratio of the medians. Usage:

    python bench/bench_window_switch.py [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from simrun import off_on

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = ROOT / "scenarios/default.yaml"
CASES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "format-switch-bf16-kvquant4@1024": (
        (),
        ("kv.format_switch.after_tokens=1024", "kv.format_switch.format=kvquant4"),
    ),
    "mistral-7b-window-512": (
        ("model.name=mistral-7b", "model.sliding_window=0"),
        ("model.name=mistral-7b", "model.sliding_window=512"),
    ),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = []
    for name, (off_args, on_args) in CASES.items():
        off, on, med = off_on(ROOT, SCENARIO, off_args, on_args, args.repeats)
        row: dict = {"case": name, **med}
        for key in ("events", "steps", "preemptions", "completed"):
            row[key] = (off[0][key], on[0][key])
        rows.append(row)
        print(
            f"{name}: off {row['off_wall_s']:.2f} s, on {row['on_wall_s']:.2f} s ({row['ratio']:.2f}x; "
            f"CPU {row['cpu_ratio']:.2f}x); events {row['events'][0]:,} / {row['events'][1]:,}, "
            f"steps {row['steps'][0]:,} / {row['steps'][1]:,}, preemptions {row['preemptions'][0]:,} / "
            f"{row['preemptions'][1]:,}",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()

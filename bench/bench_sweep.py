"""Sweep speed (issue 12): a 64-point sweep of the default scenario, on the process pool and on a
local Ray instance, against the time of one run.

Target: at most 1.2 x (64 x one run) / workers. One run is timed as `kvsim run` of the default
scenario with its report, in a fresh process, median of 3; each sweep is one fresh `kvsim sweep`.
Usage:

    python bench/bench_sweep.py [--jobs 2] [--no-ray] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = ROOT / "scenarios" / "default.yaml"
# 2 x 4 x 4 x 2 = 64 points of the default scenario.
GRID = [
    "kv.format=bf16,fp8",
    "workload.rate_scale=1,2,3,4",
    "scheduler.max_num_seqs=64,128,256,512",
    "kv.block_size=16,32",
]


def _timed(argv: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "kvsim", *argv], cwd=ROOT, check=True, capture_output=True)
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--no-ray", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    grid = [a for g in GRID for a in ("--grid", g)]
    with tempfile.TemporaryDirectory() as tmp:
        one = statistics.median(
            _timed(["run", str(SCENARIO), "--out", f"{tmp}/one{i}", "--no-progress"]) for i in range(3)
        )
        budget = 1.2 * 64 * one / args.jobs
        res = {"one_run_s": one, "jobs": args.jobs, "target_s": budget}
        print(
            f"one run (with its report): {one:.2f} s; target for 64 points on {args.jobs}: <= {budget:.1f} s"
        )
        for name, extra in (("local", []), ("ray", ["--executor", "ray"])):
            if name == "ray" and args.no_ray:
                continue
            wall = _timed(
                [
                    "sweep",
                    str(SCENARIO),
                    *grid,
                    "--out",
                    f"{tmp}/{name}",
                    "--jobs",
                    str(args.jobs),
                    "--no-progress",
                    *extra,
                ]
            )
            res[f"{name}_s"] = wall
            print(
                f"{name}: 64 points in {wall:.1f} s ({64 * one / wall:.2f}x one-at-a-time; target met: {wall <= budget})"
            )
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One simulation in a fresh process (so its peak RSS is its own), for the benchmark scripts.

`run_child(tree, scenario, *overrides)` runs `kvsim` from checkout `tree` (its own package, not the
installed one, so an earlier commit's worktree can be measured beside this one) and returns wall
and CPU seconds (CPU time is steadier on a shared machine), engine events, steps, requests,
preemptions, simulated seconds and peak RSS.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = """
import json, resource, sys, time
try:
    from kvsim.scenario import load_scenario  # before the restructure
except ImportError:
    from kvsim.spec.scenario import load_scenario
from kvsim.run import run_scenario
sc = load_scenario(sys.argv[1], sys.argv[2:])
t, c = time.perf_counter(), time.process_time()
r = run_scenario(sc)
wall, cpu = time.perf_counter() - t, time.process_time() - c
s = r.summary
print(json.dumps({"wall_s": wall, "cpu_s": cpu, "events": s["engine_events"], "steps": s["steps"],
                  "requests": s["requests"]["total"], "completed": s["requests"]["completed"],
                  "preemptions": s["preemptions"], "simulated_s": s["simulated_s"],
                  "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def run_child(tree: Path, scenario: Path | str, *overrides: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(scenario), *overrides],
        cwd=tree,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def off_on(
    tree: Path, scenario: Path | str, off: tuple[str, ...], on: tuple[str, ...], repeats: int
) -> tuple[list[dict[str, float]], list[dict[str, float]], dict[str, float]]:
    """`repeats` runs of `scenario` alternately with overrides `off` and `on`, each in a fresh
    process; returns both lists of runs and the medians of wall and CPU seconds (``off_wall_s``,
    ``on_wall_s``, ``off_cpu_s``, ``on_cpu_s``) with their ratios (``ratio``, ``cpu_ratio``)."""
    runs_off: list[dict[str, float]] = []
    runs_on: list[dict[str, float]] = []
    for _ in range(repeats):
        runs_off.append(run_child(tree, scenario, *off))
        runs_on.append(run_child(tree, scenario, *on))
    med: dict[str, float] = {}
    for key in ("wall_s", "cpu_s"):
        med[f"off_{key}"] = statistics.median(r[key] for r in runs_off)
        med[f"on_{key}"] = statistics.median(r[key] for r in runs_on)
    med["ratio"] = med["on_wall_s"] / med["off_wall_s"]
    med["cpu_ratio"] = med["on_cpu_s"] / med["off_cpu_s"]
    return runs_off, runs_on, med

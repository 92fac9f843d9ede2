"""One simulation in a fresh process (so its peak RSS is its own), for the benchmark scripts.

`run_child(tree, scenario, *overrides)` runs `kvsim` from checkout `tree` (its own package, not the
installed one, so an earlier commit's worktree can be measured beside this one) and returns wall
and CPU seconds (CPU time is steadier on a shared machine), engine events, steps, requests,
preemptions, simulated seconds and peak RSS.
"""

from __future__ import annotations

import json
import os
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

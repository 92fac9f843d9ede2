"""Golden outputs: small scenarios whose ``summary.json`` and ``requests.csv`` a test pins.

Regenerate only on purpose, in a commit that says why::

    python tests/goldens/goldens.py --regen

The comparison ignores what depends on the machine (wall time, simulation speed), the simulator's
own event count, and the
checkout's location (the trace and profile paths are reduced to file names). Every key of a golden
summary must be present and equal (floats to a relative 1e-9, so that reordering a sum does not
count as a change); keys added later do not fail the test, renamed or moved ones do.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SCENARIOS = HERE / "scenarios"
EXPECTED = HERE / "expected"
# What measures the simulator rather than the simulated cluster: wall time, speed, and the number of
# engine events (fast-forward windows, which speed work changes on purpose; steps are pinned).
VOLATILE = ("wall_s", "sim_speed_x", "engine_events")
REL_TOL = 1e-9


def golden_names() -> list[str]:
    return sorted(p.stem for p in SCENARIOS.glob("*.yaml"))


def normalise(summary: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in summary.items() if k not in VOLATILE}
    cfg = dict(out.get("config", {}))
    for key in ("trace", "profile", "scenario_path"):
        if isinstance(cfg.get(key), str):
            cfg[key] = Path(cfg[key]).name
    out["config"] = cfg
    return out


def produce(name: str, out_dir: Path) -> tuple[dict[str, Any], list[list[str]]]:
    """Run golden `name` in-process and write its run directory; returns (summary, csv rows)."""
    sys.path.insert(0, str(HERE.parent.parent))
    from kvsim.run import run_scenario, write_run
    from kvsim.spec.scenario import load_scenario

    result = run_scenario(load_scenario(SCENARIOS / f"{name}.yaml"))
    write_run(result, out_dir)
    summary = json.loads((out_dir / "summary.json").read_text())
    with (out_dir / "requests.csv").open() as f:
        rows = list(csv.reader(f))
    return normalise(summary), rows


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if isinstance(a, float) and math.isnan(a):
            return isinstance(b, float) and math.isnan(b)
        return math.isclose(a, b, rel_tol=REL_TOL, abs_tol=1e-12)
    return a == b


def diff_summary(golden: Any, got: Any, path: str = "") -> list[str]:
    """Where `got` differs from `golden` (keys only in `got` are allowed)."""
    if isinstance(golden, dict):
        if not isinstance(got, dict):
            return [f"{path or '.'}: expected a mapping, got {got!r}"]
        out: list[str] = []
        for k, v in golden.items():
            p = f"{path}.{k}" if path else k
            if k not in got:
                out.append(f"{p}: missing")
            else:
                out.extend(diff_summary(v, got[k], p))
        return out
    if isinstance(golden, list):
        if not isinstance(got, list) or len(got) != len(golden):
            return [f"{path}: expected {golden!r}, got {got!r}"]
        return [
            d
            for i, (a, b) in enumerate(zip(golden, got, strict=True))
            for d in diff_summary(a, b, f"{path}[{i}]")
        ]
    return [] if _close(golden, got) else [f"{path}: expected {golden!r}, got {got!r}"]


def _cell(text: str) -> Any:
    try:
        return float(text)
    except ValueError:
        return text


def diff_rows(golden: list[list[str]], got: list[list[str]]) -> list[str]:
    out = []
    if golden[:1] != got[:1]:
        return [f"header: expected {golden[:1]}, got {got[:1]}"]
    if len(golden) != len(got):
        out.append(f"rows: expected {len(golden) - 1}, got {len(got) - 1}")
    header = golden[0]
    for i, (a, b) in enumerate(zip(golden[1:], got[1:], strict=False), start=1):
        for col, x, y in zip(header, a, b, strict=True):
            if not _close(_cell(x), _cell(y)):
                out.append(f"row {i} ({col}): expected {x!r}, got {y!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--regen", action="store_true", help="rewrite the expected outputs")
    ap.add_argument("names", nargs="*", help="goldens to regenerate (default: all)")
    args = ap.parse_args(argv)
    if not args.regen:
        ap.error("nothing to do: pass --regen to rewrite the expected outputs (the test compares them)")
    import tempfile

    for name in args.names or golden_names():
        with tempfile.TemporaryDirectory() as tmp:
            summary, rows = produce(name, Path(tmp))
        dest = EXPECTED / name
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        with (dest / "requests.csv").open("w", newline="") as f:
            csv.writer(f).writerows(rows)
        print(f"wrote {dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

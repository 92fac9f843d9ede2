"""A sweep from definition to results table: validate every point, resume, run, tabulate.

`prepare_sweep` expands the factors and loads every point's scenario (the same validation as
``kvsim run --set``) before anything runs or is written; the first bad value raises one
`KvsimError` naming the axis and the value. `resumable` compares an existing ``DIR/sweep.json``
with the new definition. `run_sweep` writes the manifest, reuses finished points, runs the rest
(`kvsim.sweep.local`) and writes ``results.csv``. Building the HTML page is the report layer's
(`kvsim.report.sweep`); the CLI joins the two.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Hashable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from kvsim.errors import KvsimError
from kvsim.progress import PointProgress
from kvsim.results.record import read_summary
from kvsim.spec.scenario import load_scenario
from kvsim.sweep.define import Factor, SweepPoint, expand
from kvsim.sweep.local import BeforePoint, Finish, PointTask, run_points, workload_key
from kvsim.sweep.table import (
    PointResult,
    manifest,
    metrics_of,
    read_manifest,
    results_csv,
    results_parquet,
    swept_paths,
)

MANIFEST = "sweep.json"
RESULTS = "results.csv"
RESULTS_PARQUET = "results.parquet"  # the same table, typed, where pyarrow is installed
POINTS = "points"


@dataclass(frozen=True)
class SweepPlan:
    scenario: Path
    factors: tuple[Factor, ...]
    points: tuple[SweepPoint, ...]
    keys: tuple[Hashable, ...]  # each point's workload key
    reads: tuple[tuple[str, Path | None], ...]  # files the points read, never to be written over


@dataclass(frozen=True)
class SweepOutcome:
    plan: SweepPlan
    results: tuple[PointResult, ...]  # in point order
    reused: int  # points taken from an earlier, interrupted run
    parquet: bool = False  # results.parquet written (pyarrow installed)

    @property
    def failed(self) -> int:
        return sum(r.status != "ok" for r in self.results)


def _blame(point: SweepPoint, exc: KvsimError) -> str | None:
    """The override of `point` an error is about (by its field path), as ``--grid path=value``."""
    source = exc.source or ""
    field = exc.path or (source.removeprefix("--set ").strip() if source.startswith("--set ") else "")
    if not field or not ("(--set)" in source or source.startswith("--set")):
        return None  # the scenario itself, not a swept value
    for override, origin in zip(point.overrides, point.origins, strict=True):
        p = override.split("=", 1)[0]
        if field == p or field.startswith(p + ".") or p.startswith(field + "."):
            if origin.startswith("--"):
                return f"{origin.split(' ', 1)[0]} {override}"
            return f"{origin}: {override}"
    return f"point {point.id}"


def _loads(scenario: str) -> bool:
    try:
        load_scenario(scenario)
    except KvsimError:
        return False
    return True


def prepare_sweep(scenario: str, factors: list[Factor]) -> SweepPlan:
    points = expand(factors)
    keys: list[Hashable] = []
    reads: dict[str, tuple[str, Path | None]] = {}
    for p in points:
        try:
            sc = load_scenario(scenario, p.overrides)
        except KvsimError as exc:
            blame = _blame(p, exc)
            if blame is None and p.overrides and _loads(scenario):
                blame = f"point {p.index} ({', '.join(p.overrides)})"  # values valid alone, not together
            if blame is None:
                raise
            raise KvsimError(str(exc), source=blame) from None
        keys.append(workload_key(sc))
        for what, path in (
            ("trace", sc.workload.trace),
            ("model config", sc.model.config_path),
            ("profile", sc.cost_model.profile),
        ):
            if path is not None:
                reads.setdefault(str(path), (what, path))
    path = Path(scenario)
    return SweepPlan(path, tuple(factors), tuple(points), tuple(keys), (("scenario", path), *reads.values()))


def refuse_foreign_points(out: Path, manifest_name: str, what: str, *, force: bool) -> None:
    """A ``points`` folder with no manifest beside it is not kvsim's: refused unless `force`."""
    if (out / POINTS).exists() and not force:
        raise KvsimError(
            f"{out / POINTS} exists but {out / manifest_name} does not: not a kvsim {what}; use --force",
            source="--out",
        )


def resumable(plan: SweepPlan, out: Path, *, force: bool) -> bool:
    """Whether the run directories under `out` may be reused: there is a manifest for the same
    scenario file (path and content). A manifest of a different sweep is refused unless `force`;
    so is a ``points`` folder with no manifest beside it."""
    old = read_manifest(out / MANIFEST) if (out / MANIFEST).is_file() else None
    if old is None:
        refuse_foreign_points(out, MANIFEST, "sweep", force=force)
        return False
    new = manifest(plan.scenario, plan.factors, plan.points)
    if old.get("scenario") != new["scenario"] or old.get("scenario_sha256") != new["scenario_sha256"]:
        what = "scenario file" if old.get("scenario") != new["scenario"] else "scenario content"
    elif old.get("points") != new["points"]:
        what = "set of points"
    else:
        return True
    if not force:
        raise KvsimError(
            f"{out / MANIFEST} is a sweep with a different {what}; use --force to replace it, or another --out",
            source="--out",
        )
    return bool(
        old.get("scenario_sha256") == new["scenario_sha256"] and old.get("scenario") == new["scenario"]
    )


def finished_result(overrides: tuple[str, ...], run_dir: Path, index: int = 0) -> PointResult | None:
    """A point's result from its run directory, when it holds a summary for these overrides (a
    sweep's resume, a plan's reuse of points already run)."""
    if not (run_dir / "summary.json").is_file():
        return None
    try:
        summary = read_summary(run_dir)
    except KvsimError:
        return None
    if tuple(summary.config.overrides) != overrides:
        return None
    return PointResult(index, "ok", "", metrics_of(summary))


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file, so a reader never sees half of it."""
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def run_sweep(
    plan: SweepPlan,
    out: Path,
    *,
    jobs: int,
    reuse: bool,
    finish: Finish | None = None,
    before_point: BeforePoint | None = None,
    progress: bool = False,
    executor: str = "local",
    ray_address: str | None = None,
) -> SweepOutcome:
    """Run `plan` into `out` (already checked); `reuse`: from `resumable`. `progress`: on stderr, a
    bar on a terminal, a line per finished point when piped (`kvsim.progress`). `executor`: ``local`` (processes on
    this machine) or ``ray`` (`kvsim.sweep.ray_executor`, at `ray_address` or a local instance)."""
    points_dir = out / POINTS
    points_dir.mkdir(parents=True, exist_ok=True)
    old = read_manifest(out / MANIFEST) if (out / MANIFEST).is_file() else None
    ours = {p.id for p in plan.points}
    if old is not None:  # points of a replaced definition: kvsim wrote them, so it removes them
        for entry in old["points"]:
            name = entry.get("id") if isinstance(entry, dict) else None
            if isinstance(name, str) and name not in ours and "/" not in name and name not in ("", ".", ".."):
                shutil.rmtree(points_dir / name, ignore_errors=True)
    write_atomic(
        out / MANIFEST, json.dumps(manifest(plan.scenario, plan.factors, plan.points), indent=2) + "\n"
    )
    done: list[PointResult] = []
    tasks: list[PointTask] = []
    keys: list[Hashable] = []
    for p, key in zip(plan.points, plan.keys, strict=True):
        prior = finished_result(p.overrides, points_dir / p.id, p.index) if reuse else None
        if prior is not None:
            done.append(prior)
        else:
            tasks.append(PointTask(p.index, str(plan.scenario), p.overrides, points_dir / p.id))
            keys.append(key)
    display = PointProgress(len(tasks), reused=len(done)) if progress and tasks else None
    labels = {t.index: ", ".join(t.overrides) for t in tasks}

    def advance(r: PointResult) -> None:
        assert display is not None
        display.finished(labels[r.index], r.status == "ok")

    try:
        if executor == "ray":
            from kvsim.sweep.ray_executor import run_points_ray

            execute: Any = partial(run_points_ray, address=ray_address)
        else:
            execute = run_points
        ran = execute(
            tasks,
            keys,
            jobs=jobs,
            finish=finish,
            before_point=before_point,
            on_started=display.start if display else None,
            on_result=advance if display else None,
        )
    finally:
        if display is not None:
            display.stop()
    results = sorted([*done, *ran], key=lambda r: r.index)
    text = results_csv(swept_paths(plan.factors), plan.points, results)
    write_atomic(out / RESULTS, text)
    parquet = results_parquet(out / RESULTS_PARQUET, text)
    return SweepOutcome(plan, tuple(results), len(done), parquet)

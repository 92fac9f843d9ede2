"""The local executor: a sweep's points in worker processes on this machine.

`run_points` runs tasks with ``concurrent.futures.ProcessPoolExecutor`` (``jobs`` workers), or in
this process when ``jobs`` is 1. Each worker holds one `PointRunner`, which keeps the workloads it
has read (a few, by workload configuration and seed) and the cost models it has built (a measured
profile is parsed once), so that the points of one worker sharing a trace or a profile read it once; tasks are handed out grouped by workload so that neighbours share it.

A point runs into ``points/.<id>.partial`` and is renamed to ``points/<id>`` only when its
summary, tables and report are all written: a point directory is complete or absent, which is what
resuming relies on. A `KvsimError` or any other exception in one point becomes that point's
error; it never stops the others.
"""

from __future__ import annotations

import shutil
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from kvsim.costs.base import CostModel
from kvsim.errors import KvsimError
from kvsim.run import cost_model_key, make_cost_model, run_scenario, scenario_workload, write_run
from kvsim.spec.scenario import Scenario, load_scenario
from kvsim.spec.workload import Workload
from kvsim.sweep.table import PointResult, metrics_of

WORKLOADS_KEPT = 2  # parsed workloads a worker keeps; a large trace is hundreds of MB in memory
MAX_ERROR = 400  # characters of an error kept in results.csv
COST_MODELS_KEPT = 8  # cost models a worker keeps (a measured profile is a few MB parsed)

# What to do with a written run directory (the CLI passes kvsim.report.write_report), and a
# callable run before each point (tests inject failures with it). Both must pickle by name.
Finish = Callable[[Path], object]
BeforePoint = Callable[[int, tuple[str, ...]], None]


@dataclass(frozen=True)
class PointTask:
    index: int
    scenario: str
    overrides: tuple[str, ...]
    out_dir: Path  # the final points/<id>


def workload_key(sc: Scenario) -> Hashable:
    """Points with equal keys read the same workload."""
    return (sc.workload, sc.sim.seed)


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_ERROR else text[: MAX_ERROR - 3] + "..."


class PointRunner:
    """Runs one point at a time, keeping the last few workloads it read."""

    def __init__(self, finish: Finish | None = None, before_point: BeforePoint | None = None) -> None:
        self._finish = finish
        self._before = before_point
        self._workloads: OrderedDict[Hashable, Workload] = OrderedDict()
        self.workload_reads = 0
        # Cost models (a measured profile is parsed once per worker); pricing has no side effects,
        # so points can share one. Warnings come from what each run recorded, not from the model.
        self._costs: OrderedDict[Hashable, CostModel] = OrderedDict()
        self.cost_models_built = 0

    def _cost(self, sc: Scenario) -> CostModel:
        key = cost_model_key(sc)
        try:
            cm = self._costs.get(key)
        except TypeError:  # a spec that does not hash (never seen): build it for this point alone
            return make_cost_model(sc)
        if cm is None:
            cm = make_cost_model(sc)
            self.cost_models_built += 1
            self._costs[key] = cm
            while len(self._costs) > COST_MODELS_KEPT:
                self._costs.popitem(last=False)
        else:
            self._costs.move_to_end(key)
        return cm

    def _workload(self, sc: Scenario) -> Workload:
        key = workload_key(sc)
        wl = self._workloads.get(key)
        if wl is None:
            wl = scenario_workload(sc)
            self.workload_reads += 1
            self._workloads[key] = wl
            while len(self._workloads) > WORKLOADS_KEPT:
                self._workloads.popitem(last=False)
        else:
            self._workloads.move_to_end(key)
        return wl

    def __call__(self, task: PointTask) -> PointResult:
        partial = task.out_dir.with_name(f".{task.out_dir.name}.partial")
        try:
            if self._before is not None:
                self._before(task.index, task.overrides)
            sc = load_scenario(task.scenario, task.overrides)
            result = run_scenario(sc, workload=self._workload(sc), cost=self._cost(sc))
            if partial.exists():
                shutil.rmtree(partial)
            write_run(result, partial, compress=True)  # a point's CSVs as .csv.gz
            if self._finish is not None:
                self._finish(partial)
            if task.out_dir.exists():
                shutil.rmtree(task.out_dir)
            partial.rename(task.out_dir)
            return PointResult(task.index, "ok", "", metrics_of(result.record))
        except KvsimError as exc:
            error = str(exc)
        except Exception as exc:  # a defect in kvsim: recorded, the sweep goes on
            error = f"internal error: {type(exc).__name__}: {exc}"
        shutil.rmtree(partial, ignore_errors=True)
        return PointResult(task.index, "failed", _one_line(error), {})


# The worker process's runner, set once by the pool's initializer (one per process, never shared).
_WORKER: PointRunner | None = None


def _init_worker(finish: Finish | None, before_point: BeforePoint | None) -> None:
    global _WORKER
    _WORKER = PointRunner(finish, before_point)


def _run_in_worker(task: PointTask) -> PointResult:
    assert _WORKER is not None, "worker not initialised"
    return _WORKER(task)


def run_points(
    tasks: Sequence[PointTask],
    keys: Sequence[Hashable],
    *,
    jobs: int,
    finish: Finish | None = None,
    before_point: BeforePoint | None = None,
    on_started: Callable[[], None] | None = None,
    on_result: Callable[[PointResult], None] | None = None,
) -> list[PointResult]:
    """Run `tasks` (`keys`: each task's workload key) on `jobs` processes; results in task order.
    `on_started` is called once the workers exist (a progress display's threads must not be
    forked into them), `on_result` as each point ends."""
    first: dict[Hashable, int] = {}
    for k in keys:
        first.setdefault(k, len(first))
    order = sorted(range(len(tasks)), key=lambda i: (first[keys[i]], i))
    results: dict[int, PointResult] = {}

    def record(r: PointResult) -> None:
        results[r.index] = r
        if on_result is not None:
            on_result(r)

    if jobs <= 1 or len(tasks) <= 1:
        runner = PointRunner(finish, before_point)
        if on_started is not None:
            on_started()
        for i in order:
            record(runner(tasks[i]))
    else:
        with ProcessPoolExecutor(
            max_workers=min(jobs, len(tasks)), initializer=_init_worker, initargs=(finish, before_point)
        ) as pool:
            index_of: dict[Future[PointResult], int] = {
                pool.submit(_run_in_worker, tasks[i]): tasks[i].index for i in order
            }
            pending = set(index_of)
            if on_started is not None:
                on_started()
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    try:
                        record(fut.result())
                    except Exception as exc:  # the worker died (killed, out of memory): that point failed
                        error = f"internal error: worker process lost: {type(exc).__name__}: {exc}"
                        record(PointResult(index_of[fut], "failed", _one_line(error), {}))
    return [results[t.index] for t in tasks]

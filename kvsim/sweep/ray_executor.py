"""The Ray executor: a sweep's points on a Ray cluster (``kvsim sweep --executor ray``).

`run_points_ray` has `kvsim.sweep.local.run_points`'s contract (results in task order, a failure
in one point recorded and the rest going on). It connects with ``ray.init(address=...)``, or starts
a local Ray instance with ``jobs`` CPUs when no address is given, and runs the tasks on ``jobs``
actors, each holding one `PointRunner` (so, as with local workers, the points one actor runs share
the workloads it has parsed; tasks go out grouped by workload).

Ray is an optional extra (``pip install 'kvsim[ray]'``), imported only here and only when asked.
Every node must have kvsim installed and see the sweep's directory at the same path (a shared file
system): each point writes its own run directory, as a local worker does.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from kvsim.errors import KvsimError
from kvsim.sweep.local import BeforePoint, Finish, PointRunner, PointTask, _one_line
from kvsim.sweep.table import PointResult


def _check_address(address: str) -> None:
    """A quick TCP check of `address` (``host:port`` or ``ray://host:port``): a cluster that does
    not answer is one line here, not minutes of Ray's own retries. ``auto`` is left to Ray."""
    if address == "auto":
        return
    hostport = address.split("://", 1)[-1]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise KvsimError(
            f"expected HOST:PORT (or ray://HOST:PORT, or auto), got {address!r}", source="--ray-address"
        )
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=3.0).close()
    except OSError as exc:
        raise KvsimError(
            f"no Ray cluster answers at {address}: {exc.strerror or exc}", source="--ray-address"
        ) from None


def preflight(address: str | None) -> None:
    """Before a sweep writes anything: Ray is installed and, given an address, something answers."""
    if address:
        _check_address(address)
    _ray()


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise KvsimError(
            "needs Ray, which is not installed: pip install 'kvsim[ray]'", source="--executor ray"
        ) from None
    return ray


class _Worker:
    """One Ray actor: a `PointRunner` that keeps the workloads it has read."""

    def __init__(self, finish: Finish | None, before_point: BeforePoint | None) -> None:
        self.runner = PointRunner(finish, before_point)

    def run(self, task: PointTask) -> PointResult:
        return self.runner(task)


def run_points_ray(
    tasks: Sequence[PointTask],
    keys: Sequence[Hashable],
    *,
    jobs: int,
    address: str | None = None,
    finish: Finish | None = None,
    before_point: BeforePoint | None = None,
    on_started: Callable[[], None] | None = None,
    on_result: Callable[[PointResult], None] | None = None,
) -> list[PointResult]:
    """Run `tasks` on `jobs` Ray actors; see the module docstring."""
    if address:
        _check_address(address)
    ray = _ray()
    first: dict[Hashable, int] = {}
    for k in keys:
        first.setdefault(k, len(first))
    order = sorted(range(len(tasks)), key=lambda i: (first[keys[i]], i))
    started_here = not ray.is_initialized()
    if started_here:
        try:
            if address:
                ray.init(address=address, log_to_driver=False)
            else:
                ray.init(num_cpus=jobs, include_dashboard=False, log_to_driver=False)
        except Exception as exc:  # no cluster at that address, or Ray could not start
            where = f"at {address}" if address else "locally"
            raise KvsimError(f"cannot start or reach Ray {where}: {exc}", source="--executor ray") from None
    results: dict[int, PointResult] = {}
    try:
        actor = ray.remote(num_cpus=1)(_Worker)
        n = max(1, min(jobs, len(tasks)))
        workers = [actor.remote(finish, before_point) for _ in range(n)]
        # Contiguous runs of the workload-grouped order per actor, so neighbours share a workload.
        refs: dict[Any, int] = {}
        for slot, i in enumerate(order):
            w = workers[slot * n // max(1, len(order))]
            refs[w.run.remote(tasks[i])] = tasks[i].index
        if on_started is not None:
            on_started()
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                try:
                    r = ray.get(ref)
                except Exception as exc:  # the actor died: that point failed, the others go on
                    error = f"internal error: Ray worker lost: {type(exc).__name__}: {exc}"
                    r = PointResult(refs[ref], "failed", _one_line(error), {})
                results[r.index] = r
                if on_result is not None:
                    on_result(r)
    finally:
        if started_here:
            ray.shutdown()
    return [results[t.index] for t in tasks]

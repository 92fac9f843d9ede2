"""The autoscaler of one run (``cluster.autoscale``, `kvsim.spec.autoscale`): every interval it
reads the replicas serving, asks the policy how many it wants (Kubernetes HPA's rule), starts
replicas that take requests after the scale-up delay with a cold cache, and drains others (no new
requests; off, cache emptied, once their last request finished).

It is the router's gate (`kvsim.sim.faults.Gate`, with `FaultRouter`): a replica not serving is
closed to arrivals as a replica down is. Billing follows the replicas up (starting, serving or
draining); `replica_s` is the integral the summary's GPU-hours come from. A run without the
section builds none of this. Design: docs/architecture.md ("Autoscaling").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from enum import Enum
from typing import TYPE_CHECKING, Any

import simpy

from kvsim.sim.cluster import _ArrivalTimeout
from kvsim.sim.faults import RouterQueue
from kvsim.spec.autoscale import TOLERANCE, AutoscaleConfig, AutoscalePolicy

if TYPE_CHECKING:
    from kvsim.sim.faults import FaultRouter
    from kvsim.sim.replica import Replica


class ReplicaState(Enum):
    OFF = "off"  # not billed, not routed to, cache empty
    STARTING = "starting"  # billed; takes requests after the scale-up delay
    SERVING = "serving"
    DRAINING = "draining"  # billed; no new requests, its own finish; then off


class Autoscaler:
    """The run's replicas in and out of service, driven by its own process (`start`)."""

    def __init__(
        self,
        env: simpy.Environment,
        cfg: AutoscaleConfig,
        num_replicas: int,
        delay_s: float,
        delay_source: str,
        arrivals_left: Callable[[], float],
    ) -> None:
        """`delay_s`: a started replica's wait before it serves (`delay_source` says whence);
        `arrivals_left`: the next open-loop arrival's instant (inf: none left), so that the ticks
        stop once the trace is over and the replicas are empty."""
        self.env = env
        self.cfg = cfg
        self.delay_s = delay_s
        self.delay_source = delay_source
        self.arrivals_left = arrivals_left
        n0 = cfg.initial_replicas
        self.state = [ReplicaState.SERVING if i < n0 else ReplicaState.OFF for i in range(num_replicas)]
        self.down = [i >= n0 for i in range(num_replicas)]  # the gate: closed unless serving
        self.num_down = sum(self.down)
        self.queue = RouterQueue()  # unused while min_replicas >= 1 keeps one serving
        self.drain_s = [0.0] * num_replicas
        self.changes: list[tuple[float, int]] = [(0.0, n0)]  # (instant, +-replicas up)
        # (tick, desired) within the cool-down; the initial replicas count as one at 0, so that no
        # scale-down comes before a cool-down has passed (HPA keeps the current count until then)
        self.recommendations: list[tuple[float, int]] = [(0.0, n0)]
        self.scale_ups = 0
        self.scale_downs = 0
        self.ticks = 0
        self.next_t = cfg.interval_s  # the next tick: replicas do not run a window across it
        self.replicas: list[Replica] = []

    def start(self, replicas: list[Replica], router: FaultRouter) -> None:
        self.replicas = replicas
        self.env.process(self._run())

    def next_instant(self) -> float:
        """The next tick (inf: ticking is over)."""
        return self.next_t

    def _run(self) -> Generator[simpy.Event, Any, None]:
        env, interval = self.env, self.cfg.interval_s
        k = 1
        while True:
            t = k * interval  # a product, not a running sum: the same instants however long the run
            self.next_t = t
            if t > env.now:
                yield _ArrivalTimeout(env, t - env.now)
            if self.arrivals_left() == math.inf and not any(r.sched.num_requests for r in self.replicas):
                self.next_t = math.inf  # the work is over: no decision after it (the summary settles drains)
                return
            self._tick(t)
            k += 1

    # ---- one tick ------------------------------------------------------------------------------
    def _tick(self, t: float) -> None:
        self.ticks += 1
        self.settle_drains(t)
        st = self.state
        serving = [i for i, s in enumerate(st) if s is ReplicaState.SERVING]
        starting = sum(1 for s in st if s is ReplicaState.STARTING)
        metric = self._metric(serving)
        current = len(serving) + starting
        cfg = self.cfg
        ratio = metric / cfg.target
        if abs(ratio - 1.0) <= TOLERANCE:
            desired = current
        else:
            # HPA: ceil(current x metric / target); less a hair, so that 2 x 1.5 / 0.75 is 4, not 5
            desired = math.ceil(len(serving) * ratio - 1e-9)
        desired = max(cfg.min_replicas, min(cfg.max_replicas, desired))
        recs = self.recommendations
        recs.append((t, desired))
        while len(recs) > 1 and recs[0][0] <= t - cfg.cool_down_s:  # the current one stays
            recs.pop(0)
        stabilized = max(d for _, d in recs)  # HPA's scale-down stabilization window
        if desired > current:
            self._scale_up(t, desired - current)
        elif stabilized < current:
            self._scale_down(t, min(current - stabilized, len(serving) - 1), serving)

    def _metric(self, serving: list[int]) -> float:
        """The policy's reading at `t`, a mean over the replicas serving: the requests in one
        (running and waiting), or its KV cache usage (blocks some request references, over its
        pool's blocks, as vLLM's ``kv_cache_usage`` counts them: cached blocks no request holds are
        free). A busy-time share would read 1 whenever anything decodes, so it is not offered."""
        if not serving:
            return 0.0
        reps = self.replicas
        if self.cfg.policy is AutoscalePolicy.QUEUE:
            return sum(reps[i].sched.num_requests for i in serving) / len(serving)
        return math.fsum(
            reps[i].sched.kv.pool.num_used / reps[i].sched.kv.pool.num_blocks for i in serving
        ) / len(serving)

    def _scale_up(self, t: float, n: int) -> None:
        """Start `n` replicas that are off, lowest index first (fewer where none is off: one still
        draining keeps its place until it is off)."""
        for i in range(self.cfg.max_replicas):
            if n == 0:
                return
            if self.state[i] is ReplicaState.OFF:
                self.state[i] = ReplicaState.STARTING
                self.changes.append((t, 1))
                self.scale_ups += 1
                n -= 1
                self.env.process(self._serve_after(i, t + self.delay_s))

    def _serve_after(self, i: int, at: float) -> Generator[simpy.Event, Any, None]:
        if at > self.env.now:
            yield _ArrivalTimeout(self.env, at - self.env.now)
        self.state[i] = ReplicaState.SERVING
        self.down[i] = False
        self.num_down -= 1

    def _scale_down(self, t: float, n: int, serving: list[int]) -> None:
        """Drain `n` serving replicas, the highest index first (the newest)."""
        for i in sorted(serving, reverse=True)[: max(0, n)]:
            self.state[i] = ReplicaState.DRAINING
            self.drain_s[i] = t
            self.down[i] = True
            self.num_down += 1
            self.scale_downs += 1
        self.settle_drains(t)

    def settle_drains(self, t: float) -> None:
        """Turn off each draining replica that is empty and idle: off from its last step's end
        (or from the drain, if it was idle then), its prefix cache emptied."""
        for i, s in enumerate(self.state):
            if s is not ReplicaState.DRAINING:
                continue
            r = self.replicas[i]
            if r.sched.num_requests or r.wake is None:
                continue
            off = min(t, max(self.drain_s[i], r.clock))
            self.state[i] = ReplicaState.OFF
            self.changes.append((off, -1))
            r.sched.drop_all()  # nothing left to drop: the cache emptied (a cold start next time)

    # ---- after the run ---------------------------------------------------------------------------
    def timeline(self, simulated_s: float) -> tuple[list[float], list[int]]:
        """Replicas up from each instant on, within [0, simulated_s]: (instants, counts)."""
        ts: list[float] = []
        ns: list[int] = []
        n = 0
        for t, d in sorted(self.changes, key=lambda c: c[0]):
            if t > simulated_s:
                break
            n += d
            if ts and ts[-1] == t:
                ns[-1] = n
            else:
                ts.append(t)
                ns.append(n)
        return ts, ns

    def replica_seconds(self, simulated_s: float) -> float:
        """The integral of replicas up over [0, simulated_s] (what the run's GPUs are billed for)."""
        ts, ns = self.timeline(simulated_s)
        ends = [*ts[1:], simulated_s]
        return math.fsum(n * (b - a) for a, b, n in zip(ts, ends, ns, strict=True))

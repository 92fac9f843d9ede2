"""Faults injected into a run (``faults``, `kvsim.spec.faults`): replicas and nodes that go down at
stated times or at a seeded rate (`draw_faults`), drop their requests and come back cold after the
down time plus a weight reload.

`Faults` owns the schedule (each replica's outages, merged where they overlap), the instants a
replica must not run ahead of (`next_t`), the retry counts and the tallies the summary reads; its
process takes each replica down and up at URGENT priority, like an arrival. `FaultRouter` wraps the
run's router so that nothing is sent to a replica that is down; with every replica down, requests
wait at the router (`RouterQueue`) and go out in order when the first comes back. A run without
``faults`` builds none of this. Design: docs/architecture.md ("Faults").
"""

from __future__ import annotations

import math
from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import simpy

from kvsim.core.request import Request, RequestStatus
from kvsim.core.router import Router
from kvsim.sim.cluster import _ArrivalTimeout
from kvsim.spec.faults import FaultEvent, FaultKind, FaultsConfig, RandomFaults

if TYPE_CHECKING:
    from kvsim.sim.replica import Replica


@dataclass
class Outage:
    """One replica down from `down_s` until `up_s` (its down time, then `reload_s` of weights)."""

    replica: int
    down_s: float
    up_s: float
    reload_s: float
    requests_dropped: int = 0  # running and waiting when it went down
    kv_blocks_lost: int = 0  # blocks holding KV then: referenced, or cached and free


# Mixed into each component's seed so that the fault draws never share a stream with the workload's
# generator seeded by the same sim.seed ("faul" in ASCII).
_FAULTS_SALT = 0x6661756C
# Draws per chunk: fixed, so that a longer span draws the same first outages (a prefix) and more.
_CHUNK = 256


def draw_faults(r: RandomFaults, span_s: float, components: int) -> tuple[FaultEvent, ...]:
    """The failures of `components` replicas (or nodes) over [0, span_s), by component then time:
    each its own Poisson process at ``r.rate_per_hour`` (exponential gaps of mean 3,600 / rate s)
    with exponential down times of mean ``r.mean_down_s``, from its own Generator seeded by
    (seed, salt, component). The same seed gives the same failures, whatever the workload: a
    workload with a longer span keeps the failures of the shorter and only adds later ones."""
    if r.rate_per_hour <= 0.0 or span_s <= 0.0:
        return ()
    gap = 3600.0 / r.rate_per_hour
    out: list[FaultEvent] = []
    for j in range(components):
        rng = np.random.default_rng(np.random.SeedSequence([r.seed, _FAULTS_SALT, j]))
        t = 0.0
        while t < span_s:
            at = t + np.cumsum(rng.exponential(gap, _CHUNK))
            down = rng.exponential(r.mean_down_s, _CHUNK)
            n = int(np.searchsorted(at, span_s, side="left"))  # those at < span_s
            out.extend(
                FaultEvent(float(a), r.kind, j, float(d)) for a, d in zip(at[:n], down[:n], strict=True)
            )
            t = float(at[-1])
    return tuple(out)


def plan_outages(events: tuple[FaultEvent, ...], replicas_per_node: int, reload_s: float) -> list[Outage]:
    """Each replica's outages, by replica then time: a ``node_down`` takes every replica on its node
    (replica i sits on node i // replicas_per_node); a fault that starts before the replica is back
    (still down, or reloading) extends that outage to its own end, reload included."""
    spans: dict[int, list[tuple[float, float]]] = {}
    for ev in events:
        if ev.kind is FaultKind.REPLICA_DOWN:
            targets = [ev.target]
        else:
            targets = list(range(ev.target * replicas_per_node, (ev.target + 1) * replicas_per_node))
        for i in targets:
            spans.setdefault(i, []).append((ev.at_s, ev.at_s + ev.duration_s + reload_s))
    out: list[Outage] = []
    for i in sorted(spans):
        for start, end in sorted(spans[i]):
            if out and out[-1].replica == i and start < out[-1].up_s:
                out[-1].up_s = max(out[-1].up_s, end)
            else:
                out.append(Outage(i, start, end, reload_s))
    return out


class Submits(Protocol):
    def submit(self, seq: Request) -> None: ...

    def resubmit(self, seq: Request, t: float) -> None: ...


class RouterQueue:
    """Requests that found every replica down: they wait here, in arrival order."""

    def __init__(self) -> None:
        self.waiting: list[Request] = []
        self.peak = 0

    def submit(self, seq: Request) -> None:
        self.waiting.append(seq)
        self.peak = max(self.peak, len(self.waiting))

    def resubmit(self, seq: Request, t: float) -> None:
        self.submit(seq)


class Gate(Protocol):
    """Which replicas the router may not send to: those down (`Faults`) or off, starting or
    draining (`kvsim.sim.autoscale.Autoscaler`); with none open, requests wait in `queue`."""

    down: list[bool]
    num_down: int
    queue: RouterQueue


class FaultRouter:
    """The run's router, skipping the replicas its gate closes (`Router.choose_among`); while all
    are open, the router itself decides (its heaps, no scan)."""

    def __init__(self, router: Router, faults: Gate) -> None:
        self.router = router
        self.faults = faults

    def choose(self, seq: Request, now: float) -> Submits:
        f = self.faults
        if not f.num_down:
            return self.router.choose(seq, now)  # type: ignore[return-value]
        up = [i for i, d in enumerate(f.down) if not d]
        if not up:
            return f.queue
        return self.router.choose_among(seq, now, up)  # type: ignore[return-value]


def restart(req: Request) -> None:
    """`req` starts again from nothing (its KV and answer were lost): its stream restarts, so its
    first token is the retry's; its arrival, first schedule and first prefix hit stay."""
    req.num_computed = req.num_generated = req.evicted = req.spec_steps = 0
    req.num_tokens = req.prompt_len
    req.status = RequestStatus.WAITING
    req.first_token_s = math.nan


class Faults:
    """The fault schedule of one run, driven by its own process (`start`, once the router exists)."""

    def __init__(
        self,
        env: simpy.Environment,
        cfg: FaultsConfig,
        num_replicas: int,
        outages: list[Outage],
        drawn: tuple[FaultEvent, ...] = (),
        drawn_span_s: float = 0.0,
        num_components: int = 0,
    ):
        self.env = env
        self.cfg = cfg
        self.outages = outages
        self.drawn = drawn  # faults.random's failures (`draw_faults`), planned with cfg.events
        self.drawn_span_s = drawn_span_s  # they were drawn over [0, drawn_span_s)
        self.num_components = num_components  # replicas or nodes, each failing at the rate
        self.down = [False] * num_replicas
        self.num_down = 0
        self.queue = RouterQueue()
        self.retries: dict[int, int] = {}  # request id -> times it was dropped
        self.failed = 0
        self.requeued = 0  # drops that sent the request back through the router
        self.lost_prompt_tokens = 0  # prompt tokens whose KV was lost (computed, or hit, there)
        self.lost_output_tokens = 0  # tokens generated and lost: decoded again by the retry
        # (instant, 0 up / 1 down, outage): ups first, so requests dropped at that instant can go
        # to a replica back at it
        marks = [(o.down_s, 1, k) for k, o in enumerate(outages)] + [
            (o.up_s, 0, k) for k, o in enumerate(outages)
        ]
        self._marks = sorted(marks)
        self.next_t = self._marks[0][0] if self._marks else math.inf
        self.router: FaultRouter | None = None
        self.replicas: list[Replica] = []

    def start(self, replicas: list[Replica], router: FaultRouter) -> None:
        self.replicas, self.router = replicas, router
        self.env.process(self._run())

    def _run(self) -> Generator[simpy.Event, Any, None]:
        env = self.env
        for t, is_down, k in self._marks:
            self.next_t = t
            if t > env.now:
                yield _ArrivalTimeout(env, t - env.now)
            o = self.outages[k]
            if is_down:
                self.down[o.replica] = True
                self.num_down += 1
                self.replicas[o.replica].go_down(o)
            else:
                self.down[o.replica] = False
                self.num_down -= 1
                waiting, self.queue.waiting = self.queue.waiting, []
                for seq in waiting:
                    self.route(seq, t)
        self.next_t = math.inf

    def next_instant(self) -> float:
        """The next instant a replica goes down or comes back (inf: none left)."""
        return self.next_t

    def route(self, seq: Request, t: float) -> None:
        assert self.router is not None
        self.router.choose(seq, t).resubmit(seq, t)

    def dropped(self, o: Outage, reqs: list[Request], t: float) -> None:
        """Replica `o.replica` went down at `t` with `reqs` in it: each is counted, and restarted
        through the router, or fails past ``faults.max_retries``."""
        limit = self.cfg.max_retries
        o.requests_dropped = len(reqs)
        for r in reqs:
            self.lost_prompt_tokens += min(r.num_computed, r.prompt_len)
            self.lost_output_tokens += r.num_generated
            n = self.retries.get(r.id, 0) + 1
            self.retries[r.id] = n
            if n > limit:
                r.status = RequestStatus.FAILED
                r.reason = f"its replica went down {n} times (faults.max_retries: {limit})"
                self.failed += 1
                continue
            restart(r)
            self.requeued += 1
            self.route(r, t)

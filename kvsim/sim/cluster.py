"""The cluster around the replicas: the arrival processes that route each request at its arrival
instant (open loop: at the trace's times; closed loop: agent turns sent when the previous reply
arrives), and the factory of a replica's pool and scheduler. Design: docs/architecture.md ("The
run, assembled")."""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from typing import Any, Protocol

import numpy as np
import simpy
from simpy.events import URGENT

from kvsim.core.eviction import Eviction
from kvsim.core.kv_cache_manager import KVCacheManager
from kvsim.core.request import Request, RequestStatus
from kvsim.core.sched.scheduler import Scheduler
from kvsim.core.spec_decode import SpecDecoder
from kvsim.core.tiers import SwapDecider, TierLookup


class Chooser(Protocol):
    """What the arrivals send requests through: the run's `Router`, or with faults the router
    that skips replicas that are down (`kvsim.sim.faults.FaultRouter`)."""

    def choose(self, req: Request, now: float) -> Any: ...


class _ArrivalTimeout(simpy.events.Event):
    """A timeout at URGENT priority: an arrival at the same instant as a step's end is seen first,
    so that "the steps that ended strictly before an arrival" is one rule whether the replica
    steps one by one or fast-forwards (`kvsim.core.horizon.steps_before`)."""

    def __init__(self, env: simpy.Environment, delay: float) -> None:
        super().__init__(env)
        self._ok = True
        self._value = None
        env.schedule(self, URGENT, delay)


class NextArrival:
    """The instant of the next open-loop arrival not yet routed (inf: none left), known in advance
    from the trace: a replica runs the steps that end strictly before it without an engine event
    (`kvsim.sim.replica.Replica`), since only an arrival can read or change it before then."""

    def __init__(self, first: float = math.inf) -> None:
        self.t = first

    def __call__(self) -> float:
        return self.t


def arrival_process(
    env: simpy.Environment,
    times: np.ndarray,
    make_seq: Callable[[int], Request],
    router: Chooser,
    next_arrival: NextArrival | None = None,
) -> Generator[simpy.Event, Any, None]:
    """Route request i at ``times[i]`` (s, non-decreasing); rejected ones are recorded only.
    `next_arrival` is kept at the next one's instant."""
    ts = times.tolist()
    for i, t in enumerate(ts):
        if next_arrival is not None:
            next_arrival.t = t
        if t > env.now:
            yield _ArrivalTimeout(env, t - env.now)
        seq = make_seq(i)
        if seq.status is not RequestStatus.REJECTED:  # rejected ones stay in the run's records
            router.choose(seq, t).submit(seq)
    if next_arrival is not None:
        next_arrival.t = math.inf


class ClosedLoopArrivals:
    """Agent sessions in closed loop: a session's first turn at its start time; each later turn
    `gap_s` after the previous turn's reply arrived (`on_finish`, called by the replica at the
    step's end). A rejected turn ends its session: the later turns are never sent (the summary
    counts them as not arrived). Sends at URGENT priority, like the open-loop arrivals, so a turn
    sent at the instant a step ends is seen by the router first, fast-forward or not.

    Built before the replicas (they are given `on_finish`), started once the router over them is
    (`start`)."""

    def __init__(
        self,
        env: simpy.Environment,
        gap_s: np.ndarray,
        next_request: np.ndarray,
        make_seq: Callable[[int, float], Request],
    ) -> None:
        self.env = env
        self.gap_s = gap_s.tolist()
        self.next_request = next_request.tolist()
        self.make_seq = make_seq
        self.router: Chooser | None = None

    def start(self, first_times: list[tuple[float, int]], router: Chooser) -> None:
        """Send the sessions' first turns at their (time, request index), and every turn, through
        `router`."""
        self.router = router
        self.env.process(self._starts(first_times))

    def _send(self, i: int, t: float) -> None:
        seq = self.make_seq(i, t)
        if seq.status is not RequestStatus.REJECTED:
            assert self.router is not None
            self.router.choose(seq, t).submit(seq)

    def _starts(self, first_times: list[tuple[float, int]]) -> Generator[simpy.Event, Any, None]:
        env = self.env
        for t, i in first_times:
            if t > env.now:
                yield _ArrivalTimeout(env, t - env.now)
            self._send(i, t)

    def _later(self, i: int, t: float) -> Generator[simpy.Event, Any, None]:
        # Always through an event, never sent from inside the replica's step end: the replica
        # schedules its next step first, in both modes.
        env = self.env
        yield _ArrivalTimeout(env, max(0.0, t - env.now))
        self._send(i, t)

    def on_finish(self, done: list[Request]) -> None:
        # The send time from the reply's own time (the step's end, equal in both modes), not from
        # env.now, which a fast-forward window reaches by another sum of floats.
        for seq in done:
            j = self.next_request[seq.id]
            if j >= 0:
                self.env.process(self._later(j, seq.finish_s + self.gap_s[j]))


def make_pool_and_scheduler(
    num_blocks: int,
    block_size: int,
    max_num_seqs: int,
    max_batched_tokens: int,
    chunked_prefill: bool,
    enable_caching: bool = True,
    *,
    eviction: Eviction | None = None,
    spec: SpecDecoder | None = None,
    host: TierLookup | None = None,
    swap_decider: SwapDecider | None = None,
) -> Scheduler:
    """A replica's KV cache manager and scheduler, with its token eviction (kv.eviction, sliding
    windows or a format switch), speculative decoding, the tiers below HBM it loads prefixes from
    and its swap decision (`kvsim.sim.offload`; None: off)."""
    return Scheduler(
        KVCacheManager(num_blocks, block_size, enable_caching=enable_caching, eviction=eviction),
        max_num_seqs=max_num_seqs,
        max_batched_tokens=max_batched_tokens,
        chunked_prefill=chunked_prefill,
        spec=spec,
        host=host,
        swap_decider=swap_decider,
    )

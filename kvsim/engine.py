"""The SimPy shell: replica engines that own time, a router, and the arrival process.

Each replica is one SimPy process running the scheduler's step loop; the clock advances only by
step durations from the cost model. Arrivals are routed at their arrival instant. Where nothing
can change between steps (decode-only batch, no arrival before the steps end, no completion
before the last, enough free blocks), several steps are advanced with one event; step durations
come from the same vectorised cost function and times from the same sequential sums, so results
equal stepping one by one (tests/test_engine.py checks this); only the occupancy time series, sampled
once per event, is sparser.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import simpy

from kvsim.core.block_pool import BlockPool
from kvsim.core.scheduler import Scheduler, Sequence, Status, StepPlan
from kvsim.costs import CostModel, StepBatch

MAX_FF_STEPS = 2048


@dataclass
class ReplicaStats:
    steps: int = 0
    events: int = 0
    busy_s: float = 0.0  # simulated seconds spent running steps
    samples: list[tuple[float, int, int, int, int, int, int]] = field(default_factory=list)


class Replica:
    def __init__(
        self,
        env: simpy.Environment,
        index: int,
        scheduler: Scheduler,
        cost: CostModel,
        *,
        fast_forward: bool,
        barrier: Callable[[], float],
        sample_every_s: float,
    ) -> None:
        self.env = env
        self.index = index
        self.sched = scheduler
        self.cost = cost
        self.fast_forward = fast_forward
        self.barrier = barrier  # time of the next outside event (arrival or end of simulation)
        self.sample_every_s = sample_every_s
        self.clock = 0.0
        self.wake: simpy.Event | None = None
        self.stats = ReplicaStats()
        self._next_sample = 0.0
        self.process = env.process(self.run())

    def submit(self, seq: Sequence) -> None:
        seq.replica = self.index
        self.sched.add(seq)
        if self.wake is not None and not self.wake.triggered:
            self.wake.succeed()

    def _sample(self) -> None:
        if self.clock >= self._next_sample:
            pool = self.sched.pool
            self.stats.samples.append(
                (
                    self.clock,
                    self.index,
                    pool.num_used,
                    pool.num_cached_free,
                    pool.free,
                    len(self.sched.running),
                    len(self.sched.waiting),
                )
            )
            self._next_sample = self.clock + self.sample_every_s

    def run(self):  # type: ignore[no-untyped-def]
        env = self.env
        sched = self.sched
        while True:
            plan = sched.schedule()
            if plan.empty:
                self._sample()
                self.wake = env.event()
                yield self.wake
                self.wake = None
                self.clock = env.now
                continue
            self._sample()
            start = self.clock
            if plan.decode_only:
                k, t_end = self._decode_steps(plan)
                yield env.timeout(max(0.0, t_end - env.now))
                self.clock = t_end
                done = sched.advance_decode(plan, k)
                self.stats.steps += k
                for seq in done:
                    seq.finish_s = t_end
            else:
                for seq in plan.admitted:
                    if seq.first_scheduled_s != seq.first_scheduled_s:  # NaN: first time
                        seq.first_scheduled_s = self.clock
                batch = StepBatch(
                    tuple(plan.num_new),
                    tuple(plan.ctx_before),
                    sum(
                        1
                        for s, n in zip(plan.seqs, plan.num_new, strict=True)
                        if s.num_computed + n == s.num_tokens
                    ),
                )
                t_end = self.clock + self.cost.step_time(batch)
                yield env.timeout(max(0.0, t_end - env.now))
                self.clock = t_end
                first, done = sched.complete(plan)
                self.stats.steps += 1
                for seq in first:
                    seq.first_token_s = t_end
                for seq in done:
                    seq.finish_s = t_end
            self.stats.events += 1
            self.stats.busy_s += self.clock - start

    def _decode_steps(self, plan: StepPlan) -> tuple[int, float]:
        """Steps to advance at once and the end time of the last one."""
        m = len(plan.seqs)
        if not self.fast_forward:
            sum_ctx = np.array([sum(plan.ctx_before)], dtype=np.int64)
            d = self.cost.decode_step_times(m, sum_ctx)
            self.cost.observe_decode(m, sum_ctx)
            return 1, float(np.cumsum(np.concatenate(([self.clock], d)))[-1])
        k, sum_ctx = self.sched.decode_horizon(plan, MAX_FF_STEPS)
        d = self.cost.decode_step_times(m, sum_ctx)
        ends = np.cumsum(np.concatenate(([self.clock], d)))[1:]
        barrier = self.barrier()
        # Only steps that end strictly before the next outside event; always at least one.
        k = max(1, min(k, int(np.searchsorted(ends, barrier, side="left"))))
        self.cost.observe_decode(m, sum_ctx[:k])
        return k, float(ends[k - 1])


class Router:
    """Chooses a replica for each arriving request."""

    def __init__(self, policy: str, replicas: list[Replica]) -> None:
        self.policy = policy
        self.replicas = replicas
        self._rr = 0

    def choose(self, seq: Sequence) -> Replica:
        reps = self.replicas
        if len(reps) == 1:
            return reps[0]
        if self.policy == "round_robin":
            r = reps[self._rr % len(reps)]
            self._rr += 1
            return r
        if self.policy == "prefix_affinity" and seq.keys:
            # Longest cached prefix wins; ties (and no hit anywhere) go to the least loaded.
            best = max(
                range(len(reps)),
                key=lambda i: (
                    reps[i].sched.pool.num_prefix_hits(seq.keys),
                    -reps[i].sched.outstanding_tokens,
                    -i,
                ),
            )
            if reps[best].sched.pool.num_prefix_hits(seq.keys) > 0:
                return reps[best]
        return min(reps, key=lambda r: (r.sched.outstanding_tokens, r.index))


@dataclass
class ArrivalFeed:
    """Arrival times and the process that routes each request at its arrival instant."""

    times: np.ndarray
    end_s: float
    cursor: int = 0

    def next_time(self) -> float:
        return float(self.times[self.cursor]) if self.cursor < len(self.times) else self.end_s


def arrival_process(
    env: simpy.Environment,
    feed: ArrivalFeed,
    make_seq: Callable[[int], Sequence],
    router: Router,
):  # type: ignore[no-untyped-def]
    n = len(feed.times)
    while feed.cursor < n:
        t = float(feed.times[feed.cursor])
        if t > env.now:
            yield env.timeout(t - env.now)
        i = feed.cursor
        feed.cursor += 1
        seq = make_seq(i)
        if seq.status is not Status.REJECTED:  # rejected ones stay in the run's records
            router.choose(seq).submit(seq)


def make_pool_and_scheduler(
    num_blocks: int, block_size: int, max_num_seqs: int, max_batched_tokens: int, chunked_prefill: bool
) -> Scheduler:
    return Scheduler(
        BlockPool(num_blocks),
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_batched_tokens=max_batched_tokens,
        chunked_prefill=chunked_prefill,
    )

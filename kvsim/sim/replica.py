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

from kvsim.core.request import Request
from kvsim.core.sched.scheduler import Scheduler, StepPlan
from kvsim.costs.base import CostModel, ForwardBatch, SeqKind

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
        self.off_grid: set[str] = set()  # the cost model's flags of the steps this replica ran
        self._next_sample = 0.0
        self.process = env.process(self.run())

    def submit(self, seq: Request) -> None:
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
                # -- cost: price the step that runs, and record its off-grid flags --
                batch = ForwardBatch(
                    tuple(
                        SeqKind.DECODE if s.num_generated > 0 and n == 1 else SeqKind.PREFILL
                        for s, n in zip(plan.seqs, plan.num_new, strict=True)
                    ),
                    tuple(plan.num_new),
                    tuple(plan.ctx_before),
                    sum(
                        1
                        for s, n in zip(plan.seqs, plan.num_new, strict=True)
                        if s.num_computed + n == s.num_tokens
                    ),
                )
                price = self.cost.price(batch)
                self.off_grid |= price.off_grid
                t_end = self.clock + price.seconds
                # -- end cost --
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
            self.off_grid |= self.cost.decode_off_grid(m, sum_ctx)  # cost: what ran
            return 1, float(np.cumsum(np.concatenate(([self.clock], d)))[-1])
        k, sum_ctx = self.sched.decode_horizon(plan, MAX_FF_STEPS)
        d = self.cost.decode_step_times(m, sum_ctx)
        ends = np.cumsum(np.concatenate(([self.clock], d)))[1:]
        barrier = self.barrier()
        # Only steps that end strictly before the next outside event; always at least one.
        k = max(1, min(k, int(np.searchsorted(ends, barrier, side="left"))))
        self.off_grid |= self.cost.decode_off_grid(m, sum_ctx[:k])  # cost: only the steps that run
        return k, float(ends[k - 1])

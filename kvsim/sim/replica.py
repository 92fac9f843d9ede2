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
from kvsim.costs.base import CostModel, StepBatch

MAX_FF_STEPS = 2048


@dataclass
class ReplicaStats:
    steps: int = 0
    events: int = 0
    busy_s: float = 0.0  # simulated seconds spent running steps
    # Integral of KV blocks in use (referenced by some request) over simulated time, block-seconds:
    # the per-replica mean KV use in the summary. Summed step by step in the same order with and
    # without fast-forward, so both give the same number.
    kv_block_s: float = 0.0
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
                idle_used = sched.pool.num_used
                self.wake = env.event()
                yield self.wake
                self.wake = None
                self.stats.kv_block_s += idle_used * (env.now - self.clock)
                self.clock = env.now
                continue
            self._sample()
            start = self.clock
            if plan.decode_only:
                k, t_end, block_s = self._decode_steps(plan)
                yield env.timeout(max(0.0, t_end - env.now))
                self.clock = t_end
                self.stats.kv_block_s = float(
                    np.cumsum(np.concatenate(([self.stats.kv_block_s], block_s)))[-1]
                )
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
                dt = self.cost.step_time(batch)
                t_end = self.clock + dt
                used = sched.pool.num_used  # allocated by schedule(), held through the step
                yield env.timeout(max(0.0, t_end - env.now))
                self.clock = t_end
                self.stats.kv_block_s += used * dt
                first, done = sched.complete(plan)
                self.stats.steps += 1
                for seq in first:
                    seq.first_token_s = t_end
                for seq in done:
                    seq.finish_s = t_end
            self.stats.events += 1
            self.stats.busy_s += self.clock - start

    def _decode_steps(self, plan: StepPlan) -> tuple[int, float, np.ndarray]:
        """Steps to advance at once, the end time of the last one, and each step's KV block-seconds."""
        m = len(plan.seqs)
        used0 = self.sched.pool.num_used
        if not self.fast_forward:
            sum_ctx = np.array([sum(plan.ctx_before)], dtype=np.int64)
            d = self.cost.decode_step_times(m, sum_ctx)
            self.cost.observe_decode(m, sum_ctx)
            return 1, float(np.cumsum(np.concatenate(([self.clock], d)))[-1]), used0 * d
        k, sum_ctx = self.sched.decode_horizon(plan, MAX_FF_STEPS)
        d = self.cost.decode_step_times(m, sum_ctx)
        ends = np.cumsum(np.concatenate(([self.clock], d)))[1:]
        barrier = self.barrier()
        # Only steps that end strictly before the next outside event; always at least one.
        k = max(1, min(k, int(np.searchsorted(ends, barrier, side="left"))))
        self.cost.observe_decode(m, sum_ctx[:k])
        used = _decode_used_blocks(plan.seqs, used0, self.sched.block_size, k)
        return k, float(ends[k - 1]), used * d[:k]


def _decode_used_blocks(seqs: list[Request], used0: int, block_size: int, k: int) -> np.ndarray:
    """(k,) int64: blocks in use during each of k decode-only steps that start with `used0` in use.

    Step j writes token num_computed + j, so a sequence takes a new block at step
    nblocks * block_size - num_computed (>= 1: step 0's blocks are held) and every block_size steps
    after; the blocks taken through step j are what ``Scheduler.advance_decode`` allocates.
    """
    first = np.fromiter((s.nblocks * block_size - s.num_computed for s in seqs), np.int64, len(seqs))
    first = first[first < k]
    rows = -(-k // block_size)
    # Crossings of one sequence fall in one column of a (rows, block_size) layout of the steps,
    # from its first row on: count first crossings per cell, then carry them down the rows.
    starts = np.bincount(first, minlength=rows * block_size).reshape(rows, block_size)
    new_at = np.cumsum(starts, axis=0).ravel()[:k]
    return used0 + np.cumsum(new_at)

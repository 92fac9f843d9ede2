"""A replica: one SimPy process running the scheduler's step loop; the clock advances only by step
durations from the cost model.

Fast-forward: where nothing can change between steps (a decode-only batch, no completion before
the last step, blocks enough: `kvsim.core.horizon`), several steps are advanced as one event.
Step durations come from the same vectorised cost function and times from the same sequential
sums, so results equal stepping one by one (tests/test_engine.py and the property tests check
this). An arrival routed here mid-window cuts the window after the step it lands in (`submit`),
exactly where stepping would first see it; arrivals routed elsewhere leave it alone, and the router
reads this replica's state at any instant in closed form (`outstanding_tokens_at`): inside a
decode-only window only the computed-token counts move, one per request per step. The prefix cache
changes inside a window only when the window evicts cached entries; then a read of it first applies
the steps that ended and takes the blocks of the step in flight (`_apply_ended_steps`), as stepping
has. Arrivals come first at an instant shared with a step's end (`kvsim.sim.cluster`), in both
modes. So engine events grow with the requests, not with requests x replicas.
Only the occupancy time series, sampled once per event, is sparser than stepping's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import simpy

from kvsim.core.horizon import decode_window, steps_before
from kvsim.core.request import Request
from kvsim.core.sched.output import SchedulerOutput
from kvsim.core.sched.scheduler import Scheduler
from kvsim.costs.base import CostModel, ForwardBatch

MAX_FF_STEPS = 2048


@dataclass
class ReplicaStats:
    steps: int = 0
    events: int = 0
    busy_s: float = 0.0  # simulated seconds spent running steps
    idle_s: float = 0.0  # simulated seconds waiting for work, up to the last step's end
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
        next_outside_event: Callable[[], float],
        sample_every_s: float,
    ) -> None:
        self.env = env
        self.index = index
        self.sched = scheduler
        self.cost = cost
        self.fast_forward = fast_forward
        self.next_outside_event = next_outside_event  # cluster-level: the end of the simulation, for now
        self.sample_every_s = sample_every_s
        self.clock = 0.0
        self.wake: simpy.Event | None = None
        self.stats = ReplicaStats()
        self.off_grid: set[str] = set()  # the cost model's flags of the steps this replica ran
        self._next_sample = 0.0
        self._win_ends: list[float] | None = None  # end times of the decode window in flight
        self._win_k = 0  # steps of it that will run
        self._win_m = 0  # requests in it
        self._win_plan: SchedulerOutput | None = None
        self._win_applied = 0  # steps of it already applied (the router read this replica mid-window)
        self._win_evicts = False  # whether it evicts cached entries (then reads apply ended steps)
        self.process = env.process(self.run())

    # ---- what the router reads ---------------------------------------------------------------------
    def outstanding_tokens_at(self, t: float) -> int:
        """Tokens still to compute at time `t`, steps of the current window that ended before `t`
        taken off (each computes one token per running request)."""
        ends = self._win_ends
        if ends is None:
            return self.sched.outstanding_tokens
        done = steps_before(ends, t, self._win_k) - self._win_applied
        return self.sched.outstanding_tokens - self._win_m * done

    @property
    def num_requests(self) -> int:
        return self.sched.num_requests

    def num_prefix_hits(self, keys: list[int]) -> int:
        if self._win_evicts and self._win_ends is not None:
            self._apply_ended_steps(self.env.now)  # the window's evictions so far, as stepping has them
        return self.sched.kv.num_prefix_hits(keys)

    def _apply_ended_steps(self, t: float) -> None:
        """Bring the replica to where stepping is at `t`: the steps of the window that ended before
        `t` applied (never its last one), and the step in flight scheduled, its blocks taken (taking
        them may evict cached entries, which the router must not see)."""
        assert self._win_ends is not None and self._win_plan is not None
        done = steps_before(self._win_ends, t, self._win_k) - self._win_applied
        if done > 0:
            self.sched.advance_decode(self._win_plan, done)
            self._win_applied += done
            self.sched.kv.take_step_blocks(self._win_plan.reqs)

    # ---- arrivals -----------------------------------------------------------------------------------
    def submit(self, seq: Request) -> None:
        seq.replica = self.index
        self.sched.add(seq)
        if self.wake is not None and not self.wake.triggered:
            self.wake.succeed()
        elif self._win_ends is not None:
            # Stepping would first see the request after the step in flight now: cut the window there.
            k = steps_before(self._win_ends, self.env.now, self._win_k) + 1
            if k < self._win_k:
                self._win_k = k
                self.process.interrupt()

    def _sample(self) -> None:
        if self.clock >= self._next_sample:
            pool = self.sched.kv.pool
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
                idle_used = sched.kv.pool.num_used
                self.wake = env.event()
                yield self.wake
                self.wake = None
                self.stats.kv_block_s += idle_used * (env.now - self.clock)
                self.stats.idle_s += env.now - self.clock
                self.clock = env.now
                continue
            self._sample()
            if plan.decode_only:
                ends, sum_ctx, evicts, block_s = self._decode_window(plan)
                self._win_ends, self._win_k, self._win_m = ends, len(ends), len(plan.reqs)
                self._win_plan, self._win_applied, self._win_evicts = plan, 0, evicts
                while True:
                    try:
                        yield env.timeout(max(0.0, ends[self._win_k - 1] - env.now))
                        break
                    except simpy.Interrupt:  # an arrival cut the window shorter
                        continue
                k = self._win_k
                self._win_ends = self._win_plan = None
                t_end = ends[k - 1]
                self.off_grid |= self.cost.decode_off_grid(
                    len(plan.reqs), sum_ctx[:k]
                )  # cost: only the steps that ran
                self.clock = t_end
                self.stats.kv_block_s = float(
                    np.cumsum(np.concatenate(([self.stats.kv_block_s], block_s[:k])))[-1]
                )
                done = sched.advance_decode(plan, k - self._win_applied)
                self.stats.steps += k
                for seq in done:
                    seq.finish_s = t_end
            else:
                for seq in plan.admitted:
                    if seq.first_scheduled_s != seq.first_scheduled_s:  # NaN: first time
                        seq.first_scheduled_s = self.clock
                # -- cost: price the step that runs, and record its off-grid flags --
                batch = ForwardBatch(
                    tuple(plan.kinds),
                    tuple(plan.num_new),
                    tuple(plan.ctx_before),
                    plan.num_sampling,
                )
                price = self.cost.price(batch)
                self.off_grid |= price.off_grid
                dt = price.seconds
                t_end = self.clock + dt
                # -- end cost --
                used = sched.kv.pool.num_used  # allocated by schedule(), held through the step
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
            # Busy time as the clock less idle time: the same sums, in the same order, however many
            # steps each event ran (a sum of per-event durations would round differently).
            self.stats.busy_s = self.clock - self.stats.idle_s

    def _decode_window(self, plan: SchedulerOutput) -> tuple[list[float], np.ndarray, bool, np.ndarray]:
        """End times of the decode steps this event may run, the batch's cached context before each
        (for pricing and bookkeeping), whether the window evicts cached entries, and each step's KV
        block-seconds."""
        m = len(plan.reqs)
        used0 = self.sched.kv.pool.num_used
        if not self.fast_forward:
            sum_ctx = np.array([sum(plan.ctx_before)], dtype=np.int64)
            evicts = False
        else:
            sched = self.sched
            window = decode_window(plan, sched.kv, MAX_FF_STEPS, may_evict=sched.may_evict_in_window)
            sum_ctx = window.sum_ctx
            evicts = (
                sched.kv.blocks_needed_through(plan.reqs, window.num_steps - 1) > sched.kv.num_empty_blocks
            )
        d = self.cost.decode_step_times(m, sum_ctx)
        ends = np.cumsum(np.concatenate(([self.clock], d)))[1:].tolist()
        # Only steps that end strictly before the next outside event; always at least one.
        k = max(1, steps_before(ends, self.next_outside_event()))
        used = _decode_used_blocks(plan.reqs, used0, self.sched.block_size, k)
        return ends[:k], sum_ctx, evicts, used * d[:k]


def _decode_used_blocks(seqs: list[Request], used0: int, block_size: int, k: int) -> np.ndarray:
    """(k,) int64: blocks in use during each of k decode-only steps that start with `used0` in use.

    Step j writes token num_computed + j, so a sequence takes a new block at step
    num_blocks * block_size - num_computed (>= 1: step 0's blocks are held) and every block_size steps
    after; the blocks taken through step j are what ``Scheduler.advance_decode`` allocates.
    """
    first = np.fromiter((s.num_blocks * block_size - s.num_computed for s in seqs), np.int64, len(seqs))
    first = first[first < k]
    rows = -(-k // block_size)
    # Crossings of one sequence fall in one column of a (rows, block_size) layout of the steps,
    # from its first row on: count first crossings per cell, then carry them down the rows.
    starts = np.bincount(first, minlength=rows * block_size).reshape(rows, block_size)
    new_at = np.cumsum(starts, axis=0).ravel()[:k]
    return used0 + np.cumsum(new_at)

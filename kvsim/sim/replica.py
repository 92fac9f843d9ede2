"""A replica: one SimPy process running the scheduler's step loop; the clock advances only by step
durations from the cost model. Every schedule runs as a window of steps, one engine for all: a
fast-forward window where nothing stepping would react to can happen (`kvsim.core.horizon`) or a
single step; each priced
by `CostModel.step_times` and applied by `Scheduler.advance`, so results equal stepping one by one
(`sim.fast_forward: false`; tests/test_engine.py and the property tests check this). An arrival
routed here mid-window cuts it after the step it lands in; the router reads a windowed replica in
closed form (`outstanding_tokens_at`), and a prefix read first applies the steps that ended where
the window changes the cache (`_apply_ended_steps`). The design, with every bound, is in
docs/architecture.md ("One step, end to end"). A replica builds its parts given itself
(`ReplicaParts`, from `kvsim.sim.assembly.replica_parts`): they read its clock and poke it.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import simpy

from kvsim.core.horizon import (
    VerifyWindow,
    decode_window,
    mixed_window,
    steps_before,
    verify_window,
)
from kvsim.core.request import Request
from kvsim.core.sched.output import SchedulerOutput, SeqKind
from kvsim.core.sched.scheduler import Scheduler
from kvsim.costs.base import CostModel, StepRun
from kvsim.costs.draft import DraftCost
from kvsim.sim.offload import OffloadPort

if TYPE_CHECKING:
    from kvsim.sim.faults import Faults, Outage
    from kvsim.sim.kv_events import ReplicaSink

MAX_FF_STEPS = 2048
# A speculative-decoding window is built step by step (each priced alone), and an arrival cuts it
# where it lands: a shorter cap wastes less of that work under load.
MAX_VERIFY_FF_STEPS = 32
MIN_VERIFY_FF_STEPS = 4  # the cap after a cut window; doubled after each window that ran whole
_NO_DECODE = np.zeros(0)  # the decode part of a step without decoding rows (read only)


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
    draft_s: float = 0.0  # simulated seconds of speculative decoding's draft passes (in busy_s)
    eviction_s: float = 0.0  # simulated seconds of trims (top-k, compaction, block tables) after steps
    # Simulated seconds of prefill attention over cached prefixes beyond the cost model's measured
    # ones (`CostModel.prefix_extrapolated_s`), in busy_s.
    prefix_extrapolated_s: float = 0.0
    samples: list[tuple[float, int, int, int, int, int, int]] = field(default_factory=list)
    down_s: float = 0.0  # simulated seconds down (faults: down time and weight reload; in idle_s)


class TokenGaps:
    """Inter-token latency, exactly: the gap before each output token after a request's first, from
    the step ends that emitted them (a step emitting several tokens of one request, speculative
    decoding's accepted drafts, gives the first the gap and the rest 0, so a request's gaps sum to
    finish - first token). A fast-forward window's steps after its first share their gaps among its
    decoding requests: one array of gaps with the requests' ids, not one entry per token."""

    def __init__(self) -> None:
        self.last: dict[int, float] = {}  # request id -> when it last emitted
        # One token's gap each, of request gap_id[i]: typed arrays, 8 bytes an entry (a run of a
        # million requests keeps tens of millions; Python floats and ints in lists took 4x more).
        self.gap_s = array("d")
        self.gap_id = array("q")
        # (request id, tokens, len(gap_s) then) emitted with another, gap 0
        self.zeros: list[tuple[int, int, int]] = []
        # (a window's step ends, and the span of gap_id holding its requests, the end of which orders
        # `per_request`): the gaps are the ends' differences, taken after the run (`_shared_gaps`)
        self.shared: list[tuple[array[float], int, int]] = []

    def emit(self, req_id: int, t: float, n: int) -> None:
        """Request `req_id` emitted `n` tokens at the end of a step at `t`."""
        last = self.last.get(req_id)
        if last is not None:
            self.gap_s.append(t - last)
            self.gap_id.append(req_id)
        if n > 1:
            self.zeros.append((req_id, n - 1, len(self.gap_s)))
        self.last[req_id] = t

    def window(self, reqs: list[Request], ends: list[float]) -> None:
        """`reqs` emitted one token each at every one of `ends` (a decode window's applied steps)."""
        if not reqs:
            return
        last, gap_s = self.last, self.gap_s
        t0 = ends[0]
        ids = [r.id for r in reqs]  # decoding: each emitted before
        start = len(gap_s)
        gap_s.extend([t0 - last[i] for i in ids])
        self.gap_id.extend(ids)
        last.update(dict.fromkeys(ids, ends[-1]))
        if len(ends) > 1:
            self.shared.append((array("d", ends), start, len(gap_s)))

    def _shared_gaps(self) -> list[tuple[np.ndarray, array[int], int]]:
        """`shared` with each window's gaps (the differences of its step ends) and its requests."""
        if not self.shared:
            return []
        gid = self.gap_id
        g, lens = self._shared_diffs()
        starts = (np.cumsum(lens) - lens).tolist()
        return [
            (g[o : o + n - 1], gid[a:b], b)
            for o, n, (_, a, b) in zip(starts, lens.tolist(), self.shared, strict=True)
        ]

    def pooled(self, keep: set[int]) -> tuple[np.ndarray, np.ndarray]:
        """(gaps, how many tokens had each) of the requests in `keep` (the completed ones). Runs of
        equal gaps (the decode rows of one step share theirs) come as one value with their count:
        the distribution is the same, its arrays a step's size rather than a token's."""
        others = set(self.last) - keep  # emitted, never completed (sim.max_time)
        kept = ~np.isin(np.frombuffer(self.gap_id, dtype=np.int64), list(others)) if others else None
        gaps, counts = _runs(np.frombuffer(self.gap_s, dtype=np.float64), kept)
        vals, ns = [gaps, np.zeros(len(self.zeros))], [counts]
        ns.append(np.array([n if r in keep else 0 for r, n, _ in self.zeros], dtype=np.int64))
        if self.shared:  # every window's gaps at once, in the windows' order
            g, lens = self._shared_diffs()
            gid = self.gap_id
            if others:
                w = [sum(1 for r in gid[a:b] if r in keep) for _, a, b in self.shared]
            else:
                w = [b - a for _, a, b in self.shared]
            inside = np.ones(len(g), dtype=bool)
            inside[np.cumsum(lens)[:-1] - 1] = False  # a difference across two windows' ends
            vals.append(g[inside])
            ns.append(np.repeat(np.asarray(w, dtype=np.int64), lens - 1))
        return np.concatenate(vals), np.concatenate(ns)

    def _shared_diffs(self) -> tuple[np.ndarray, np.ndarray]:
        """The differences of all windows' step ends laid end to end, and each window's ends."""
        arrs = [np.frombuffer(e, dtype=np.float64) for e, _, _ in self.shared]
        lens = np.fromiter((len(a) for a in arrs), dtype=np.int64, count=len(arrs))
        return np.diff(np.concatenate(arrs)), lens

    def per_request(self, keep: set[int]) -> dict[int, list[float]]:
        """Each request in `keep`'s gaps (s) in the order its tokens came (vLLM bench's ``itls``);
        built after the run, from the same records as `pooled`."""
        parts: dict[int, list[tuple[int, int, list[float]]]] = {r: [] for r in keep}
        for i, (g, r) in enumerate(zip(self.gap_s, self.gap_id, strict=True)):
            if r in keep:
                parts[r].append((i, 1, [g]))
        for r, n, pos in self.zeros:
            if r in keep:
                parts[r].append((pos, 0, [0.0] * n))
        for shared, ids, pos in self._shared_gaps():
            gaps = shared.tolist()
            for r in ids:
                if r in keep:
                    parts[r].append((pos, 0, gaps))
        out = {}
        for r, items in parts.items():
            items.sort(key=lambda x: (x[0], x[1]))
            out[r] = [g for *_, gs in items for g in gs]
        return out


def _runs(values: np.ndarray, kept: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """`values` (each counted once, or where `kept`) as runs of equal neighbours: (value, count)."""
    if kept is not None and len(values):
        values = values[kept]
    if not len(values):
        return np.zeros(0), np.zeros(0, dtype=np.int64)
    starts = np.flatnonzero(np.concatenate(([True], values[1:] != values[:-1])))
    counts = np.diff(np.append(starts, len(values)))
    return values[starts], counts


class ReplicaParts(NamedTuple):
    """What a replica runs, built for it by the run (`kvsim.sim.assembly`) once it has a clock:
    its scheduler, its port to the tiers below HBM (None: off) and its pool's KV events sink
    (``kvsim run --kv-events``; None: not written)."""

    sched: Scheduler
    offload: OffloadPort | None = None
    kv_events: ReplicaSink | None = None


class Replica:
    def __init__(
        self,
        env: simpy.Environment,
        index: int,
        cost: CostModel,
        parts: Callable[[Replica], ReplicaParts],
        *,
        fast_forward: bool,
        next_outside_event: Callable[[], float],
        sample_every_s: float,
        draft: DraftCost | None = None,
        on_load_change: Callable[[int], None] | None = None,
        on_finish: Callable[[list[Request]], None] | None = None,
        next_arrival: Callable[[], float] | None = None,
        before_schedule: Callable[[], None] | None = None,
        faults: Faults | None = None,
    ) -> None:
        """`parts` builds its scheduler, offload port and KV events sink, given the replica: they
        read its clock and poke it (`kvsim.sim.offload.ReplicaClock`), it runs them.
        `before_schedule`: called before each schedule (a decode replica of a disaggregated run
        takes in the requests whose KV landed, `kvsim.sim.disagg`; None: nothing). `faults`: the
        run's fault schedule, which takes this replica down (`go_down`; None: never down)."""
        self.env = env
        self.index = index
        self.cost = cost
        self.fast_forward = fast_forward
        self.next_outside_event = next_outside_event  # cluster-level: the end of the simulation, for now
        self.sample_every_s = sample_every_s
        self.clock = 0.0
        self.wake: simpy.Event | None = None
        self.stats = ReplicaStats()
        self.gaps = TokenGaps()  # inter-token latency of its requests (the summary's itl_s)
        self.off_grid: set[str] = set()  # the cost model's flags of the steps this replica ran
        self._next_sample = 0.0
        self._win: _Window | None = None  # the fast-forward window in flight
        self._verify_cap = MIN_VERIFY_FF_STEPS  # steps a speculative-decoding window may plan
        self.draft = draft  # speculative decoding's draft cost (None: off, or free)
        # Called with the requests that finished, at the step's end (closed-loop sessions).
        self.on_finish = on_finish
        # Called with its index where its load may have changed (the set of touched replicas of a
        # router that keeps loads in heaps, `kvsim.core.router`), before the process next waits;
        # None: not read so.
        self.on_load_change = on_load_change
        self.before_schedule = before_schedule
        # The host-DRAM tier and its links (None: off); its pool's KV events, stamped by its clock
        # (None: not written): then windows change no cache entry, so every event comes at a
        # schedule or a step's end.
        self.sched, self.offload, self.kv_events = parts(self)
        # Running ahead of the clock (`run`): a window that ends strictly before the next arrival
        # and the end of the simulation is applied at once, without an engine event, since only an
        # arrival (routed here, or reading this replica through the router) can come between. Only
        # where nothing else reaches a replica mid-step: no lower tiers or pool (their loads and
        # other replicas' publications), no KV events (one log for all replicas, in time order).
        self._ahead: Callable[[], float] | None = None
        if fast_forward and next_arrival is not None and self.offload is None and self.kv_events is None:
            self._ahead = lambda: min(next_arrival(), next_outside_event())
        self.faults = faults
        self.process = env.process(self.run() if faults is None else self._run_faulted())

    # ---- what the router reads ---------------------------------------------------------------------
    def outstanding_tokens_at(self, t: float) -> int:
        """Tokens still to compute at time `t`, steps of the current window that ended before `t`
        taken off (each computes one token per running request)."""
        win = self._win
        if win is None:
            return self.sched.outstanding_tokens
        done = steps_before(win.ends, t, win.k) - win.applied
        if win.tokens_cum is not None:  # speculative decoding: steps keep different token counts
            return self.sched.outstanding_tokens - (
                win.tokens_cum[win.applied + done] - win.tokens_cum[win.applied]
            )
        return self.sched.outstanding_tokens - win.tokens_per_step * done

    def outstanding_tokens_until(self, t: float) -> tuple[int, float, int]:
        """`outstanding_tokens_at(t)`; the end of the window's step in flight at `t` (inf when
        none), through which the reading holds; and the count after the window's last step, the
        least it falls to before this replica next tells the router."""
        win = self._win
        n = self.sched.outstanding_tokens
        if win is None:
            return n, math.inf, n
        j = steps_before(win.ends, t, win.k)
        until = win.ends[j] if j < win.k else math.inf
        if win.tokens_cum is not None:
            cum, a = win.tokens_cum, win.applied
            return n - (cum[j] - cum[a]), until, n - (cum[win.k] - cum[a])
        tps = win.tokens_per_step
        return n - tps * (j - win.applied), until, n - tps * (win.k - win.applied)

    @property
    def num_requests(self) -> int:
        return self.sched.num_requests

    def num_prefix_hits(self, keys: list[int]) -> int:
        if self._win is not None and self._win.changes_cache:
            self._apply_ended_steps(self.env.now)  # the window's cache changes so far, as stepping has
        return self.sched.kv.num_prefix_hits(keys)

    def prefill_cost_tokens(self, req: Request) -> float:
        """Tokens the request would cost here (`kvsim.core.router`, ``cache_aware``): its prompt less
        its HBM hits, with what it would load from a lower tier weighed by `OffloadPort.load_weight`
        (over H2D) or `OffloadPort.remote_weight` (over the network: another node's pool share, a
        pool node)."""
        bs = self.sched.block_size
        if not req.keys:
            return float(req.prompt_len)
        hbm = self.num_prefix_hits(req.keys)
        cum = req.key_cum
        cost = float(req.prompt_len - cum[hbm] * bs)
        off = self.offload
        if off is not None and off.view.looks_up:
            far = [0]  # blocks of those fetched over the network
            lower = off.view.num_prefix_hits(req.keys, hbm, len(req.keys), count=False, remote=far)
            loaded = (cum[hbm + lower] - cum[hbm]) * bs
            remote = far[0] * bs
            cost -= (loaded - remote) * (1.0 - off.load_weight) + remote * (1.0 - off.remote_weight)
        return cost

    def _apply_ended_steps(self, t: float) -> None:
        """Bring the replica to where stepping is at `t`: the steps of the window that ended before
        `t` applied (never its last one), and the step in flight scheduled, its blocks taken (taking
        them may evict cached entries, which the router must not see)."""
        win = self._win
        assert win is not None
        done = steps_before(win.ends, t, win.k) - win.applied
        if done <= 0:
            return
        sched, reqs = self.sched, win.reqs
        self._apply_part(win, done)
        if win.chunk:
            sched.kv.take_step_blocks(reqs, win.chunk)
            p = reqs[-1]
            if len(p.held_keys) < len(p.keys):  # the step in flight registered its blocks when scheduled
                sched.kv.cache_blocks(p, p.num_computed + win.chunk)
        else:
            sched.kv.take_step_blocks(reqs)

    # ---- arrivals -----------------------------------------------------------------------------------
    def submit(self, seq: Request) -> None:
        seq.replica = self.index
        self.sched.add(seq)
        if self.on_load_change is not None:
            self.on_load_change(self.index)
        if self.wake is not None and not self.wake.triggered:
            self.wake.succeed(seq.arrival_s)
        elif self._win is not None:
            # Stepping would first see the request after the step in flight now: cut the window there.
            win = self._win
            k = steps_before(win.ends, self.env.now, win.k) + 1
            if k < win.k:
                win.k = k
                self.process.interrupt()

    def poke(self, t: float) -> None:
        """Something outside the replica changed, at `t`, what its next schedule does (a load
        arrived; its node's tiers changed while requests wait here): stepping sees it after the step
        in flight, so an idle replica wakes (its clock to `t`) and a window is cut there, as for an
        arrival (`submit`)."""
        if self.on_load_change is not None:  # a load's end computed its tokens (`finish_load`)
            self.on_load_change(self.index)
        if self.wake is not None and not self.wake.triggered:
            self.wake.succeed(t)
        elif self._win is not None:
            win = self._win
            k = steps_before(win.ends, t, win.k) + 1
            if k < win.k:
                win.k = k
                self.process.interrupt()

    # ---- faults (`kvsim.sim.faults`) -------------------------------------------------------------
    def resubmit(self, seq: Request, t: float) -> None:
        """A request sent here at `t` after its arrival (its replica went down; it waited at the
        router while every replica was down): taken in as an arrival at `t`."""
        seq.replica = self.index
        self.sched.add(seq)
        self.poke(t)

    def go_down(self, outage: Outage) -> None:
        """Down now until `outage.up_s`: the step in flight is lost (its time counted busy), every
        request is dropped and handed to the fault schedule, the prefix cache emptied; the process
        waits out the outage (`_run_faulted`). Windows and running ahead end before every fault
        instant (`next_outside_event`), so at most one step is in flight here. An idle replica's
        clock stays where it was: its idle time (the outage in it) is counted when it next wakes,
        so a fault after the last request does not lengthen the run."""
        assert self.faults is not None and self._win is None
        t = self.env.now
        pool = self.sched.kv.pool
        if self.wake is None:  # a step (or a trim's pause) in flight, lost: busy until now
            self.stats.kv_block_s += pool.num_used * (t - self.clock)
            self.clock = t
            self.stats.busy_s = self.clock - self.stats.idle_s
        self.wake = None
        outage.kv_blocks_lost = pool.num_blocks - pool.free
        reqs = self.sched.drop_all()
        for r in reqs:
            self.gaps.last.pop(r.id, None)  # a retry here starts a new stream: no gap across the outage
        if self.on_load_change is not None:
            self.on_load_change(self.index)
        self.process.interrupt(outage)
        self.faults.dropped(outage, reqs, t)

    def _run_faulted(self) -> Generator[simpy.Event, Any, None]:
        """`run`, restarted after each outage: an interrupt whose cause is the outage (`go_down`)
        ends the step loop; the replica waits until it is back, then loops again, from the instant
        it is back if requests were sent to it then (else from its next wake, as when idle)."""
        while True:
            try:
                yield from self.run()
            except simpy.Interrupt as stop:
                outage = stop.cause
                assert outage is not None
                yield self.env.timeout(outage.up_s - self.env.now)
                self.stats.down_s += outage.up_s - outage.down_s
                if self.sched.num_requests:  # requests waiting at the router came here
                    self.stats.idle_s += outage.up_s - self.clock
                    self.clock = outage.up_s
                    self.stats.busy_s = self.clock - self.stats.idle_s

    def _apply_part(self, win: _Window, n: int) -> tuple[list[Request], list[Request]]:
        """Apply the window's next `n` steps, adding their blocks in use x seconds step by step in
        stepping's order. Returns (sampled their first token, finished)."""
        sched = self.sched
        if win.verify is not None:
            a = win.applied
            in_use, done = sched.advance_verify(win.reqs, win.verify.drafts, win.verify.accepted, a, n)
            for j in range(a, a + n):
                rows = zip(win.reqs, win.verify.drafts[j], win.verify.accepted[j], strict=True)
                for req, n_draft, n_acc in rows:
                    self.gaps.emit(req.id, win.ends[j], 1 + (n_acc if n_draft else 0))  # as advance_verify
            acc, dsum = self.stats.kv_block_s, self.stats.draft_s
            dv = win.durations[a : a + n]
            for u, d_j, ds in zip(
                in_use, dv if isinstance(dv, list) else dv.tolist(), win.draft_s[a : a + n], strict=True
            ):
                dsum += ds
                acc += u * d_j
            self.stats.kv_block_s, self.stats.draft_s = acc, dsum
            win.applied += n
            return [], done
        a = win.applied
        used0 = sched.kv.pool.num_used if win.used0 is None else win.used0  # its first step's blocks held
        plan = win.plan
        self.gaps.window(plan.decode_reqs, win.ends[a : a + n])
        others = plan.verify_reqs + plan.prefill_reqs if plan.verify_reqs else plan.prefill_reqs
        if others:
            g0 = [r.num_generated for r in others]
            first, done = sched.advance(plan, n)
            t = win.ends[a + n - 1]
            for r, g in zip(others, g0, strict=True):
                if r.num_generated > g:  # a prefill's last chunk sampled; a verify row's tokens
                    self.gaps.emit(r.id, t, r.num_generated - g)
        else:
            first, done = sched.advance(plan, n)
        taken, d = sched.last_new_blocks, win.durations[a : a + n]
        if n <= 64:  # a short part: a plain loop beats numpy's per-call cost; the same sums either way
            acc, used = self.stats.kv_block_s, used0
            for t_j, d_j in zip(taken, d if isinstance(d, list) else d.tolist(), strict=True):
                used += t_j
                acc += used * d_j
            self.stats.kv_block_s = acc
        else:
            block_s = (used0 + np.cumsum(taken)) * d
            self.stats.kv_block_s = float(np.cumsum(np.concatenate(([self.stats.kv_block_s], block_s)))[-1])
        if win.draft_s:  # a single step's draft passes, counted once it ran
            self.stats.draft_s += win.draft_s[0]
        win.applied += n
        return first, done

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
            if self.offload is not None:
                self.offload.sample(self.clock)  # the tiers below HBM it samples
            self._next_sample = self.clock + self.sample_every_s

    def run(self) -> Generator[simpy.Event, Any, None]:
        env = self.env
        sched = self.sched
        offload = self.offload
        before = self.before_schedule
        while True:
            if before is not None:
                before()
            plan = sched.schedule()
            if offload is not None:
                offload.after_schedule()  # write-backs of what it evicted, loads of whom it admitted
            if self.on_load_change is not None:  # the schedule admitted, preempted; a window follows
                self.on_load_change(self.index)
            if plan.empty:
                self._sample()
                idle_used = sched.kv.pool.num_used
                self.wake = env.event()
                # The arrival's own time, not env.now: a closed-loop turn's time is its previous
                # reply's end plus a gap, which env.now reaches by a sum that differs between
                # fast-forward and stepping (an arrival from a trace is at env.now either way).
                woken_at = yield self.wake
                self.wake = None
                now = max(self.clock, woken_at)
                self.stats.kv_block_s += idle_used * (now - self.clock)
                self.stats.idle_s += now - self.clock
                self.clock = now
                continue
            self._sample()
            for seq in plan.admitted:
                if seq.first_scheduled_s != seq.first_scheduled_s:  # NaN: first time
                    seq.first_scheduled_s = self.clock
            win = (self._window(plan) if self.fast_forward else None) or self._single_step(plan)
            # Ahead: it ends before anything from outside can come, so it is applied now, no event.
            ahead = self._ahead is not None and win.ends[win.k - 1] < self._ahead()
            if not ahead and win.k > 1:  # the router reads it mid-window; an arrival may cut it
                self._win = win
                while True:
                    try:
                        yield env.timeout(max(0.0, win.ends[win.k - 1] - env.now))
                        break
                    except simpy.Interrupt as stop:  # an arrival cut the window shorter
                        if stop.cause is not None:  # the replica went down (`go_down`)
                            raise
                        continue
                self._win = None
            elif not ahead:
                yield env.timeout(max(0.0, win.ends[0] - env.now))
            k = win.k
            if win.verify is not None:  # grow the plan while windows run whole, shrink when cut
                whole = k == len(win.verify.tokens)
                self._verify_cap = (
                    min(2 * self._verify_cap, MAX_VERIFY_FF_STEPS) if whole else MIN_VERIFY_FF_STEPS
                )
            t_end = win.ends[k - 1]
            self.off_grid |= win.off_grid(k)  # cost: only the steps that ran
            for x in win.prefix_extrapolated(k):
                self.stats.prefix_extrapolated_s += x
            self.clock = t_end
            first, done = self._apply_part(win, k - win.applied)
            self.stats.steps += k
            pause = self._end_step(first, done, t_end)
            if pause:
                if ahead and self._ahead is not None and self.clock + pause < self._ahead():
                    self.clock += pause
                else:
                    yield env.timeout(max(0.0, self.clock + pause - env.now))
                    self.clock += pause
                    ahead = False
            if not ahead:
                self.stats.events += 1
            # Busy time as the clock less idle time: the same sums, in the same order, however many
            # steps each event ran (a sum of per-event durations would round differently).
            self.stats.busy_s = self.clock - self.stats.idle_s

    def _end_step(self, first: list[Request], done: list[Request], t_end: float) -> float:
        """A step (or a window's last) ended at `t_end`: stamp its first tokens and finishes, tell
        the closed-loop sessions, and return the pause its token evictions take (0 for none)."""
        for seq in first:
            seq.first_token_s = t_end
        for seq in done:
            seq.finish_s = t_end
        if self.on_load_change is not None:  # the step's tokens computed, its finished gone
            self.on_load_change(self.index)
        if done and self.on_finish is not None:
            self.on_finish(done)
        return self._eviction_pause()

    def _eviction_pause(self) -> float:
        """Seconds of the trims the last step(s) made (token eviction), run before the next step;
        their blocks in use x seconds are added. 0 when nothing was trimmed."""
        kv = self.sched.kv
        if kv.eviction is None:
            return 0.0
        work = kv.take_eviction_work()
        if not work:
            return 0.0
        price = self.cost.eviction_price(work)
        dt = price.seconds
        self.off_grid |= price.off_grid
        self.stats.eviction_s += dt
        self.stats.kv_block_s += kv.pool.num_used * dt
        return dt

    def _single_step(self, plan: SchedulerOutput) -> _Window:
        """The scheduled step as a window of one: priced by the same `CostModel.step_times` as a
        window's steps (plus its draft passes), applied by the same `Scheduler.advance`."""
        cost, sched = self.cost, self.sched
        m = len(plan.decode_reqs)
        rows: list[tuple[SeqKind, int]] = []
        ctxs: list[tuple[int]] = []
        if plan.verify_reqs:  # speculative decoding: k+1 tokens per row, and the drafts' cost
            rows += [(SeqKind.VERIFY, d + 1) for d in plan.verify_drafts]
            ctxs += [(c,) for c in plan.verify_ctx]
            switched, switched_ctx = 0, None
        else:
            switched = plan.decode_switched
            switched_ctx = np.array([plan.decode_switched_ctx], dtype=np.float64) if switched else None
        if plan.prefill_reqs:
            rows += [(SeqKind.PREFILL, n) for n in plan.prefill_new]
            ctxs += [(c,) for c in plan.prefill_ctx]
        dec = np.array([sum(plan.decode_ctx)], dtype=np.float64) if m else _NO_DECODE
        run = StepRun(m, dec, plan.num_sampling, 1, tuple(rows), tuple(ctxs), switched, switched_ctx)
        dt = cost.step_seconds(run)
        flags = cost.step_off_grid(run)
        draft_s: list[float] = []
        if plan.verify_reqs and self.draft is not None:
            ds = self.draft.seconds(plan.verify_ctx, plan.verify_drafts)
            dt += ds
            if ds:
                draft_s.append(ds)
        win = _Window(plan, plan.decode_reqs, [self.clock + dt], 1, 0, 0, False, [dt], lambda _k: flags)
        win.used0 = sched.kv.pool.num_used
        win.draft_s = draft_s
        if plan.prefill_reqs and any(plan.prefill_ctx):
            terms = tuple(
                cost.prefix_extrapolated_s(n, c)
                for n, c in zip(plan.prefill_new, plan.prefill_ctx, strict=True)
                if c
            )
            win.prefix_extrapolated = lambda _k: terms
        return win

    def _window(self, plan: SchedulerOutput) -> _Window | None:
        """The fast-forward window starting with the scheduled step, or None to run it alone.

        Stepping one by one (``sim.fast_forward: false``) never comes here: it prices every step
        with `CostModel.price`, so the tests that compare the two modes compare two code paths."""
        sched = self.sched
        kv = sched.kv
        if self.offload is not None and self.offload.tier_changed and sched.waiting:
            return None  # the host tier changed at this schedule: the next may admit differently
        events = self.kv_events is not None
        if events and kv.eviction is not None:
            return None  # token eviction's trims rewrite entries at the step that makes them
        if sched.spec is not None and (plan.decode_reqs or plan.verify_reqs):
            return self._verify_window(plan)
        if plan.decode_only:
            m = len(plan.decode_reqs)
            reqs = plan.decode_reqs
            may_evict = sched.may_evict_in_window and not (
                events or (self.offload and self.offload.writes_back)
            )
            window = decode_window(plan, kv, MAX_FF_STEPS, may_evict=may_evict)
            if window.num_steps == 1:
                return None  # a window of one step costs more bookkeeping than the step
            sum_ctx = window.sum_ctx
            evicts = window.new_blocks > kv.num_empty_blocks
            run = StepRun.decode(m, sum_ctx, window.num_switched, window.switched_ctx)
            d = self.cost.step_times(run)
            cost = self.cost

            def off_grid(k: int) -> frozenset[str]:
                return cost.step_off_grid(run, k)

            chunk, tokens, changes = 0, m, evicts
        else:
            off = self.offload
            mw = mixed_window(plan, kv, MAX_FF_STEPS, may_evict=not (events or (off and off.writes_back)))
            if mw is None:
                return None
            p = plan.prefill_reqs[0]
            registers = len(p.held_keys) < len(p.keys)
            if registers and (events or (off is not None and off.publishes_on_register)):
                return (
                    None  # its registrations are written through (or logged) at the schedules that make them
                )
            run = StepRun.mixed(
                mw.num_decode,
                mw.dec_sum_ctx,
                mw.chunk,
                mw.prefill_ctx,
                mw.num_sampling,
                mw.num_switched,
                mw.dec_switched_ctx,
            )
            d = self.cost.step_times(run)
            cost = self.cost

            def off_grid(k: int) -> frozenset[str]:
                return cost.step_off_grid(run, k)

            def extrapolated(k: int) -> tuple[float, ...]:
                return (
                    math.fsum(
                        cost.prefix_extrapolated_s(mw.chunk, int(c)) for c in mw.prefill_ctx[:k].tolist() if c
                    ),
                )

            reqs = [*plan.decode_reqs, p]
            chunk, tokens = mw.chunk, mw.num_decode + mw.chunk
            need = mw.new_blocks
            evicts = need > kv.num_empty_blocks
            changes = evicts or len(p.held_keys) < len(p.keys)
        ends = list(accumulate(d.tolist(), initial=self.clock))[1:]  # numpy's cumsum: float for float
        k = self._steps_within(ends)
        win = _Window(plan, reqs, ends[:k], k, chunk, tokens, changes, d[:k], off_grid)
        if chunk:
            win.prefix_extrapolated = extrapolated
        return win

    def _steps_within(self, ends: list[float]) -> int:
        """Steps of a window with these step ends that may run: those that end strictly before the
        next outside event (the end of the simulation, a load's arrival), and none past the schedule
        at which a cached entry goes cold (offload's ``cold_after_steps``); always at least one."""
        outside = self.next_outside_event()
        if self.offload is not None:
            outside = min(outside, self.offload.next_event())
        k = max(1, steps_before(ends, outside))
        if self.offload is not None:
            cold = self.offload.cold_steps_left()  # the schedule at which an entry goes cold
            if cold is not None and cold < k:
                k = max(1, cold)
        return k

    def _verify_window(self, plan: SchedulerOutput) -> _Window | None:
        """A window of speculative-decoding steps (`kvsim.core.horizon.verify_window`), each priced
        with `CostModel.price` of the batch stepping would build, plus its draft passes: so its
        durations are stepping's, float for float."""
        sched = self.sched
        assert sched.spec is not None
        steady = bool(sched.waiting) and len(sched.running) < sched.max_num_seqs
        vw = verify_window(
            plan, sched.kv, sched.spec, sched.running, self._verify_cap, sched.max_batched_tokens, steady
        )
        if vw is None or vw.num_steps == 1:
            return None
        durations: list[float] = []
        drafts_s: list[float] = []
        flags: list[frozenset[str]] = []
        for ctx, drafts in zip(vw.ctx, vw.drafts, strict=True):
            dec = [c for c, d in zip(ctx, drafts, strict=True) if not d]
            ver = [(c, d) for c, d in zip(ctx, drafts, strict=True) if d]
            v_ctx, v_d = [c for c, _ in ver], [d for _, d in ver]
            m, v = len(dec), len(ver)
            dec_arr = np.array([sum(dec)], dtype=np.float64) if m else _NO_DECODE
            run = StepRun(
                m,
                dec_arr,
                m + v + sum(v_d),
                1,
                tuple((SeqKind.VERIFY, d + 1) for d in v_d),
                tuple((c,) for c in v_ctx),
            )
            dt = float(self.cost.step_times(run)[0])
            flag = self.cost.step_off_grid(run)
            ds = 0.0
            if v and self.draft is not None:
                ds = self.draft.seconds(v_ctx, v_d)
                dt += ds
            durations.append(dt)
            drafts_s.append(ds)
            flags.append(flag)
        d_arr = np.array(durations, dtype=np.float64)
        ends = np.cumsum(np.concatenate(([self.clock], d_arr)))[1:].tolist()
        k = self._steps_within(ends)  # the bounds of `_window`'s windows: a load's end, a cold entry
        cum = np.cumsum([0, *vw.tokens]).tolist()

        def off_grid(n: int) -> frozenset[str]:
            return frozenset().union(*flags[:n])

        reqs = list(plan.verify_reqs)
        win = _Window(plan, reqs, ends[:k], k, 0, 0, False, d_arr[:k], off_grid)
        win.verify, win.tokens_cum, win.draft_s = vw, cum, drafts_s
        return win


@dataclass(slots=True)
class _Window:
    """A fast-forward window in flight: `k` of its steps will run (an arrival may lower it)."""

    plan: SchedulerOutput
    reqs: list[Request]  # its requests, a mixed window's prefilling one last
    ends: list[float]  # end time of each step
    k: int
    chunk: int  # prefill tokens per step of the last request (mixed window), 0 for decode-only
    tokens_per_step: int  # tokens computed per step, all requests together
    changes_cache: bool  # it evicts cached entries or registers blocks: reads first apply ended steps
    durations: np.ndarray | list[float]  # (len(ends),) seconds of each step (a single step's: a list)
    off_grid: Callable[[int], frozenset[str]]  # the cost model's flags of its first k steps
    applied: int = 0  # steps already applied (the router read this replica mid-window)
    verify: VerifyWindow | None = None  # speculative decoding's window (its rows and drafts per step)
    tokens_cum: list[int] | None = None  # verify window: tokens computed by its first j steps
    # Draft seconds per step: a verify window's; a single step's (one entry, only if it drafted)
    draft_s: list[float] = field(default_factory=list)
    # A single step's blocks in use, read when it was scheduled (a load landing mid-step may share
    # them); None: a window's, read as each part is applied (no load lands inside a window).
    used0: int | None = None
    # Seconds of its first k steps' prefill attention beyond the measured prefixes, added in order.
    prefix_extrapolated: Callable[[int], tuple[float, ...]] = field(default=lambda k: ())

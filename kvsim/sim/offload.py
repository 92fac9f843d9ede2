"""The SimPy side of host-DRAM offload: write-backs, write-throughs and loads over queued links.

Each replica has an `OffloadPort`: its node's `HostTier` (`kvsim.core.tiers`, shared by the node's
replicas) and the `LinkQueue`s (`kvsim.sim.links`) its GPUs' PCIe lanes belong to, one per
direction. After every schedule (and after every completed step or window) the replica calls
`OffloadPort.after_schedule`, which

- copies HBM's evicted entries to DRAM (``write: back``; the pool's `BlockRemoved` events) or its
  newly registered ones (``write: through``; `BlockStored`), as one device-to-host transfer per
  batch of events, queued on the D2H link. The copy reads the blocks before the pool reuses them
  (a copy enqueued on the compute stream ahead of the kernel that overwrites them); the step does
  not wait for it. A DRAM entry can be looked up at once, but a load of it starts no earlier than
  its write has arrived;
- starts the load of every request the scheduler admitted to load (`Scheduler.new_loads`): one
  host-to-device transfer of the entries it found in DRAM, queued on the H2D link, and one engine
  event at its end, at URGENT priority (as arrivals: a load that arrives at the instant a step ends
  is seen by the next schedule whether the replica steps or fast-forwards), which hands the
  request to the scheduler (`Scheduler.finish_load`) and wakes the replica if it idles.

Swap preemption (``scheduler.preemption: swap | auto``) goes over the same links: a swap-out is a
device-to-host copy of the victim's computed blocks at the schedule that preempts it, within the
node's swap space (`SwapSpace`; a victim that does not fit is recomputed), and a swap-in a load
like the others, starting no earlier than its swap-out has arrived; the swap space is returned
when the swap-in ends. ``auto`` swaps a victim when copying its KV out and back over idle links
takes less than recomputing its computed tokens in one prefill (the cost model's price; queueing
and prefix hits that would shorten the recompute are not weighed).

A load's end is an outside event for the replica's fast-forward windows (`next_event`,
`kvsim.core.horizon`): a window runs only the steps that end strictly before it. While offload is
on, windows evict no cached entry (their allocations take empty blocks only), so every eviction,
and so every write-back, happens at a schedule, at the same instant whether the replica steps or
fast-forwards; with ``write: through`` a mixed window also stops before a prefill that registers
entries. Bytes per transfer: blocks x the replica's KV block bytes per GPU x the replica's GPUs on
that link (the replica's other GPUs move their shares in parallel over their own lanes).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import simpy

from kvsim.core.block_pool import BlockRemoved, BlockStored
from kvsim.core.request import Request
from kvsim.core.sched.scheduler import Scheduler
from kvsim.core.tiers import HostTier
from kvsim.sim.links import LinkQueue
from kvsim.spec.offload import CopyMode, OffloadWrite


class _UrgentTimeout(simpy.events.Event):
    """A timeout at URGENT priority (as `kvsim.sim.cluster`'s arrivals)."""

    def __init__(self, env: simpy.Environment, delay: float) -> None:
        super().__init__(env)
        self._ok = True
        self._value = None
        env.schedule(self, simpy.core.URGENT, delay)


@dataclass
class SwapSpace:
    """A node's host memory for swapped-out KV, in KV blocks of its replicas (all their GPUs)."""

    capacity_blocks: int
    used_blocks: int = 0
    peak_blocks: int = 0


@dataclass
class OffloadStats:
    loads: int = 0
    loaded_blocks: int = 0
    loaded_tokens: int = 0  # tokens the loads let requests skip (at admission)
    first_admission_tokens: dict[int, int] = field(default_factory=dict)  # request id -> DRAM tokens
    written_blocks: int = 0  # blocks copied HBM -> DRAM
    swaps_out: int = 0
    swapped_blocks: int = 0  # copied out by swaps (and as many back in)
    recomputed: int = 0  # preemptions the swap policy sent to recompute
    waits: dict[int, float] = field(default_factory=dict)  # request id -> seconds waited for KV


class OffloadPort:
    def __init__(
        self,
        env: simpy.Environment,
        sched: Scheduler,
        host: HostTier | None,
        h2d: LinkQueue,
        d2h: LinkQueue,
        *,
        h2d_block_bytes: float,
        d2h_block_bytes: float,
        write: OffloadWrite,
        copy: CopyMode,
        ready: dict[int, float],
        swap: tuple[SwapSpace, Callable[[Request], bool]] | None = None,
    ) -> None:
        self.env = env
        self.sched = sched
        self.host = host
        self.h2d = h2d
        self.d2h = d2h
        # Bytes of one block on each link: per-GPU block bytes x the replica's GPUs on that link.
        self.h2d_block_bytes = h2d_block_bytes
        self.d2h_block_bytes = d2h_block_bytes
        self.write = write
        self.per_block = copy is CopyMode.PER_BLOCK
        self.ready = ready  # the node's: entry key -> instant its write to DRAM arrives (pruned lazily)
        self.pending: dict[int, tuple[float, Request]] = {}  # request id -> (load end, request)
        self.stats = OffloadStats()
        self.on_arrival: Callable[[], None] = lambda: None  # wakes the replica (set by it)
        self.peers: list[OffloadPort] = []  # the other replicas' ports on this node
        self.has_waiting: Callable[[], bool] = lambda: bool(sched.waiting)
        self.tier_changed = False  # the last after_schedule changed the tier's contents
        self.swap_ready: dict[int, float] = {}  # request id -> instant its swap-out has arrived
        sched.host = host
        self.swap_space: SwapSpace | None = None
        if swap is not None:
            self.swap_space, self._cheaper_to_swap = swap
            sched.swap_decider = self._decide_swap

    def next_event(self) -> float:
        """The end of the earliest load in flight (inf when none)."""
        if not self.pending:
            return math.inf
        return min(t for t, _ in self.pending.values())

    def after_schedule(self) -> None:
        now = self.env.now
        events = self.sched.kv.pool.take_events()
        self.tier_changed = False
        if events and self.host is not None:
            self._write(now, events)
        sched = self.sched
        if sched.new_swaps:
            swaps, sched.new_swaps = sched.new_swaps, []
            for req, blocks, out in swaps:
                self._swap(now, req, blocks, out)
        if sched.new_loads:
            loads, sched.new_loads = sched.new_loads, []
            for req, hits, n in loads:
                self._load(now, req, hits, n)

    def _decide_swap(self, req: Request) -> bool:
        """Whether to swap the victim `req` (else it is recomputed): it has KV, it fits the node's
        swap space, and (``auto``) swapping is the cheaper."""
        space = self.swap_space
        assert space is not None
        blocks = -(-req.num_computed // self.sched.block_size)
        ok = blocks > 0 and space.used_blocks + blocks <= space.capacity_blocks and self._cheaper_to_swap(req)
        if ok:
            space.used_blocks += blocks  # held from now until its swap-in ends
            space.peak_blocks = max(space.peak_blocks, space.used_blocks)
        else:
            self.stats.recomputed += 1
        return ok

    def _swap(self, now: float, req: Request, blocks: int, out: bool) -> None:
        calls = blocks if self.per_block else 1
        if out:
            _, end = self.d2h.reserve(now, blocks * self.d2h_block_bytes, calls)
            self.swap_ready[req.id] = end
            self.stats.swaps_out += 1
            self.stats.swapped_blocks += blocks
            return
        start = max(now, self.swap_ready.pop(req.id))
        _, end = self.h2d.reserve(start, blocks * self.h2d_block_bytes, calls)
        self._await(now, end, req, blocks)

    def _write(self, now: float, events: list[BlockStored | BlockRemoved]) -> None:
        kind = BlockRemoved if self.write is OffloadWrite.BACK else BlockStored
        keys: list[int] = []
        sizes: list[int] = []
        for ev in events:
            if isinstance(ev, kind):
                keys.extend(ev.keys)
                sizes.extend(ev.sizes)
        if not keys:
            return
        assert self.host is not None
        new = self.host.insert(keys, sizes)
        if not new:
            return
        # What the node's waiting requests find in DRAM changed: this replica's next schedule (no
        # window now, `Replica._window`) and the node's other replicas' (poked) see it.
        self.tier_changed = True
        for p in self.peers:
            if p.has_waiting():
                p.on_arrival()
        blocks = sum(s for _, s in new)
        _, end = self.d2h.reserve(now, blocks * self.d2h_block_bytes, blocks if self.per_block else 1)
        ready = self.ready
        for k, _ in new:
            ready[k] = end
        self.stats.written_blocks += blocks

    def _load(self, now: float, req: Request, hits: int, n: int) -> None:
        cum = req.key_cum
        blocks = cum[hits + n] - cum[hits]
        start = now
        ready = self.ready
        for k in req.keys[hits : hits + n]:
            t = ready.get(k)
            if t is not None:
                if t <= now:
                    del ready[k]
                elif t > start:
                    start = t
        _, end = self.h2d.reserve(start, blocks * self.h2d_block_bytes, blocks if self.per_block else 1)
        bs = self.sched.block_size
        skipped = min(cum[hits + n], (req.num_tokens - 1) // bs) * bs - cum[hits] * bs
        s = self.stats
        s.loads += 1
        s.loaded_blocks += blocks
        s.loaded_tokens += skipped
        if req.num_cached_tokens < 0:
            s.first_admission_tokens[req.id] = skipped
        if req.first_scheduled_s != req.first_scheduled_s:  # NaN: first time
            req.first_scheduled_s = now
        self._await(now, end, req, 0)

    def _await(self, now: float, end: float, req: Request, swap_blocks: int) -> None:
        """`req` waits for KV until `end`: one URGENT event then."""
        s = self.stats
        s.waits[req.id] = s.waits.get(req.id, 0.0) + (end - now)
        self.pending[req.id] = (end, req)
        ev = _UrgentTimeout(self.env, end - now)
        ev.callbacks.append(lambda _e: self._arrived(req, swap_blocks))

    def _arrived(self, req: Request, swap_blocks: int) -> None:
        del self.pending[req.id]
        if swap_blocks:
            assert self.swap_space is not None
            self.swap_space.used_blocks -= swap_blocks
        self.sched.finish_load(req)
        self.on_arrival()

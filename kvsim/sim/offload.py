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
class OffloadStats:
    loads: int = 0
    loaded_blocks: int = 0
    loaded_tokens: int = 0  # tokens the loads let requests skip (at admission)
    first_admission_tokens: dict[int, int] = field(default_factory=dict)  # request id -> DRAM tokens
    written_blocks: int = 0  # blocks copied HBM -> DRAM
    waits: dict[int, float] = field(default_factory=dict)  # request id -> seconds waited for KV


class OffloadPort:
    def __init__(
        self,
        env: simpy.Environment,
        sched: Scheduler,
        host: HostTier,
        h2d: LinkQueue,
        d2h: LinkQueue,
        *,
        h2d_block_bytes: float,
        d2h_block_bytes: float,
        write: OffloadWrite,
        copy: CopyMode,
        ready: dict[int, float],
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
        sched.host = host

    def next_event(self) -> float:
        """The end of the earliest load in flight (inf when none)."""
        if not self.pending:
            return math.inf
        return min(t for t, _ in self.pending.values())

    def after_schedule(self) -> None:
        now = self.env.now
        events = self.sched.kv.pool.take_events()
        self.tier_changed = False
        if events:
            self._write(now, events)
        if self.sched.new_loads:
            loads, self.sched.new_loads = self.sched.new_loads, []
            for req, hits, n in loads:
                self._load(now, req, hits, n)

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
        s.waits[req.id] = s.waits.get(req.id, 0.0) + (end - now)
        self.pending[req.id] = (end, req)
        ev = _UrgentTimeout(self.env, end - now)
        ev.callbacks.append(lambda _e, r=req: self._arrived(r))

    def _arrived(self, req: Request) -> None:
        del self.pending[req.id]
        self.sched.finish_load(req)
        self.on_arrival()

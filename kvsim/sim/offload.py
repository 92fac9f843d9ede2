"""The SimPy side of the tiers below HBM: write-backs, write-throughs, loads, swaps, the global pool.

Each replica has its side of the tiers (`ReplicaTiers`, built per run by
`kvsim.sim.offload_wiring` before its scheduler): its node's `HostTier` (`kvsim.core.tiers`, shared
by the node's replicas), the node's SSD tier (`SSDSide`), the global pool (`GlobalSide`), the
`LinkQueue`s (`kvsim.sim.links`) its GPUs' PCIe lanes and NIC belong to, one per direction, and
what its scheduler is given: a `TierView` (the scheduler's `TierLookup`: DRAM first, then the SSD,
then the pool) and a `SwapPolicy` (its `SwapDecider`). Its `OffloadPort` is built over that side
and the scheduler; all three read the replica's clock and poke it (`ReplicaClock`). After every
schedule the replica calls `OffloadPort.after_schedule`, at its own clock (the same float whether
it steps or fast-forwards), which

- moves down the cached HBM entries gone cold (``cold_after_steps``: `BlockPool.drop_cold`);
- starts the load of every request the scheduler admitted to load (`Scheduler.new_loads`): one
  host-to-device transfer of the entries it found in DRAM, queued on the H2D link (SSD entries
  first over the SSD's read link, then H2D; remote pool entries over the network, in parallel),
  and one engine event at its end, at URGENT priority (as arrivals: a load that arrives at the
  instant a step ends is seen by the next schedule whether the replica steps or fast-forwards),
  which hands the request to the scheduler (`Scheduler.finish_load`) and wakes the replica if it
  idles; with ``load: overlap`` the event comes earlier by the prefill that hides the load;
- copies HBM's evicted entries to DRAM (``write: back``; the pool's `BlockRemoved` events) or its
  newly registered ones (``write: through``; `BlockStored`), as one device-to-host transfer per
  batch of events, queued on the D2H link; what DRAM's LRU drops goes to the SSD. The copy reads
  the blocks before the pool reuses them (a copy enqueued on the compute stream ahead of the kernel
  that overwrites them); the step does not wait for it. An entry takes its room in a tier when its
  write is asked for (as vLLM's `prepare_store`) but is readable only once the write has arrived: a
  lookup before that misses it (a store in flight is no hit, as in vLLM's OffloadingConnector,
  LMCache and Mooncake Store) and the replica is poked at the arrival (`num_prefix_hits`).

Token eviction (``kv.eviction``): an entry its only holder trims is rewritten in place and leaves
HBM's index as a `BlockRewritten` event, which no write path copies: its blocks no longer hold the
prefix (a write-back of it would store wrong content as a hit). A copy below written before the
trim (a write-through or a publication to the global pool, queued at the schedule that registered
the entry, ahead of the steps that rewrite it; or an earlier write-back) holds the full content and
stays valid: a trim un-publishes nothing. Cold-block offload moves unreferenced cached entries
only, which trimmed ones never are. Sliding-window layers and a format switch trim the same way (a
window's out-of-window blocks and a switch's re-quantized ones are no first-format prefix), so the
same holds for them; a windowed request takes no more hits from the tiers than the blocks of the
tokens it keeps (`KVCacheManager.window_hit_blocks`).

Swap preemption (``scheduler.preemption: swap | auto``) goes over the same links: a swap-out is a
device-to-host copy of the victim's blocks (`Scheduler.swap_blocks`: its computed tokens' blocks;
for a request that evicted tokens, the blocks it holds, its resident tokens' with soft-marked
slots; with speculative decoding, the blocks it holds, its last verify step's look-ahead ones too)
at the schedule that preempts it, within the node's swap space (`SwapSpace`; a victim that
does not fit is recomputed), and a swap-in a load like the others, starting no earlier than its
swap-out has arrived; the swap space is returned when the swap-in ends. A swapped request comes
back with the same computed and evicted tokens in the same number of blocks. ``auto`` swaps a
victim when copying those blocks out and back over idle links takes less than recomputing its
computed tokens in one prefill (the cost model's price; a request that evicted recomputes its whole
context, prompt and generated tokens, and trims again; queueing and prefix hits that would shorten
the recompute are not weighed).

The global pool (``kv.prefix_cache.scope: global``, `GlobalSide`) is fed with every entry an HBM
pool registers (`BlockStored`): published to the pool in the publisher's node DRAM over its D2H
link, as Mooncake stores a prefill's KV (or to dedicated pool nodes, below). A lookup continues
past HBM and local DRAM into the pool; an entry homed on another node is fetched by GPUDirect RDMA
into HBM, one read per home node through the home node's NIC egress and the requester's network
link at once (`kvsim.sim.links.reserve_through`; the home node's NIC on the requester's rail, its
NIC group of the same index, as rail-optimized fabrics wire NIC i of every node to one leaf), one
homed on this node over H2D, the transfers of a load in parallel; with ``fetch: auto`` a remote
entry is fetched only when that beats recomputing its tokens (the cost model's prefill price at
no context, against the idle path's transfer time), else the prefix stops there and the rest is
recomputed. With fair-shared links only the requester's link is charged (a transfer through two
fair-shared links is not modelled).

On dedicated pool nodes (``pool_nodes``, `kvsim.core.tiers.PoolNodes`; Mooncake Store on memory
servers of its own) both ends' NICs are charged: each pool node has an ingress and an egress
`LinkQueue` (its NICs together), each GPU NIC group an inbound (``network``) and an outbound
(``network_out``) one. A publication is one RDMA write per pool node its new entries are homed on,
from HBM through the publisher's egress and the pool node's ingress at once
(`kvsim.sim.links.reserve_through`: cut-through, both held together; no D2H copy, the GPU nodes'
DRAM holds nothing of the pool); a fetch one read per pool node, through its egress and the
requester's inbound link (of entries whose writes have arrived, as every load's).
Every pool entry is remote. A pool node's NICs carry a replica's whole blocks (every GPU's share),
a GPU NIC group its own GPUs' shares.

Fast-forward: a load's end is an outside event for the replica's windows (`next_event`,
`kvsim.core.horizon`): a window runs only the steps that end strictly before it. With write-back
offload, windows evict no cached entry (their allocations take empty blocks only), so every
eviction, and so every write-back, happens at a schedule, at the same instant in both modes; with
``write: through`` or the global pool a mixed window also stops before a prefill that registers
entries; with a cold threshold a window ends before the schedule at which the oldest cached-free
entry goes cold (`cold_steps_left`). A change of a tier's contents matters to a replica only
through the head of its waiting queue (the admission loop stops at the first request that does
not fit): a replica whose head's prefix holds a changed key is poked (its window cut, as for an
arrival), or, for the replica that wrote, its next step takes no window.

Fair-shared links (``cluster.topology.sharing: fair``, `kvsim.sim.links.FairLinkQueue`): a
transfer's end is known only when it comes, so the ``ready`` maps hold `Arrival`s instead of
instants, a load's parts start when the writes they read have arrived (the SSD's second hop when
its read has), and the request gets its KV at the last part's arrival, an event at URGENT
priority as above. Its replica's windows stop at a lower bound of its end while it waits (`next_event`: each part's
work at the whole bandwidth from the instant it asked) and the arrival pokes it, so both modes see the load
at the same schedule. ``load: overlap`` is refused with it (it needs the end at the start).

Bytes per transfer: blocks x the replica's KV block bytes per GPU x the replica's GPUs on that link
(its other GPUs move their shares in parallel over their own lanes); the SSD, per node, moves whole
replica blocks.

Design: docs/architecture.md ("With host-DRAM offload", "The run, assembled").
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import simpy
from simpy.events import URGENT

from kvsim.core.block_pool import BlockRemoved, BlockStored, PoolEvent
from kvsim.core.request import Request
from kvsim.core.sched.scheduler import Scheduler
from kvsim.core.tiers import GlobalPool, HostTier, PoolNodes
from kvsim.sim.links import Arrival, FairLinkQueue, LinkQueue, reserve_through, urgent_at
from kvsim.spec.offload import CopyMode, OffloadWrite

if TYPE_CHECKING:
    from kvsim.sim.kv_events import ReplicaSink


class _UrgentTimeout(simpy.events.Event):
    """A timeout at URGENT priority (as `kvsim.sim.cluster`'s arrivals)."""

    def __init__(self, env: simpy.Environment, delay: float) -> None:
        super().__init__(env)
        self._ok = True
        self._value = None
        env.schedule(self, URGENT, delay)


@dataclass
class SwapSpace:
    """A node's host memory for swapped-out KV, in KV blocks of its replicas (all their GPUs)."""

    capacity_blocks: int
    used_blocks: int = 0
    peak_blocks: int = 0


@dataclass
class SSDSide:
    """A node's NVMe tier below its DRAM tier, and the SSD's two links (one per direction)."""

    tier: HostTier
    read: LinkQueue
    write: LinkQueue
    block_bytes: float  # a replica's whole block (the SSD holds every GPU's share)
    ready: dict[int, Any]  # entry key -> instant its demotion is written (fair: its Arrival; pruned lazily)


@dataclass
class GlobalSide:
    """A replica's access to the cluster-wide pool."""

    pool: GlobalPool
    ready: dict[int, Any]  # entry key -> instant its publication arrives (fair: its Arrival; pruned lazily)
    net: LinkQueue  # the replica's network link (its first GPU's NIC group)
    net_block_bytes: float  # per block on that link
    node: int
    worth: Callable[[int], bool]  # fetch a remote entry of this many blocks rather than recompute it
    watchers: list[OffloadPort]  # every replica's port (a pool change can matter to any)
    # Dedicated pool nodes (``pool_nodes``; empty lists: the pool in the GPU nodes' DRAM): each pool
    # node's NIC ingress and egress (`pool_in`, `pool_out`, by pool node), the replica's network
    # egress (`out`, its first GPU's NIC group, the outbound direction of `net`), a replica's whole
    # block (all its GPUs' shares, which a pool node's NICs carry) and the home id of pool node 0.
    out: LinkQueue | None = None
    pool_in: list[LinkQueue] = field(default_factory=list)
    pool_out: list[LinkQueue] = field(default_factory=list)
    pool_block_bytes: float = 0.0
    first_pool: int = 0
    # The pool in the GPU nodes' DRAM with FIFO links: a home node's NIC egress on this replica's
    # rail (None: fair sharing, or pool nodes).
    home_out: Callable[[int], LinkQueue] | None = None


@dataclass
class OffloadStats:
    loads: int = 0
    loaded_blocks: int = 0
    loaded_tokens: int = 0  # tokens the loads let requests skip (at admission)
    first_admission_tokens: dict[int, int] = field(default_factory=dict)  # request id -> DRAM tokens
    first_admission_global: dict[int, int] = field(default_factory=dict)  # request id -> pool tokens
    fetched_blocks: int = 0  # of the loaded blocks, from the global pool
    remote_blocks: int = 0  # of those, from another node (over the network)
    fetched_tokens: int = 0
    declined: int = 0  # requests whose lookup stopped at a remote entry not worth fetching
    published_blocks: int = 0
    first_admission_ssd: dict[int, int] = field(default_factory=dict)  # request id -> SSD tokens
    ssd_written_blocks: int = 0
    ssd_loaded_blocks: int = 0
    written_blocks: int = 0  # blocks copied HBM -> DRAM
    swaps_out: int = 0
    swapped_blocks: int = 0  # copied out by swaps (and as many back in)
    recomputed: int = 0  # preemptions the swap policy sent to recompute
    waits: dict[int, float] = field(default_factory=dict)  # request id -> seconds waited for KV


@dataclass
class _LoadSources:
    """Where a load's blocks come from (`OffloadPort._sources`)."""

    host: int  # over H2D: local DRAM's, and the pool's homed on this node
    ssd: int  # the node's SSD's (read into DRAM, then over H2D)
    pool: int  # of all, the global pool's (here or remote)
    remote: int  # of those, the ones homed on another node (over the network)
    by_home: dict[int, int]  # remote blocks by home, where FIFO links charge its NIC egress too


# A transfer of a load over fair-shared links: (link, bytes, calls, the arrivals it waits for, and a
# second hop started when it arrives: the SSD's read, then PCIe).
_Part = tuple[LinkQueue, float, int, list[Arrival], tuple[LinkQueue, float, int] | None]


class ReplicaClock(Protocol):
    """What the parts built for a replica read of it (`kvsim.sim.replica.Replica`, which builds
    them with itself): its clock, the same float whether it steps or fast-forwards (env.now reaches
    an instant by different sums in the two modes), and its wake-up (`Replica.poke`)."""

    clock: float

    def poke(self, t: float) -> None: ...


class TierView:
    """What the tiers below a replica's HBM hold readable at its clock, DRAM first, then the SSD,
    then the pool: the scheduler's `TierLookup` (built before it, and given to it) and the source of
    each entry its port loads."""

    def __init__(
        self,
        env: simpy.Environment,
        replica: ReplicaClock,
        host: HostTier | None,
        ready: dict[int, Any],
        *,
        ssd: SSDSide | None,
        glob: GlobalSide | None,
        node: int,
        stats: OffloadStats,
    ) -> None:
        self.env = env
        self.replica = replica  # its clock: every lookup and transfer starts from it
        self.poke = replica.poke  # wakes the replica at the given instant, or cuts its window there
        self.host = host
        self.ready = ready  # the node's: entry key -> instant its write to DRAM arrives (pruned lazily)
        self.ssd = ssd
        self.glob = glob
        self.node = node
        self.stats = stats
        self._declined: dict[int, Sequence[int]] = {}  # requests (their keys) whose lookup declined
        # Arrivals of entries a lookup missed while in flight (`_watch`): instants, and fair Arrivals
        self._watched: set[float] = set()
        self.watch_heap: list[float] = []
        self._watched_arrivals: dict[int, Arrival] = {}

    @property
    def looks_up(self) -> bool:
        """Whether the replica has tiers below HBM to look prefixes up in."""
        return self.host is not None or self.glob is not None

    def num_prefix_hits(
        self,
        keys: Sequence[int],
        start: int,
        stop: int,
        *,
        count: bool = True,
        remote: list[int] | None = None,
    ) -> int:
        """Entries of ``keys[start:stop]`` readable below HBM, in order; with `remote` (the cache-aware
        router), ``remote[0]`` also gains the blocks of those a load would fetch over the network
        (pool entries homed on another node; every pool node's are).

        An entry whose write (to DRAM, the SSD or the pool) has not arrived is a miss, as a store in
        flight is in vLLM's OffloadingConnector (`lookup` counts ready blocks only), LMCache and
        Mooncake Store (an object is visible once its put completes): the lookup stops there. The
        scheduler's lookups (`count`) watch that arrival: the replica is poked then, and its
        fast-forward windows end before it (`OffloadPort.next_event`)."""
        now = self.replica.clock if count else self.env.now
        glob = self.glob
        n = 0
        for i in range(start, stop):
            k = keys[i]
            src = self.source(k, now, count)
            if src is None:
                break
            if src == "pool":
                assert glob is not None
                if glob.pool.home[k] != self.node:
                    size = glob.pool.entries[k]
                    if not glob.worth(size):
                        if count and id(keys) not in self._declined:
                            # Once per request (its keys' list): stepping looks a blocked head up at
                            # every step, fast-forward once per window, with the same outcome each time.
                            self._declined[id(keys)] = keys  # (kept alive, so the id is not reused)
                            self.stats.declined += 1
                        break
                    if remote is not None:
                        remote[0] += size
            n += 1
        return n

    def source(self, k: int, now: float, watch: bool = False) -> str | None:
        """The first tier that holds `k` readable at `now` (its write arrived): "dram", "ssd" or
        "pool"; None if none. With `watch`, a tier whose copy is still in flight watches its arrival."""
        host, ssd, glob = self.host, self.ssd, self.glob
        if host is not None and k in host.entries and self._readable(self.ready, k, now, watch):
            return "dram"
        if ssd is not None and k in ssd.tier.entries and self._readable(ssd.ready, k, now, watch):
            return "ssd"
        if glob is not None and k in glob.pool.entries and self._readable(glob.ready, k, now, watch):
            return "pool"
        return None

    def _readable(self, ready: dict[int, Any], k: int, now: float, watch: bool) -> bool:
        t = ready.get(k)
        if t is None:
            return True
        if isinstance(t, Arrival):
            if t.t is not None and t.t <= now:
                return True
            if watch:
                if t.t is not None:
                    self._watch(t.t)
                elif id(t) not in self._watched_arrivals:
                    self._watched_arrivals[id(t)] = t
                    t.waiters.append(functools.partial(self._arrival_ready, t))
            return False
        if t <= now:
            return True
        if watch:
            self._watch(t)
        return False

    def _watch(self, t: float) -> None:
        """A lookup missed an entry readable from `t`: poke the replica then (it wakes if idle, its
        window is cut), and end its windows before it (`next_watched`)."""
        if t in self._watched:
            return
        self._watched.add(t)
        heapq.heappush(self.watch_heap, t)
        ev = urgent_at(self.env, t)
        ev.callbacks.append(functools.partial(self._ready_event, t))

    def _ready_event(self, t: float, _ev: simpy.events.Event) -> None:
        self._watched.discard(t)
        self.poke(t)

    def _arrival_ready(self, a: Arrival) -> None:
        del self._watched_arrivals[id(a)]
        assert a.t is not None
        self.poke(a.t)

    def next_watched(self, now: float) -> float:
        """The earliest arrival after `now` of an entry a lookup missed while in flight (inf: none)."""
        heap = self.watch_heap
        while heap and heap[0] <= now:
            heapq.heappop(heap)
        return heap[0] if heap else math.inf

    def touch(self, keys: Sequence[int]) -> int:
        now = self.replica.clock
        blocks = 0
        for k in keys:
            where = self.source(k, now)
            if where == "dram":
                assert self.host is not None
                blocks += self.host.touch((k,))
            elif where == "ssd":
                assert self.ssd is not None
                blocks += self.ssd.tier.touch((k,))
            else:
                assert self.glob is not None and where == "pool"
                blocks += self.glob.pool.touch((k,))
        return blocks

    def check(self) -> None:
        if self.host is not None:
            self.host.check()
        if self.ssd is not None:
            self.ssd.tier.check()
        if self.glob is not None:
            self.glob.pool.check()
            assert self.glob.pool.entries.keys() <= self.glob.pool.home.keys()


class SwapPolicy:
    """A replica's `SwapDecider` (``scheduler.preemption: swap | auto``): a victim is swapped when it
    has KV, its blocks fit its node's swap space, and (``auto``) copying them out and back is the
    cheaper (`cheaper`, built by `kvsim.sim.offload_wiring`); else it is recomputed (counted)."""

    def __init__(
        self, space: SwapSpace, cheaper: Callable[[Request, int], bool], stats: OffloadStats
    ) -> None:
        self.space = space
        self.cheaper = cheaper
        self.stats = stats

    def __call__(self, req: Request, blocks: int, /) -> bool:
        space = self.space
        ok = blocks > 0 and space.used_blocks + blocks <= space.capacity_blocks and self.cheaper(req, blocks)
        if ok:
            space.used_blocks += blocks  # held from now until its swap-in ends
            space.peak_blocks = max(space.peak_blocks, space.used_blocks)
        else:
            self.stats.recomputed += 1
        return ok


@dataclass
class ReplicaTiers:
    """A replica's side of the tiers below HBM, built before its scheduler
    (`kvsim.sim.offload_wiring.OffloadWiring.side`): its node, its PCIe lanes (one queue per
    direction, and its GPUs on each), its access to the global pool, and what its scheduler is
    given: the lookup (`TierView`) and the swap decision (None: off). Its port is built over it."""

    node: int
    h2d: LinkQueue
    d2h: LinkQueue
    h2d_block_bytes: float  # per-GPU block bytes x the replica's GPUs on that lane
    d2h_block_bytes: float
    glob: GlobalSide | None
    view: TierView
    swap: SwapPolicy | None
    stats: OffloadStats
    # What a token loaded from a lower tier costs against computing it (the cache-aware router):
    # over H2D (DRAM, the SSD through DRAM, the pool on this node), and over the network (the
    # pool on another node or on a pool node; None: as over H2D).
    load_weight: float = 0.0
    remote_weight: float | None = None

    @property
    def lookup(self) -> TierView | None:
        """The scheduler's `TierLookup` (None: no tier to load prefixes from)."""
        return self.view if self.view.looks_up else None


class OffloadPort:
    def __init__(
        self,
        env: simpy.Environment,
        sched: Scheduler,
        side: ReplicaTiers,
        *,
        write: OffloadWrite,
        copy: CopyMode,
        cold_after_steps: int = 0,
        overlap: Callable[[int, int], float] | None = None,
        kv_events: ReplicaSink | None = None,
        node_ports: list[OffloadPort] | None = None,
        sampled: list[tuple[str, HostTier]] | None = None,
        links_to_sample: Callable[[], list[LinkQueue]] | None = None,
    ) -> None:
        self.env = env
        # The replica's KV events (``kvsim run --kv-events``; None: not written): its node's DRAM
        # and SSD changes its writes make, and the stamp of a load's entries cached at its arrival.
        self.kv_events = kv_events
        self.sched = sched
        view = self.view = side.view
        self.replica, self.poke = view.replica, view.poke
        self.node, self.stats = side.node, side.stats
        self.host, self.ready, self.ssd, self.glob = view.host, view.ready, view.ssd, view.glob
        self.h2d, self.d2h = side.h2d, side.d2h
        self.h2d_block_bytes, self.d2h_block_bytes = side.h2d_block_bytes, side.d2h_block_bytes
        self.write = write
        self.per_block = copy is CopyMode.PER_BLOCK
        self.pending: dict[int, tuple[float, Request]] = {}  # request id -> (load end, request)
        # Writes to DRAM and to the SSD: (the instant they arrive, or their fair Arrival; blocks)
        self.write_log: list[tuple[Any, int]] = []
        self.ssd_write_log: list[tuple[Any, int]] = []
        # The ports of the node's replicas, this one's among them (their DRAM tier is shared).
        self.node_ports: list[OffloadPort] = [self] if node_ports is None else node_ports
        self.tier_changed = False  # the last after_schedule changed the tier's contents
        self.swap_ready: dict[int, Any] = {}  # request id -> instant its swap-out arrives (fair: Arrival)
        self.swap_space = None if side.swap is None else side.swap.space
        self.fair = isinstance(self.h2d, FairLinkQueue)  # cluster.topology.sharing: fair
        self.cold_after_steps = cold_after_steps
        # ``load: overlap``: seconds of a prefill of (tokens, cached tokens) alone, which a load hides
        self.overlap = overlap
        # Occupancy over time of the tiers this port samples (its node's, the pool for one port):
        # (t, tier name, blocks used).
        self.sampled = [] if sampled is None else sampled
        self.samples: list[tuple[float, str, int]] = []
        # Traffic over time of every link of the run (sampled by one port): (t, link, bytes and busy
        # seconds of the transfers asked for so far).
        self.links_to_sample = links_to_sample
        self.link_samples: list[tuple[float, str, float, float]] = []
        # The cache-aware router's price of a loaded token, in computed tokens (`ReplicaTiers`)
        self.load_weight = side.load_weight
        self.remote_weight = side.load_weight if side.remote_weight is None else side.remote_weight

    def _changed(self, keys: set[int], watchers: list[OffloadPort], now: float) -> None:
        """Tier contents under `keys` changed: replicas whose waiting head's prefix holds one of them
        would admit differently at their next schedule."""
        for p in watchers:
            sched = p.sched
            if not sched.waiting or sched.swapped:
                continue
            head = sched.waiting[0]
            if any(k in keys for k in head.keys):
                if p is self:
                    self.tier_changed = True
                else:
                    p.poke(now)

    @property
    def writes_back(self) -> bool:
        """Whether an eviction from HBM copies the entry below (then windows must not evict)."""
        return self.host is not None and self.write is OffloadWrite.BACK

    @property
    def publishes_on_register(self) -> bool:
        """Whether registering an entry in HBM copies it below (write-through, the global pool)."""
        return (self.host is not None and self.write is OffloadWrite.THROUGH) or self.glob is not None

    def next_event(self) -> float:
        """The end of the earliest load in flight, or the arrival of an entry a lookup missed while
        it was in flight (inf when none)."""
        t = self.view.next_watched(self.replica.clock)
        if not self.pending:
            return t
        return min(t, min(t for t, _ in self.pending.values()))

    def after_schedule(self) -> None:
        now = self.replica.clock
        sched = self.sched
        self.tier_changed = False
        cold: list[int] = []
        if self.cold_after_steps:  # cached entries untouched for that many steps move down
            cold = sched.kv.pool.drop_cold(sched.num_steps - self.cold_after_steps)
        # Loads first: they read the entries the scheduler found, before this schedule's writes
        # make room (a load in flight keeps its source, as the real systems pin it).
        if sched.new_loads:
            loads, sched.new_loads = sched.new_loads, []
            for req, hits, n in loads:
                self._load(now, req, hits, n)
        if sched.new_swaps:
            swaps, sched.new_swaps = sched.new_swaps, []
            for req, blocks, out in swaps:
                self._swap(now, req, blocks, out)
        events = sched.kv.pool.take_events()
        if events and self.host is not None:
            self._write(now, events)
        if cold:  # after this schedule's admissions, a waiting head's HBM hits moved down a tier
            self._changed(set(cold), [self], now)
        if events and self.glob is not None:
            self._publish(now, events)

    def _publish(self, now: float, events: list[PoolEvent]) -> None:
        glob = self.glob
        assert glob is not None
        keys, sizes = _entries(events, BlockStored)
        if not keys:
            return
        new = glob.pool.publish(keys, sizes, glob.node)
        for k in glob.pool.last_dropped:
            glob.ready.pop(k, None)
        if not new:
            return
        blocks = sum(s for _, s in new)
        if glob.pool_in:
            self._publish_to_pool_nodes(now)
        else:
            end = self._send(self.d2h, now, blocks * self.d2h_block_bytes, blocks if self.per_block else 1)
            for k, _ in new:
                glob.ready[k] = end
        self.stats.published_blocks += blocks
        self._changed({*keys, *glob.pool.last_dropped}, glob.watchers, now)

    def _publish_to_pool_nodes(self, now: float) -> None:
        """RDMA writes of the entries the pool just took in, from this replica's HBM to their pool
        nodes: one transfer per pool node (in node order), each through the replica's NIC egress
        and the pool node's NIC ingress at once (`reserve_through`)."""
        glob = self.glob
        assert glob is not None and glob.out is not None
        pool = glob.pool
        assert isinstance(pool, PoolNodes)
        out, pool_in, ready = glob.out, glob.pool_in, glob.ready
        per_gpu, whole = glob.net_block_bytes, glob.pool_block_bytes
        for j, part in pool.last_by_node:
            nb = sum(s for _, s in part)
            end = reserve_through(
                out, pool_in[j], now, nb * per_gpu, nb if self.per_block else 1, nb * whole
            )[1]
            for k, _ in part:
                ready[k] = end

    def _swap(self, now: float, req: Request, blocks: int, out: bool) -> None:
        calls = blocks if self.per_block else 1
        if out:
            self.swap_ready[req.id] = self._send(self.d2h, now, blocks * self.d2h_block_bytes, calls)
            self.stats.swaps_out += 1
            self.stats.swapped_blocks += blocks
            return
        if self.fair:
            self._fair_load(
                now,
                req,
                blocks,
                [(self.h2d, blocks * self.h2d_block_bytes, calls, [self.swap_ready.pop(req.id)], None)],
            )
            return
        start = max(now, self.swap_ready.pop(req.id))
        _, end = self.h2d.reserve(start, blocks * self.h2d_block_bytes, calls)
        self._await(now, end, req, blocks)

    def _write(self, now: float, events: list[PoolEvent]) -> None:
        keys, sizes = _entries(events, BlockRemoved if self.write is OffloadWrite.BACK else BlockStored)
        if not keys:
            return
        assert self.host is not None
        new = self.host.insert(keys, sizes)
        if not new:
            return
        # What the node's waiting requests find in DRAM changed: this replica's next schedule (no
        # window now, `Replica._window`) and the node's other replicas' (poked) see it.
        dropped, dropped_sizes = self.host.last_dropped, self.host.last_dropped_sizes
        changed = {*keys, *dropped}
        blocks = sum(s for _, s in new)
        end = self._send(self.d2h, now, blocks * self.d2h_block_bytes, blocks if self.per_block else 1)
        ready = self.ready
        # A dropped entry's demotion reads its DRAM copy: not before that has arrived (FIFO links)
        demote_at = max((t for k in dropped if isinstance(t := ready.pop(k, now), float)), default=now)
        for k, _ in new:
            ready[k] = end
        self.stats.written_blocks += blocks
        self.write_log.append((end, blocks))
        if self.kv_events is not None:
            self._tier_events(now, self.host, new, dropped, "CPU")
        ssd = self.ssd
        if ssd is not None and dropped:  # what DRAM drops is demoted to the node's SSD
            down = ssd.tier.insert(dropped, dropped_sizes)
            if self.kv_events is not None:
                self._tier_events(now, ssd.tier, down, ssd.tier.last_dropped, "DISK")
            changed.update(ssd.tier.last_dropped)
            for k in ssd.tier.last_dropped:
                ssd.ready.pop(k, None)
            if down:
                nb = sum(s for _, s in down)
                end2 = self._send(ssd.write, max(now, demote_at), nb * ssd.block_bytes, 1)
                for k, _ in down:
                    ssd.ready[k] = end2
                self.stats.ssd_written_blocks += nb
                self.ssd_write_log.append((end2, nb))
        # What the node's waiting requests find below HBM changed: this replica's next schedule (no
        # window now, `Replica._window`) and the node's other replicas' (poked) see it.
        self._changed(changed, self.node_ports, now)

    def _tier_events(
        self, now: float, tier: HostTier, new: list[tuple[int, int]], dropped: list[int], medium: str
    ) -> None:
        """KV events of one insert into a node's tier, by what it holds after it: the entries it
        dropped (and holds no more), then the new ones it still holds (an insert can drop an
        entry it took in earlier in the same call). The room is taken at the write's asking."""
        log = self.kv_events
        assert log is not None
        held = tier.entries
        log.log.removed(now, log.rank, list(dict.fromkeys(k for k in dropped if k not in held)), medium)
        kept = [(k, s) for k, s in new if k in held]
        if kept:
            keys, sizes = zip(*kept, strict=True)
            log.log.stored(now, log.rank, keys, sizes, None, medium)

    @staticmethod
    def arrived_by(logs: Sequence[tuple[Any, int]], t: float) -> int:
        """Blocks of the logged writes whose data had arrived by `t`."""
        return sum(b for a, b in logs if _arrival_t(a) <= t)

    @staticmethod
    def readable_blocks(tier: HostTier, ready: dict[int, Any], t: float) -> int:
        """Blocks of `tier`'s entries readable at `t` (their writes arrived)."""
        return sum(size for k, size in tier.entries.items() if _arrival_t(ready.get(k)) <= t)

    def sample(self, t: float) -> None:
        for name, tier in self.sampled:
            self.samples.append((t, name, tier.used_blocks))
        if self.links_to_sample is not None:
            for q in self.links_to_sample():
                self.link_samples.append((t, q.label, q.stats.bytes, q.busy_within(t)))

    def cold_steps_left(self) -> int | None:
        """Steps until the schedule at which the oldest cached-free HBM entry goes cold (a window
        must end there, so that it moves down at the same step as stepping's); None: never."""
        if not self.cold_after_steps:
            return None
        stamp = self.sched.kv.pool.oldest_unreferenced_stamp()
        if stamp is None:
            return None
        return stamp + self.cold_after_steps + 1 - self.sched.num_steps

    def _send(self, q: LinkQueue, now: float, nbytes: float, calls: int) -> Any:
        """A transfer with no prerequisite: the instant its data arrive (fair: its Arrival)."""
        if isinstance(q, FairLinkQueue):
            return q.submit(now, nbytes, calls)
        return q.reserve(now, nbytes, calls)[1]

    def _fair_load(
        self,
        now: float,
        req: Request,
        swap_blocks: int,
        parts: list[_Part],
    ) -> None:
        """A load over fair-shared links: each part (link, bytes, calls, the arrivals it waits for,
        and a second hop started when the first arrives: the SSD read, then PCIe) starts when its
        prerequisites have arrived; the request gets its KV when every part has."""
        left = [len(parts)]
        ends = [now]
        s = self.stats
        s.waits[req.id] = s.waits.get(req.id, 0.0)
        # Its end is not known yet; no part can end before its own work at the whole bandwidth (a
        # lower bound: sharing and waiting only delay it), so windows may run to there.
        lb = now
        for q, nbytes, calls, _, then in parts:
            t = now + q.occupancy(nbytes, calls) + q.link.latency_s
            if then is not None:
                t += then[0].occupancy(then[1], then[2]) + then[0].link.latency_s
            lb = max(lb, t)
        self.pending[req.id] = (lb, req)

        def arrived(a: Arrival) -> None:
            assert a.t is not None
            ends.append(a.t)
            left[0] -= 1
            if left[0] == 0:
                end = max(ends)
                s.waits[req.id] += end - now
                self._arrived(req, swap_blocks, end)

        def start(
            q: LinkQueue, nbytes: float, calls: int, then: tuple[LinkQueue, float, int] | None, t: float
        ) -> None:
            assert isinstance(q, FairLinkQueue)
            a = q.submit(t, nbytes, calls)
            if then is None:
                a.waiters.append(lambda: arrived(a))
            else:
                a.waiters.append(lambda: start(*then, None, a.t if a.t is not None else t))

        for q, nbytes, calls, deps, then in parts:
            self._after(deps, now, functools.partial(start, q, nbytes, calls, then))

    def _after(self, deps: list[Arrival], now: float, fn: Callable[[float], None]) -> None:
        """Call ``fn(t)`` at `t`, the instant every arrival in `deps` has happened (`now` at least):
        at once if that is now, from the last arrival's event if it is that one's, else from an
        event at `t` (an arrival whose instant is known but ahead)."""
        pend = [d for d in deps if d.t is None]
        known = max((d.t for d in deps if d.t is not None), default=now)

        def go(t0: float) -> None:
            if known > t0:
                ev = urgent_at(self.env, known)
                ev.callbacks.append(lambda _e: fn(known))
            else:
                fn(t0)

        if not pend:
            go(now)
            return
        left = [len(pend)]

        def one() -> None:
            left[0] -= 1
            if left[0] == 0:
                go(max(now, *(d.t for d in pend if d.t is not None)))

        for d in pend:
            d.waiters.append(one)

    def _load(self, now: float, req: Request, hits: int, n: int) -> None:
        """Start the load of `req`'s entries ``hits .. hits + n`` from where each is readable: one
        URGENT event at the end of its last transfer hands it to the scheduler."""
        src = self._sources(now, req, hits, n)
        skipped = self._count_load(now, req, hits, n, src)
        if self.fair:  # the ends are not known yet (`load: overlap` is refused with fair sharing)
            parts = self._fair_parts(src)
            if parts:
                self._fair_load(now, req, 0, parts)
            else:
                self._await(now, now, req, 0)
            return
        end = self._fifo_end(now, src)
        if self.overlap is not None:  # layer by layer behind the prefill: wait only for the excess
            computed = req.key_cum[hits] * self.sched.block_size + skipped
            chunk = min(req.num_tokens - computed, self.sched.max_batched_tokens)
            end = max(now, end - self.overlap(chunk, computed))
        self._await(now, end, req, 0)

    def _sources(self, now: float, req: Request, hits: int, n: int) -> _LoadSources:
        """The blocks of the entries to load by where each is readable at `now` (the lookup's
        source, where its write has arrived: no part of a load waits for a write)."""
        cum, keys, source, glob, node = req.key_cum, req.keys, self.view.source, self.glob, self.node
        # Remote blocks by home where FIFO links charge the home's NIC egress too (pool nodes, or
        # the GPU nodes' rails)
        through = glob is not None and (bool(glob.pool_out) or glob.home_out is not None)
        host = ssd = pool = remote = 0
        by_home: dict[int, int] = {}
        for i in range(hits, hits + n):
            k = keys[i]
            size = cum[i + 1] - cum[i]
            where = source(k, now)
            if where == "dram":
                host += size
            elif where == "ssd":
                ssd += size
            else:
                assert glob is not None and where == "pool"
                pool += size
                j = glob.pool.home[k]
                if j == node:
                    host += size
                    continue
                remote += size
                if through:
                    by_home[j] = by_home.get(j, 0) + size
        return _LoadSources(host, ssd, pool, remote, by_home)

    def _count_load(self, now: float, req: Request, hits: int, n: int, src: _LoadSources) -> int:
        """Count a load in the stats (its request's first admission's tokens by tier too); returns
        the tokens its entries let the request skip."""
        cum, bs = req.key_cum, self.sched.block_size
        skipped = min(cum[hits + n], (req.num_tokens - 1) // bs) * bs - cum[hits] * bs
        from_pool = min(src.pool * bs, skipped)  # tokens the pool gave (the cap trims the local part)
        from_ssd = min(src.ssd * bs, skipped - from_pool)
        s = self.stats
        s.loads += 1
        s.loaded_blocks += cum[hits + n] - cum[hits]
        s.ssd_loaded_blocks += src.ssd
        s.loaded_tokens += skipped - from_pool - from_ssd
        s.fetched_blocks += src.pool
        s.remote_blocks += src.remote
        s.fetched_tokens += from_pool
        if req.num_cached_tokens < 0:
            s.first_admission_tokens[req.id] = skipped - from_pool - from_ssd
            s.first_admission_global[req.id] = from_pool
            s.first_admission_ssd[req.id] = from_ssd
        if req.first_scheduled_s != req.first_scheduled_s:  # NaN: first time
            req.first_scheduled_s = now
        return skipped

    def _fair_parts(self, src: _LoadSources) -> list[_Part]:
        """A load's transfers over fair-shared links: DRAM's over H2D, the SSD's read then H2D,
        remote entries over the network link (fair sharing charges only the requester's link)."""
        pb = self.per_block
        parts: list[_Part] = []
        if src.host:
            parts.append((self.h2d, src.host * self.h2d_block_bytes, src.host if pb else 1, [], None))
        if src.ssd:
            ssd = self.ssd
            assert ssd is not None
            hop = (self.h2d, src.ssd * self.h2d_block_bytes, src.ssd if pb else 1)
            parts.append((ssd.read, src.ssd * ssd.block_bytes, 1, [], hop))
        if src.remote:
            glob = self.glob
            assert glob is not None
            parts.append((glob.net, src.remote * glob.net_block_bytes, src.remote if pb else 1, [], None))
        return parts

    def _fifo_end(self, now: float, src: _LoadSources) -> float:
        """A load's end over FIFO links, its transfers reserved from `now` and run in parallel: DRAM's
        over H2D; the SSD's read, then H2D; remote entries from each home through its NIC egress and
        this replica's network link at once (`reserve_through`), or over the network link alone."""
        pb = self.per_block
        end = now
        if src.host:
            end = self.h2d.reserve(now, src.host * self.h2d_block_bytes, src.host if pb else 1)[1]
        if src.ssd:  # read from the SSD into DRAM, then over PCIe
            ssd = self.ssd
            assert ssd is not None
            read_end = ssd.read.reserve(now, src.ssd * ssd.block_bytes, 1)[1]
            end = max(
                end, self.h2d.reserve(read_end, src.ssd * self.h2d_block_bytes, src.ssd if pb else 1)[1]
            )
        glob = self.glob
        if src.by_home:
            assert glob is not None
            for j in sorted(src.by_home):
                nb = src.by_home[j]
                if glob.pool_out:  # a pool node's NICs carry every GPU's share
                    q, q_bytes = glob.pool_out[j - glob.first_pool], nb * glob.pool_block_bytes
                else:  # a GPU node's NIC on this replica's rail carries its GPUs' shares
                    assert glob.home_out is not None
                    q, q_bytes = glob.home_out(j), nb * glob.net_block_bytes
                _, e = reserve_through(q, glob.net, now, q_bytes, nb if pb else 1, nb * glob.net_block_bytes)
                end = max(end, e)
        elif src.remote:
            assert glob is not None
            end = max(
                end, glob.net.reserve(now, src.remote * glob.net_block_bytes, src.remote if pb else 1)[1]
            )
        return end

    def _await(self, now: float, end: float, req: Request, swap_blocks: int) -> None:
        """`req` waits for KV until `end`: one URGENT event then."""
        s = self.stats
        s.waits[req.id] = s.waits.get(req.id, 0.0) + (end - now)
        self.pending[req.id] = (end, req)
        ev = _UrgentTimeout(self.env, max(0.0, end - self.env.now))
        ev.callbacks.append(lambda _e: self._arrived(req, swap_blocks, end))

    def _arrived(self, req: Request, swap_blocks: int, end: float) -> None:
        del self.pending[req.id]
        if swap_blocks:
            assert self.swap_space is not None
            self.swap_space.used_blocks -= swap_blocks
        sink = self.kv_events
        if sink is not None:
            sink.at = end  # its entries are cached now, mid-step: at the arrival, in both modes
            self.sched.finish_load(req)
            sink.at = None
        else:
            self.sched.finish_load(req)
        self.poke(end)


def _entries(
    events: list[PoolEvent], kind: type[BlockStored] | type[BlockRemoved]
) -> tuple[list[int], list[int]]:
    """The keys and sizes of the entries of `events` of one kind, in order."""
    keys: list[int] = []
    sizes: list[int] = []
    for ev in events:
        if isinstance(ev, kind):
            keys.extend(ev.keys)
            sizes.extend(ev.sizes)
    return keys, sizes


def _arrival_t(a: Any) -> float:
    """The instant a write's data arrive: its float, its fair Arrival's (inf until known), or
    -inf for none (an entry whose write has been forgotten arrived long ago)."""
    if a is None:
        return -math.inf
    if isinstance(a, Arrival):
        return math.inf if a.t is None else a.t
    return float(a)

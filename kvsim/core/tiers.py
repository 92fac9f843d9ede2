"""Tiers below HBM, pure bookkeeping: a node's host-DRAM store of prefix-cache entries.

A `HostTier` is a second-level prefix cache: cache entries (the same keys and sizes as the HBM
pool's, `kvsim.core.block_pool`) copied to a node's host DRAM, shared by the node's replicas
(they run the same model with the same tensor-parallel layout, so a block one wrote another can
load, as LMCache's local CPU backend and SGLang HiCache's host pool share a host). Capacity is in
blocks of the replicas' layout; an insert that does not fit drops the least recently used
entries (``eviction: lru``, the default, as vLLM's offloading manager, SGLang HiCache's host radix
tree and LMCache's local CPU backend do), or the least frequently used (``eviction: lfu``: fewest
uses since the entry came in, the least recently used of those first; the issue's pool eviction
"LRU, LFU"). A use is the insert that brings an entry in, a lookup that loads it (`touch`) and an
insert of an entry already present (another write or publication of the same block). An entry
dropped and inserted again starts from one use: no history of dropped entries is kept, and counts
do not age (an entry used often long ago outlives newer ones, LFU's known weakness). LFU costs O(1)
per operation: entries sit in one insertion-ordered bucket per use count, and the counts present
form a linked list in increasing order, so the victim is the first entry of the first bucket. Entries have copy semantics: an entry loaded back into HBM
stays here too, so writing it back again when HBM evicts it costs nothing.

A `GlobalPool` is the same store cluster-wide (``kv.prefix_cache.scope: global``, as Mooncake
Store keeps prefix KV in the DRAM of every node): each entry also knows its home node, whose DRAM
holds it, so a fetch from another node crosses the network. One LRU (or LFU) over the whole pool.
`PoolNodes` is the pool on dedicated pool nodes (``pool_nodes``): each node its own DRAM and LRU.

The scheduler asks a `TierLookup` (the shell's view of a replica's lower tiers, local DRAM then the
global pool) how far a prefix continues below HBM, and a `SwapDecider` whether a preempted victim's
KV goes to host memory; both are given when it is built (None: off).

What time the copies take is the SimPy shell's business (`kvsim.sim.offload`, over the links of
`kvsim.sim.links`): this module knows no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvsim.core.request import Request


class TierLookup(Protocol):
    """What the scheduler asks of the tiers below a replica's HBM."""

    def num_prefix_hits(self, keys: Sequence[int], start: int, stop: int) -> int:
        """Entries ``keys[start:stop]`` the tiers hold (and that are worth loading), a leading run."""
        ...

    def touch(self, keys: Sequence[int]) -> int:
        """Mark the entries used; returns the blocks they cover."""
        ...


class SwapDecider(Protocol):
    """Whether the scheduler swaps a preempted victim out to host memory (else it is recomputed)."""

    def __call__(self, req: Request, blocks: int) -> bool:
        """Swap `req`, whose swap-out copies `blocks` blocks (`Scheduler.swap_blocks`)? A yes holds
        the room for them until its swap-in ends."""
        ...


@dataclass
class TierStats:
    inserted_blocks: int = 0  # blocks copied in
    dropped_blocks: int = 0  # blocks dropped to make room (LRU)
    hit_blocks: int = 0  # blocks found by lookups that then loaded them
    peak_blocks: int = 0


EVICTIONS = ("lru", "lfu")


class HostTier:
    def __init__(self, capacity_blocks: int, *, name: str = "dram", eviction: str = "lru") -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be positive, got {capacity_blocks}")
        if eviction not in EVICTIONS:
            raise ValueError(f"eviction must be one of {EVICTIONS}, got {eviction!r}")
        self.name = name
        self.lfu = eviction == "lfu"
        # LFU: key -> uses; use count -> its entries, least recently used first; the counts present
        # as a circular doubly linked list through the sentinel 0, in increasing order.
        self.uses: dict[int, int] = {}
        self._bucket: dict[int, OrderedDict[int, None]] = {}
        self._next: dict[int, int] = {0: 0}
        self._prev: dict[int, int] = {0: 0}
        self.capacity_blocks = capacity_blocks
        self.used_blocks = 0
        self.entries: OrderedDict[int, int] = OrderedDict()  # key -> blocks, least recent first
        self.stats = TierStats()
        self.last_dropped: list[int] = []  # keys the last insert dropped
        self.last_dropped_sizes: list[int] = []  # and their blocks

    def __contains__(self, key: int) -> bool:
        return key in self.entries

    def num_prefix_hits(self, keys: Sequence[int], start: int, stop: int) -> int:
        """Entries ``keys[start:stop]`` present here, as a leading run."""
        entries = self.entries
        n = 0
        for i in range(start, stop):
            if keys[i] not in entries:
                break
            n += 1
        return n

    def touch(self, keys: Sequence[int]) -> int:
        """Mark entries used (most recent last); returns the blocks they cover."""
        entries = self.entries
        blocks = 0
        for k in keys:
            if self.lfu:
                self._use(k)
            else:
                entries.move_to_end(k)
            blocks += entries[k]
        return blocks

    # ---- LFU bookkeeping, O(1) each ----------------------------------------------------------------
    def _link_after(self, f: int, g: int) -> None:
        """Put the use count `g` (absent) right after `f` (present) in the list."""
        n = self._next[f]
        self._next[f] = g
        self._prev[g] = f
        self._next[g] = n
        self._prev[n] = g

    def _leave(self, k: int, f: int) -> None:
        """Take `k` out of the bucket of count `f`; a bucket left empty leaves the list."""
        b = self._bucket[f]
        del b[k]
        if not b:
            del self._bucket[f]
            p, n = self._prev.pop(f), self._next.pop(f)
            self._next[p] = n
            self._prev[n] = p

    def _enter(self, k: int, f: int, after: int) -> None:
        """Put `k` last into the bucket of count `f`, created right after `after` if absent."""
        b = self._bucket.get(f)
        if b is None:
            b = self._bucket[f] = OrderedDict()
            self._link_after(after, f)
        b[k] = None
        self.uses[k] = f

    def _use(self, k: int) -> None:
        f = self.uses[k]
        self._enter(k, f + 1, f)  # before leaving f, so that f is still in the list to link after
        self._leave(k, f)

    def _drop_lfu(self) -> tuple[int, int]:
        """Take out LFU's victim, the oldest entry of the lowest count's bucket: (key, blocks)."""
        nxt = self._next
        f = nxt[0]
        b = self._bucket[f]
        old, _ = b.popitem(last=False)
        if not b:  # (`_leave`, inlined: one call per victim)
            del self._bucket[f]
            n = nxt.pop(f)
            del self._prev[f]
            nxt[0] = n
            self._prev[n] = 0
        del self.uses[old]
        return old, self.entries.pop(old)

    def insert(self, keys: Sequence[int], sizes: Sequence[int]) -> list[tuple[int, int]]:
        """Copy entries in (those present are only touched). Returns (key, blocks) of the entries
        newly inserted, the ones a transfer must move; an entry larger than the tier is skipped.
        The victim is the least recently used entry, or under LFU the oldest of the lowest count's
        bucket (a new entry joins the bucket of count one)."""
        entries = self.entries
        cap = self.capacity_blocks
        lfu = self.lfu
        used = self.used_blocks
        new: list[tuple[int, int]] = []
        dropped: list[int] = []
        dropped_sizes: list[int] = []
        self.last_dropped = dropped
        self.last_dropped_sizes = dropped_sizes
        for k, s in zip(keys, sizes, strict=True):
            if k in entries:
                if lfu:
                    self._use(k)
                else:
                    entries.move_to_end(k)
                continue
            if s > cap:
                continue
            while used + s > cap:
                old, size = self._drop_lfu() if lfu else entries.popitem(last=False)
                dropped.append(old)
                dropped_sizes.append(size)
                used -= size
            entries[k] = s
            if lfu:
                self._enter(k, 1, 0)
            used += s
            new.append((k, s))
        self.used_blocks = used
        if dropped_sizes:
            self.stats.dropped_blocks += sum(dropped_sizes)
        if new:
            self.stats.inserted_blocks += sum(s for _, s in new)
            if used > self.stats.peak_blocks:
                self.stats.peak_blocks = used
        return new

    def check(self) -> None:
        """Invariants (property tests): within capacity, counts agree, every entry counted once."""
        assert 0 <= self.used_blocks <= self.capacity_blocks
        assert self.used_blocks == sum(self.entries.values())
        assert all(s > 0 for s in self.entries.values())
        if self.lfu:  # every entry in exactly one bucket, its count's; the list the counts in order
            assert self.uses.keys() == self.entries.keys()
            assert sum(len(b) for b in self._bucket.values()) == len(self.entries)
            assert all(self.uses[k] == f for f, b in self._bucket.items() for k in b)
            order, f = [], self._next[0]
            while f != 0:
                order.append(f)
                f = self._next[f]
            assert order == sorted(self._bucket) and len(self._next) == len(order) + 1


class GlobalPool(HostTier):
    """A cluster-wide `HostTier` whose entries each live in one node's DRAM (``home``)."""

    def __init__(self, capacity_blocks: int, *, eviction: str = "lru") -> None:
        super().__init__(capacity_blocks, name="global", eviction=eviction)
        self.home: dict[int, int] = {}

    def publish(self, keys: Sequence[int], sizes: Sequence[int], node: int) -> list[tuple[int, int]]:
        """Insert entries homed at `node` (present ones only touched); returns those inserted."""
        new = self.insert(keys, sizes)
        home = self.home
        for k, _ in new:
            home[k] = node
        if len(home) > 2 * len(self.entries) + 1024:  # forget the homes of dropped entries
            self.home = {k: home[k] for k in self.entries}
        return new


class PoolNodes(GlobalPool):
    """The cluster-wide pool on dedicated pool nodes (``kv.prefix_cache.pool_nodes``), each with
    its own DRAM (`shards`, one `HostTier` per node, LRU or LFU within it, as a memory server
    evicts from its own memory) and its own NICs (the shell's business).

    An entry is homed on pool node ``spread(key) mod N`` (`home` holds ``first_home + that``, ids
    after the GPU nodes', so every pool entry is remote to every replica). Why by key: any GPU finds
    an entry's home from the key alone, as a hash-partitioned store does; it depends on nothing but
    the key, so one seed gives one placement; and the nodes fill evenly in expectation, a prefix's
    blocks spread over them (Mooncake stripes its objects over nodes and NICs the same way). Keys
    are trace ids, often consecutive, and private keys whose low bits are all zero
    (`kvsim.core.block_hash`): `spread`, a Fibonacci (multiplicative) hash, mixes them first. Least-full
    placement was the alternative: in steady state every node is full, its ties would send every
    entry to the same node. Each node evicting its own LRU approximates one LRU over the whole
    pool (each sees about 1/N of the stream), so hit rates stay close to the in-DRAM pool's of the
    same capacity. `entries` is the union of the shards' (for lookups), kept in step with them."""

    def __init__(
        self, capacity_blocks_per_node: int, num_nodes: int, *, first_home: int, eviction: str = "lru"
    ) -> None:
        if num_nodes < 1:
            raise ValueError(f"num_nodes must be positive, got {num_nodes}")
        super().__init__(capacity_blocks_per_node * num_nodes, eviction=eviction)
        self.shards = [
            HostTier(capacity_blocks_per_node, name=f"pool{j}", eviction=eviction) for j in range(num_nodes)
        ]
        self.first_home = first_home
        self.last_by_node: list[tuple[int, list[tuple[int, int]]]] = []  # the last publish's, by node

    def shard_of(self, key: int) -> int:
        return spread(key) % len(self.shards)

    def publish(self, keys: Sequence[int], sizes: Sequence[int], node: int) -> list[tuple[int, int]]:
        """Insert entries, each into its pool node (`node`, the publisher, does not place them);
        returns those inserted, grouped by pool node in node order (`last_by_node`: each pool node
        with new entries and those entries)."""
        n = len(self.shards)
        by_node: list[tuple[list[int], list[int]]] = [([], []) for _ in range(n)]
        g = _GOLDEN64
        for k, s in zip(keys, sizes, strict=True):
            ks, ss = by_node[(((k * g) & 0xFFFFFFFFFFFFFFFF) >> 32) % n]  # spread(k) % n, inlined
            ks.append(k)
            ss.append(s)
        new: list[tuple[int, int]] = []
        dropped: list[int] = []
        dropped_sizes: list[int] = []
        groups: list[tuple[int, list[tuple[int, int]]]] = []
        self.last_by_node = groups
        entries, home = self.entries, self.home
        for j, (ks, ss) in enumerate(by_node):
            if not ks:
                continue
            shard = self.shards[j]
            before = shard.used_blocks
            got = shard.insert(ks, ss)
            held = shard.entries
            # The union follows the shard, whatever the batch did in between (an entry dropped by a
            # later one, or dropped and inserted again). A dropped entry's home stays until
            # compacted.
            at = self.first_home + j
            for k, s in got:
                if k in held:
                    entries[k] = s
                home[k] = at
            if shard.last_dropped:
                for old in shard.last_dropped:
                    if old not in held:
                        entries.pop(old, None)
                dropped.extend(shard.last_dropped)
                dropped_sizes.extend(shard.last_dropped_sizes)
            self.used_blocks += shard.used_blocks - before
            if got:
                new.extend(got)
                groups.append((j, got))
        self.last_dropped = dropped
        self.last_dropped_sizes = dropped_sizes
        st = self.stats
        if dropped_sizes:
            st.dropped_blocks += sum(dropped_sizes)
        if new:
            st.inserted_blocks += sum(s for _, s in new)
            if self.used_blocks > st.peak_blocks:
                st.peak_blocks = self.used_blocks
        if len(home) > 2 * len(entries) + 1024:  # forget the homes of dropped entries
            self.home = {k: home[k] for k in entries}
        return new

    def touch(self, keys: Sequence[int]) -> int:
        shards, n = self.shards, len(self.shards)
        return sum(shards[spread(k) % n].touch((k,)) for k in keys)

    def check(self) -> None:
        for sh in self.shards:
            sh.check()
        n = len(self.shards)
        assert self.used_blocks == sum(sh.used_blocks for sh in self.shards) <= self.capacity_blocks
        assert self.entries.keys() == {k for sh in self.shards for k in sh.entries}
        assert all(self.home[k] == self.first_home + spread(k) % n for k in self.entries)
        assert all(spread(k) % n == j for j, sh in enumerate(self.shards) for k in sh.entries)


_GOLDEN64 = 0x9E3779B97F4A7C15  # 2^64 / the golden ratio, odd


def spread(key: int) -> int:
    """A 32-bit Fibonacci hash of an entry key (Knuth's multiplicative hashing): the high half of
    ``key x 2^64/phi mod 2^64``, so consecutive or low-bit-equal keys land on different nodes."""
    return ((key * _GOLDEN64) & 0xFFFFFFFFFFFFFFFF) >> 32

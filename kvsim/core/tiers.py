"""Tiers below HBM, pure bookkeeping: a node's host-DRAM store of prefix-cache entries.

A `HostTier` is a second-level prefix cache: cache entries (the same keys and sizes as the HBM
pool's, `kvsim.core.block_pool`) copied to a node's host DRAM, shared by the node's replicas
(they run the same model with the same tensor-parallel layout, so a block one wrote another can
load, as LMCache's local CPU backend and SGLang HiCache's host pool share a host). Capacity is in
blocks of the replicas' layout; an insert that does not fit drops the least recently used
entries (LRU, as vLLM's offloading manager, SGLang HiCache's host radix tree and LMCache's
local CPU backend do by default). Entries have copy semantics: an entry loaded back into HBM
stays here too, so writing it back again when HBM evicts it costs nothing.

A `GlobalPool` is the same store cluster-wide (``kv.prefix_cache.scope: global``, as Mooncake
Store keeps prefix KV in the DRAM of every node): each entry also knows its home node, whose DRAM
holds it, so a fetch from another node crosses the network. One LRU over the whole pool.

The scheduler asks a `TierLookup` (the shell's view of a replica's lower tiers, local DRAM then the
global pool) how far a prefix continues below HBM.

What time the copies take is the SimPy shell's business (`kvsim.sim.offload`, over the links of
`kvsim.sim.links`): this module knows no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class TierLookup(Protocol):
    """What the scheduler asks of the tiers below a replica's HBM."""

    def num_prefix_hits(self, keys: Sequence[int], start: int, stop: int) -> int:
        """Entries ``keys[start:stop]`` the tiers hold (and that are worth loading), a leading run."""
        ...

    def touch(self, keys: Sequence[int]) -> int:
        """Mark the entries used; returns the blocks they cover."""
        ...


@dataclass
class TierStats:
    inserted_blocks: int = 0  # blocks copied in
    dropped_blocks: int = 0  # blocks dropped to make room (LRU)
    hit_blocks: int = 0  # blocks found by lookups that then loaded them
    peak_blocks: int = 0


class HostTier:
    def __init__(self, capacity_blocks: int, *, name: str = "dram") -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be positive, got {capacity_blocks}")
        self.name = name
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
            entries.move_to_end(k)
            blocks += entries[k]
        return blocks

    def insert(self, keys: Sequence[int], sizes: Sequence[int]) -> list[tuple[int, int]]:
        """Copy entries in (those present are only touched). Returns (key, blocks) of the entries
        newly inserted, the ones a transfer must move; an entry larger than the tier is skipped."""
        entries = self.entries
        cap = self.capacity_blocks
        new: list[tuple[int, int]] = []
        dropped: list[int] = []
        dropped_sizes: list[int] = []
        self.last_dropped = dropped
        self.last_dropped_sizes = dropped_sizes
        for k, s in zip(keys, sizes, strict=True):
            if k in entries:
                entries.move_to_end(k)
                continue
            if s > cap:
                continue
            while self.used_blocks + s > cap:
                old, size = entries.popitem(last=False)
                dropped.append(old)
                dropped_sizes.append(size)
                self.used_blocks -= size
                self.stats.dropped_blocks += size
            entries[k] = s
            self.used_blocks += s
            new.append((k, s))
        if new:
            self.stats.inserted_blocks += sum(s for _, s in new)
            if self.used_blocks > self.stats.peak_blocks:
                self.stats.peak_blocks = self.used_blocks
        return new

    def check(self) -> None:
        """Invariants (property tests): within capacity, counts agree, every entry counted once."""
        assert 0 <= self.used_blocks <= self.capacity_blocks
        assert self.used_blocks == sum(self.entries.values())
        assert all(s > 0 for s in self.entries.values())


class GlobalPool(HostTier):
    """A cluster-wide `HostTier` whose entries each live in one node's DRAM (``home``)."""

    def __init__(self, capacity_blocks: int) -> None:
        super().__init__(capacity_blocks, name="global")
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

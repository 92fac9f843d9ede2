"""Paged KV block pool of one tier: reference counts and a prefix-cache LRU.

Blocks are fungible except for the content they cache, so the pool keeps counts, not block ids:
``free`` empty blocks, cached entries (key -> reference count), an LRU of cached entries no request
references (reusable by key until reallocated), and a count of private (unhashed) blocks.

A cached entry covers ``size`` consecutive blocks of one prompt that always come and go together:
the engine blocks inside one trace hash block (Mooncake: 512 / 16 = 32). Bookkeeping per entry
instead of per block keeps an hour of 12K-token prompts fast; the cost is eviction granularity
(a whole entry at a time, its surplus blocks returning to the free pool).

Eviction: a cached-but-free entry is only reclaimed when no empty block is left, oldest first.
vLLM v1 instead pops the head of one free queue that mixes empty and cached blocks, so it can
evict a cached block while empty ones exist; SGLang's radix cache, like this pool, evicts only
under pressure. With ample free memory the two agree; under pressure vLLM evicts earlier.

Two requests computing the same prompt at once: the second one's copy is freed when it turns out
to be cached already, and it shares the first's (vLLM v1 keeps both physical copies cached until
their owners finish), so bursts of identical concurrent prompts use a little less memory here.

Every cached entry has a last-access stamp (the manager's step counter), for policies that move
cold blocks down a tier: a referenced entry is touched by its running requests every step, so its
stamp is the current one; an unreferenced entry's is the step its last holder released it, kept as
its value in the LRU. Memory: an hour of traffic leaves hundreds of thousands of cached entries per
cluster, so an entry costs one `refs` slot and, while unreferenced, one LRU node; its size is stored
only when it is not one block. With ``events=True`` the
pool records `BlockStored` / `BlockRemoved` events (vLLM's KV events, which KV-aware routers and a
cluster-wide prefix index consume), and `BlockRewritten` for an entry token eviction rewrote in place
(it left the index but its blocks are no reusable copy: a write-back must not move them down);
`take_events` hands them over and clears the list. `listen(sink)` also hands every event to `sink` as
it happens (``kvsim run --kv-events``); a pool that records nothing pays one None check at a
register or an eviction, nothing per token.

Pinning (``kv.prefix_cache.pin``, agent system prompts and tool definitions, design documents 003:
"前缀缓存 + 永久保留", kept permanently): entries whose keys are in `pin_keys` go, when their last
holder releases them, to a pinned set instead of the LRU, up to `pin_max_blocks` blocks (past that
they enter the LRU as any other entry). Pinned entries are evicted last: only when the LRU is empty
and an allocation still does not fit, oldest first. "Never" would deadlock a request that needs
their blocks; evicting them last keeps them through any churn that other entries can absorb.

Dropping (``kv.segments``' window and evict_after_use, `release_dropping`): a finished agent turn
releases its entries from a cut on not into the LRU but out of the cache, their blocks empty at
once (one `BlockRemoved` event), where no other request still references them.

Left out: copy-on-write forks (parallel sampling, beam search): nothing in a trace asks for them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockStored:
    """Cache entries registered (their blocks now hold reusable content)."""

    keys: tuple[int, ...]
    sizes: tuple[int, ...]
    parent: int | None = None  # the entry before keys[0] in its owner's chain (None: the first)


@dataclass(frozen=True)
class BlockRemoved:
    """Cache entries evicted (their blocks were reallocated)."""

    keys: tuple[int, ...]
    sizes: tuple[int, ...] = ()  # blocks each covered (a write-back to a lower tier moves them)


@dataclass(frozen=True)
class BlockRewritten:
    """Cache entries their only holder rewrote in place (token eviction, `uncache`): they left the
    index and their blocks stay, private to the holder, but no longer hold the keys' content. Not a
    removal of reusable content: a write-back tier must not copy them down as prefix blocks; a copy
    below written before (a write-through, a publication, an earlier write-back) holds the full
    content and stays valid."""

    keys: tuple[int, ...]


PoolEvent = BlockStored | BlockRemoved | BlockRewritten


class BlockPool:
    def __init__(self, num_blocks: int, *, events: bool = False) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.free = num_blocks  # empty blocks
        self.refs: dict[int, int] = {}  # cached entry key -> reference count (>= 0)
        self.sizes: dict[int, int] = {}  # cached entry key -> blocks it covers, where not 1
        self.lru: OrderedDict[int, int] = OrderedDict()  # unreferenced entries, oldest first -> stamp
        self.lru_blocks = 0  # blocks held by unreferenced cached entries
        self.private = 0  # referenced unhashed blocks, all owners together
        self.evictions = 0  # cached blocks reclaimed for new allocations
        self.demoted = 0  # cached blocks reclaimed for going cold (`drop_cold`)
        self.stamp = 0  # the owner's clock (steps); set by the KV cache manager
        self.pin_keys: frozenset[int] = frozenset()  # keys kept out of the LRU (`pin`)
        self.pin_max_blocks = 0
        self.pinned: OrderedDict[int, int] = OrderedDict()  # unreferenced pinned, oldest first -> stamp
        self.pinned_blocks = 0
        self.pinned_peak = 0  # most blocks the pinned set held at once
        self.dropped = 0  # cached blocks a segment policy dropped at a turn's end (`release_dropping`)
        self._events: list[PoolEvent] | None = [] if events else None
        self._listener: Callable[[PoolEvent], None] | None = None
        # Where events go (None: nowhere): `_record`, set when events are recorded or listened to.
        self._sink: Callable[[PoolEvent], None] | None = self._record if events else None

    # ---- queries ----------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: empty plus cached-but-unreferenced (pinned last)."""
        return self.free + self.lru_blocks + self.pinned_blocks

    @property
    def num_cached_free(self) -> int:
        """Blocks of cached entries no request references (evictable, or pinned)."""
        return self.lru_blocks + self.pinned_blocks

    @property
    def num_used(self) -> int:
        """Blocks some request references (private or cached)."""
        return self.num_blocks - self.free - self.lru_blocks - self.pinned_blocks

    def pin(self, keys: frozenset[int], max_blocks: int) -> None:
        """Keep entries under `keys` cached when unreferenced, up to `max_blocks` blocks."""
        self.pin_keys = keys
        self.pin_max_blocks = max_blocks

    def size(self, key: int) -> int:
        """Blocks the cached entry `key` covers."""
        return self.sizes.get(key, 1)

    def last_access(self, key: int) -> int:
        """Stamp of the last step that touched cached entry `key`."""
        if self.refs[key] > 0:
            return self.stamp
        return self.pinned[key] if key in self.pinned else self.lru[key]

    def num_prefix_hits(self, keys: Sequence[int]) -> int:
        """Length of the leading run of `keys` whose entries are cached."""
        refs = self.refs
        n = 0
        for k in keys:
            if k not in refs:
                break
            n += 1
        return n

    def unreferenced_blocks(self, keys: Iterable[int]) -> int:
        """Blocks among cached `keys` that sit in the LRU (taking them shrinks num_free)."""
        lru, sizes, pinned = self.lru, self.sizes, self.pinned
        return sum(sizes.get(k, 1) for k in keys if k in lru or k in pinned)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    # ---- mutations --------------------------------------------------------------------------------
    def acquire_cached(self, keys: Iterable[int]) -> None:
        """Reference cached entries (prefix hits); unreferenced ones leave the LRU."""
        refs, lru, sizes = self.refs, self.lru, self.sizes
        for k in keys:
            r = refs[k]
            if r == 0:
                if k in lru:
                    del lru[k]
                    self.lru_blocks -= sizes.get(k, 1)
                else:
                    del self.pinned[k]
                    self.pinned_blocks -= sizes.get(k, 1)
            refs[k] = r + 1

    def allocate(self, n: int) -> list[int]:
        """Take `n` private blocks: empty ones first, then evict the oldest cached-free entries.
        Returns the keys of the entries evicted (usually none)."""
        if n > self.free + self.lru_blocks + self.pinned_blocks:
            raise ValueError(f"cannot allocate {n} blocks, {self.num_free} free")
        evicted: list[int] = []
        if n > self.free:
            lru, refs, sizes = self.lru, self.refs, self.sizes
            evicted_sizes: list[int] = []
            while n > self.free:
                if lru:
                    k, _ = lru.popitem(last=False)
                    s = sizes.pop(k, 1)
                    self.lru_blocks -= s
                else:  # the LRU is empty: pinned entries go last, oldest first
                    k, _ = self.pinned.popitem(last=False)
                    s = sizes.pop(k, 1)
                    self.pinned_blocks -= s
                del refs[k]
                self.free += s
                self.evictions += s
                evicted.append(k)
                evicted_sizes.append(s)
            if self._sink is not None:
                self._sink(BlockRemoved(tuple(evicted), tuple(evicted_sizes)))
        self.free -= n
        self.private += n
        return evicted

    def register(
        self, keys: Sequence[int], sizes: Sequence[int] | None = None, parent: int | None = None
    ) -> list[int]:
        """Turn private blocks that just became full into cached entries under `keys` (a run of
        their owner's chain, after `parent`).

        A key already cached (another request computed the same content meanwhile) is not
        registered twice. Returns the keys registered; the caller decides what to do with the rest.
        Events: one `BlockStored` per run of consecutive keys registered, with its parent.
        """
        out = []
        refs, stored = self.refs, self.sizes
        moved = 0
        for i, k in enumerate(keys):
            if k in refs:
                continue
            s = 1 if sizes is None else sizes[i]
            refs[k] = 1
            if s != 1:
                stored[k] = s
            moved += s
            out.append(k)
        self.private -= moved
        assert self.private >= 0
        if out and self._sink is not None:
            if len(out) == len(keys):
                self._sink(BlockStored(tuple(out), tuple(stored.get(k, 1) for k in out), parent))
            else:
                self._stored_runs(keys, parent, set(out))
        return out

    def _stored_runs(self, keys: Sequence[int], parent: int | None, fresh: set[int]) -> None:
        """`BlockStored` events of the runs of `keys` in `fresh` (the others were cached already)."""
        assert self._sink is not None
        run: list[int] = []
        for k in [*keys, None]:
            if k is not None and k in fresh:
                run.append(k)
                continue
            if run:
                self._sink(BlockStored(tuple(run), tuple(self.sizes.get(j, 1) for j in run), parent))
                run = []
            parent = k

    def promote(self, keys: Sequence[int], sizes: Sequence[int], parent: int | None = None) -> None:
        """An owner's private blocks under `keys` (after `parent` in its chain) just became full:
        cache them, or where equal content is cached already (computed meanwhile by another
        request), reference that entry and free the owner's copy. Either way the owner now holds
        one reference per key."""
        registered = self.register(keys, sizes, parent)
        if len(registered) == len(keys):
            return
        fresh = set(registered)
        dup = [k for k in keys if k not in fresh]
        dup_blocks = sum(s for k, s in zip(keys, sizes, strict=True) if k not in fresh)
        self.acquire_cached(dup)
        self.private -= dup_blocks
        self.free += dup_blocks

    def release(self, private: int, keys: Sequence[int]) -> None:
        """Drop an owner's blocks: private ones become empty, cached ones lose a reference.

        Keys are released tail first, so the end of a prompt is evicted before its shared start.
        """
        assert 0 <= private <= self.private
        self.private -= private
        self.free += private
        refs, lru, sizes = self.refs, self.lru, self.sizes
        stamp = self.stamp
        pin = self.pin_keys
        for k in reversed(keys):
            r = refs[k] - 1
            refs[k] = r
            if r == 0:
                s = sizes.get(k, 1)
                if pin and k in pin and self.pinned_blocks + s <= self.pin_max_blocks:
                    self.pinned[k] = stamp
                    self.pinned_blocks += s
                    if self.pinned_blocks > self.pinned_peak:
                        self.pinned_peak = self.pinned_blocks
                else:
                    lru[k] = stamp
                    self.lru_blocks += s

    def release_dropping(self, private: int, keys: Sequence[int], cut: int) -> None:
        """`release`, except that the entries ``keys[cut:]`` whose last reference this was leave
        the cache (their blocks empty) instead of entering the LRU: a segment policy's hole and
        what follows it, which no exact-prefix lookup reaches again."""
        tail = keys[cut:]
        refs, sizes = self.refs, self.sizes
        gone: list[int] = []
        gone_sizes: list[int] = []
        for k in reversed(tail):
            r = refs[k] - 1
            if r:
                refs[k] = r
                continue
            del refs[k]
            s = sizes.pop(k, 1)
            self.free += s
            gone.append(k)
            gone_sizes.append(s)
        self.dropped += sum(gone_sizes)
        if gone and self._sink is not None:
            self._sink(BlockRemoved(tuple(gone), tuple(gone_sizes)))
        self.release(private, keys[:cut])

    def drop_cold(self, before: int) -> list[int]:
        """Reclaim the unreferenced entries last touched before stamp `before` (the LRU is in stamp
        order, oldest first), their blocks becoming empty, as one `BlockRemoved` event (a lower
        tier copies them down first). Returns their keys."""
        lru, refs, sizes = self.lru, self.refs, self.sizes
        keys: list[int] = []
        dropped: list[int] = []
        while lru:
            k, stamp = next(iter(lru.items()))
            if stamp >= before:
                break
            del lru[k]
            del refs[k]
            s = sizes.pop(k, 1)
            self.lru_blocks -= s
            self.free += s
            keys.append(k)
            dropped.append(s)
        if keys and self._sink is not None:
            self._sink(BlockRemoved(tuple(keys), tuple(dropped)))
        self.demoted += sum(dropped)
        return keys

    def wipe(self) -> int:
        """Drop every cached entry (the GPU holding the pool went down: its memory is lost), once
        no request holds a block; every block is empty after. One `BlockRemoved` event of the
        entries (a KV-aware router's index forgets them). Returns the blocks that held content."""
        assert self.private == 0 and not any(self.refs.values()), "a request still holds blocks"
        lost = self.num_blocks - self.free
        keys = tuple(self.refs)
        if keys and self._sink is not None:
            self._sink(BlockRemoved(keys, tuple(self.size(k) for k in keys)))
        self.refs.clear()
        self.sizes.clear()
        self.lru.clear()
        self.pinned.clear()
        self.lru_blocks = self.pinned_blocks = 0
        self.free = self.num_blocks
        return lost

    def oldest_unreferenced_stamp(self) -> int | None:
        """The stamp of the least recently released unreferenced entry (None: none)."""
        for stamp in self.lru.values():
            return stamp
        return None

    def record_events(self) -> None:
        """Start recording `BlockStored` / `BlockRemoved` events (a lower tier's write path)."""
        if self._events is None:
            self._events = []
            self._sink = self._record

    def listen(self, sink: Callable[[PoolEvent], None]) -> None:
        """Hand every event to `sink` too, as it happens (a run writing KV events)."""
        self._listener = sink
        self._sink = self._record

    def _record(self, ev: PoolEvent) -> None:
        if self._events is not None:
            self._events.append(ev)
        if self._listener is not None:
            self._listener(ev)

    def uncache(self, key: int) -> int:
        """Its only holder is about to rewrite cached entry `key` (token eviction): the entry leaves
        the cache index (no later prefix hit) and its blocks become the holder's private blocks.
        Returns the blocks it covered."""
        assert self.refs[key] == 1
        del self.refs[key]
        s = self.sizes.pop(key, 1)
        self.private += s
        if self._sink is not None:
            self._sink(BlockRewritten((key,)))
        return s

    def drop_ref(self, key: int) -> None:
        """An owner stops referencing cached entry `key` that others still reference."""
        assert self.refs[key] > 1
        self.refs[key] -= 1

    def take_events(self) -> list[PoolEvent]:
        """The events recorded since the last call (empty unless the pool records events)."""
        if self._events is None:
            return []
        out, self._events = self._events, []
        return out

    def check(self) -> None:
        """Invariants (used by property tests)."""
        assert self.free >= 0 and self.private >= 0
        assert all(r >= 0 for r in self.refs.values())
        assert all(self.refs[k] == 0 for k in self.lru)
        assert all(self.refs[k] == 0 and k not in self.lru for k in self.pinned)
        assert self.pinned_blocks == sum(self.size(k) for k in self.pinned) <= self.pin_max_blocks
        assert self.sizes.keys() <= self.refs.keys() and all(s != 1 for s in self.sizes.values())
        assert self.lru_blocks == sum(self.size(k) for k in self.lru)
        referenced = sum(self.size(k) for k, r in self.refs.items() if r > 0)
        assert self.free + self.lru_blocks + self.pinned_blocks + referenced + self.private == self.num_blocks

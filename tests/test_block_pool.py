"""Property tests for the pure core: block pool invariants and prefix-key reuse."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.core.block_hash import block_keys
from kvsim.core.block_pool import BlockPool, BlockRemoved, BlockStored

ops = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "register", "hit", "release", "drop"]),
        st.integers(0, 12),
        st.integers(0, 30),
    ),
    max_size=60,
)


class ShadowPool:
    """An independent model of what the pool must cache: keys with references, and the unreferenced
    ones in least-recently-released order, evicted oldest first only when no empty block is left."""

    def __init__(self, num_blocks: int) -> None:
        self.free = num_blocks
        self.refs: dict[int, int] = {}
        self.lru: list[int] = []  # unreferenced cached keys, oldest first (one block each here)

    def allocate(self, n: int) -> list[int]:
        evicted = []
        while n > self.free:
            k = self.lru.pop(0)
            del self.refs[k]
            self.free += 1
            evicted.append(k)
        self.free -= n
        return evicted

    def register(self, keys: list[int]) -> list[int]:
        fresh = [k for k in keys if k not in self.refs]
        for k in fresh:
            self.refs[k] = 1
        return fresh

    def acquire(self, keys: list[int]) -> None:
        for k in keys:
            if self.refs[k] == 0:
                self.lru.remove(k)
            self.refs[k] += 1

    def release(self, private: int, keys: list[int]) -> None:
        self.free += private
        for k in reversed(keys):
            self.refs[k] -= 1
            if self.refs[k] == 0:
                self.lru.append(k)

    def release_dropping(self, private: int, keys: list[int], cut: int) -> None:
        """kv.segments: the keys from `cut` on that lose their last reference leave the cache."""
        for k in reversed(keys[cut:]):
            self.refs[k] -= 1
            if self.refs[k] == 0:
                del self.refs[k]
                self.free += 1
        self.release(private, keys[:cut])

    def hits(self, keys: list[int]) -> int:
        n = 0
        for k in keys:
            if k not in self.refs:
                break
            n += 1
        return n


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(1, 40), script=ops, probe=st.lists(st.integers(0, 30 * 100 + 12), max_size=8))
def test_pool_invariants_hold_under_any_sequence(num_blocks, script, probe):
    pool = BlockPool(num_blocks)
    shadow = ShadowPool(num_blocks)
    owners: list[tuple[int, list[int]]] = []  # (private blocks, held keys) per owner
    ever: list[int] = []  # every key ever registered, evicted ones included
    for op, n, key in script:
        if op == "alloc" and pool.can_allocate(n):
            assert pool.allocate(n) == shadow.allocate(n)
            owners.append((n, []))
        elif op == "register" and owners:
            priv, held = owners.pop()
            k = [key * 100 + i for i in range(min(n, priv))]
            fresh = pool.register(k)
            assert fresh == shadow.register(k)
            ever.extend(fresh)
            owners.append((priv - len(fresh), held + fresh))
        elif op == "hit":
            # Ask for keys the model says may or may not be cached (evicted ones, never-seen ones):
            # the pool must agree with the model on the leading run of cached entries.
            candidates = [*ever[-n:], *probe]
            hits = pool.num_prefix_hits(candidates)
            assert hits == shadow.hits(candidates)
            got = candidates[:hits]
            if len(set(got)) == len(got):
                pool.acquire_cached(got)
                shadow.acquire(got)
                owners.append((0, got))
        elif op == "release" and owners:
            priv, held = owners.pop(n % len(owners))
            pool.release(priv, held)
            shadow.release(priv, held)
        elif op == "drop" and owners:
            priv, held = owners.pop(n % len(owners))
            cut = key % (len(held) + 1)
            pool.release_dropping(priv, held, cut)
            shadow.release_dropping(priv, held, cut)
        pool.check()
        assert pool.free == shadow.free
        assert {k for k, r in pool.refs.items()} == set(shadow.refs)
        assert list(pool.lru) == shadow.lru
        referenced = sum(1 for r in pool.refs.values() if r > 0)
        assert referenced + pool.private <= num_blocks
        assert pool.private == sum(p for p, _ in owners)
    for priv, held in owners:
        pool.release(priv, held)
    pool.check()
    assert pool.num_free == num_blocks


@settings(max_examples=100, deadline=None)
@given(n_keys=st.integers(1, 20), evict=st.integers(0, 25))
def test_freed_cached_blocks_reusable_by_key_until_reallocated(n_keys, evict):
    pool = BlockPool(30)
    pool.allocate(n_keys)
    keys = list(range(1000, 1000 + n_keys))
    pool.register(keys)
    pool.release(0, keys)
    assert pool.num_prefix_hits(keys) == n_keys  # cached but free: still hits
    take = min(evict, pool.num_free)
    pool.allocate(take)  # empty blocks go first, then the oldest cached ones
    evicted = max(0, take - (30 - n_keys))
    assert pool.evictions == evicted
    assert len(pool.lru) == n_keys - evicted
    # Release order was tail first, so the prompt's tail is evicted before its head.
    if evicted < n_keys:
        assert pool.num_prefix_hits(keys) == n_keys - evicted
    pool.check()


def test_allocate_returns_evicted_entries_and_events_describe_them():
    pool = BlockPool(4, events=True)
    pool.allocate(3)
    pool.stamp = 7
    assert pool.register([1, 2], [1, 2]) == [1, 2]
    assert (pool.last_access(1), pool.last_access(2)) == (7, 7)  # referenced: touched now
    pool.stamp = 9
    pool.release(0, [1, 2])  # tail first: 2 is older in the LRU than 1
    pool.stamp = 12
    assert (pool.last_access(1), pool.last_access(2)) == (9, 9)  # unreferenced: when released
    assert pool.allocate(1) == []  # an empty block is left: nothing evicted
    assert pool.allocate(2) == [2]  # entry 2 (two blocks) goes first
    assert pool.take_events() == [BlockStored((1, 2), (1, 2)), BlockRemoved((2,), (2,))]
    assert pool.take_events() == []
    pool.check()


def test_block_keys_group_engine_blocks_by_trace_block():
    ids = np.array([5, 9, 11])
    # 512 / 16 = 32 engine blocks per trace block; 1100 tokens -> 68 full engine blocks.
    keys, sizes = block_keys(ids, 1100, 512, 16)
    assert keys == [5, 9, 11] and sizes == [32, 32, 4]
    # Engine blocks larger than trace blocks take the id of the last trace block inside them.
    assert block_keys(np.array([1, 2, 3, 4]), 64, 16, 32) == ([2, 4], [1, 1])


def test_grouped_entries_evict_whole_and_return_surplus_to_free():
    pool = BlockPool(10)
    pool.allocate(8)
    pool.register([1, 2], [4, 4])
    pool.release(0, [1, 2])
    assert pool.num_free == 10 and pool.num_cached_free == 8
    pool.allocate(3)  # takes the 2 empty blocks, then evicts entry 2 (tail first) for 1 more
    assert 2 not in pool.refs and 1 in pool.refs
    assert pool.free == 3 and pool.evictions == 4
    pool.check()

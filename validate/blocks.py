"""Physical block ids for the real KV pool, from kvsim's count-keeping block pool.

`kvsim.core.block_pool.BlockPool` keeps counts, not ids (blocks are fungible). A real pool needs
ids: this adapter keeps a free list of physical ids and each request's table, and after the
scheduler acts brings every table to the request's ``num_blocks`` (growing takes ids from the
free list; a request the scheduler released, by preemption or by finishing, returns its ids). It
then checks that its free list holds exactly the pool's empty blocks, so the real pool and the
simulated one can never disagree on a count.

Prefix caching is off in validation (``kv.prefix_cache: none``): every block is private, so the
pool emits no `BlockStored` / `BlockRemoved` events and counts say everything. With caching on, an
entry's ids would follow those events (stored: the owner's first private ids become the entry's;
removed: they return to the free list); that is left out, and `sync` refuses held cache entries.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvsim.core.kv_cache_manager import KVCacheManager
from kvsim.core.request import Request


class BlockTables:
    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.free = list(range(kv.num_blocks - 1, -1, -1))  # pop() hands out the lowest id first
        self.tables: dict[int, list[int]] = {}

    def release(self, reqs: Iterable[Request]) -> None:
        for r in reqs:
            ids = self.tables.pop(r.id, [])
            self.free.extend(reversed(ids))

    def sync(self, reqs: Iterable[Request]) -> None:
        """Bring the tables of `reqs` to their block counts, then check the free list against the pool."""
        for r in reqs:
            if r.held_keys:
                raise RuntimeError("validation runs without prefix caching: no request holds cache entries")
            table = self.tables.setdefault(r.id, [])
            while len(table) < r.num_blocks:
                table.append(self.free.pop())
            if len(table) > r.num_blocks:
                raise RuntimeError(f"request {r.id} holds {len(table)} blocks, the pool says {r.num_blocks}")
        self.check()

    def check(self) -> None:
        pool = self.kv.pool
        if len(self.free) != pool.free or pool.lru_blocks:
            raise RuntimeError(f"{len(self.free)} free block ids, the pool has {pool.free} empty blocks")

"""The KV cache manager: what the scheduler asks about a request's blocks, in vLLM v1's words.

The scheduler never touches the block pool; it asks this manager (vLLM v1: ``KVCacheManager``
between ``sched/scheduler.py`` and ``block_pool.py``; nano-vllm: ``BlockManager.can_allocate`` /
``may_append``):

- `get_computed_blocks(req)`: the prefix-cache hits of a waiting request, as (cache entries hit,
  tokens whose KV they hold), with vLLM's rule that at least one token is always computed;
- `allocate_slots(req, num_new_blocks)`: more blocks for a running request's next tokens, or False
  with nothing changed when they do not fit (the scheduler then preempts);
- `admit(req, num_hits, num_new_tokens)`: take the hits and the new blocks of a waiting request, or
  False when they do not fit;
- `cache_blocks(req, num_computed_tokens)`: turn the request's blocks that are full up to that many
  tokens into cache entries;
- `free(req)`: release everything the request holds.

A request's block table is a run of cache entries (a prefix of its prompt's entry keys, each
covering ``entry size`` blocks) followed by one run of private blocks; `block_table(req)` returns it
as `BlockRun`s with their tier. A request's blocks all live in HBM: entries a lower tier holds
(`kvsim.core.tiers`) are loaded into blocks reserved for them (`admit_loading`) before it runs
(`finish_loading`). Resident tokens equal computed tokens while no token is evicted.

The manager also keeps the memory peaks (noted after every allocation, before any release) and
hands the scheduler's step count to the pool as its last-access stamp (`set_step`).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from enum import Enum
from itertools import accumulate, chain

import numpy as np

from kvsim.core.block_hash import private_key
from kvsim.core.block_pool import BlockPool
from kvsim.core.request import Request


class Tier(str, Enum):
    HBM = "hbm"


@dataclass(frozen=True)
class BlockRun:
    """Consecutive blocks of one request: a cache entry (``key``) or private blocks (``key`` None)."""

    key: int | None
    num_blocks: int
    tier: Tier = Tier.HBM


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, *, enable_caching: bool = True, events: bool = False
    ) -> None:
        self.pool = BlockPool(num_blocks, events=events)
        self.block_size = block_size
        self.enable_caching = enable_caching  # prefix caching on: released full blocks stay cached
        self.peak_used_blocks = 0  # referenced by some request
        self.peak_occupied_blocks = 0  # referenced or cached-but-free

    # ---- queries ----------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: empty plus cached-but-unreferenced."""
        return self.pool.free + self.pool.lru_blocks + self.pool.pinned_blocks

    @property
    def num_empty_blocks(self) -> int:
        """Blocks that hold nothing (taking them evicts no cache entry)."""
        return self.pool.free

    def num_prefix_hits(self, keys: list[int]) -> int:
        return self.pool.num_prefix_hits(keys)

    def get_computed_blocks(self, req: Request) -> tuple[int, int]:
        """(cache entries hit, tokens they let the request skip) for a waiting request.

        At least one token is computed (vLLM): a fully cached prompt recomputes its last block's
        tokens into the block it already holds."""
        if not req.keys:
            return 0, 0
        hits = self.pool.num_prefix_hits(req.keys)
        hit_blocks = min(req.key_cum[hits], (req.num_tokens - 1) // self.block_size)
        return hits, hit_blocks * self.block_size

    def blocks_needed(self, req: Request, num_tokens: int) -> int:
        """New blocks a running request needs to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size) - req.num_blocks

    def blocks_needed_through(self, reqs: list[Request], j: int, chunk: int = 0) -> int:
        """New blocks the requests need to run steps 0..j of a window (step 0's are already held):
        one token per step each, but the last request `chunk` tokens per step when `chunk` > 0."""
        bs = self.block_size
        total = 0
        for r in reqs:
            n = -(-(r.num_computed + j + 1) // bs) - r.num_blocks
            if n > 0:
                total += n
        if chunk:
            last = reqs[-1]
            total -= max(0, -(-(last.num_computed + j + 1) // bs) - last.num_blocks)
            total += max(0, -(-(last.num_computed + (j + 1) * chunk) // bs) - last.num_blocks)
        return total

    def block_table(self, req: Request) -> list[BlockRun]:
        cum = req.key_cum
        runs = [BlockRun(k, cum[i + 1] - cum[i]) for i, k in enumerate(req.held_keys)]
        if req.num_private:
            runs.append(BlockRun(None, req.num_private))
        return runs

    def num_resident_tokens(self, req: Request) -> int:
        return req.num_computed

    # ---- mutations --------------------------------------------------------------------------------
    def set_step(self, step: int) -> None:
        """The scheduler's step count: the stamp of what the pool touches from now on."""
        self.pool.stamp = step

    def note_peak(self) -> None:
        """Called after every allocation, before any release: blocks only grow in between."""
        pool = self.pool
        occupied = pool.num_blocks - pool.free
        used = occupied - pool.lru_blocks - pool.pinned_blocks
        if used > self.peak_used_blocks:
            self.peak_used_blocks = used
        if occupied > self.peak_occupied_blocks:
            self.peak_occupied_blocks = occupied

    def allocate_slots(self, req: Request, num_new_blocks: int) -> bool:
        """Give a running request `num_new_blocks` more private blocks; False (nothing changed) when
        they do not fit."""
        pool = self.pool
        if num_new_blocks > pool.free + pool.lru_blocks + pool.pinned_blocks:
            return False
        pool.allocate(num_new_blocks)
        req.num_private += num_new_blocks
        req.num_blocks += num_new_blocks
        return True

    def admit(self, req: Request, num_hits: int, num_new_tokens: int) -> bool:
        """Take a waiting request's first `num_hits` cache entries and the blocks for its next
        `num_new_tokens` tokens; False (nothing changed) when they do not fit."""
        bs = self.block_size
        pool = self.pool
        held_blocks = req.key_cum[num_hits] if req.keys else 0
        computed = min(held_blocks, (req.num_tokens - 1) // bs) * bs
        need = max(0, -(-(computed + num_new_tokens) // bs) - held_blocks)
        hit_keys = req.keys[:num_hits]
        if need + pool.unreferenced_blocks(hit_keys) > pool.free + pool.lru_blocks + pool.pinned_blocks:
            return False
        pool.acquire_cached(hit_keys)
        pool.allocate(need)
        req.held_keys = hit_keys
        req.num_private = need
        req.num_blocks = held_blocks + need
        req.num_computed = computed
        return True

    # ---- loads from a lower tier (kvsim.core.tiers) -----------------------------------------------
    def admit_loading(self, req: Request, num_hits: int, num_load: int) -> bool:
        """Take a waiting request's first `num_hits` cache entries and reserve private blocks for
        the next `num_load` entries, which a transfer from a lower tier will fill; False (nothing
        changed) when they do not fit. The blocks for its new tokens come when it runs."""
        pool = self.pool
        cum = req.key_cum
        load = cum[num_hits + num_load] - cum[num_hits]
        hit_keys = req.keys[:num_hits]
        if load + pool.unreferenced_blocks(hit_keys) > pool.free + pool.lru_blocks + pool.pinned_blocks:
            return False
        pool.acquire_cached(hit_keys)
        pool.allocate(load)
        req.held_keys = hit_keys
        req.num_private = load
        req.num_blocks = cum[num_hits + num_load]
        return True

    def finish_loading(self, req: Request, num_load: int) -> int:
        """The `num_load` entries after the request's held ones have arrived: cache them (or share
        equal content cached meanwhile). Returns the tokens it now has computed (at least one
        token is left to compute, as `get_computed_blocks`)."""
        start = len(req.held_keys)
        cum = req.key_cum
        keys = req.keys[start : start + num_load]
        self.pool.promote(keys, [cum[i + 1] - cum[i] for i in range(start, start + num_load)])
        req.num_private -= cum[start + num_load] - cum[start]
        req.held_keys = req.held_keys + keys
        computed = min(cum[start + num_load], (req.num_tokens - 1) // self.block_size) * self.block_size
        req.num_computed = computed
        return computed

    def cache_blocks(self, req: Request, num_computed_tokens: int) -> None:
        """Cache the request's entries that are full once `num_computed_tokens` tokens are computed
        (or, where equal content is cached already, share it and free the request's copy)."""
        start = len(req.held_keys)
        if start == len(req.keys):
            return
        cum = req.key_cum
        end = bisect_right(cum, num_computed_tokens // self.block_size) - 1  # entries fully computed
        if end <= start:
            return
        keys = req.keys[start:end]
        self.pool.promote(keys, [cum[i + 1] - cum[i] for i in range(start, end)])
        req.num_private -= cum[end] - cum[start]
        req.held_keys = req.held_keys + keys if req.held_keys else keys

    def take_step_blocks(self, reqs: list[Request], chunk: int = 0) -> None:
        """Blocks for the next step of `reqs` (one token each, the last `chunk` if given), as
        scheduling it would take them; used when a fast-forward window is applied in parts."""
        bs = self.block_size
        extra = 0
        last = len(reqs) - 1
        for i, r in enumerate(reqs):
            n = -(-(r.num_computed + (chunk if chunk and i == last else 1)) // bs) - r.num_blocks
            if n > 0:
                r.num_private += n
                r.num_blocks += n
                extra += n
        if extra:
            self.pool.allocate(extra)
        self.note_peak()

    def _cache_generated(self, req: Request) -> None:
        start = req.key_cum[-1]  # blocks the request's entries cover
        full = req.num_computed // self.block_size
        if full <= start:
            return
        j = start - req.prompt_len // self.block_size  # answer blocks already in entries
        keys = req.out_keys[j : j + full - start]
        sizes = [1] * len(keys)
        rest = start + len(keys)
        if full > rest:
            keys.append(private_key(req.id, rest))
            sizes.append(full - rest)
        self.pool.promote(keys, sizes)
        req.num_private -= full - start
        cum = req.key_cum
        req.key_cum = cum + [cum[-1] + c for c in accumulate(sizes)]
        req.keys = req.keys + keys
        req.held_keys = req.held_keys + keys

    def grow_decode(self, reqs: list[Request], num_steps: int, chunk: int = 0) -> list[int] | np.ndarray:
        """Blocks for `num_steps` steps just applied to `reqs` (their computed counts already
        advanced: one token per step, the last request `chunk` if given; blocks held before cover
        the first of those steps, as scheduling it took them). Returns (num_steps,) int64: the new
        blocks stepping would have taken at each step (entry 0 is 0)."""
        bs = self.block_size
        extra = 0
        pool = self.pool
        firsts: list[int] = []  # per request taking blocks: the step that takes its first new one
        counts: list[int] = []
        chunked: np.ndarray | None = None  # steps of the chunked request's new blocks
        last = len(reqs) - 1
        for i, r in enumerate(reqs):
            n = -(-r.num_computed // bs) - r.num_blocks
            if n > 0:
                # Block b of the request's table is taken by the step that writes its first token.
                if chunk and i == last:
                    c0 = r.num_computed - num_steps * chunk
                    b = np.arange(r.num_blocks, r.num_blocks + n, dtype=np.int64)
                    chunked = (b * bs - c0) // chunk
                else:
                    firsts.append(r.num_blocks * bs - (r.num_computed - num_steps))
                    counts.append(n)  # then one every bs steps
                r.num_private += n
                r.num_blocks += n
                extra += n
        taken: list[int] | np.ndarray
        if extra <= 256 and chunked is None:  # the usual short window: a loop beats numpy's call cost
            taken = [0] * num_steps
            for first, n in zip(firsts, counts, strict=True):
                for step in range(first, first + n * bs, bs):
                    taken[step] += 1
        else:
            taken = np.zeros(num_steps, dtype=np.int64)
            if counts:
                cnt = np.asarray(counts, dtype=np.int64)
                within = np.arange(int(cnt.sum()), dtype=np.int64) - np.repeat(np.cumsum(cnt) - cnt, cnt)
                steps = np.repeat(np.asarray(firsts, np.int64), cnt) + bs * within
                taken += np.bincount(steps, minlength=num_steps)
            if chunked is not None:
                taken += np.bincount(chunked, minlength=num_steps)
        if (
            extra > pool.free
            and pool.sizes
            and (pool.lru or pool.pinned)
            and self.peak_occupied_blocks < pool.num_blocks
        ):
            self._note_stepwise_peak(taken, extra)  # (a full pool's peak cannot rise further)
        if extra:
            pool.allocate(extra)
        self.note_peak()
        return taken

    def _note_stepwise_peak(self, taken: list[int] | np.ndarray, total: int) -> None:
        """The occupancy peak stepping would see while a window's allocations evict cached entries.

        One batch allocation evicts the same least-recently-used entries as one allocation per step,
        but an entry larger than one block returns its surplus to the empty blocks, so occupancy
        after some intermediate step can exceed the batch's final one. `taken[j]`: blocks step j
        takes; the LRU order is fixed inside a window (nothing is released)."""
        pool = self.pool
        empty0 = pool.free
        sizes: list[int] = []  # of the LRU entries the whole allocation evicts, oldest first
        covered = 0
        for key in chain(pool.lru, pool.pinned):  # the eviction order: LRU, then pinned
            if empty0 + covered >= total:
                break
            s = pool.size(key)
            sizes.append(s)
            covered += s
        steps = np.asarray(taken, dtype=np.int64)
        cum = np.cumsum(steps)[steps > 0]  # blocks taken by the end of each step that takes some
        evicted = np.concatenate(([0], np.cumsum(sizes)))
        # After a step that has taken x blocks, the smallest LRU prefix with empty0 + E >= x is gone.
        e = evicted[np.searchsorted(evicted, np.maximum(cum - empty0, 0), side="left")]
        min_empty = min(empty0, int((empty0 + e - cum).min())) if len(cum) else empty0
        occupied = pool.num_blocks - min_empty
        if occupied > self.peak_occupied_blocks:
            self.peak_occupied_blocks = occupied

    def free(self, req: Request) -> None:
        """Release everything `req` holds; with caching on, its full generated blocks are cached
        first (`kvsim.core.block_hash`: under the answer's content keys where the workload names
        them, else under keys of the request's own), so a recompute or a later turn can hit them.
        Only once every prompt entry is held: a request preempted while still recomputing its
        prompt has no answer blocks past them to cache."""
        if self.enable_caching and len(req.held_keys) == len(req.keys):
            self._cache_generated(req)
        self.pool.release(req.num_private, req.held_keys)
        req.held_keys = []
        req.num_private = 0
        req.num_blocks = 0

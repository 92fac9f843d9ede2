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
hands the scheduler's step count to the pool as its last-access stamp (`set_step`). Token eviction
(`kvsim.core.eviction`) is applied here at step ends (`apply_evictions`, `_trim`). Planning a window
of steps (how many fit: `kvsim.core.horizon`) reads the manager from outside; `keeps_all` and
`decode_plan` (with the plan it caches) remain here because `grow_decode` reads them.
See docs/architecture.md for where the manager sits.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from enum import Enum
from itertools import accumulate, chain

import numpy as np

from kvsim.core.block_hash import private_key
from kvsim.core.block_pool import BlockPool
from kvsim.core.eviction import Eviction, EvictionKind, EvictionWork, PagePolicy, blocks_for, decode_steps
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
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = True,
        events: bool = False,
        eviction: Eviction | None = None,
    ) -> None:
        self.pool = BlockPool(num_blocks, events=events)
        self.block_size = block_size
        self.enable_caching = enable_caching  # prefix caching on: released full blocks stay cached
        self.peak_used_blocks = 0  # referenced by some request
        self.peak_occupied_blocks = 0  # referenced or cached-but-free
        # Token eviction (`kvsim.core.eviction`: kv.eviction, sliding windows or a format switch),
        # given when the run is built; None: every token stays.
        self.eviction: Eviction | None = eviction
        self.evict_active = False  # the trigger's state after the last step
        self.tokens_evicted = 0
        self.trims = 0
        self.blocks_released = 0  # freed by physical release
        self.blocks_copied = 0  # shared prefix blocks a trimmed sequence copied to own them
        self.entries_uncached = 0  # cache entries rewritten by their only holder: no longer hits
        self.tokens_requantized = 0  # format switch: tokens re-quantized at their sequence's crossing
        self.switched_ids: set[int] = set()  # format switch: requests that crossed (a recompute again)
        self._work = EvictionWork()
        # kv.segments (`set_segment_cuts`): per request id, the token from which a finished turn's
        # blocks leave the cache (-1: none); None: every finished turn's blocks stay cached.
        self.segment_cuts: list[int] | None = None
        # the last window's plan: its requests, their blocks per step, and those summed per step
        self._plan: tuple[list[Request], np.ndarray, np.ndarray] | None = None

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
        cap = self.window_hit_blocks(req)
        if cap >= 0 and req.key_cum[hits] > cap:
            hits = bisect_right(req.key_cum, cap) - 1
        hit_blocks = min(req.key_cum[hits], (req.num_tokens - 1) // self.block_size)
        return hits, hit_blocks * self.block_size

    def window_hit_blocks(self, req: Request) -> int:
        """With sliding-window layers, the most blocks a waiting request's prefix hits may cover
        (-1: no cap): the blocks of ``kept(n)`` tokens of its ``n = P + O - 1``. kvsim's block holds
        every layer's KV, so hits are taken whole and trimmed after the request's first step; with
        more than it keeps, that step could outgrow what `kvsim run` admits a request for (its kept
        tokens plus one step's new ones), and a prompt longer than HBM would wait forever. Only a
        lower tier can hold more: HBM holds no entry of a request past its first trim. The tokens
        past the cap are recomputed (vLLM would take only the windowed layers' in-window blocks of a
        longer hit: an underestimate of such hits' saving)."""
        ev = self.eviction
        if ev is None or ev.kind is not EvictionKind.WINDOW:
            return -1
        return ev.kept(req.prompt_len + req.output_len - 1) // self.block_size

    def blocks_needed(self, req: Request, num_tokens: int) -> int:
        """New blocks a running request needs to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size) - req.num_blocks

    def block_table(self, req: Request) -> list[BlockRun]:
        cum = req.key_cum
        runs = [BlockRun(k, cum[i + 1] - cum[i]) for i, k in enumerate(req.held_keys)]
        if req.num_private:
            runs.append(BlockRun(None, req.num_private))
        return runs

    def num_resident_tokens(self, req: Request) -> int:
        return req.num_computed - req.evicted

    # ---- mutations --------------------------------------------------------------------------------
    def set_eviction(self, ev: Eviction | None) -> None:
        self.eviction = ev

    def take_eviction_work(self) -> EvictionWork:
        """The trims since the last call, for pricing; resets (an empty one is handed over as it is
        and stays: nothing to reset, and most steps trim nothing)."""
        work = self._work
        if work.trims:
            self._work = EvictionWork()
        return work

    def apply_evictions(self, reqs: list[Request], steps: int = 1) -> None:
        """At the end of a step: every decoding request of `reqs` keeps `Eviction.kept` of its
        tokens while the trigger is active, and under physical release frees the blocks it no longer
        needs. Evicting the one token a step added beyond the budget of a request that evicted
        before is steady (its slot is reused; priced with the step); any other eviction is a trim.
        After a fast-forward window of `steps` steps, a request at its budget when the window began
        first evicts steadily for the steps but the last (the window's bounds guarantee that
        stepping did so at each of their ends); the last step then ends as above."""
        ev = self.eviction
        if ev is None:
            return
        used, num = self.pool.num_used, self.pool.num_blocks
        multi = steps > 1 and self.evict_active  # after a window whose steps evicted (at a budget)
        active = self.evict_active = ev.active(used, num)
        release = ev.releases(used, num)
        # Steady to the end, the common case (under physical release a sequence at its budget holds
        # no block beyond what its kept tokens need): one look-up.
        steady = active and (not release or ev.pages is PagePolicy.PHYSICAL)
        bs, short, kept = self.block_size, ev.keeps_all_up_to, ev.kept_fn
        sliding = ev.kind is EvictionKind.WINDOW
        evicted = 0
        for r in reqs:
            c = r.num_computed
            if r.num_tokens - c != 1 or not r.num_generated:
                # Still prefilling (or recomputing): eviction starts after the prompt; a window
                # frees the blocks its chunks leave behind (its next chunk fills their slots).
                if sliding and c > short and c - r.evicted > (kc := kept(c)):
                    self._trim(r, kc, True)
                continue
            e = r.evicted
            if c <= short and not e:
                continue  # it keeps every token and holds no block beyond them: nothing to do
            res = c - e
            kc = kept(c)
            if multi and e and res - steps == kept(c - steps):  # at its budget when the window began
                if steady:
                    evicted += res - kc
                    r.evicted = c - kc
                    continue
                m = (res - 1) - kept(c - 1)  # the window's steady evictions
                e += m
                r.evicted = e
                evicted += m
                res -= m
            if not active:
                kc = res
            target = res if res < kc else kc
            surplus = release and r.num_blocks > -(-(target + 1) // bs)
            if target == res and not surplus:
                continue
            if not surplus and res - target == 1 and e and not r.held_keys:
                r.evicted = e + 1
                evicted += 1
                continue
            self._trim(r, target, release)
        self.tokens_evicted += evicted

    def settle_window(self, reqs: list[Request], steps: int) -> None:
        """The steady evictions of the steps but the last of a window (`apply_evictions`), for
        requests that finish at its last step (freed before that step's evictions): only the count
        of `tokens_evicted` matters for them, as stepping counts it."""
        ev = self.eviction
        if ev is None or steps < 2 or not self.evict_active:
            return
        kept = ev.kept_fn
        for r in reqs:
            c = r.num_computed
            res = c - r.evicted
            if r.evicted and res - steps == kept(c - steps):
                self.tokens_evicted += (res - 1) - kept(c - 1)

    def _trim(self, r: Request, target: int, release: bool) -> bool:
        """Evict `r` down to `target` resident tokens. Its cache entries are given up first: one
        only it references is rewritten in place and leaves the cache (a block with evicted tokens
        is no prefix hit for others); one others share is copied into a private block. Under
        physical release the kept tokens are compacted and blocks beyond what the next token needs
        are freed. False (nothing changed) when the copies do not fit; it is retried next step."""
        pool = self.pool
        bs = self.block_size
        cum = r.key_cum
        own = r.num_private
        shared = 0
        in_place: list[int] = []
        others: list[int] = []
        for i, k in enumerate(r.held_keys):
            size = cum[i + 1] - cum[i]
            if pool.refs[k] == 1:
                in_place.append(k)
                own += size
            else:
                others.append(k)
                shared += size
        held = own + shared
        final = min(blocks_for(target, bs), held) if release else held
        copies = max(0, final - own)
        if copies > pool.free + pool.lru_blocks:
            return False
        for k in in_place:
            pool.uncache(k)
        for k in others:
            pool.drop_ref(k)
        if copies:
            pool.allocate(copies)
            self.note_peak()
        freed = own + copies - final
        if freed:
            pool.release(freed, [])
        res = r.num_computed - r.evicted
        ev = self.eviction
        if ev is not None and ev.kind is EvictionKind.SWITCH:  # the crossing: everything re-quantized
            w = self._work
            w.trims += 1
            w.requant_tokens += res  # (shared entries' copies included: they are written anew)
            w.table_entries += abs(r.num_blocks - final) + len(in_place) + len(others)
            self.tokens_requantized += res
            self.switched_ids.add(r.id)
        elif ev is not None and ev.kind is not EvictionKind.WINDOW:  # a window's trim costs nothing
            w = self._work
            w.trims += 1
            w.select_tokens += res if ev.scores() else 0
            w.moved_tokens += (target if freed else 0) + copies * bs
            w.table_entries += abs(r.num_blocks - final) + len(in_place) + len(others)
        self.trims += 1
        self.tokens_evicted += res - target
        self.blocks_released += freed
        self.blocks_copied += copies
        self.entries_uncached += len(in_place)
        r.held_keys = []
        r.num_private = final
        r.num_blocks = final
        r.evicted += res - target
        return True

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
        held_blocks = req.key_cum[num_hits] if req.keys else 0
        computed = min(held_blocks, (req.num_tokens - 1) // bs) * bs
        need = max(0, -(-(computed + num_new_tokens) // bs) - held_blocks)
        if not self._take_hits(req, num_hits, need):
            return False
        req.num_blocks = held_blocks + need
        req.num_computed = computed
        return True

    def _take_hits(self, req: Request, num_hits: int, private: int) -> bool:
        """A waiting request takes its first `num_hits` cache entries and `private` new blocks after
        them; False (nothing changed) when they do not fit."""
        pool = self.pool
        hit_keys = req.keys[:num_hits]
        if private + pool.unreferenced_blocks(hit_keys) > pool.free + pool.lru_blocks + pool.pinned_blocks:
            return False
        pool.acquire_cached(hit_keys)
        pool.allocate(private)
        req.held_keys = hit_keys
        req.num_private = private
        return True

    # ---- loads from a lower tier (kvsim.core.tiers) -----------------------------------------------
    def admit_loading(self, req: Request, num_hits: int, num_load: int) -> bool:
        """Take a waiting request's first `num_hits` cache entries and reserve private blocks for
        the next `num_load` entries, which a transfer from a lower tier will fill; False (nothing
        changed) when they do not fit. The blocks for its new tokens come when it runs."""
        cum = req.key_cum
        if not self._take_hits(req, num_hits, cum[num_hits + num_load] - cum[num_hits]):
            return False
        req.num_blocks = cum[num_hits + num_load]
        return True

    def finish_loading(self, req: Request, num_load: int) -> int:
        """The `num_load` entries after the request's held ones have arrived: cache them (or share
        equal content cached meanwhile). Returns the tokens it now has computed (at least one
        token is left to compute, as `get_computed_blocks`)."""
        start = len(req.held_keys)
        cum = req.key_cum
        keys = req.keys[start : start + num_load]
        parent = req.keys[start - 1] if start else None
        self.pool.promote(keys, [cum[i + 1] - cum[i] for i in range(start, start + num_load)], parent)
        req.num_private -= cum[start + num_load] - cum[start]
        req.held_keys = req.held_keys + keys
        computed = min(cum[start + num_load], (req.num_tokens - 1) // self.block_size) * self.block_size
        req.num_computed = computed
        return computed

    def cache_blocks(self, req: Request, num_computed_tokens: int) -> None:
        """Cache the request's entries that are full once `num_computed_tokens` tokens are computed
        (or, where equal content is cached already, share it and free the request's copy)."""
        start = len(req.held_keys)
        if start == len(req.keys) or req.evicted:
            return  # (a request that evicted tokens, or a window's, holds private blocks only)
        cum = req.key_cum
        end = bisect_right(cum, num_computed_tokens // self.block_size) - 1  # entries fully computed
        if end <= start:
            return
        keys = req.keys[start:end]
        parent = req.keys[start - 1] if start else None
        self.pool.promote(keys, [cum[i + 1] - cum[i] for i in range(start, end)], parent)
        req.num_private -= cum[end] - cum[start]
        req.held_keys = req.held_keys + keys if req.held_keys else keys

    def take_step_blocks(self, reqs: list[Request], chunk: int = 0) -> None:
        """Blocks for the next step of `reqs` (one token each, the last `chunk` if given), as
        scheduling it would take them; used when a fast-forward window is applied in parts."""
        bs = self.block_size
        extra = 0
        last = len(reqs) - 1
        for i, r in enumerate(reqs):
            resident = r.num_computed - r.evicted
            n = -(-(resident + (chunk if chunk and i == last else 1)) // bs) - r.num_blocks
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
        self.pool.promote(keys, sizes, req.keys[-1] if req.keys else None)
        req.num_private -= full - start
        cum = req.key_cum
        req.key_cum = cum + [cum[-1] + c for c in accumulate(sizes)]
        req.keys = req.keys + keys
        req.held_keys = req.held_keys + keys

    def _free_cut(self, req: Request, cut: int) -> None:
        """A finished turn's release under ``kv.segments``: its entries from the one holding token
        `cut` on leave the cache (the whole entry goes: it holds some of the dropped segment)."""
        if cut < 0 or not self.enable_caching:
            self.pool.release(req.num_private, req.held_keys)
            return
        first = bisect_right(req.key_cum, cut // self.block_size) - 1  # entry holding block cut // bs
        self.pool.release_dropping(req.num_private, req.held_keys, min(first, len(req.held_keys)))

    def grow_decode(self, reqs: list[Request], num_steps: int, chunk: int = 0) -> list[int] | np.ndarray:
        """Blocks for `num_steps` steps just applied to `reqs` (their computed counts already
        advanced: one token per step, the last request `chunk` if given; blocks held before cover
        the first of those steps, as scheduling it took them). Returns (num_steps,) int64: the new
        blocks stepping would have taken at each step (entry 0 is 0)."""
        if self.eviction is not None:
            # (counts already advanced by the window's steps; a mixed window's prefill, last, evicts
            # nothing before its prompt is done). A window planned in closed form (`decode_plan`)
            # for these very requests grows by that plan: where they kept every token the two
            # closed forms agree, so the check is skipped.
            decs = reqs[:-1] if chunk else reqs
            plan = self._plan
            if (plan is not None and plan[0] is decs) or not self.keeps_all(decs, 0):
                return self._grow_decode_evicting(reqs, num_steps, chunk)
            self._plan = None
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

    def keeps_all(self, reqs: list[Request], k: int) -> bool:
        """Whether eviction cannot touch `k` decode steps of `reqs`: none has evicted and none grows
        past the length up to which every token is kept (then the plain closed forms hold)."""
        ev = self.eviction
        if ev is None:
            return True
        short = ev.keeps_all_up_to - k
        return all(not r.evicted and r.num_computed <= short for r in reqs)

    def decode_plan(
        self, reqs: list[Request], k: int, advanced: int = 0
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """With eviction on: (c0, capped, resident, blocks, total) of `k` decode steps of `reqs` from
        where they stood `advanced` steps ago (`kvsim.core.eviction.decode_steps`; resident and
        blocks are (n, k), total (k,) the blocks all of them hold at each step). A request is capped
        when it sits at its budget with the trigger active."""
        ev = self.eviction
        assert ev is not None
        n = len(reqs)
        rows = [(r.num_computed, r.evicted, r.num_blocks) for r in reqs]
        state = np.array(rows, dtype=np.int64).reshape(n, 3)
        c0 = state[:, 0] - advanced if advanced else state[:, 0]
        capped, resident, blocks = decode_steps(
            ev, c0, state[:, 1], state[:, 2], self.evict_active, k, self.block_size
        )
        total = blocks.sum(axis=0)
        if not advanced:  # a window's plan: its first part's `grow_decode` reuses it
            self._plan = (reqs, blocks, total)
        return c0, capped, resident, blocks, total

    def _grow_decode_evicting(
        self, reqs: list[Request], num_steps: int, chunk: int = 0
    ) -> list[int] | np.ndarray:
        """`grow_decode` with eviction on: the decodes' blocks from the closed form of `decode_plan`
        (the one the window was planned with, where nothing has moved since), a mixed window's
        prefilling request's (last, `chunk` tokens a step) as its chunks fill them."""
        decs = reqs[:-1] if chunk else reqs
        plan, self._plan = self._plan, None
        extra = 0
        if decs:
            same = plan is not None and (
                plan[0] is decs
                or (len(plan[0]) == len(decs) and all(a is b for a, b in zip(plan[0], decs, strict=True)))
            )
            if plan is not None and same and plan[1].shape[1] >= num_steps:
                blocks, total = plan[1][:, :num_steps], plan[2][:num_steps]
            else:
                _, _, _, blocks, total = self.decode_plan(decs, num_steps, advanced=num_steps)
                self._plan = None
            taken = np.zeros(num_steps, dtype=np.int64)  # entry 0: its blocks are held already
            taken[1:] = total[1:] - total[:-1]
            extra = int(total[-1] - total[0])
            for r, b in zip(decs, blocks[:, -1].tolist(), strict=True):
                grow = b - r.num_blocks
                if grow > 0:
                    r.num_private += grow
                    r.num_blocks += grow
        else:
            taken = np.zeros(num_steps, dtype=np.int64)
        if chunk:
            p = reqs[-1]
            bs = self.block_size
            n = -(-p.num_computed // bs) - p.num_blocks
            if n > 0:
                c0 = p.num_computed - num_steps * chunk
                b = np.arange(p.num_blocks, p.num_blocks + n, dtype=np.int64)
                taken += np.bincount((b * bs - c0) // chunk, minlength=num_steps)
                p.num_private += n
                p.num_blocks += n
                extra += n
        pool = self.pool
        if extra > pool.free and pool.sizes and pool.lru and self.peak_occupied_blocks < pool.num_blocks:
            self._note_stepwise_peak(taken, extra)
        if extra:
            pool.allocate(extra)
        self.note_peak()
        return taken.tolist() if num_steps <= 64 else taken

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

    def set_segment_cuts(self, cuts: list[int]) -> None:
        """``kv.segments``: per request id, the token offset from which its blocks are dropped from
        the cache when it finishes (-1: none; `kvsim.spec.agent.segment_cuts`)."""
        self.segment_cuts = cuts

    def free(self, req: Request) -> None:
        """Release everything `req` holds; with caching on, its full generated blocks are cached
        first (`kvsim.core.block_hash`: under the answer's content keys where the workload names
        them, else under keys of the request's own), so a recompute or a later turn can hit them.
        Only once every prompt entry is held: a request preempted while still recomputing its
        prompt has no answer blocks past them to cache."""
        if self.enable_caching and len(req.held_keys) == len(req.keys) and not req.evicted:
            self._cache_generated(req)  # (a request that evicted tokens caches nothing: no hit)
        cuts = self.segment_cuts
        if cuts is not None and req.num_generated >= req.output_len and len(req.held_keys) == len(req.keys):
            self._free_cut(req, cuts[req.id])
        else:
            self.pool.release(req.num_private, req.held_keys)
        req.held_keys = []
        req.num_private = 0
        req.num_blocks = 0
        req.evicted = 0

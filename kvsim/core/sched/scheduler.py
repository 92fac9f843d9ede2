"""The scheduler's batch decision, vLLM-v1 style, with no clock in it.

Each step: running sequences first, in order, each asking for its remaining tokens (one while
decoding, a chunk while prefilling) within the token budget; when blocks run out the newest running
sequence is preempted (recompute: its blocks are released and it rejoins the front of the queue,
to recompute prompt and generated tokens, re-using whatever its prompt left in the prefix cache).
Then, if nothing was preempted, waiting sequences are admitted first-come-first-served while the
sequence cap, the token budget and free blocks allow; an admitted sequence first takes its prefix-
cache hits (at least one token is always computed, as in vLLM). A sequence samples a token when
its computed tokens reach its token count; the first sampled token is its first token.

Token accounting: a request with P prompt and O output tokens computes P + O - 1 tokens (the last
sampled token is never fed back), which is what ``outstanding_tokens`` counts down.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from kvsim.core.block_pool import BlockPool
from kvsim.core.request import Request, RequestStatus


@dataclass
class StepPlan:
    seqs: list[Request] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    ctx_before: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    all_decoding: bool = True  # every sequence scheduled so far decodes one token past its first

    @property
    def empty(self) -> bool:
        return not self.seqs

    @property
    def decode_only(self) -> bool:
        """Every scheduled sequence is decoding one token and nothing joined or left."""
        return self.all_decoding and not self.admitted and not self.preempted


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        *,
        block_size: int,
        max_num_seqs: int,
        max_batched_tokens: int,
        chunked_prefill: bool,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.outstanding_tokens = 0
        self.peak_used_blocks = 0  # referenced by some request
        self.peak_occupied_blocks = 0  # referenced or cached-but-free

    def _note_peak(self) -> None:
        """Called after every allocation, before any release: blocks only grow in between."""
        pool = self.pool
        used = pool.num_used
        if used > self.peak_used_blocks:
            self.peak_used_blocks = used
        occupied = pool.num_blocks - pool.free
        if occupied > self.peak_occupied_blocks:
            self.peak_occupied_blocks = occupied

    # ---- admission --------------------------------------------------------------------------------
    def add(self, seq: Request) -> None:
        self.waiting.append(seq)
        self.outstanding_tokens += seq.prompt_len + seq.output_len - 1

    def _release(self, seq: Request) -> None:
        self.pool.release(seq.num_private, seq.held_keys)
        seq.held_keys = []
        seq.num_private = 0
        seq.nblocks = 0

    def _preempt(self, seq: Request) -> None:
        self._release(seq)
        self.outstanding_tokens += seq.num_computed
        seq.num_computed = 0
        seq.preemptions += 1
        seq.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(seq)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        pool = self.pool
        budget = self.max_batched_tokens
        running = self.running
        bs = self.block_size
        add_seq, add_new, add_ctx = plan.seqs.append, plan.num_new.append, plan.ctx_before.append
        all_decoding = True
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            c = seq.num_computed
            num_new = seq.num_tokens - c
            if num_new != 1 or seq.num_generated == 0:
                all_decoding = False
            if num_new > budget:
                num_new = budget
            need = -(-(c + num_new) // bs) - seq.nblocks
            if need > 0:
                preempted_self = False
                if need > pool.free + pool.lru_blocks:
                    self._note_peak()  # memory is at its fullest just before a preemption
                while need > pool.free + pool.lru_blocks:
                    victim = running.pop()
                    self._preempt(victim)
                    plan.preempted.append(victim)
                    if victim is seq:
                        preempted_self = True
                        break
                if preempted_self:
                    break
                pool.allocate(need)
                seq.num_private += need
                seq.nblocks += need
            add_seq(seq)
            add_new(num_new)
            add_ctx(c)
            budget -= num_new
            i += 1
        plan.all_decoding = all_decoding
        if plan.preempted:
            self._note_peak()
            return plan
        while self.waiting and len(running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            hits = pool.num_prefix_hits(seq.keys) if seq.keys else 0
            held_blocks = seq.key_cum[hits]
            # At least one token is computed (vLLM): a fully cached prompt recomputes its last
            # block's tokens into the block it already holds.
            hit_blocks = min(held_blocks, (seq.num_tokens - 1) // bs)
            num_new = seq.num_tokens - hit_blocks * bs
            if not self.chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            hit_keys = seq.keys[:hits]
            need = max(0, _cdiv(hit_blocks * bs + num_new, bs) - held_blocks)
            if need + pool.unreferenced_blocks(hit_keys) > pool.num_free:
                break
            self.waiting.popleft()
            pool.acquire_cached(hit_keys)
            pool.allocate(need)
            seq.held_keys = hit_keys
            seq.num_private = need
            seq.nblocks = held_blocks + need
            seq.num_computed = hit_blocks * bs
            self.outstanding_tokens -= hit_blocks * bs
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = hit_blocks * bs
            seq.status = RequestStatus.RUNNING
            running.append(seq)
            plan.admitted.append(seq)
            add_seq(seq)
            add_new(num_new)
            add_ctx(seq.num_computed)
            budget -= num_new
        self._note_peak()
        return plan

    # ---- after the step ---------------------------------------------------------------------------
    def complete(self, plan: StepPlan) -> tuple[list[Request], list[Request]]:
        """Apply a finished step. Returns (sequences that sampled their first token, finished)."""
        first: list[Request] = []
        done: list[Request] = []
        bs = self.block_size
        for seq, n in zip(plan.seqs, plan.num_new, strict=True):
            seq.num_computed += n
            self.outstanding_tokens -= n
            if seq.keys and len(seq.held_keys) < len(seq.keys):
                full = bisect_right(seq.key_cum, seq.num_computed // bs) - 1  # entries fully computed
                start = len(seq.held_keys)
                if full > start:
                    self._promote(seq, start, full)
            if seq.num_computed == seq.num_tokens:
                seq.num_generated += 1
                seq.num_tokens += 1
                if seq.num_generated == 1:
                    first.append(seq)
                if seq.num_generated >= seq.output_len:
                    done.append(seq)
        if done:
            self._finish(done)
        return first, done

    def _finish(self, done: list[Request]) -> None:
        for seq in done:
            self._release(seq)
            seq.status = RequestStatus.FINISHED
        gone = {id(s) for s in done}
        self.running = [s for s in self.running if id(s) not in gone]

    def _promote(self, seq: Request, start: int, end: int) -> None:
        """Entries start..end-1 just became full: the pool caches them (or shares equal content)."""
        keys = seq.keys[start:end]
        cum = seq.key_cum
        self.pool.promote(keys, [cum[i + 1] - cum[i] for i in range(start, end)])
        seq.num_private -= cum[end] - cum[start]
        seq.held_keys = seq.held_keys + keys if seq.held_keys else keys

    # ---- fast-forward -----------------------------------------------------------------------------
    def decode_horizon(self, plan: StepPlan, max_steps: int) -> tuple[int, np.ndarray]:
        """How many decode-only steps (the planned one included) can run with no event between.

        Bounded by the first completion and by free blocks (no preemption may be needed). Returns
        (k_max, sum of the sequences' cached contexts before each step j < k_max).
        """
        seqs = plan.seqs
        k = max_steps
        sum_c = 0
        for s in seqs:
            r = s.output_len - s.num_generated
            if r < k:
                k = r
            sum_c += s.num_computed
        # A run only takes empty blocks: an eviction could shorten the queue head's prefix hits and
        # let it in at the next step, and evicting an entry returns its surplus blocks to the free
        # pool, so memory occupancy would dip and rise unseen inside the run.
        free = self.pool.free
        if self._blocks_through(seqs, k - 1) > free:
            lo, hi = 0, k - 1  # step 0 always fits (its blocks are allocated); find the last j that fits
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self._blocks_through(seqs, mid) <= free:
                    lo = mid
                else:
                    hi = mid - 1
            k = lo + 1
        return k, sum_c + np.arange(k, dtype=np.int64) * len(seqs)

    def _blocks_through(self, seqs: list[Request], j: int) -> int:
        """New blocks the sequences need to run decode steps 0..j (step 0's are already held)."""
        bs = self.block_size
        total = 0
        for s in seqs:
            n = -(-(s.num_computed + j + 1) // bs) - s.nblocks
            if n > 0:
                total += n
        return total

    def advance_decode(self, plan: StepPlan, k: int) -> list[Request]:
        """Apply k decode-only steps at once (the first already has its blocks). Returns finished."""
        bs = self.block_size
        extra = 0
        done = []
        for seq in plan.seqs:
            seq.num_computed += k
            seq.num_generated += k
            seq.num_tokens += k
            new_blocks = -(-seq.num_computed // bs) - seq.nblocks
            if new_blocks > 0:
                seq.num_private += new_blocks
                seq.nblocks += new_blocks
                extra += new_blocks
            if seq.num_generated >= seq.output_len:
                done.append(seq)
        if extra:
            self.pool.allocate(extra)
        self._note_peak()
        self.outstanding_tokens -= k * len(plan.seqs)
        if done:
            self._finish(done)
        return done

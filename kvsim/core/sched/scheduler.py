"""The scheduler's batch decision, vLLM-v1 style, with no clock in it.

Each step (`schedule`): running requests first, in order, each asking for its remaining tokens
(one while decoding, a chunk while prefilling) within the token budget; when blocks run out the
newest running request is preempted (recompute: its blocks are released and it rejoins the front
of the queue, to recompute prompt and generated tokens, re-using whatever its prompt left in the
prefix cache: `_schedule_running`, `_take`). Then, if nothing was preempted, swapped-out requests
come back (`_swap_in`, below) and waiting requests are admitted first-come-first-served while the
request cap, the token budget and free blocks allow (`_admit_waiting`); an admitted request first
takes its prefix-cache hits (at least one token is always computed, as in vLLM). A request samples
a token when its computed tokens reach its token count; the first sampled token is its first
token. See docs/architecture.md for the scheduler's place in a replica.

Prefix caching follows vLLM v1: the full blocks a step will compute are registered when the step
is scheduled (so a request admitted while another prefills the same prefix hits it, in the same
step or a later one), not when the step completes.

Blocks are the KV cache manager's business (`kvsim.core.kv_cache_manager`): the scheduler asks it
how many blocks a request needs and whether they fit, never the pool itself.

Token accounting: a request with P prompt and O output tokens computes P + O - 1 tokens (the last
sampled token is never fed back), which is what ``outstanding_tokens`` counts down.

A lower tier (`host`, a node's DRAM: `kvsim.core.tiers`), when given: a waiting request whose prefix
continues past its HBM hits into entries the tier holds is admitted to load them instead of
prefilling (`RequestStatus.WAITING_FOR_KV_TRANSFER`): its HBM hits are taken and blocks for the
entries to load reserved (`KVCacheManager.admit_loading`), it is listed in `new_loads` for the
engine to start the transfer, and it counts against the request cap while it waits; other requests
keep running and being admitted behind it. When the engine says the load arrived (`finish_load`),
it joins the running requests, its loaded entries cached in HBM, and prefills the remainder.

Preemption by swap (`swap_decider`, given for ``scheduler.preemption: swap | auto``):
a victim the decider accepts keeps its computed tokens; its blocks are released (their KV was
copied to host memory: `new_swaps` tells the engine, which queues the copy) and it joins the
`swapped` queue, which is served before the waiting one (vLLM v0's order): a swapped request is
readmitted with as many blocks as it swapped out (`swap_blocks`: its computed tokens'; with token
eviction, the blocks it held, and its evicted count is kept, so it resumes with the same kept
tokens), once its next step's blocks and 1% of the pool stay free beside them, waits for KV while
they are copied back, and resumes where it stopped. A victim the decider refuses is recomputed as
above (with token eviction: its whole context, which trims again after its prompt).

Speculative decoding (`spec`, `kvsim.core.spec_decode`): a decoding request computes its last token
plus up to k drafts in one verify row, blocks for all those slots taken before the step; `advance`
draws its accepted drafts and advances it by accepted + 1 tokens, the rejected drafts' slots rolled
back (vLLM v1: ``num_computed`` rewound, blocks kept until the request ends). A swapped victim
copies the blocks it holds, look-ahead ones too (`swap_blocks`), and resumes with the same computed
tokens and verify-step index; its swap-in keeps room for its next verify step's slots.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Sequence

import numpy as np

from kvsim.core.eviction import EvictionKind
from kvsim.core.kv_cache_manager import KVCacheManager
from kvsim.core.request import Request, RequestStatus
from kvsim.core.sched.output import SchedulerOutput
from kvsim.core.spec_decode import SpecDecoder
from kvsim.core.tiers import SwapDecider, TierLookup

_NO_NEW_BLOCKS = (0,)  # a single step's blocks: all taken when it was scheduled


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_num_seqs: int,
        max_batched_tokens: int,
        chunked_prefill: bool,
        spec: SpecDecoder | None = None,
        host: TierLookup | None = None,
        swap_decider: SwapDecider | None = None,
    ) -> None:
        self.kv = kv
        self.block_size = kv.block_size
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.outstanding_tokens = 0
        self.num_steps = 0  # steps applied; the pool's last-access stamp
        # Of the last steps applied (`advance`): the blocks taken at each of them (the first's by
        # `schedule`, so 0), for the engine's blocks-in-use integral.
        self.last_new_blocks: Sequence[int] | np.ndarray = _NO_NEW_BLOCKS
        self.host = host  # lower tiers to load prefix entries from (None: off)
        self.loading: list[tuple[Request, int]] = []  # (request, entries it loads), waiting for KV
        self.new_loads: list[tuple[Request, int, int]] = []  # admitted to load since the engine looked:
        # (request, HBM entries it holds, entries to load after them)
        self.swap_decider = swap_decider  # swap this victim? (None: never)
        self.swapped: deque[Request] = deque()  # swapped out, KV in host memory, to swap back in
        self.new_swaps: list[tuple[Request, int, bool]] = []  # since the engine looked:
        # (request, blocks, out: True for a swap-out, False for a swap-in)
        self._swapped_blocks: dict[int, int] = {}  # request id -> blocks its swap-out copied
        self.spec = spec  # speculative decoding's acceptance (None: off)

    # ---- admission --------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)
        self.outstanding_tokens += req.prompt_len + req.output_len - 1

    @property
    def num_requests(self) -> int:
        """Requests in this engine (running, waiting, swapped out, or waiting for KV)."""
        return len(self.running) + len(self.waiting) + len(self.loading) + len(self.swapped)

    @property
    def may_evict_in_window(self) -> bool:
        """Whether evicting cached entries during a decode-only window cannot change who is admitted
        next: nothing waits, or the running cap is reached (`kvsim.core.horizon`)."""
        return not self.waiting or len(self.running) >= self.max_num_seqs

    def swap_blocks(self, req: Request) -> int:
        """Blocks a swap of running `req` copies out (and back in): the blocks holding its computed
        tokens; for a request that evicted tokens, the blocks it holds (its resident tokens' blocks,
        with the masked slots of soft-mark pages), not its computed tokens'; with speculative
        decoding, the blocks it holds too: its last verify step's look-ahead blocks (rejected drafts'
        slots, rolled back but kept, as vLLM keeps them in the block table) go out and come back
        with it, so it resumes with the same blocks and the same computed tokens."""
        if req.evicted or self.spec is not None:
            return req.num_blocks
        return -(-req.num_computed // self.block_size)

    def _preempt(self, req: Request) -> None:
        decide = self.swap_decider
        if decide is not None and decide(req, blocks := self.swap_blocks(req)):
            self.new_swaps.append((req, blocks, True))
            self._swapped_blocks[req.id] = blocks
            evicted = req.evicted
            self.kv.free(req)  # its KV is copied out first (the engine queues the copy)
            req.evicted = evicted  # its kept tokens come back as they left
            req.preemptions += 1
            req.status = RequestStatus.PREEMPTED
            self.swapped.appendleft(req)
            return
        self.kv.free(req)
        self.outstanding_tokens += req.num_computed
        req.num_computed = 0
        req.preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)

    def drop_all(self) -> list[Request]:
        """The replica went down: every request in it, running first then waiting in queue order,
        released and removed (their progress kept for the caller to count; it restarts them), and
        the prefix cache emptied. Returns them. Not with requests loading KV or swapped out (the
        tiers' transfers in flight are not unwound: refused with faults)."""
        assert not self.loading and not self.swapped, "loads and swaps are not unwound"
        reqs = [*self.running, *self.waiting]
        kv = self.kv
        for req in reqs:
            kv.free(req)
        kv.pool.wipe()
        kv.take_eviction_work()  # trims of the step that ended last: priced in a pause that is lost
        kv.evict_active = False  # the trigger's state over an empty pool
        self.running = []
        self.waiting.clear()
        self.outstanding_tokens = 0
        return reqs

    def schedule(self) -> SchedulerOutput:
        """The next step's batch: the running requests first (`_schedule_running`, which may preempt),
        then, if none was preempted, swapped-out requests back in (`_swap_in`) and waiting ones
        admitted (`_admit_waiting`) within what is left of the token budget."""
        out = SchedulerOutput()
        kv = self.kv
        kv.set_step(self.num_steps)
        budget = self._schedule_running(out)
        if not out.preempted:
            if self.swapped:
                self._swap_in()
            if not self.swapped and self.waiting and budget > 0:
                self._admit_waiting(out, budget)
        kv.note_peak()
        return out

    def _schedule_running(self, out: SchedulerOutput) -> int:
        """The running requests in order, each its next tokens within the token budget: one while
        decoding, its last token and drafts in a verify row (speculative decoding), a chunk while
        prefilling; when blocks run out the newest are preempted (`_take`). Returns the budget
        left."""
        kv = self.kv
        budget = self.max_batched_tokens
        running = self.running
        add_dec, add_dec_ctx = out.decode_reqs.append, out.decode_ctx.append
        bs = self.block_size
        spec = self.spec
        # A format switch: decode rows past their crossing (evicted > 0) are in its second format.
        switching = kv.eviction is not None and kv.eviction.kind is EvictionKind.SWITCH
        last_is_prefill = False
        i = 0
        if spec is None and not switching:  # the leading decode rows, in a loop of their own
            i, budget = self._decode_rows(out, budget)
            if i < 0:  # the request that needed a block was preempted
                out.last_is_prefill = False
                return budget
        while i < len(running) and budget > 0:
            req = running[i]
            c = req.num_computed
            num_new = req.num_tokens - c
            drafts = 0
            if num_new == 1 and req.num_generated > 0:
                if spec is not None:  # a verify step: no more drafts than its output or budget needs
                    drafts = min(spec.k, req.output_len - req.num_generated - 1, budget - 1)
                if not drafts:  # decoding: the common case, kept short
                    c -= req.evicted  # attention and slots follow the resident tokens (0 evicted: all)
                    if c >= req.num_blocks * bs and not self._take(req, 1, out):
                        break
                    add_dec(req)
                    add_dec_ctx(c)
                    if switching and req.evicted:
                        out.decode_switched += 1
                        out.decode_switched_ctx += c
                    last_is_prefill = False
                    budget -= 1
                    i += 1
                    continue
                num_new = 1 + drafts
                need = -(-(c + num_new) // bs) - req.num_blocks
            else:
                if num_new > budget:
                    num_new = budget
                # kv.blocks_needed, inlined (hot loop); a window's chunk fills the slots it freed
                need = -(-(c - req.evicted + num_new) // bs) - req.num_blocks
            if need > 0 and not self._take(req, need, out):
                break
            if drafts:
                out.verify_reqs.append(req)
                out.verify_drafts.append(drafts)
                out.verify_ctx.append(c)
                last_is_prefill = False
            else:
                if len(req.held_keys) < len(req.keys):
                    kv.cache_blocks(req, c + num_new)  # at schedule time, as vLLM's allocate_slots
                out.prefill_reqs.append(req)
                out.prefill_new.append(num_new)
                out.prefill_ctx.append(c)
                out.prefill_sampling.append(c + num_new == req.num_tokens)
                last_is_prefill = True
            budget -= num_new
            i += 1
        out.last_is_prefill = last_is_prefill
        return budget

    def _decode_rows(self, out: SchedulerOutput, budget: int) -> tuple[int, int]:
        """`_schedule_running`'s decode rows from the front of the running requests while they
        decode one token (no speculative decoding, no format switch: the common case, kept short).
        Returns (the index of the first request not scheduled, or -1 when the one needing a block
        was preempted; the budget left)."""
        bs = self.block_size
        add_dec, add_dec_ctx = out.decode_reqs.append, out.decode_ctx.append
        i = 0
        for req in self.running:  # `_take` preempts from the end: a victim is never reached
            if budget <= 0:
                break
            c = req.num_computed
            if req.num_tokens - c != 1 or not req.num_generated:
                break  # prefilling: the general loop goes on from here
            c -= req.evicted
            if c >= req.num_blocks * bs and not self._take(req, 1, out):
                return -1, budget
            add_dec(req)
            add_dec_ctx(c)
            budget -= 1
            i += 1
        return i, budget

    def _take(self, req: Request, need: int, out: SchedulerOutput) -> bool:
        """`need` more blocks for running `req`, preempting the newest running requests until they
        fit; False when `req` itself was preempted."""
        kv = self.kv
        if kv.allocate_slots(req, need):
            return True
        kv.note_peak()  # memory is at its fullest just before a preemption
        running = self.running
        while True:
            victim = running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
            if kv.allocate_slots(req, need):
                return True

    def _swap_in(self) -> None:
        """Swapped-out requests back in, the front of the queue first, while the request cap and the
        blocks allow: their blocks are taken and they wait for KV while the copy back (listed in
        `new_swaps`) runs."""
        kv = self.kv
        running, loading, swapped = self.running, self.loading, self.swapped
        while swapped and len(running) + len(loading) < self.max_num_seqs:
            req = swapped[0]
            blocks = self._swapped_blocks[req.id]
            # vLLM v0's swap-in watermark (BlockSpaceManager's watermark=0.01: 1% of the blocks stay
            # free after it), plus, kvsim's addition, the blocks of the request's own next step (a
            # prefill chunk, one token, or a verify step's token and drafts), so it is not that
            # step's victim: else a request swapped out mid-prefill ping-pongs between HBM and host
            # without progress. The watermark is waived when nothing else runs or loads: no one else
            # can free blocks, and a request admitted at all fits a replica alone (else it would
            # wait forever).
            c = req.num_computed
            res = c - req.evicted  # its next step's slots follow its resident tokens
            step = min(req.num_tokens - c, self.max_batched_tokens)
            if step == 1 and req.num_generated > 0 and self.spec is not None:  # a verify step's drafts
                step += max(
                    0, min(self.spec.k, req.output_len - req.num_generated - 1, self.max_batched_tokens - 1)
                )
            nxt = -(-(res + step) // self.block_size) - blocks
            alone = not running and not loading
            headroom = (0 if alone else max(1, kv.num_blocks // 100)) + max(0, nxt)
            if blocks + headroom > kv.num_free_blocks or not kv.allocate_slots(req, blocks):
                break
            swapped.popleft()
            del self._swapped_blocks[req.id]
            req.status = RequestStatus.WAITING_FOR_KV_TRANSFER
            loading.append((req, -1))
            self.new_swaps.append((req, blocks, False))

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Waiting requests admitted first-come-first-served while the request cap, the token
        `budget` and the blocks allow, each taking its prefix-cache hits first; one whose prefix
        continues into entries a lower tier holds is admitted to load them instead (`new_loads`)."""
        kv, host = self.kv, self.host
        running, loading, waiting = self.running, self.loading, self.waiting
        while waiting and len(running) + len(loading) < self.max_num_seqs and budget > 0:
            req = waiting[0]
            hits, computed = kv.get_computed_blocks(req)
            if host is not None and req.keys:
                n = self._host_hits(host, req, hits)
                if n:
                    if not kv.admit_loading(req, hits, n):
                        break
                    waiting.popleft()
                    req.status = RequestStatus.WAITING_FOR_KV_TRANSFER
                    host.touch(req.keys[hits : hits + n])
                    loading.append((req, n))
                    self.new_loads.append((req, hits, n))
                    continue
            num_new = req.num_tokens - computed
            if not self.chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            if not kv.admit(req, hits, num_new):
                break
            waiting.popleft()
            self.outstanding_tokens -= computed
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = computed
            req.status = RequestStatus.RUNNING
            running.append(req)
            out.admitted.append(req)
            if len(req.held_keys) < len(req.keys):
                kv.cache_blocks(req, computed + num_new)
            out.prefill_reqs.append(req)
            out.prefill_new.append(num_new)
            out.prefill_ctx.append(computed)
            out.prefill_sampling.append(computed + num_new == req.num_tokens)
            out.last_is_prefill = True
            budget -= num_new

    def _host_hits(self, host: TierLookup, req: Request, hits: int) -> int:
        """Entries after the `hits` HBM ones that `host` holds and that let the request skip
        tokens (at least one token is computed: entries wholly past that are not loaded)."""
        cum = req.key_cum
        cap = (req.num_tokens - 1) // self.block_size  # blocks a hit may cover
        if cum[hits] >= cap:
            return 0
        stop = min(len(req.keys), bisect_left(cum, cap, hits))
        win = self.kv.window_hit_blocks(req)  # sliding windows: no more than the request keeps
        if win >= 0:
            stop = min(stop, bisect_right(cum, win) - 1)
            if stop <= hits:
                return 0
        return host.num_prefix_hits(req.keys, hits, stop)

    def finish_load(self, req: Request) -> int:
        """The load of a request waiting for KV arrived: it runs from the next step, prefilling what
        its hits do not cover. Returns the tokens its hits (HBM and loaded) cover."""
        i = next((i for i, (r, _) in enumerate(self.loading) if r is req), -1)
        if i < 0:
            raise ValueError(f"request {req.id} is not loading")
        _, n = self.loading.pop(i)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        if n < 0:  # swapped back in: it resumes where it stopped
            return req.num_computed
        computed = self.kv.finish_loading(req, n)
        self.outstanding_tokens -= computed
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = computed
        return computed

    # ---- after the step ---------------------------------------------------------------------------
    def advance(self, out: SchedulerOutput, k: int = 1) -> tuple[list[Request], list[Request]]:
        """Apply `k` steps of `out`: the engine's one way to advance (a single step is k = 1). Each
        decode row computes one token a step; each prefill row its chunk a step, sampling when its
        computed tokens reach its token count; verify rows (k = 1 only: a speculative-decoding
        window applies through `advance_verify`) their accepted drafts. A fast-forward window
        (k > 1: decode-only, or decodes plus one prefill chunk, `kvsim.core.horizon`) takes the
        blocks of its steps after the first here (the first's were taken by `schedule`) and
        registers the prefilling request's full blocks. Returns (requests that sampled their first
        token, finished); a window applied in parts finishes nobody before its last part."""
        decoders = out.decode_reqs
        done = _advance_decoding(decoders, k)
        first: list[Request] = []
        tokens = k * len(decoders)
        if out.verify_reqs:
            assert k == 1, "verify steps run in windows of their own (advance_verify)"
            tokens += self._verify(out, done)
        kv = self.kv
        for req, n in zip(out.prefill_reqs, out.prefill_new, strict=True):
            req.num_computed += k * n
            tokens += k * n
        if k > 1:
            chunk = out.prefill_new[0] if out.prefill_reqs else 0
            self.last_new_blocks = kv.grow_decode([*decoders, *out.prefill_reqs], k, chunk)
            if chunk and len((p := out.prefill_reqs[0]).held_keys) < len(p.keys):
                kv.cache_blocks(p, p.num_computed)  # registered as each step was scheduled
        else:
            self.last_new_blocks = _NO_NEW_BLOCKS
        for req in out.prefill_reqs:
            if req.num_computed == req.num_tokens:  # its last chunk (or the window's): it samples
                _sample(req, first, done)
        self.num_steps += k
        self.outstanding_tokens -= tokens
        if done:
            if k > 1 and kv.eviction is not None:
                kv.settle_window(done, k)
            self._finish(done)
        if kv.eviction is not None:
            kv.apply_evictions(self.running, k)
        return first, done

    def _verify(self, out: SchedulerOutput, done: list[Request]) -> int:
        """A step's verify rows: each keeps its last token and its accepted drafts (the rejected
        drafts' slots rolled back: num_computed rewound, blocks kept, as vLLM v1). Returns the
        tokens they computed; the finished are added to `done`."""
        spec = self.spec
        assert spec is not None
        tokens = 0
        for req, d in zip(out.verify_reqs, out.verify_drafts, strict=True):
            e = spec.verify(req.id, req.spec_steps, d) + 1
            req.spec_steps += 1
            req.num_computed += e
            req.num_generated += e
            req.num_tokens += e
            tokens += e
            if req.num_generated >= req.output_len:
                done.append(req)
        return tokens

    def _finish(self, done: list[Request]) -> None:
        kv = self.kv
        kv.set_step(self.num_steps)
        for req in done:
            kv.free(req)
            req.status = RequestStatus.FINISHED
            req.keys, req.key_cum = [], [0]  # nothing reads them again; a long run keeps every request
        gone = {id(r) for r in done}
        self.running = [r for r in self.running if id(r) not in gone]

    def advance_verify(
        self, reqs: list[Request], drafts: list[list[int]], accepted: list[list[int]], first: int, n: int
    ) -> tuple[list[int], list[Request]]:
        """Apply steps ``first .. first + n - 1`` of a speculative-decoding window
        (`kvsim.core.horizon.verify_window`) to `reqs`, as stepping would: each step's blocks taken
        (step 0's are held already), then its drafts verified. Returns (blocks in use during each
        step, finished); every part but the window's last finishes nobody."""
        kv, spec, bs = self.kv, self.spec, self.block_size
        assert spec is not None
        used: list[int] = []
        done: list[Request] = []  # in `advance`'s order: plain decode rows, then verify rows
        done_verify: list[Request] = []
        for j in range(first, first + n):
            d_row = drafts[j]
            if j:
                kv.set_step(self.num_steps)
                for req, d in zip(reqs, d_row, strict=True):
                    need = -(-(req.num_computed + 1 + d) // bs) - req.num_blocks
                    if need > 0:
                        ok = kv.allocate_slots(req, need)
                        assert ok, "a verify window takes only blocks that are empty"
                kv.note_peak()
            used.append(kv.pool.num_used)
            self.num_steps += 1
            for req, d, a in zip(reqs, d_row, accepted[j], strict=True):
                e = 1
                if d:  # the window drew it (the same pure draw as `SpecDecoder.verify`)
                    spec.tally(d, a)
                    e += a
                    req.spec_steps += 1
                req.num_computed += e
                req.num_generated += e
                req.num_tokens += e
                self.outstanding_tokens -= e
                if req.num_generated >= req.output_len:
                    (done_verify if d else done).append(req)
        done += done_verify
        if done:
            self._finish(done)
        return used, done


def _advance_decoding(reqs: list[Request], k: int) -> list[Request]:
    """`reqs` decoded k tokens each (k steps); returns those that reached their output."""
    done = []
    for req in reqs:
        req.num_computed += k
        req.num_generated += k
        req.num_tokens += k
        if req.num_generated >= req.output_len:
            done.append(req)
    return done


def _sample(req: Request, first: list[Request], done: list[Request]) -> None:
    """`req` sampled a token at the end of a step: its first (TTFT), or its last (finished)."""
    req.num_generated += 1
    req.num_tokens += 1
    if req.num_generated == 1:
        first.append(req)
    if req.num_generated >= req.output_len:
        done.append(req)

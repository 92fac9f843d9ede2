"""The fast-forward horizon: how many steps can run as one engine event (decode-only or mixed).

Inside a window nothing may happen that stepping one by one would react to. Each mechanism that
can end a window contributes a bound, and the window is their minimum:

- ``max_steps``: a cap on the window (memory of the per-step arrays);
- ``outputs``: the first request to reach its output length finishes at that step;
- ``empty_blocks`` / ``free_blocks``: the window ends before the first step whose new blocks do
  not fit (step 0's are already allocated). While a request waits that could be admitted but for
  blocks, only empty blocks count: evicting a cached entry could shorten its prefix hits and let it
  in (or keep it out) at the next step. With nothing waiting, or the running cap reached, evicting
  cached-but-free entries inside the window is safe: a batch allocation evicts the same least-
  recently-used entries that one-block-per-step allocations would (nothing is released inside a
  window, so the LRU order is fixed), and the replica applies the steps that ended before any
  instant at which the router reads its prefix cache (`Replica.num_prefix_hits`);
- ``outside_event``: the next event from outside the replica (the end of the simulation, the end of
  a load from a lower tier, `kvsim.sim.offload`; closed-loop turns later): only steps that end strictly before it run, and at least
  one. It needs the steps' end times, so the replica applies it after pricing (`steps_before`). Arrivals are not outside events: one routed to this replica cuts its window where it lands
  (`steps_before`), and the others do not concern it.

Mixed windows: a step of decodes plus one prefill chunk that takes the rest of the token budget
(chunked prefill under load) repeats too: each decode computes one token and the chunk stays the
same size, until the prefill's last full chunk. No request can be admitted inside (the budget is
spent every step), so evicting cached entries is safe; the prefilling request registers its full
blocks as each step is scheduled, which the replica applies at the window's end or before the router
reads its prefix cache, and a key it would register that is cached already (sharing frees a block
mid-window) ends the window before that step (``shared_key``). `mixed_window` returns the per-step
contexts that `CostModel.step_times` prices (`StepRun.mixed`).

Verify windows (speculative decoding, `verify_window`): the accepted drafts of each request's step
are a pure function of (seed, request, step index), so each step's drafts, contexts and blocks are
known in advance; see `verify_window` for its bounds.

The block arithmetic of a window lives here, not in the KV cache manager: `blocks_needed_through`
(the new blocks steps 0..j take) and its bisection for the last step that fits.

A new mechanism starts by contributing a bound (one step is always correct), then a sharper one.
A window returns its per-step work (the cached tokens the batch attends before each step), which
the cost model prices in one call (`CostModel.step_times`).
See docs/architecture.md for where windows sit in the engine.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

import numpy as np

from kvsim.core.eviction import EvictionKind, first_trim
from kvsim.core.kv_cache_manager import KVCacheManager
from kvsim.core.request import Request
from kvsim.core.sched.output import SchedulerOutput
from kvsim.core.spec_decode import SpecDecoder


@dataclass(slots=True)  # built once per window: a frozen one costs more to build
class DecodeWindow:
    num_steps: int
    num_seqs: int
    sum_ctx: np.ndarray  # (num_steps,) int64: cached tokens of all requests before step j
    bound: str  # the mechanism that set num_steps
    new_blocks: int  # blocks its steps after the first take (more than the empty ones: it evicts)
    num_switched: int = 0  # format switch: requests in the second format (the same at every step)
    switched_ctx: np.ndarray | None = None  # (num_steps,) their part of sum_ctx (None: none)

    @property
    def tokens_attended(self) -> np.ndarray:
        """(num_steps,) tokens each step's attention reads: the cache plus the new token, per request."""
        return self.sum_ctx + self.num_seqs


def decode_window(
    out: SchedulerOutput, kv: KVCacheManager, max_steps: int, *, may_evict: bool = False
) -> DecodeWindow:
    """The longest run of decode-only steps, the scheduled one first, that no mechanism ends early.
    `may_evict`: whether the window may evict cached-but-free entries (see the module docstring)."""
    reqs = out.decode_reqs
    k, bound = max_steps, "max_steps"
    sum_c = 0
    for r in reqs:
        left = r.output_len - r.num_generated
        if left < k:
            k, bound = left, "outputs"
        sum_c += r.num_computed
    avail = kv.num_free_blocks if may_evict else kv.num_empty_blocks
    if kv.eviction is not None and not kv.keeps_all(reqs, k):
        return _evicting_decode_window(reqs, kv, k, bound, avail, may_evict)
    bs = kv.block_size
    need = blocks_needed_through(reqs, k - 1, bs)
    if need > avail:
        j = _last_fitting(reqs, k - 1, bs, 0, avail)
        k, bound = j + 1, "free_blocks" if may_evict else "empty_blocks"
        need = blocks_needed_through(reqs, j, bs)
    return DecodeWindow(k, len(reqs), sum_c + np.arange(k, dtype=np.int64) * len(reqs), bound, need)


def _evicting_decode_window(
    reqs: list[Request], kv: KVCacheManager, k: int, bound: str, avail: int, may_evict: bool
) -> DecodeWindow:
    """`decode_window` with token eviction on: resident tokens and blocks per step in closed form
    (`KVCacheManager.decode_plan`); the window also ends with the first step after which a request
    trims (``eviction``: it reaches its budget, the pressure trigger fires, or hybrid pages switch to
    physical release), that step included: the trim is applied when the window ends, as stepping
    applies it when that step ends."""
    c0, capped, resident, blocks, total = kv.decode_plan(reqs, k)
    new = total - total[0]  # blocks taken by steps 1..j together
    if new[-1] > avail:
        k, bound = (
            int(np.searchsorted(new, avail, side="right")),
            "free_blocks" if may_evict else "empty_blocks",
        )
    pool = kv.pool
    ev = kv.eviction
    assert ev is not None
    j = first_trim(
        ev,
        c0,
        capped,
        resident[:, :k],
        blocks[:, :k],
        pool.num_used,
        new,
        pool.num_blocks,
        kv.block_size,
    )
    if j < k:
        k, bound = j, "eviction"
    sum_ctx = resident[:, :k].sum(axis=0)
    n_sw, sw_ctx = _switched(kv, c0, resident, k)
    return DecodeWindow(k, len(reqs), sum_ctx, bound, int(new[k - 1]), n_sw, sw_ctx)


def _switched(
    kv: KVCacheManager, c0: np.ndarray, resident: np.ndarray, k: int
) -> tuple[int, np.ndarray | None]:
    """With a format switch: how many of a plan's requests are past their crossing (they hold
    fewer tokens than they computed: evicted > 0, as the scheduler counts them), and their resident
    tokens summed per step (a window ends at the step after which another crosses: `first_trim`)."""
    ev = kv.eviction
    if ev is None or ev.kind is not EvictionKind.SWITCH:
        return 0, None
    sw = resident[:, 0] < c0
    n = int(np.count_nonzero(sw))
    if not n:
        return 0, None
    return n, resident[sw, :k].sum(axis=0)


def _evicting_mixed_window(
    out: SchedulerOutput, kv: KVCacheManager, k: int, bound: str, avail: int, may_evict: bool
) -> MixedWindow | None:
    """`mixed_window` with token eviction on, from its bounds so far: the decodes' resident tokens
    and blocks in closed form (`KVCacheManager.decode_plan`), the prefilling request's blocks as
    its chunks fill them, and the window ending with the first step after which a decode trims
    (`first_trim`); the prefill, which evicts only once its prompt is done, samples at the last."""
    ev = kv.eviction
    assert ev is not None
    p = out.prefill_reqs[0]
    decs = out.decode_reqs
    m = len(decs)
    chunk = out.prefill_new[0]
    c_p = out.prefill_ctx[0]
    bs = kv.block_size
    if ev.kind is EvictionKind.WINDOW:
        # A window frees a prefilling request's out-of-window blocks after each chunk: the window
        # ends with the first step after which it has passed the length kept whole (the trim is
        # applied at the window's end, as stepping applies it at that step's), and a request that
        # trims already steps one by one.
        top = ev.keeps_all_up_to
        if p.evicted or c_p + chunk > top:
            return None
        j = (top - c_p) // chunk  # the first step after which c_p + (j + 1) x chunk > top
        if j + 1 < k:
            k, bound = j + 1, "window"
    steps = np.arange(k, dtype=np.int64)
    p_blocks = np.maximum(p.num_blocks, -(-(c_p + (steps + 1) * chunk) // bs))
    new = p_blocks - p_blocks[0]
    if m:
        c0, capped, resident, blocks, total = kv.decode_plan(decs, k)
        new = new + (total - total[0])
    if new[-1] > avail:
        k, bound = (
            int(np.searchsorted(new, avail, side="right")),
            "free_blocks" if may_evict else "empty_blocks",
        )
    if m:
        j = first_trim(
            ev, c0, capped, resident[:, :k], blocks[:, :k], kv.pool.num_used, new, kv.pool.num_blocks, bs
        )
        if j < k:
            k, bound = j, "eviction"
    if k < 2:
        return None
    steps = steps[:k]
    dec = resident[:, :k].sum(axis=0) if m else np.zeros(k, dtype=np.int64)
    n_sw, sw_ctx = _switched(kv, c0, resident, k) if m else (0, None)
    sampling = np.full(k, m, dtype=np.int64)
    if c_p + k * chunk == p.num_tokens:
        sampling[-1] += 1
    return MixedWindow(k, m, chunk, dec, c_p + steps * chunk, sampling, bound, int(new[k - 1]), n_sw, sw_ctx)


@dataclass(frozen=True)
class VerifyWindow:
    """A run of speculative-decoding steps (`verify_window`): per step, each running request's
    cached tokens and drafts (0: a plain decode of its last token), in running order."""

    num_steps: int
    ctx: list[list[int]]  # [step][row] cached tokens before the step
    drafts: list[list[int]]  # [step][row] draft tokens (0: a plain decode row)
    accepted: list[list[int]]  # [step][row] accepted drafts (`SpecDecoder.draw`)
    tokens: list[int]  # [step] tokens whose KV is kept, all rows: the outstanding count's fall
    bound: str


def verify_window(
    out: SchedulerOutput,
    kv: KVCacheManager,
    spec: SpecDecoder,
    running: list[Request],
    max_steps: int,
    max_batched_tokens: int,
    steady_budget: bool,
) -> VerifyWindow | None:
    """The longest run of verify steps, the scheduled one first, that stepping would schedule alike,
    or None. Each request's emitted tokens per step are known in advance (`SpecDecoder.draw` is a
    pure function of request and step), so its contexts, drafts and blocks are too.

    Bounds: the first finish (that step included); before the first step whose new blocks exceed
    the empty ones (so no cache entry is evicted, and every allocation succeeds as it would one step
    at a time); `max_steps`; with `steady_budget` (a request waits that the running cap does not
    hold back: a step's leftover budget decides whether it is admitted), before the first step whose
    tokens differ from the first's. The window exists only while the token budget never limits a
    request's drafts (all rows' k + 1 fit), every running request is scheduled, and no row is a
    prefill."""
    reqs = out.verify_reqs
    if out.prefill_reqs or out.decode_reqs or len(reqs) != len(running) or out.admitted or out.preempted:
        return None
    k, bs = spec.k, kv.block_size
    left = [r.output_len - r.num_generated for r in reqs]
    drafts0 = [min(k, n - 1) for n in left]
    if drafts0 != out.verify_drafts or len(reqs) + sum(drafts0) > max_batched_tokens:
        return None
    comp = [r.num_computed for r in reqs]
    nb = [r.num_blocks for r in reqs]
    sidx = [r.spec_steps for r in reqs]
    ids = [r.id for r in reqs]
    room = kv.num_empty_blocks
    ctx_s: list[list[int]] = []
    drafts_s: list[list[int]] = []
    tokens: list[int] = []
    accepted_s: list[list[int]] = []
    total0 = len(reqs) + sum(drafts0)
    bound = "max_steps"
    for j in range(max_steps):
        d = [min(k, n - 1) for n in left]
        if j:
            if steady_budget and len(reqs) + sum(d) != total0:
                bound = "budget"
                break
            new = _verify_blocks(comp, d, nb, bs, room)
            if new < 0:
                bound = "empty_blocks"
                break
            room -= new
        ctx_s.append(list(comp))
        drafts_s.append(d)
        acc, emitted, finished = _verify_draws(spec, ids, sidx, d, comp, left)
        tokens.append(emitted)
        accepted_s.append(acc)
        if finished:
            bound = "outputs"
            break
    return VerifyWindow(len(tokens), ctx_s, drafts_s, accepted_s, tokens, bound)


def _verify_blocks(comp: list[int], d: list[int], nb: list[int], bs: int, room: int) -> int:
    """The blocks a verify step takes (each row its token and drafts `d` past `comp`), `nb` (blocks
    held per row) grown by them; -1, nothing changed, when they exceed `room`."""
    needs = [-(-(c + 1 + n) // bs) - b for c, n, b in zip(comp, d, nb, strict=True)]
    new = sum(n for n in needs if n > 0)
    if new > room:
        return -1
    for i, n in enumerate(needs):
        if n > 0:
            nb[i] += n
    return new


def _verify_draws(
    spec: SpecDecoder, ids: list[int], sidx: list[int], d: list[int], comp: list[int], left: list[int]
) -> tuple[list[int], int, bool]:
    """One verify step's accepted drafts per row (`SpecDecoder.draw`, at each row's step index
    `sidx`), with `comp` (computed) and `left` (output left) advanced by what each row emits.
    Returns (accepted per row, tokens emitted, whether a row finished)."""
    emitted = 0
    finished = False
    acc = [0] * len(d)
    for i, n in enumerate(d):
        e = 1
        if n:
            acc[i] = spec.draw(ids[i], sidx[i], n)
            e += acc[i]
            sidx[i] += 1
        comp[i] += e
        left[i] -= e
        emitted += e
        finished = finished or left[i] <= 0
    return acc, emitted, finished


def steps_before(ends: list[float], t: float, k: int | None = None) -> int:
    """How many of the first `k` steps (all by default) end strictly before time `t`."""
    return bisect_left(ends, t, 0, len(ends) if k is None else k)


@dataclass(slots=True)
class MixedWindow:
    num_steps: int
    num_decode: int  # decoding requests: all but the last of the step
    chunk: int  # prefill tokens per step of the last request
    dec_sum_ctx: np.ndarray  # (num_steps,) int64: cached tokens of the decoding requests before step j
    prefill_ctx: np.ndarray  # (num_steps,) int64: cached tokens of the prefilling request before step j
    num_sampling: np.ndarray  # (num_steps,) int64: LM-head rows (the prefill samples at its last chunk)
    bound: str
    new_blocks: int  # blocks its steps after the first take (more than the empty ones: it evicts)
    num_switched: int = 0  # format switch: decoding requests in the second format
    dec_switched_ctx: np.ndarray | None = None  # (num_steps,) their part of dec_sum_ctx (None: none)


def mixed_window(
    out: SchedulerOutput, kv: KVCacheManager, max_steps: int, *, may_evict: bool = True
) -> MixedWindow | None:
    """The longest run of decodes-plus-one-full-chunk steps starting with the scheduled one, or None
    where the step is not of that shape or no second step would follow unchanged. `may_evict`
    False: its steps take empty blocks only (an eviction must happen at a schedule: offload)."""
    if out.admitted or out.preempted or len(out.prefill_reqs) != 1 or not out.last_is_prefill:
        return None
    p = out.prefill_reqs[0]
    reqs = [*out.decode_reqs, p]  # the prefill last, as `blocks_needed_through` takes it
    n = len(reqs)
    chunk = out.prefill_new[0]
    c_p = out.prefill_ctx[0]
    # Full chunks left, this one included; a shorter last chunk would leave budget for an admission.
    k, bound = (p.num_tokens - c_p) // chunk, "prefill"
    if k < 2:
        return None
    if max_steps < k:
        k, bound = max_steps, "max_steps"
    m = n - 1
    sum_c = 0
    for r in reqs[:m]:
        left = r.output_len - r.num_generated
        if left < k:
            k, bound = left, "outputs"
        sum_c += r.num_computed
    if p.keys and len(p.held_keys) < len(p.keys):
        refs = kv.pool.refs
        cum = p.key_cum
        bs = kv.block_size
        for e in range(len(p.held_keys), len(p.keys)):
            if p.keys[e] in refs:  # registering it at step j would share it and free a block
                j = -(-(cum[e + 1] * bs - c_p) // chunk) - 1
                if j < k:
                    k, bound = j, "shared_key"
                break
    if k < 2:
        return None
    avail = kv.num_free_blocks if may_evict else kv.num_empty_blocks
    if kv.eviction is not None:
        return _evicting_mixed_window(out, kv, k, bound, avail, may_evict)
    bs = kv.block_size
    need = blocks_needed_through(reqs, k - 1, bs, chunk)
    if need > avail:
        j = _last_fitting(reqs, k - 1, bs, chunk, avail)
        k, bound = j + 1, "free_blocks" if may_evict else "empty_blocks"
        if k < 2:
            return None
        need = blocks_needed_through(reqs, j, bs, chunk)
    steps = np.arange(k, dtype=np.int64)
    prefill_ctx = c_p + steps * chunk
    sampling = np.full(k, m, dtype=np.int64)
    if c_p + k * chunk == p.num_tokens:
        sampling[-1] += 1
    return MixedWindow(k, m, chunk, sum_c + steps * m, prefill_ctx, sampling, bound, need)


def blocks_needed_through(reqs: list[Request], j: int, block_size: int, chunk: int = 0) -> int:
    """New blocks the requests need to run steps 0..j of a window (step 0's are already held):
    one token per step each, but the last request `chunk` tokens per step when `chunk` > 0."""
    bs = block_size
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


def _last_fitting(reqs: list[Request], top: int, block_size: int, chunk: int, avail: int) -> int:
    """The last step j <= `top` through which the window's new blocks fit in `avail` (step 0
    always fits: its blocks are allocated), by bisection (the blocks needed grow with j)."""
    lo, hi = 0, top
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if blocks_needed_through(reqs, mid, block_size, chunk) <= avail:
            lo = mid
        else:
            hi = mid - 1
    return lo

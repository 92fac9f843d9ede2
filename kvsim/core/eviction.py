"""Token eviction per sequence, as closed-form functions of position (no state, no clock).

A sequence that evicts keeps ``kept(p)`` of its ``p`` computed tokens once its prompt is computed:

- H2O (Zhang et al., 2023): the ``recent_tokens`` newest plus the heavy hitters, a share
  ``heavy_ratio`` of the sequence (the design documents' "heavy-hitter ratio": active tokens kept /
  sequence length, 15-25% suggested, 000 section 4.2), capped at ``budget_tokens`` when one is given:
  ``kept(p) = min(p, recent + ceil(heavy_ratio * p), budget)``;
- StreamingLLM (Xiao et al., 2023): ``sink_tokens`` attention sinks plus a window of
  ``recent_tokens``: ``kept(p) = min(p, sinks + recent)``;
- attention entropy (000 section 4.2: a token whose attention entropy is below a threshold is
  kept, "only statistics before the softmax"): the ``recent_tokens`` newest plus the share
  ``keep_ratio`` of the sequence that passes the threshold, capped at ``budget_tokens``:
  ``kept(p) = min(p, recent + ceil(keep_ratio * p), budget)``, the closed form of H2O with its own
  share. Which tokens pass a threshold depends on the attention a simulator does not compute, so
  the share is an input (default 0.25, an estimate from 000 section 4.1: 70-80% of a long
  sequence's tokens get near-zero attention). Its per-step statistics are priced apart from H2O's
  score accumulation (`kvsim.costs.analytic`).

- token merging (003, 'token合并与压缩': similar tokens' KV merged into one, Cross-Attention
  Merging; CaM, Zhang et al., ICML 2024, merges the to-be-evicted tokens into the kept ones): a
  sequence holds ``merge_ratio`` of its tokens plus the recent window, H2O's closed form with its own
  share, and a merged slot costs what a token's slot does. Choosing what to merge needs the
  attention scores H2O accumulates, so the per-step work is priced as H2O's score accumulation and
  top-k (`scores`), the weighted average itself (two token reads and a write per merged token)
  left out as small beside it: an estimate. Merged KV is no prefix hit, as trimmed KV.

Each formula is written once (`_FORMS`): a function built for the policy's numbers when the policy
is (`Eviction.kept_fn`: the engine calls it per decoding request at every step end, with no branch
on the policy), beside the same arithmetic over arrays for the windows' closed forms (`kept_array`).
See docs/architecture.md ("Token eviction") for where the engine uses it.

``kept`` grows by at most one token per token computed, so a sequence at its budget evicts exactly
what it adds beyond it, every step: its resident tokens are ``kept(position)`` and the blocks it
needs for the step at ``p`` are ``ceil((kept(p) + 1) / block_size)`` (the new token's slot: an evicted
token's slot is reused, on every page policy). What differs between page policies is the trim, when
a sequence first drops many tokens (at the end of its prompt, or when pressure starts):

- ``soft_mark``: tokens are masked, blocks kept (peak memory does not fall);
- ``physical``: kept tokens are compacted to the front of the sequence's blocks and the rest freed
  down to what the next token needs (a compaction cost);
- ``hybrid``: soft-mark, and physical whenever the pool is under pressure (000 section 4.3: what
  vLLM and TensorRT-LLM do).

Trigger: ``always``, or ``pressure``: only while the blocks requests reference reach
``pressure_threshold`` of the pool (000 section 7.3: "evict only near the memory threshold"). The
same threshold switches ``hybrid`` to physical release.

Sliding-window layers (``ModelSpec.sliding_window``; `window_eviction`) reuse the same closed forms
as a third kind, ``window``, set from the model rather than ``kv.eviction``: vLLM v1's
``SlidingWindowManager`` frees the blocks that fall wholly out of the window, and its hybrid allocator
keeps full-attention and windowed layers in separate block groups. kvsim's block holds all layers'
KV of ``block_size`` tokens, so a sequence of ``p`` computed tokens keeps the layer average
``kept(p) = p`` up to ``W = sliding_window + global_tokens`` and
``ceil((L_full * p + L_win * W) / L_kv)`` past it (``L_win`` of the ``L_kv`` KV layers windowed), and
holds ``ceil((kept(p) + 1) / block_size)`` blocks for its next token: the hybrid split is rounded to
whole blocks per request (error under one block per request). With every layer windowed and ``W`` a
multiple of the block size this is vLLM's count at 15 of 16 positions (vLLM holds one block fewer
when the sequence ends on a block boundary): Mistral-7B (4,096 on every layer) holds 257 blocks of
16 tokens from 4,096 tokens on, not one more every 16 tokens. Windows free blocks physically, always
(trigger ``always``, pages ``physical``), at no cost: vLLM only rewrites block-table entries on the
host. Unlike eviction, a window also trims while its prompt prefills (after each chunk, as vLLM
frees between chunks): a chunk of ``c`` new tokens then writes into ``kept(p) + c`` slots (the
windowed layers hold the window plus the chunk, the full ones everything), so a prompt far longer
than the window never holds all its blocks. At its first trim a sequence gives up its prefix-cache
entries as eviction does (`KVCacheManager._trim`; it registers none after that):
blocks that fall out of the window are no hits for later requests, and a shared entry still inside
the window is counted as blocks of its own (kvsim's entries are the unit of sharing; vLLM keeps
referencing the shared blocks until they leave the window). With the memory tiers, those entries
leave HBM as rewritten (never written back); copies made below at registration stay hits, of which
a request takes no more than the blocks of its kept tokens (`KVCacheManager.window_hit_blocks`).

A format switch (``kv.format_switch``; `switch_eviction`) is a fourth kind, ``switch``: a sequence
keeps its KV in ``kv.format`` (``b1`` bytes a token) up to ``N = after_tokens`` tokens; past them it
is re-quantized to the second format (``b2 < b1`` bytes a token) and its later tokens are written in
it. Blocks are allocated in units of the first format's block bytes, so a block of the second format
packs ``b1 / b2`` times more tokens: ``kept(p) = p`` up to ``N`` and ``ceil(p * b2 / b1)``
first-format token slots past it, and the sequence holds ``ceil((kept(p) + 1) / block_size)``
blocks (error under one block per request). The crossing is a trim after the step that passes
``N`` (as eviction's first trim: once the prompt is computed, so a prompt longer than ``N`` is
prefilled in the first format and re-quantized whole): every resident token is read in the first
format and written in the second (`EvictionWork.requant_tokens`, priced by the cost model), the
blocks the smaller format frees return to the pool, and the sequence's cache entries are given up
(re-quantized blocks are no hits for requests reading the first format; a shared entry is copied).
A switched sequence's decode attention and its new tokens' quantize-on-write are priced in the
second format (`SchedulerOutput.decode_switched`).

Left out: per-head and per-layer budgets (all heads keep the same
tokens, as in ``kernels/h2o.py``), and evicting during prefill (H2O scores and entropy statistics
need the prompt's attention first, so eviction starts with the first decode step).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from enum import Enum
from math import ceil

import numpy as np

from kvsim.spec.formats import FormatSwitch, KVFormat
from kvsim.spec.models import ModelSpec
from kvsim.spec.scenario import EvictionConfig

_EMPTY = np.zeros(0, dtype=np.int64)
_TABLE_MAX = 1 << 22  # positions `kept_array` tables (32 MiB of int64 at most)


class EvictionKind(str, Enum):
    H2O = "h2o"
    STREAMING = "streaming"
    WINDOW = "window"  # sliding-window layers (the model's, not kv.eviction's): `window_eviction`
    SWITCH = "switch"  # kv.format_switch: re-quantized to a smaller format past a length
    ENTROPY = "entropy"  # attention entropy below a threshold: H2O's closed form, `keep_ratio`
    MERGE = "merge"  # token merging: H2O's closed form with `merge_ratio`, priced as H2O's scores


class Trigger(str, Enum):
    ALWAYS = "always"
    PRESSURE = "pressure"


class PagePolicy(str, Enum):
    SOFT_MARK = "soft_mark"
    PHYSICAL = "physical"
    HYBRID = "hybrid"


@dataclass(frozen=True)
class Eviction:
    kind: EvictionKind
    heavy_ratio: float = 0.2  # h2o: heavy hitters kept / sequence length (000 section 7.3: start at 20%)
    keep_ratio: float = 0.25  # entropy: share below the entropy threshold (estimate, 000 section 4.1)
    merge_ratio: float = 0.5  # merge: tokens kept after merging / length (estimate: pairs merged)
    recent_tokens: int = 0
    sink_tokens: int = 0  # streaming
    budget_tokens: int = 0  # h2o, entropy: a cap on tokens kept (0: none)
    trigger: Trigger = Trigger.ALWAYS
    pressure_threshold: float = 0.9
    pages: PagePolicy = PagePolicy.HYBRID
    # window: W (the window plus its global tokens), and the KV layers that are windowed of all
    window_tokens: int = 0
    window_layers: int = 0
    kv_layers: int = 1
    # switch: N, and the second format's bytes per token over the first's (b2 / b1, lowest terms)
    switch_after: int = 0
    switch_num: int = 1
    switch_den: int = 1
    keeps_all_up_to: int = field(init=False, default=0)
    # `kept` of positions 0..len-1 (int64), grown by doubling as longer sequences ask: one look-up
    # per window instead of a handful of array operations (`kept_array`)
    _table: np.ndarray = field(init=False, repr=False, compare=False, default_factory=lambda: _EMPTY)

    # `kept` built once for the policy (`_FORMS`): the engine calls it per decoding request per
    # step end, with no branch on the policy there
    kept_fn: Callable[[int], int] = field(init=False, repr=False, compare=False)
    _kept_range: Callable[[np.ndarray], np.ndarray] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        kept, kept_range = _FORMS[self.kind](self)
        object.__setattr__(self, "kept_fn", kept)
        object.__setattr__(self, "_kept_range", kept_range)
        # The longest sequence that keeps every token (kept(p) == p up to it, p - kept(p) never
        # falls): the engine skips shorter sequences without evaluating `kept`.
        lo, hi = 0, 1 << 31
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if kept(mid) == mid:
                lo = mid
            else:
                hi = mid - 1
        object.__setattr__(self, "keeps_all_up_to", lo)

    def __reduce__(self) -> tuple[type[Eviction], tuple[object, ...]]:
        """Pickled by its fields: its built forms are rebuilt, not pickled."""
        return (Eviction, tuple(getattr(self, f.name) for f in fields(self) if f.init))

    def kept(self, pos: int) -> int:
        """Tokens a sequence at its budget keeps of ``pos`` computed ones."""
        return self.kept_fn(pos)

    def kept_array(self, pos: np.ndarray, top: int = -1) -> np.ndarray:
        """`kept` element by element (int64), from a table of positions 0..len-1; `top`: the
        largest of `pos` where the caller knows it."""
        table = self._table
        if top < 0:
            top = int(pos.max()) if pos.size else 0
        if top >= len(table):
            if top >= _TABLE_MAX:  # multi-million-token contexts: computed, not tabled (memory)
                return self._kept_range(pos)
            size = max(1024, len(table))
            while size <= top:
                size *= 2
            table = self._kept_range(np.arange(size, dtype=np.int64))
            object.__setattr__(self, "_table", table)
        out: np.ndarray = table[pos]
        return out

    @property
    def share(self) -> float:
        """The share of the sequence kept besides the recent window: H2O's heavy hitters, or the
        tokens under the entropy threshold (``keep_ratio``), or the merged tokens (``merge_ratio``)."""
        if self.kind is EvictionKind.ENTROPY:
            return self.keep_ratio
        return self.merge_ratio if self.kind is EvictionKind.MERGE else self.heavy_ratio

    def under_pressure(self, used_blocks: int, num_blocks: int) -> bool:
        return used_blocks >= self.pressure_threshold * num_blocks

    def active(self, used_blocks: int, num_blocks: int) -> bool:
        """Whether sequences evict after a step that leaves ``used_blocks`` referenced."""
        return self.trigger is Trigger.ALWAYS or self.under_pressure(used_blocks, num_blocks)

    def releases(self, used_blocks: int, num_blocks: int) -> bool:
        """Whether a trim frees blocks (physical release) at this occupancy."""
        if self.pages is PagePolicy.PHYSICAL:
            return True
        return self.pages is PagePolicy.HYBRID and self.under_pressure(used_blocks, num_blocks)

    def scores(self) -> bool:
        """Whether every decode step keeps per-token statistics and a trim ranks them (H2O's
        accumulated scores, the entropy statistics, merging's attention scores), or eviction is
        positional."""
        return self.kind in (EvictionKind.H2O, EvictionKind.ENTROPY, EvictionKind.MERGE)


# Each policy's formula (the module docstring), written once: `kept` of one position, built for the
# policy's numbers, and the same arithmetic element by element over an int64 array (`kept_array`).
_Forms = tuple[Callable[[int], int], Callable[[np.ndarray], np.ndarray]]


def _streaming_forms(ev: Eviction) -> _Forms:
    window = ev.sink_tokens + ev.recent_tokens

    def kept(pos: int) -> int:
        return pos if pos < window else window

    def kept_range(pos: np.ndarray) -> np.ndarray:
        out: np.ndarray = np.minimum(pos, window)
        return out

    return kept, kept_range


def _switch_forms(ev: Eviction) -> _Forms:
    after, num, den = ev.switch_after, ev.switch_num, ev.switch_den

    def kept(pos: int) -> int:
        return pos if pos <= after else -(-(pos * num) // den)

    def kept_range(pos: np.ndarray) -> np.ndarray:
        return np.where(pos <= after, pos, -(-(pos * num) // den)).astype(np.int64)

    return kept, kept_range


def _window_forms(ev: Eviction) -> _Forms:
    w, layers = ev.window_tokens, ev.kv_layers
    full, w_part = layers - ev.window_layers, ev.window_layers * w

    def kept(pos: int) -> int:
        return pos if pos <= w else -(-(full * pos + w_part) // layers)

    def kept_range(pos: np.ndarray) -> np.ndarray:
        return np.where(pos <= w, pos, -(-(full * pos + w_part) // layers)).astype(np.int64)

    return kept, kept_range


def _scored_forms(ev: Eviction) -> _Forms:
    """H2O, attention entropy and token merging: the same closed form, each with its share."""
    rec, share, cap = ev.recent_tokens, ev.share, ev.budget_tokens
    if cap:

        def kept(pos: int) -> int:
            k = rec + ceil(share * pos)
            if k > cap:
                k = cap
            return pos if pos < k else k

    else:

        def kept(pos: int) -> int:  # (no cap to compare with)
            k = rec + ceil(share * pos)
            return pos if pos < k else k

    def kept_range(pos: np.ndarray) -> np.ndarray:
        out = np.ceil(share * pos).astype(np.int64)
        out += rec
        if cap:
            np.minimum(out, cap, out=out)
        np.minimum(pos, out, out=out)
        return out

    return kept, kept_range


_FORMS: dict[EvictionKind, Callable[[Eviction], _Forms]] = {
    EvictionKind.STREAMING: _streaming_forms,
    EvictionKind.SWITCH: _switch_forms,
    EvictionKind.WINDOW: _window_forms,
    EvictionKind.H2O: _scored_forms,
    EvictionKind.ENTROPY: _scored_forms,
    EvictionKind.MERGE: _scored_forms,
}


def blocks_for(resident: int, block_size: int) -> int:
    """Blocks a sequence of ``resident`` tokens needs to write its next token."""
    return -(-(resident + 1) // block_size)


@dataclass
class EvictionWork:
    """What the trims after one step did, for the cost model to price (`CostModel.eviction_time`):
    ``select_tokens`` scored tokens ranked for top-k (H2O, entropy), ``moved_tokens`` tokens of KV moved
    (compaction on physical release, and copies of shared prefix blocks a trimmed sequence must own
    before rewriting them), ``table_entries`` block-table entries rewritten. The steady eviction of
    a sequence at its budget (one token out per token in, its slot reused) is priced with the step
    instead (score accumulation and selection per attended token). A format switch's crossing
    re-quantizes ``requant_tokens`` tokens (`switch_eviction`)."""

    trims: int = 0
    select_tokens: int = 0
    moved_tokens: int = 0
    table_entries: int = 0
    requant_tokens: int = 0  # format switch: tokens read in the first format, written in the second

    def __bool__(self) -> bool:
        return self.trims > 0


def decode_steps(
    ev: Eviction,
    c0: np.ndarray,
    ev0: np.ndarray,
    held0: np.ndarray,
    active: bool,
    k: int,
    block_size: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Resident tokens attended and blocks held at each of `k` decode steps, per sequence, closed form,
    from positions ``c0``, evicted counts ``ev0`` and blocks held ``held0``: a sequence at its budget
    (``capped``: it evicted before, stands at ``kept(c0)`` and the trigger is ``active``) holds
    ``kept(position)``; the others grow one token a step. Returns (capped (n,), resident (n, k),
    blocks (n, k)), int64 but for the mask."""
    j = np.arange(k, dtype=np.int64)
    res0 = c0 - ev0
    if active and ev0.any():
        kept = ev.kept_array(c0[:, None] + j, int(c0.max()) + k - 1 if len(c0) else -1)
        capped = (ev0 > 0) & (res0 == kept[:, 0])
        if capped.all():
            resident = kept
        elif capped.any():
            resident = np.where(capped[:, None], kept, res0[:, None] + j)
        else:
            resident = res0[:, None] + j
    else:
        capped = np.zeros(len(c0), dtype=bool)
        resident = res0[:, None] + j
    blocks = (resident + block_size) // block_size  # ceil((resident + 1) / block_size)
    np.maximum(blocks, held0[:, None], out=blocks)
    return capped, resident, blocks


def first_trim(
    ev: Eviction,
    c0: np.ndarray,
    capped: np.ndarray,
    resident: np.ndarray,
    blocks: np.ndarray,
    used0: int,
    new: np.ndarray,
    num_blocks: int,
    block_size: int,
    shortcut: bool = True,
) -> int:
    """How many steps of a decode run of `k` may run as one window, given the blocks referenced after
    each step (``used``): up to and including the first step after which some sequence trims
    (evicts more than its steady token, or frees blocks), and only up to the first step after which
    the pressure trigger no longer holds while a sequence at its budget relies on it. `shortcut`
    False: every step's events computed even where a closed form gives the answer (for its test)."""
    k = int(resident.shape[1])
    pressure_free = (
        ev.pages is not PagePolicy.HYBRID or used0 + new[k - 1] < ev.pressure_threshold * num_blocks
    )
    if ev.trigger is Trigger.ALWAYS and pressure_free:
        # The trigger always on and hybrid pages (if any) never under pressure (blocks referenced
        # only grow inside a run): a sequence at its budget never trims, since under physical
        # release it holds no block beyond what its kept tokens need.
        if capped.all():
            return k
    if ev.trigger is Trigger.ALWAYS and pressure_free and shortcut:
        free = ~capped
        c_u, r_u = c0[free], resident[free, 0]
        if (r_u == c_u).all() and (
            ev.pages is not PagePolicy.PHYSICAL
            or (
                (blocks[free, 0] <= (r_u + 1 + block_size) // block_size).all()
                and (blocks[capped, 0] <= (resident[capped, 0] + block_size) // block_size).all()
            )
        ):
            # The others never evicted and hold no block beyond their next token's (nor, under
            # physical release, do those at their budget beyond their kept tokens'): each first
            # trims at the step whose new token passes `keeps_all_up_to` (kept(p) == p up to it,
            # p - kept(p) > 0 and never falling past it), the full computation below in one min.
            return min(k, int(np.maximum(ev.keeps_all_up_to - c_u, 0).min()) + 1)
    used = used0 + new[:k]
    j = np.arange(k, dtype=np.int64)
    kept1 = ev.kept_array(c0[:, None] + (j + 1), int(c0.max()) + k if len(c0) else -1)
    if ev.trigger is Trigger.ALWAYS:
        active = np.ones(k, dtype=bool)
    else:
        active = used >= ev.pressure_threshold * num_blocks
    if ev.pages is PagePolicy.PHYSICAL:
        release = np.ones(k, dtype=bool)
    elif ev.pages is PagePolicy.HYBRID:
        release = used >= ev.pressure_threshold * num_blocks
    else:
        release = np.zeros(k, dtype=bool)
    grown = resident + 1
    evicts = active[None, :] & (grown > kept1)
    target = np.where(evicts, kept1, grown)
    event = (evicts & ~capped[:, None]) | (release[None, :] & (blocks > -(-(target + 1) // block_size)))
    hit = event.any(axis=0)
    n = int(np.argmax(hit)) + 1 if hit.any() else k
    if capped.any() and not active.all():
        n = min(n, max(1, int(np.argmin(active))))
    return n


def window_eviction(model: ModelSpec) -> Eviction | None:
    """The model's sliding-window layers as a `Eviction` of kind ``window`` (None without any): see
    the module docstring."""
    win = model.windowed_kv_layers()
    if not win:
        return None
    return Eviction(
        kind=EvictionKind.WINDOW,
        trigger=Trigger.ALWAYS,
        pages=PagePolicy.PHYSICAL,
        window_tokens=model.sliding_window + model.global_tokens,
        window_layers=win,
        kv_layers=model.kv_layers,
    )


def switch_eviction(model: ModelSpec, first: KVFormat, switch: FormatSwitch | None) -> Eviction | None:
    """``kv.format_switch`` as a `Eviction` of kind ``switch`` (None without one): see the module
    docstring. The bytes per token are the model's, all layers (the ratio is the same per GPU)."""
    if switch is None:
        return None
    b1, b2 = model.kv_bytes_per_token(first), model.kv_bytes_per_token(switch.format)
    g = math.gcd(b1, b2)
    return Eviction(
        kind=EvictionKind.SWITCH,
        trigger=Trigger.ALWAYS,
        pages=PagePolicy.PHYSICAL,
        switch_after=switch.after_tokens,
        switch_num=b2 // g,
        switch_den=b1 // g,
    )


def eviction_from_config(cfg: EvictionConfig) -> Eviction | None:
    """The scenario's ``kv.eviction`` as a policy (None for ``policy: none``)."""
    if cfg.policy == "none":
        return None
    return Eviction(
        kind=EvictionKind(cfg.policy.value),
        heavy_ratio=cfg.heavy_ratio,
        keep_ratio=cfg.keep_ratio,
        merge_ratio=cfg.merge_ratio,
        recent_tokens=cfg.recent_tokens,
        sink_tokens=cfg.sink_tokens,
        budget_tokens=cfg.budget_tokens,
        trigger=Trigger(cfg.trigger.value),
        pressure_threshold=cfg.pressure_threshold,
        pages=PagePolicy(cfg.pages.value),
    )

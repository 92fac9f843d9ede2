"""Token eviction on a paged cache: H2O heavy hitters and StreamingLLM sinks + window.

What it models (design document section 4):

- `h2o_accumulate`: after each decode step, every cached token's softmax probability is added to
  its accumulated attention score (H2O, Zhang et al., 2023). One kernel recomputes the scores of
  the step's queries tile by tile from the paged K (any format, dequantized in-kernel) and the
  step's log-sum-exp (from `paged_decode(..., return_lse=True)`), so no [heads, tokens]
  probability matrix is materialised. Scores are kept per KV head, summed over its query heads.
- `h2o_select`: which tokens to keep: the first ``num_sink`` (attention sinks), the last
  ``num_recent``, and the ``num_heavy`` others with the largest score summed over KV heads.
  Plain torch (topk + sort on the device); the reference is a per-sequence Python loop.
- `streaming_keep`: StreamingLLM's keep list (sinks + recent window, Xiao et al., 2023).
- `compact_kv`: kept tokens are moved, in place, to positions 0..num_kept-1 of the sequence's own
  blocks (all planes of K and V, any format), so the tail blocks can be freed; returns the updated
  block tables, context lengths and which blocks were freed ("physical release" in section 4.3).

Left out: per-head eviction (a block table addresses all KV heads of a token, so all heads keep the
same tokens; the H2O paper evicts per head), per-layer budgets, and positional re-encoding of the
kept keys (RoPE positions stay those the keys were written with, as in H2O).
Preconditions of `compact_kv`: each sequence's blocks are its own (not shared copy-on-write), and
keep lists are strictly increasing (checked unless ``check=False``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.kv_cache import (
    FMT_BF16,
    PagedKVCache,
    dequantize_slots_ref,
    format_constexprs,
    load_kv_tile,
    sequence_slots,
    side_args,
)
from kernels.paged_decode import LOG2E, check_paged_inputs, paged_decode


@triton.jit
def _h2o_accumulate_kernel(
    q_ptr,
    lse_ptr,
    scores_ptr,
    bt_ptr,
    ctx_ptr,
    kd_ptr, ks_ptr, kz_ptr, kov_ptr, koi_ptr, kf8_ptr, kcb_ptr,
    ks_data, ks_scale, ks_zero, ks_oval, ks_oidx,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_sb,
    stride_sh,
    stride_bt,
    H,
    D,
    BS,
    G: tl.constexpr,
    FMT: tl.constexpr,
    GROUP: tl.constexpr,
    NG: tl.constexpr,
    PD: tl.constexpr,
    NOUT: tl.constexpr,
    FP8_PER_HEAD: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_FP16: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    nt = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    t = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    tmask = t < ctx
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gmask = g < G
    qh = h * G + g
    qmask = gmask[:, None] & (d < D)[None, :]
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + qh[:, None] * stride_qh + d[None, :],
        mask=qmask,
        other=0.0,
    )
    lse2 = tl.load(lse_ptr + b * (H * G) + qh, mask=gmask, other=0.0) * 1.4426950408889634
    blk = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + t // BS, mask=tmask, other=0).to(tl.int64)
    k = load_kv_tile(
        kd_ptr, ks_ptr, kz_ptr, kov_ptr, koi_ptr, kf8_ptr, kcb_ptr,
        ks_data, ks_scale, ks_zero, ks_oval, ks_oidx,
        blk, t % BS, tmask, h, d, H, D, FMT, GROUP, NG, PD, NOUT, FP8_PER_HEAD,
    )  # fmt: skip
    if DOT_FP16:
        s = tl.dot(q.to(tl.float16), tl.trans(k.to(tl.float16))) * qk_scale
    else:
        s = tl.dot(q.to(tl.float32), tl.trans(k)) * qk_scale
    p = tl.exp2(s - lse2[:, None])
    p = tl.where(gmask[:, None] & tmask[None, :], p, 0.0)
    ptrs = scores_ptr + b.to(tl.int64) * stride_sb + h * stride_sh + t
    old = tl.load(ptrs, mask=tmask, other=0.0)
    tl.store(ptrs, old + tl.sum(p, 0), mask=tmask)


def _check_scores(scores: torch.Tensor, batch: int, num_kv_heads: int, device: torch.device) -> None:
    if scores.dim() != 3 or scores.shape[0] != batch or scores.shape[1] != num_kv_heads:
        raise ValueError(f"scores must be [{batch}, {num_kv_heads}, max_tokens], got {list(scores.shape)}")
    if scores.dtype != torch.float32 or scores.stride(2) != 1:
        raise ValueError(
            f"scores must be float32, contiguous along tokens; got {scores.dtype} strides {scores.stride()}"
        )
    if scores.device != device:
        raise ValueError(f"scores is on {scores.device}, the cache on {device}")


def h2o_accumulate(
    q: torch.Tensor,
    cache: PagedKVCache,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    sm_scale: float,
    scores: torch.Tensor,
    *,
    lse: torch.Tensor | None = None,
    max_context_len: int | None = None,
    block_n: int = 32,
) -> torch.Tensor:
    """scores[b, kv_head, t] += sum over the KV head's query heads of softmax(q.k * sm_scale)[t].

    q, cache, block_tables, context_lens, sm_scale: as `paged_decode`. scores: [batch,
    num_kv_heads, max_tokens] fp32, max_tokens >= every context_len, updated in place and returned.
    lse: [batch, num_q_heads] fp32 natural-log log-sum-exp of this step (computed with
    `paged_decode` when None).
    """
    check_paged_inputs(q, cache, block_tables, context_lens, sm_scale)
    spec = cache.spec
    batch, num_q_heads, head_dim = q.shape
    _check_scores(scores, batch, spec.num_kv_heads, cache.device)
    if max_context_len is None:
        max_context_len = int(context_lens.max().item()) if batch else 0
    if max_context_len > scores.shape[2]:
        raise ValueError(f"scores hold {scores.shape[2]} tokens, a context has {max_context_len}")
    if lse is None:
        _, lse = paged_decode(
            q, cache, block_tables, context_lens, sm_scale, max_context_len=max_context_len,
            return_lse=True,
        )  # fmt: skip
    if tuple(lse.shape) != (batch, num_q_heads) or lse.dtype != torch.float32:
        raise ValueError(f"lse must be float32 [{batch}, {num_q_heads}], got {lse.dtype} {list(lse.shape)}")
    lse = lse.contiguous()
    if batch == 0 or max_context_len == 0:
        return scores
    group = num_q_heads // spec.num_kv_heads
    grid = (batch, spec.num_kv_heads, triton.cdiv(max_context_len, block_n))
    _h2o_accumulate_kernel[grid](
        q, lse, scores, block_tables, context_lens, *side_args(cache, "k"),
        float(sm_scale) * LOG2E, q.stride(0), q.stride(1), scores.stride(0), scores.stride(1),
        block_tables.stride(0), spec.num_kv_heads, head_dim, spec.block_size,
        G=group, **format_constexprs(spec), BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DOT_FP16=q.dtype == torch.float16 and spec.code != FMT_BF16,
    )  # fmt: skip
    return scores


def h2o_accumulate_ref(
    q: torch.Tensor,
    cache: PagedKVCache,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    sm_scale: float,
    scores: torch.Tensor,
) -> torch.Tensor:
    """Torch reference of `h2o_accumulate` (exact softmax in fp32)."""
    spec = cache.spec
    group = q.shape[1] // spec.num_kv_heads
    for b, length in enumerate(context_lens.tolist()):
        if length == 0:
            continue
        k = dequantize_slots_ref(cache, "k", sequence_slots(block_tables[b], length, spec.block_size))
        kk = k.repeat_interleave(group, 1)  # [T, Hq, D]
        probs = torch.softmax(torch.einsum("hd,thd->ht", q[b].float(), kk) * sm_scale, -1)
        scores[b, :, :length] += probs.view(spec.num_kv_heads, group, length).sum(1)
    return scores


def h2o_select(
    scores: torch.Tensor, context_lens: torch.Tensor, num_heavy: int, num_sink: int, num_recent: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep lists: sinks, recent window and top-``num_heavy`` scored tokens (summed over heads).

    scores: [batch, num_kv_heads, max_tokens] fp32; context_lens: [batch] int32. Returns keep_idx
    [batch, min(budget, max_tokens)] int32 ascending, padded with -1, and num_kept [batch] int32
    (= min(context_len, budget), budget = num_sink + num_heavy + num_recent).
    """
    for name, value in (
        ("num_heavy", num_heavy),
        ("num_sink", num_sink),
        ("num_recent", num_recent),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if scores.dim() != 3 or context_lens.dim() != 1 or context_lens.shape[0] != scores.shape[0]:
        raise ValueError(
            f"scores must be [batch, heads, tokens] and context_lens [batch]; got "
            f"{list(scores.shape)} and {list(context_lens.shape)}"
        )
    max_tokens = scores.shape[2]
    budget = num_sink + num_heavy + num_recent
    k = min(budget, max_tokens)
    ctx = context_lens.long()[:, None]
    pos = torch.arange(max_tokens, device=scores.device)[None, :]
    prio = scores.sum(1)
    prio = torch.where((pos < num_sink) | (pos >= ctx - num_recent), float("inf"), prio)
    prio = torch.where(pos >= ctx, float("-inf"), prio)
    top = prio.topk(k, dim=1).indices
    big = max_tokens + 1
    keep = torch.where(top < ctx, top, big).sort(1).values
    keep = torch.where(keep == big, -1, keep).to(torch.int32)
    num_kept = torch.clamp(context_lens, max=k).to(torch.int32)
    return keep, num_kept


def h2o_select_ref(
    scores: torch.Tensor, context_lens: torch.Tensor, num_heavy: int, num_sink: int, num_recent: int
) -> list[list[int]]:
    """Reference of `h2o_select`: per sequence, the sorted list of kept positions."""
    out = []
    total = scores.sum(1).tolist()
    for b, length in enumerate(context_lens.tolist()):
        if length <= num_sink + num_heavy + num_recent:
            out.append(list(range(length)))
            continue
        middle = range(num_sink, length - num_recent)
        heavy = sorted(middle, key=lambda t: -total[b][t])[:num_heavy]
        keep = set(range(num_sink)) | set(range(length - num_recent, length)) | set(heavy)
        out.append(sorted(keep))
    return out


def streaming_keep(
    context_lens: torch.Tensor, num_sink: int, num_recent: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """StreamingLLM keep lists: positions 0..num_sink-1 and the last num_recent.

    Returns keep_idx [batch, num_sink + num_recent] int32 (-1 padded) and num_kept [batch] int32.
    """
    if min(num_sink, num_recent) < 0 or num_sink + num_recent == 0:
        raise ValueError(f"need num_sink, num_recent >= 0 with a positive sum: {num_sink}, {num_recent}")
    k = num_sink + num_recent
    ctx = context_lens.long()[:, None]
    j = torch.arange(k, device=context_lens.device)[None, :]
    keep = torch.where(ctx <= k, j, torch.where(j < num_sink, j, ctx - k + j))
    num_kept = torch.clamp(context_lens, max=k).to(torch.int32)
    keep = torch.where(j < num_kept.long()[:, None], keep, -1).to(torch.int32)
    return keep, num_kept


@triton.jit
def _compact_kernel(
    pool_ptr,
    keep_ptr,
    nkept_ptr,
    bt_ptr,
    comp_ptr,  # [NC, 2] int64: byte offset in a block row, bytes per (token, head)
    row_bytes,
    stride_keep,
    stride_bt,
    H,
    BS,
    NC,
    BLOCK_J: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Move token keep[b, j] to position j, for all planes of KV head h; in place, tile by tile.

    keep is strictly increasing, so keep[j] >= j: a tile's sources are never destinations of an
    earlier tile, and the barrier orders its own loads before its stores.
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    nk = tl.load(nkept_ptr + b)
    jj = tl.arange(0, BLOCK_J)
    r = tl.arange(0, BLOCK_R)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    for j0 in range(0, nk, BLOCK_J):
        j = j0 + jj
        jm = j < nk
        src = tl.load(keep_ptr + b.to(tl.int64) * stride_keep + j, mask=jm, other=0)
        s_blk = tl.load(bt_row + src // BS, mask=jm, other=0).to(tl.int64)
        d_blk = tl.load(bt_row + j // BS, mask=jm, other=0).to(tl.int64)
        s_row = (src % BS).to(tl.int64) * H + h
        d_row = (j % BS).to(tl.int64) * H + h
        for c in range(NC):
            c_off = tl.load(comp_ptr + 2 * c)
            c_rb = tl.load(comp_ptr + 2 * c + 1)
            m2 = jm[:, None] & (r[None, :] < c_rb)
            sp = pool_ptr + (s_blk * row_bytes + c_off + s_row * c_rb)[:, None] + r[None, :]
            x = tl.load(sp, mask=m2, other=0)
            tl.debug_barrier()
            dp = pool_ptr + (d_blk * row_bytes + c_off + d_row * c_rb)[:, None] + r[None, :]
            tl.store(dp, x, mask=m2)
            tl.debug_barrier()


class Compaction(NamedTuple):
    """Result of `compact_kv`: the new tables and lengths, and the blocks the caller may free."""

    block_tables: torch.Tensor  # [batch, max_blocks] int32, freed entries set to -1
    context_lens: torch.Tensor  # [batch] int32 = num_kept
    freed: torch.Tensor  # [batch, max_blocks] bool, True where a block was released


def _check_keep(
    keep_idx: torch.Tensor, num_kept: torch.Tensor, context_lens: torch.Tensor, check: bool
) -> None:
    batch = context_lens.shape[0]
    if keep_idx.dim() != 2 or keep_idx.shape[0] != batch or keep_idx.dtype != torch.int32:
        raise ValueError(f"keep_idx must be int32 [{batch}, K], got {keep_idx.dtype} {list(keep_idx.shape)}")
    if keep_idx.shape[1] > 1 and keep_idx.stride(1) != 1:
        raise ValueError(f"keep_idx rows must be contiguous, got strides {keep_idx.stride()}")
    if tuple(num_kept.shape) != (batch,) or num_kept.dtype != torch.int32:
        raise ValueError(f"num_kept must be int32 [{batch}], got {num_kept.dtype} {list(num_kept.shape)}")
    if not check or batch == 0:
        return
    j = torch.arange(keep_idx.shape[1], device=keep_idx.device)[None, :]
    live = j < num_kept.long()[:, None]
    if bool((num_kept > context_lens).any()) or bool((num_kept > keep_idx.shape[1]).any()):
        raise ValueError("num_kept exceeds context_lens or keep_idx's width")
    k = keep_idx.long()
    if bool(((k < 0) | (k >= context_lens.long()[:, None]))[live].any()):
        raise ValueError("keep_idx holds positions outside [0, context_len)")
    rising = k[:, 1:] > k[:, :-1]
    if bool((~rising & live[:, 1:]).any()):
        raise ValueError("keep_idx must be strictly increasing within num_kept")


def compact_kv(
    cache: PagedKVCache,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    keep_idx: torch.Tensor,
    num_kept: torch.Tensor,
    *,
    check: bool = True,
    block_j: int = 16,
) -> Compaction:
    """Move each sequence's kept tokens (keep_idx [batch, K] int32 positions, ascending, first
    num_kept [batch] valid) to positions 0..num_kept-1, in place in its own blocks; one launch,
    grid (batch, num_kv_heads). Returns the new block tables (released tail blocks set to -1),
    context lengths (= num_kept) and a mask of released blocks."""
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32:
        raise ValueError(
            f"block_tables must be int32 [batch, max_blocks], got {block_tables.dtype} {list(block_tables.shape)}"
        )
    if context_lens.dim() != 1 or context_lens.shape[0] != block_tables.shape[0]:
        raise ValueError(f"context_lens must be [{block_tables.shape[0]}], got {list(context_lens.shape)}")
    if block_tables.shape[1] > 1 and block_tables.stride(1) != 1:
        raise ValueError(f"block_tables rows must be contiguous, got strides {block_tables.stride()}")
    _check_keep(keep_idx, num_kept, context_lens, check)
    spec = cache.spec
    entries, _ = spec.layout()
    comps = [(off, p.row * p.dtype.itemsize) for _, p, off in entries]
    comp = torch.tensor(comps, dtype=torch.int64, device=cache.device)
    batch = block_tables.shape[0]
    if batch:
        _compact_kernel[(batch, spec.num_kv_heads)](
            cache.pool, keep_idx, num_kept, block_tables, comp, cache.pool.stride(0),
            keep_idx.stride(0), block_tables.stride(0), spec.num_kv_heads, spec.block_size,
            len(comps), BLOCK_J=block_j,
            BLOCK_R=triton.next_power_of_2(max(rb for _, rb in comps)),
        )  # fmt: skip
    bs = spec.block_size
    idx = torch.arange(block_tables.shape[1], device=block_tables.device)[None, :]
    used_before = idx < (context_lens.long()[:, None] + bs - 1) // bs
    used_after = idx < (num_kept.long()[:, None] + bs - 1) // bs
    freed = used_before & ~used_after
    new_tables = torch.where(freed, -1, block_tables).to(torch.int32)
    return Compaction(new_tables, num_kept.clone(), freed)


def compact_kv_ref(
    cache: PagedKVCache,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    keep_idx: torch.Tensor,
    num_kept: torch.Tensor,
) -> Compaction:
    """Torch reference of `compact_kv` (copies every per-token plane of K and V)."""
    bs = cache.spec.block_size
    for b, n in enumerate(num_kept.tolist()):
        src = sequence_slots(block_tables[b], int(context_lens[b]), bs)[keep_idx[b, :n].long()]
        dst = sequence_slots(block_tables[b], n, bs)
        for side in ("k", "v"):
            for t in cache.side(side).per_token().values():
                rows = t[src // bs, src % bs].clone()
                t[dst // bs, dst % bs] = rows
    idx = torch.arange(block_tables.shape[1])[None, :]
    used_before = idx < (context_lens.long().cpu()[:, None] + bs - 1) // bs
    used_after = idx < (num_kept.long().cpu()[:, None] + bs - 1) // bs
    freed = (used_before & ~used_after).to(block_tables.device)
    return Compaction(torch.where(freed, -1, block_tables).to(torch.int32), num_kept.clone(), freed)


def compact_scores(scores: torch.Tensor, keep_idx: torch.Tensor, num_kept: torch.Tensor) -> torch.Tensor:
    """Scores [batch, heads, T] following the tokens `compact_kv` moved (0 past num_kept)."""
    k = keep_idx.long().clamp_min(0)[:, None, :].expand(-1, scores.shape[1], -1)
    moved = scores.gather(2, k)
    live = torch.arange(k.shape[2], device=scores.device)[None, None, :] < num_kept.long()[:, None, None]
    out = torch.zeros_like(scores)
    out[:, :, : k.shape[2]] = torch.where(live, moved, 0.0)
    return out


def make_inputs(
    fmt: str,
    batch: int,
    context_len: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    num_q_heads: int | None = None,
    block_size: int = 16,
    dtype: torch.dtype = torch.float16,
    device: str = "cpu",
    seed: int = 0,
) -> dict[str, object]:
    """Arguments for `h2o_accumulate(**inputs)` (decode inputs plus a zero ``scores`` buffer)."""
    from kernels.paged_decode import make_inputs as decode_inputs

    inputs = decode_inputs(
        fmt, batch, context_len, num_kv_heads, head_dim, num_q_heads=num_q_heads,
        block_size=block_size, dtype=dtype, device=device, seed=seed,
    )  # fmt: skip
    inputs["scores"] = torch.zeros(batch, num_kv_heads, context_len, device=device)
    return inputs

"""Paged decode attention: one new query token per sequence attends to its whole paged KV cache.

What it models: the decode-step attention of vLLM's PagedAttention / flash-decoding. K and V are
read through the block table (token ``t`` of sequence ``b`` lives in block
``block_tables[b, t // block_size]`` at offset ``t % block_size``) and dequantized inside the
kernel from any format of `kernels.kv_cache` (fp16, bf16, fp8 e4m3 with per-tensor or per-head
scale, int8/int4 group-wise, kvquant4). GQA: one program serves all ``num_q_heads/num_kv_heads``
query heads of a KV head, so every K/V tile is loaded once per KV head (the query-head axis is
padded to 16 rows for `tl.dot`). Split-KV: for long contexts and small batches the context is cut
into ``num_splits`` ranges processed by separate programs, each writing a partial output and its
log-sum-exp, and a second kernel merges them.

Dot precision: with fp16 queries and a non-bf16 cache the tiles are cast to fp16 (fp32
accumulation), as vLLM does; otherwise the dot runs on fp32 operands (tf32 on a GPU, exact for
bf16-valued inputs). This also keeps bf16 operands away from `tl.dot`, which the Triton 3.9
interpreter gets wrong.

Left out: ALiBi, sliding-window masks, logit soft-capping, multiple query tokens per sequence
(speculative decoding; see `chunked_prefill`), and autotuning (block sizes are plain arguments).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.kv_cache import (
    FMT_BF16,
    FMT_INT4,
    FMT_KVQ4,
    PagedKVCache,
    dequantize_slots_ref,
    format_constexprs,
    load_kv_tile,
    sequence_slots,
    side_args,
)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more in merging than it gains
TARGET_PROGRAMS = 264  # 2 programs per SM on a 132-SM H100/H200


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    out_ptr,
    lse_ptr,
    part_out_ptr,
    part_lse_ptr,
    bt_ptr,
    ctx_ptr,
    kd_ptr, ks_ptr, kz_ptr, kov_ptr, koi_ptr, kf8_ptr, kcb_ptr,
    ks_data, ks_scale, ks_zero, ks_oval, ks_oidx,
    vd_ptr, vs_ptr, vz_ptr, vov_ptr, voi_ptr, vf8_ptr, vcb_ptr,
    vs_data, vs_scale, vs_zero, vs_oval, vs_oidx,
    qk_scale,  # sm_scale * log2(e)
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_bt,
    H,
    D,
    BS,
    tokens_per_split,
    num_splits,
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
    SPLIT: tl.constexpr,
    RETURN_LSE: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    lo = sp * tokens_per_split
    hi = tl.minimum(lo + tokens_per_split, ctx)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gmask = g < G
    dmask = d < D
    qh = h * G + g  # [BLOCK_G] query heads of this KV head
    qmask = gmask[:, None] & dmask[None, :]
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + qh[:, None] * stride_qh + d[None, :],
        mask=qmask,
        other=0.0,
    )  # [BLOCK_G, BLOCK_D]
    if DOT_FP16:
        q = q.to(tl.float16)
    else:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)  # running max (log2 units), finite on purpose
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        t = start + n
        tmask = t < hi
        blk = tl.load(bt_row + t // BS, mask=tmask, other=0).to(tl.int64)
        off = t % BS
        k = load_kv_tile(
            kd_ptr, ks_ptr, kz_ptr, kov_ptr, koi_ptr, kf8_ptr, kcb_ptr,
            ks_data, ks_scale, ks_zero, ks_oval, ks_oidx,
            blk, off, tmask, h, d, H, D, FMT, GROUP, NG, PD, NOUT, FP8_PER_HEAD,
        )  # fmt: skip
        v = load_kv_tile(
            vd_ptr, vs_ptr, vz_ptr, vov_ptr, voi_ptr, vf8_ptr, vcb_ptr,
            vs_data, vs_scale, vs_zero, vs_oval, vs_oidx,
            blk, off, tmask, h, d, H, D, FMT, GROUP, NG, PD, NOUT, FP8_PER_HEAD,
        )  # fmt: skip
        if DOT_FP16:
            k = k.to(tl.float16)
            v = v.to(tl.float16)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_G, BLOCK_N], log2 units
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_FP16:
            p = p.to(tl.float16)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new

    empty = l_i == 0.0  # split past the end of this sequence (or context_len 0)
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse2 = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    if SPLIT:
        row = (b * (H * G) + qh).to(tl.int64) * num_splits + sp  # [BLOCK_G]
        tl.store(part_out_ptr + row[:, None] * BLOCK_D + d[None, :], out, mask=qmask)
        tl.store(part_lse_ptr + row, lse2, mask=gmask)
    else:
        o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + qh[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=qmask)
        if RETURN_LSE:
            tl.store(lse_ptr + b * (H * G) + qh, lse2 * 0.6931471805599453, mask=gmask)


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    lse_ptr,
    part_out_ptr,
    part_lse_ptr,
    stride_ob,
    stride_oh,
    num_q_heads,
    num_splits,
    D,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    RETURN_LSE: tl.constexpr,
):
    """out[b, qh] = sum_s w_s * o_s / sum_s w_s with w_s = 2^(lse_s - max lse)."""
    b = tl.program_id(0)
    qh = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = s < num_splits
    row = (b * num_q_heads + qh).to(tl.int64) * num_splits + s
    lse = tl.load(part_lse_ptr + row, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_safe)  # 0 for empty splits
    o = tl.load(part_out_ptr + row[:, None] * BLOCK_D + d[None, :], mask=smask[:, None], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + qh * stride_oh + d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=d < D)
    if RETURN_LSE:
        lse_all = tl.where(total > 0, m_safe + tl.log2(tl.where(total > 0, total, 1.0)), m)
        tl.store(lse_ptr + b * num_q_heads + qh, lse_all * 0.6931471805599453)


def check_paged_inputs(
    q: torch.Tensor,
    cache: PagedKVCache,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    sm_scale: float,
    *,
    varlen: bool = False,
) -> None:
    """Raise ValueError (stating shapes, dtypes, strides) unless the inputs fit the cache.

    varlen: q is [num_tokens, ...] (chunked prefill) and the batch size is len(context_lens).
    """
    s = cache.spec
    q_name = "q (varlen tokens)" if varlen else "q"
    if q.dim() != 3 or q.shape[2] != s.head_dim:
        raise ValueError(f"{q_name} must be [batch, num_q_heads, {s.head_dim}], got {list(q.shape)}")
    if q.shape[1] % s.num_kv_heads:
        raise ValueError(f"num_q_heads ({q.shape[1]}) must be a multiple of num_kv_heads ({s.num_kv_heads})")
    if q.dtype not in Q_DTYPES:
        raise ValueError(f"{q_name} dtype must be float16, bfloat16 or float32, got {q.dtype}")
    if q.stride(2) != 1:
        raise ValueError(f"{q_name} must be contiguous along head_dim, got strides {q.stride()}")
    batch = context_lens.shape[0] if varlen and context_lens.dim() == 1 else q.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be [{batch}, max_blocks], got {list(block_tables.shape)}")
    if block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables dtype must be int32, got {block_tables.dtype}")
    if block_tables.shape[1] > 1 and block_tables.stride(1) != 1:
        raise ValueError(f"block_tables rows must be contiguous, got strides {block_tables.stride()}")
    if context_lens.dim() != 1 or context_lens.shape[0] != batch:
        raise ValueError(f"context_lens must be [{batch}], got {list(context_lens.shape)}")
    if context_lens.dtype != torch.int32 or (batch > 1 and context_lens.stride(0) != 1):
        raise ValueError(
            f"context_lens must be contiguous int32, got {context_lens.dtype} strides {context_lens.stride()}"
        )
    for name, t in ((q_name, q), ("block_tables", block_tables), ("context_lens", context_lens)):
        if t.device != cache.device:
            raise ValueError(f"{name} is on {t.device}, the cache on {cache.device}")
    if not (isinstance(sm_scale, (int, float)) and math.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"sm_scale must be a positive finite number, got {sm_scale!r}")


def default_num_splits(batch: int, num_kv_heads: int, max_context_len: int) -> int:
    """Enough programs to fill a GPU, but no split shorter than MIN_SPLIT_TOKENS tokens."""
    by_len = max(1, max_context_len // MIN_SPLIT_TOKENS)
    by_occupancy = max(1, -(-TARGET_PROGRAMS // (batch * num_kv_heads)))
    return int(min(by_len, by_occupancy, 64))


def paged_decode(
    q: torch.Tensor,
    cache: PagedKVCache,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    sm_scale: float,
    *,
    max_context_len: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Decode attention for q [batch, num_q_heads, head_dim] over the paged cache.

    block_tables: [batch, max_blocks] int32 physical block ids; context_lens: [batch] int32 tokens
    in the cache per sequence (0 gives a zero output). max_context_len bounds context_lens (read
    from the device when None, which synchronises). num_splits: KV splits per sequence (None picks
    `default_num_splits`; 1 skips the merge kernel). Returns out [batch, num_q_heads, head_dim] in
    q's dtype, and with return_lse the natural-log log-sum-exp of the scaled scores
    [batch, num_q_heads] fp32 (used by `kernels.h2o`).
    """
    check_paged_inputs(q, cache, block_tables, context_lens, sm_scale)
    spec = cache.spec
    batch, num_q_heads, head_dim = q.shape
    group = num_q_heads // spec.num_kv_heads
    if max_context_len is None:
        max_context_len = int(context_lens.max().item()) if batch else 0
    if num_splits is None:
        num_splits = default_num_splits(batch, spec.num_kv_heads, max_context_len)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive integer, got {num_splits!r}")
    if block_n is None:
        # 4-bit unpacking holds more live registers: at head_dim 128, 32-token tiles spill
        # (int4: 255 registers + 928 B; kvquant4: 7.8 KB) on sm_90 with ptxas; 16 do not.
        block_n = 16 if spec.code in (FMT_INT4, FMT_KVQ4) else 32
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    out = torch.empty_like(q)
    lse = torch.empty(batch, num_q_heads, dtype=torch.float32, device=q.device)
    if batch == 0:
        return (out, lse) if return_lse else out
    block_d = max(16, triton.next_power_of_2(head_dim))
    tokens_per_split = -(-max(1, -(-max_context_len // num_splits)) // block_n) * block_n
    split = num_splits > 1
    if split:
        part_out = torch.empty(
            batch * num_q_heads * num_splits, block_d, dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(batch * num_q_heads * num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = lse
    dot_fp16 = q.dtype == torch.float16 and spec.code != FMT_BF16
    _paged_decode_kernel[(batch, spec.num_kv_heads, num_splits)](
        q, out, lse, part_out, part_lse, block_tables, context_lens,
        *side_args(cache, "k"), *side_args(cache, "v"),
        float(sm_scale) * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        spec.num_kv_heads, head_dim, spec.block_size, tokens_per_split, num_splits,
        G=group, **format_constexprs(spec),
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_FP16=dot_fp16, SPLIT=split, RETURN_LSE=return_lse, num_warps=num_warps,
    )  # fmt: skip
    if split:
        _merge_splits_kernel[(batch, num_q_heads)](
            out, lse, part_out, part_lse, out.stride(0), out.stride(1), num_q_heads, num_splits,
            head_dim, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
            RETURN_LSE=return_lse,
        )  # fmt: skip
    return (out, lse) if return_lse else out


def attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, causal_offset: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 attention. q [M, Hq, D]; k, v [N, Hkv, D]; GQA by repeating KV heads.

    causal_offset: query i sees keys j <= causal_offset + i (None: all keys).
    Returns out [M, Hq, D] fp32 and natural-log lse [M, Hq]; rows with no keys give 0 and -inf.
    """
    group = q.shape[1] // k.shape[1]
    kk = k.float().repeat_interleave(group, 1)
    vv = v.float().repeat_interleave(group, 1)
    scores = torch.einsum("mhd,nhd->hmn", q.float(), kk) * sm_scale
    if causal_offset is not None:
        i = torch.arange(q.shape[0], device=q.device)[:, None]
        j = torch.arange(k.shape[0], device=q.device)[None, :]
        scores = scores.masked_fill(j > causal_offset + i, float("-inf"))
    lse = torch.logsumexp(scores, -1)  # [Hq, M]
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("hmn,nhd->mhd", probs, vv)
    return out, lse.transpose(0, 1)


def paged_decode_ref(
    q: torch.Tensor,
    cache: PagedKVCache,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    sm_scale: float,
    *,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `paged_decode`: dequantize each sequence's K/V, fp32 attention."""
    check_paged_inputs(q, cache, block_tables, context_lens, sm_scale)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    for b, length in enumerate(context_lens.tolist()):
        if length == 0:
            continue
        slots = sequence_slots(block_tables[b], length, cache.spec.block_size)
        k = dequantize_slots_ref(cache, "k", slots)
        v = dequantize_slots_ref(cache, "v", slots)
        o, l_b = attention_ref(q[b : b + 1], k, v, sm_scale, None)
        out[b] = o[0].to(q.dtype)
        lse[b] = l_b[0]
    return (out, lse) if return_lse else out


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
    """Arguments for `paged_decode(**inputs)` / `paged_decode_ref(**inputs)` at one grid point.

    Every sequence has ``context_len`` tokens in shuffled blocks, filled with N(0, 1) K/V by
    `kernels.kv_write.fill_random` (the kv_write kernel on CUDA, the torch reference on CPU); fp8
    scales are 4/448, so values beyond 4 sigma saturate.
    """
    from kernels.kv_write import fill_random

    gen = torch.Generator().manual_seed(seed)
    num_q_heads = num_q_heads or 4 * num_kv_heads
    blocks_per_seq = max(1, -(-context_len // block_size))
    num_blocks = batch * blocks_per_seq + 1
    cache = PagedKVCache.allocate(fmt, num_blocks, block_size, num_kv_heads, head_dim, device)
    perm = torch.randperm(num_blocks, generator=gen)[: batch * blocks_per_seq]
    block_tables = perm.view(batch, blocks_per_seq).to(torch.int32).to(device)
    if cache.k.fp8_scale is not None:
        cache.k.fp8_scale.fill_(4.0 / 448.0)
        cache.v.fp8_scale.fill_(4.0 / 448.0)
    slots = torch.cat([sequence_slots(block_tables[b], context_len, block_size) for b in range(batch)])
    fill_random(cache, slots, seed=seed)
    q = torch.randn(batch, num_q_heads, head_dim, generator=gen).to(device, dtype)
    return {
        "q": q,
        "cache": cache,
        "block_tables": block_tables,
        "context_lens": torch.full((batch,), context_len, dtype=torch.int32, device=device),
        "sm_scale": head_dim**-0.5,
    }

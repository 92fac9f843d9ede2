"""Chunked prefill: a chunk of new tokens per sequence attends causally to its paged prefix and to
itself, after its own K/V have been written into the cache.

What it models: one prefill chunk of vLLM's chunked prefill for a batch of sequences (varlen,
``query_start_loc`` as in vLLM). The chunk's K/V are first stored with `kernels.kv_write`
(quantize-on-write), then one attention kernel reads prefix and chunk alike through the block table
and dequantizes in-kernel, so the chunk attends to the same (possibly quantized) K/V later decode
steps will see. Grid: (sequence, KV head, query tile); the tile holds ``BLOCK_M`` query tokens x all
query heads of the KV head (GQA), so each K/V tile is loaded once for them all.

Left out: attention over the chunk's unquantized K/V (engines differ here; reading back the cache is
the simpler and more conservative choice for lossy formats), sliding windows, ALiBi, and a split
over the prefix for very long prefixes with tiny chunks (decode covers that case).
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
from kernels.kv_write import kv_write, kv_write_ref
from kernels.paged_decode import LOG2E, attention_ref, check_paged_inputs


@triton.jit
def _chunked_prefill_kernel(
    q_ptr,
    out_ptr,
    bt_ptr,
    qsl_ptr,
    seq_ptr,
    kd_ptr, ks_ptr, kz_ptr, kov_ptr, koi_ptr, kf8_ptr, kcb_ptr,
    ks_data, ks_scale, ks_zero, ks_oval, ks_oidx,
    vd_ptr, vs_ptr, vz_ptr, vov_ptr, voi_ptr, vf8_ptr, vcb_ptr,
    vs_data, vs_scale, vs_zero, vs_oval, vs_oidx,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    H,
    D,
    BS,
    G: tl.constexpr,
    G_P2: tl.constexpr,
    FMT: tl.constexpr,
    GROUP: tl.constexpr,
    NG: tl.constexpr,
    PD: tl.constexpr,
    NOUT: tl.constexpr,
    FP8_PER_HEAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_FP16: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    mt = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    seq_len = tl.load(seq_ptr + b)
    prefix = seq_len - q_len

    r = tl.arange(0, BLOCK_M * G_P2)  # rows: (query token, query head) pairs
    m = mt * BLOCK_M + r // G_P2  # query token index within the chunk
    g = r % G_P2
    rmask = (m < q_len) & (g < G)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    qh = h * G + g
    tok = (q_start + m).to(tl.int64)
    qmask = rmask[:, None] & dmask[None, :]
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + qh[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0
    )
    if DOT_FP16:
        q = q.to(tl.float16)
    else:
        q = q.to(tl.float32)
    qpos = prefix + m  # absolute position of each row's query token

    m_i = tl.full([BLOCK_M * G_P2], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M * G_P2], tl.float32)
    acc = tl.zeros([BLOCK_M * G_P2, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    hi = tl.minimum(seq_len, prefix + (mt + 1) * BLOCK_M)  # last key any row here may see, +1
    for start in range(0, hi, BLOCK_N):
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
        s = tl.dot(q, tl.trans(k)) * qk_scale
        visible = tmask[None, :] & (t[None, :] <= qpos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_FP16:
            p = p.to(tl.float16)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_ptrs = out_ptr + tok[:, None] * stride_ot + qh[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=qmask)


def _check_prefill_inputs(
    q: torch.Tensor,
    cache: PagedKVCache,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
) -> None:
    check_paged_inputs(q, cache, block_tables, seq_lens, sm_scale, varlen=True)
    batch = seq_lens.shape[0]
    if query_start_loc.dim() != 1 or query_start_loc.shape[0] != batch + 1:
        raise ValueError(
            f"query_start_loc must be [batch + 1] = [{batch + 1}], got {list(query_start_loc.shape)}"
        )
    if query_start_loc.dtype != torch.int32 or query_start_loc.stride(0) != 1:
        raise ValueError(
            f"query_start_loc must be contiguous int32, got {query_start_loc.dtype} "
            f"strides {query_start_loc.stride()}"
        )
    if query_start_loc.device != cache.device:
        raise ValueError(f"query_start_loc is on {query_start_loc.device}, cache on {cache.device}")


def chunk_slot_mapping(
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Slots [num_tokens] int64 of each chunk token: positions seq_len - q_len .. seq_len - 1."""
    qsl = query_start_loc.long()
    q_lens = qsl[1:] - qsl[:-1]
    seq_of = torch.repeat_interleave(torch.arange(len(q_lens), device=qsl.device), q_lens)
    idx = torch.arange(int(qsl[-1]), device=qsl.device) - qsl[:-1][seq_of]
    pos = seq_lens.long()[seq_of] - q_lens[seq_of] + idx
    blocks = block_tables.long()[seq_of, pos // block_size]
    return blocks * block_size + pos % block_size


def chunked_prefill(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: PagedKVCache,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    *,
    slot_mapping: torch.Tensor | None = None,
    max_query_len: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Write the chunk's K/V, then causal attention of the chunk over prefix + chunk.

    q: [num_tokens, num_q_heads, head_dim] (all sequences' chunk tokens, concatenated);
    key, value: [num_tokens, num_kv_heads, head_dim]; block_tables: [batch, max_blocks] int32;
    query_start_loc: [batch + 1] int32 offsets of each chunk in q; seq_lens: [batch] int32 tokens
    per sequence including the chunk (prefix = seq_len - chunk length). slot_mapping: [num_tokens]
    (computed from the block tables when None). block_m: query tokens per program (default: 64
    rows of (token, query head)). Returns out like q.
    """
    _check_prefill_inputs(q, cache, block_tables, query_start_loc, seq_lens, sm_scale)
    spec = cache.spec
    if key.shape[0] != q.shape[0]:
        raise ValueError(f"key has {key.shape[0]} tokens, q has {q.shape[0]}")
    if block_m is not None and (block_m < 1 or block_m & (block_m - 1)):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    four_bit = cache.spec.code in (FMT_INT4, FMT_KVQ4)
    # 4-bit tiles spill at 32 tokens x 4 warps on sm_90 (int4: 1.4 KB, kvquant4: up to 4.1 KB);
    # 16 tokens x 8 warps do not (165-175 registers).
    if block_n is None:
        block_n = 16 if four_bit else 32
    if num_warps is None:
        num_warps = 8 if four_bit else 4
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if slot_mapping is None:
        slot_mapping = chunk_slot_mapping(block_tables, query_start_loc, seq_lens, spec.block_size)
    kv_write(key, value, cache, slot_mapping)
    batch = seq_lens.shape[0]
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    group = num_q_heads // spec.num_kv_heads
    out = torch.empty_like(q)
    if batch == 0 or q.shape[0] == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    g_p2 = triton.next_power_of_2(group)
    if block_m is None:
        block_m = max(1, 64 // g_p2)  # 64 (token, head) rows per program
    block_m = max(block_m, -(-16 // g_p2))  # >= 16 rows for tl.dot
    grid = (batch, spec.num_kv_heads, max(1, -(-max_query_len // block_m)))
    _chunked_prefill_kernel[grid](
        q, out, block_tables, query_start_loc, seq_lens,
        *side_args(cache, "k"), *side_args(cache, "v"),
        float(sm_scale) * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        spec.num_kv_heads, head_dim, spec.block_size,
        G=group, G_P2=g_p2, **format_constexprs(spec),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DOT_FP16=q.dtype == torch.float16 and spec.code != FMT_BF16, num_warps=num_warps,
    )  # fmt: skip
    return out


def chunked_prefill_ref(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: PagedKVCache,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    *,
    slot_mapping: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference of `chunked_prefill` (same arguments, same cache writes)."""
    _check_prefill_inputs(q, cache, block_tables, query_start_loc, seq_lens, sm_scale)
    bs = cache.spec.block_size
    if slot_mapping is None:
        slot_mapping = chunk_slot_mapping(block_tables, query_start_loc, seq_lens, bs)
    kv_write_ref(key, value, cache, slot_mapping)
    out = torch.zeros_like(q)
    qsl = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = qsl[b], qsl[b + 1]
        if hi == lo:
            continue
        slots = sequence_slots(block_tables[b], seq_len, bs)
        k = dequantize_slots_ref(cache, "k", slots)
        v = dequantize_slots_ref(cache, "v", slots)
        o, _ = attention_ref(q[lo:hi], k, v, sm_scale, causal_offset=seq_len - (hi - lo))
        out[lo:hi] = o.to(q.dtype)
    return out


def make_inputs(
    fmt: str,
    batch: int,
    prefix_len: int,
    chunk_len: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    num_q_heads: int | None = None,
    block_size: int = 16,
    dtype: torch.dtype = torch.float16,
    device: str = "cpu",
    seed: int = 0,
) -> dict[str, object]:
    """Arguments for `chunked_prefill(**inputs)`: every sequence has ``prefix_len`` cached tokens
    (N(0, 1), written by `kernels.kv_write.fill_random`) and a chunk of ``chunk_len`` new tokens.
    fp8 scales are 4/448."""
    from kernels.kv_write import fill_random

    gen = torch.Generator().manual_seed(seed)
    num_q_heads = num_q_heads or 4 * num_kv_heads
    seq_len = prefix_len + chunk_len
    per_seq = max(1, math.ceil(seq_len / block_size))
    num_blocks = batch * per_seq + 1
    cache = PagedKVCache.allocate(fmt, num_blocks, block_size, num_kv_heads, head_dim, device)
    perm = torch.randperm(num_blocks, generator=gen)[: batch * per_seq]
    block_tables = perm.view(batch, per_seq).to(torch.int32).to(device)
    if cache.k.fp8_scale is not None:
        cache.k.fp8_scale.fill_(4.0 / 448.0)  # randn data: |x| > 4 saturates
        cache.v.fp8_scale.fill_(4.0 / 448.0)
    if prefix_len:
        slots = torch.cat([sequence_slots(block_tables[b], prefix_len, block_size) for b in range(batch)])
        fill_random(cache, slots, seed=seed)
    n = batch * chunk_len
    return {
        "q": torch.randn(n, num_q_heads, head_dim, generator=gen).to(device, dtype),
        "key": torch.randn(n, num_kv_heads, head_dim, generator=gen).to(device, dtype),
        "value": torch.randn(n, num_kv_heads, head_dim, generator=gen).to(device, dtype),
        "cache": cache,
        "block_tables": block_tables,
        "query_start_loc": (torch.arange(batch + 1, dtype=torch.int32) * chunk_len).to(device),
        "seq_lens": torch.full((batch,), seq_len, dtype=torch.int32, device=device),
        "sm_scale": head_dim**-0.5,
    }

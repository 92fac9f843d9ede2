"""Quantize-on-write: new K/V tokens stored into their cache slots in the cache's format.

What it models: the cache write of every attention layer step (vLLM's ``reshape_and_cache``):
token ``t`` goes to ``slot_mapping[t]`` (slot = block * block_size + offset, -1 = skip, e.g. a
padding token), quantized inside the kernel: int8/int4 group scales and zero points, fp8 with the
static scale (saturating at +-448, round-to-nearest-even done with integer bit arithmetic so that it
is exact on every backend, the Triton interpreter included; bf16 likewise), kvquant4 outliers (the N largest |x|
per token and head, first index on ties), per-token scale and nearest-codebook indices.

Left out: dynamic fp8 scale updates (scales are static), and K/V producing projections (RoPE etc.).
One program per (token, KV head, K-or-V); a real engine would fuse this into the QKV epilogue.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_cache import (
    FMT_BF16,
    FMT_FP8,
    PagedKVCache,
    format_constexprs,
    quantize_ref,
    side_args,
    write_slots_ref,
)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def fp8_e4m3_bits(y):
    """fp32 -> float8_e4m3fn bits (int32 in 0..255), saturating at 448, round to nearest even."""
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
    a = tl.minimum(tl.abs(y), 448.0)
    bits = a.to(tl.int32, bitcast=True)
    # normal range (a >= 2^-6): keep 3 of 23 mantissa bits, carry may bump the exponent
    mant = bits & 0x7FFFFF
    upper = mant >> 20
    lower = mant & 0xFFFFF
    up = (lower > 0x80000) | ((lower == 0x80000) & ((upper & 1) == 1))
    code_n = ((((bits >> 23) & 0xFF) - 127 + 7) << 3) + upper + up.to(tl.int32)
    # subnormal range: a = m * 2^-9, m rounded to nearest even (m = 8 is the smallest normal)
    t = a * 512.0
    f = tl.floor(t)
    r = t - f
    fi = f.to(tl.int32)
    up_s = (r > 0.5) | ((r == 0.5) & ((fi & 1) == 1))
    code_s = fi + up_s.to(tl.int32)
    code = tl.where(a < 0.015625, code_s, code_n)
    return code | (sign << 7)


@triton.jit
def bf16_bits(x):
    """fp32 -> bfloat16 bits (int16), round to nearest even; finite inputs.

    Done on the bits because the 3.9 interpreter's fp32 -> bf16 cast truncates.
    """
    b = x.to(tl.int32, bitcast=True)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.int16)


@triton.jit
def quantize_store(
    x_base,  # pointer to x[t, h, 0], elements contiguous along head_dim
    slot,  # int64; -1 skips the token
    blk,  # int64 physical block
    off,  # int64 offset within block
    h,
    data_ptr,
    scale_ptr,
    zero_ptr,
    oval_ptr,
    oidx_ptr,
    fp8s_ptr,
    cb_ptr,
    s_data,
    s_scale,
    s_zero,
    s_oval,
    s_oidx,
    H,
    D,
    FMT: tl.constexpr,
    GROUP: tl.constexpr,
    NG: tl.constexpr,
    PD: tl.constexpr,
    NOUT: tl.constexpr,
    FP8_PER_HEAD: tl.constexpr,
    BLOCK_P: tl.constexpr,  # >= ceil(D / 2), power of two
    BLOCK_G: tl.constexpr,  # >= NG, power of two
):
    """Quantize one vector x[0:D] and store every plane of it at (blk, off, h).

    Works on even/odd element pairs (e0 = 2p, e1 = 2p + 1) so int4 bytes pack without reshapes.
    """
    p = tl.arange(0, BLOCK_P)
    e0 = 2 * p
    e1 = e0 + 1
    v0 = e0 < D
    v1 = e1 < D
    # (scalar bool & vector bool) comes out int32 in the 3.9 interpreter, so compare vectors
    slot_ok = slot >= 0
    ok_p = (p * 0 + slot) >= 0
    m0 = v0 & ok_p
    m1 = v1 & ok_p
    x0 = tl.load(x_base + e0, mask=m0, other=0.0).to(tl.float32)
    x1 = tl.load(x_base + e1, mask=m1, other=0.0).to(tl.float32)
    row = off * H + h
    if FMT == 0:
        dst = data_ptr + blk * s_data + row * D
        tl.store(dst + e0, x0.to(tl.float16), mask=m0)
        tl.store(dst + e1, x1.to(tl.float16), mask=m1)
    elif FMT == 1:
        dst = data_ptr + blk * s_data + row * D  # data_ptr: int16 view of the bf16 plane
        tl.store(dst + e0, bf16_bits(x0), mask=m0)
        tl.store(dst + e1, bf16_bits(x1), mask=m1)
    elif FMT == 2:
        sc = tl.load(fp8s_ptr + h * FP8_PER_HEAD)
        dst = data_ptr + blk * s_data + row * D  # data_ptr: uint8 view of the fp8 plane
        tl.store(dst + e0, fp8_e4m3_bits(tl.math.div_rn(x0, sc)).to(tl.uint8), mask=m0)
        tl.store(dst + e1, fp8_e4m3_bits(tl.math.div_rn(x1, sc)).to(tl.uint8), mask=m1)
    elif FMT <= 4:
        if FMT == 3:
            qmax = 255.0
        else:
            qmax = 15.0
        gr = tl.arange(0, BLOCK_G)
        gvalid = gr < NG
        sel0 = ((e0 // GROUP)[:, None] == gr[None, :]) & v0[:, None]  # [BLOCK_P, BLOCK_G]
        sel1 = ((e1 // GROUP)[:, None] == gr[None, :]) & v1[:, None]
        inf = float("inf")
        mn = tl.minimum(
            tl.min(tl.where(sel0, x0[:, None], inf), 0), tl.min(tl.where(sel1, x1[:, None], inf), 0)
        )
        mx = tl.maximum(
            tl.max(tl.where(sel0, x0[:, None], -inf), 0),
            tl.max(tl.where(sel1, x1[:, None], -inf), 0),
        )
        mn = tl.where(gvalid, mn, 0.0)
        mx = tl.where(gvalid, mx, 0.0)
        scale16 = tl.math.div_rn(mx - mn, qmax).to(tl.float16)
        zero16 = mn.to(tl.float16)
        tl.store(scale_ptr + blk * s_scale + row * NG + gr, scale16, mask=gvalid & ((gr * 0 + slot) >= 0))
        tl.store(zero_ptr + blk * s_zero + row * NG + gr, zero16, mask=gvalid & ((gr * 0 + slot) >= 0))
        sf = scale16.to(tl.float32)
        sf = tl.where(sf > 0, sf, 1.0)
        zf = zero16.to(tl.float32)
        s0 = tl.sum(tl.where(sel0, sf[None, :], 0.0), 1)
        s1 = tl.sum(tl.where(sel1, sf[None, :], 0.0), 1)
        s0 = tl.where(v0, s0, 1.0)  # padding lanes: avoid 0/0
        s1 = tl.where(v1, s1, 1.0)
        z0 = tl.sum(tl.where(sel0, zf[None, :], 0.0), 1)
        z1 = tl.sum(tl.where(sel1, zf[None, :], 0.0), 1)
        q0 = tl.minimum(tl.maximum(tl.floor(tl.math.div_rn(x0 - z0, s0) + 0.5), 0.0), qmax)
        q1 = tl.minimum(tl.maximum(tl.floor(tl.math.div_rn(x1 - z1, s1) + 0.5), 0.0), qmax)
        if FMT == 3:
            dst = data_ptr + blk * s_data + row * D
            tl.store(dst + e0, q0.to(tl.uint8), mask=m0)
            tl.store(dst + e1, q1.to(tl.uint8), mask=m1)
        else:
            q1 = tl.where(v1, q1, 0.0)
            byte = q0.to(tl.int32) | (q1.to(tl.int32) << 4)
            tl.store(data_ptr + blk * s_data + row * PD + p, byte.to(tl.uint8), mask=m0)
    else:  # kvquant4
        a0 = tl.where(v0, tl.abs(x0), -1.0)
        a1 = tl.where(v1, tl.abs(x1), -1.0)
        for j in tl.static_range(NOUT):
            amax = tl.maximum(tl.max(a0, 0), tl.max(a1, 0))
            big = 1 << 30
            idx = tl.minimum(
                tl.min(tl.where(a0 == amax, e0, big), 0), tl.min(tl.where(a1 == amax, e1, big), 0)
            )
            val = tl.sum(tl.where(e0 == idx, x0, 0.0), 0) + tl.sum(tl.where(e1 == idx, x1, 0.0), 0)
            tl.store(oidx_ptr + blk * s_oidx + row * NOUT + j, idx.to(tl.int16), mask=slot_ok)
            tl.store(oval_ptr + blk * s_oval + row * NOUT + j, val.to(tl.float16), mask=slot_ok)
            a0 = tl.where(e0 == idx, -1.0, a0)
            a1 = tl.where(e1 == idx, -1.0, a1)
        rest = tl.maximum(tl.maximum(tl.max(a0, 0), tl.max(a1, 0)), 0.0)
        scale16 = rest.to(tl.float16)
        tl.store(scale_ptr + blk * s_scale + row, scale16, mask=slot_ok)
        sf = scale16.to(tl.float32)
        sf = tl.where(sf > 0, sf, 1.0)
        u0 = tl.math.div_rn(x0, sf)
        u1 = tl.math.div_rn(x1, sf)
        best0 = tl.full([BLOCK_P], float("inf"), tl.float32)
        best1 = tl.full([BLOCK_P], float("inf"), tl.float32)
        code0 = tl.zeros([BLOCK_P], tl.int32)
        code1 = tl.zeros([BLOCK_P], tl.int32)
        for c in tl.static_range(16):
            level = tl.load(cb_ptr + h * 16 + c).to(tl.float32)
            d0 = tl.abs(u0 - level)
            d1 = tl.abs(u1 - level)
            code0 = tl.where(d0 < best0, c, code0)
            code1 = tl.where(d1 < best1, c, code1)
            best0 = tl.minimum(best0, d0)
            best1 = tl.minimum(best1, d1)
        code1 = tl.where(v1, code1, 0)
        byte = code0 | (code1 << 4)
        tl.store(data_ptr + blk * s_data + row * PD + p, byte.to(tl.uint8), mask=m0)


@triton.jit
def _kv_write_kernel(
    k_ptr,
    v_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    kd_ptr,
    ks_ptr,
    kz_ptr,
    kov_ptr,
    koi_ptr,
    kf8_ptr,
    kcb_ptr,
    ks_data,
    ks_scale,
    ks_zero,
    ks_oval,
    ks_oidx,
    vd_ptr,
    vs_ptr,
    vz_ptr,
    vov_ptr,
    voi_ptr,
    vf8_ptr,
    vcb_ptr,
    vs_data,
    vs_scale,
    vs_zero,
    vs_oval,
    vs_oidx,
    H,
    D,
    BS,
    FMT: tl.constexpr,
    GROUP: tl.constexpr,
    NG: tl.constexpr,
    PD: tl.constexpr,
    NOUT: tl.constexpr,
    FP8_PER_HEAD: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    side = tl.program_id(2)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    safe = tl.where(slot >= 0, slot, 0)
    blk = safe // BS
    off = safe % BS
    if side == 0:
        quantize_store(
            k_ptr + t * stride_kt + h * stride_kh, slot, blk, off, h,
            kd_ptr, ks_ptr, kz_ptr, kov_ptr, koi_ptr, kf8_ptr, kcb_ptr,
            ks_data, ks_scale, ks_zero, ks_oval, ks_oidx, H, D,
            FMT, GROUP, NG, PD, NOUT, FP8_PER_HEAD, BLOCK_P, BLOCK_G,
        )  # fmt: skip
    else:
        quantize_store(
            v_ptr + t * stride_vt + h * stride_vh, slot, blk, off, h,
            vd_ptr, vs_ptr, vz_ptr, vov_ptr, voi_ptr, vf8_ptr, vcb_ptr,
            vs_data, vs_scale, vs_zero, vs_oval, vs_oidx, H, D,
            FMT, GROUP, NG, PD, NOUT, FP8_PER_HEAD, BLOCK_P, BLOCK_G,
        )  # fmt: skip


def _check_kv(name: str, x: torch.Tensor, cache: PagedKVCache) -> None:
    s = cache.spec
    if x.dim() != 3 or x.shape[1] != s.num_kv_heads or x.shape[2] != s.head_dim:
        raise ValueError(f"{name} must be [num_tokens, {s.num_kv_heads}, {s.head_dim}], got {list(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} dtype must be float16, bfloat16 or float32, got {x.dtype}")
    if x.stride(2) != 1:
        raise ValueError(f"{name} must be contiguous along head_dim, got strides {x.stride()}")
    if x.device != cache.device:
        raise ValueError(f"{name} is on {x.device}, the cache on {cache.device}")


def check_slot_mapping(slot_mapping: torch.Tensor, num_tokens: int, cache: PagedKVCache) -> None:
    """Raise ValueError unless slot_mapping is [num_tokens] int32/int64 on the cache's device."""
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {list(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping dtype must be int32 or int64, got {slot_mapping.dtype}")
    if slot_mapping.stride(0) != 1 and num_tokens > 1:
        raise ValueError(f"slot_mapping must be contiguous, got stride {slot_mapping.stride()}")
    if slot_mapping.device != cache.device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device}, the cache on {cache.device}")


def kv_write(key: torch.Tensor, value: torch.Tensor, cache: PagedKVCache, slot_mapping: torch.Tensor) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] into ``slot_mapping`` [num_tokens]
    (slot = block * block_size + offset; -1 skips the token), quantizing to the cache's format.

    Slots must be < num_blocks * block_size and distinct (not checked: that would synchronise).
    One launch, grid (num_tokens, num_kv_heads, 2).
    """
    _check_kv("key", key, cache)
    _check_kv("value", value, cache)
    if key.shape != value.shape:
        raise ValueError(f"key {list(key.shape)} and value {list(value.shape)} differ in shape")
    num_tokens = key.shape[0]
    check_slot_mapping(slot_mapping, num_tokens, cache)
    if num_tokens == 0:
        return
    spec = cache.spec
    kargs, vargs = side_args(cache, "k"), side_args(cache, "v")
    if spec.code == FMT_FP8:  # the kernel writes the fp8 / bf16 bits it computes itself
        kargs[0], vargs[0] = kargs[0].view(torch.uint8), vargs[0].view(torch.uint8)
    if spec.code == FMT_BF16:
        kargs[0], vargs[0] = kargs[0].view(torch.int16), vargs[0].view(torch.int16)
    half = spec.packed_dim
    grid = (num_tokens, spec.num_kv_heads, 2)
    _kv_write_kernel[grid](
        key, value, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *kargs, *vargs,
        spec.num_kv_heads, spec.head_dim, spec.block_size,
        **format_constexprs(spec),
        BLOCK_P=triton.next_power_of_2(half),
        BLOCK_G=triton.next_power_of_2(spec.num_groups),
    )  # fmt: skip


def kv_write_ref(
    key: torch.Tensor, value: torch.Tensor, cache: PagedKVCache, slot_mapping: torch.Tensor
) -> None:
    """Torch reference of `kv_write` (same arguments, same stored bytes)."""
    for side, x in (("k", key), ("v", value)):
        planes = cache.side(side)
        q = quantize_ref(x, cache.spec, planes.fp8_scale, planes.codebook)
        write_slots_ref(cache, side, slot_mapping.long(), q)


def fill_random(cache: PagedKVCache, slots: torch.Tensor, *, seed: int = 0, std: float = 1.0) -> None:
    """Write N(0, std^2) K/V into ``slots`` [n] (on the cache's device), in chunks.

    On CUDA the kv_write kernel quantizes (fast at calibration shapes: no [n, H, D, 16] temporaries
    of the kvquant4 reference); elsewhere the torch reference does, so the interpreter is not
    needed to build inputs. Deterministic for a seed and device.
    """
    spec, device = cache.spec, cache.device
    on_gpu = device.type == "cuda"
    per_token = spec.num_kv_heads * spec.head_dim
    chunk = 1 << 16 if on_gpu else max(1, (1 << 20) // per_token)
    gen = torch.Generator(device=device).manual_seed(seed)
    write = kv_write if on_gpu else kv_write_ref
    for i in range(0, slots.numel(), chunk):
        part = slots[i : i + chunk].contiguous()
        shape = (part.numel(), spec.num_kv_heads, spec.head_dim)
        k = torch.randn(shape, generator=gen, device=device) * std
        v = torch.randn(shape, generator=gen, device=device) * std
        write(k, v, cache, part)


def make_inputs(
    fmt: str,
    num_tokens: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    device: str = "cpu",
    dtype: torch.dtype = torch.float16,
    seed: int = 0,
) -> dict[str, object]:
    """Arguments for `kv_write(**inputs)`: random K/V and a shuffled slot per token."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = -(-num_tokens // block_size) + 1
    cache = PagedKVCache.allocate(fmt, num_blocks, block_size, num_kv_heads, head_dim, device)
    shape = (num_tokens, num_kv_heads, head_dim)
    key = torch.randn(shape, generator=gen).to(device, dtype)
    value = torch.randn(shape, generator=gen).to(device, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    return {"key": key, "value": value, "cache": cache, "slot_mapping": slots.to(device)}

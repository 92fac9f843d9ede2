"""The calibrated ops, their grids, and the work (bytes, FLOPs) each grid point does.

- ``gemm``: ``torch.matmul`` of [m, k] x [k, n] at one layer's per-GPU shapes under TP (qkv, o,
  gate_up, down; lm_head once per step), over token counts m; in bf16 on CUDA, in fp32 on a CPU
  (`gemm_dtype`: CPUs without AMX run bf16 matmuls several times slower than fp32 ones, and a CPU
  serving loop such as ``kvsim validate`` runs fp32 weights).
- ``paged_decode``: one layer of paged decode attention (`kernels.paged_decode`; on a CPU its torch
  reference; a dense SDPA when `kernels` is not importable), over batch x context x KV format.
  Work: the KV bytes read, batch x context x bytes per token per layer per GPU (kvsim's formula).
- ``chunked_prefill``: one layer of chunked prefill for one sequence (`kernels.chunked_prefill` or its
  reference), over chunk x prefix. Work: 4 x heads x head_dim FLOPs per (query, key) pair.
- ``copy``: pinned host <-> device copies (CUDA) or a host memcpy (CPU), over sizes.

Left out: MoE expert GEMMs, MLA attention, all-reduce (no multi-GPU), sampling.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from kvsim.costs.work import (
    attn_flops_per_pair_layer,
    causal_pairs,
    gemm_bytes,
    gemm_flops,
    kv_bytes_per_token_layer_gpu,
)
from kvsim.spec.formats import format_from_name
from kvsim.spec.models import ModelSpec, TPShapes

OPS = ("gemm", "paged_decode", "chunked_prefill", "copy")
OP_ALIASES = {
    "decode": "paged_decode",
    "prefill": "chunked_prefill",
    "paged_decode": "paged_decode",
    "chunked_prefill": "chunked_prefill",
    "block_copy": "copy",
}
GEMM_LAYERS = ("qkv", "o", "gate_up", "down", "lm_head")


def gemm_dtype(backend: str) -> torch.dtype:
    """The dtype GEMMs are timed in: bf16 on CUDA, fp32 on a CPU (see the module docstring)."""
    return torch.bfloat16 if backend == "cuda" else torch.float32


@dataclass(frozen=True)
class Grid:
    gemm_m: tuple[int, ...]
    lm_head_m: tuple[int, ...]
    decode_batch: tuple[int, ...]
    decode_context: tuple[int, ...]
    prefill_chunk: tuple[int, ...]
    prefill_prefix: tuple[int, ...]
    copy_bytes: tuple[int, ...]
    formats: tuple[str, ...]


def make_grid(backend: str, quick: bool, formats: tuple[str, ...] | None) -> Grid:
    """Grids per backend: a GPU one up to vLLM's 8192-token step, a CPU one small enough to finish."""
    mib = 1 << 20
    if backend == "cuda" and not quick:
        return Grid(
            gemm_m=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
            lm_head_m=(1, 4, 16, 64, 256, 1024),
            decode_batch=(1, 4, 16, 64, 256),
            decode_context=(256, 1024, 4096, 16384),  # 256 x 16K x 4 KiB = 16 GiB of bf16 KV at most
            prefill_chunk=(16, 64, 256, 1024, 4096),
            prefill_prefix=(0, 1024, 4096, 16384),
            copy_bytes=tuple(k * mib for k in (0.0625, 0.25, 1, 4, 16, 64, 256)),  # type: ignore[misc]
            formats=formats or ("bf16", "fp8_e4m3/per_tensor", "int8/g64", "int4/g64"),
        )
    if backend == "cuda":
        return Grid(
            (1, 16, 128, 1024, 8192),
            (1, 16, 256),
            (1, 16, 64),
            (512, 4096),
            (64, 1024),
            (0, 4096),
            (mib // 16, mib, 64 * mib),
            formats or ("bf16", "fp8_e4m3/per_tensor"),
        )
    if quick:
        return Grid(
            (1, 16, 64),
            (1, 16),
            (1, 4),
            (128, 512),
            (32, 128),
            (0, 256),
            (mib // 16, mib, 16 * mib),
            formats or ("bf16",),
        )
    return Grid(
        (1, 4, 16, 64, 256),
        (1, 4, 16, 64),
        (1, 4, 16),
        (128, 512, 2048),
        (32, 128, 512),
        (0, 512, 2048),
        (mib // 16, mib // 4, mib, 4 * mib, 16 * mib, 64 * mib),
        formats or ("bf16", "int8/g64"),
    )


def _reach(axis: tuple[int, ...], top: int | None) -> tuple[int, ...]:
    """`axis` extended by factors of 4 up to `top` (and `top` itself), so a grid covers it."""
    if top is None or top <= axis[-1]:
        return axis
    out = list(axis)
    while out[-1] * 4 < top:
        out.append(out[-1] * 4)
    out.append(top)
    return tuple(out)


def extend_grid(
    grid: Grid, *, max_tokens: int | None, max_batch: int | None, max_context: int | None
) -> Grid:
    """The grid reaching a serving loop's largest step (tokens), decode batch and context
    (``kvsim validate`` passes its trace's, so that no step it runs is priced off the grid).

    With `max_batch`, GEMMs are also timed at every token count up to min(max_batch, 16) and at
    powers of two up to max_batch, and decode attention at powers of two: decode-only steps are
    most of a serving loop's steps, and a CPU's small-m GEMMs are not monotone between grid points
    (m = 3 measured slower than m = 4 on the EPYC here)."""

    def small(axis: tuple[int, ...], every: bool) -> tuple[int, ...]:
        if max_batch is None:
            return axis
        extra = {1 << i for i in range(max_batch.bit_length()) if 1 << i <= max_batch} | {max_batch}
        if every:
            extra |= set(range(1, min(max_batch, 16) + 1))
        return tuple(sorted(set(axis) | extra))

    return replace(
        grid,
        gemm_m=_reach(small(grid.gemm_m, True), max_tokens),
        lm_head_m=_reach(small(grid.lm_head_m, True), max_batch),
        decode_batch=_reach(small(grid.decode_batch, False), max_batch),
        decode_context=_reach(grid.decode_context, max_context),
        prefill_chunk=_reach(grid.prefill_chunk, max_tokens),
        prefill_prefix=_reach(grid.prefill_prefix, max_context),
    )


Shapes = TPShapes  # per-GPU shapes, shared with kvsim.costs.profile so both price the same GEMMs


@dataclass
class Point:
    params: dict[str, Any]
    fn: Callable[[], object]
    nbytes: float
    flops: float


# Queries in fp16: the kernels' fp16 path runs fp16 tensor-core dots (as fast as bf16 ones on Hopper);
# their bf16 path upcasts to fp32 dots (kept for the Triton interpreter's bf16-dot defect), which
# would time a slower kernel than a bf16 production engine runs.
Q_DTYPE = torch.float16


def _kernels() -> tuple[Any, Any] | None:
    try:
        from kernels import chunked_prefill, paged_decode
    except Exception:  # the kernels package is optional: fall back to dense SDPA
        return None
    return paged_decode, chunked_prefill


def count(op: str, grid: Grid, backend: str) -> int:
    if op == "gemm":
        return 4 * len(grid.gemm_m) + len(grid.lm_head_m)
    if op == "paged_decode":
        return len(grid.decode_batch) * len(grid.decode_context) * len(grid.formats)
    if op == "chunked_prefill":
        return len(grid.prefill_chunk) * len(grid.prefill_prefix) * len(grid.formats)
    return len(grid.copy_bytes) * (2 if backend == "cuda" else 1)


def points(op: str, grid: Grid, model: ModelSpec, tp: int, backend: str) -> Iterator[Point]:
    """Grid points of ``op``, each built lazily (inputs are allocated when the point is reached)."""
    sh = Shapes.of(model, tp)
    dev = backend
    if op == "gemm":
        for layer in GEMM_LAYERS:
            n, k = sh.gemm_nk[layer]
            dt = gemm_dtype(backend)
            w = torch.randn(k, n, dtype=dt, device=dev)
            for m in grid.lm_head_m if layer == "lm_head" else grid.gemm_m:
                a = torch.randn(m, k, dtype=dt, device=dev)
                yield Point(
                    {"layer": layer, "m": m, "n": n, "k": k},
                    lambda a=a, w=w: torch.matmul(a, w),
                    gemm_bytes(m, n, k, operand_bytes=dt.itemsize, out_bytes=dt.itemsize),
                    gemm_flops(m, n, k),
                )
            del w
    elif op == "paged_decode":
        yield from _decode_points(grid, model, tp, backend)
    elif op == "chunked_prefill":
        yield from _prefill_points(grid, model, tp, backend)
    elif op == "copy":
        for nbytes in grid.copy_bytes:
            nbytes = int(nbytes)
            if backend == "cuda":
                host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
                yield Point(
                    {"link": "host_h2d", "nbytes": nbytes},
                    lambda g=gpu, h=host: g.copy_(h, non_blocking=True),
                    nbytes,
                    0.0,
                )
                yield Point(
                    {"link": "host_d2h", "nbytes": nbytes},
                    lambda g=gpu, h=host: h.copy_(g, non_blocking=True),
                    nbytes,
                    0.0,
                )
            else:
                src = torch.ones(nbytes, dtype=torch.uint8)
                dst = torch.empty_like(src)
                yield Point(
                    {"link": "memcpy", "nbytes": nbytes}, lambda d=dst, s=src: d.copy_(s), nbytes, 0.0
                )
    else:  # pragma: no cover - the CLI checks names
        raise ValueError(op)


def _decode_points(grid: Grid, model: ModelSpec, tp: int, backend: str) -> Iterator[Point]:
    sh = Shapes.of(model, tp)
    kern = _kernels()
    for fmt_name in grid.formats:
        fmt = format_from_name(fmt_name)
        per_tok = kv_bytes_per_token_layer_gpu(model, fmt, tp)
        for b in grid.decode_batch:
            for ctx in grid.decode_context:
                params = {"batch": b, "context": ctx, "format": fmt.name}
                flops = float(attn_flops_per_pair_layer(model, tp) * b * ctx)
                if kern is None:
                    params["impl"] = "torch_sdpa_dense"
                    yield Point(
                        params, _dense_sdpa(b, 1, ctx, sh, backend, causal=False), b * ctx * per_tok, flops
                    )
                    continue
                pd = kern[0]
                inp = pd.make_inputs(
                    fmt.name,
                    b,
                    ctx,
                    sh.kv_heads,
                    sh.head_dim,
                    num_q_heads=sh.heads,
                    dtype=Q_DTYPE,
                    device=backend,
                )
                if backend == "cuda":
                    params["impl"] = "triton:kernels.paged_decode"
                    fn = partial(pd.paged_decode, **inp, max_context_len=ctx)
                else:
                    params["impl"] = "torch:kernels.paged_decode.paged_decode_ref"
                    fn = partial(pd.paged_decode_ref, **inp)
                yield Point(params, fn, b * ctx * per_tok, flops)


def _prefill_points(grid: Grid, model: ModelSpec, tp: int, backend: str) -> Iterator[Point]:
    sh = Shapes.of(model, tp)
    kern = _kernels()
    for fmt_name in grid.formats:
        fmt = format_from_name(fmt_name)
        per_tok = kv_bytes_per_token_layer_gpu(model, fmt, tp)
        for chunk in grid.prefill_chunk:
            for prefix in grid.prefill_prefix:
                params = {"chunk": chunk, "prefix": prefix, "format": fmt.name}
                flops = attn_flops_per_pair_layer(model, tp) * causal_pairs(chunk, prefix)
                nbytes = (prefix + chunk) * per_tok
                if kern is None:
                    params["impl"] = "torch_sdpa_dense"
                    yield Point(
                        params, _dense_sdpa(1, chunk, prefix + chunk, sh, backend, causal=True), nbytes, flops
                    )
                    continue
                cp = kern[1]
                inp = cp.make_inputs(
                    fmt.name,
                    1,
                    prefix,
                    chunk,
                    sh.kv_heads,
                    sh.head_dim,
                    num_q_heads=sh.heads,
                    dtype=Q_DTYPE,
                    device=backend,
                )
                if backend == "cuda":
                    params["impl"] = "triton:kernels.chunked_prefill"
                    # Slots and the chunk length given up front: otherwise each timed call
                    # synchronises with the device and launches small torch ops to derive them.
                    slots = cp.chunk_slot_mapping(
                        inp["block_tables"],
                        inp["query_start_loc"],
                        inp["seq_lens"],
                        inp["cache"].spec.block_size,
                    )
                    fn = partial(cp.chunked_prefill, **inp, slot_mapping=slots, max_query_len=chunk)
                else:
                    params["impl"] = "torch:kernels.chunked_prefill.chunked_prefill_ref"
                    fn = partial(cp.chunked_prefill_ref, **inp)
                yield Point(params, fn, nbytes, flops)


def _dense_sdpa(
    b: int, q_len: int, kv_len: int, sh: Shapes, dev: str, *, causal: bool
) -> Callable[[], object]:
    """Dense bf16 SDPA stand-in when `kernels` is absent: q [b, H, q_len, D], K/V [b, Hkv, kv_len, D]."""
    q = torch.randn(b, sh.heads, q_len, sh.head_dim, dtype=torch.bfloat16, device=dev)
    k = torch.randn(b, sh.kv_heads, kv_len, sh.head_dim, dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if causal and q_len != kv_len:
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=dev).tril(kv_len - q_len)
        return lambda: sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
    return lambda: sdpa(q, k, v, is_causal=causal, enable_gqa=True)

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
- ``h2o_accumulate``: one layer of H2O score accumulation after a decode step
  (`kernels.h2o.h2o_accumulate`, given the step's log-sum-exp as `paged_decode` returns it; on a CPU
  `h2o_accumulate_ref`), over batch x context x KV format. Work: the K bytes re-read plus the fp32
  scores read and written (`h2o_accumulate_bytes_per_token_layer`).
- ``h2o_select``: one layer's top-k selection (`kernels.h2o.h2o_select`, torch on either device) of one
  sequence over its scored tokens, keeping a quarter (H2O's 20% heavy hitters plus a 5% recent
  window). Work: the scores read.
- ``compact_kv``: one layer's compaction of one sequence (`kernels.h2o.compact_kv` with its block-table
  update; on a CPU `compact_kv_ref`): the kept tokens, a quarter of its context, moved to the front,
  over tokens moved x KV format. Work: the moved K/V read and written.
- ``kv_write``: one layer's quantize-on-write of new tokens (`kernels.kv_write.kv_write`; on a CPU
  `kv_write_ref`) from K/V in the loop's dtype (`attn_dtype`), over tokens x KV format. Work: bf16
  read plus the format written.
  Also the decode rows' write of a bf16/fp16 cache (``kvsim validate`` times it in the cache's format).
- ``step_rest``: a step's work besides GEMMs and attention, the serving loop's own code
  (`validate.model.step_rest`): per part, ``layer`` (one layer's RMSNorms, rotary, residual adds,
  SiLU-and-mul) and ``embed`` (the embedding lookup, rotary tables) over tokens, ``sample`` (final
  norm, greedy pick) over sampled rows. Work: `kvsim.costs.work.step_rest_bytes_per_token`.
- ``step_overhead``: one decode step of the serving loop with the forward left out
  (`validate.loop.empty_step`: scheduling, block tables, inputs, ``complete``), over rows, by the
  host's clock (`Point.host`). On CUDA this is the host's work per step (input tensors copied to the GPU, ids read back); kernel launches
  are not in it (each op's timing hides them behind a queued sleep), so a GPU loop without CUDA graphs
  pays launches no op times.

Cold and warm, as the serving loop leaves each op (`calibrate.harness`): a GEMM's weight is rotated
through copies, and attention (``paged_decode``, ``chunked_prefill``'s prefix, ``h2o_accumulate``)
reads its KV from disjoint blocks of one pool per format (`KVRotation`), so that their total
reaches `calibrate.harness.rotation_bytes`; every other op runs warm. Queries, keys and values
enter attention and ``kv_write`` in the loop's dtype (`attn_dtype`: fp16 on CUDA, fp32 on a CPU).

Left out: MoE expert GEMMs, MLA attention, all-reduce (no multi-GPU), sampling other than greedy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from calibrate.harness import MAX_COPIES, num_copies, rotation_bytes
from kvsim.costs.work import (
    attn_flops_per_pair_layer,
    causal_pairs,
    compact_bytes_per_token_layer,
    gemm_bytes,
    gemm_flops,
    h2o_accumulate_bytes_per_token_layer,
    h2o_select_bytes_per_token_layer,
    kv_bytes_per_token_layer_gpu,
    quant_ops_per_element,
    quant_write_bytes_per_token_layer,
    step_rest_bytes_per_token,
)
from kvsim.spec.formats import format_from_name
from kvsim.spec.models import ModelSpec, TPShapes

OPS = (
    "gemm",
    "paged_decode",
    "chunked_prefill",
    "copy",
    "h2o_accumulate",
    "h2o_select",
    "compact_kv",
    "kv_write",
    "step_rest",
    "step_overhead",
)
OP_ALIASES = {
    "decode": "paged_decode",
    "prefill": "chunked_prefill",
    "paged_decode": "paged_decode",
    "chunked_prefill": "chunked_prefill",
    "block_copy": "copy",
    "score": "h2o_accumulate",
    "select": "h2o_select",
    "compact": "compact_kv",
    "write": "kv_write",
    "rest": "step_rest",
    "overhead": "step_overhead",
}
KEEP_SHARE = 4  # h2o_select and compact_kv keep 1/KEEP_SHARE of a sequence's tokens
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
    score_batch: tuple[int, ...]  # h2o_accumulate: batch x context per sequence
    score_context: tuple[int, ...]
    select_tokens: tuple[int, ...]  # h2o_select: tokens scored
    compact_tokens: tuple[int, ...]  # compact_kv: tokens moved
    write_tokens: tuple[int, ...]  # kv_write: new tokens


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
            score_batch=(1, 16, 64),
            score_context=(512, 4096, 16384),
            select_tokens=(1024, 4096, 16384, 65536),
            compact_tokens=(256, 1024, 4096, 16384),
            write_tokens=(1, 16, 256, 4096),
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
            score_batch=(1, 16, 64),
            score_context=(512, 4096),
            select_tokens=(1024, 16384),
            compact_tokens=(256, 4096),
            write_tokens=(1, 16, 1024),
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
            score_batch=(1, 4),
            score_context=(128, 512),
            select_tokens=(256, 4096),
            compact_tokens=(64, 512),
            write_tokens=(1, 16, 256),
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
        score_batch=(1, 4, 16),
        score_context=(128, 512, 2048),
        select_tokens=(256, 2048, 16384),
        compact_tokens=(64, 512, 4096),
        write_tokens=(1, 16, 256),
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
        score_batch=_reach(small(grid.score_batch, False), max_batch),
        score_context=_reach(grid.score_context, max_context),
        select_tokens=_reach(grid.select_tokens, max_context),
        compact_tokens=_reach(grid.compact_tokens, max_context),
        write_tokens=_reach(grid.write_tokens, max_tokens),
    )


Shapes = TPShapes  # per-GPU shapes, shared with kvsim.costs.profile so both price the same GEMMs


@dataclass
class Point:
    params: dict[str, Any]
    fn: Callable[[], object]
    nbytes: float
    flops: float
    host: bool = False  # timed by the host's clock on CUDA too (`calibrate.harness.Timer.time`)
    # The calls the timer rotates through, one per copy of a large read-only operand (`fn` is the
    # first); empty: `fn` alone, warm (`calibrate.harness`).
    copies: tuple[Callable[[], object], ...] = ()
    # An untimed call before each timed one: the op the serving loop runs just before (a CPU's
    # small ops follow a GEMM there, `calibrate.harness`).
    before: Callable[[], object] | None = None

    def calls(self) -> tuple[Callable[[], object], ...]:
        return self.copies or (self.fn,)


# Queries in fp16 on CUDA: the kernels' fp16 path runs fp16 tensor-core dots (as fast as bf16 ones on
# Hopper); their bf16 path upcasts to fp32 dots (kept for the Triton interpreter's bf16-dot defect),
# which would time a slower kernel than a bf16 production engine runs.
Q_DTYPE = torch.float16


def attn_dtype(backend: str) -> torch.dtype:
    """The dtype of the queries, keys and values entering the attention and KV-write kernels, as
    `validate.model.TinyLlama` feeds them: fp16 on CUDA (`Q_DTYPE`), fp32 on a CPU (its GEMMs')."""
    return Q_DTYPE if backend == "cuda" else torch.float32


def _kernels() -> tuple[Any, Any] | None:
    try:
        from kernels import chunked_prefill, paged_decode
    except Exception:  # the kernels package is optional: fall back to dense SDPA
        return None
    return paged_decode, chunked_prefill


# No stand-in without `kernels` (the step's rest and overhead run `validate`'s model and loop, which
# drive `kernels`).
KERNEL_OPS = ("h2o_accumulate", "h2o_select", "compact_kv", "kv_write", "step_rest", "step_overhead")


def unavailable(op: str) -> str | None:
    """Why `op` cannot be timed here (None when it can): the eviction, write and step ops need `kernels`."""
    if op in KERNEL_OPS and _kernels() is None:
        return "the kernels package is not importable"
    return None


def count(op: str, grid: Grid, backend: str) -> int:
    if op == "gemm":
        return 4 * len(grid.gemm_m) + len(grid.lm_head_m)
    if op == "paged_decode":
        return len(grid.decode_batch) * len(grid.decode_context) * len(grid.formats)
    if op == "chunked_prefill":
        return len(grid.prefill_chunk) * len(grid.prefill_prefix) * len(grid.formats)
    if op == "h2o_accumulate":
        return len(grid.score_batch) * len(grid.score_context) * len(grid.formats)
    if op == "h2o_select":
        return len(grid.select_tokens)
    if op == "compact_kv":
        return len(grid.compact_tokens) * len(grid.formats)
    if op == "kv_write":
        return len(grid.write_tokens) * len(grid.formats)
    if op == "step_rest":
        return 2 * len(grid.gemm_m) + len(grid.lm_head_m)
    if op == "step_overhead":
        return len(grid.decode_batch)
    return len(grid.copy_bytes) * (2 if backend == "cuda" else 1)


def points(op: str, grid: Grid, model: ModelSpec, tp: int, backend: str) -> Iterator[Point]:
    """Grid points of ``op``, each built lazily (inputs are allocated when the point is reached)."""
    sh = Shapes.of(model, tp)
    dev = backend
    if op == "gemm":
        for layer in GEMM_LAYERS:
            n, k = sh.gemm_nk[layer]
            dt = gemm_dtype(backend)
            w = _weight(k, n, dt, dev)
            # The weight cold, as in a step that streams every layer's: rotated through copies.
            ws = [w] + [w.clone() for _ in range(num_copies(w.numel() * dt.itemsize, backend) - 1)]
            for m in grid.lm_head_m if layer == "lm_head" else grid.gemm_m:
                a = torch.randn(m, k, dtype=dt, device=dev)
                calls = tuple(partial(torch.matmul, a, wi) for wi in ws)
                yield Point(
                    {"layer": layer, "m": m, "n": n, "k": k},
                    calls[0],
                    gemm_bytes(m, n, k, operand_bytes=dt.itemsize, out_bytes=dt.itemsize),
                    gemm_flops(m, n, k),
                    copies=calls if len(calls) > 1 else (),
                )
            del w, ws
    elif op == "paged_decode":
        yield from _decode_points(grid, model, tp, backend)
    elif op == "chunked_prefill":
        yield from _prefill_points(grid, model, tp, backend)
    elif op == "h2o_accumulate":
        yield from _score_points(grid, model, tp, backend)
    elif op == "h2o_select":
        yield from _select_points(grid, model, tp, backend)
    elif op == "compact_kv":
        yield from _compact_points(grid, model, tp, backend)
    elif op == "kv_write":
        yield from _write_points(grid, model, tp, backend)
    elif op == "step_rest":
        yield from _rest_points(grid, model, tp, backend)
    elif op == "step_overhead":
        from validate.loop import empty_step

        after = _after_weights(model, sh, backend, "step")
        for rows in grid.decode_batch:
            fn = empty_step(rows, device=backend)
            yield Point({"rows": rows, "impl": "validate.loop.step"}, fn, 0.0, 0.0, host=True, before=after)
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


class KVRotation:
    """One layer's KV pool per format, `rotation_bytes` large and filled once, from which each point
    takes disjoint blocks per copy (`tables`): attention reads its KV cold, as in a step that
    streams every layer's weights and KV, without a pool allocated and filled per point."""

    def __init__(self, sh: Shapes, backend: str, block_size: int = 16) -> None:
        self.sh, self.backend, self.block_size = sh, backend, block_size
        self.pools: dict[str, Any] = {}
        self.gen = torch.Generator().manual_seed(0)

    def cache(self, fmt: str) -> Any:
        if fmt not in self.pools:
            from kernels.kv_cache import PagedKVCache
            from kernels.paged_decode import make_inputs

            sh, bs = self.sh, self.block_size
            row = PagedKVCache.allocate(fmt, 1, bs, sh.kv_heads, sh.head_dim).pool.shape[1]
            blocks = max(1, rotation_bytes(self.backend) // row)
            # A seed of random K/V (make_inputs' fill), tiled over the pool: filling the whole pool
            # with fresh random values would cost seconds per format on a CPU.
            seed = make_inputs(
                fmt, 1, min(blocks, 256) * bs, sh.kv_heads, sh.head_dim, num_q_heads=sh.heads,
                block_size=bs, device=self.backend,
            )["cache"]  # fmt: skip
            cache = PagedKVCache.allocate(
                fmt, blocks, bs, sh.kv_heads, sh.head_dim, self.backend,
                k_fp8_scale=seed.k.fp8_scale, v_fp8_scale=seed.v.fp8_scale,
                k_codebook=seed.k.codebook, v_codebook=seed.v.codebook,
            )  # fmt: skip
            src = seed.pool
            for lo in range(0, blocks, src.shape[0]):
                hi = min(blocks, lo + src.shape[0])
                cache.pool[lo:hi].copy_(src[: hi - lo])
            self.pools[fmt] = cache
        return self.pools[fmt]

    def tables(self, fmt: str, batch: int, tokens: int) -> list[torch.Tensor] | None:
        """Block tables [batch, blocks per sequence] of each copy, over disjoint shuffled blocks of
        the pool (as many copies as fit, at most `MAX_COPIES`); None when one copy does not fit
        (its KV alone is larger than the rotation, so it streams through the cache every call)."""
        cache = self.cache(fmt)
        per_seq = max(1, -(-tokens // self.block_size))
        need = batch * per_seq
        blocks = cache.spec.num_blocks
        if need > blocks:
            return None
        n = min(MAX_COPIES, blocks // need)
        perm = torch.randperm(blocks, generator=self.gen)[: n * need].view(n, batch, per_seq)
        return [t.to(torch.int32).to(self.backend) for t in perm]


def _after_gemm(sh: Shapes, backend: str) -> Callable[[int], Callable[[], object] | None]:
    """`Point.before` of a small op over `n` tokens: on a CPU an untimed GEMM of the layer's output
    projection at `n` rows (in the loop each small op follows a GEMM, `calibrate.harness`); None
    on CUDA (the kernels' time does not depend on what ran before)."""
    if backend == "cuda":
        return lambda n: None
    nn, k = sh.gemm_nk["o"]
    w = _weight(k, nn, gemm_dtype(backend), backend)
    return lambda n: partial(torch.matmul, torch.randn(max(n, 1), k, dtype=w.dtype), w)


def _after_weights(model: ModelSpec, sh: Shapes, backend: str, scope: str) -> Callable[[], object] | None:
    """`Point.before` of a small op that the loop runs once per layer (`scope` ``layer``: the KV
    write) or once per step (``step``: the embedding, sampling, the loop's own overhead): on a CPU,
    one row through the GEMM weights the loop streams between two calls of the op, in the loop's
    order (one layer's o, gate_up, down and qkv; every layer's and the LM head for a step), as
    distinct [k, n] weights of the model's shapes, at most `calibrate.harness.rotation_bytes` of
    them (more would leave the cache no colder). Measured on an EPYC at the validate model's shapes
    (4 layers, 84 MiB of fp32 weights): the loop's KV write took 3x, its embedding 5-8x the
    back-to-back time, and one GEMM before them covered half of that. None on CUDA."""
    if backend == "cuda":
        return None
    dt = gemm_dtype(backend)
    cap = rotation_bytes(backend)
    order = [sh.gemm_nk[name] for name in ("o", "gate_up", "down", "qkv")]
    shapes = order if scope == "layer" else order * model.num_layers + [sh.gemm_nk["lm_head"]]
    calls: list[Callable[[], object]] = []
    total = 0
    rows: dict[int, torch.Tensor] = {}
    for nn, k in shapes:
        if total >= cap:
            break
        x = rows.setdefault(k, torch.randn(1, k, dtype=dt, device=backend))
        calls.append(partial(torch.matmul, x, _weight(k, nn, dt, backend)))
        total += nn * k * dt.itemsize

    def sweep() -> None:
        for c in calls:
            c()

    return sweep


def _weight(k: int, n: int, dt: torch.dtype, dev: str) -> torch.Tensor:
    """A [k, n] GEMM weight: random rows tiled (a GEMM's time does not depend on the values, and
    drawing an 8B model's LM head, 2 GiB in fp32, took 5-17 s of a quick CPU calibration)."""
    rows = min(k, 64)
    return torch.randn(rows, n, dtype=dt, device=dev).repeat(-(-k // rows), 1)[:k].contiguous()


def _decode_copies(
    rot: KVRotation,
    fmt: str,
    b: int,
    ctx: int,
    backend: str,
    scores: bool = False,
    dtype: torch.dtype | None = None,
) -> list[dict[str, Any]]:
    """Inputs of `paged_decode` (with a zero ``scores`` buffer: `h2o_accumulate`'s) per copy: one
    query batch, each copy's sequences over its own blocks of the rotation pool (`KVRotation`);
    one copy of its own inputs when the point's KV is larger than the rotation."""
    sh = rot.sh
    dtype = attn_dtype(backend) if dtype is None else dtype
    tabs = rot.tables(fmt, b, ctx)
    if tabs is None:
        from kernels import h2o
        from kernels.paged_decode import make_inputs

        build = h2o.make_inputs if scores else make_inputs
        return [
            build(fmt, b, ctx, sh.kv_heads, sh.head_dim, num_q_heads=sh.heads, dtype=dtype, device=backend)
        ]  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    base: dict[str, Any] = {
        "q": torch.randn(b, sh.heads, sh.head_dim, generator=gen).to(backend, dtype),
        "cache": rot.cache(fmt),
        "context_lens": torch.full((b,), ctx, dtype=torch.int32, device=backend),
        "sm_scale": sh.head_dim**-0.5,
    }
    if scores:
        base["scores"] = torch.zeros(b, sh.kv_heads, ctx, device=backend)
    return [{**base, "block_tables": t} for t in tabs]


def _decode_points(grid: Grid, model: ModelSpec, tp: int, backend: str) -> Iterator[Point]:
    sh = Shapes.of(model, tp)
    kern = _kernels()
    rot = KVRotation(sh, backend)
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
                if backend == "cuda":
                    params["impl"] = "triton:kernels.paged_decode"
                    calls = [partial(pd.paged_decode, **inp, max_context_len=ctx)
                             for inp in _decode_copies(rot, fmt.name, b, ctx, backend)]  # fmt: skip
                else:
                    params["impl"] = "torch:kernels.paged_decode.paged_decode_ref"
                    calls = [partial(pd.paged_decode_ref, **inp)
                             for inp in _decode_copies(rot, fmt.name, b, ctx, backend)]  # fmt: skip
                yield Point(params, calls[0], b * ctx * per_tok, flops, copies=_rot(calls))


def _rot(calls: list[Callable[[], object]]) -> tuple[Callable[[], object], ...]:
    return tuple(calls) if len(calls) > 1 else ()


def _prefill_points(grid: Grid, model: ModelSpec, tp: int, backend: str) -> Iterator[Point]:
    sh = Shapes.of(model, tp)
    kern = _kernels()
    rot = KVRotation(sh, backend)
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
                tabs = rot.tables(fmt.name, 1, prefix + chunk)
                # The chunk's queries and new K/V (warm, as the loop's activations), and the cached
                # prefix cold: each copy over its own blocks of the rotation pool.
                inp = cp.make_inputs(
                    fmt.name,
                    1,
                    prefix if tabs is None else 0,
                    chunk,
                    sh.kv_heads,
                    sh.head_dim,
                    num_q_heads=sh.heads,
                    dtype=attn_dtype(backend),
                    device=backend,
                )
                copies = [inp]
                if tabs is not None:
                    lens = torch.full((1,), prefix + chunk, dtype=torch.int32, device=backend)
                    copies = [{**inp, "cache": rot.cache(fmt.name), "block_tables": t, "seq_lens": lens}
                              for t in tabs]  # fmt: skip
                calls: list[Callable[[], object]] = []
                for c in copies:
                    if backend == "cuda":
                        # Slots and the chunk length given up front: otherwise each timed call
                        # synchronises with the device and launches small torch ops to derive them.
                        slots = cp.chunk_slot_mapping(
                            c["block_tables"], c["query_start_loc"], c["seq_lens"], c["cache"].spec.block_size
                        )
                        calls.append(
                            partial(cp.chunked_prefill, **c, slot_mapping=slots, max_query_len=chunk)
                        )
                    else:
                        calls.append(partial(cp.chunked_prefill_ref, **c))
                params["impl"] = (
                    "triton:kernels.chunked_prefill"
                    if backend == "cuda"
                    else "torch:kernels.chunked_prefill.chunked_prefill_ref"
                )
                yield Point(params, calls[0], nbytes, flops, copies=_rot(calls))


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


def _score_points(
    grid: Grid, model: ModelSpec, tp: int, backend: str, triton: bool | None = None
) -> Iterator[Point]:
    """`triton`: time the Triton kernel (default on CUDA; on a CPU only in the interpreter, for tests)."""
    triton = backend == "cuda" if triton is None else triton
    from kernels import h2o
    from kernels.paged_decode import paged_decode

    sh = Shapes.of(model, tp)
    rot = KVRotation(sh, backend)
    for fmt_name in grid.formats:
        fmt = format_from_name(fmt_name)
        per_tok = h2o_accumulate_bytes_per_token_layer(model, fmt, tp)
        for b in grid.score_batch:
            for ctx in grid.score_context:
                params: dict[str, Any] = {"batch": b, "context": ctx, "format": fmt.name}
                flops = float(attn_flops_per_pair_layer(model, tp) // 2 * b * ctx)  # QK^T
                # The K read cold: each copy over its own blocks of the rotation pool.
                copies = _decode_copies(rot, fmt.name, b, ctx, backend, scores=True, dtype=Q_DTYPE)
                if triton:
                    params["impl"] = "triton:kernels.h2o.h2o_accumulate"
                    # The step's log-sum-exp comes with its attention output (paged_decode's
                    # return_lse): only the accumulation is timed. The first copy's serves all
                    # (the values do not change the time).
                    dec = {k: v for k, v in copies[0].items() if k != "scores"}
                    _, lse = paged_decode(**dec, max_context_len=ctx, return_lse=True)
                    calls = [partial(h2o.h2o_accumulate, **c, lse=lse, max_context_len=ctx) for c in copies]
                else:
                    params["impl"] = "torch:kernels.h2o.h2o_accumulate_ref"
                    calls = [partial(h2o.h2o_accumulate_ref, **c) for c in copies]
                yield Point(params, calls[0], b * ctx * per_tok, flops, copies=_rot(calls))


def _select_points(grid: Grid, model: ModelSpec, tp: int, backend: str) -> Iterator[Point]:
    from kernels import h2o

    sh = Shapes.of(model, tp)
    per_tok = h2o_select_bytes_per_token_layer(model, tp)
    gen = torch.Generator().manual_seed(0)
    for n in grid.select_tokens:
        keep = max(1, n // KEEP_SHARE)
        recent = keep // 5  # of a quarter kept: 20% of the sequence heavy hitters, 5% recent
        scores = torch.rand(1, sh.kv_heads, n, generator=gen).to(backend)
        lens = torch.full((1,), n, dtype=torch.int32, device=backend)
        params = {"tokens": n, "kept": keep, "impl": "torch:kernels.h2o.h2o_select"}
        fn = partial(h2o.h2o_select, scores, lens, keep - recent, 0, recent)
        yield Point(params, fn, n * per_tok, float(sh.kv_heads * n * max(1.0, math.log2(n))))


def _compact_points(
    grid: Grid, model: ModelSpec, tp: int, backend: str, triton: bool | None = None
) -> Iterator[Point]:
    """`triton`: time the Triton kernel (default on CUDA; on a CPU only in the interpreter, for tests)."""
    triton = backend == "cuda" if triton is None else triton
    from kernels import h2o

    sh = Shapes.of(model, tp)
    gen = torch.Generator().manual_seed(0)
    for fmt_name in grid.formats:
        fmt = format_from_name(fmt_name)
        per_tok = compact_bytes_per_token_layer(model, fmt, tp)
        for n in grid.compact_tokens:
            ctx = KEEP_SHARE * n
            inp = h2o.make_inputs(fmt.name, 1, ctx, sh.kv_heads, sh.head_dim, dtype=Q_DTYPE, device=backend)
            keep = torch.randperm(ctx, generator=gen)[:n].sort().values.to(torch.int32)[None, :]
            args = (inp["cache"], inp["block_tables"], inp["context_lens"], keep.to(backend))
            kept = torch.full((1,), n, dtype=torch.int32, device=backend)
            params: dict[str, Any] = {"tokens": n, "context": ctx, "format": fmt.name}
            if triton:
                params["impl"] = "triton:kernels.h2o.compact_kv"
                fn = partial(h2o.compact_kv, *args, kept, check=False)  # keep lists come from h2o_select
            else:
                params["impl"] = "torch:kernels.h2o.compact_kv_ref"
                fn = partial(h2o.compact_kv_ref, *args, kept)
            yield Point(params, fn, n * per_tok, 0.0)


def _write_points(
    grid: Grid, model: ModelSpec, tp: int, backend: str, triton: bool | None = None
) -> Iterator[Point]:
    """`triton`: time the Triton kernel (default on CUDA; on a CPU only in the interpreter, for tests)."""
    triton = backend == "cuda" if triton is None else triton
    from kernels import kv_write

    sh = Shapes.of(model, tp)
    after = _after_weights(model, sh, backend, "layer")
    for fmt_name in grid.formats:
        fmt = format_from_name(fmt_name)
        per_tok = quant_write_bytes_per_token_layer(model, fmt, tp)
        elements = 2 * sh.kv_heads * sh.head_dim
        for n in grid.write_tokens:
            # K/V in the dtype the serving loop writes them in (warm: a small op, `calibrate.harness`).
            inp = kv_write.make_inputs(
                fmt.name, n, sh.kv_heads, sh.head_dim, device=backend, dtype=attn_dtype(backend)
            )
            params: dict[str, Any] = {"tokens": n, "format": fmt.name}
            if triton:
                params["impl"] = "triton:kernels.kv_write.kv_write"
                fn = partial(kv_write.kv_write, **inp)
            else:
                params["impl"] = "torch:kernels.kv_write.kv_write_ref"
                fn = partial(kv_write.kv_write_ref, **inp)
            yield Point(
                params,
                fn,
                n * per_tok,
                float(n * elements * quant_ops_per_element(fmt, sh.head_dim)),
                before=after,
            )


def _rest_points(grid: Grid, model: ModelSpec, tp: int, backend: str) -> Iterator[Point]:
    """`validate.model.step_rest` at the per-GPU shapes: ``layer`` and ``embed`` over the GEMMs' token
    counts, ``sample`` over the LM head's rows; in the GEMMs' dtype (fp32 on a CPU, as the serving
    loop there), the attention kernels' inputs in fp16 on CUDA."""
    from validate.model import STEP_REST_PARTS, step_rest

    sh = Shapes.of(model, tp)
    dims = {
        "hidden": model.hidden_size,
        "heads": sh.heads,
        "kv_heads": sh.kv_heads,
        "head_dim": sh.head_dim,
        "intermediate": sh.gemm_nk["down"][1],
        "vocab": sh.gemm_nk["lm_head"][0],
    }
    dt = gemm_dtype(backend)
    after = _after_gemm(sh, backend)
    after_step = _after_weights(model, sh, backend, "step")
    for part in STEP_REST_PARTS:
        per_tok = step_rest_bytes_per_token(model, tp, part)
        sizes = grid.lm_head_m if part == "sample" else grid.gemm_m

        # One embedding table for every size, written (see `step_rest`).
        table = (
            torch.zeros(dims["vocab"], dims["hidden"], device=backend, dtype=dt) if part == "embed" else None
        )

        def call(n: int, part: str = part, table: torch.Tensor | None = table) -> Callable[[], object]:
            adt = Q_DTYPE if backend == "cuda" else dt
            return step_rest(part, n, **dims, device=backend, dtype=dt, attn_dtype=adt, table=table)

        # The largest size first, untimed: a serving loop has run its largest steps before (its
        # warm-up), so its allocator serves these tensors from the heap; timed cold, glibc's
        # adaptive mmap threshold made the 256-token layer page-fault every call (3x slower here).
        warm = call(sizes[-1])
        for _ in range(3):
            warm()
        del warm
        for n in sizes:
            yield Point(
                {"part": part, "tokens": n, "impl": "validate.model.step_rest"},
                call(n),
                n * per_tok,
                0.0,
                before=after(n) if part == "layer" else after_step,
            )

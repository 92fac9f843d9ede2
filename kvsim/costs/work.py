"""The work of every op, in one place: FLOPs and bytes per GPU of a tensor-parallel group.

The analytic model divides this work by peak rates, the profile model by measured rates, and the
calibrator (``calibrate/ops.py``, ``calibrate/aiconfigurator.py``) records it beside each timed
point; all three import it from here so that a rate measured for one shape prices another by the
same arithmetic.

- KV share: a GPU holds ceil(kv_heads / tp) of the KV heads (vLLM pads), all of an MLA latent
  (replicated on every rank): `ModelSpec.kv_share`, defined under the spec because the memory plan,
  below this layer, sizes the cache with it.
- Attention pairs: a chunk of n new tokens over ctx cached ones attends to n x ctx cached keys and,
  causally, n (n + 1) / 2 of its own: `causal_pairs`.
- Attention FLOPs per (query, key) pair per layer: QK^T and PV at 2 FLOPs per MAC over the GPU's
  query heads; MLA decode runs absorbed (vLLM, FlashMLA): scores over kv_lora_rank + rope dims and
  values over kv_lora_rank dims of the cached latent.
- GEMMs: 2 m n k FLOPs for [m, k] x [k, n]; bytes of bf16 operands and result.
- KV bytes read: decode reads each sequence's cache plus its new token; a prefill chunk reads its
  prefix and writes its own tokens.
- All-reduce: two per layer (attention output, MLP output) under TP > 1, ring algorithm:
  2 (tp - 1) / tp of the bf16 activations per token cross the link.
- Quantize-on-write (vLLM's ``reshape_and_cache`` with a quantizing ``kv_cache_dtype``;
  ``kernels/kv_write.py``): every new token's K and V are read in bf16 and written in the cache's
  format, with `quant_ops_per_element` vector operations per element (kvquant4's outlier selection
  included). Only lossy parts of the cache count: a bf16 cache's plain copy is left inside the
  attention and overhead terms, as before.
- kvquant4's outlier path (`outlier_read_work_per_token`): reading a cached token merges its fp16
  outliers into the dequantized codebook values, a compare and a select over the vector per outlier
  (``kernels/kv_cache.py``, ``load_kv_tile``); the outliers' bytes are in the format's bytes.
- MLA prefill over a cached prefix (vLLM's chunked-context MLA prefill): the prefix's latents are
  up-projected to per-head K (nope part) and V before attention, 2 x ctx x kv_lora_rank x heads x
  (qk_nope_head_dim + v_head_dim) FLOPs per layer (`mla_upproj_flops`); new tokens' up-projection
  is in the GEMMs (``kv_b_proj``). Decode runs absorbed, with no up-projection.
- Sliding-window layers (``ModelSpec.sliding_window``): a prefill chunk's queries attend to at
  most the window (plus its global tokens) in those layers (`window_pairs`, `attended_pairs`) and
  read only the window of the prefix; a decode reads the sequence's resident tokens, which the KV
  cache manager keeps as the layer average (`kvsim.core.eviction.window_eviction`).
- Format switch (`kv.format_switch`): re-quantizing a cached token reads it in the first format,
  writes it in the second, with both formats' vector operations per element (`requant_work_per_token`).
- Mixed formats per head (`FormatMix`): bytes are the two parts' bytes summed; `ModelWork` keeps
  each part's share of the cached vectors so a model can price each part at its own rate.

- A MoE layout (``cluster.parallel``, `ModelWork.with_layout`): weights per GPU as
  `kvsim.spec.parallel.weight_bytes_per_gpu` places them; routed-expert GEMM FLOPs per GPU are the
  busiest EP rank's (the mean times ``expert_imbalance``); under DP attention a GPU holds and reads
  1 / dp of the replica's tokens' KV (whole tokens, all heads) instead of its TP share; all-reduces
  only where a TP split needs one (attention under TP; dense MLPs, and experts at EP 1, under DP:
  an all-gather plus a reduce-scatter moves an all-reduce's bytes); under EP a dispatch and a
  combine per MoE layer, each token sent once to every other rank holding one of its experts
  (`kvsim.spec.parallel.remote_ranks_per_token`) in bf16 both ways (DeepEP can dispatch in FP8,
  which would halve the dispatch: not modelled).

Left out: sampling, the embedding lookup, EP across nodes (pipeline and context parallelism price
this work per stage and per rank: `kvsim.costs.pipeline`, `kvsim.costs.context_parallel`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import overload

import numpy as np

from kvsim.spec.formats import FP16_BYTES, OUTLIER_INDEX_BYTES, FormatKind, FormatMix, KVFormat
from kvsim.spec.models import Attention, ModelSpec, TPShapes
from kvsim.spec.parallel import (
    AttentionParallel,
    ParallelLayout,
    WeightParts,
    kv_share,
    remote_ranks_per_token,
    weight_bytes_per_gpu,
)

BF16 = KVFormat(kind=FormatKind.BF16)
ACT_BYTES = 2  # bf16 activations
Size = int | float | np.ndarray  # a count, or counts element by element
# Vector operations per element to quantize one new K/V element on write (estimates from the
# kernels' arithmetic in kernels/kv_write.py, not measured): fp8 scale and convert; int8/int4 the
# group's min and max, scale, round and pack; kvquant4 the nearest of 16 codebook entries (a
# subtract and a compare each) plus the scale; its outlier selection is `OUTLIER_SELECT_OPS`.
QUANT_FLOPS_PER_ELEMENT: dict[FormatKind, int] = {
    FormatKind.FP16: 0,
    FormatKind.BF16: 0,
    FormatKind.FP8_E4M3: 2,
    FormatKind.INT8: 5,
    FormatKind.INT4: 6,
    FormatKind.KVQUANT4: 34,
}
# kvquant4's outliers, vector operations per element of a vector, per outlier it keeps (estimates
# from the kernels' arithmetic, not measured). Write (kernels/kv_write.py): each outlier is found by
# a pass over the vector: the max of |x|, its first index (compare, select, min), its value
# (compare, select, sum) and the mask update (compare, select): 9. Read (kernels/kv_cache.py,
# load_kv_tile): each outlier overwrites its coordinate of the dequantized vector (compare, select): 2.
OUTLIER_SELECT_OPS = 9
OUTLIER_MERGE_OPS = 2


def quant_ops_per_element(fmt: KVFormat, dim: int) -> int:
    """Vector operations per element of quantizing one new vector of ``dim`` elements in `fmt`:
    `QUANT_FLOPS_PER_ELEMENT`, plus kvquant4's outlier selection (`OUTLIER_SELECT_OPS` per outlier)."""
    return QUANT_FLOPS_PER_ELEMENT[fmt.kind] + OUTLIER_SELECT_OPS * fmt.outliers_per_vector(dim)


def outlier_read_work_per_token(model: ModelSpec, fmt: KVFormat, tp: int) -> tuple[float, float]:
    """(bytes, vector operations) of kvquant4's outliers when attention reads one cached token in
    `fmt`, one GPU, all layers (0, 0 for other formats and for outlier_fraction 0): the outliers' fp16
    values and int16 indices (part of the format's bytes per token), and their merge into the
    dequantized vectors, `OUTLIER_MERGE_OPS` per element per outlier."""
    n = fmt.outliers_per_vector(model.kv_vector_dim)
    if not n:
        return 0.0, 0.0
    vectors = model.kv_layers * model.kv_vectors_per_layer * model.kv_share(tp)
    nbytes = vectors * n * (FP16_BYTES + OUTLIER_INDEX_BYTES)
    return nbytes, vectors * model.kv_vector_dim * n * OUTLIER_MERGE_OPS


@overload
def causal_pairs(n: float, ctx: float) -> float: ...
@overload
def causal_pairs(n: np.ndarray, ctx: Size) -> np.ndarray: ...
def causal_pairs(n: Size, ctx: Size) -> Size:
    """(query, key) pairs of a causal chunk of ``n`` new tokens over ``ctx`` cached ones."""
    return n * ctx + n * (n + 1) / 2


def window_pairs(n: int, ctx: int, window: int) -> int:
    """(query, key) pairs of a causal chunk of ``n`` new tokens over ``ctx`` cached ones in a layer
    that attends to the last ``window`` tokens (the query at position i to min(i + 1, window)):
    `causal_pairs` up to the window, ``window`` per query past it."""
    lo, hi = ctx + 1, ctx + n  # keys each query sees if nothing were cut: lo .. hi
    pairs = 0
    if lo <= window:
        top = min(hi, window)
        pairs += (lo + top) * (top - lo + 1) // 2
    if hi > window:
        pairs += window * (hi - max(lo - 1, window))
    return pairs


def attended_pairs(model: ModelSpec, n: int, ctx: int) -> float:
    """`causal_pairs` averaged over the model's layers, its sliding-window layers attending only to
    their window (``sliding_window`` plus ``global_tokens``, as `ModelSpec.resident_tokens` keeps)."""
    full = causal_pairs(n, ctx)
    win = model.sliding_window_layers if model.sliding_window else 0
    if not win:
        return full
    w = window_pairs(n, ctx, model.sliding_window + model.global_tokens)
    return ((model.num_layers - win) * full + win * w) / model.num_layers


def attended_prefix(model: ModelSpec, ctx: int) -> float:
    """Cached tokens a prefill chunk reads over ``ctx`` cached ones, averaged over the KV layers
    (a windowed layer reads its window only)."""
    win = model.windowed_kv_layers()
    if not win:
        return float(ctx)
    capped = min(ctx, model.sliding_window + model.global_tokens)
    return ((model.kv_layers - win) * ctx + win * capped) / model.kv_layers


def decode_tokens_read(num_seqs: int, sum_ctx: np.ndarray) -> np.ndarray:
    """Tokens of KV a decode step reads: each sequence's cache plus its new token."""
    return sum_ctx + num_seqs


# Paged attention pays per block (block-table reads, per-block gather setup): vLLM's PagedAttention
# kernel ran 20-26% slower than FasterTransformer's contiguous one at block size 16 (Kwon et al.,
# SOSP 2023, section 7.1), about 0.2 x 16 = 3.2 token reads per block (the low end). The kernels
# also step through whole blocks, so a sequence's partial last block costs (bs - 1) / 2 token slots
# on average. Measured rates (the fitted tables, `kvsim calibrate`'s kernels) already hold both at
# the block size they ran at, taken as 16 (calibrate's and bench's; an assumption for the NVIDIA
# tables, whose page size is not recorded): only the difference from it is added.
BLOCK_OVERHEAD_TOKENS = 3.2
REFERENCE_BLOCK_SIZE = 16


def block_extra_tokens(num_seqs: Size, tokens: Size, block_size: int) -> Size:
    """Token reads a paged decode over ``tokens`` tokens of ``num_seqs`` sequences costs beyond
    those at `REFERENCE_BLOCK_SIZE` (negative for larger blocks: fewer block-table reads): the
    per-block term over the blocks plus the partial last block's wasted slots. Its minimum is near
    block_size = sqrt(2 x 3.2 x tokens per sequence): 23 at 80 tokens, 57 at 500, 113 at 2,000,
    as the vLLM paper's ablation found 16-32 best on Alpaca's short sequences and 16-128 on
    ShareGPT's (section 7.2)."""
    if block_size == REFERENCE_BLOCK_SIZE:
        return tokens * 0.0
    per_block = tokens * BLOCK_OVERHEAD_TOKENS * (1.0 / block_size - 1.0 / REFERENCE_BLOCK_SIZE)
    return per_block + num_seqs * (block_size - REFERENCE_BLOCK_SIZE) / 2.0


def block_gather_factor(block_size: int) -> float:
    """A paged read's cost per token relative to `REFERENCE_BLOCK_SIZE`, per-block term only (a
    prefill chunk's prefix read: one partial block per sequence is small beside its chunk)."""
    return 1.0 + BLOCK_OVERHEAD_TOKENS * (1.0 / block_size - 1.0 / REFERENCE_BLOCK_SIZE)


def kv_bytes_per_token_gpu(model: ModelSpec, fmt: KVFormat, tp: int, mix: FormatMix | None = None) -> float:
    """Bytes one token adds to one GPU's cache, all layers."""
    return model.kv_bytes_per_token(fmt, mix) * model.kv_share(tp)


def kv_bytes_per_token_layer_gpu(
    model: ModelSpec, fmt: KVFormat, tp: int, mix: FormatMix | None = None
) -> float:
    """Bytes one token adds to one GPU's cache in one layer."""
    return model.kv_bytes_per_token_layer(fmt, mix) * model.kv_share(tp)


def format_parts(fmt: KVFormat, mix: FormatMix | None) -> list[tuple[KVFormat, float]]:
    """The cache's formats with the share of cached vectors each stores (one part without a mix)."""
    if mix is None or not mix.heads:
        return [(fmt, 1.0)]
    if mix.heads == mix.num_kv_heads:
        return [(mix.format, 1.0)]
    return [(fmt, 1.0 - mix.fraction), (mix.format, mix.fraction)]


def quant_write_work_per_token(
    model: ModelSpec, fmt: KVFormat, tp: int, mix: FormatMix | None
) -> tuple[float, float]:
    """(bytes, vector FLOPs) of quantizing one new token's K/V on write, one GPU, all layers: the
    lossy parts' bf16 input read and quantized output written (see the module docstring)."""
    nbytes = 0.0
    flops = 0.0
    elements = model.kv_layers * model.kv_vectors_per_layer * model.kv_vector_dim * model.kv_share(tp)
    for f, share in format_parts(fmt, mix):
        if not f.lossy:
            continue
        nbytes += share * (kv_bytes_per_token_gpu(model, BF16, tp) + kv_bytes_per_token_gpu(model, f, tp))
        flops += share * elements * quant_ops_per_element(f, model.kv_vector_dim)
    return nbytes, flops


def requant_work_per_token(
    model: ModelSpec, first: KVFormat, second: KVFormat, tp: int
) -> tuple[float, float]:
    """(bytes, vector FLOPs) of re-quantizing one cached token from `first` to `second` (a format
    switch's crossing), one GPU, all layers: read in the first format, written in the second, and
    dequantize plus quantize operations per element (`quant_ops_per_element` of each: dequantizing
    is taken to cost as much as quantizing, an estimate; kvquant4's outlier selection counted in both)."""
    d = model.kv_vector_dim
    elements = model.kv_layers * model.kv_vectors_per_layer * d * model.kv_share(tp)
    nbytes = kv_bytes_per_token_gpu(model, first, tp) + kv_bytes_per_token_gpu(model, second, tp)
    ops = quant_ops_per_element(first, d) + quant_ops_per_element(second, d)
    return nbytes, elements * ops


# ---- token eviction and quantize-on-write, one layer, one GPU (the measured ops' work) ------------
SCORE_BYTES = 4  # one fp32 H2O score per token and KV head (kernels/h2o.py)
# Attention entropy's statistic per logit: p = exp(s - m), p * log p and the sum (exp, log, multiply,
# add), on the vector units. Estimate: no kernel in kernels/, no measurement on file.
ENTROPY_FLOPS_PER_LOGIT = 4


def kv_heads_gpu(model: ModelSpec, tp: int) -> float:
    """KV heads one GPU holds (ceil(kv_heads / tp); 1 for an MLA latent)."""
    return max(1, model.num_kv_heads) * model.kv_share(tp)


def h2o_accumulate_bytes_per_token_layer(
    model: ModelSpec, fmt: KVFormat, tp: int, mix: FormatMix | None = None
) -> float:
    """Bytes per attended token of one layer's `h2o_accumulate`: the token's K re-read in the
    cache's format (half its KV bytes) and its fp32 score per KV head read and written."""
    return kv_bytes_per_token_layer_gpu(model, fmt, tp, mix) / 2 + 2 * SCORE_BYTES * kv_heads_gpu(model, tp)


def h2o_select_bytes_per_token_layer(model: ModelSpec, tp: int) -> float:
    """Bytes per scored token of one layer's `h2o_select` (its fp32 scores read, summed over heads)."""
    return SCORE_BYTES * kv_heads_gpu(model, tp)


def compact_bytes_per_token_layer(
    model: ModelSpec, fmt: KVFormat, tp: int, mix: FormatMix | None = None
) -> float:
    """Bytes per moved token of one layer's `compact_kv`: its K and V read and written."""
    return 2 * kv_bytes_per_token_layer_gpu(model, fmt, tp, mix)


def quant_write_bytes_per_token_layer(model: ModelSpec, fmt: KVFormat, tp: int) -> float:
    """Bytes per new token of one layer's `kv_write` in `fmt`: its bf16 K and V read, the cache's
    format written (the per-layer part of `quant_write_work_per_token`, lossless formats too)."""
    return kv_bytes_per_token_layer_gpu(model, BF16, tp) + kv_bytes_per_token_layer_gpu(model, fmt, tp)


def step_rest_bytes_per_token(model: ModelSpec, tp: int, part: str) -> float:
    """Bytes one GPU moves per token (per sampled row for ``sample``) in one part of a step's work
    besides GEMMs and attention (the profile's ``step_rest``), at bf16 activations (`ACT_BYTES`):
    ``layer``, one layer's two RMSNorms (hidden read and written each), the rotary on Q and K (read
    and written) and V's copy, the two residual adds (two read, one written) and SiLU-and-mul (gate and
    up read, one written); ``embed``, the embedding row read and written and the rotary tables (head
    dim); ``sample``, the final norm of the row and its logits read for the pick. A work measure for
    the rate (the time is measured), so that another shape is priced by the same arithmetic."""
    sh = TPShapes.of(model, tp)
    h, inter = model.hidden_size, sh.gemm_nk["down"][1]
    if part == "layer":
        elements = 2 * 2 * h + 2 * (sh.heads + sh.kv_heads) * sh.head_dim + 2 * sh.kv_heads * sh.head_dim
        elements += 2 * 3 * h + 3 * inter
    elif part == "embed":
        elements = 2 * h + sh.head_dim
    elif part == "sample":
        elements = 2 * h + sh.gemm_nk["lm_head"][0]
    else:
        raise ValueError(part)
    return float(elements * ACT_BYTES)


def attn_flops_per_pair_layer(model: ModelSpec, tp: int) -> int:
    """Attention FLOPs per (query, key) pair per layer on one GPU (prefill; MHA/GQA decode too)."""
    m = model
    heads = TPShapes.of(m, tp).heads
    if m.attention is Attention.MLA:
        return 2 * heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
    return 2 * heads * (m.head_dim + m.head_dim)


def decode_attn_flops_per_pair_layer(model: ModelSpec, tp: int) -> int:
    """Decode attention FLOPs per (query, key) pair per layer on one GPU: MLA runs absorbed."""
    m = model
    if m.attention is Attention.MLA:
        return 2 * TPShapes.of(m, tp).heads * (2 * m.kv_lora_rank + m.qk_rope_head_dim)
    return attn_flops_per_pair_layer(m, tp)


@overload
def gemm_flops(m: float, n: float, k: float) -> float: ...
@overload
def gemm_flops(m: np.ndarray, n: Size, k: Size) -> np.ndarray: ...
def gemm_flops(m: Size, n: Size, k: Size) -> Size:
    """FLOPs of [m, k] x [k, n] (numpy arrays broadcast)."""
    return 2.0 * m * n * k


def gemm_bytes(m: int, n: int, k: int, *, operand_bytes: int = 2, out_bytes: int = 2) -> float:
    """Bytes a [m, k] x [k, n] GEMM reads and writes: both operands (bf16 unless told) and the
    result (bf16)."""
    return float(operand_bytes * (m * k + k * n) + out_bytes * m * n)


def allreduce_calls(model: ModelSpec, tp: int) -> int:
    """All-reduces per step: two per layer under tensor parallelism, none without."""
    return 2 * model.num_layers if tp > 1 else 0


def allreduce_bytes_per_token(model: ModelSpec, tp: int) -> float:
    """Bytes per token that one GPU sends per all-reduce (ring: 2 (tp - 1) / tp of the hidden)."""
    return ACT_BYTES * model.hidden_size * 2 * (tp - 1) / tp if tp > 1 else 0.0


@dataclass(frozen=True)
class ModelWork:
    """The per-GPU work constants of one model at one TP degree and KV format (all layers unless the
    name says ``_layer``); the methods give the work of a step's parts."""

    model: ModelSpec
    tp: int
    kv_bytes_per_token: float
    kv_bytes_per_token_layer: float
    kv_bytes_per_token_bf16: float  # the same cache in bf16 (format speed-ups are relative to it)
    kv_heads: int  # KV heads on one GPU (ceil(kv_heads / tp); 1 for MLA's latent)
    attn_flops_per_pair: int  # all layers
    decode_attn_flops_per_pair: int  # all layers; MLA absorbed
    body_params: float  # GEMM parameters per token, LM head excluded, per GPU
    lm_head_params: float  # per sampled row, per GPU
    dense_weight_bytes: float  # streamed once per step whatever the batch
    moe_expert_bytes: float  # all routed experts, per GPU; a step reads the share it touches
    allreduce_calls: int
    allreduce_bytes_per_token: float
    mla_upproj_flops_per_token: float = 0.0  # MLA: up-projecting one cached latent, all layers
    quant_write_bytes_per_token: float = 0.0  # quantize-on-write, lossy parts only
    quant_write_flops_per_token: float = 0.0
    a2a_calls: int = 0  # EP dispatches and combines per step (2 per MoE layer under EP)
    a2a_bytes_per_token: float = 0.0  # bytes one GPU sends per call, per token of the replica's step

    @staticmethod
    def of(model: ModelSpec, tp: int, fmt: KVFormat, mix: FormatMix | None = None) -> ModelWork:
        m = model
        lm_head = m.vocab_size * m.hidden_size
        bpp = m.weight_bytes_per_param
        moe_expert_bytes = 0.0
        if m.is_moe:
            moe_layers = m.num_layers - m.first_dense_layers
            expert_params = 3 * m.hidden_size * m.moe_intermediate_size
            moe_expert_bytes = moe_layers * m.num_experts * expert_params * bpp / tp
        # The input embedding is a lookup of a few rows, not streamed; a tied one is read as LM head.
        embedding = 0 if m.tie_embeddings else m.vocab_size * m.hidden_size * bpp / tp
        qbytes, qflops = quant_write_work_per_token(m, fmt, tp, mix)
        upproj = 0.0
        if m.attention is Attention.MLA:
            heads = TPShapes.of(m, tp).heads
            upproj = 2.0 * m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim) * m.num_layers
        return ModelWork(
            model=m,
            tp=tp,
            kv_bytes_per_token=kv_bytes_per_token_gpu(m, fmt, tp, mix),
            kv_bytes_per_token_layer=kv_bytes_per_token_layer_gpu(m, fmt, tp, mix),
            kv_bytes_per_token_bf16=kv_bytes_per_token_gpu(m, BF16, tp),
            kv_heads=1 if m.attention is Attention.MLA else math.ceil(m.num_kv_heads / tp),
            attn_flops_per_pair=attn_flops_per_pair_layer(m, tp) * m.num_layers,
            decode_attn_flops_per_pair=decode_attn_flops_per_pair_layer(m, tp) * m.num_layers,
            body_params=(m.matmul_params_active() - lm_head) / tp,
            lm_head_params=lm_head / tp,
            dense_weight_bytes=m.weight_bytes / tp - moe_expert_bytes - embedding,
            moe_expert_bytes=moe_expert_bytes,
            allreduce_calls=allreduce_calls(m, tp),
            allreduce_bytes_per_token=allreduce_bytes_per_token(m, tp),
            mla_upproj_flops_per_token=upproj,
            quant_write_bytes_per_token=qbytes,
            quant_write_flops_per_token=qflops,
        )

    def with_layout(self, layout: ParallelLayout) -> ModelWork:
        """This work under a MoE layout (see the module docstring): ``tp`` is the replica's GPUs."""
        m, tp = self.model, self.tp
        ep = layout.expert_parallel
        moe_layers = m.num_layers - m.first_dense_layers if m.is_moe else 0
        width = 3 * m.hidden_size * m.moe_intermediate_size  # one expert's gate, up, down
        routed_active = moe_layers * m.experts_per_token * width
        skew = layout.expert_imbalance if ep > 1 else 1.0  # TP'd experts split every token evenly
        lm_head = m.vocab_size * m.hidden_size
        body = (m.matmul_params_active() - lm_head - routed_active) / tp + routed_active * skew / tp
        bpp = m.weight_bytes_per_param
        moe_bytes = WeightParts.of(m).routed * bpp / (ep if ep > 1 else tp)
        embedding = 0 if m.tie_embeddings else lm_head * bpp / tp
        kv = kv_share(m, tp, layout) / m.kv_share(tp)  # 1 under attention TP
        tp_attention = layout.attention is AttentionParallel.TP
        # Dense layers' MLPs (all of a dense model's layers) and, at EP 1, the experts' need one.
        split_mlps = (m.num_layers - moe_layers) + (moe_layers if ep == 1 else 0)
        calls = ((m.num_layers if tp_attention else 0) + split_mlps) if tp > 1 else 0
        a2a = remote_ranks_per_token(m, ep) * m.hidden_size * ACT_BYTES / tp
        return replace(
            self,
            kv_bytes_per_token=self.kv_bytes_per_token * kv,
            kv_bytes_per_token_layer=self.kv_bytes_per_token_layer * kv,
            kv_bytes_per_token_bf16=self.kv_bytes_per_token_bf16 * kv,
            body_params=body,
            dense_weight_bytes=weight_bytes_per_gpu(m, tp, layout) - moe_bytes - embedding,
            moe_expert_bytes=moe_bytes,
            allreduce_calls=calls,
            quant_write_bytes_per_token=self.quant_write_bytes_per_token * kv,
            quant_write_flops_per_token=self.quant_write_flops_per_token * kv,
            a2a_calls=2 * moe_layers if ep > 1 else 0,
            a2a_bytes_per_token=a2a,
        )

    def gemm_flops(self, num_tokens: int, num_sampling: int) -> float:
        """GEMM FLOPs of a step: the body per token, the LM head per sampled row."""
        return 2.0 * (self.body_params * num_tokens + self.lm_head_params * num_sampling)

    def weight_bytes(self, num_tokens: int) -> float:
        """Weight bytes a step streams: dense weights, plus the routed experts its tokens touch
        (each token picks experts_per_token of num_experts, independently)."""
        if not self.model.is_moe:
            return self.dense_weight_bytes
        m = self.model
        touched = 1.0 - (1.0 - m.experts_per_token / m.num_experts) ** num_tokens
        return self.dense_weight_bytes + self.moe_expert_bytes * touched

    def prefill_attn_flops(self, n: int, ctx: int) -> float:
        """Attention FLOPs of a chunk of ``n`` new tokens over ``ctx`` cached ones, all layers
        (sliding-window layers over their window: `attended_pairs`)."""
        if self.model.sliding_window:
            return self.attn_flops_per_pair * attended_pairs(self.model, n, ctx)
        return self.attn_flops_per_pair * causal_pairs(n, ctx)

    def mla_upproj_flops(self, ctx: int) -> float:
        """FLOPs of up-projecting a prefill chunk's ``ctx`` cached latents (0 unless MLA)."""
        return self.mla_upproj_flops_per_token * ctx

    def prefill_kv_bytes(self, n: int, ctx: int) -> float:
        """KV bytes a prefill chunk touches: its prefix read (a windowed layer's window only:
        `attended_prefix`) and its own tokens, all layers."""
        if self.model.sliding_window:
            return (attended_prefix(self.model, ctx) + n) * self.kv_bytes_per_token
        return (ctx + n) * self.kv_bytes_per_token

    def h2o_score_work_per_token(self) -> tuple[float, float]:
        """(bytes, FLOPs) per attended token of one decode step's H2O score accumulation and
        selection (``kernels/h2o.py``: `h2o_accumulate` re-reads the token's K, in the cache's format,
        and adds its softmax probability to an fp32 score per KV head; the selection reads the
        scores), all layers, one GPU: half the KV bytes, 12 bytes of scores per KV head and layer, and
        the QK^T half of the decode attention FLOPs."""
        m = self.model
        heads = m.kv_layers * max(1, m.num_kv_heads) * m.kv_share(self.tp)
        return self.kv_bytes_per_token / 2 + 12 * heads, self.decode_attn_flops_per_pair / 2

    def entropy_stat_work_per_token(self) -> tuple[float, float]:
        """(bytes, FLOPs) per attended token of one decode step's attention-entropy statistics and
        selection, all layers, one GPU. Estimate (no kernel in ``kernels/``): the statistic is
        computed inside decode attention from the logits it already holds and the softmax's running
        max and sum (the documents' "only statistics before the softmax", 000 section 4.2), so,
        unlike `h2o_score_work_per_token`, no K re-read and no QK^T recomputed: the same 12 bytes of
        fp32 statistics per KV head and layer (read, written, read by the selection), and
        `ENTROPY_FLOPS_PER_LOGIT` vector FLOPs per query head and layer."""
        m = self.model
        heads = m.kv_layers * max(1, m.num_kv_heads) * m.kv_share(self.tp)
        return 12 * heads, float(self.entropy_flops_per_pair)

    @property
    def entropy_flops_per_pair(self) -> int:
        """Entropy statistics' vector FLOPs per (query, key) pair, all layers, one GPU."""
        return ENTROPY_FLOPS_PER_LOGIT * TPShapes.of(self.model, self.tp).heads * self.model.num_layers

    def trim_work(self, select_tokens: int, moved_tokens: int, table_entries: int) -> tuple[float, float]:
        """(bytes, FLOPs) of trims: the selected tokens' fp32 scores read and ranked (a sort,
        about log2(n) compares per score), the moved tokens' KV read and written, int32 block-table
        entries written; all layers, one GPU."""
        m = self.model
        heads = m.kv_layers * max(1, m.num_kv_heads) * m.kv_share(self.tp)
        nbytes = 4 * heads * select_tokens + 2 * moved_tokens * self.kv_bytes_per_token + 4 * table_entries
        flops = heads * select_tokens * max(1.0, np.log2(max(select_tokens, 2)))
        return nbytes, float(flops)

    def allreduce_bytes(self, num_tokens: int) -> float:
        """Bytes one GPU sends over a step's all-reduces."""
        return self.allreduce_calls * num_tokens * self.allreduce_bytes_per_token

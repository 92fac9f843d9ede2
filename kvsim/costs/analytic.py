"""The analytic cost model: how long a scheduler step and a transfer take, from first principles.

The engine asks a `kvsim.costs.base.CostModel`; `AnalyticCostModel` is a roofline: each part of a
step takes a launch time plus max(FLOPs / (peak x compute efficiency), bytes / (HBM bandwidth x
memory efficiency)), and the parts run one after another: GEMMs (weights read once per step; MoE
layers read only the experts the batch touches), prefill attention, decode attention,
tensor-parallel all-reduces, and a fixed per-step overhead. A measured profile (`kvsim calibrate`)
plugs in behind the same interface.

The efficiencies per op are the forms of `kvsim.costs.analytic_fit`: for GPUs with measured
kernel tables (NVIDIA aiconfigurator-core: h100-sxm, h200-sxm, a100-80gb, b200, l40s) fitted to
them (``kvsim/data/analytic_fit.json``, written by ``python -m calibrate.fit_analytic``; errors
before and after in docs/cost-model-accuracy.md): compute efficiency that rises with the token
count or chunk length, a launch time per kernel call, decode attention a time per sequence. Other
GPUs keep the published figures below. The model's ``name`` says which applies.

Transfers: latency + calls x per-call overhead + bytes / bandwidth over the topology's links
(`kvsim.spec.topology`).

Left out: CUDA-graph padding of batch sizes, sampling cost (pipeline and context parallelism are
`kvsim.costs.pipeline` and `kvsim.costs.context_parallel`, built on this model); decode and
prefill attention are priced as separate kernel calls. Speculative decoding's verify row: GEMMs
and LM head over its k+1 tokens, its attention as decode attention's bytes or k+1 queries' FLOPs at
the decode rates (estimate: the kernel reads the cache once at such query lengths; no measurement
on file), launched with the step's prefill call; its draft passes are `kvsim.costs.draft`.

Published efficiencies (`kvsim.costs.analytic_fit.PUBLISHED`) and their sources
(../shared/REFERENCE.md unless noted):
- decode attention at bf16: 80% of HBM peak (a good Triton decode kernel; FlashInfer 85-93%).
- weight streaming: 80% of HBM peak (affine fits of decode latency use BW_eff 77-85%).
- prefill attention: 65% of dense peak (FlashInfer about 56%, FA3 about 75% on H100).
- GEMMs: 70% of dense peak. Estimate: no measurement on file; the calibrator replaces it.

On every GPU (not fitted: the tables hold no such data):
- decode attention speed-up over bf16 by KV format, at long context: fp8 1.6x (vLLM FA3 1.5-1.75x
  on H100; GPUs with tables use their fitted fp8 speed-up and an fp8 prefill-attention factor,
  ``fp8_kv`` in the fit file: 1.26x and 1.18x slower prefill on H100), int8 1.6x (estimate: same bytes as fp8), int4 and kvquant4's 4-bit codes 1.7x (KVQuant's kernel
  about 1.7x over fp16; a fused 4-bit Triton kernel reached only 0.93-1.05x in SGLang).
- kvquant4's outlier path, on top of its codes' 1.7x (estimate, `kvsim.costs.work`): its outliers'
  bytes (fp16 value + int16 index) at the decode efficiency, and their merge into the dequantized
  vectors, 2 vector operations per element per outlier (``kernels/kv_cache.py``), at the
  quantize-on-write vector rate, not overlapped with the reads; a prefill chunk merges its cached
  prefix's once; quantize-on-write adds the outlier selection, 9 operations per element per outlier
  (``kernels/kv_write.py``). At 1% (2 outliers of 128) it adds 4.4% to the default scenario's
  TPOT at 8x load on H100 (5.4% at 64 sequences of 2K tokens, 0.1% at batch 1): the design documents
  put the outlier dequantize-requantize path at 3-5% of each decode step (000, section 3.3).
  KVQuant's "up to ~1.7x over fp16" (Hooper et al. 2024, arXiv 2401.18079, abstract) is its 4-bit
  kernel with 1% sparse outliers, the path included: charging the path on top is conservative
  (a kvsim assumption). outlier_fraction 0 prices decode attention exactly as int4.
- quantize-on-write of new tokens (lossy formats): 50% of HBM peak for its bytes (estimate: a
  short elementwise kernel over a few MB per step, no measurement on file), its vector operations
  at 1/15 of the dense BF16 tensor rate (H100 SXM datasheet: 67 TFLOP/s FP32 vs 989 TFLOP/s BF16).
- mixed formats per head: each part's decode attention at its own speed-up, weighted by its share
  of the cached vectors.
- a format switch (``kv.format_switch``): a switched sequence's decode attention at the second
  format's speed-up over its real tokens (b1 / b2 per first-format slot), its new tokens'
  quantize-on-write in the second format, and the crossing's re-quantization (every resident token
  read in the first format, written in the second, dequantize plus quantize vector operations) at
  the quantize-on-write rates, priced with the trims.
- token eviction (`kvsim.core.eviction`): H2O's per-step score accumulation and selection priced
  per attended token like decode attention (its bytes at the decode efficiency, its QK^T FLOPs at
  the prefill efficiency), a prompt's scores as the QK^T half of its prefill attention; a trim's
  top-k, compaction and block-table writes at the quantize-on-write rates, plus 3 kernel launches
  of 5 us each (estimate, no measurement on file; `kernels/h2o.py` has the kernels to measure).
  Attention entropy's per-step statistics (estimate: no kernel, no measurement on file): computed in
  decode attention from the logits it already holds, so no K re-read and no QK^T recomputed, only
  H2O's 12 bytes of fp32 statistics per KV head and layer at the decode efficiency and 4 vector
  FLOPs per logit (`kvsim.costs.work.ENTROPY_FLOPS_PER_LOGIT`) at the quantize-on-write vector rate;
  a prompt's statistics as those 4 FLOPs per pair of its prefill attention at the same rate; a
  trim's selection as H2O's top-k.
- block size (``kv.block_size``): paged decode reads 3.2 tokens more per block and a partial last
  block's (bs - 1) / 2 slots per sequence, a prefill's prefix reads the per-block term, each only
  as its difference from block size 16, at which the rates above are taken to be measured
  (`kvsim.costs.work.block_extra_tokens`; vLLM paper, sections 7.1-7.2; an estimate).
- per-step overhead 1 ms (estimate of scheduling + input preparation in a vLLM-V1-style engine;
  no per-GPU measurement on file. Published figures span the choice of engine loop: vLLM V1 with
  synchronous scheduling left a 5-6 ms gap between decode steps at batch 256 (Llama-2-7B,
  vllm-project/vllm#10634), async scheduling 150-170 us with CUDA graphs (vllm#11133); vLLM
  V0 4 ms of GPU bubble per decode step (vllm#6854); SGLang's overlap scheduler hides it behind
  the GPU's work. The imported-table profiles take the same 1 ms).
- a prefill chunk over a cached prefix on a GPU with tables (which hold prefix 0 only): the
  prefix's pairs at the long-chunk efficiency, the ramp on the chunk's own pairs; each run warns
  the share of busy time so priced (`prefix_extrapolated_s`).
- all-reduce latency 10 us per call (estimate for NCCL small messages over NVLink).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvsim.core.eviction import Eviction, EvictionKind, EvictionWork
from kvsim.costs.analytic_fit import PUBLISHED, PUBLISHED_LABEL, OpFits, fit_for, smooth_max
from kvsim.costs.base import StepCostModel, transfer_time
from kvsim.costs.work import (
    REFERENCE_BLOCK_SIZE,
    ModelWork,
    attended_prefix,
    block_extra_tokens,
    block_gather_factor,
    decode_tokens_read,
    format_parts,
    kv_bytes_per_token_gpu,
    outlier_read_work_per_token,
    quant_write_work_per_token,
    requant_work_per_token,
)
from kvsim.spec.formats import FormatMix, FormatSwitch, KVFormat
from kvsim.spec.hardware import GPUSpec
from kvsim.spec.models import ModelSpec
from kvsim.spec.parallel import ParallelLayout
from kvsim.spec.topology import Link, Topology


@dataclass(frozen=True)
class Efficiencies:
    """What the kernel tables do not measure (the per-op efficiencies are `OpFits`)."""

    kv_write_bw: float = 0.50  # quantize-on-write and trims, of HBM bandwidth (estimate)
    vector_flops_fraction: float = 1 / 15  # FP32 vector rate / dense BF16 (H100 SXM datasheet)
    step_overhead_s: float = 1e-3
    allreduce_latency_s: float = 10e-6
    format_decode_speedup: dict[str, float] = field(
        default_factory=lambda: {
            "fp16": 1.0,
            "bf16": 1.0,
            "fp8_e4m3": 1.6,
            "int8": 1.6,
            "int4": 1.7,
            "kvquant4": 1.7,
        }
    )


TRIM_LAUNCHES = 3  # top-k, compaction, block-table update
TRIM_LAUNCH_S = 5e-6  # estimate of one small kernel's launch and tail


class AnalyticCostModel(StepCostModel):
    """The roofline with each op's efficiency a function of batch shape (`kvsim.costs.analytic_fit`):
    fitted to measured kernel tables for the GPUs in ``kvsim/data/analytic_fit.json``, the published
    peaks times one efficiency per op otherwise (or when ``ops`` is given). ``name`` says which."""

    name = PUBLISHED_LABEL

    def __init__(
        self,
        model: ModelSpec,
        gpu: GPUSpec,
        tp: int,
        fmt: KVFormat,
        topology: Topology,
        eff: Efficiencies | None = None,
        ops: OpFits | None = None,
        mix: FormatMix | None = None,
        eviction: Eviction | None = None,
        switch: FormatSwitch | None = None,
        block_size: int = REFERENCE_BLOCK_SIZE,
        layout: ParallelLayout | None = None,
    ) -> None:
        self.model, self.gpu, self.tp, self.fmt, self.topology = model, gpu, tp, fmt, topology
        self.layout = layout
        self.block_size = block_size
        self.switch = switch
        self.mix = mix
        self.eff = eff or Efficiencies()
        self.fit = fit_for(gpu) if ops is None else None
        self.ops = ops or (self.fit.ops if self.fit else PUBLISHED)
        self.name = self.fit.label if self.fit else PUBLISHED_LABEL
        self.overhead_s = self.eff.step_overhead_s
        self._init_formats(fmt, mix)
        m = model
        fp8_weights = m.weight_dtype in ("fp8", "float8_e4m3fn") and gpu.fp8_flops > 0
        self.gemm_peak = gpu.fp8_flops if fp8_weights else gpu.bf16_flops
        self.bw = gpu.hbm_bw_bytes_per_s
        w = ModelWork.of(m, tp, fmt, mix)
        self.work = w = w if layout is None else w.with_layout(layout)
        g, d, p = self.ops.gemm, self.ops.decode_attn, self.ops.prefill_attn
        layers = m.num_layers
        # Launch times: per layer four GEMMs (qkv, o, gate_up, down; MoE layers counted alike), the
        # LM head once, one decode-attention call and one prefill-attention call for all of a step's
        # chunks (a varlen kernel; the tables' batched prefill rows pay one launch per call).
        self.gemm_launch_s = (4 * layers + 1) * g.t0_s
        self.decode_launch_s = layers * d.t0_s
        self.decode_per_seq_s = layers * w.kv_heads * d.t_item_s
        self.prefill_launch_s = layers * p.t0_s
        # Decode attention: bf16-equivalent bytes at the bf16 efficiency, divided by the format's
        # measured speed-up (so fp8 is not assumed to gain the full 2x its bytes suggest); a mix of
        # formats runs each part at its own speed-up.
        self.decode_attn_s_per_token = sum(
            share * (w.kv_bytes_per_token_bf16 / (self.bw * d.e_max) / self.speedup.get(f.kind.value, 1.0))
            for f, share in format_parts(fmt, mix)
        )
        # kvquant4's outlier path on top of its 4-bit codes' speed-up (int4's): the outliers' bytes
        # at the decode efficiency, their merge into the vectors at the vector rate, not overlapped.
        self.vector_flops = gpu.bf16_flops * self.eff.vector_flops_fraction
        self.outlier_s_per_token = 0.0  # merge seconds per cached token read (0 without outliers)
        for f, share in format_parts(fmt, mix):
            ob, _ = outlier_read_work_per_token(m, f, tp)
            if ob:
                self.decode_attn_s_per_token += share * ob / (self.bw * d.e_max)
                self.outlier_s_per_token += share * self.outlier_merge_s(f)
        self.decode_attn_flops_s_per_token = w.decode_attn_flops_per_pair / (gpu.bf16_flops * d.e_flops)
        self.eviction = eviction
        self._init_eviction(eviction)
        e = self.eff
        self.write_s_per_token = max(
            w.quant_write_bytes_per_token / (self.bw * e.kv_write_bw),
            w.quant_write_flops_per_token / (gpu.bf16_flops * e.vector_flops_fraction),
        )
        self._init_switch(switch)
        self.gather = block_gather_factor(block_size)  # a prefill's paged KV reads, per token
        # All-reduces run over the GPUs' peer link: NVLink, or PCIe peer copies where there is none.
        self.link_bw = topology.nvlink.bw_bytes_per_s

    def _init_formats(self, fmt: KVFormat, mix: FormatMix | None) -> None:
        """fp8 KV: the fitted speed-up and prefill factor where the GPU's tables measured them."""
        self.speedup = dict(self.eff.format_decode_speedup)
        fp8_prefill = 1.0
        if self.fit is not None and self.fit.fp8_decode_speedup is not None:
            self.speedup["fp8_e4m3"] = self.fit.fp8_decode_speedup
        if self.fit is not None and self.fit.fp8_prefill_factor is not None:
            fp8_prefill = self.fit.fp8_prefill_factor
        # Prefill attention's time factor: each part of the cache's formats at its share.
        self.prefill_format_factor = sum(
            share * (fp8_prefill if f.kind.value == "fp8_e4m3" else 1.0)
            for f, share in format_parts(fmt, mix)
        )

    def _init_eviction(self, eviction: Eviction | None) -> None:
        """Token eviction's per-token work: H2O's score accumulation or the entropy statistics, plus
        the selection, per decode token and for the prompt."""
        w, d, p, gpu = self.work, self.ops.decode_attn, self.ops.prefill_attn, self.gpu
        self.score_s_per_token = 0.0  # H2O score accumulation (or entropy statistics) + selection
        self.prefill_score = 0.0  # share of prefill attention added for the prompt's H2O scores
        self.prefill_entropy_s_per_pair = 0.0  # entropy: the prompt's statistics per attended pair
        if eviction is not None and eviction.kind is EvictionKind.ENTROPY:
            sb, sf = w.entropy_stat_work_per_token()
            vector = gpu.bf16_flops * self.eff.vector_flops_fraction
            self.score_s_per_token = max(sb / (self.bw * d.e_max), sf / vector)
            self.prefill_entropy_s_per_pair = w.entropy_flops_per_pair / vector
        elif eviction is not None and eviction.scores():
            sb, sf = w.h2o_score_work_per_token()
            self.score_s_per_token = max(sb / (self.bw * d.e_max), sf / (gpu.bf16_flops * p.e_max))
            self.prefill_score = 0.5

    def _init_switch(self, switch: FormatSwitch | None) -> None:
        """A format switch: a switched sequence's decode reads its tokens at the second format's
        speed-up (per first-format token slot: times b1 / b2 tokens), writes its new tokens in it,
        and its crossing reads every token in the first format and writes it in the second."""
        self.switch_s_per_slot = 0.0
        self.switch_outlier_s_per_slot = 0.0
        self.switch_flops_s_per_slot = 0.0
        self.switch_write_s_per_token = 0.0
        self.requant_bytes_per_token = 0.0
        self.requant_flops_per_token = 0.0
        if switch is None:
            return
        m, w, tp, gpu = self.model, self.work, self.tp, self.gpu
        f2 = switch.format
        slots = w.kv_bytes_per_token / kv_bytes_per_token_gpu(m, f2, tp)  # tokens per slot: b1 / b2
        speed = self.speedup.get(f2.kind.value, 1.0)
        e_max = self.ops.decode_attn.e_max
        self.switch_s_per_slot = slots * w.kv_bytes_per_token_bf16 / (self.bw * e_max) / speed
        ob, _ = outlier_read_work_per_token(m, f2, tp)
        if ob:  # kvquant4 as the second format: its outlier path, as for the first
            self.switch_s_per_slot += slots * ob / (self.bw * e_max)
            self.switch_outlier_s_per_slot = slots * self.outlier_merge_s(f2)
        self.switch_flops_s_per_slot = slots * self.decode_attn_flops_s_per_token
        qb, qf = quant_write_work_per_token(m, f2, tp, None)
        self.switch_write_s_per_token = max(
            qb / (self.bw * self.eff.kv_write_bw),
            qf / (gpu.bf16_flops * self.eff.vector_flops_fraction),
        )
        self.requant_bytes_per_token, self.requant_flops_per_token = requant_work_per_token(
            m, self.fmt, f2, tp
        )

    def outlier_merge_s(self, fmt: KVFormat) -> float:
        """Seconds per cached token that attention spends merging kvquant4's outliers into the
        dequantized vectors of `fmt` (all of the cache in it; 0 without outliers), at the vector rate."""
        return outlier_read_work_per_token(self.model, fmt, self.tp)[1] / self.vector_flops

    # ---- parts ------------------------------------------------------------------------------------
    def _gemm_time(self, num_tokens: int, num_sampling: int) -> float:
        w, g = self.work, self.ops.gemm
        compute = w.gemm_flops(num_tokens, num_sampling) / (self.gemm_peak * g.e_max)
        memory = w.weight_bytes(num_tokens) / (self.bw * g.e_weight)
        return self.gemm_launch_s + float(smooth_max(compute, memory, g.q))

    def _comm_time(self, num_tokens: int) -> float:
        calls = self.work.allreduce_calls
        if not calls:
            return 0.0
        return calls * self.eff.allreduce_latency_s + self.work.allreduce_bytes(num_tokens) / self.link_bw

    def _write_time(self, num_tokens: int) -> float:
        return num_tokens * self.write_s_per_token

    def _switched_write_time(self, num_tokens: int) -> float:
        return num_tokens * self.switch_write_s_per_token

    def _switched_decode_attn_time(
        self, num_seqs: int, sum_ctx: np.ndarray, num_switched: int, switched_ctx: np.ndarray
    ) -> np.ndarray:
        # One kernel call for all: the unswitched tokens at the first format's speed, the switched
        # ones' slots at the second's (no H2O: eviction and a switch are refused together).
        tokens = decode_tokens_read(num_seqs, sum_ctx)
        sw = decode_tokens_read(num_switched, switched_ctx)
        rest = tokens - sw + block_extra_tokens(num_seqs, tokens, self.block_size)
        fixed = self.decode_launch_s + num_seqs * self.decode_per_seq_s
        out: np.ndarray = fixed + np.maximum(
            rest * self.decode_attn_s_per_token + sw * self.switch_s_per_slot,
            rest * self.decode_attn_flops_s_per_token + sw * self.switch_flops_s_per_slot,
        )
        if self.outlier_s_per_token or self.switch_outlier_s_per_slot:
            out = out + (rest * self.outlier_s_per_token + sw * self.switch_outlier_s_per_slot)
        return out

    def paged_tokens(self, num_seqs: int, tokens: np.ndarray) -> np.ndarray:
        """``tokens`` read by a paged decode of ``num_seqs`` sequences, plus the per-block and
        partial-block reads of this block size beyond the reference one (`block_extra_tokens`)."""
        if self.block_size == REFERENCE_BLOCK_SIZE:  # nothing beyond: tokens + 0.0, value for value
            return tokens
        out: np.ndarray = tokens + block_extra_tokens(num_seqs, tokens, self.block_size)
        return out

    def _decode_seconds(
        self, num_seqs: int, sum_ctx: float, num_switched: int, switched_ctx: float | None
    ) -> float:
        if num_switched and switched_ctx is not None:  # rare: the arrays' path
            return super()._decode_seconds(num_seqs, sum_ctx, num_switched, switched_ctx)
        # `_decode_attn_time`'s operations take a float as they take an array, float for float.
        return float(self._decode_attn_time(num_seqs, sum_ctx))  # type: ignore[arg-type]

    def _decode_attn_time(self, num_seqs: int, sum_ctx: np.ndarray) -> np.ndarray:
        tokens = self.paged_tokens(num_seqs, decode_tokens_read(num_seqs, sum_ctx))
        fixed = self.decode_launch_s + num_seqs * self.decode_per_seq_s
        # Attention at the larger of its bytes and FLOPs rates (tokens >= 0: float for float
        # max(tokens x a, tokens x b)), plus H2O's scores where it runs.
        per_token = max(self.decode_attn_s_per_token, self.decode_attn_flops_s_per_token)
        if self.score_s_per_token:
            out: np.ndarray = fixed + tokens * (per_token + self.score_s_per_token)
        else:
            out = fixed + tokens * per_token
        if self.outlier_s_per_token:  # kvquant4's outliers merged into the tokens it reads
            out = out + tokens * self.outlier_s_per_token
        return out

    def _verify_attn_time(self, n: int, ctx: int) -> float:
        # A verify row's n = k + 1 queries read the cache once, like a decode (at k + 1 <= 33 the
        # arithmetic intensity stays below the ridge point): decode attention's bytes, or its FLOPs
        # for n queries if larger, plus its per-sequence time. Estimate: the prefill fit's ramp
        # (n_half) is fitted to chunks of hundreds of tokens and would price 5 queries like 1,000.
        tokens = ctx + n + float(block_extra_tokens(1, ctx + n, self.block_size))
        t = self.decode_per_seq_s + max(
            tokens * self.decode_attn_s_per_token, n * tokens * self.decode_attn_flops_s_per_token
        )
        if self.outlier_s_per_token:
            t += tokens * self.outlier_s_per_token
        return t

    def decode_score_time(self, tokens: np.ndarray) -> np.ndarray:
        """H2O score accumulation (or attention-entropy statistics) and selection over ``tokens``
        attended tokens (0 without either)."""
        out: np.ndarray = tokens * self.score_s_per_token
        return out

    def prefill_score_time(self, n: int, ctx: int) -> float:
        """H2O scores of a prefill chunk: the QK^T half of its attention FLOPs (0 without H2O); the
        entropy statistics of its attended pairs."""
        if self.prefill_entropy_s_per_pair:
            w = self.work
            return self.prefill_entropy_s_per_pair * w.prefill_attn_flops(n, ctx) / w.attn_flops_per_pair
        if not self.prefill_score:
            return 0.0
        flops = self.prefill_score * self.work.prefill_attn_flops(n, ctx)
        return flops / (self.gpu.bf16_flops * self.ops.prefill_attn.e_max)

    def eviction_time(self, work: EvictionWork) -> float:
        nbytes, flops = self.work.trim_work(work.select_tokens, work.moved_tokens, work.table_entries)
        if work.requant_tokens:  # a format switch's crossings
            nbytes += work.requant_tokens * self.requant_bytes_per_token
            flops += work.requant_tokens * self.requant_flops_per_token
        e = self.eff
        return TRIM_LAUNCHES * TRIM_LAUNCH_S + max(
            nbytes / (self.bw * e.kv_write_bw), flops / (self.gpu.bf16_flops * e.vector_flops_fraction)
        )

    def trim_op_time(self, select_tokens: int, moved_tokens: int, table_entries: int) -> float:
        """One of a trim's kernels alone (a launch plus its work at the rates of `eviction_time`):
        what a measured profile adds for the trim ops it did not measure."""
        nbytes, flops = self.work.trim_work(select_tokens, moved_tokens, table_entries)
        e = self.eff
        return TRIM_LAUNCH_S + max(
            nbytes / (self.bw * e.kv_write_bw), flops / (self.gpu.bf16_flops * e.vector_flops_fraction)
        )

    def _prefill_attn_time(self, n: int, ctx: int) -> float:
        p = self.ops.prefill_attn
        flops = self.work.prefill_attn_flops(n, ctx)
        if self.work.mla_upproj_flops_per_token and ctx:
            flops += self.work.mla_upproj_flops(ctx)  # the cached prefix's latents up-projected
        # The efficiency ramp of short chunks on the chunk's own causal pairs (`PrefillAttnEff`):
        # the tables measure prefix 0 only, where the two are the same.
        ramp = (self.work.prefill_attn_flops(n, 0) if ctx else flops) * (p.n_half / n)
        t = self.prefill_format_factor * float(
            max(
                (flops + ramp) / (self.gpu.bf16_flops * p.e_max),
                self.work.prefill_kv_bytes(n, ctx) * self.gather / (self.bw * p.e_kv),
            )
        )
        if self.prefill_score:
            t += self.prefill_score_time(n, ctx)
        if self.outlier_s_per_token and ctx:  # the cached prefix's outliers, merged once per chunk
            t += attended_prefix(self.model, ctx) * self.outlier_s_per_token
        return t

    prefix_rule = (
        "the prefix's pairs at the fitted long-chunk efficiency, the short-chunk ramp on the chunk's "
        "own pairs only"
    )

    def prefix_extrapolated_s(self, n: int, ctx: int) -> float:
        """With fitted tables (prefix 0 only): what a cached prefix adds to the chunk's attention."""
        if self.fit is None or ctx <= 0:
            return 0.0
        return self._prefill_attn_time(n, ctx) - self._prefill_attn_time(n, 0)

    # ---- interface --------------------------------------------------------------------------------
    def transfer_time(self, nbytes: float, link: Link, num_calls: int = 1) -> float:
        return transfer_time(nbytes, link, num_calls)

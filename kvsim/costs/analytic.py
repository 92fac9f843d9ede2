"""The one cost seam: how long a scheduler step and a transfer take.

`CostModel` is what the engine asks. `AnalyticCostModel` is a roofline: each part of a step takes
max(FLOPs / (peak x compute efficiency), bytes / (HBM bandwidth x memory efficiency)), and the
parts run one after another: GEMMs (weights read once per step; MoE layers read only the experts
the batch touches), prefill attention, decode attention, tensor-parallel all-reduces, and a fixed
per-step overhead. A measured profile (`kvsim calibrate`) plugs in behind the same interface.

Left out: CUDA-graph padding of batch sizes, kernel-launch gaps between layers beyond the fixed
overhead, pipeline parallelism, sampling cost, speculative decoding.

Default efficiencies and their sources (../shared/REFERENCE.md unless noted):
- decode attention at bf16: 80% of HBM peak (a good Triton decode kernel; FlashInfer 85-93%).
- weight streaming: 80% of HBM peak (affine fits of decode latency use BW_eff 77-85%).
- prefill attention: 65% of dense peak (FlashInfer about 56%, FA3 about 75% on H100).
- GEMMs: 70% of dense peak. Estimate: no measurement on file; the calibrator replaces it.
- decode attention speed-up over bf16 by KV format, at long context: fp8 1.6x (vLLM FA3 1.5-1.75x
  on H100), int8 1.6x (estimate: same bytes as fp8), int4 and kvquant4 1.7x (KVQuant's kernel
  about 1.7x over fp16; a fused 4-bit Triton kernel reached only 0.93-1.05x in SGLang).
- per-step overhead 1 ms (estimate of scheduling + input preparation in a vLLM-V1-style engine).
- all-reduce latency 10 us per call (estimate for NCCL small messages over NVLink).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from kvsim.costs.base import StepCostModel
from kvsim.spec.formats import FormatKind, KVFormat
from kvsim.spec.hardware import GPUSpec
from kvsim.spec.models import Attention, ModelSpec


@dataclass(frozen=True)
class Efficiencies:
    decode_attn_bw: float = 0.80
    weight_bw: float = 0.80
    prefill_attn_compute: float = 0.65
    gemm_compute: float = 0.70
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


class AnalyticCostModel(StepCostModel):
    name = "analytic"

    def __init__(
        self, model: ModelSpec, gpu: GPUSpec, tp: int, fmt: KVFormat, eff: Efficiencies | None = None
    ):
        self.model, self.gpu, self.tp, self.fmt = model, gpu, tp, fmt
        self.eff = eff or Efficiencies()
        self.overhead_s = self.eff.step_overhead_s
        e = self.eff
        m = model
        fp8_weights = m.weight_dtype in ("fp8", "float8_e4m3fn") and gpu.fp8_flops > 0
        self.gemm_peak = (gpu.fp8_flops if fp8_weights else gpu.bf16_flops) * e.gemm_compute
        self.bw = gpu.hbm_bw_bytes_per_s
        # Per-GPU share of the attention heads / KV under tensor parallelism.
        if m.attention is Attention.MLA:
            kv_share = 1.0  # the latent is replicated on every TP rank
        else:
            kv_share = math.ceil(m.num_kv_heads / tp) / m.num_kv_heads
        self.kv_bytes_per_token_gpu = m.kv_bytes_per_token(fmt) * kv_share
        qk_dim = (m.qk_nope_head_dim + m.qk_rope_head_dim) if m.attention is Attention.MLA else m.head_dim
        v_dim = m.v_head_dim if m.attention is Attention.MLA else m.head_dim
        heads_gpu = math.ceil(m.num_heads / tp)
        # FLOPs per (query token, key token) pair across layers: QK^T and PV, 2 FLOPs per MAC.
        self.attn_flops_per_pair = 2 * heads_gpu * (qk_dim + v_dim) * m.num_layers
        # GEMM work: body parameters per token, LM head per sampled row.
        lm_head = m.vocab_size * m.hidden_size
        self.body_params_active = (m.matmul_params_active() - lm_head) / tp
        self.lm_head_params = lm_head / tp
        bpp = m.weight_bytes_per_param
        self.dense_weight_bytes = 0.0
        self.moe_expert_bytes = 0.0  # bytes of all routed experts, per GPU
        if m.is_moe:
            moe_layers = m.num_layers - m.first_dense_layers
            expert_params = 3 * m.hidden_size * m.moe_intermediate_size
            self.moe_expert_bytes = moe_layers * m.num_experts * expert_params * bpp / tp
        # The input embedding is a lookup of a few rows, not streamed; a tied one is read as LM head.
        embedding = 0 if m.tie_embeddings else m.vocab_size * m.hidden_size * bpp / tp
        self.dense_weight_bytes = m.weight_bytes / tp - self.moe_expert_bytes - embedding
        speedup = self.eff.format_decode_speedup.get(fmt.kind.value, 1.0)
        # Decode attention: bf16-equivalent bytes at the bf16 efficiency, divided by the format's
        # measured speed-up (so fp8 is not assumed to gain the full 2x its bytes suggest).
        bf16_bytes = m.kv_bytes_per_token(_BF16) * kv_share
        self.decode_attn_s_per_token = bf16_bytes / (self.bw * e.decode_attn_bw) / speedup
        decode_flops_per_pair = self.attn_flops_per_pair
        if m.attention is Attention.MLA:
            # Decode runs MLA absorbed (vLLM, FlashMLA): every head attends over the cached latent,
            # scores over kv_lora_rank + rope dims and values over kv_lora_rank dims.
            decode_flops_per_pair = 2 * heads_gpu * (2 * m.kv_lora_rank + m.qk_rope_head_dim) * m.num_layers
        self.decode_attn_flops_s_per_token = decode_flops_per_pair / (gpu.bf16_flops * e.prefill_attn_compute)
        # All-reduce: two per layer (attention output, MLP output), ring algorithm.
        self.ar_calls = 2 * m.num_layers if tp > 1 else 0
        self.ar_bytes_per_token = 2 * m.hidden_size * 2 * (tp - 1) / tp if tp > 1 else 0.0
        self.link_bw = gpu.nvlink_bytes_per_s or gpu.host_link_theoretical_bytes_per_s

    # ---- parts ------------------------------------------------------------------------------------
    def _weight_bytes(self, num_tokens: int) -> float:
        if not self.model.is_moe:
            return self.dense_weight_bytes
        m = self.model
        touched = 1.0 - (1.0 - m.experts_per_token / m.num_experts) ** num_tokens
        return self.dense_weight_bytes + self.moe_expert_bytes * touched

    def _gemm_time(self, num_tokens: int, num_sampling: int) -> float:
        flops = 2.0 * (self.body_params_active * num_tokens + self.lm_head_params * num_sampling)
        return max(flops / self.gemm_peak, self._weight_bytes(num_tokens) / (self.bw * self.eff.weight_bw))

    def _comm_time(self, num_tokens: int) -> float:
        if not self.ar_calls:
            return 0.0
        return (
            self.ar_calls * self.eff.allreduce_latency_s
            + self.ar_calls * num_tokens * self.ar_bytes_per_token / self.link_bw
        )

    def _decode_attn_time(self, num_seqs: int, sum_ctx: np.ndarray) -> np.ndarray:
        tokens = sum_ctx + num_seqs  # each reads its cache plus the new token
        return np.maximum(tokens * self.decode_attn_s_per_token, tokens * self.decode_attn_flops_s_per_token)

    def _prefill_attn_time(self, n: int, ctx: int) -> float:
        pairs = n * ctx + n * (n + 1) / 2
        flops = self.attn_flops_per_pair * pairs
        nbytes = (ctx + n) * self.kv_bytes_per_token_gpu
        return max(
            flops / (self.gpu.bf16_flops * self.eff.prefill_attn_compute),
            nbytes / (self.bw * self.eff.decode_attn_bw),
        )

    # ---- interface --------------------------------------------------------------------------------
    def transfer_time(self, nbytes: float, link: str) -> float:
        bw = {
            "host_h2d": self.gpu.host_h2d_bytes_per_s,
            "host_d2h": self.gpu.host_d2h_bytes_per_s,
            "nvlink": self.gpu.nvlink_bytes_per_s or self.gpu.host_link_theoretical_bytes_per_s,
            "internode": self.gpu.internode_bytes_per_s,
        }[link]
        return nbytes / bw


def _bf16() -> KVFormat:
    return KVFormat(kind=FormatKind.BF16)


_BF16 = _bf16()

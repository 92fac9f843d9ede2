"""How many KV blocks a replica gets: HBM x utilisation - weights - activation reserve.

A wrong block count skews every latency (LLMServingSim 2.0 moved its TTFT error from -20.7% to
+0.6% by matching the engine's real count), so the plan is computed here, once, and reported.

Per GPU of a tensor-parallel group: usable = hbm_bytes x gpu_memory_utilization (vLLM's knob,
default 0.9); weights are split evenly across the group; the activation reserve, unless given,
is estimated as vLLM's profiling run would find it: the peak of one layer's activations at
max_batched_tokens (MLP gate+up outputs in bf16 plus three hidden-size buffers), fp32 logits for
max_num_seqs rows, and 1 GiB of non-torch memory (CUDA context, cuBLAS/NCCL workspaces, CUDA
graphs; an estimate: vLLM reports it per run, typically 0.5-2 GiB).

With ``cluster.parallel`` (`kvsim.spec.parallel`) the weights per GPU follow the layout, and under
DP attention each GPU holds whole tokens of its own requests: the replica gets dp times one GPU's
blocks (pooled, an approximation: kvsim's replica has one block pool, where SGLang has one per DP
rank), and the bytes per token and block per GPU are the average over the replica's GPUs.

Under pipeline parallelism a GPU holds its stage's num_layers / PP layers: the weights of the
busiest stage (`kvsim.spec.parallel.stage_weight_bytes_per_gpu`) and 1 / PP of each token's KV, so a
block's bytes per GPU are 1 / PP of TP's. Under context parallelism each of the CP ranks holds 1 / CP
of every sequence's blocks (weights replicated): the replica gets CP times one rank's blocks, in one
pool (a sequence's blocks striped over the ranks), and the bytes per token and block per GPU are
the average over the replica's GPUs, as under DP (design: docs/architecture.md, "Pipeline and
context parallelism").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvsim.errors import KvsimError
from kvsim.spec.parallel import kv_share, weight_bytes_per_gpu
from kvsim.spec.scenario import Scenario

NON_TORCH_BYTES = 2**30


@dataclass(frozen=True)
class MemoryPlan:
    hbm_bytes_per_gpu: int
    usable_bytes_per_gpu: int
    weight_bytes_per_gpu: int
    activation_reserve_bytes: int
    kv_bytes_per_gpu: int
    kv_bytes_per_token_per_gpu: float
    block_bytes_per_gpu: float
    num_blocks: int  # per replica
    tokens_per_replica: int


def estimate_activation_reserve(sc: Scenario) -> int:
    m = sc.model
    tp = sc.cluster.tensor_parallel
    tokens = sc.scheduler.max_batched_tokens
    ffn = m.moe_intermediate_size * max(1, m.experts_per_token) if m.is_moe else m.intermediate_size
    mlp = tokens * 2 * math.ceil(ffn / tp) * 2
    hidden = tokens * m.hidden_size * 2 * 3
    logits = sc.scheduler.max_num_seqs * m.vocab_size * 4 // tp
    return mlp + hidden + logits + NON_TORCH_BYTES


def plan_memory(sc: Scenario) -> MemoryPlan:
    m = sc.model
    c = sc.cluster
    tp = c.tensor_parallel
    hbm = c.gpu.hbm_bytes
    usable = int(hbm * c.gpu_memory_utilization)
    layout = c.parallel
    weights = weight_bytes_per_gpu(m, tp, layout)
    reserve = (
        c.activation_reserve_bytes
        if c.activation_reserve_bytes is not None
        else estimate_activation_reserve(sc)
    )
    kv_bytes = usable - weights - reserve
    if layout is not None and weights >= usable:
        raise KvsimError(
            f"the weights of {m.name} under {layout.describe(tp)} take {weights / 2**30:.1f} GiB per GPU, "
            f"over the {usable / 2**30:.1f} GiB usable ({c.gpu.name}, x {c.gpu_memory_utilization})",
            source=sc.source,
            path="cluster.parallel",
        )
    full = m.kv_bytes_per_token(sc.kv.format, sc.kv.format_mix)
    dp = 1 if layout is None else layout.attention_dp(tp)
    per_token = full * kv_share(m, tp, layout)
    cp = 1
    if layout is not None and layout.stages_or_ranks > 1:  # DP attention is refused with PP / CP
        per_token = per_token / layout.pipeline_parallel  # a stage's layers
        cp = layout.context_parallel
    block = per_token * sc.kv.block_size
    rank_block = block if dp == 1 else full * sc.kv.block_size  # a DP rank's block: whole tokens
    if cp > 1:  # a block lives on one CP rank: per GPU of the replica, 1 / CP of it on average
        per_token, block = per_token / cp, block / cp
    if kv_bytes <= rank_block:
        raise KvsimError(
            f"no room for the KV cache: {hbm / 2**30:.1f} GiB x {c.gpu_memory_utilization} usable per GPU, "
            f"weights {weights / 2**30:.1f} GiB per GPU (TP {tp}), activation reserve {reserve / 2**30:.1f} GiB; "
            "use more tensor parallelism, a bigger GPU or lighter weights",
            source=sc.source,
            path="cluster",
        )
    if dp == 1 and cp == 1:
        num_blocks = int(kv_bytes // block)
    else:
        num_blocks = max(dp, cp) * int(kv_bytes // rank_block)
    return MemoryPlan(
        hbm, usable, weights, reserve, kv_bytes, per_token, block, num_blocks, num_blocks * sc.kv.block_size
    )

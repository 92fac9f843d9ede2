"""The analytic model under context parallelism: a step's tokens split over CP ranks, ring attention.

`ContextParallelCostModel` is `AnalyticCostModel` (TP per rank) for a replica of CP ranks of TP
GPUs each, every rank holding 1 / CP of each sequence's KV (weights replicated):

- GEMMs, all-reduces and quantize-on-write over the step's tokens / CP per rank (rows and chunks
  split over the ranks; the weights read in full by each rank).
- A prefill chunk (n new tokens over ctx cached ones) by ring attention: each rank computes 1 / CP
  of the chunk's attention (load-balanced, as zig-zag sharding does) while the ring passes either
  the KV (each rank's (n + ctx) / CP tokens, CP - 1 hops) or the chunk's queries and their partial
  outputs (n / CP tokens a rank), whichever moves fewer bytes (Yang et al. 2024, "Context
  Parallelism for Scalable Million-Token Inference", arXiv 2411.01783: pass-KV for full prefill,
  pass-Q when the cached prefix dominates); ``overlap_ring`` (default) pays max(compute, comm),
  else their sum.
- Decode: each rank attends its shard of every sequence (1 / CP of the cached tokens), and the
  partial outputs with their log-sum-exps are combined, per layer, over the ring's link.

The ring's link is NVLink while the CP group (TP x CP GPUs) fits a node, the network otherwise.
Built only when ``cluster.parallel.context_parallel`` > 1 (or pipeline parallelism, whose model
derives from this one). Design: docs/architecture.md, "Pipeline and context parallelism". Left
out: imbalance of a causal split that is not zig-zag, the query all-gather of decode (the combine's
size), CP across a KV that is not striped evenly.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvsim.costs.analytic import AnalyticCostModel
from kvsim.costs.work import ACT_BYTES
from kvsim.spec.formats import KVFormat
from kvsim.spec.hardware import GPUSpec
from kvsim.spec.models import ModelSpec, TPShapes
from kvsim.spec.parallel import ParallelLayout
from kvsim.spec.topology import Link, Topology

LSE_BYTES = 4  # fp32 log-sum-exp per query head, sent with each partial output


def ring_link(topology: Topology, tp: int, cp: int, gpus_per_node: int) -> Link:
    """The slowest hop of a CP ring of `cp` ranks of `tp` consecutive GPUs: the network when the
    group spans nodes, NVLink otherwise."""
    return topology.network if tp * cp > gpus_per_node else topology.nvlink


class ContextParallelCostModel(AnalyticCostModel):
    """`AnalyticCostModel` per CP rank plus ring attention and the decode combine (module docstring)."""

    def __init__(
        self,
        model: ModelSpec,
        gpu: GPUSpec,
        tp: int,
        fmt: KVFormat,
        topology: Topology,
        layout: ParallelLayout,
        gpus_per_node: int,
        **kwargs: Any,
    ) -> None:
        # The per-rank work is TP's (PP and CP are refused with DP attention and EP).
        super().__init__(model, gpu, tp, fmt, topology, **kwargs)
        self.cp = cp = layout.context_parallel
        self.overlap_ring = layout.overlap_ring
        self.ring = ring_link(topology, tp, cp, gpus_per_node)
        layers = model.num_layers
        heads = TPShapes.of(model, tp).heads
        q_bytes = heads * model.head_dim * ACT_BYTES  # one token's queries on one GPU, one layer
        out_bytes = q_bytes + heads * LSE_BYTES  # its partial output and log-sum-exps
        hops = cp - 1
        # Per ring step and layer: a hop's latency and one copy call.
        self.ring_fixed_s = layers * hops * (self.ring.latency_s + self.ring.per_call_overhead_s)
        bw = self.ring.bw_bytes_per_s
        # Ring bytes a GPU sends, per token of its shard, all layers: pass-KV moves the cached
        # tokens' KV (cache format), pass-Q a new token's queries out and its partial output back.
        self.pass_kv_s_per_token = hops * self.work.kv_bytes_per_token / bw
        self.pass_q_s_per_token = hops * layers * (q_bytes + out_bytes) / bw
        # Decode combine: every rank's partial output of each sequence to its owner, per layer.
        self.combine_fixed_s = (
            0.0 if cp == 1 else layers * (self.ring.latency_s + self.ring.per_call_overhead_s)
        )
        self.combine_s_per_seq = hops * layers * out_bytes / bw
        if cp > 1:
            self.name = f"{self.name} + CP{cp} ring attention over {self.ring.name}"

    def _rank_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.cp)

    def _gemm_time(self, num_tokens: int, num_sampling: int) -> float:
        return super()._gemm_time(self._rank_tokens(num_tokens), self._rank_tokens(num_sampling))

    def _comm_time(self, num_tokens: int) -> float:
        return super()._comm_time(self._rank_tokens(num_tokens))

    def _write_time(self, num_tokens: int) -> float:
        return super()._write_time(self._rank_tokens(num_tokens))

    def ring_comm_time(self, n: int, ctx: int) -> float:
        """Seconds of a prefill chunk's ring passes (n new tokens over ctx cached ones): the
        cheaper of pass-KV and pass-Q; 0 at CP 1."""
        if self.cp == 1:
            return 0.0
        shard_kv = (n + ctx) / self.cp
        shard_q = n / self.cp
        return self.ring_fixed_s + min(shard_kv * self.pass_kv_s_per_token, shard_q * self.pass_q_s_per_token)

    def ring_attn_time(self, n: int, ctx: int) -> float:
        """A prefill chunk's attention under ring attention: 1 / CP of its compute per rank, with
        the ring's passes overlapped (max) or not (sum)."""
        compute = super()._prefill_attn_time(n, ctx) / self.cp
        comm = self.ring_comm_time(n, ctx)
        return max(compute, comm) if self.overlap_ring else compute + comm

    def _prefill_attn_time(self, n: int, ctx: int) -> float:
        return self.ring_attn_time(n, ctx)

    def _decode_attn_time(self, num_seqs: int, sum_ctx: np.ndarray) -> np.ndarray:
        # Each rank reads its shard: 1 / CP of every sequence's cached tokens; then the combine.
        combine = self.combine_fixed_s + num_seqs * self.combine_s_per_seq
        out: np.ndarray = super()._decode_attn_time(num_seqs, sum_ctx / self.cp) + combine
        return out


def prefill_attn_bound(m: ContextParallelCostModel, n: int, ctx: int) -> tuple[float, float]:
    """(compute, communication) seconds of one chunk's ring attention, each alone: the bound its
    time must respect (at least the larger; at most the sum)."""
    return AnalyticCostModel._prefill_attn_time(m, n, ctx) / m.cp, m.ring_comm_time(n, ctx)

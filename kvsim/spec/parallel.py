"""A replica's parallel layout (``cluster.parallel``): attention TP or DP, experts EP, pipeline and
context parallelism.

Pipeline parallelism (``pipeline_parallel``, PP stages of whole layers) and context parallelism
(``context_parallel``, CP ranks each holding 1 / CP of every sequence's KV) make a replica TP x PP x
CP GPUs, which may span nodes (design: docs/architecture.md, "Pipeline and context parallelism");
they are not combined with DP attention or EP yet. Without them a replica is
``cluster.tensor_parallel`` GPUs in one node. Attention runs tensor-parallel over them
(``attention: tp``, as without the section) or data-parallel (``attention: dp``, SGLang's DP
attention: each GPU holds all attention weights and its own requests' KV); routed experts are
sharded over ``expert_parallel`` ranks (whole experts, ``num_experts / ep`` per GPU) or, with
``expert_parallel: 1``, split by TP like every other GEMM. Dense layers' MLPs and the embeddings
stay tensor-parallel over the replica; under EP the shared experts and the router are replicated
(SGLang with DeepEP runs the shared experts on every rank). Design: docs/architecture.md, "MoE
layouts". Left out: EP across nodes (a replica lives in one node), redundant experts (EPLB),
attention DP groups smaller than the replica.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from kvsim.errors import KvsimError
from kvsim.spec.models import ModelSpec
from kvsim.spec.schema import Section

# The busiest EP rank's routed tokens over the mean: an estimate, no measurement on file. Routing is
# skewed towards hot experts; DeepSeek's EPLB (github.com/deepseek-ai/EPLB) replicates them to bring
# this towards 1, which kvsim does not model. Set cluster.parallel.expert_imbalance from a run's logs.
EXPERT_IMBALANCE = 1.25


class AttentionParallel(str, Enum):
    TP = "tp"
    DP = "dp"


@dataclass(frozen=True)
class ParallelLayout:
    """``cluster.parallel``: how one replica of ``gpus`` GPUs splits attention and experts."""

    attention: AttentionParallel = AttentionParallel.TP
    expert_parallel: int = 1  # 1: routed experts split by TP, no all-to-all
    expert_imbalance: float = EXPERT_IMBALANCE
    overlap_a2a: bool = False  # dispatch/combine hidden behind the step's GEMMs (two-batch overlap)
    pipeline_parallel: int = 1  # stages of num_layers / PP whole layers, each TP x CP GPUs
    context_parallel: int = 1  # ranks of TP GPUs, each holding 1 / CP of every sequence's KV
    overlap_ring: bool = True  # ring attention's KV (or Q) passing hidden under its compute
    pipeline_chunks: bool = False  # a prompt's chunks follow one another into the stages (SGLang)

    @property
    def stages_or_ranks(self) -> int:
        """PP x CP: the replica's GPUs over its TP degree (1 without either)."""
        return self.pipeline_parallel * self.context_parallel

    def replica_gpus(self, tp: int) -> int:
        """GPUs of one replica of TP `tp`: TP x PP x CP."""
        return tp * self.pipeline_parallel * self.context_parallel

    def attention_dp(self, gpus: int) -> int:
        """Data-parallel attention ranks of a replica of `gpus` GPUs (1 under attention TP)."""
        return gpus if self.attention is AttentionParallel.DP else 1

    def describe(self, gpus: int) -> str:
        att = f"DP{gpus}" if self.attention is AttentionParallel.DP else f"TP{gpus}"
        ep = f"EP{self.expert_parallel}" if self.expert_parallel > 1 else f"experts TP{gpus}"
        if self.stages_or_ranks > 1:  # PP / CP: refused with DP attention and EP
            pp, cp = self.pipeline_parallel, self.context_parallel
            parts = [f"TP{gpus}"] + [f"PP{pp}"] * (pp > 1) + [f"CP{cp}"] * (cp > 1)
            return " x ".join(parts) + f" ({self.replica_gpus(gpus)} GPUs)"
        return f"attention {att}, {ep}"


@dataclass(frozen=True)
class WeightParts:
    """A MoE model's parameters by how a layout places them (counts, not bytes)."""

    attention: int  # attention projections, all layers
    norms: int  # RMSNorms, all layers and the final one
    dense_ffn: int  # the leading dense layers' MLPs
    routed: int  # routed experts, all MoE layers
    shared: int  # shared experts, all MoE layers
    router: int  # the gate's [hidden, num_experts] per MoE layer
    embeddings: int  # input embedding and LM head (once if tied)

    @staticmethod
    def of(m: ModelSpec) -> WeightParts:
        moe_layers = m.num_layers - m.first_dense_layers if m.is_moe else 0
        ffn = 3 * m.hidden_size  # gated MLP per unit of width: gate, up, down
        emb = m.vocab_size * m.hidden_size
        return WeightParts(
            attention=m.attention_params_per_layer() * m.num_layers,
            norms=2 * m.hidden_size * m.num_layers + m.hidden_size,
            dense_ffn=(m.num_layers - moe_layers) * ffn * m.intermediate_size,
            routed=moe_layers * m.num_experts * ffn * m.moe_intermediate_size,
            shared=moe_layers * m.num_shared_experts * ffn * m.moe_intermediate_size,
            router=moe_layers * m.hidden_size * m.num_experts,
            embeddings=emb * (1 if m.tie_embeddings else 2),
        )


def weight_bytes_per_gpu(m: ModelSpec, gpus: int, layout: ParallelLayout | None) -> int:
    """Weight bytes one GPU of a replica of `gpus` GPUs holds. Without a layout every weight is
    split evenly (ceil(weight_bytes / tp), as the memory plan always did); with one, attention is
    split (TP) or replicated (DP), routed experts split over EP ranks (or by TP at EP 1), shared
    experts and the router replicated under EP, dense MLPs and embeddings split by TP, norms
    replicated."""
    if layout is None:
        return math.ceil(m.weight_bytes / gpus)
    if layout.stages_or_ranks > 1:
        return stage_weight_bytes_per_gpu(m, gpus, layout.pipeline_parallel)
    p = WeightParts.of(m)
    ep = layout.expert_parallel
    attn = p.attention if layout.attention is AttentionParallel.DP else p.attention / gpus
    routed = p.routed / ep if ep > 1 else p.routed / gpus
    replicated_moe = p.shared + p.router if ep > 1 else (p.shared + p.router) / gpus
    params = attn + p.norms + (p.dense_ffn + p.embeddings) / gpus + routed + replicated_moe
    return math.ceil(params * m.weight_bytes_per_param)


def stage_weight_bytes_per_gpu(m: ModelSpec, tp: int, pp: int) -> int:
    """Weight bytes one GPU of the busiest pipeline stage holds, every weight split by TP `tp`
    (CP ranks replicate the stage): num_layers / pp layers plus, at pp > 1, one vocabulary matrix
    (the first stage's input embedding or the last stage's LM head, a copy each when tied; the
    final norm counted with the layers). pp = 1 is the plain TP split, ceil(weight_bytes / tp)."""
    if pp == 1:
        return math.ceil(m.weight_bytes / tp)
    vocab = m.vocab_size * m.hidden_size
    layers = m.num_params - vocab * (1 if m.tie_embeddings else 2)
    return math.ceil((layers / pp + vocab) * m.weight_bytes_per_param / tp)


def kv_share(m: ModelSpec, gpus: int, layout: ParallelLayout | None) -> float:
    """Share of each token's KV one GPU holds, on average over the replica's GPUs: the TP share
    (`ModelSpec.kv_share`: all of an MLA latent on every rank), or 1 / dp under DP attention
    (each token's whole KV on the one rank that serves its request)."""
    if layout is not None and layout.attention is AttentionParallel.DP:
        return 1.0 / gpus
    return m.kv_share(gpus)


def remote_ranks_per_token(m: ModelSpec, ep: int) -> float:
    """EP ranks other than its own that a token's top-k experts land on, on average (a token is
    sent once per destination rank, as DeepEP's dispatch does): (ep - 1) x P(a given rank holds at
    least one of the k experts drawn without replacement from E, E / ep per rank)."""
    if ep <= 1:
        return 0.0
    e, k, per_rank = m.num_experts, m.experts_per_token, m.num_experts // ep
    none_here = math.comb(e - per_rank, k) / math.comb(e, k)
    return (ep - 1) * (1.0 - none_here)


def read_parallel(c: Section, m: ModelSpec, gpus: int) -> ParallelLayout | None:
    """``cluster.parallel`` (None when absent): ``attention`` (tp | dp), ``expert_parallel`` (divides
    the model's experts and the replica's GPUs), ``expert_imbalance`` (>= 1), ``overlap_a2a``,
    ``pipeline_parallel`` (divides the model's layers), ``context_parallel``, ``overlap_ring``,
    ``pipeline_chunks`` (with PP > 1).
    Where the replica's TP x PP x CP GPUs sit is checked with the cluster (`check_placement`)."""
    if not c.has("parallel"):
        return None
    s = c.section("parallel")
    attention = AttentionParallel(s.choice("attention", [a.value for a in AttentionParallel], "tp"))
    ep = s.int("expert_parallel", 1, lo=1, hi=1024)
    imbalance = s.float("expert_imbalance", EXPERT_IMBALANCE, lo=1.0, hi=64.0)
    overlap = s.bool("overlap_a2a", False)
    pp = s.int("pipeline_parallel", 1, lo=1, hi=1024)
    cp = s.int("context_parallel", 1, lo=1, hi=1024)
    ring = s.bool("overlap_ring", True)
    chunks = s.bool("pipeline_chunks", False)
    s.done()
    if chunks and pp == 1:
        raise s.err("pipeline_chunks", "pipelines a prompt's chunks over stages: needs pipeline_parallel > 1")
    if m.num_layers % pp:
        raise s.err(
            "pipeline_parallel",
            f"{pp} stages do not divide {m.name}'s {m.num_layers} layers (stages hold whole layers, "
            "evenly; uneven splits are not simulated)",
        )
    if pp * cp > 1 and (attention is AttentionParallel.DP or ep > 1):
        key, what = ("pipeline_parallel", "pipeline") if pp > 1 else ("context_parallel", "context")
        raise s.err(key, f"{what} parallelism is not simulated together with DP attention or EP yet")
    if not m.is_moe and (attention is AttentionParallel.DP or ep > 1):
        key = "attention" if attention is AttentionParallel.DP else "expert_parallel"
        raise s.err(key, f"{m.name} is a dense model: DP attention and expert parallelism need MoE layers")
    if ep > gpus:
        raise s.err("expert_parallel", f"{ep} exceeds the replica's {gpus} GPUs (cluster.tensor_parallel)")
    if gpus % ep:
        raise s.err(
            "expert_parallel", f"{ep} must divide the replica's {gpus} GPUs (cluster.tensor_parallel)"
        )
    if m.is_moe and m.num_experts % ep:
        raise s.err("expert_parallel", f"{ep} does not divide {m.name}'s {m.num_experts} routed experts")
    return ParallelLayout(attention, ep, imbalance, overlap, pp, cp, ring, chunks)


def check_placement(source: str, layout: ParallelLayout, tp: int, nodes: int, gpus_per_node: int) -> None:
    """A replica of TP x PP x CP GPUs, placed on consecutive GPUs (TP innermost, then CP ranks, then
    stages), fits the cluster: no more GPUs than it has, a whole number of replicas, and either
    several replicas to a node or whole nodes to a replica (so every replica sees the same links)."""
    n = layout.replica_gpus(tp)
    total = nodes * gpus_per_node
    what = f"a replica of {layout.describe(tp)}"
    msg = None
    if n > total:
        msg = f"{what} is larger than the cluster's {total} GPUs ({nodes} nodes x {gpus_per_node})"
    elif gpus_per_node % n and n % gpus_per_node:
        msg = f"{what} neither divides gpus_per_node ({gpus_per_node}) nor spans whole nodes"
    elif total % n:
        msg = f"the cluster's {total} GPUs are not a whole number of replicas ({what})"
    if msg is not None:
        raise KvsimError(msg, source=source, path="cluster.parallel")

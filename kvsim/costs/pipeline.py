"""The analytic model under pipeline parallelism: a step as a round of micro-batches through PP stages.

A replica of PP stages (num_layers / PP whole layers each, TP x CP GPUs a stage) runs an engine
step as one round: the step's rows split into m = min(PP, rows) micro-batches, each passing the
stages in turn, with its activations (hidden_size x its tokens in bf16, per GPU) sent over each
stage boundary's link (NVLink inside a node, the network where the boundary crosses nodes). Rounds
follow one another without draining the pipeline (vLLM keeps PP batches in flight, one per
virtual engine), and a micro-batch's next round waits for its own last stage, so with m <= PP
micro-batches the round's period is one micro-batch's whole traversal:

    round = overhead + (all layers of the slowest micro-batch) + (PP - 1) boundary transfers

and a stage is busy m x (its share of a micro-batch) of it: a bubble of 1 - m / PP of the stage
time with uniform stages and free transfers (none with m = PP). The slowest micro-batch is priced
as the step scaled to 1 / m (decode rows, each chunk's tokens and the sampled rows; weights, kernel
launches and all-reduce latencies paid in full by each micro-batch), or the step's largest chunk
alone if that is slower (a chunk is not split). Each row's token comes at the round's end.

With ``pipeline_chunks`` (SGLang's chunked pipeline parallelism) a step that is one prompt chunk
alone and not its last (nothing sampled) lets the next chunk into the first stage as soon as it
leaves it: such a step takes overhead + max(a stage's share of the chunk, the slowest boundary's
transfer, sent while the stage computes), and the last chunk the whole traversal, so N uniform
chunks take N overheads + (N + PP - 1) stage times: GPipe's bubble (PP - 1) / (N + PP - 1).

Vidur simulates this schedule event by event (up to PP batches in flight, a queue per stage);
kvsim prices the round in closed form over its one batch per replica. Built only when
``cluster.parallel.pipeline_parallel`` > 1. Design: docs/architecture.md,
"Pipeline and context parallelism". Left out: the sampled token's
trip back to the first stage, uneven stages (the embeddings' stages), the one-off fill of an idle
pipeline (GPipe's (PP - 1) / (m + PP - 1) bubble, for a flushed pipeline).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvsim.core.sched.output import SeqKind
from kvsim.costs.base import StepRun, transfer_time
from kvsim.costs.context_parallel import ContextParallelCostModel
from kvsim.costs.work import ACT_BYTES
from kvsim.spec.formats import KVFormat
from kvsim.spec.hardware import GPUSpec
from kvsim.spec.models import ModelSpec
from kvsim.spec.parallel import ParallelLayout
from kvsim.spec.topology import Link, Topology

_NO_DECODE = np.zeros(0)


def boundary_links(topology: Topology, layout: ParallelLayout, tp: int, gpus_per_node: int) -> list[Link]:
    """The link of each of a replica's PP - 1 stage boundaries: stage s sits on GPUs
    [s x TP x CP, (s + 1) x TP x CP) of the replica, so boundary b crosses nodes where b x TP x CP is a
    multiple of gpus_per_node (replicas start on a node or spread over whole nodes)."""
    stage = tp * layout.context_parallel
    return [
        topology.network if (b * stage) % gpus_per_node == 0 else topology.nvlink
        for b in range(1, layout.pipeline_parallel)
    ]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class PipelineCostModel(ContextParallelCostModel):
    """`ContextParallelCostModel` (plain TP per stage at CP 1) with a step priced as a pipeline
    round (see the module docstring)."""

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
        super().__init__(model, gpu, tp, fmt, topology, layout, gpus_per_node, **kwargs)
        self.pp = layout.pipeline_parallel
        assert self.pp > 1
        self.links = boundary_links(topology, layout, tp, gpus_per_node)
        self.act_bytes_per_token = model.hidden_size * ACT_BYTES
        self.pipeline_chunks = layout.pipeline_chunks
        crossing = sum(link is topology.network for link in self.links)
        self.name = f"{self.name} + PP{self.pp} ({crossing} of {self.pp - 1} boundaries across nodes)"

    def micro_batches(self, run: StepRun) -> int:
        """m = min(PP, the step's rows): micro-batches of a round."""
        return max(1, min(self.pp, run.num_decode + len(run.rows)))

    def transfer_s(self, num_tokens: int) -> float:
        """Seconds of one micro-batch of `num_tokens` tokens crossing every stage boundary (each
        GPU sends its CP rank's share of the hidden states to its peer in the next stage)."""
        nbytes = self.act_bytes_per_token * _ceil_div(num_tokens, self.cp)
        return sum(transfer_time(nbytes, link) for link in self.links)

    def scaled(self, run: StepRun, m: int) -> StepRun:
        """`run`'s steps scaled to one of m balanced micro-batches: ceil(decode rows / m) at their
        mean context, each chunk's tokens / m (rounded up) on its context, sampled rows / m."""
        nd = run.num_decode
        dec_n = _ceil_div(nd, m)
        dec = run.dec_sum_ctx * (dec_n / nd) if nd else run.dec_sum_ctx
        samp = run.num_sampling
        msamp: int | list[int] = (
            _ceil_div(samp, m) if isinstance(samp, int) else [_ceil_div(s, m) for s in samp]
        )
        rows = tuple((kind, _ceil_div(n, m)) for kind, n in run.rows)
        return StepRun(dec_n, dec, msamp, run.num_steps, rows, run.rows_ctx)

    def round_parts(self, run: StepRun) -> tuple[np.ndarray, int]:
        """Per step, the slowest micro-batch's seconds through all layers (overhead included), and
        its tokens (what crosses each boundary)."""
        m = self.micro_batches(run)
        total = run.num_decode + run.row_tokens
        if m == 1:
            return super().step_times(run), total
        t = super().step_times(self.scaled(run, m))
        tokens = _ceil_div(total, m)
        if run.rows:  # a chunk is not split: the largest alone, if slower
            i = max(range(len(run.rows)), key=lambda r: run.rows[r][1])
            n = run.rows[i][1]
            samp = run.num_sampling
            one: int | list[int] = min(1, samp) if isinstance(samp, int) else [min(1, s) for s in samp]
            alone = StepRun(0, _NO_DECODE, one, run.num_steps, (run.rows[i],), (run.rows_ctx[i],))
            t = np.maximum(t, super().step_times(alone))
            tokens = max(tokens, n)
        return t, tokens

    def is_lone_chunk(self, run: StepRun) -> bool:
        """With ``pipeline_chunks``: `run`'s steps are each one prefill chunk alone (those of them
        that sample nothing, not a prompt's last chunk, let the next chunk follow into the stages)."""
        return (
            self.pipeline_chunks
            and run.num_decode == 0
            and len(run.rows) == 1
            and run.rows[0][0] is SeqKind.PREFILL
        )

    def step_times(self, run: StepRun) -> np.ndarray:
        t, tokens = self.round_parts(run)
        full: np.ndarray = t + self.transfer_s(tokens)
        if not self.is_lone_chunk(run):
            return full
        # Until the first stage takes the next chunk: its share of this one, or the slowest
        # boundary's send if longer (sent while the stages compute).
        piped: np.ndarray = self.overhead_s + np.maximum(
            (t - self.overhead_s) / self.pp, self.slowest_boundary_s(tokens)
        )
        samp = run.num_sampling
        if isinstance(samp, int):
            return piped if samp == 0 else full
        out: np.ndarray = np.where(np.asarray(samp) == 0, piped, full)
        return out

    def prefix_extrapolated_s(self, n: int, ctx: int) -> float:
        # With pipelined chunks a lone chunk's step is about a stage's share of it (the run's
        # warning compares this with busy time; mixed steps, priced whole, are then under-counted).
        t = super().prefix_extrapolated_s(n, ctx)
        return t / self.pp if self.pipeline_chunks else t

    def slowest_boundary_s(self, num_tokens: int) -> float:
        """Seconds of one chunk of `num_tokens` tokens over the slowest stage boundary."""
        nbytes = self.act_bytes_per_token * _ceil_div(num_tokens, self.cp)
        return max(transfer_time(nbytes, link) for link in self.links)

    def step_seconds(self, run: StepRun) -> float:
        return float(self.step_times(run)[0])

    def bubble(self, run: StepRun) -> float:
        """Share of a round's pipeline time (the engine's per-step overhead left out) a stage sits
        idle, for `run`'s first step: 1 - m x (a stage's share of the slowest micro-batch) / (the
        micro-batch's traversal + its transfers); 1 - m / PP with free transfers."""
        t, tokens = self.round_parts(run)
        busy = float(t[0]) - self.overhead_s
        return 1.0 - self.micro_batches(run) * (busy / self.pp) / (busy + self.transfer_s(tokens))

"""The analytic model under expert parallelism: the roofline plus each MoE layer's dispatch and combine.

`MoECostModel` is `AnalyticCostModel` built with a layout whose ``expert_parallel`` > 1 (the work
of `kvsim.costs.work.ModelWork.with_layout`: experts per rank, the busiest rank's routed tokens,
DP attention's KV share), plus the all-to-all of every MoE layer over the replica's NVLink: a
latency per call and the busiest rank's bytes at `A2A_EFFICIENCY` of the link. With
``overlap_a2a`` the all-to-all runs under the step's GEMMs (SGLang's two-batch overlap) and only
what exceeds them is paid. A run without a layout never builds it. Design: docs/architecture.md,
"MoE layouts". Left out: DeepEP's low-latency mode (decode over RDMA), FP8 dispatch, EP across
nodes (a replica is inside one node), the per-expert GEMM launch of small groups.
"""

from __future__ import annotations

from typing import Any

from kvsim.costs.analytic import AnalyticCostModel
from kvsim.spec.formats import KVFormat
from kvsim.spec.hardware import GPUSpec
from kvsim.spec.models import ModelSpec
from kvsim.spec.parallel import ParallelLayout
from kvsim.spec.topology import Topology

# Achieved all-to-all rate over the link's per-direction peak: DeepEP V1's performance table
# (deepseek-ai/DeepEP, docs/legacy.md, "Normal kernels with NVLink and RDMA forwarding") reports its
# intranode EP8 normal kernels at 153 GB/s (dispatch) and 158 GB/s (combine) NVLink bottleneck
# bandwidth on H800, whose NVLink it puts at about 160 GB/s: 0.95 of peak.
A2A_EFFICIENCY = 0.95
A2A_LATENCY_S = 10e-6  # per dispatch or combine call; estimate, taken as an NCCL all-reduce's


class MoECostModel(AnalyticCostModel):
    """`AnalyticCostModel` plus EP dispatch and combine (see the module docstring)."""

    def __init__(
        self,
        model: ModelSpec,
        gpu: GPUSpec,
        tp: int,
        fmt: KVFormat,
        topology: Topology,
        layout: ParallelLayout,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, gpu, tp, fmt, topology, layout=layout, **kwargs)
        assert layout.expert_parallel > 1
        w, lay = self.work, layout
        self.a2a_fixed_s = w.a2a_calls * A2A_LATENCY_S
        rate = self.link_bw * A2A_EFFICIENCY
        self.a2a_s_per_token = w.a2a_calls * w.a2a_bytes_per_token * lay.expert_imbalance / rate
        self.overlap = lay.overlap_a2a
        self.name = f"{self.name} + EP{lay.expert_parallel} all-to-all"

    def a2a_time(self, num_tokens: int) -> float:
        """Seconds of a step's dispatches and combines for ``num_tokens`` tokens of the replica."""
        return self.a2a_fixed_s + num_tokens * self.a2a_s_per_token

    def _comm_time(self, num_tokens: int) -> float:
        a2a = self.a2a_time(num_tokens)
        if self.overlap:  # hidden under the body's GEMMs (the LM head waits for the last combine)
            a2a = max(0.0, a2a - self._gemm_time(num_tokens, 0))
        return super()._comm_time(num_tokens) + a2a

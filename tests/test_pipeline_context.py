"""Pipeline and context parallelism (``cluster.parallel.pipeline_parallel`` / ``context_parallel``;
`kvsim.costs.pipeline`, `kvsim.costs.context_parallel`): memory per stage and per rank by hand, a
round's period and bubble against an explicit pipeline schedule, ring attention against its
compute and communication bounds, the layouts refused, and a story: a prompt whose KV exceeds a
node's HBM is rejected by TP8 and served by PP2 x TP8 and CP2 x TP8 over two nodes."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.core.memory_plan import plan_memory
from kvsim.core.request import RequestStatus
from kvsim.costs.analytic import AnalyticCostModel
from kvsim.costs.base import ForwardBatch, StepRun
from kvsim.costs.context_parallel import ContextParallelCostModel, prefill_attn_bound
from kvsim.costs.pipeline import PipelineCostModel
from kvsim.errors import KvsimError
from kvsim.run import make_cost_model, run_scenario
from kvsim.spec.models import PRESETS
from kvsim.spec.parallel import stage_weight_bytes_per_gpu
from kvsim.spec.scenario import load_scenario, scenario_from_dict
from tests.helpers import ROOT, make_workload

L70 = PRESETS["llama-3.1-70b"]
KV_PER_TOKEN = 80 * 2 * 8 * 128 * 2  # layers x (K, V) x KV heads x head_dim x bf16 = 327,680 bytes


def _scenario(parallel: dict[str, Any] | None, *, model: str = "llama-3.1-70b", nodes: int = 2, **extra: Any):  # type: ignore[no-untyped-def]
    cluster: dict[str, Any] = {"gpu": "h100-sxm", "nodes": nodes, "gpus_per_node": 8, "tensor_parallel": 8}
    if parallel is not None:
        cluster["parallel"] = parallel
    data = {
        "model": model,
        "cluster": cluster,
        "kv": {"block_size": 16, "format": "bf16"},
        "scheduler": {"max_num_seqs": 64, "max_batched_tokens": 8192, "chunked_prefill": True},
        "workload": {"synthetic": {"num_requests": 1, "rate": 1}},
        "sim": {"seed": 1},
        **extra,
    }
    return scenario_from_dict(data, source="pp.yaml", base_dir=ROOT)


# ---- memory -------------------------------------------------------------------------------------
def test_weights_per_stage_by_hand() -> None:
    # Llama-3.1-70B: 80 layers of 855,654,400 parameters (attention 150,994,944, MLP 704,643,072,
    # two norms 16,384), an untied 128,256 x 8,192 embedding and LM head, a final norm.
    layer = 8192 * 8192 * 2 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192
    assert layer == 855_654_400
    vocab = 128256 * 8192
    assert L70.num_params == 80 * layer + 2 * vocab + 8192 == 70_553_706_496
    # PP2 x TP8: a stage holds 40 layers (and half the final norm) plus one vocabulary matrix.
    stage = (80 * layer + 8192) / 2 + vocab
    assert stage_weight_bytes_per_gpu(L70, 8, 2) == math.ceil(stage * 2 / 8) == 8_819_213_312
    assert stage_weight_bytes_per_gpu(L70, 8, 1) == L70.weight_bytes // 8 == 17_638_426_624


def test_memory_plan_per_stage_and_per_rank_exact() -> None:
    tp8 = plan_memory(_scenario(None, nodes=1))
    pp2 = plan_memory(_scenario({"pipeline_parallel": 2}))
    cp2 = plan_memory(_scenario({"context_parallel": 2}))
    assert tp8.block_bytes_per_gpu == 16 * KV_PER_TOKEN / 8 == 655_360
    # A stage holds half the layers: half a block's bytes per GPU, the busiest stage's weights.
    assert pp2.weight_bytes_per_gpu == 8_819_213_312
    assert pp2.block_bytes_per_gpu == 16 * KV_PER_TOKEN / 8 / 2 == 327_680
    assert pp2.kv_bytes_per_gpu == pp2.usable_bytes_per_gpu - 8_819_213_312 - pp2.activation_reserve_bytes
    assert pp2.num_blocks == pp2.kv_bytes_per_gpu // 327_680
    # CP: weights replicated (TP8's), every rank its share of each sequence: CP x one rank's blocks.
    assert cp2.weight_bytes_per_gpu == tp8.weight_bytes_per_gpu == 17_638_426_624
    assert cp2.num_blocks == 2 * tp8.num_blocks
    # A block sits on one rank: on average over the replica's GPUs, half of TP8's bytes.
    assert cp2.block_bytes_per_gpu == 655_360 / 2
    assert pp2.num_blocks > cp2.num_blocks  # PP also halves each GPU's weights


def test_replicas_over_the_cluster() -> None:
    assert _scenario(None).cluster.num_replicas == 2
    assert _scenario({"pipeline_parallel": 2}).cluster.num_replicas == 1
    assert _scenario({"context_parallel": 2}, nodes=4).cluster.num_replicas == 2
    sc = _scenario({"pipeline_parallel": 2, "context_parallel": 2}, nodes=4)
    assert sc.cluster.replica_gpus == 32 and sc.cluster.num_replicas == 1


@pytest.mark.parametrize(
    ("parallel", "nodes", "message"),
    [
        ({"pipeline_parallel": 3}, 3, "3 stages do not divide llama-3.1-70b's 80 layers"),
        ({"pipeline_parallel": 4}, 2, "TP8 x PP4 (32 GPUs) is larger than the cluster's 16 GPUs"),
        ({"context_parallel": 2}, 3, "the cluster's 24 GPUs are not a whole number of replicas"),
    ],
)
def test_bad_layouts_refused(parallel: dict[str, Any], nodes: int, message: str) -> None:
    with pytest.raises(KvsimError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _scenario(parallel, nodes=nodes)


def test_a_replica_that_straddles_nodes_is_refused() -> None:
    data = {
        "model": "llama-3.1-8b",
        "cluster": {
            "gpu": "h100-sxm",
            "gpus_per_node": 8,
            "nodes": 3,
            "tensor_parallel": 4,
            "parallel": {"context_parallel": 3},
        },
        "workload": {"synthetic": {"num_requests": 1, "rate": 1}},
    }
    with pytest.raises(KvsimError, match="neither divides gpus_per_node"):
        scenario_from_dict(data, source="s.yaml", base_dir=ROOT)


# ---- pipeline: a round against an explicit schedule -------------------------------------------
def pipeline_schedule(pp: int, m: int, t: float, x: float, rounds: int) -> tuple[float, float]:
    """An explicit list schedule: `m` micro-batches cycle through `pp` stages (`t` seconds a stage,
    `x` per boundary); a micro-batch's next round waits for its own last stage; a stage serves one
    micro-batch at a time, in order. Returns (steady-state period, makespan of the first round)."""
    free = [0.0] * pp  # each stage's next free instant
    ready = [0.0] * m  # when each micro-batch can enter stage 0 again
    ends = []
    first = 0.0
    for r in range(rounds):
        end = 0.0
        for j in range(m):
            at = ready[j]
            for s in range(pp):
                start = max(at, free[s])
                free[s] = start + t
                at = free[s] + (x if s < pp - 1 else 0.0)
            ready[j] = free[pp - 1]
            end = max(end, ready[j])
        ends.append(end)
        if r == 0:
            first = end
    return ends[-1] - ends[-2], first


@pytest.mark.parametrize(("pp", "m"), [(2, 1), (2, 2), (4, 1), (4, 3), (4, 4), (8, 5)])
def test_pipeline_schedule_closed_forms(pp: int, m: int) -> None:
    t = 1.0
    period, first = pipeline_schedule(pp, m, t, 0.0, rounds=6)
    # Rounds that follow one another (kvsim's model): period pp x t, bubble 1 - m / pp.
    assert period == pytest.approx(pp * t)
    assert 1 - m * t / period == pytest.approx((pp - m) / pp)
    # One flushed round (GPipe): (m + pp - 1) slots, bubble (pp - 1) / (m + pp - 1).
    assert first == pytest.approx((m + pp - 1) * t)
    assert 1 - m * t / first == pytest.approx((pp - 1) / (m + pp - 1))
    period_x, _ = pipeline_schedule(pp, m, t, 0.25, rounds=6)
    assert period_x == pytest.approx(pp * t + (pp - 1) * 0.25)


@settings(max_examples=200, deadline=None)
@given(
    pp=st.integers(1, 8),
    data=st.data(),
    t=st.floats(1e-4, 1.0),
    x=st.floats(0.0, 0.5),
)
def test_pipeline_schedule_period_property(pp: int, data: st.DataObject, t: float, x: float) -> None:
    """For any m <= PP micro-batches, the steady-state period is one micro-batch's traversal."""
    m = data.draw(st.integers(1, pp))
    period, _ = pipeline_schedule(pp, m, t, x, rounds=4)
    assert period == pytest.approx(pp * t + (pp - 1) * x, rel=1e-9)


def _decode(rows: int, ctx: int) -> StepRun:
    return StepRun.of(ForwardBatch.decode([ctx] * rows))


@pytest.mark.parametrize("rows", [1, 2, 3, 64])
def test_round_is_the_schedules_period(rows: int) -> None:
    sc = _scenario({"pipeline_parallel": 4}, nodes=4)
    cost = make_cost_model(sc)
    assert isinstance(cost, PipelineCostModel)
    run = _decode(rows, 4096)
    m = min(4, rows)
    assert cost.micro_batches(run) == m
    # The slowest micro-batch through all layers, a stage a quarter of that (uniform stages).
    mb = cost.scaled(run, m) if m > 1 else run
    through = float(AnalyticCostModel.step_times(cost, mb)[0]) - cost.overhead_s
    x = cost.transfer_s(-(-rows // m))
    period, _ = pipeline_schedule(4, m, through / 4, x / 3, rounds=5)  # 3 boundaries, all network here
    assert cost.step_seconds(run) == pytest.approx(cost.overhead_s + period, rel=1e-12)
    assert cost.bubble(run) == pytest.approx(1 - m * (through / 4) / (through + x), rel=1e-12)


def test_bubble_with_free_transfers_is_the_closed_form() -> None:
    data = {
        "model": "llama-3.1-8b",
        "cluster": {
            "gpu": "h100-sxm",
            "gpus_per_node": 8,
            "tensor_parallel": 2,
            "parallel": {"pipeline_parallel": 4},
            "topology": {"nvlink": {"bw": "100TB/s", "per_call_overhead": 0}},
        },
        "workload": {"synthetic": {"num_requests": 1, "rate": 1}},
    }
    sc = scenario_from_dict(data, source="s.yaml", base_dir=ROOT)
    cost = make_cost_model(sc)
    assert isinstance(cost, PipelineCostModel)
    assert cost.transfer_s(8192) < 1e-5
    for rows in (1, 2, 3, 4, 32):
        assert cost.bubble(_decode(rows, 2048)) == pytest.approx((4 - min(4, rows)) / 4, abs=1e-6)


def test_pipeline_boundaries_cross_nodes_only_between_nodes() -> None:
    data = {
        "model": "llama-3.1-8b",
        "cluster": {
            "gpu": "h100-sxm",
            "gpus_per_node": 8,
            "tensor_parallel": 4,
            "parallel": {"pipeline_parallel": 2},
        },
        "workload": {"synthetic": {"num_requests": 1, "rate": 1}},
    }
    one_node = make_cost_model(scenario_from_dict(data, source="s.yaml", base_dir=ROOT))
    two_nodes = make_cost_model(_scenario({"pipeline_parallel": 2}))
    assert isinstance(one_node, PipelineCostModel) and isinstance(two_nodes, PipelineCostModel)
    assert [link.name for link in one_node.links] == ["nvlink"]
    assert [link.name for link in two_nodes.links] == ["network"]
    # 8,192 tokens of hidden states (8,192 x bf16 = 16 KiB a token) over 50 GB/s, 5 us + 2.3 us.
    assert two_nodes.transfer_s(8192) == pytest.approx(5e-6 + 2.3e-6 + 8192 * 8192 * 2 / 50e9)


def test_pipeline_decode_is_no_faster_prefill_of_many_rows_is() -> None:
    tp8 = make_cost_model(_scenario(None, nodes=1))
    pp2 = make_cost_model(_scenario({"pipeline_parallel": 2}))
    # Decode over short contexts is bound by the weights, which each micro-batch streams again in
    # every stage: the round is no shorter. Over long contexts each stage reads its layers' KV,
    # half of it, while the other stage reads the other half: the 16 GPUs' bandwidth shows.
    short, long = _decode(64, 128), _decode(64, 32768)
    assert pp2.step_seconds(short) > 0.95 * tp8.step_seconds(short)
    assert pp2.step_seconds(long) < 0.7 * tp8.step_seconds(long)
    # Two prompts' chunks in one step: each micro-batch one chunk, about half the compute.
    two = StepRun.of(ForwardBatch((ForwardBatch.prefill(4096).kinds[0],) * 2, (4096, 4096), (0, 0), 2))
    assert pp2.step_seconds(two) < 0.7 * tp8.step_seconds(two)
    one = StepRun.of(ForwardBatch.prefill(8192))  # one chunk: not split, plus the transfer
    assert pp2.step_seconds(one) > tp8.step_seconds(one)


def test_window_prices_as_single_steps() -> None:
    pp2 = make_cost_model(_scenario({"pipeline_parallel": 2, "context_parallel": 2}, nodes=4))
    ctx = np.array([1000.0, 1064.0, 1128.0, 9000.0])
    window = pp2.step_times(StepRun.decode(7, ctx))
    singles = [pp2.step_seconds(StepRun.decode(7, ctx[i : i + 1])) for i in range(4)]
    assert window.tolist() == singles


# ---- context parallelism ----------------------------------------------------------------------
@pytest.mark.parametrize(("n", "ctx"), [(8192, 0), (8192, 65536), (8192, 1_000_000), (512, 200_000)])
@pytest.mark.parametrize("overlap", [True, False])
def test_ring_attention_against_its_bounds(n: int, ctx: int, overlap: bool) -> None:
    cost = make_cost_model(_scenario({"context_parallel": 2, "overlap_ring": overlap}))
    assert isinstance(cost, ContextParallelCostModel)
    assert cost.ring.name == "network"  # CP2 x TP8 spans two nodes of 8
    compute, comm = prefill_attn_bound(cost, n, ctx)
    plain = make_cost_model(_scenario(None, nodes=1))
    assert compute == pytest.approx(plain._prefill_attn_time(n, ctx) / 2, rel=1e-12)
    # One hop (CP 2), 80 layers x (5 us + 2.3 us); pass-KV: the shard's (n + ctx) / 2 tokens at
    # 40,960 bytes a GPU; pass-Q: n / 2 queries (8 heads x 128 x bf16 = 2,048 bytes a layer) out and
    # their outputs and log-sum-exps (2,048 + 32) back.
    fixed = 80 * 7.3e-6
    kv = (n + ctx) / 2 * 40_960 / 50e9
    q = n / 2 * 80 * (2048 + 2048 + 32) / 50e9
    assert comm == pytest.approx(fixed + min(kv, q), rel=1e-9)
    t = cost._prefill_attn_time(n, ctx)
    assert t == pytest.approx(max(compute, comm) if overlap else compute + comm, rel=1e-12)
    assert max(compute, comm) <= t * (1 + 1e-12) <= (compute + comm) * (1 + 1e-12)


def test_ring_uses_nvlink_inside_a_node_and_pass_q_over_a_long_prefix() -> None:
    data = {
        "model": "llama-3.1-8b",
        "cluster": {
            "gpu": "h100-sxm",
            "gpus_per_node": 8,
            "tensor_parallel": 2,
            "parallel": {"context_parallel": 4},
        },
        "workload": {"synthetic": {"num_requests": 1, "rate": 1}},
    }
    cost = make_cost_model(scenario_from_dict(data, source="s.yaml", base_dir=ROOT))
    assert isinstance(cost, ContextParallelCostModel) and cost.ring.name == "nvlink"
    short = cost.ring_comm_time(4096, 0) - cost.ring_fixed_s
    long = cost.ring_comm_time(4096, 10**6) - cost.ring_fixed_s
    assert long == pytest.approx(4096 / 4 * cost.pass_q_s_per_token)  # pass-Q: the prefix stays
    assert short == pytest.approx(4096 / 4 * cost.pass_kv_s_per_token)


def test_cp_decode_reads_a_shard_and_combines() -> None:
    cp2 = make_cost_model(_scenario({"context_parallel": 2}))
    tp8 = make_cost_model(_scenario(None, nodes=1))
    assert isinstance(cp2, ContextParallelCostModel)
    ctx = np.array([2e6])
    combine = 80 * 7.3e-6 + 4 * 80 * (2048 + 32) / 50e9
    want = float(AnalyticCostModel._decode_attn_time(tp8, 4, ctx / 2)[0]) + combine
    assert float(cp2._decode_attn_time(4, ctx)[0]) == pytest.approx(want, rel=1e-12)


def test_cp_over_a_prompt_shorter_than_its_ranks_blocks_is_refused() -> None:
    sc = _scenario({"context_parallel": 2})
    with pytest.raises(
        KvsimError, match=r"2 ranks x block_size 16 = 32 tokens exceed the workload's shortest prompt \(20"
    ):
        run_scenario(sc, workload=make_workload([0.0, 0.1], [20, 4000], [4, 4]))


def test_plain_runs_build_no_layout_model() -> None:
    assert type(make_cost_model(_scenario(None))) is AnalyticCostModel


# ---- a story ------------------------------------------------------------------------------------
def test_a_prompt_beyond_one_nodes_hbm_runs_on_pp_and_cp() -> None:
    # Llama-70B with full multi-head KV (2.6 MB a token): TP8 on one node holds about 170 K
    # tokens; a 250 K-token prompt is rejected there and served by a replica over both nodes.
    wl = make_workload([0.0, 0.5], [250_000, 2048], [8, 8])
    ttft = {}
    for name, parallel in (
        ("tp8", None),
        ("pp2", {"pipeline_parallel": 2}),
        ("cp2", {"context_parallel": 2}),
    ):
        res = run_scenario(_scenario(parallel, model="llama-70b-mha"), workload=wl)
        long = res.seqs[0]
        if name == "tp8":
            assert long.status is RequestStatus.REJECTED and res.seqs[1].status is RequestStatus.FINISHED
            continue
        assert [s.status for s in res.seqs] == [RequestStatus.FINISHED] * 2
        ttft[name] = long.first_token_s - long.arrival_s
    assert ttft["cp2"] < 0.75 * ttft["pp2"]  # CP splits the long prefill; PP runs its chunks in turn


def test_a_default_layout_on_a_dense_model_prices_as_no_layout() -> None:
    # `cluster.parallel` with PP = CP = 1 on a dense model (the scenario's TP8 baseline): two
    # all-reduces a layer as without the section (the MoE path once counted one), the weights
    # within their replicated norms.
    plain = make_cost_model(_scenario(None, nodes=1))
    default = make_cost_model(_scenario({"pipeline_parallel": 1}, nodes=1))
    assert default.work.allreduce_calls == plain.work.allreduce_calls == 160
    for run in (_decode(32, 4096), StepRun.of(ForwardBatch.prefill(8192, 65536))):
        assert default.step_seconds(run) == pytest.approx(plain.step_seconds(run), rel=1e-4)


SHIPPED = ROOT / "scenarios/llama70b_1m_pp_cp.yaml"
CP2 = ("cluster.parallel.pipeline_parallel=1", "cluster.parallel.context_parallel=2")


def _ttfts(overrides: tuple[str, ...] = ()) -> tuple[list[float], Any]:
    res = run_scenario(load_scenario(SHIPPED, overrides))
    assert [s.status for s in res.seqs] == [RequestStatus.FINISHED] * 3
    return [s.first_token_s - s.arrival_s for s in res.seqs], res


def test_shipped_1m_scenario_pp_holds_all_cp_prefills_faster() -> None:
    pp, pp_res = _ttfts()
    cp, cp_res = _ttfts(CP2)
    tp, tp_res = _ttfts(("cluster.parallel.pipeline_parallel=1",))
    assert pp_res.plan.num_blocks * 16 > 3 * 1_048_000 > cp_res.plan.num_blocks * 16 > 2 * 1_048_000
    assert tp_res.plan.num_blocks * 16 < 2 * 1_048_000
    # PP2: the three at once, prefilled in turn at about TP8's speed (chunks not pipelined).
    assert sum(s.preemptions for s in pp_res.seqs) == 0
    assert pp[1] == pytest.approx(2 * pp[0], rel=0.01) and pp[0] == pytest.approx(tp[0], rel=0.01)
    # CP2: each prefill about halved by ring attention (its passes hidden under the compute).
    assert cp[0] == pytest.approx(pp[0] / 2, rel=0.02)
    for res in (pp_res, cp_res, tp_res):
        assert res.record.hbm_peak_bytes <= res.plan.hbm_bytes_per_gpu


def test_shipped_128k_scenario_cp8_answers_first_sooner_at_the_same_throughput() -> None:
    path = ROOT / "scenarios/llama8b_128k_cp.yaml"
    one = run_scenario(load_scenario(path))
    cp8 = run_scenario(load_scenario(path, ("cluster.parallel.context_parallel=8",)))
    assert one.scenario.cluster.num_replicas == 8 and cp8.scenario.cluster.num_replicas == 1
    t1 = sorted(s.first_token_s - s.arrival_s for s in one.seqs)
    t8 = sorted(s.first_token_s - s.arrival_s for s in cp8.seqs)
    assert t8[0] == pytest.approx(t1[0] / 8, rel=0.05)  # a prefill split eight ways over NVLink
    end1 = max(s.finish_s for s in one.seqs)
    end8 = max(s.finish_s for s in cp8.seqs)
    assert end1 < end8 < 1.05 * end1  # the same work, plus the ring's and the combines' time


def test_kv_size_shows_one_gpu_under_pp_and_cp(capsys: pytest.CaptureFixture[str]) -> None:
    from kvsim.cli import main

    argv = ["kv-size", "--model", "llama-3.1-70b", "--gpus", "8", "--format", "bf16"]
    argv += ["--context", "1048576", "--json"]
    assert main([*argv, "--pp", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    (row,) = out["per_gpu"]
    assert out["layout"] == "TP8 x PP2 (16 GPUs)"
    assert row["weight_bytes_per_gpu"] == 8_819_213_312
    assert row["kv_bytes_per_gpu"] == 1_048_576 * KV_PER_TOKEN // 16  # a stage's layers, a TP share
    assert main([*argv, "--cp", "2"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["per_gpu"]
    assert row["weight_bytes_per_gpu"] == 17_638_426_624
    assert row["kv_bytes_per_gpu"] == 1_048_576 * KV_PER_TOKEN // 16  # a rank's half of the sequence


def _llama8b(parallel: dict[str, Any], **cluster: Any):  # type: ignore[no-untyped-def]
    data = {
        "model": "llama-3.1-8b",
        "cluster": {"gpu": "h100-sxm", "gpus_per_node": 4, "parallel": parallel, **cluster},
        "scheduler": {"max_num_seqs": 8, "max_batched_tokens": 512, "chunked_prefill": True},
        "workload": {"synthetic": {"num_requests": 1, "rate": 1}},
        "sim": {"seed": 1},
    }
    return scenario_from_dict(data, source="s.yaml", base_dir=ROOT)


@pytest.mark.parametrize(("pp", "n"), [(2, 1), (2, 8), (4, 3), (4, 16)])
def test_pipelined_chunks_have_gpipes_bubble(pp: int, n: int) -> None:
    # N identical chunks of one prompt, free transfers: N - 1 steps of a stage's share each, the
    # last the whole traversal, so the pipeline's time is (N + PP - 1) stage times.
    fast = {"nvlink": {"bw": "100TB/s", "per_call_overhead": 0}}
    cost = make_cost_model(_llama8b({"pipeline_parallel": pp, "pipeline_chunks": True}, topology=fast))
    assert isinstance(cost, PipelineCostModel)
    mid = StepRun.of(ForwardBatch.prefill(512, 0, sampling=False))
    last = StepRun.of(ForwardBatch.prefill(512, 0, sampling=True))
    o = cost.overhead_s
    stage = (cost.step_seconds(last) - o) / pp
    total = (n - 1) * cost.step_seconds(mid) + cost.step_seconds(last) - n * o
    assert total == pytest.approx((n + pp - 1) * stage, rel=1e-4)
    assert 1 - n * stage / total == pytest.approx((pp - 1) / (n + pp - 1), rel=1e-3)
    _, first = pipeline_schedule(pp, n, stage, 0.0, rounds=2)
    assert total == pytest.approx(first, rel=1e-4)  # one flushed round of N micro-batches


def test_pipelined_chunks_shorten_a_long_prompts_ttft() -> None:
    wl = make_workload([0.0], [8 * 512], [4])
    ttft = {}
    for chunks in (False, True):
        sc = _llama8b({"pipeline_parallel": 4, "pipeline_chunks": chunks})
        ttft[chunks] = run_scenario(sc, workload=wl).seqs[0].first_token_s
    # 8 chunks over 4 stages: (8 + 3) / 4 of one chunk's traversal instead of 8, give or take the
    # attention's growth and the per-step overhead.
    assert ttft[True] < 0.5 * ttft[False]


def test_pipeline_chunks_needs_stages() -> None:
    with pytest.raises(KvsimError, match="pipeline_chunks: pipelines a prompt's chunks"):
        _llama8b({"context_parallel": 2, "pipeline_chunks": True})

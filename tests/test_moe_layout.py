"""MoE layouts (``cluster.parallel``, `kvsim.spec.parallel`, `kvsim.costs.moe`): DeepSeek-V3's
memory per GPU under TP8 and DP8 + EP8 by hand, the all-to-all of a step, and a story: DP attention
holds more requests' KV at once than TP8 can."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from kvsim.core.memory_plan import plan_memory
from kvsim.costs.moe import A2A_EFFICIENCY, A2A_LATENCY_S, MoECostModel
from kvsim.run import make_cost_model, run_scenario
from kvsim.spec.models import PRESETS
from kvsim.spec.parallel import (
    EXPERT_IMBALANCE,
    AttentionParallel,
    ParallelLayout,
    WeightParts,
    remote_ranks_per_token,
    weight_bytes_per_gpu,
)
from kvsim.spec.scenario import scenario_from_dict
from tests.helpers import ROOT, make_workload

V3 = PRESETS["deepseek-v3"]
DP8_EP8 = ParallelLayout(AttentionParallel.DP, 8)
H = 7168  # DeepSeek-V3's hidden size


def _scenario(parallel: dict[str, Any] | None, **extra: Any):  # type: ignore[no-untyped-def]
    cluster: dict[str, Any] = {"gpu": "h200-sxm", "gpus_per_node": 8, "tensor_parallel": 8}
    if parallel is not None:
        cluster["parallel"] = parallel
    data = {
        "model": "deepseek-v3",
        "cluster": cluster,
        "kv": {"block_size": 64, "format": "bf16"},
        "scheduler": {"max_num_seqs": 256, "max_batched_tokens": 16384, "chunked_prefill": True},
        "workload": {"synthetic": {"num_requests": 1, "rate": 1}},
        "sim": {"seed": 1},
        **extra,
    }
    return scenario_from_dict(data, source="v3.yaml", base_dir=ROOT)


def test_deepseek_v3_parameters_by_placement() -> None:
    # Per layer: q_a 7168 x 1536 + its norm 1536, q_b 1536 x 128 x 192, kv_a 7168 x 576 + its norm
    # 512, kv_b 512 x 128 x (128 + 128), o 128 x 128 x 7168.
    attn = 7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256 + 128 * 128 * 7168
    assert attn == 187_107_328
    p = WeightParts.of(V3)
    assert p.attention == 61 * attn == 11_413_547_008
    assert p.routed == 58 * 256 * 3 * H * 2048 == 653_908_770_816
    assert p.shared == 58 * 3 * H * 2048 == 2_554_331_136
    assert p.dense_ffn == 3 * 3 * H * 18432
    assert p.router == 58 * H * 256
    total = p.attention + p.norms + p.dense_ffn + p.routed + p.shared + p.router + p.embeddings
    assert total == V3.num_params == 671_026_404_352  # 671B, as DeepSeek reports (MTP left out)


def test_deepseek_v3_memory_per_gpu_tp8_against_dp8_ep8() -> None:
    # FP8 weights, one byte a parameter. TP8: every weight split by 8.
    assert weight_bytes_per_gpu(V3, 8, None) == math.ceil(671_026_404_352 / 8) == 83_878_300_544
    # DP8 + EP8: attention (11.4 GB) and norms replicated, 32 of 256 routed experts per GPU, the
    # shared expert and router replicated, dense MLPs and embeddings split by 8.
    p = WeightParts.of(V3)
    dp = p.attention + p.norms + (p.dense_ffn + p.embeddings) / 8 + p.routed / 8 + p.shared + p.router
    assert weight_bytes_per_gpu(V3, 8, DP8_EP8) == math.ceil(dp) == 96_194_092_032
    # KV: MLA's latent, 61 layers x (512 + 64) x 2 bytes = 70,272 bytes a token, all of it on each
    # TP rank; under DP each token lives on one GPU (8,784 bytes a GPU on average).
    tp8, dp8 = plan_memory(_scenario(None)), plan_memory(_scenario({"attention": "dp", "expert_parallel": 8}))
    assert tp8.weight_bytes_per_gpu == 83_878_300_544 and dp8.weight_bytes_per_gpu == 96_194_092_032
    assert tp8.kv_bytes_per_token_per_gpu == 70_272 and dp8.kv_bytes_per_token_per_gpu == 70_272 / 8
    assert tp8.activation_reserve_bytes == dp8.activation_reserve_bytes
    block = 70_272 * 64
    assert tp8.num_blocks == tp8.kv_bytes_per_gpu // block == 10_787
    assert dp8.kv_bytes_per_gpu == tp8.kv_bytes_per_gpu - (96_194_092_032 - 83_878_300_544)
    assert dp8.num_blocks == 8 * (dp8.kv_bytes_per_gpu // block) == 64_392  # 5.97x TP8's tokens


def test_all_to_all_of_a_step() -> None:
    # A token's 8 experts of 256, 32 per rank: P(a rank holds none) = C(224, 8) / C(256, 8).
    rr = 7 * (1 - math.comb(224, 8) / math.comb(256, 8))
    assert remote_ranks_per_token(V3, 8) == pytest.approx(4.632820500334669, rel=1e-15) == rr
    cost = make_cost_model(_scenario({"attention": "dp", "expert_parallel": 8}))
    assert isinstance(cost, MoECostModel)
    # 58 MoE layers x (dispatch + combine); a GPU sends its 1/8 of the step's tokens, bf16 hidden,
    # once per remote rank; the busiest rank 1.25x the mean; NVLink 4 450 GB/s at 0.95.
    calls = 2 * 58
    per_token = calls * rr * H * 2 / 8 * EXPERT_IMBALANCE / (450e9 * A2A_EFFICIENCY)
    for n in (1, 256, 16384):
        assert cost.a2a_time(n) == pytest.approx(calls * A2A_LATENCY_S + n * per_token, rel=1e-12)
    # 256 decode tokens: 1.16 ms of latency + 256 x 2.816 us (1.20 MB a token over 427.5 GB/s): 1.88
    # ms, against about 50 ms a step; DP attention drops attention's
    # all-reduces, the 3 dense layers' MLPs keep theirs (gather + scatter).
    assert cost.a2a_time(256) == pytest.approx(1.16e-3 + 256 * 2.81589e-6, rel=1e-5)
    assert cost.work.allreduce_calls == 3


def test_overlap_hides_the_all_to_all_under_the_gemms() -> None:
    base = {"attention": "dp", "expert_parallel": 8}
    plain = make_cost_model(_scenario(base))
    hidden = make_cost_model(_scenario({**base, "overlap_a2a": True}))
    assert isinstance(plain, MoECostModel) and isinstance(hidden, MoECostModel)
    for n in (64, 4096):
        a2a, gemm = plain.a2a_time(n), plain._gemm_time(n, 0)
        saved = plain._comm_time(n) - hidden._comm_time(n)
        assert saved == pytest.approx(min(a2a, gemm), rel=1e-12)


def test_layout_tp_without_ep_prices_as_no_layout_within_rounding() -> None:
    # attention tp, expert_parallel 1: the same split as without the section, norms replicated.
    a, b = make_cost_model(_scenario(None)), make_cost_model(_scenario({"attention": "tp"}))
    assert not isinstance(b, MoECostModel)
    for n in (1, 512, 8192):
        assert b._gemm_time(n, 1) == pytest.approx(a._gemm_time(n, 1), rel=1e-4)
        assert b._comm_time(n) == a._comm_time(n)


def test_dp_attention_holds_more_requests_kv_at_once() -> None:
    # 64 prompts of 20,000 tokens at once, 200 tokens each out: 1.29 M tokens of KV while they
    # decode, over TP8's 690,368 (10,787 blocks of 64) and within DP8's 4.1 M. TP8 preempts, DP8
    # holds them all.
    wl = make_workload([0.0] * 64, [20_000] * 64, [200] * 64)
    tp8 = run_scenario(_scenario(None), workload=wl).summary
    dp8 = run_scenario(_scenario({"attention": "dp", "expert_parallel": 8}), workload=wl).summary
    assert tp8["kv_blocks_per_replica"] == 10_787 and dp8["kv_blocks_per_replica"] == 64_392
    assert tp8["kv_peak_used_blocks"] <= 10_787 < dp8["kv_peak_used_blocks"]
    assert dp8["kv_peak_used_blocks"] >= 64 * math.ceil(20_000 / 64)  # every prompt resident at once
    assert tp8["preemptions"] > 0 == dp8["preemptions"]
    assert tp8["requests"]["completed"] == dp8["requests"]["completed"] == 64


def test_kv_size_shows_one_gpu_under_the_layout(capsys: pytest.CaptureFixture[str]) -> None:
    from kvsim.cli import main

    argv = ["kv-size", "--model", "deepseek-v3", "--gpu", "h200", "--gpus", "8", "--format", "bf16"]
    argv += ["--context", "32768", "--batch", "64", "--json"]
    assert main([*argv, "--attention", "dp", "--ep", "8"]) == 0
    out = json.loads(capsys.readouterr().out)
    (row,) = out["per_gpu"]
    assert out["layout"] == "attention DP8, EP8"
    assert row["weight_bytes_per_gpu"] == 96_194_092_032
    assert row["kv_bytes_per_gpu"] == 8 * 32_768 * 70_272  # 64 sequences, 8 a GPU, whole latents
    assert row["fits"]
    assert main([*argv, "--attention", "tp"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["per_gpu"]
    assert row["kv_bytes_per_gpu"] == 64 * 32_768 * 70_272  # every latent on every TP rank
    assert not row["fits"]
    plain = json.loads((main(argv), capsys.readouterr().out)[1])
    assert "per_gpu" not in plain  # no layout asked
    # The main table judges fit per GPU under TP too: 818 GB "fits" 8 x 141 GB pooled, not per GPU.
    (r,) = plain["rows"]
    assert r["memory_needed_bytes"] < r["gpu_memory_bytes"]
    assert r["memory_needed_per_gpu_bytes"] == -(-r["weight_bytes"] // 8) + 64 * 32_768 * 70_272
    assert not r["fits"]

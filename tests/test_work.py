"""The work of every op (kvsim.costs.work): the one place FLOPs and bytes are counted."""

from __future__ import annotations

import numpy as np
import pytest

from kvsim.core.memory_plan import plan_memory
from kvsim.costs.analytic import AnalyticCostModel
from kvsim.costs.work import (
    BF16,
    ModelWork,
    allreduce_bytes_per_token,
    allreduce_calls,
    attn_flops_per_pair_layer,
    causal_pairs,
    decode_attn_flops_per_pair_layer,
    gemm_bytes,
    gemm_flops,
    kv_bytes_per_token_gpu,
)
from kvsim.spec.models import load_model
from tests.helpers import small_scenario


def test_causal_pairs_count_the_prefix_and_the_triangle():
    assert causal_pairs(1, 0) == 1  # one token attends to itself
    assert causal_pairs(4, 0) == 1 + 2 + 3 + 4
    assert causal_pairs(1, 100) == 101  # a one-token chunk reads its whole prefix, like a decode
    assert causal_pairs(3, 10) == 3 * 10 + 6
    # Vectorised over chunk sizes, the same numbers.
    assert list(causal_pairs(np.array([1, 4]), np.array([100, 0]))) == [101, 10]


def test_kv_share_rounds_heads_up_and_replicates_the_mla_latent():
    llama = load_model("llama-3.1-8b")  # 8 KV heads
    full = kv_bytes_per_token_gpu(llama, BF16, 1)
    assert full == 131072  # ../shared/REFERENCE.md
    assert kv_bytes_per_token_gpu(llama, BF16, 2) == full / 2
    # TP 16 over 8 KV heads: each GPU still holds one whole head (vLLM replicates), 1/8 not 1/16.
    assert kv_bytes_per_token_gpu(llama, BF16, 16) == full / 8
    ds = load_model("deepseek-v3")
    assert kv_bytes_per_token_gpu(ds, BF16, 8) == kv_bytes_per_token_gpu(ds, BF16, 1) == 70272


def test_memory_plan_and_cost_model_use_the_same_kv_share():
    for model, tp in (("llama-3.1-70b", 4), ("deepseek-v3", 8)):
        sc = small_scenario(
            model=model, cluster={"gpu": "h200-sxm", "gpus_per_node": 8, "tensor_parallel": tp}
        )
        plan = plan_memory(sc)
        cm = AnalyticCostModel(sc.model, sc.cluster.gpu, tp, sc.kv.format, sc.cluster.topology)
        assert plan.kv_bytes_per_token_per_gpu == cm.work.kv_bytes_per_token
        assert plan.kv_bytes_per_token_per_gpu == kv_bytes_per_token_gpu(sc.model, sc.kv.format, tp)


def test_attention_flops_per_pair_and_mla_absorbed_decode():
    llama = load_model("llama-3.1-8b")
    # QK^T and PV over 32 query heads of 128 dims, 2 FLOPs per multiply-add.
    assert attn_flops_per_pair_layer(llama, 1) == 2 * 32 * (128 + 128)
    assert attn_flops_per_pair_layer(llama, 4) == attn_flops_per_pair_layer(llama, 1) / 4
    assert decode_attn_flops_per_pair_layer(llama, 1) == attn_flops_per_pair_layer(llama, 1)
    ds = load_model("deepseek-v3")  # 128 heads, nope 128 + rope 64, v 128, latent 512
    assert attn_flops_per_pair_layer(ds, 1) == 2 * 128 * (128 + 64 + 128)
    # Absorbed decode attends over the latent: more FLOPs per pair than the unabsorbed prefill.
    assert decode_attn_flops_per_pair_layer(ds, 1) == 2 * 128 * (2 * 512 + 64)
    assert decode_attn_flops_per_pair_layer(ds, 1) > attn_flops_per_pair_layer(ds, 1)


def test_gemm_and_allreduce_work():
    assert gemm_flops(3, 5, 7) == 2 * 3 * 5 * 7
    assert gemm_bytes(3, 5, 7) == 2 * (3 * 7 + 7 * 5 + 3 * 5)
    assert gemm_bytes(3, 5, 7, operand_bytes=1) == (3 * 7 + 7 * 5) + 2 * 3 * 5  # fp8 operands
    llama = load_model("llama-3.1-8b")
    assert allreduce_calls(llama, 1) == 0 and allreduce_bytes_per_token(llama, 1) == 0.0
    assert allreduce_calls(llama, 2) == 64
    # Ring all-reduce: 2 (tp - 1) / tp of the bf16 hidden state per token; grows with tp towards 2x.
    assert allreduce_bytes_per_token(llama, 2) == 2 * 4096 * 2 * 1 / 2
    assert allreduce_bytes_per_token(llama, 8) > allreduce_bytes_per_token(llama, 2)


def test_model_work_of_a_step_grows_with_its_tokens():
    w = ModelWork.of(load_model("llama-3.1-8b"), 1, BF16)
    assert w.gemm_flops(2, 1) > w.gemm_flops(1, 1) > w.gemm_flops(1, 0)
    assert w.prefill_attn_flops(8, 0) == w.attn_flops_per_pair * 36
    assert w.prefill_kv_bytes(8, 100) == 108 * w.kv_bytes_per_token
    assert w.weight_bytes(1) == w.weight_bytes(1000)  # a dense model streams its weights once
    moe = ModelWork.of(load_model("deepseek-v3"), 8, BF16)
    assert moe.weight_bytes(1) < moe.weight_bytes(16) < moe.weight_bytes(4096)
    assert moe.weight_bytes(10**6) == pytest.approx(moe.dense_weight_bytes + moe.moe_expert_bytes)


def test_calibrator_points_carry_the_same_work():
    torch = pytest.importorskip("torch")
    del torch
    from calibrate.ops import make_grid, points

    model = load_model("llama-3.1-8b")
    grid = make_grid("cpu", True, None)
    pre = next(iter(points("chunked_prefill", grid, model, 2, "cpu")))
    n, p = pre.params["chunk"], pre.params["prefix"]
    assert pre.flops == attn_flops_per_pair_layer(model, 2) * causal_pairs(n, p)
    assert attn_flops_per_pair_layer(model, 2) == 2 * 16 * 256  # tp 2: half the query heads

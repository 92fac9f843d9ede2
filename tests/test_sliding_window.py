"""Sliding-window layers free their out-of-window blocks (`kvsim.core.eviction.window_eviction`):
held blocks as a closed form of length, freed blocks back to the pool, attention priced on the
window, prefix entries given up, and the combinations refused. Direction and size, exact numbers."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from kvsim.core.eviction import EvictionKind, blocks_for, window_eviction
from kvsim.core.kv_cache_manager import KVCacheManager
from kvsim.core.request import Request
from kvsim.core.sched.scheduler import Scheduler
from kvsim.costs.base import ForwardBatch
from kvsim.costs.work import BF16, ModelWork, causal_pairs, window_pairs
from kvsim.run import make_cost_model, run_scenario
from kvsim.spec.models import PRESETS
from kvsim.spec.scenario import scenario_from_dict
from tests.helpers import ROOT, make_workload, records

MISTRAL = PRESETS["mistral-7b"]  # window 4,096 on all 32 layers
HYBRID = dataclasses.replace(MISTRAL, sliding_window_layers=16)  # half the layers windowed
BLOCK_BYTES = 16 * 131072  # 16 tokens x 128 KiB of bf16 KV (32 layers x 8 heads x 128 x 2 x 2)


def _scenario(model: Any, num_blocks: int, **sections: Any):  # type: ignore[no-untyped-def]
    """Mistral-7B (or an override of it) on one H100 whose pool has exactly `num_blocks` blocks."""
    hbm = MISTRAL.weight_bytes + num_blocks * BLOCK_BYTES + BLOCK_BYTES // 2
    data: dict[str, Any] = {
        "model": model,
        "cluster": {
            "gpu": {"preset": "h100-sxm", "hbm": hbm},
            "gpus_per_node": 1,
            "gpu_memory_utilization": 1.0,
            "activation_reserve": 0,
        },
        "workload": {"synthetic": {"num_requests": 1, "rate": 1}},
        "sim": {"seed": 1},
        **sections,
    }
    sc = scenario_from_dict(data, source="test.yaml", base_dir=ROOT)
    return sc


FULL = {"name": "mistral-7b", "sliding_window": 0}  # the same model keeping every token


def test_held_blocks_are_a_closed_form_of_length():
    w = window_eviction(MISTRAL)
    assert w is not None and w.kind is EvictionKind.WINDOW
    assert window_eviction(PRESETS["llama-3.1-8b"]) is None
    # Every layer windowed: 4,096 tokens kept past the window, 257 blocks for the next token's slot
    # (not 513 at 8,192 tokens).
    assert [w.kept(p) for p in (100, 4096, 4097, 8192, 100_000)] == [100, 4096, 4096, 4096, 4096]
    assert blocks_for(w.kept(8192), 16) == 257
    # Half the layers windowed: (16 x 8192 + 16 x 4096) / 32 = 6,144 kept, 385 blocks: half-way
    # between 257 and 513.
    h = window_eviction(HYBRID)
    assert h is not None
    assert h.kept(8192) == 6144 and blocks_for(h.kept(8192), 16) == 385 == (257 + 513 + 1) // 2
    assert h.kept(4097) == 4097  # ceil((16 x 4097 + 16 x 4096) / 32): rounded up
    # Global tokens widen the window.
    g = window_eviction(dataclasses.replace(MISTRAL, global_tokens=4))
    assert g is not None and g.kept(8192) == 4100
    pos = np.arange(0, 10_000, dtype=np.int64)
    for e in (w, h, g):
        assert e.kept_array(pos).tolist() == [e.kept(int(p)) for p in pos]
        assert np.diff(e.kept_array(pos)).min() >= 0 and np.diff(e.kept_array(pos)).max() <= 1


def test_a_request_frees_its_out_of_window_blocks_after_the_prompt():
    kv = KVCacheManager(2000, 16)
    kv.set_eviction(window_eviction(MISTRAL))
    sched = Scheduler(kv, max_num_seqs=8, max_batched_tokens=8192, chunked_prefill=True)
    req = Request(0, 0.0, 8192, 10, [], [])
    sched.add(req)
    plan = sched.schedule()
    assert req.num_blocks == 512  # the prompt's blocks, held while it prefills
    sched.advance(plan)
    # After the prompt: 4,096 tokens out of the window, blocks down to 257, 255 back in the pool.
    assert (req.num_blocks, req.evicted, kv.blocks_released) == (257, 4096, 255)
    assert kv.num_free_blocks == 2000 - 257
    for _ in range(5):
        plan = sched.schedule()
        assert plan.decode_ctx == [4096]  # attention reads the window
        sched.advance(plan)
        assert req.num_blocks == 257  # one token in, one out: the slot is reused
    assert req.evicted == 4096 + 5


def test_a_chunked_prompt_frees_its_out_of_window_blocks_between_chunks():
    kv = KVCacheManager(3000, 16)
    kv.set_eviction(window_eviction(MISTRAL))
    sched = Scheduler(kv, max_num_seqs=8, max_batched_tokens=8192, chunked_prefill=True)
    req = Request(0, 0.0, 32_000, 10, [], [])
    sched.add(req)
    held = []
    while not req.num_generated:
        plan = sched.schedule()
        held.append(req.num_blocks)  # during the step
        sched.advance(plan)
    # The first chunk's 8,192 tokens (512 blocks); then each chunk writes into the window's 4,096
    # kept tokens plus its own 8,192: 768 blocks, never the 2,000 of the whole prompt; the last
    # chunk of 7,424 tokens: ceil((4,096 + 7,424) / 16) = 720.
    assert held == [512, 768, 768, 720]
    assert kv.peak_used_blocks == 768 and req.num_blocks == 257


def test_a_prompt_longer_than_the_pool_runs_with_a_window():
    # 30,000 prompt tokens on a pool of 1,000 blocks (16,000 tokens): kept whole it cannot fit and is
    # rejected; windowed it needs at most 4,096 kept + 8,192 new tokens (768 blocks) at once.
    wl = make_workload([0.0], [30_000], [100])
    full = run_scenario(_scenario(FULL, 1000), workload=wl).summary
    win = run_scenario(_scenario("mistral-7b", 1000), workload=wl).summary
    assert full["requests"]["rejected"] == 1 and win["requests"]["completed"] == 1
    assert win["kv_peak_used_blocks"] == 768


def test_hybrid_model_holds_half_way():
    kv = KVCacheManager(2000, 16)
    kv.set_eviction(window_eviction(HYBRID))
    sched = Scheduler(kv, max_num_seqs=8, max_batched_tokens=8192, chunked_prefill=True)
    req = Request(0, 0.0, 8192, 40, [], [])
    sched.add(req)
    sched.advance(sched.schedule())
    assert (req.num_blocks, req.evicted) == (385, 8192 - 6144)
    for _ in range(32):
        sched.advance(sched.schedule())
    # 32 tokens later: ceil((16 x 8224 + 16 x 4096) / 32) = 6,160 kept, ceil(6161 / 16) = 386 blocks.
    assert (req.num_computed - req.evicted, req.num_blocks) == (6160, 386)


def test_more_sequences_fit_and_peak_memory_falls():
    # Four 6,000-token prompts with 3,000-token answers on a pool of 1,200 blocks: kept whole, each
    # ends at 563 blocks and the pool holds two; windowed, each holds 257 once its prompt is done.
    wl = make_workload([0.0] * 4, [6000] * 4, [3000] * 4)
    win = run_scenario(_scenario("mistral-7b", 1200), workload=wl).summary
    full = run_scenario(_scenario(FULL, 1200), workload=wl).summary
    assert full["preemptions"] == 1 and win["preemptions"] == 0
    assert win["requests"]["completed"] == full["requests"]["completed"] == 4
    assert win["kv_peak_used_blocks"] < full["kv_peak_used_blocks"] == 1200
    assert win["hbm_peak_bytes"] < full["hbm_peak_bytes"]
    # Each request freed 375 - 257 = 118 blocks after its prompt.
    assert win["sliding_window"]["blocks_freed"] == 4 * (375 - 257)
    assert full["sliding_window"] is None
    assert win["tpot_s"]["mean"] < full["tpot_s"]["mean"]  # fewer tokens attended, no recompute


def test_attention_is_priced_on_the_window():
    sc = _scenario("mistral-7b", 1000)
    cost = make_cost_model(sc)
    full = make_cost_model(_scenario(FULL, 1000))
    # Prefill: 4,096 x 4,097 / 2 pairs up to the window, then 4,096 a query (25,167,872), not
    # 8,192 x 8,193 / 2 (33,558,528).
    assert window_pairs(8192, 0, 4096) == 25_167_872 and causal_pairs(8192, 0) == 33_558_528
    w_win = ModelWork.of(MISTRAL, 1, BF16)
    w_full = ModelWork.of(dataclasses.replace(MISTRAL, sliding_window=0), 1, BF16)
    assert w_win.prefill_attn_flops(8192, 0) / w_full.prefill_attn_flops(8192, 0) == 25_167_872 / 33_558_528
    # A later chunk reads the window of its prefix only.
    assert w_win.prefill_kv_bytes(2048, 8192) == (4096 + 2048) * w_win.kv_bytes_per_token
    assert cost.price(ForwardBatch.prefill(8192)).seconds < full.price(ForwardBatch.prefill(8192)).seconds
    # Short sequences are unaffected.
    assert cost.price(ForwardBatch.prefill(2048)).seconds == full.price(ForwardBatch.prefill(2048)).seconds
    # Decode reads the resident tokens the scheduler passes (the window): 4,096, not 8,192.
    assert cost.price(ForwardBatch.decode([4096])).seconds < full.price(ForwardBatch.decode([8192])).seconds


def test_blocks_out_of_the_window_are_no_prefix_hits():
    # Two requests with the same 8,192-token prompt, the second after the first has finished: kept
    # whole, the second hits 8,176 tokens of it; windowed, the first gave its entries up.
    ids = [list(range(16))] * 2  # 16 trace blocks of 512 tokens
    wl = make_workload([0.0, 30.0], [8192, 8192], [4, 4], hash_ids=ids, block_tokens=512)
    full = run_scenario(_scenario(FULL, 2000), workload=wl)
    win = run_scenario(_scenario("mistral-7b", 2000), workload=wl)
    assert [s.num_cached_tokens for s in full.seqs] == [0, 8176]
    assert [s.num_cached_tokens for s in win.seqs] == [0, 0]
    assert win.summary["sliding_window"]["cache_entries_invalidated"] == 2 * 16


def test_fast_forward_equals_stepping_with_windows():
    rng = np.random.default_rng(3)
    n = 40
    wl = make_workload(
        np.cumsum(rng.exponential(0.3, n)).tolist(),
        rng.integers(100, 9000, n).tolist(),
        rng.integers(1, 600, n).tolist(),
    )
    for model in ("mistral-7b", {"name": "mistral-7b", "sliding_window_layers": 16, "global_tokens": 4}):
        runs = []
        for ff in (True, False):
            sc = _scenario(model, 3000)
            sc = dataclasses.replace(sc, sim=dataclasses.replace(sc.sim, fast_forward=ff))
            runs.append(run_scenario(sc, workload=wl))
        a, b = runs
        assert records(a) == records(b)
        assert a.summary["sliding_window"] == b.summary["sliding_window"]
        assert a.summary["kv_peak_used_blocks"] == b.summary["kv_peak_used_blocks"]
        assert a.summary["sliding_window"]["blocks_freed"] > 0
        assert a.summary["engine_events"] < b.summary["engine_events"]  # windows did run

"""A format switch past a context length (``kv.format_switch``): held blocks as a closed form of
length, the crossing's re-quantization priced and its blocks freed, switched sequences priced in
the second format, its accuracy estimate shown. Direction and size, exact numbers."""

from __future__ import annotations

import dataclasses

import numpy as np

from kvsim.core.eviction import EvictionKind, EvictionWork, blocks_for, switch_eviction
from kvsim.core.kv_cache_manager import KVCacheManager
from kvsim.core.request import Request
from kvsim.core.sched.scheduler import Scheduler
from kvsim.costs.analytic import TRIM_LAUNCH_S, TRIM_LAUNCHES, AnalyticCostModel
from kvsim.costs.base import ForwardBatch
from kvsim.run import make_cost_model, run_scenario
from tests.helpers import make_workload, records, small_scenario

SWITCH = {"format": "fp8", "format_switch": {"after_tokens": 1000, "format": "kvquant4"}}
# Llama-3.1-8B: 32 layers x 8 KV heads x K and V; fp8 128 bytes a vector (65,536 a token),
# kvquant4/1% 64 packed + 2 scale + 2 outliers x 4 = 74 (37,888 a token): b2 / b1 = 37 / 64.
B1, B2 = 65_536, 37_888


def _switch(sc):  # type: ignore[no-untyped-def]
    ev = switch_eviction(sc.model, sc.kv.format, sc.kv.format_switch)
    assert ev is not None
    return ev


def test_held_blocks_are_a_closed_form_of_length():
    sc = small_scenario(kv=SWITCH)
    ev = _switch(sc)
    assert ev.kind is EvictionKind.SWITCH and (ev.switch_num, ev.switch_den) == (37, 64)
    assert sc.model.kv_bytes_per_token(sc.kv.format) == B1
    assert sc.model.kv_bytes_per_token(sc.kv.format_switch.format) == B2
    # Up to 1,000 tokens every token in fp8; past it ceil(n x 37 / 64) fp8 token slots.
    assert [ev.kept(p) for p in (10, 1000, 1001, 3000, 100_000)] == [10, 1000, 579, 1735, 57_813]
    assert blocks_for(ev.kept(3000), 16) == 109  # not 188
    assert switch_eviction(sc.model, sc.kv.format, None) is None
    pos = np.arange(0, 5000, dtype=np.int64)
    assert ev.kept_array(pos).tolist() == [ev.kept(int(p)) for p in pos]
    assert np.diff(ev.kept_array(pos[1001:])).max() <= 1  # grows by at most a slot a token past N


def test_the_crossing_requantizes_and_frees_blocks():
    sc = small_scenario(kv=SWITCH)
    kv = KVCacheManager(1000, 16)
    kv.set_eviction(_switch(sc))
    sched = Scheduler(kv, max_num_seqs=8, max_batched_tokens=4096, chunked_prefill=True)
    long, short = Request(0, 0.0, 3000, 10, [], []), Request(1, 0.0, 990, 30, [], [])
    sched.add(long)
    sched.add(short)
    plan = sched.schedule()
    assert (long.num_blocks, short.num_blocks) == (188, 62)
    sched.advance(plan)
    # The 3,000-token prompt is re-quantized whole after it is computed: 188 blocks down to 109.
    assert (long.num_blocks, long.evicted, kv.blocks_released) == (109, 3000 - 1735, 79)
    assert kv.take_eviction_work().requant_tokens == 3000
    plan = sched.schedule()
    assert plan.decode_ctx == [1735, 990] and (plan.decode_switched, plan.decode_switched_ctx) == (1, 1735)
    sched.advance(plan)
    for _ in range(10):  # the short one passes 1,000 tokens after its 11th token
        sched.advance(sched.schedule())
    assert short.evicted == 1001 - 579 and short.num_blocks == blocks_for(579, 16) == 37
    assert kv.tokens_requantized == 3000 + 1001 and kv.switched_ids == {0, 1}


def test_requantization_and_switched_decodes_are_priced_in_the_second_format():
    sc = small_scenario(kv=SWITCH)
    cost = make_cost_model(sc)
    assert isinstance(cost, AnalyticCostModel)
    # The crossing: 3,000 tokens read in fp8 and written in kvquant4 (65,536 + 37,888 bytes each),
    # fp8's 2 and kvquant4's 34 vector operations per element (65,536 elements a token).
    t = cost.eviction_time(EvictionWork(trims=1, requant_tokens=3000))
    table_only = cost.eviction_time(EvictionWork(trims=1))
    e, gpu = cost.eff, sc.cluster.gpu
    requant = max(
        3000 * (B1 + B2) / (gpu.hbm_bw_bytes_per_s * e.kv_write_bw),
        3000 * 65_536 * 36 / (gpu.bf16_flops * e.vector_flops_fraction),
    )
    assert table_only == TRIM_LAUNCHES * TRIM_LAUNCH_S
    assert abs(t - TRIM_LAUNCHES * TRIM_LAUNCH_S - requant) <= 1e-15
    # A switched decode reads its 1,736 slots' worth of real tokens (x 64 / 37) at kvquant4's speed
    # and writes its new token in kvquant4: as a kvquant4 cache of the same real tokens would.
    q = make_cost_model(small_scenario(kv={"format": "kvquant4"}))
    assert isinstance(q, AnalyticCostModel)
    assert abs(cost.switch_s_per_slot - q.decode_attn_s_per_token * 64 / 37) <= 1e-12 * cost.switch_s_per_slot
    assert cost.switch_write_s_per_token == q.write_s_per_token
    sw = cost.price(ForwardBatch((ForwardBatch.decode([1735]).kinds), (1,), (1735,), 1, 1, 1735))
    plain = cost.price(ForwardBatch.decode([1735]))  # the same slots in fp8
    assert sw.seconds > plain.seconds  # kvquant4: 1.7x over bf16 where fp8 is 1.6x, on 1.73x the tokens
    # Fast-forward's vector form equals `price`.
    v = cost.decode_step_times(3, np.array([5000]), 1, np.array([1735]))
    b = cost.price(
        ForwardBatch((ForwardBatch.decode([1]).kinds[0],) * 3, (1, 1, 1), (1735, 1600, 1665), 3, 1, 1735)
    )
    assert float(v[0]) == b.seconds


def test_long_sequences_fit_better_and_accuracy_is_shown():
    # Eight 3,000-token prompts with 1,500-token answers on 1,601 fp8 blocks (800 of bf16): fp8
    # throughout each ends at 282 blocks (preemptions); switched past 1,000 tokens, at
    # ceil((ceil(4,499 x 37 / 64) + 1) / 16) = 163.
    wl = make_workload([0.0] * 8, [3000] * 8, [1500] * 8)
    fp8 = run_scenario(small_scenario(num_blocks=800, kv={"format": "fp8"}), workload=wl).summary
    sw = run_scenario(small_scenario(num_blocks=800, kv=SWITCH), workload=wl).summary
    assert fp8["format_switch"] is None
    assert (fp8["preemptions"], sw["preemptions"]) == (3, 0)
    assert fp8["kv_peak_used_blocks"] == 1601 and sw["kv_peak_used_blocks"] == 8 * 163
    assert sw["tpot_s"]["mean"] < fp8["tpot_s"]["mean"]
    f = sw["format_switch"]
    assert f["after_tokens"] == 1000 and f["format"] == "kvquant4/1.0%"
    assert (f["requests_switched"], f["switches"], f["tokens_requantized"]) == (8, 8, 8 * 3000)
    assert f["blocks_freed"] == 8 * (188 - 109) and f["requant_s"] > 0
    acc = f["accuracy"]
    assert acc["estimate_only"] is True and acc["format"] == "kvquant4/1.0%"
    assert "past 1,000 tokens" in acc["note"]
    assert any("500K" in c["claim"] for c in acc["literature"])


def test_fast_forward_equals_stepping_with_a_switch():
    rng = np.random.default_rng(5)
    n = 40
    wl = make_workload(
        np.cumsum(rng.exponential(0.2, n)).tolist(),
        rng.integers(50, 3000, n).tolist(),
        rng.integers(1, 800, n).tolist(),
    )
    for kv in (SWITCH, {"format": "bf16", "format_switch": {"after_tokens": 700, "format": "int4"}}):
        runs = []
        for ff in (True, False):
            sc = small_scenario(num_blocks=2500, kv=kv)
            sc = dataclasses.replace(sc, sim=dataclasses.replace(sc.sim, fast_forward=ff))
            runs.append(run_scenario(sc, workload=wl))
        a, b = runs
        assert records(a) == records(b)
        assert a.summary["format_switch"] == b.summary["format_switch"]
        assert a.summary["kv_peak_used_blocks"] == b.summary["kv_peak_used_blocks"]
        assert a.summary["format_switch"]["switches"] > 0
        assert a.summary["engine_events"] < b.summary["engine_events"]


def test_a_measured_profile_prices_switched_decodes_at_its_second_format_rates():
    # The shipped H200 profile has bf16 and fp8 decode points: bf16 switched to fp8 past 1,000 tokens.
    kv = {"format": "bf16", "format_switch": {"after_tokens": 1000, "format": "fp8"}}
    prof = {
        "kind": "profile",
        "profile": "scenarios/profiles/aiconfigurator-h200_sxm-vllm-llama-3.1-8b-tp1.json",
    }
    sc = small_scenario(kv=kv, cluster={"gpu": "h200-sxm"}, cost_model=prof)
    cost = make_cost_model(sc)
    fp8 = make_cost_model(small_scenario(kv={"format": "fp8"}, cluster={"gpu": "h200-sxm"}, cost_model=prof))
    # One switched sequence of 1,500 fp8 slots (b2 / b1 = 1 / 2: 1,000 bf16 slots) decodes as fp8 would.
    kinds = ForwardBatch.decode([1]).kinds
    sw = cost._decode_part(1, np.array([999.0]), 1, np.array([999.0]))
    assert sw[0] == fp8._decode_attn_time(1, np.array([1999.0]))[0]
    # Two sequences, one switched: the plain one as a batch of its own, plus the switched one.
    both = cost._decode_part(2, np.array([2999.0]), 1, np.array([999.0]))
    assert both[0] == cost._decode_attn_time(1, np.array([2000.0]))[0] + sw[0]
    assert cost.price(ForwardBatch(kinds * 2, (1, 1), (2000, 999), 2, 1, 999)).seconds == float(
        cost.decode_step_times(2, np.array([2999]), 1, np.array([999]))[0]
    )
    wl = make_workload([0.0, 0.1, 0.3], [3000, 500, 1200], [300, 900, 50])
    runs = []
    for ff in (True, False):
        s = dataclasses.replace(sc, sim=dataclasses.replace(sc.sim, fast_forward=ff))
        runs.append(run_scenario(s, workload=wl))
    assert records(runs[0]) == records(runs[1]) and runs[0].summary["format_switch"]["switches"] == 3

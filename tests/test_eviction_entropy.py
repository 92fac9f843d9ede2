"""Attention-entropy token eviction (kv.eviction.policy: entropy): H2O's closed form with its own
kept share (``keep_ratio``), blocks freed in a run, its per-step statistics priced without H2O's K
re-read (the documented difference), its cited accuracy estimate, and fast-forward equal to
stepping. Exact numbers where possible."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from kvsim.core.eviction import Eviction, EvictionKind, EvictionWork, eviction_from_config
from kvsim.costs.analytic import AnalyticCostModel
from kvsim.costs.base import ForwardBatch
from kvsim.costs.work import causal_pairs
from kvsim.run import make_cost_model, run_scenario
from tests.helpers import make_workload, records, small_scenario
from tests.test_eviction import _loaded, _one

ENT = {"policy": "entropy", "keep_ratio": 0.25, "recent_tokens": 64, "pages": "physical"}
H2O = {"policy": "h2o", "heavy_ratio": 0.25, "recent_tokens": 64, "pages": "physical"}
HEADS = 8 * 32  # Llama-3.1-8B: 8 KV heads x 32 layers, tp 1
KV_BYTES = 131072  # bf16 KV bytes per token, all layers


def test_kept_is_the_recent_window_plus_the_share_below_the_threshold():
    e = Eviction(EvictionKind.ENTROPY, keep_ratio=0.25, recent_tokens=64)
    # min(p, 64 + ceil(0.25 p)): every token up to 86, then 64 + 250, 64 + 750, 64 + 800.
    assert [e.kept(p) for p in (10, 80, 86, 87, 1000, 3000, 3198)] == [10, 80, 86, 86, 314, 814, 864]
    assert e.keeps_all_up_to == 86
    capped = dataclasses.replace(e, budget_tokens=500)
    assert capped.kept(3000) == 500 and capped.kept(1000) == 314
    # The share is keep_ratio, not heavy_ratio (which only H2O reads).
    assert dataclasses.replace(e, heavy_ratio=0.9).kept(3000) == 814
    assert Eviction(EvictionKind.H2O, heavy_ratio=0.25, recent_tokens=64).kept(3000) == 814
    pos = np.arange(0, 5000, dtype=np.int64)
    for ev in (e, capped):
        assert ev.kept_array(pos).tolist() == [ev.kept(int(p)) for p in pos]
        assert np.diff(ev.kept_array(pos)).max() <= 1
    assert e.scores()  # a trim ranks its statistics (top-k, as H2O)


def test_the_scenario_reads_keep_ratio():
    sc = small_scenario(kv={"eviction": {**ENT, "keep_ratio": 0.4, "budget_tokens": 900}})
    ev = eviction_from_config(sc.kv.eviction)
    assert ev is not None and ev.kind is EvictionKind.ENTROPY
    assert (ev.keep_ratio, ev.budget_tokens, ev.recent_tokens) == (0.4, 900, 64)
    assert small_scenario(kv={"eviction": {"policy": "entropy"}}).kv.eviction.keep_ratio == 0.25


def test_one_request_keeps_its_share_frees_blocks_and_decodes_on_resident_tokens():
    sc, res = _one(ENT)
    s = res.summary
    ev = eviction_from_config(sc.kv.eviction)
    assert ev is not None
    # Stepping evicts after every step but the last: at its end it had computed 3198 tokens.
    assert s["eviction"]["tokens_evicted"] == 3198 - ev.kept(3198) == 3198 - 864
    assert s["eviction"]["trims"] == 1
    # The trim after the prompt: 188 blocks down to what 814 kept tokens + the next need (51).
    assert s["eviction"]["blocks_released"] == 188 - math.ceil(815 / 16) == 137
    assert s["eviction"]["policy"] == "entropy"
    assert s["eviction"]["keep_ratio"] == 0.25 and s["eviction"]["heavy_ratio"] is None
    cm = make_cost_model(sc)
    steps = sum(cm.step_time(ForwardBatch.decode([ev.kept(c)])) for c in range(3000, 3199))
    seq = res.seqs[0]
    assert seq.finish_s - seq.first_token_s == pytest.approx(s["eviction"]["trim_s"] + steps, rel=1e-12)
    # Fewer blocks than without eviction; the same tokens as H2O at the same share, sooner.
    _, plain = _one(None)
    _, h2o = _one(H2O)
    mean = lambda r: r.summary["replicas"][0]["kv_mean_used_blocks"]  # noqa: E731
    assert mean(res) < mean(plain)
    assert s["eviction"]["tokens_evicted"] == h2o.summary["eviction"]["tokens_evicted"]
    assert s["eviction"]["blocks_released"] == h2o.summary["eviction"]["blocks_released"]
    assert seq.finish_s < h2o.seqs[0].finish_s


def test_entropy_statistics_cost_less_than_h2o_scores_by_the_k_re_read():
    plain = make_cost_model(small_scenario())
    ent = make_cost_model(small_scenario(kv={"eviction": ENT}))
    h2o = make_cost_model(small_scenario(kv={"eviction": H2O}))
    assert isinstance(ent, AnalyticCostModel) and isinstance(h2o, AnalyticCostModel)
    rate = plain.gpu.hbm_bw_bytes_per_s * plain.ops.decode_attn.e_max
    ctx = np.array([64 * 1000.0])
    tokens = 64 * 1000 + 64
    extra_ent = ent._decode_attn_time(64, ctx)[0] - plain._decode_attn_time(64, ctx)[0]
    extra_h2o = h2o._decode_attn_time(64, ctx)[0] - plain._decode_attn_time(64, ctx)[0]
    # Entropy: 12 B of fp32 statistics per KV head and layer (bytes-bound: its 4 FLOPs per logit,
    # 4 x 32 heads x 32 layers, at 1/15 of the BF16 rate take 0.06 of that time).
    assert extra_ent == pytest.approx(tokens * 12 * HEADS / rate, rel=1e-9)
    assert 4 * 32 * 32 / (plain.gpu.bf16_flops / 15) < 0.07 * 12 * HEADS / rate
    # H2O pays the K re-read on top: half the cache's bytes per token.
    assert extra_h2o - extra_ent == pytest.approx(tokens * (KV_BYTES / 2) / rate, rel=1e-9)
    assert extra_ent / extra_h2o == pytest.approx(3072 / 68608, rel=1e-9)
    # A prompt's statistics: 4 vector FLOPs per head and layer for each attended pair.
    assert ent.prefill_score_time(3000, 0) == pytest.approx(
        causal_pairs(3000, 0) * 4 * 32 * 32 / (plain.gpu.bf16_flops / 15), rel=1e-12
    )
    assert 0 < ent.prefill_score_time(3000, 0) < h2o.prefill_score_time(3000, 0)
    # A trim's top-k is H2O's.
    work = EvictionWork(1, 3000, 664, 100)
    assert ent.eviction_time(work) == h2o.eviction_time(work)


def test_the_cited_accuracy_estimate():
    _, res = _one(ENT, output=20)
    acc = res.summary["eviction"]["accuracy"]
    assert acc["estimate_only"] is True
    assert acc["format"] == "entropy 25% below the threshold + 64 recent"
    claim = acc["literature"][0]
    assert "-0.8% on RULER-1M" in claim["claim"]
    assert claim["source"] == "design documents 000, section 4.2 (table)"


@pytest.mark.parametrize(
    "ev",
    [
        ENT,
        {**ENT, "pages": "soft_mark", "budget_tokens": 400},
        {**ENT, "pages": "hybrid", "pressure_threshold": 0.6},
        {**ENT, "trigger": "pressure", "pressure_threshold": 0.7},
    ],
)
def test_fast_forward_equals_stepping_with_entropy_under_load(ev):
    a, b = _loaded(ev, True), _loaded(ev, False)
    assert records(a) == records(b)
    assert a.summary["eviction"] == b.summary["eviction"]
    for key in ("kv_peak_used_blocks", "hbm_peak_bytes", "simulated_s", "preemptions"):
        assert a.summary[key] == b.summary[key], key
    assert a.summary["engine_events"] < b.summary["engine_events"]


def test_entropy_under_memory_pressure_fits_more_and_preempts_less():
    plain, ent = _loaded(None, True).summary, _loaded(ENT, True).summary
    assert plain["requests"]["completed"] == ent["requests"]["completed"] == 150
    assert ent["preemptions"] < plain["preemptions"]
    assert ent["simulated_s"] < plain["simulated_s"]


def test_the_report_shows_the_share(tmp_path):
    from kvsim.report import write_report
    from kvsim.run import write_run

    sc = small_scenario(kv={"eviction": ENT})
    write_run(run_scenario(sc, workload=make_workload([0.0], [3000], [20])), tmp_path)
    html = write_report(tmp_path).read_text()
    assert "share kept below the entropy threshold" in html and "-0.8% on RULER-1M" in html

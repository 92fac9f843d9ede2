"""Token eviction in the engine (kv.eviction): closed-form resident tokens, blocks freed or kept by
page policy, attention priced on resident tokens, trims priced, prefix entries invalidated, the
pressure trigger, and fast-forward equal to stepping. Direction and size, exact where possible."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from kvsim.core.block_hash import PRIVATE_ENTRY_BLOCKS
from kvsim.core.eviction import (
    Eviction,
    EvictionKind,
    EvictionWork,
    PagePolicy,
    Trigger,
    eviction_from_config,
)
from kvsim.costs.analytic import AnalyticCostModel
from kvsim.costs.base import ForwardBatch
from kvsim.run import make_cost_model, run_scenario
from tests.helpers import make_workload, records, small_scenario

H2O = {"policy": "h2o", "heavy_ratio": 0.2, "recent_tokens": 64, "pages": "physical"}


def _one(ev: dict | None, prompt: int = 3000, output: int = 200, **kw):  # type: ignore[no-untyped-def]
    kv = {"eviction": ev} if ev else {}
    sc = small_scenario(kv=kv, **kw)
    return sc, run_scenario(sc, workload=make_workload([0.0], [prompt], [output]))


def test_kept_is_closed_form():
    h = Eviction(EvictionKind.H2O, heavy_ratio=0.2, recent_tokens=64)
    assert [h.kept(p) for p in (10, 80, 1000, 3000)] == [10, 80, 264, 664]
    capped = dataclasses.replace(h, budget_tokens=300)
    assert capped.kept(3000) == 300 and capped.kept(1000) == 264
    s = Eviction(EvictionKind.STREAMING, sink_tokens=4, recent_tokens=256)
    assert [s.kept(p) for p in (100, 260, 5000)] == [100, 260, 260]
    pos = np.arange(0, 5000, dtype=np.int64)
    for e in (h, capped, s):
        assert e.kept_array(pos).tolist() == [e.kept(int(p)) for p in pos]
        assert np.diff(e.kept_array(pos)).max() <= 1  # at most one more token kept per token added


def test_one_request_keeps_its_budget_frees_blocks_and_decodes_on_resident_tokens():
    sc, res = _one(H2O)
    s = res.summary
    ev = eviction_from_config(sc.kv.eviction)
    assert ev is not None
    # Stepping evicts after every step but the last: at its end it had computed 3198 tokens.
    assert s["eviction"]["tokens_evicted"] == 3198 - ev.kept(3198) == 3198 - 704
    assert s["eviction"]["trims"] == 1  # the prompt's, then one out per token in
    # The trim after the prompt: 188 blocks down to what 664 kept tokens + the next need (42).
    assert s["eviction"]["blocks_released"] == 188 - math.ceil(665 / 16)
    # Its prompt's 187 full blocks, cached under its own keys in entries of 32 blocks.
    assert s["eviction"]["cache_entries_invalidated"] == math.ceil(187 / PRIVATE_ENTRY_BLOCKS) == 6
    # TPOT: the decode steps attend kept(c) tokens, not c; the trim runs before the first of them.
    cm = make_cost_model(sc)
    steps = sum(cm.step_time(ForwardBatch.decode([ev.kept(c)])) for c in range(3000, 3199))
    seq = res.seqs[0]
    trim = s["eviction"]["trim_s"]
    assert trim > 0
    assert seq.finish_s - seq.first_token_s == pytest.approx(trim + steps, rel=1e-12)
    _, plain = _one(None)
    p = plain.seqs[0]
    assert seq.finish_s - seq.first_token_s < p.finish_s - p.first_token_s
    assert plain.summary["eviction"] is None


def test_soft_mark_keeps_blocks_physical_frees_them():
    _, soft = _one({**H2O, "pages": "soft_mark"})
    _, phys = _one(H2O)
    _, plain = _one(None)
    assert soft.summary["eviction"]["blocks_released"] == 0
    assert phys.summary["eviction"]["blocks_released"] == 188 - 42
    mean = {
        k: r.summary["replicas"][0]["kv_mean_used_blocks"]
        for k, r in (("soft", soft), ("phys", phys), ("plain", plain))
    }
    assert mean["phys"] < mean["soft"] <= mean["plain"]
    # Soft-marked slots are reused: the sequence never grows past its prompt's 188 blocks.
    assert soft.summary["kv_peak_used_blocks"] == 188
    # Hybrid with memory to spare is soft-mark.
    _, hyb = _one({**H2O, "pages": "hybrid"})
    assert hyb.summary["eviction"]["blocks_released"] == 0


def test_streaming_keeps_sinks_and_window():
    sc, res = _one({"policy": "streaming", "sink_tokens": 4, "recent_tokens": 252, "pages": "physical"})
    assert res.summary["eviction"]["tokens_evicted"] == 3198 - 256
    assert res.summary["eviction"]["blocks_released"] == 188 - math.ceil(257 / 16)
    cm = make_cost_model(sc)
    assert isinstance(cm, AnalyticCostModel) and cm.score_s_per_token == 0.0  # positional: no scores


def test_h2o_scores_cost_per_attended_token():
    plain = make_cost_model(small_scenario())
    h2o = make_cost_model(small_scenario(kv={"eviction": H2O}))
    assert isinstance(h2o, AnalyticCostModel)
    ctx = np.array([64 * 1000.0])
    extra = h2o._decode_attn_time(64, ctx)[0] - plain._decode_attn_time(64, ctx)[0]
    # Half of the cache's bytes (K) plus 12 B of fp32 scores per KV head and layer, per token.
    # (At the fitted decode-attention bandwidth efficiency of the H100's tables.)
    per_token = (131072 / 2 + 12 * 8 * 32) / (plain.gpu.hbm_bw_bytes_per_s * plain.ops.decode_attn.e_max)
    assert extra == pytest.approx((64 * 1000 + 64) * per_token, rel=1e-9)
    # A trim of 3000 scored tokens, 664 moved: launches + bytes at the write rate.
    t = h2o.eviction_time(EvictionWork(1, 3000, 664, 100))
    assert t > 3 * 5e-6 and t == pytest.approx(
        15e-6 + (4 * 8 * 32 * 3000 + 2 * 664 * 131072 + 400) / (plain.gpu.hbm_bw_bytes_per_s * 0.5), rel=1e-9
    )


def test_a_prefix_whose_owner_evicted_is_no_hit_for_a_later_request():
    ids = [list(range(188)), list(range(188))]
    wl = make_workload([0.0, 30.0], [3000, 3000], [50, 50], hash_ids=ids, block_tokens=16)
    hits = {}
    for ev in (None, H2O):
        sc = small_scenario(kv={"eviction": ev} if ev else {})
        res = run_scenario(sc, workload=wl)
        hits["h2o" if ev else "none"] = res.seqs[1].num_cached_tokens
    assert hits["none"] == 187 * 16  # all but the last block (at least one token is computed)
    assert hits["h2o"] == 0


def test_pressure_trigger_evicts_only_under_pressure():
    never = {**H2O, "trigger": "pressure", "pressure_threshold": 1.0}
    _, res = _one(never)
    assert res.summary["eviction"]["tokens_evicted"] == 0
    _, low = _one({**H2O, "trigger": "pressure", "pressure_threshold": 0.001})
    assert low.summary["eviction"]["tokens_evicted"] == 3198 - 704


def _loaded(ev: dict | None, ff: bool):  # type: ignore[no-untyped-def]
    wl = {
        "synthetic": {
            "num_requests": 150,
            "rate": 30,
            "input": {"dist": "uniform", "mean": 2500, "stdev": 800},
            "output": {"dist": "constant", "mean": 250},
        }
    }
    kv = {"eviction": ev} if ev else {}
    sc = small_scenario(
        kv=kv,
        workload=wl,
        sim={"fast_forward": ff},
        cluster={
            "gpu": {"preset": "h100-sxm", "hbm": "24GiB"},
            "gpu_memory_utilization": 1.0,
            "activation_reserve": 0,
        },
    )
    return run_scenario(sc)


@pytest.mark.parametrize(
    "ev",
    [
        H2O,
        {**H2O, "pages": "soft_mark"},
        {**H2O, "pages": "hybrid", "pressure_threshold": 0.6},
        {**H2O, "trigger": "pressure", "pressure_threshold": 0.7},
        {
            "policy": "streaming",
            "sink_tokens": 4,
            "recent_tokens": 500,
            "pages": "hybrid",
            "trigger": "pressure",
            "pressure_threshold": 0.5,
        },
    ],
)
def test_fast_forward_equals_stepping_with_eviction_under_load(ev):
    a, b = _loaded(ev, True), _loaded(ev, False)
    assert records(a) == records(b)
    assert a.summary["eviction"] == b.summary["eviction"]
    for key in ("kv_peak_used_blocks", "hbm_peak_bytes", "simulated_s", "preemptions"):
        assert a.summary[key] == b.summary[key], key
    assert a.summary["replicas"][0]["kv_mean_used_blocks"] == pytest.approx(
        b.summary["replicas"][0]["kv_mean_used_blocks"], rel=1e-12
    )
    assert a.summary["engine_events"] < b.summary["engine_events"]  # it did fast-forward


def test_eviction_under_memory_pressure_fits_more_and_preempts_less():
    plain, h2o = _loaded(None, True).summary, _loaded(H2O, True).summary
    assert plain["requests"]["completed"] == h2o["requests"]["completed"] == 150
    assert h2o["preemptions"] < plain["preemptions"]
    assert h2o["simulated_s"] < plain["simulated_s"]
    assert h2o["eviction"]["accuracy"]["estimate_only"] is True
    assert "H2O" in h2o["eviction"]["accuracy"]["literature"][0]["claim"]


def test_policy_enums_line_up_with_the_scenario():
    sc = small_scenario(kv={"eviction": {**H2O, "trigger": "pressure", "pages": "hybrid"}})
    ev = eviction_from_config(sc.kv.eviction)
    assert ev is not None and ev.trigger is Trigger.PRESSURE and ev.pages is PagePolicy.HYBRID
    assert eviction_from_config(small_scenario().kv.eviction) is None


def test_eviction_and_its_accuracy_estimate_are_shown_beside_the_results(tmp_path, capsys):
    from kvsim.render import print_summary
    from kvsim.report import write_report
    from kvsim.run import write_run

    sc = small_scenario(kv={"format": "fp8", "eviction": H2O})
    res = run_scenario(sc, workload=make_workload([0.0], [3000], [50]))
    write_run(res, tmp_path)
    html = write_report(tmp_path).read_text()
    assert "<h2>Token eviction</h2>" in html and "estimate, not measured by the simulator" in html
    assert "H2O (Zhang et al., NeurIPS 2023)" in html
    print_summary(res.record)
    out = " ".join(capsys.readouterr().out.split())
    # 3048 computed before the last step, 64 + ceil(0.2 x 3048) = 674 of them kept.
    assert "eviction h2o (always, physical pages): 2,374 tokens evicted, 1 trims" in out
    assert out.count("accuracy estimate (cited, not simulated)") == 2  # fp8 and H2O


def test_the_eviction_record_reads_back_from_summary_json(tmp_path):
    from kvsim.results.record import read_summary
    from kvsim.run import write_run

    sc = small_scenario(
        kv={"format": "int8", "format_mix": {"format": "int4", "share": 0.5}, "eviction": H2O}
    )
    res = run_scenario(sc, workload=make_workload([0.0, 0.5], [3000, 2000], [40, 30]))
    write_run(res, tmp_path)
    back = read_summary(tmp_path)
    assert back.eviction == res.record.eviction and back.eviction is not None
    assert back.eviction.accuracy is not None and back.eviction.accuracy.estimate_only
    assert back.config.kv_format_mix == "4/8 heads int4/g64"
    assert back.accuracy is not None and back.accuracy.format == "int8/g64 with 4/8 heads int4/g64"


@pytest.mark.parametrize(
    "ev",
    [
        Eviction(EvictionKind.H2O, heavy_ratio=0.2, recent_tokens=128),
        Eviction(EvictionKind.H2O, heavy_ratio=0.15, recent_tokens=7, budget_tokens=900),
        Eviction(EvictionKind.STREAMING, sink_tokens=4, recent_tokens=60),
    ],
)
def test_kept_array_equals_kept_as_its_table_grows(ev):
    """`kept_array` reads a table that grows by doubling: equal to `kept` below and past each growth,
    asked with and without the caller's maximum."""
    small = np.array([[0, 1, 5], [127, 128, 1023]], dtype=np.int64)
    assert ev.kept_array(small).tolist() == [[ev.kept(int(p)) for p in row] for row in small]
    big = np.array([1024, 4095, 70_001, 70_000], dtype=np.int64)  # past the first table: it grows
    assert ev.kept_array(big, 70_001).tolist() == [ev.kept(int(p)) for p in big]
    assert len(ev._table) == 131_072
    assert ev.kept_array(small).tolist() == [[ev.kept(int(p)) for p in row] for row in small]


def test_kept_array_past_the_table_limit_is_computed():
    from kvsim.core import eviction as E

    ev = Eviction(EvictionKind.H2O, heavy_ratio=0.2, recent_tokens=128)
    pos = np.array([5, E._TABLE_MAX + 3], dtype=np.int64)
    assert ev.kept_array(pos).tolist() == [ev.kept(5), ev.kept(E._TABLE_MAX + 3)]
    assert len(ev._table) == 0  # nothing tabled


def test_first_trim_shortcut_equals_every_step_computed():
    """`first_trim`'s closed form (the sequences not at their budget never evicted) gives the step
    that computing every step's events gives, over random states of every policy and page mode."""
    from kvsim.core.eviction import decode_steps, first_trim

    rng = np.random.default_rng(7)
    kinds = [
        Eviction(EvictionKind.H2O, heavy_ratio=r, recent_tokens=16, pages=p, trigger=t, budget_tokens=b)
        for p in PagePolicy
        for r in (0.1, 0.5)
        for t in Trigger
        for b in (0, 60)
    ] + [
        Eviction(EvictionKind.STREAMING, sink_tokens=4, recent_tokens=40, pages=p, trigger=t)
        for p in PagePolicy
        for t in Trigger
    ]
    shortcuts = 0
    for it in range(4000):
        ev = kinds[it % len(kinds)]
        n, k, bs = int(rng.integers(1, 8)), int(rng.integers(1, 60)), int(rng.choice([1, 4, 16]))
        c0 = rng.integers(1, 200, n)
        mode = rng.integers(0, 3, n)  # never evicted, at its budget, evicted part-way
        kept0 = ev.kept_array(c0)
        ev0 = np.maximum(np.where(mode == 1, c0 - kept0, np.where(mode == 2, (c0 - kept0) // 2, 0)), 0)
        held0 = (c0 - ev0 + bs) // bs + (rng.random(n) < 0.2) * rng.integers(1, 3, n)
        capped, resident, blocks = decode_steps(ev, c0, ev0, held0, bool(rng.random() < 0.8), k, bs)
        new = blocks.sum(axis=0) - blocks[:, 0].sum()
        args = (ev, c0, capped, resident, blocks, int(rng.integers(0, 600)), new, 500, bs)
        fast, full = first_trim(*args), first_trim(*args, shortcut=False)
        assert fast == full, (it, ev, c0.tolist(), ev0.tolist(), held0.tolist(), k, bs)
        shortcuts += ev.trigger is Trigger.ALWAYS and not capped.all() and bool((ev0[~capped] == 0).all())
    assert shortcuts > 300  # the closed form was really exercised (462 of these draws)

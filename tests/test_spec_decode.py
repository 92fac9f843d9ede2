"""Speculative decoding (`scheduler.spec_decode`): step counts, tokens, KV rollback, cost direction."""

from __future__ import annotations

import numpy as np
import pytest

from kvsim.core.horizon import verify_window
from kvsim.core.request import Request
from kvsim.core.spec_decode import SpecDecoder, accepted_drafts, uniform
from kvsim.costs.base import ForwardBatch, SeqKind
from kvsim.costs.draft import DraftCost
from kvsim.run import make_cost_model, run_scenario
from kvsim.sim.cluster import make_pool_and_scheduler
from tests.helpers import make_workload, records, small_scenario


def _sc(mean: float | None, k: int = 3, ff: bool = True, draft: dict | None = None, **acc):  # type: ignore[no-untyped-def]
    sched: dict = {}
    if mean is not None:
        sched["spec_decode"] = {
            "k": k,
            "acceptance": {"mean": mean, **acc},
            "draft": draft or {"kind": "mtp"},
        }
    return small_scenario(scheduler=sched, sim={"seed": 7, "fast_forward": ff})


def _one(mean: float | None, output: int = 13, k: int = 3, **kw):  # type: ignore[no-untyped-def]
    return run_scenario(_sc(mean, k, **kw), workload=make_workload([0.0], [100], [output]))


def test_acceptance_one_takes_ceil_output_over_k_plus_one_verify_steps():
    res = _one(1.0)
    sd = res.summary["spec_decode"]
    # 12 tokens after the first, 4 per verify step: ceil(12 / 4) = 3 steps, after one prefill step.
    assert sd["verify_rows"] == 3
    assert res.summary["steps"] == 1 + 3
    assert sd["accepted_per_step_hist"] == [0, 0, 0, 3]
    assert sd["accepted_tokens"] == 9 and sd["kv_discarded_tokens"] == 0
    assert sd["tokens_per_step_mean"] == 4.0
    assert res.seqs[0].num_generated == 13


def test_acceptance_one_caps_drafts_at_the_output_left():
    # 10 after the first: steps of 4, 4, then 2 (one draft: only two tokens are left).
    sd = _one(1.0, output=11).summary["spec_decode"]
    assert sd["verify_rows"] == 3 and sd["drafted_tokens"] == 3 + 3 + 1
    assert sd["accepted_per_step_hist"] == [0, 1, 0, 2]


def test_acceptance_zero_emits_one_token_per_step_and_costs_more_than_decode():
    on, off = _one(0.0), _one(None)
    sd = on.summary["spec_decode"]
    assert on.summary["steps"] == off.summary["steps"] == 1 + 12
    # Drafts min(3, left - 1) for left 12..2: nine rows of 3, then 2 and 1; the last token is a decode.
    assert sd["verify_rows"] == 11 and sd["drafted_tokens"] == 9 * 3 + 2 + 1
    assert sd["accepted_tokens"] == 0 and sd["kv_discarded_tokens"] == 30
    assert sd["accepted_per_step_hist"] == [11, 0, 0, 0]
    assert on.summary["tpot_s"]["mean"] > off.summary["tpot_s"]["mean"]
    assert on.seqs[0].finish_s > off.seqs[0].finish_s


def test_verify_priced_as_k_plus_one_tokens_not_as_decode():
    cost = make_cost_model(small_scenario())
    dec = cost.price(ForwardBatch.decode([1000])).seconds
    ver = cost.price(ForwardBatch((SeqKind.VERIFY,), (4,), (1000,), 4)).seconds
    pre = cost.price(ForwardBatch((SeqKind.PREFILL,), (4,), (1000,), 4)).seconds
    assert dec < ver < pre  # GEMMs over 4 rows; attention reads the cache once, like a decode
    rows4 = cost._gemm_time(4, 4) + cost._comm_time(4) + cost._write_time(4)
    attn = cost.decode_per_seq_s + max(
        1004 * cost.decode_attn_s_per_token, 4 * 1004 * cost.decode_attn_flops_s_per_token
    )
    assert ver == pytest.approx(cost.overhead_s + rows4 + cost.prefill_launch_s + attn, rel=1e-12)


def test_tpot_falls_with_acceptance():
    wl = make_workload([0.0, 0.01, 0.02, 0.3], [300, 40, 900, 120], [80, 200, 64, 150])
    tpot = [run_scenario(_sc(m), workload=wl).summary["tpot_s"]["mean"] for m in (0.0, 0.4, 0.7, 0.9, 1.0)]
    assert tpot == sorted(tpot, reverse=True) and len(set(tpot)) == len(tpot)


def test_discarded_kv_is_drafts_less_accepted_and_fast_forward_equals_stepping():
    wl = make_workload([0.0, 0.0, 0.05, 0.5], [300, 40, 900, 120], [80, 200, 64, 150])
    a = run_scenario(_sc(0.6, k=4, dist="beta", concentration=3.0), workload=wl)
    b = run_scenario(_sc(0.6, k=4, ff=False, dist="beta", concentration=3.0), workload=wl)
    assert records(a) == records(b) and a.summary["spec_decode"] == b.summary["spec_decode"]
    sd = a.summary["spec_decode"]
    hist = sd["accepted_per_step_hist"]
    assert sd["accepted_tokens"] == sum(i * n for i, n in enumerate(hist))
    assert sd["kv_discarded_tokens"] == sd["drafted_tokens"] - sd["accepted_tokens"] > 0
    # Every output token is either a prefill's first token, a verify step's accepted + 1, or a decode.
    out = sum(s.num_generated for s in a.seqs)
    assert out == 80 + 200 + 64 + 150
    assert a.summary["spec_decode"]["kv_discarded_bytes"] == int(
        sd["kv_discarded_tokens"] * a.summary["kv_block_bytes"] / 16
    )


def test_spec_off_leaves_the_summary_without_the_part():
    assert _one(None).summary["spec_decode"] is None  # null in summary.json, as eviction when off


def test_draft_model_cost_grows_with_the_draft_model():
    small = _one(0.8, draft={"kind": "model", "model": "llama-3.1-8b"})
    big = _one(0.8, draft={"kind": "model", "model": "llama-3.1-70b"})
    mtp = _one(0.8)
    assert records(small)[0][8] == records(big)[0][8] == 13  # same tokens, same draws
    assert 0 < mtp.summary["spec_decode"]["draft_s"] < small.summary["spec_decode"]["draft_s"]
    assert small.summary["spec_decode"]["draft_s"] < big.summary["spec_decode"]["draft_s"]
    assert big.seqs[0].finish_s > small.seqs[0].finish_s


def test_draft_cost_passes():
    cost = make_cost_model(small_scenario())
    d = DraftCost(cost, 1e-3, scale=0.5, kind="mtp")
    one = 0.5 * (cost.step_time(ForwardBatch.decode([100])) - 1e-3)
    two = 0.5 * (cost.step_time(ForwardBatch.decode([101])) - 1e-3)
    rows = 0.5 * (cost.step_time(ForwardBatch.decode([100, 50])) - 1e-3)
    assert d.seconds([100], [2]) == pytest.approx(one + two, rel=1e-12)
    assert d.seconds([100, 50], [1, 1]) == pytest.approx(rows, rel=1e-12)
    assert d.seconds([], []) == 0.0


def test_counter_rng_is_keyed_by_seed_request_and_step():
    assert uniform(1, 2, 3) == uniform(1, 2, 3)
    assert len({uniform(1, 2, s) for s in range(100)}) == 100
    assert uniform(1, 2, 3) != uniform(2, 2, 3) != uniform(1, 3, 3)
    u = np.array([uniform(5, r, s) for r in range(50) for s in range(200)])
    assert 0.0 <= u.min() and u.max() < 1.0 and abs(u.mean() - 0.5) < 0.01


def test_accepted_drafts_are_geometric_capped_at_d():
    assert accepted_drafts(1.0, 0.999, 3) == 3
    assert accepted_drafts(0.0, 0.0, 3) == 0
    assert accepted_drafts(0.5, 0.3, 5) == 1  # 0.3 < 0.5, not < 0.25
    draws = [accepted_drafts(0.6, uniform(9, 0, s), 4) for s in range(40_000)]
    # E[accepted] = sum_{j=1..4} 0.6^j = 1.3056; P(0) = 0.4; P(4) = 0.6^4 = 0.1296.
    assert abs(np.mean(draws) - 1.3056) < 0.02
    assert abs(draws.count(0) / len(draws) - 0.4) < 0.01
    assert abs(draws.count(4) / len(draws) - 0.1296) < 0.01


def test_beta_rates_per_request():
    s = SpecDecoder(3, mean=0.7, concentration=4.0, seed=1)
    rates = [s.rate(i) for i in range(4000)]
    assert rates[10] == s.rate(10) == SpecDecoder(3, mean=0.7, concentration=4.0, seed=1).rate(10)
    assert abs(np.mean(rates) - 0.7) < 0.01
    # Beta(2.8, 1.2): variance m(1-m)/(c+1) = 0.042
    assert abs(np.var(rates) - 0.042) < 0.004
    assert SpecDecoder(3, mean=0.7, concentration=None, seed=1).rate(10) == 0.7


@pytest.mark.parametrize(
    "kw", [{"k": 0, "mean": 0.5}, {"k": 2, "mean": 1.5}, {"k": 2, "mean": 0.5, "concentration": 0.0}]
)
def test_spec_decoder_refuses_bad_parameters(kw):  # type: ignore[no-untyped-def]
    k = kw.pop("k")
    with pytest.raises(ValueError):
        SpecDecoder(k, seed=1, concentration=kw.pop("concentration", None), **kw)


def test_rollback_rewinds_computed_tokens_and_keeps_the_blocks():
    sched = make_pool_and_scheduler(8, 16, 4, 256, True)
    sched.spec = SpecDecoder(7, mean=0.0, concentration=None, seed=1)
    req = Request(0, 0.0, 10, 20, [], [])
    sched.add(req)
    sched.advance(sched.schedule())  # prefill: 10 computed, the first token sampled
    assert (req.num_computed, req.num_generated, req.num_blocks) == (10, 1, 1)
    out = sched.schedule()
    assert out.verify_reqs == [req] and out.verify_drafts == [7] and out.verify_ctx == [10]
    assert req.num_blocks == 2  # slots 10..17 taken before the step
    sched.advance(out)
    # Every draft rejected: 11 computed (its last token), 7 slots discarded, the second block kept.
    assert (req.num_computed, req.num_generated, req.num_blocks) == (11, 2, 2)
    assert sched.spec.discarded_tokens == 7
    assert sched.outstanding_tokens == 10 + 20 - 1 - 11
    while sched.running:
        sched.advance(sched.schedule())
    assert req.num_generated == 20 and req.num_computed == 29 and sched.outstanding_tokens == 0
    assert sched.kv.pool.num_used == 0


def test_verify_steps_fast_forward_in_windows_and_equal_stepping():
    # Two replicas, the router reading outstanding tokens mid-window, arrivals cutting windows.
    wl = make_workload(
        [0.0, 0.0, 0.02, 0.05, 0.3, 0.31, 0.9],
        [300, 40, 900, 120, 64, 500, 33],
        [400, 300, 64, 150, 250, 90, 12],
    )
    runs = []
    for ff in (True, False):
        sc = small_scenario(
            scheduler={
                "spec_decode": {
                    "k": 4,
                    "acceptance": {"dist": "beta", "mean": 0.7, "concentration": 4},
                    "draft": {"kind": "mtp"},
                }
            },
            cluster={"gpus_per_node": 2, "router": "least_outstanding_tokens"},
            sim={"seed": 5, "fast_forward": ff},
        )
        runs.append(run_scenario(sc, workload=wl))
    a, b = runs
    assert records(a) == records(b)
    for key in ("spec_decode", "replicas", "kv_peak_used_blocks", "tpot_s", "steps"):
        assert a.summary[key] == b.summary[key], key
    assert b.summary["engine_events"] == b.summary["steps"]
    assert a.summary["engine_events"] < a.summary["steps"] / 3  # windows of verify steps


def test_a_draft_model_not_smaller_than_the_target_is_warned_about():
    big = _one(0.8, draft={"kind": "model", "model": "llama-3.1-70b"}).summary["warnings"]
    small = _one(0.8, draft={"kind": "model", "model": "llama-3.1-8b"}).summary["warnings"]
    mtp = _one(0.8).summary["warnings"]
    assert any("llama-3.1-70b is not smaller than llama-3.1-8b" in w for w in big)
    assert any("not smaller" in w for w in small)  # the same model: no smaller either
    assert not any("draft model" in w for w in mtp)


def test_a_step_cut_by_max_time_counts_no_draft_time_in_either_mode():
    wl = make_workload([0.0, 0.1], [300, 500], [4000, 3000])
    out = []
    for ff in (True, False):
        sc = small_scenario(
            scheduler={"spec_decode": {"k": 3, "acceptance": {"mean": 0.6}, "draft": {"kind": "mtp"}}},
            sim={"seed": 1, "fast_forward": ff, "max_time": "1.2345s"},
        )
        out.append(run_scenario(sc, workload=wl).summary)
    assert out[0]["spec_decode"] == out[1]["spec_decode"] and out[0]["requests"]["unfinished"] == 2


def _two_request_scheduler():  # type: ignore[no-untyped-def]
    sched = make_pool_and_scheduler(16, 16, 4, 256, True)
    sched.spec = SpecDecoder(1, mean=1.0, concentration=None, seed=1)
    a, b = Request(0, 0.0, 10, 5, [], []), Request(1, 0.0, 10, 4, [], [])
    sched.add(a)
    sched.add(b)
    sched.advance(sched.schedule())  # both prefill and sample: 4 and 3 tokens left
    return sched, a, b


def test_a_verify_window_finishes_requests_in_steppings_order():
    # Step 2: a verifies its last two tokens, b decodes its last one; both finish. Stepping lists
    # plain decode rows first (the order of their releases, and of closed-loop turns they trigger).
    sched, a, b = _two_request_scheduler()
    step = sched.schedule()
    assert step.verify_drafts == [1, 1]
    sched.advance(step)
    last = sched.schedule()
    assert last.verify_reqs == [a] and last.decode_reqs == [b]
    _, stepped = sched.advance(last)
    assert stepped == [b, a]

    sched, a, b = _two_request_scheduler()
    out = sched.schedule()
    vw = verify_window(out, sched.kv, sched.spec, sched.running, 8, 256, False)
    assert vw is not None and vw.num_steps == 2 and vw.drafts == [[1, 1], [1, 0]]
    _, windowed = sched.advance_verify(sched.running[:], vw.drafts, vw.accepted, 0, 2)
    assert windowed == [b, a]

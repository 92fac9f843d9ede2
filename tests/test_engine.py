"""Stories with exact expectations, on the event log of per-request records."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvsim.costs.base import ForwardBatch
from kvsim.run import RunResult, make_cost_model, run_scenario
from tests.helpers import ROOT, make_workload, records, small_scenario


def cost_of(sc):
    return make_cost_model(sc)


def by_id(result):
    return {s.id: s for s in result.seqs}


def test_one_request_alone_ttft_is_its_prefill_step():
    sc = small_scenario()
    res = run_scenario(sc, workload=make_workload([0.5], [1000], [10]))
    (s,) = res.seqs
    step = cost_of(sc).step_time(ForwardBatch.prefill(1000, 0))
    assert s.first_token_s - s.arrival_s == pytest.approx(step, rel=0, abs=1e-12)
    assert s.first_scheduled_s == 0.5
    assert res.summary["requests"] == {
        "total": 1,
        "completed": 1,
        "rejected": 0,
        "unfinished": 0,
        "rejected_reasons": {},
        "not_arrived": 0,
    }


def test_chunked_prefill_splits_long_prompt_into_budgeted_steps():
    sc = small_scenario(scheduler={"max_batched_tokens": 512})
    res = run_scenario(sc, workload=make_workload([0.0], [1200], [2]))
    (s,) = res.seqs
    cm = cost_of(sc)
    expected = cm.step_time(ForwardBatch.prefill(512, 0, sampling=False)) + cm.step_time(
        ForwardBatch.prefill(512, 512, sampling=False)
    )
    expected += cm.step_time(ForwardBatch.prefill(176, 1024))
    assert s.first_token_s == pytest.approx(expected, rel=1e-12)


def test_second_request_with_same_prefix_prefills_only_the_rest():
    sc = small_scenario()
    # Two prompts share their first two 512-token blocks (ids 1, 2), then differ.
    wl = make_workload([0.0, 10.0], [1100, 1300], [5, 5], hash_ids=[[1, 2, 3], [1, 2, 4]], block_tokens=512)
    res = run_scenario(sc, workload=wl)
    a, b = res.seqs
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == 1024
    step = cost_of(sc).step_time(ForwardBatch.prefill(1300 - 1024, 1024))
    assert b.first_token_s - b.arrival_s == pytest.approx(step, abs=1e-12)
    assert res.summary["prefix_hit_rate"] == pytest.approx(1024 / (1100 + 1300))


def test_identical_prompt_hits_all_but_its_last_block():
    sc = small_scenario()
    wl = make_workload([0.0, 10.0], [1024, 1024], [3, 3], hash_ids=[[7, 8], [7, 8]], block_tokens=512)
    res = run_scenario(sc, workload=wl)
    b = res.seqs[1]
    assert b.num_cached_tokens == 1008  # all but the last block: at least one token is computed


def test_memory_pressure_preempts_and_everyone_completes():
    # 40 blocks of 16 tokens = 640 tokens of KV; two requests that together need ~2 x 420.
    sc = small_scenario(num_blocks=40)
    wl = make_workload([0.0, 0.0], [300, 300], [120, 120])
    res = run_scenario(sc, workload=wl)
    assert res.plan.num_blocks == 40
    assert res.summary["preemptions"] >= 1
    assert res.summary["requests"]["completed"] == 2
    victim = max(res.seqs, key=lambda s: s.preemptions)
    assert victim.id == 1  # the newest running sequence is preempted first
    assert victim.finish_s > res.seqs[0].finish_s


def test_a_preempted_request_recomputes_only_what_its_own_cached_blocks_miss():
    # No hash ids in the trace: each prompt's full blocks are its own cache entries, and a request's
    # full generated blocks are cached when it is preempted (vLLM caches both). Request 1 is
    # preempted near the end of request 0; of its released blocks, those request 0 does not take
    # stay cached, and its recompute hits them: it finishes sooner than recomputing everything.
    sc = small_scenario(num_blocks=40)
    wl = make_workload([0.0, 0.0], [320, 300], [20, 40])
    res = run_scenario(sc, workload=wl)
    victim = res.seqs[1]
    assert victim.preemptions == 1
    off = run_scenario(small_scenario(num_blocks=40, kv={"prefix_cache": False}), workload=wl)
    assert off.seqs[1].preemptions == 1
    # With its blocks cached the victim's second admission skips the recompute: it finishes sooner.
    assert victim.finish_s < off.seqs[1].finish_s


def test_next_turn_hits_the_previous_answer():
    # A synthetic session's turn 2 prompt is turn 1's prompt + answer + new input; once turn 1 has
    # finished (think time 30 s) its answer's full blocks are cached under the ids turn 2 carries.
    data = {
        "synthetic": {
            "num_requests": 2,
            "rate": 0.01,
            "session_turns": 2,
            "think_time": "30s",
            "input": {"dist": "constant", "mean": 100},
            "output": {"dist": "constant", "mean": 200},
        }
    }
    sc = small_scenario(workload=data)
    t1, t2 = run_scenario(sc).seqs
    assert t1.finish_s < t2.arrival_s
    # Turn 1 stored 100 + 200 - 1 = 299 tokens: 18 full blocks (288 tokens), all hit by turn 2.
    assert t2.num_cached_tokens == 288


def test_request_that_can_never_fit_is_rejected_with_reason():
    sc = small_scenario(num_blocks=10)
    res = run_scenario(sc, workload=make_workload([0.0, 1.0], [100, 500], [10, 10]))
    r = res.summary["requests"]
    assert (r["completed"], r["rejected"]) == (1, 1)
    assert r["rejected_reasons"] == {"needs more KV blocks than a replica has": 1}


def test_longer_than_context_is_rejected_and_warned():
    sc = small_scenario()
    res = run_scenario(sc, workload=make_workload([0.0], [131000], [500]))
    assert res.summary["requests"]["rejected"] == 1
    assert any("exceed llama-3.1-8b's context" in w for w in res.summary["warnings"])


def _synthetic(max_time=None, **kw):
    syn = {
        "num_requests": 300,
        "rate": 20,
        "arrival": "gamma",
        "cv": 2.0,
        "input": {"dist": "lognormal", "mean": 600, "stdev": 400, "max": 3000},
        "output": {"dist": "lognormal", "mean": 150, "stdev": 120, "max": 800},
        "shared_prefix_tokens": 256,
        "shared_prefix_count": 3,
        "session_turns": 2,
        "think_time": "3s",
    }
    sim = {"seed": 3}
    if max_time:
        sim["max_time"] = max_time
    return small_scenario(num_blocks=600, workload={"synthetic": syn}, sim=sim, **kw)


@pytest.mark.parametrize("max_time", [None, "8s"])
def test_nothing_is_lost(max_time):
    res = run_scenario(_synthetic(max_time))
    r = res.summary["requests"]
    assert r["completed"] + r["rejected"] + r["unfinished"] == r["total"]
    assert r["total"] + r["not_arrived"] == 300
    if max_time:
        assert r["unfinished"] > 0
    else:
        assert r["unfinished"] == 0 and r["not_arrived"] == 0


def _comparable(summary):
    drop = {"wall_s", "sim_speed_x", "engine_events", "config"}
    return {k: v for k, v in summary.items() if k not in drop}


@pytest.mark.parametrize("replicas", [1, 2])
def test_fast_forward_equals_stepping_one_by_one(replicas):
    kw = {"cluster": {"gpus_per_node": replicas}, "scheduler": {"max_num_seqs": 64}}
    a = run_scenario(
        dataclasses.replace(_synthetic(**kw), sim=dataclasses.replace(_synthetic().sim, fast_forward=True))
    )
    b = run_scenario(
        dataclasses.replace(_synthetic(**kw), sim=dataclasses.replace(_synthetic().sim, fast_forward=False))
    )
    assert a.summary["preemptions"] > 0  # the comparison covers preemption too
    assert a.summary["engine_events"] < b.summary["engine_events"] / 2  # fast-forward engaged
    assert records(a) == records(b)
    assert _comparable(a.summary) == _comparable(b.summary)


def test_same_seed_same_summary():
    a = run_scenario(_synthetic())
    b = run_scenario(_synthetic())
    assert _comparable(a.summary) == _comparable(b.summary)


def test_blocks_are_cached_when_scheduled_so_a_same_step_admission_hits_them():
    # vLLM v1 registers the full blocks a step will compute when it schedules the step: B, admitted
    # in the same step as A's whole 96-token prompt, hits A's first five blocks (the sixth is
    # recomputed: at least one token is computed) instead of computing its own.
    sc = small_scenario(scheduler={"max_batched_tokens": 128})
    wl = make_workload([0.0, 0.0], [96, 96], [2, 2], hash_ids=[list(range(6))] * 2, block_tokens=16)
    a, b = run_scenario(sc, workload=wl).seqs
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == 80
    assert a.first_scheduled_s == b.first_scheduled_s == 0.0


def test_least_outstanding_requests_router_balances_request_counts():
    # Long and short requests alternate: by tokens, the short ones pile onto one replica; by request
    # count, each replica gets every other arrival.
    wl = make_workload(np.arange(8) * 0.001, [4000, 50] * 4, [200, 2] * 4)
    by_req = run_scenario(
        small_scenario(cluster={"gpus_per_node": 2, "router": "least_outstanding_requests"}), workload=wl
    )
    by_tok = run_scenario(
        small_scenario(cluster={"gpus_per_node": 2, "router": "least_outstanding_tokens"}), workload=wl
    )
    assert [s.replica for s in by_req.seqs] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert [s.replica for s in by_tok.seqs] != [s.replica for s in by_req.seqs]


def test_prefix_affinity_router_sends_shared_prefixes_together():
    wl = make_workload(
        np.arange(8) * 5.0,
        [1100] * 8,
        [4] * 8,
        hash_ids=[[1, 2, 10 + i] if i % 2 == 0 else [5, 6, 10 + i] for i in range(8)],
        block_tokens=512,
    )
    sc = small_scenario(cluster={"gpus_per_node": 2, "router": "prefix_affinity"})
    res = run_scenario(sc, workload=wl)
    reps = {}
    for s in res.seqs:
        reps.setdefault(s.id % 2, set()).add(s.replica)
    assert all(len(v) == 1 for v in reps.values())
    assert res.summary["prefix_hit_rate"] == pytest.approx(6 * 1024 / (8 * 1100))  # all but the first of each


def test_fast_forward_equals_stepping_on_a_real_trace_under_memory_pressure():
    """600 Mooncake requests on a pool of 4,000 blocks: evictions, preemptions and prefix hits."""
    from kvsim.spec.scenario import scenario_from_dict
    from kvsim.spec.workload import load_workload
    from tests.helpers import ROOT

    trace = {
        "trace": "scenarios/traces/mooncake/conversation_trace.jsonl",
        "format": "mooncake",
        "max_requests": 600,
    }
    wsc = scenario_from_dict(
        {"model": "llama-3.1-8b", "cluster": {"gpu": "h100"}, "workload": trace},
        source="t.yaml",
        base_dir=ROOT,
    )
    wl = load_workload(wsc.workload, seed=1)
    sc = small_scenario(num_blocks=4000, scheduler={"max_batched_tokens": 2048})
    a = run_scenario(sc, workload=wl)
    b = run_scenario(
        dataclasses.replace(sc, sim=dataclasses.replace(sc.sim, fast_forward=False)), workload=wl
    )
    assert a.summary["preemptions"] > 100 and a.summary["prefix_cache_evictions"] > 0
    assert a.summary["prefix_hit_rate"] > 0
    assert records(a) == records(b)
    assert _comparable(a.summary) == _comparable(b.summary)


@pytest.mark.parametrize("fast_forward", [True, False])
def test_peak_kv_counts_blocks_allocated_inside_a_fast_forward_run(fast_forward):
    sc = small_scenario()
    sc = dataclasses.replace(sc, sim=dataclasses.replace(sc.sim, fast_forward=fast_forward))
    res = run_scenario(sc, workload=make_workload([0.0], [100], [300]))
    assert (
        res.summary["kv_peak_used_blocks"] == 25
    )  # ceil((100 + 300 - 1) / 16): the last token is not stored


def _ff_and_stepping(sc, wl):  # type: ignore[no-untyped-def]
    return [
        run_scenario(dataclasses.replace(sc, sim=dataclasses.replace(sc.sim, fast_forward=ff)), workload=wl)
        for ff in (True, False)
    ]


def test_router_sees_the_evictions_of_the_step_in_flight():
    # Request 1's decode window on replica 0 evicts cached entry 100 at one of its steps; request 2
    # (whose prompt starts with block 100) arrives during that step. Stepping has already taken the
    # step's blocks, so prefix affinity no longer sees 100 on replica 0; fast-forward must agree.
    sc = small_scenario(num_blocks=16, cluster={"gpus_per_node": 2, "router": "prefix_affinity"})
    for t in np.linspace(0.107, 0.232, 25):
        wl = make_workload(
            [0.0, 0.1, t],
            [16, 232, 40],
            [1, 20, 2],
            hash_ids=[[100], list(range(300, 315)), [100, 200, 201]],
            block_tokens=16,
        )
        a, b = _ff_and_stepping(sc, wl)
        assert records(a) == records(b), t


def test_arrivals_around_step_ends_agree_in_both_modes():
    sc = small_scenario(num_blocks=64, kv={"prefix_cache": False})
    (alone,) = run_scenario(sc, workload=make_workload([0.0], [100], [60])).seqs
    step = (alone.finish_s - alone.first_token_s) / 59  # decode steps are nearly equal here
    ends = [alone.first_token_s + step * j for j in range(5, 40, 7)]
    for e in ends:
        wl = make_workload([0.0, e - step / 2, e], [100, 10, 10], [60, 5, 5])
        a, b = _ff_and_stepping(sc, wl)
        assert records(a) == records(b)
        assert a.summary["simulated_s"] == b.summary["simulated_s"]


def profile_under_load(*overrides: str) -> tuple[RunResult, RunResult]:
    """The profile golden under load (a 512-token budget, 64 sequences: chunked prefill), run
    fast-forwarding and stepping one by one; both must agree request by request."""
    from kvsim.spec.scenario import load_scenario

    sc = load_scenario(
        ROOT / "tests/goldens/scenarios/profile_h200.yaml",
        [
            "scheduler.max_batched_tokens=512",
            "scheduler.max_num_seqs=64",
            "workload.rate_scale=12",
            *overrides,
        ],
    )
    a, b = (
        run_scenario(dataclasses.replace(sc, sim=dataclasses.replace(sc.sim, fast_forward=ff)))
        for ff in (True, False)
    )
    assert records(a) == records(b)
    assert a.summary["warnings"] == b.summary["warnings"]
    assert a.summary["engine_events"] < b.summary["engine_events"] / 2
    return a, b


def test_fast_forward_equals_stepping_with_the_profile_cost_model_under_load():
    # Mixed windows (decodes plus one full prefill chunk) priced by the measured profile's
    # a mixed run of step_times must equal price().
    profile_under_load()

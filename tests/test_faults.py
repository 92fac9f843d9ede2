"""Faults (``faults``, `kvsim.sim.faults`): replicas and nodes that go down mid-run, their requests
retried elsewhere or failed, the replicas back cold after the down time and the weights' reload;
the accounting, fast-forward equal to stepping, and a run without faults unchanged."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import kvsim.run as krun
from kvsim.core.memory_plan import plan_memory
from kvsim.core.request import RequestStatus
from kvsim.errors import KvsimError
from kvsim.sim.assembly import assemble
from kvsim.sim.cluster import make_pool_and_scheduler
from kvsim.sim.faults import draw_faults
from kvsim.spec.faults import DEFAULT_RELOAD_BW, FaultEvent, FaultKind, FaultsConfig, RandomFaults
from tests.helpers import make_workload, records, small_scenario
from tests.test_engine_properties import _checked, cases, made

WEIGHTS = 8_030_261_248 * 2  # Llama-3.1-8B in bf16, TP 1: bytes per GPU
RELOAD_S = WEIGHTS / 13e9  # 1.235 s at the default NVMe read (Samsung PM1743, 13,000 MB/s)


def _faults(*events: tuple[float, str, int, float], max_retries: int = 2) -> dict:
    return {
        "events": [{"at": a, "kind": k, "target": t, "duration": d} for a, k, t, d in events],
        "max_retries": max_retries,
    }


def _two_replicas(**sections):  # type: ignore[no-untyped-def]
    return small_scenario(cluster={"gpus_per_node": 2}, **sections)


def _stepping(sc):  # type: ignore[no-untyped-def]
    return dataclasses.replace(sc, sim=dataclasses.replace(sc.sim, fast_forward=False))


def _accounted(summary) -> None:  # type: ignore[no-untyped-def]
    r = summary["requests"]
    assert r["completed"] + r["rejected"] + r["failed"] + r["unfinished"] == r["total"]


def test_a_replica_down_mid_decode_retries_its_request_on_the_other():
    """Two 1,024-token prompts asking for 100 tokens each, one per replica; decode steps take
    about 7.2 ms. Replica 0 goes down at 75 ms, after its request's prefill (first token at 21.3
    ms) and 7 decode steps (the 8th ends at 71.7 ms, the 9th would at 78.9 ms): the request has 8
    tokens and its KV holds 1,031 (1,024 + 7) plus the slot the lost step took, 65 blocks of 16.
    It is retried on replica 1 and recomputes its prompt and the 8 tokens."""
    sc = _two_replicas(faults=_faults((0.075, "replica_down", 0, 1.0)))
    wl = make_workload([0.0, 0.0], [1024, 1024], [100, 100])
    base = krun.run_scenario(_two_replicas(), workload=wl)
    assert [s.replica for s in base.seqs] == [0, 1]
    res = krun.run_scenario(sc, workload=wl)
    s = res.summary
    f = s["faults"]
    assert (f["retries"], f["failed"], f["max_retries"]) == (1, 0, 2)
    assert (f["lost_prompt_tokens"], f["lost_output_tokens"], f["recomputed_tokens"]) == (1024, 8, 1032)
    assert f["kv_blocks_lost"] == 65
    (o,) = f["outages"]
    assert (o["replica"], o["down_s"], o["requests_dropped"], o["kv_blocks_lost"]) == (0, 0.075, 1, 65)
    assert o["reload_s"] == pytest.approx(RELOAD_S) and f["reload_s"] == o["reload_s"]
    assert o["up_s"] == pytest.approx(0.075 + 1.0 + RELOAD_S)
    # Replica 1 finishes both requests at 0.82 s, before replica 0 is back: down time to the end.
    assert f["replica_down_s"] == s["simulated_s"] - 0.075 and s["simulated_s"] < o["up_s"]
    assert f["reload_bw_bytes_per_s"] == DEFAULT_RELOAD_BW and "PM1743" in f["reload_source"]
    r = s["requests"]
    assert (r["total"], r["completed"], r["failed"], r["unfinished"]) == (2, 2, 0, 0)
    _accounted(s)
    moved, stayed = res.seqs
    assert moved.replica == 1 and moved.status is RequestStatus.FINISHED
    assert moved.first_scheduled_s == 0.0  # its first schedule stays; its stream restarts
    assert moved.first_token_s > 0.075 and moved.finish_s > base.seqs[0].finish_s
    assert moved.num_generated == 100
    assert stayed.replica == 1 and stayed.finish_s > base.seqs[1].finish_s  # shares replica 1 now
    assert res.stats[0].steps == 8  # prefill and 7 decodes; the 8th decode was lost
    assert res.stats[0].busy_s == pytest.approx(0.075)  # the lost step ran until the fault
    assert res.stats[0].down_s == pytest.approx(1.0 + RELOAD_S)
    b = krun.run_scenario(_stepping(sc), workload=wl)
    assert records(b) == records(res) and b.summary["faults"] == f


def test_past_max_retries_a_request_fails():
    sc = _two_replicas(faults=_faults((0.075, "replica_down", 0, 1.0), max_retries=0))
    res = krun.run_scenario(sc, workload=make_workload([0.0, 0.0], [1024, 1024], [100, 100]))
    r = res.summary["requests"]
    assert (r["completed"], r["failed"], r["unfinished"]) == (1, 1, 0)
    assert res.summary["faults"]["retries"] == 0 and res.summary["faults"]["failed"] == 1
    failed = res.seqs[0]
    assert failed.status is RequestStatus.FAILED and "faults.max_retries: 0" in failed.reason
    _accounted(res.summary)


def test_with_every_replica_down_requests_wait_at_the_router():
    """One replica, down from 0.5 s for 2 s: a request arriving at 1 s waits at the router and is
    scheduled the instant the replica is back, with its weights reloaded (2.5 s + 1.235 s)."""
    sc = small_scenario(faults=_faults((0.5, "replica_down", 0, 2.0)))
    res = krun.run_scenario(sc, workload=make_workload([0.0, 1.0], [64, 64], [4, 4]))
    first, waited = res.seqs
    assert first.finish_s < 0.5  # done before the fault: nothing dropped
    f = res.summary["faults"]
    assert (f["retries"], f["router_queue_peak"], f["outages"][0]["requests_dropped"]) == (0, 1, 0)
    assert f["kv_blocks_lost"] == 4  # the first prompt's 4 cached blocks (64 tokens)
    assert waited.first_scheduled_s == pytest.approx(2.5 + RELOAD_S)
    assert waited.status is RequestStatus.FINISHED
    _accounted(res.summary)


def test_a_node_down_takes_every_replica_on_it():
    sc = small_scenario(cluster={"gpus_per_node": 2, "nodes": 2}, faults=_faults((0.05, "node_down", 1, 0.5)))
    res = krun.run_scenario(sc, workload=make_workload([0.0] * 4, [512] * 4, [50] * 4))
    f = res.summary["faults"]
    assert [o["replica"] for o in f["outages"]] == [2, 3]
    assert f["retries"] == 2 and all(s.replica in (0, 1) for s in res.seqs)
    _accounted(res.summary)


def test_overlapping_faults_make_one_outage_to_the_later_end():
    sc = _two_replicas(
        faults=_faults(
            (0.05, "replica_down", 0, 1.0), (0.5, "replica_down", 0, 2.0), (5.0, "replica_down", 0, 1.0)
        )
    )
    res = krun.run_scenario(sc, workload=make_workload([0.0, 0.0, 5.5], [512] * 3, [50] * 3))
    outages = res.summary["faults"]["outages"]
    assert [(o["down_s"], o["up_s"]) for o in outages] == [
        (0.05, pytest.approx(2.5 + RELOAD_S)),
        (5.0, pytest.approx(6.0 + RELOAD_S)),
    ]
    _accounted(res.summary)


def test_a_fault_after_the_last_request_does_not_lengthen_the_run():
    wl = make_workload([0.0], [64], [4])
    base = krun.run_scenario(small_scenario(), workload=wl)
    res = krun.run_scenario(small_scenario(faults=_faults((100.0, "replica_down", 0, 5.0))), workload=wl)
    assert res.summary["simulated_s"] == base.summary["simulated_s"]
    assert records(res) == records(base)


def test_a_run_without_faults_runs_none_of_their_code():
    """No faults key in the summary, no failed count; the replicas run the plain step loop, with
    the run's end as their only outside event, and the arrivals go through the plain router."""
    sc, wl = _two_replicas(), make_workload([0.0], [64], [4])
    res = krun.run_scenario(sc, workload=wl)
    assert "faults" not in res.summary and "failed" not in res.summary["requests"]
    run = assemble(sc, wl, plan_memory(sc), krun.make_cost_model(sc), make_scheduler=make_pool_and_scheduler)
    assert run.faults is None
    for rep in run.replicas:
        assert rep.faults is None and rep.process._generator.__name__ == "run"  # type: ignore[attr-defined]
        assert rep.next_outside_event() == math.inf


def test_kv_events_are_refused_with_faults():
    sc = small_scenario(faults=_faults((0.5, "replica_down", 0, 2.0)))
    with pytest.raises(KvsimError, match="faults"):
        krun.run_scenario(sc, workload=make_workload([0.0], [64], [4]), kv_events=object())  # type: ignore[arg-type]


def _random(rate: float = 60.0, mean: float = 1.0, **more: object) -> dict:
    return {"random": {"rate_per_hour": rate, "mean_down_s": mean, **more}}


def _steady(n: int = 200, gap_s: float = 0.5, prompt: int = 256):  # type: ignore[no-untyped-def]
    return make_workload([i * gap_s for i in range(n)], [prompt] * n, [20] * n)


def test_random_faults_same_seed_same_outages_another_seed_others():
    """Two replicas failing once a minute each (the bound) over a 99.5 s trace: 3.3 expected;
    seed 3 draws 7. The same seed gives the same outages and summary, stepping or fast-forward;
    seed 4 others; without a seed, sim.seed is the seed."""
    wl = _steady()
    sc = _two_replicas(faults=_random(seed=3))
    a, again = krun.run_scenario(sc, workload=wl), krun.run_scenario(sc, workload=wl)
    b = krun.run_scenario(_stepping(sc), workload=wl)
    f = a.summary["faults"]
    r = f["random"]
    assert (r["kind"], r["components"], r["span_s"], r["seed"]) == ("replica_down", 2, 99.5, 3)
    assert r["expected"] == pytest.approx(60 * 99.5 / 3600 * 2)
    assert r["drawn"] == len(r["events"]) == 7 and len(f["outages"]) == 7  # none overlap here
    assert r["down_s"] == pytest.approx(sum(e["duration_s"] for e in r["events"]))
    assert [(e["target"], e["at_s"]) for e in r["events"]] == sorted(
        (e["target"], e["at_s"]) for e in r["events"]
    )
    assert all(0.0 <= e["at_s"] < 99.5 for e in r["events"])
    for x in (again, b):
        assert x.summary["faults"] == f and x.summary["requests"] == a.summary["requests"]
        assert records(x) == records(a)
    assert again.summary["ttft_s"] == a.summary["ttft_s"]
    _accounted(a.summary)
    other = krun.run_scenario(_two_replicas(faults=_random(seed=4)), workload=wl).summary["faults"]["random"]
    assert other["events"] != r["events"]
    by_sim_seed = _two_replicas(faults=_random(), sim={"seed": 3})
    assert krun.run_scenario(by_sim_seed, workload=wl).summary["faults"]["random"]["events"] == r["events"]


def test_random_faults_do_not_depend_on_the_workload():
    """Other prompts over the same span draw the same failures; a longer trace keeps them and only
    adds later ones (the draws go in fixed chunks, so a span is a prefix of a longer one)."""
    r = RandomFaults(rate_per_hour=60.0, mean_down_s=5.0, seed=11)
    runs = [
        krun.run_scenario(_two_replicas(faults=_random(60.0, 5.0, seed=11)), workload=wl).summary["faults"]
        for wl in (_steady(), _steady(prompt=1024), _steady(n=2000))
    ]
    short, other_prompts, longer = (x["random"]["events"] for x in runs)
    assert short == other_prompts
    assert [e for e in longer if e["at_s"] < 99.5] == short and len(longer) > 2 * len(short)
    assert draw_faults(r, 99.5, 2) == tuple(
        FaultEvent(e["at_s"], FaultKind.REPLICA_DOWN, e["target"], e["duration_s"]) for e in short
    )


def test_drawn_failures_match_the_poisson_expectation():
    """8 nodes at 0.5 failures per node-hour over 1,000 hours: 4,000 expected, a Poisson count
    with standard deviation sqrt(4,000) = 63.2. Seed 7 draws 4,108 (+1.7 sd); the bound is 5 sd
    (a chance of 6e-7 of falling outside for a sound sampler), fixed seed so never flaky. The mean
    down time of 300 s is met within 5 of its standard errors (300 / sqrt(n) = 4.7 s), and each
    node's count within 5 sd of its own 500."""
    r = RandomFaults(rate_per_hour=0.5, mean_down_s=300.0, seed=7, kind=FaultKind.NODE_DOWN)
    span = 1000 * 3600.0
    ev = draw_faults(r, span, 8)
    mu = 0.5 * 1000 * 8
    assert len(ev) == 4108 and abs(len(ev) - mu) < 5 * math.sqrt(mu)
    for node in range(8):
        assert abs(sum(1 for e in ev if e.target == node) - mu / 8) < 5 * math.sqrt(mu / 8)
    mean = sum(e.duration_s for e in ev) / len(ev)
    assert abs(mean - 300.0) < 5 * 300.0 / math.sqrt(len(ev))
    assert all(e.kind is FaultKind.NODE_DOWN and 0 <= e.at_s < span and e.duration_s >= 0 for e in ev)
    assert draw_faults(dataclasses.replace(r, rate_per_hour=0.0), span, 8) == ()


def test_random_node_faults_take_their_node_and_merge_with_the_events():
    """node_down at the rate: components are the 2 nodes, each outage takes both replicas of its
    node; an explicit event on replica 0 is planned beside the drawn ones."""
    sc = small_scenario(
        cluster={"gpus_per_node": 2, "nodes": 2},
        faults={**_faults((1.0, "replica_down", 0, 0.5)), **_random(30.0, 2.0, seed=5, kind="node_down")},
    )
    res = krun.run_scenario(sc, workload=_steady())
    f = res.summary["faults"]
    r = f["random"]
    assert (r["kind"], r["components"]) == ("node_down", 2) and r["drawn"] > 0
    spans = [(o["replica"], o["down_s"], o["up_s"]) for o in f["outages"]]
    assert any(rep == 0 and d == 1.0 for rep, d, _ in spans)
    for e in r["events"]:  # both replicas of the node are down at the draw's instant
        for i in (2 * e["target"], 2 * e["target"] + 1):
            assert any(rep == i and d <= e["at_s"] < u for rep, d, u in spans)
    _accounted(res.summary)


@st.composite
def fault_cases(draw):  # type: ignore[no-untyped-def]
    """`cases()`'s small clusters and workloads (prefix caching, token eviction, sliding windows,
    format switches, speculative decoding), over one or two nodes, with 1-4 faults drawn over
    the arrivals' span: replicas or nodes, short or long, overlapping or not; or, half the time,
    ``faults.random`` at a rate of 0.5-2 failures per component over the span, with 0-2 events."""
    sc, wl = draw(cases())
    nodes = draw(st.sampled_from([1, 2]))
    sc = dataclasses.replace(sc, cluster=dataclasses.replace(sc.cluster, nodes=nodes))
    n_rep = sc.cluster.num_replicas
    span = float(wl.arrival_s[-1]) + 0.5
    random = None
    if draw(st.booleans()) and wl.arrival_s[-1] > 0:  # drawn over [0, last arrival)
        per_component = draw(st.sampled_from([0.5, 1.0, 2.0]))
        random = RandomFaults(
            rate_per_hour=3600.0 * per_component / float(wl.arrival_s[-1]),
            mean_down_s=draw(st.sampled_from([0.05, 0.3, 2.0])),
            seed=draw(st.integers(0, 2**16)),
            kind=draw(st.sampled_from([FaultKind.REPLICA_DOWN, FaultKind.NODE_DOWN])),
        )
    events = []
    for _ in range(draw(st.integers(0, 2) if random is not None else st.integers(1, 4))):
        kind = draw(st.sampled_from([FaultKind.REPLICA_DOWN, FaultKind.NODE_DOWN]))
        target = draw(st.integers(0, (n_rep if kind is FaultKind.REPLICA_DOWN else nodes) - 1))
        at = draw(st.floats(0.0, span, allow_nan=False).map(lambda x: round(x, 3)))
        events.append(FaultEvent(at, kind, target, draw(st.sampled_from([0.001, 0.05, 0.3, 2.0]))))
    bw = draw(st.sampled_from([DEFAULT_RELOAD_BW, 1e12]))  # a reload of 1.2 s, or of 16 ms
    cfg = FaultsConfig(tuple(events), draw(st.integers(0, 3)), bw, "test", random)
    return dataclasses.replace(sc, faults=cfg), wl


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=fault_cases())
def test_random_faults_keep_every_request_and_the_invariants(case):
    """Random fault schedules: every request completes, is rejected or fails (none lost); a failed
    one was dropped max_retries + 1 times; the block-pool and scheduler invariants hold after
    every operation (`CheckedScheduler`); fast-forward equals stepping; the same seed the same run."""
    sc, wl = case
    runs = []
    for ff in (True, False, True):
        made.clear()
        res = krun.run_scenario(
            dataclasses.replace(sc, sim=dataclasses.replace(sc.sim, fast_forward=ff)),
            workload=wl,
            make_scheduler=_checked,
        )
        assert sum(s.checks for s in made) > 0
        for sched in made:  # after the run: what is left in each pool is consistent
            sched.check()
        s = res.summary
        r, f = s["requests"], s["faults"]
        _accounted(s)
        assert r["unfinished"] == 0
        assert r["failed"] == f["failed"] == sum(1 for x in res.seqs if x.status is RequestStatus.FAILED)
        assert f["recomputed_tokens"] == f["lost_prompt_tokens"] + f["lost_output_tokens"]
        assert sum(o["requests_dropped"] for o in f["outages"]) == f["retries"] + f["failed"]
        if sc.faults.random is not None:
            d = f["random"]
            assert d["drawn"] == len(d["events"]) and all(0 <= e["at_s"] < d["span_s"] for e in d["events"])
        for x in res.seqs:
            if x.status is RequestStatus.FINISHED:
                assert x.num_generated == x.output_len
                assert x.arrival_s <= x.first_scheduled_s <= x.first_token_s <= x.finish_s
        assert math.isfinite(s["simulated_s"])
        runs.append(res)
    a, b, c = runs
    f = a.summary["faults"]
    event(f"retried: {f['retries'] > 0}, failed: {f['failed'] > 0}, queued: {f['router_queue_peak'] > 0}")
    event(f"drawn: {'none' if 'random' not in f else min(f['random']['drawn'], 3)}")
    assert records(a) == records(b) == records(c)
    assert a.summary["faults"] == b.summary["faults"] == c.summary["faults"]
    assert a.summary["kv_peak_used_blocks"] == b.summary["kv_peak_used_blocks"]

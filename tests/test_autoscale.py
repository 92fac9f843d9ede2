"""The autoscaler (``cluster.autoscale``, `kvsim.sim.autoscale`): replicas started after the
scale-up delay and drained by load (HPA's rule), billed while up; a story with its exact instants,
conservation and determinism over drawn runs, and a run without it unchanged."""

from __future__ import annotations

import dataclasses
import json
import math

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import kvsim.run as krun
from kvsim.core.memory_plan import plan_memory
from kvsim.core.request import RequestStatus
from kvsim.report import write_report
from kvsim.report.charts import capacity_timeline
from kvsim.results.record import RunSummary
from kvsim.sim.assembly import assemble
from kvsim.sim.cluster import make_pool_and_scheduler
from kvsim.spec.autoscale import AutoscaleConfig, AutoscalePolicy
from tests.helpers import make_workload, records, small_scenario
from tests.test_engine_properties import _checked, cases, made


def _story_workload(burst_output: int = 200):  # type: ignore[no-untyped-def]
    """1 request/s for 10 s, 8/s for the next 10 s, 1/s again until 60 s."""
    arr = [float(i) for i in range(10)] + [10 + i / 8 for i in range(80)] + [float(i) for i in range(20, 60)]
    out = [200] * 10 + [burst_output] * 80 + [200] * 40
    return make_workload(arr, [512] * len(arr), out)


def _autoscaled(**over):  # type: ignore[no-untyped-def]
    a = {"policy": "queue", "target": 8, "interval": 5, "cool_down": 10, "scale_up_delay": 2, **over}
    return small_scenario(cluster={"gpus_per_node": 2, "autoscale": a})


def _accounted(s) -> None:  # type: ignore[no-untyped-def]
    r = s["requests"]
    assert r["completed"] + r["rejected"] + r["unfinished"] == r["total"]


def test_a_load_step_starts_a_replica_that_serves_after_the_delay_and_drains_after_the_cool_down():
    """The burst at 10 s fills replica 0's queue past 8 (+10%) by the 15 s tick: replica 1 starts
    then and takes its first request at 17.0 s (the 2 s delay); the burst over, the ticks at 25 and
    30 s want one replica, and at 30 s the cool-down (10 s: the 20 s tick still wanted two) lets it
    go; it is empty by then, so off at 30 s. GPU-seconds: the run's span plus replica 1's 15 s."""
    res = krun.run_scenario(_autoscaled(), workload=_story_workload())
    s, a = res.summary, res.summary["autoscale"]
    _accounted(s)
    assert s["requests"]["completed"] == 130
    assert (a["timeline_t_s"], a["timeline_replicas"]) == ([0.0, 15.0, 30.0], [1, 2, 1])
    assert (a["scale_ups"], a["scale_downs"]) == (1, 1)
    on1 = sorted(x.arrival_s for x in res.seqs if x.replica == 1)
    assert on1[0] == 17.0 and on1[-1] < 30.0 and len(on1) == 18
    assert min(x.first_scheduled_s for x in res.seqs if x.replica == 1) == 17.0
    assert math.isclose(a["replica_s"], s["simulated_s"] + 15.0, rel_tol=1e-12)
    assert math.isclose(s["gpu_hours"] * 3600.0, a["replica_s"], rel_tol=1e-12)  # TP 1: a GPU a replica
    assert (a["replicas_up"]["min"], a["replicas_up"]["max"]) == (1, 2)
    assert math.isclose(a["replicas_up"]["mean"], a["replica_s"] / s["simulated_s"], rel_tol=1e-12)


def test_a_drained_replica_finishes_its_requests_and_is_off_at_its_last_finish():
    """Without a cool-down, the 40 s tick (the burst's 2,000-token replies nearly done) drains
    replica 1 while one of its requests still decodes: it takes no request after 40 s, drops
    none, and turns off (billing stops) when that request finishes, at 40.44 s."""
    res = krun.run_scenario(_autoscaled(cool_down=0), workload=_story_workload(burst_output=2000))
    s, a = res.summary, res.summary["autoscale"]
    _accounted(s)
    assert s["requests"]["completed"] == s["requests"]["total"] == 130
    assert (a["scale_ups"], a["scale_downs"]) == (1, 1)
    on1 = [x for x in res.seqs if x.replica == 1]
    last = max(x.finish_s for x in on1)
    assert max(x.arrival_s for x in on1) < 40.0 < last
    assert sum(1 for x in on1 if x.finish_s > 40.0) == 1
    assert a["timeline_t_s"] == [0.0, 15.0, last] and a["timeline_replicas"] == [1, 2, 1]
    assert round(last, 2) == 40.44
    assert math.isclose(a["replica_s"], s["simulated_s"] + (last - 15.0), rel_tol=1e-12)


def test_kv_usage_scales_on_the_share_of_the_pool_requests_hold():
    """The kv_usage policy reads vLLM's kv_cache_usage (blocks requests reference over the pool):
    the burst's long contexts fill more of replica 0's pool than the 5% target, so it scales up;
    a target no load reaches (100%) never does."""
    wl = _story_workload(burst_output=2000)
    up = krun.run_scenario(_autoscaled(policy="kv_usage", target=0.05), workload=wl).summary["autoscale"]
    assert up["scale_ups"] >= 1 and up["replicas_up"]["max"] == 2
    never = krun.run_scenario(_autoscaled(policy="kv_usage", target=1.0), workload=wl).summary["autoscale"]
    assert never["scale_ups"] == 0 and never["timeline_replicas"] == [1]


def test_the_same_seed_gives_the_same_run_stepping_or_fast_forward():
    wl = _story_workload(burst_output=600)
    sc = _autoscaled()
    runs = [
        krun.run_scenario(
            dataclasses.replace(sc, sim=dataclasses.replace(sc.sim, fast_forward=ff)), workload=wl
        )
        for ff in (True, False, True)
    ]
    assert records(runs[0]) == records(runs[1]) == records(runs[2])
    assert runs[0].summary["autoscale"] == runs[1].summary["autoscale"] == runs[2].summary["autoscale"]


def test_a_run_without_the_section_builds_no_autoscaler():
    sc = small_scenario(cluster={"gpus_per_node": 2})
    wl = _story_workload()
    run = assemble(sc, wl, plan_memory(sc), krun.make_cost_model(sc), make_scheduler=make_pool_and_scheduler)
    assert run.autoscaler is None
    assert "autoscale" not in krun.run_scenario(sc, workload=wl).summary


@st.composite
def autoscale_cases(draw):  # type: ignore[no-untyped-def]
    """`cases()`'s small clusters and workloads (prefix caching, token eviction, sliding windows,
    format switches, speculative decoding) over two nodes, with an autoscaler drawn over them:
    either policy, a target from tiny (scale at once) to large (never), ticks and delays short
    against the run or not, cool-downs from none to ten ticks."""
    sc, wl = draw(cases())
    sc = dataclasses.replace(sc, cluster=dataclasses.replace(sc.cluster, nodes=2))
    n = sc.cluster.num_replicas
    policy = draw(st.sampled_from(list(AutoscalePolicy)))
    if policy is AutoscalePolicy.QUEUE:
        target = draw(st.sampled_from([0.5, 1.0, 2.0, 8.0]))
    else:
        target = draw(st.sampled_from([0.01, 0.2, 0.7, 1.0]))
    mx = draw(st.integers(1, n) if draw(st.booleans()) else st.just(n))
    mn = draw(st.integers(1, mx) if draw(st.booleans()) else st.just(1))
    initial = draw(st.sampled_from([mn, mn, mx]))
    # runs last from milliseconds to seconds: ticks from many per run to one or none
    interval = draw(st.sampled_from([0.002, 0.02, 0.2, 2.0]))
    cfg = AutoscaleConfig(
        policy,
        target,
        mn,
        mx,
        initial,
        interval,
        draw(st.sampled_from([0.0, interval, 10 * interval])),
        draw(st.sampled_from([0.0, interval / 2, 5 * interval])),
    )
    return dataclasses.replace(sc, cluster=dataclasses.replace(sc.cluster, autoscale=cfg)), wl


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=autoscale_cases())
def test_autoscaled_runs_keep_every_request_and_the_invariants(case):
    """Drawn autoscaled runs: every request completes or is rejected (none lost, none left); the
    block-pool and scheduler invariants hold after every operation (`CheckedScheduler`); replicas
    up stay within [min, max] and their integral bills the GPUs; no request starts on a replica
    before it serves; fast-forward equals stepping; the same seed the same run."""
    sc, wl = case
    cfg = sc.cluster.autoscale
    runs = []
    for ff in (True, False, True):
        made.clear()
        res = krun.run_scenario(
            dataclasses.replace(sc, sim=dataclasses.replace(sc.sim, fast_forward=ff)),
            workload=wl,
            make_scheduler=_checked,
        )
        assert sum(x.checks for x in made) > 0
        for sched in made:
            sched.check()
        s, a = res.summary, res.summary["autoscale"]
        _accounted(s)
        assert s["requests"]["unfinished"] == 0
        assert cfg.min_replicas <= a["replicas_up"]["min"] <= a["replicas_up"]["max"] <= cfg.max_replicas
        assert a["timeline_replicas"][0] == cfg.initial_replicas
        assert all(cfg.min_replicas <= k <= cfg.max_replicas for k in a["timeline_replicas"])
        gpus = sc.cluster.tensor_parallel
        assert math.isclose(s["gpu_hours"] * 3600.0, a["replica_s"] * gpus, rel_tol=1e-9, abs_tol=1e-12)
        for x in res.seqs:
            if x.status is RequestStatus.FINISHED:
                assert x.num_generated == x.output_len
                assert x.arrival_s <= x.first_scheduled_s <= x.first_token_s <= x.finish_s
            if x.replica >= cfg.initial_replicas and x.first_scheduled_s == x.first_scheduled_s:
                assert x.first_scheduled_s >= cfg.interval_s + cfg.scale_up_delay_s - 1e-9
        runs.append(res)
    a0 = runs[0].summary["autoscale"]
    event(f"scaled up: {a0['scale_ups'] > 0}, down: {a0['scale_downs'] > 0}")
    event(f"a request on a started replica: {any(x.replica >= cfg.initial_replicas for x in runs[0].seqs)}")
    assert records(runs[0]) == records(runs[1]) == records(runs[2])
    assert runs[0].summary["autoscale"] == runs[1].summary["autoscale"] == runs[2].summary["autoscale"]


def test_the_report_draws_the_capacity_timeline_above_latency_and_hit_rate(tmp_path):
    """The story's report: a capacity chart whose step is the summary's timeline (1, 2, 1 replicas
    from 0, 15 and 30 s), with TTFT and the hit rate by arrival below it; a plain run has none."""
    res = krun.run_scenario(_autoscaled(), workload=_story_workload())
    krun.write_run(res, tmp_path / "as")
    html = write_report(tmp_path / "as").read_text(encoding="utf-8")
    assert "kvsim-capacity" in html and "Capacity over time (the autoscaler's replicas up)" in html
    assert "TTFT by arrival" in html and "prefix hit rate by arrival" in html
    cap = capacity_timeline(RunSummary.from_dict(json.loads((tmp_path / "as" / "summary.json").read_text())))
    assert cap is not None and cap[:2] == ([0.0, 15.0, 30.0], [1, 2, 1])
    plain = krun.run_scenario(small_scenario(cluster={"gpus_per_node": 2}), workload=_story_workload())
    krun.write_run(plain, tmp_path / "plain")
    assert "kvsim-capacity" not in write_report(tmp_path / "plain").read_text(encoding="utf-8")


def test_with_faults_the_capacity_is_the_replicas_less_those_down(tmp_path):
    """Replica 1 down at 5 s for 10 s (back after its reload): two replicas, then one, then two."""
    faults = {"events": [{"at": 5.0, "kind": "replica_down", "target": 1, "duration": 10.0}]}
    res = krun.run_scenario(
        small_scenario(cluster={"gpus_per_node": 2}, faults=faults), workload=_story_workload()
    )
    krun.write_run(res, tmp_path)
    cap = capacity_timeline(RunSummary.from_dict(json.loads((tmp_path / "summary.json").read_text())))
    up = res.summary["faults"]["outages"][0]["up_s"]
    assert cap is not None and cap == ([0.0, 5.0, up], [2, 1, 2], "faults")
    assert "kvsim-capacity" in write_report(tmp_path).read_text(encoding="utf-8")

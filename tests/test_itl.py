"""Inter-token latency (``itl_s``): the gap before each output token after a request's first,
pooled over completed requests' tokens, exact whether steps run one by one or in fast-forward windows."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvsim.results.summary import QUANTILES, weighted_dist
from kvsim.run import make_cost_model, run_scenario
from tests.helpers import make_workload, small_scenario


def test_weighted_percentiles_equal_numpy_on_the_repeated_array() -> None:
    rng = np.random.default_rng(3)
    for size in (1, 2, 7, 200):
        values = rng.choice(rng.random(max(1, size // 3)), size)  # ties included
        counts = rng.integers(0, 40, size)
        counts[0] = max(counts[0], 1)
        qs = (0.0, 1.0, 25.0, 50.0, 66.6, 90.0, 99.0, 99.9, 100.0)
        d = weighted_dist(values, counts, qs)
        full = np.repeat(values, counts)
        for key, q in QUANTILES.items():
            assert getattr(d, key) == float(np.percentile(full, q)), (size, q)
        for q in qs:
            assert d.by_percentile[f"p{q:g}"] == float(np.percentile(full, q)), (size, q)
        assert d.mean == pytest.approx(float(full.mean()), rel=1e-12)


class _Recording:
    """The run's cost model, recording each priced step's seconds in order."""

    def __init__(self, cost) -> None:  # type: ignore[no-untyped-def]
        self.cost, self.seconds = cost, []

    def step_seconds(self, run):  # type: ignore[no-untyped-def]
        t = self.cost.step_seconds(run)
        self.seconds.append(t)
        return t

    def step_times(self, run):  # type: ignore[no-untyped-def]
        times = self.cost.step_times(run)
        self.seconds.extend(times.tolist())
        return times

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self.cost, name)


def test_one_request_itl_is_its_decode_steps_times() -> None:
    """One request, 100 prompt tokens, 6 output tokens, stepped one by one: the first step (the
    prefill) samples the first token, each of the 5 decode steps after it one more, so the gaps are
    exactly those 5 steps' priced seconds; their mean is the request's TPOT."""
    sc = small_scenario(sim={"seed": 1, "fast_forward": False})
    cost = _Recording(make_cost_model(sc))
    res = run_scenario(sc, workload=make_workload([0.0], [100], [6]), cost=cost)  # type: ignore[arg-type]
    assert len(cost.seconds) == 6
    gaps = np.array(cost.seconds[1:])
    itl, tpot = res.record.itl_s, res.record.tpot_s
    assert itl is not None
    for key, q in QUANTILES.items():  # gaps are differences of clock times: equal to the ulp
        assert getattr(itl, key) == pytest.approx(float(np.percentile(gaps, q)), rel=1e-12, abs=0)
    assert itl.mean == pytest.approx(tpot.mean, rel=1e-12)
    assert gaps.min() < gaps.max()  # the context grows: the story's gaps are not all one number


@pytest.mark.parametrize("spec", [None, {"k": 3, "acceptance": {"mean": 0.7}, "draft": {"kind": "mtp"}}])
def test_fast_forward_gives_the_same_itl_as_stepping(spec) -> None:  # type: ignore[no-untyped-def]
    """Windows share gaps among their requests; the distribution is stepping's, number for number."""
    arrivals = [0.0, 0.01, 0.02, 0.5, 0.51, 1.3]
    prompts, outputs = [300, 40, 900, 100, 64, 500], [80, 300, 20, 150, 1, 60]
    out, runs = [], []
    for ff in (True, False):
        sc = small_scenario(
            scheduler={"spec_decode": spec} if spec else {}, sim={"seed": 7, "fast_forward": ff}
        )
        res = run_scenario(sc, workload=make_workload(arrivals, prompts, outputs), percentiles=(95.0, 99.9))
        assert res.record.itl_s is not None
        out.append(res.record)
        runs.append(res)
    a, b = (dataclasses.asdict(r.itl_s) for r in out)  # type: ignore[arg-type]
    assert a.pop("mean") == pytest.approx(b.pop("mean"), rel=1e-12)
    assert a == b and set(a["by_percentile"]) == {"p95", "p99.9"}
    # a request's gaps sum to finish - first token: the pooled mean weighs requests by their tokens
    done = [s for s in runs[0].seqs if s.output_len > 1]
    spans = sum(s.finish_s - s.first_token_s for s in done)
    assert out[0].itl_s.mean == pytest.approx(spans / sum(s.output_len - 1 for s in done), rel=1e-12)  # type: ignore[union-attr]

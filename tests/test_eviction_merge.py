"""Token merging (kv.eviction.policy: merge): H2O's closed form with its own share, held and
priced as H2O at that share, with its own accuracy estimate (an assumption, its sources cited)."""

from __future__ import annotations

import pytest

import kvsim.run as krun
from kvsim.core.eviction import Eviction, EvictionKind
from tests.helpers import records, small_scenario

WL = {
    "synthetic": {
        "num_requests": 30,
        "rate": 5,
        "input": {"dist": "constant", "mean": 600},
        "output": {"dist": "constant", "mean": 200},
    }
}


def test_merge_keeps_its_share_plus_the_recent_window() -> None:
    ev = Eviction(EvictionKind.MERGE, merge_ratio=0.25, recent_tokens=16, budget_tokens=200)
    assert ev.scores() and ev.share == 0.25
    assert [ev.kept(p) for p in (10, 20, 100, 1000)] == [10, 20, 16 + 25, 200]


@pytest.mark.parametrize("ratio", [0.1, 0.3, 1.0])
def test_merge_is_held_and_priced_as_h2o_at_the_same_share(ratio: float) -> None:
    ev = {"recent_tokens": 32, "pages": "physical"}
    merge = small_scenario(
        num_blocks=300, kv={"eviction": {**ev, "policy": "merge", "merge_ratio": ratio}}, workload=WL
    )
    h2o = small_scenario(
        num_blocks=300, kv={"eviction": {**ev, "policy": "h2o", "heavy_ratio": ratio}}, workload=WL
    )
    a, b = krun.run_scenario(merge), krun.run_scenario(h2o)
    assert records(a) == records(b)
    assert a.summary["eviction"]["tokens_evicted"] == b.summary["eviction"]["tokens_evicted"]
    assert a.summary["eviction"]["merge_ratio"] == ratio and a.summary["eviction"]["heavy_ratio"] is None
    part, h2o_part = a.summary["accuracy_estimate"]["parts"][0], b.summary["accuracy_estimate"]["parts"][0]
    assert part["basis"] == "assumption" and "CaM" in part["source"]
    assert part["loss"] == h2o_part["loss"]  # at most H2O's estimate at the same kept share
    sources = [x["source"] for x in a.summary["eviction"]["accuracy"]["literature"]]
    assert any("003" in x for x in sources) and any("CaM" in x for x in sources)

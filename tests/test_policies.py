"""Policies are enums that still compare and print as their names; renamed sections still read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvsim.cli import main
from kvsim.errors import KvsimError
from kvsim.run import run_scenario
from kvsim.spec.scenario import (
    CostModelKind,
    EvictionPolicy,
    PrefixCacheScope,
    RouterPolicy,
    load_scenario,
)
from tests.helpers import make_workload, small_scenario

CORPUS = Path(__file__).parent / "scenarios"


def test_policies_are_enums_that_read_as_their_names():
    sc = small_scenario(cluster={"gpu": "h100-sxm", "router": "prefix_affinity"}, kv={"prefix_cache": False})
    assert sc.cluster.router is RouterPolicy.PREFIX_AFFINITY and sc.cluster.router == "prefix_affinity"
    assert sc.kv.prefix_cache is PrefixCacheScope.NONE
    assert sc.kv.eviction.policy is EvictionPolicy.NONE
    assert sc.cost_model.kind is CostModelKind.ANALYTIC
    assert f"{sc.cluster.router}" == str(sc.cluster.router) == "prefix_affinity"
    assert json.dumps(sc.cluster.router) == '"prefix_affinity"'
    assert "least_outstanding_requests" in {p.value for p in RouterPolicy}


def test_an_unknown_router_is_one_line_exit_2(tmp_path, capsys):
    path = CORPUS / "invalid" / "policy_unknown_router.yaml"
    assert main(["run", str(path), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "cluster.router: expected one of round_robin, least_outstanding_tokens" in err


def test_old_section_names_read_with_a_note_in_the_warnings():
    old = load_scenario(CORPUS / "valid" / "old_section_names.yaml")
    assert old.gpu_hour_usd == 2.0 and old.cost_model.kind is CostModelKind.ANALYTIC
    assert len(old.notes) == 2
    res = run_scenario(old, workload=make_workload([0.0], [100], [2]))
    warnings = res.summary["warnings"]
    assert "section 'cost' is now called 'pricing'; the old name still reads, rename it" in warnings
    assert "section 'costs' is now called 'cost_model'; the old name still reads, rename it" in warnings
    new = small_scenario(pricing={"gpu_hour": "$2.00/h"}, cost_model={"kind": "analytic"})
    assert new.notes == () and new.gpu_hour_usd == 2.0
    assert not run_scenario(new, workload=make_workload([0.0], [100], [2])).summary["warnings"]


def test_both_names_of_a_section_is_an_error():
    with pytest.raises(KvsimError, match="cost: the old name of pricing: give the section once"):
        small_scenario(cost={"gpu_hour": "$1/h"}, pricing={"gpu_hour": "$1/h"})
    # An override in the old name onto a file in the new names is the same mistake.
    with pytest.raises(KvsimError, match="costs: the old name of cost_model"):
        load_scenario(CORPUS / "valid" / "full.yaml", ["costs.kind=analytic"])

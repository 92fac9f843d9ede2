"""Golden outputs of small scenarios (tests/goldens): a refactor must not move them.

A change that moves them on purpose regenerates them with ``python tests/goldens/goldens.py --regen``
in a commit that says why.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.goldens.goldens import EXPECTED, diff_rows, diff_summary, golden_names, normalise, produce


@pytest.mark.parametrize("name", golden_names())
def test_golden(name: str, tmp_path: Path) -> None:
    expected = EXPECTED / name
    assert (expected / "summary.json").is_file(), f"no golden for {name}: run goldens.py --regen {name}"
    summary, rows = produce(name, tmp_path)
    golden = normalise(json.loads((expected / "summary.json").read_text()))
    with (expected / "requests.csv").open() as f:
        golden_rows = list(csv.reader(f))
    problems = diff_summary(golden, summary) + diff_rows(golden_rows, rows)
    assert not problems, f"{name} moved ({len(problems)} differences):\n" + "\n".join(problems[:30])


def test_goldens_cover_the_issue_cases() -> None:
    assert set(golden_names()) >= {
        "azure_1replica",
        "mooncake_2replicas",
        "pressure_preemption",
        "profile_h200",
        "synthetic_sessions",
    }


def test_goldens_cover_the_tier_mechanisms() -> None:
    """Issue 30: the tier mechanisms each have a scaled-down golden (their numbers, not only their
    invariants): offload with loads, the global pool with the cache-aware router, pool nodes, swap
    and auto preemption, speculative decoding, a lossy format, token eviction."""
    assert set(golden_names()) >= {
        "tier_offload_writeback",
        "tier_global_pool_cache_aware",
        "tier_pool_nodes",
        "tier_preempt_swap",
        "tier_preempt_auto",
        "tier_spec_decode",
        "tier_format_int4",
        "tier_eviction_h2o",
    }


@pytest.mark.parametrize(
    ("name", "section", "fields"),
    [
        ("tier_offload_writeback", "offload", ("loads", "loaded_bytes", "written_bytes")),
        ("tier_global_pool_cache_aware", "global_pool", ("fetched_bytes", "remote_bytes", "published_bytes")),
        ("tier_pool_nodes", "global_pool", ("fetched_bytes", "published_bytes")),
        ("tier_preempt_swap", "swap", ("swaps",)),
        ("tier_preempt_auto", "swap", ("swaps", "recomputes")),
        ("tier_spec_decode", "spec_decode", ("drafted_tokens", "accepted_tokens")),
        ("tier_eviction_h2o", "eviction", ("tokens_evicted", "trims")),
    ],
)
def test_each_tier_golden_exercises_its_mechanism(name: str, section: str, fields: tuple[str, ...]) -> None:
    """A golden pins a mechanism only if its run uses it: the pinned counts are positive."""
    golden = json.loads((EXPECTED / name / "summary.json").read_text())
    assert golden[section] is not None, name
    for f in fields:
        assert golden[section][f] > 0, f"{name}: {section}.{f}"


def test_diff_catches_a_changed_number() -> None:
    assert diff_summary({"a": {"b": 1.0}}, {"a": {"b": 1.0 + 1e-6}})
    assert not diff_summary({"a": {"b": 1.0}}, {"a": {"b": 1.0 + 1e-13}, "new": 3})
    assert diff_summary({"a": 1}, {})
    assert diff_rows([["x"], ["1"]], [["x"], ["2"]])

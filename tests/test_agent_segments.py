"""kv.segments: a cache policy per agent prompt segment (keep, window, evict_after_use); what the
next turn reuses, holes in the prefix, and the blocks dropped."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import pytest

import kvsim.run as krun
from kvsim.core.block_pool import BlockPool, BlockRemoved
from kvsim.errors import KvsimError
from kvsim.spec.agent import segment_cuts
from tests.helpers import ROOT, records
from tests.test_agent import CONST, agent_scenario, by_turn

# One session of 4 turns; every reply calls a tool, so turns 1.. take a 200-token tool output.
# Head: 160 + 96 = 256 tokens (16 blocks); turn t's prompt: head, t earlier turns, its input.
TOOLS: dict[str, Any] = {"turns": {"dist": CONST, "mean": 4}, "tool_call_share": 1.0}


def run(kv: dict[str, Any] | None = None, **agent: Any):  # type: ignore[no-untyped-def]
    res = krun.run_scenario(agent_scenario(kv=kv, **{**TOOLS, **agent}))
    return res, by_turn(res)


def test_pool_drops_a_released_tail_instead_of_caching_it() -> None:
    pool = BlockPool(10, events=True)
    pool.allocate(4)
    pool.register([1, 2, 3, 4], [1, 1, 1, 1])
    pool.acquire_cached([3])  # another request still holds entry 3
    pool.take_events()
    pool.release_dropping(0, [1, 2, 3, 4], 2)
    pool.check()
    assert list(pool.lru) == [2, 1] and 4 not in pool.refs and pool.refs[3] == 1
    assert pool.dropped == 1 and pool.free == 7
    assert pool.take_events() == [BlockRemoved((4,), (1,))]


def test_plain_turns_hit_the_whole_previous_stream() -> None:
    _, seqs = run()
    for prev, cur in pairwise(seqs):
        assert cur.num_cached_tokens == (prev.prompt_len + prev.output_len - 1) // 16 * 16


def test_evict_after_use_is_a_hole_when_the_prompt_keeps_the_tool_output() -> None:
    """The tool output turn t used leaves the cache at t's end; turn t + 1's prompt still holds
    it, so turn t + 1 hits only up to the block where it starts and recomputes the rest."""
    res, seqs = run(kv={"segments": {"tool_output": "evict_after_use"}})
    wl = krun.scenario_workload(res.scenario)
    ag = wl.agent
    for prev, cur in pairwise(seqs):
        start = int(ag.input_start[prev.id])
        if prev.id == seqs[0].id:  # turn 0's input is a user message: nothing dropped
            assert cur.num_cached_tokens == (prev.prompt_len + prev.output_len - 1) // 16 * 16
        else:
            assert cur.num_cached_tokens == start // 16 * 16
    assert res.summary["sessions"]["segment_dropped_blocks"] > 0
    assert res.summary["sessions"]["segment_policies"] == {"tool_output": "evict_after_use"}


def test_evict_after_use_costs_nothing_when_the_prompt_drops_the_tool_output() -> None:
    """With the agent dropping used tool outputs, the dropped blocks were dead anyway: the same
    hits, and they are freed at the turn's end instead of waiting in the LRU."""
    plain, a = run(tool_outputs="drop")
    cut, b = run(kv={"segments": {"tool_output": "evict_after_use"}}, tool_outputs="drop")
    assert [s.num_cached_tokens for s in a] == [s.num_cached_tokens for s in b]
    assert records(plain) == records(cut)
    assert cut.summary["sessions"]["segment_dropped_blocks"] > 0


@pytest.mark.parametrize(
    ("turns", "retain", "hits_head_plus"), [(1, 0, [None, 0, 0]), (1, 1, [None, None, 1])]
)
def test_history_window_keeps_the_head_and_the_retained_turns(
    turns: int, retain: int, hits_head_plus: list[int | None]
) -> None:
    """Window W, retain N: once the next prompt's history passes N + W turns, a finished turn is
    cut at its earlier turn N: the next turn hits the head and the first N turns (None: the whole
    previous stream, no cut yet)."""
    kv = {"segments": {"history": {"policy": "window", "turns": turns, "retain": retain}}}
    res, seqs = run(kv=kv, tool_call_share=0.0)
    ag = krun.scenario_workload(res.scenario).agent
    for k, (prev, cur) in enumerate(pairwise(seqs)):
        n = hits_head_plus[k]
        if n is None:
            assert cur.num_cached_tokens == (prev.prompt_len + prev.output_len - 1) // 16 * 16
        else:
            at = (
                ag.history_starts[prev.id][n]
                if n < len(ag.history_starts[prev.id])
                else ag.input_start[prev.id]
            )
            assert cur.num_cached_tokens == at // 16 * 16


def test_keep_is_pinning() -> None:
    kw: dict[str, Any] = {"sessions": 6, "rate": 2, "tool_call_share": 0.5}
    a = krun.run_scenario(agent_scenario(kv={"segments": {"system": "keep", "tools": "keep"}}, **kw))
    b = krun.run_scenario(agent_scenario(kv={"prefix_cache": {"pin": ["system", "tools"]}}, **kw))
    assert records(a) == records(b)
    assert a.scenario.kv.pin_segments == ("system", "tools")


def test_cuts_only_where_a_policy_drops() -> None:
    res, _ = run(kv={"segments": {"system": "keep"}})
    assert res.scenario.kv.segments is not None and not res.scenario.kv.segments.drops
    assert res.summary["sessions"]["segment_dropped_blocks"] == 0
    sc = agent_scenario(kv={"segments": {"tool_output": "evict_after_use"}}, **TOOLS)
    cuts = segment_cuts(sc.kv.segments, krun.scenario_workload(sc).agent)  # type: ignore[arg-type]
    assert sorted(c >= 0 for c in cuts) == [False, True, True, True]


def test_segments_need_marked_segments() -> None:
    from tests.helpers import small_scenario

    with pytest.raises(KvsimError, match="kv.segments"):
        small_scenario(kv={"segments": {"system": "keep"}})


def test_shipped_case_evict_after_use_beats_pinning_alone_under_pressure() -> None:
    """`agent_segments.yaml` cut to 100 sessions on 6,127 blocks: dropping the used tool outputs
    at once keeps more live history cached than pinning alone (scenarios/README.md's table)."""
    from kvsim.spec.scenario import load_scenario

    path = ROOT / "scenarios/cases/agent_segments.yaml"
    small = ["workload.agent.sessions=100", "cluster.gpu_memory_utilization=0.36"]
    pin = krun.run_scenario(load_scenario(path, [*small, "kv.segments={system: keep, tools: keep}"]))
    cut = krun.run_scenario(load_scenario(path, small))
    assert (
        cut.summary["sessions"]["segment_dropped_blocks"]
        > 0
        == pin.summary["sessions"]["segment_dropped_blocks"]
    )
    assert cut.summary["prefix_hit_rate"] > pin.summary["prefix_hit_rate"] + 0.01
    assert cut.summary["ttft_s"]["p50"] < pin.summary["ttft_s"]["p50"]


@pytest.mark.parametrize("share", [0.4, 0.5, 0.6])
def test_head_share_sizes_the_tools_to_the_documents_share(share: float) -> None:
    """``head_share`` (003's 40-60%; 0.5 their midpoint) sizes tool_tokens so that system prompt
    and tools are that share of the prompt tokens with the full history: within two points."""
    from tests.helpers import small_scenario

    agent = {"sessions": 200, "rate": 1, "system_prompt_tokens": 1000, "head_share": share}
    sc = small_scenario(workload={"synthetic": None, "agent": agent})
    assert sc.workload.agent is not None and sc.workload.agent.head_share == share
    st = krun.scenario_workload(sc).agent.segment_tokens  # type: ignore[union-attr]
    assert (st[:, 0].sum() + st[:, 1].sum()) / st.sum() == pytest.approx(share, abs=0.02)


@pytest.mark.parametrize("history_turns", [0, 2])
def test_cuts_fall_inside_the_session_part_of_each_prompt(history_turns: int) -> None:
    """A cut is never inside the shared head (its blocks stay for every session) and never past
    the prompt: from this turn's input at the latest."""
    segments = {"tool_output": "evict_after_use", "history": {"policy": "window", "turns": 2, "retain": 1}}
    sc = agent_scenario(
        kv={"segments": segments},
        sessions=8,
        rate=2,
        tool_call_share=0.5,
        history_turns=history_turns,
        turns={"dist": "uniform", "mean": 6, "stdev": 2},
    )
    wl = krun.scenario_workload(sc)
    ag = wl.agent
    assert ag is not None and sc.kv.segments is not None
    head = 160 + 96
    cuts = segment_cuts(sc.kv.segments, ag)
    assert any(c >= 0 for c in cuts)
    for i, c in enumerate(cuts):
        assert c == -1 or head <= c <= int(ag.input_start[i]) < int(wl.prompt_tokens[i])

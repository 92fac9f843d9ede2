"""Agent sessions: closed-loop turns, prompts of marked segments, context policies, pinning."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvsim.run as krun
from kvsim.core.block_pool import BlockPool
from kvsim.core.request import RequestStatus
from kvsim.spec.agent import SEGMENTS
from tests.helpers import records, small_scenario

CONST = "constant"


def agent_scenario(num_blocks: int | None = None, kv: dict[str, Any] | None = None, **agent: Any):  # type: ignore[no-untyped-def]
    base: dict[str, Any] = {
        "sessions": 1,
        "rate": 1,
        "turns": {"dist": CONST, "mean": 3},
        "system_prompt_tokens": 160,
        "tool_tokens": 96,
        "user": {"dist": CONST, "mean": 40},
        "tool_output": {"dist": CONST, "mean": 200},
        "output": {"dist": CONST, "mean": 30},
        "tool_call_share": 0.0,
        "think_time": "2s",
        "tool_time": "500ms",
    }
    base.update(agent)
    sc = small_scenario(num_blocks=num_blocks, kv=kv or {}, workload={"synthetic": None, "agent": base})
    return sc


def by_turn(res):  # type: ignore[no-untyped-def]
    """The run's requests in session, turn order."""
    ag = krun.scenario_workload(res.scenario).agent
    return sorted(res.seqs, key=lambda s: (ag.session[s.id], ag.turn[s.id]))


def test_closed_loop_turn_is_sent_think_time_after_the_previous_reply() -> None:
    res = krun.run_scenario(agent_scenario())
    seqs = by_turn(res)
    assert [s.status for s in seqs] == [RequestStatus.FINISHED] * 3
    for prev, nxt in itertools.pairwise(seqs):
        assert nxt.arrival_s == prev.finish_s + 2.0  # exactly: the think time after the reply
    # Turn t's prompt: system + tools + every earlier (input, reply) + its own input.
    assert [s.prompt_len for s in seqs] == [160 + 96 + 40, 256 + 70 + 40, 256 + 140 + 40]
    sess = res.summary["sessions"]
    assert sess["completed"] == 1 and sess["turns_completed"] == 3
    assert sess["duration_s"]["p50"] == pytest.approx(seqs[-1].finish_s - seqs[0].arrival_s)
    assert sess["prompt_tokens_by_segment"] == {
        "system": 480,
        "tools": 288,
        "history": 70 + 140,
        "tool_output": 0,
        "user": 120,
    }


def test_open_loop_turns_keep_their_generated_times() -> None:
    res = krun.run_scenario(agent_scenario(closed_loop=False))
    seqs = by_turn(res)
    assert [s.arrival_s for s in seqs] == [0.0, 2.0, 4.0]


def test_next_turn_hits_the_previous_prompt_and_reply() -> None:
    """The reply's full blocks are cached when it finishes; the next turn's prompt holds them."""
    res = krun.run_scenario(agent_scenario())
    seqs = by_turn(res)
    for prev, nxt in itertools.pairwise(seqs):
        stored = (prev.prompt_len + prev.output_len - 1) // 16 * 16  # full blocks written
        assert nxt.num_cached_tokens == stored


def test_tool_outputs_dropped_after_use_shrink_prompts_and_break_the_prefix() -> None:
    kw: dict[str, Any] = {"tool_call_share": 1.0, "turns": {"dist": CONST, "mean": 3}}
    keep = by_turn(krun.run_scenario(agent_scenario(**kw, tool_outputs="keep")))
    drop = by_turn(krun.run_scenario(agent_scenario(**kw, tool_outputs="drop")))
    comp = by_turn(krun.run_scenario(agent_scenario(**kw, tool_outputs="compress", compress_ratio=0.25)))
    # Turn 1's input is turn 0's tool call output (200 tokens), sent after the tool time.
    assert keep[1].arrival_s == keep[0].finish_s + 0.5
    assert keep[2].prompt_len == 256 + (40 + 30) + (200 + 30) + 200
    assert drop[2].prompt_len == 256 + (40 + 30) + 30 + 200  # turn 1's tool output dropped
    assert comp[2].prompt_len == 256 + (40 + 30) + (50 + 30) + 200  # a 25% summary instead
    # Keeping it, turn 2 hits everything turn 1 stored; dropping it, the prefix ends before it.
    assert keep[2].num_cached_tokens == (keep[1].prompt_len + 30 - 1) // 16 * 16
    assert drop[2].num_cached_tokens == (256 + 70) // 16 * 16


def test_history_window_bounds_the_prompt() -> None:
    seqs = by_turn(krun.run_scenario(agent_scenario(turns={"dist": CONST, "mean": 5}, history_turns=1)))
    assert [s.prompt_len for s in seqs] == [296] + [256 + 70 + 40] * 4


def test_pinned_system_prompt_survives_memory_pressure() -> None:
    """Two system prompts of 50 blocks, sessions of 102 blocks in a 160-block pool: plain LRU
    evicts the idle system prompt (released before the other sessions' tails); pinned, it stays,
    and the other sessions' own blocks are evicted instead."""
    kw: dict[str, Any] = {
        "sessions": 12,
        "rate": 0.2,
        "turns": {"dist": CONST, "mean": 1},
        "system_prompt_tokens": 800,
        "tool_tokens": 0,
        "system_prompts": 2,
        "user": {"dist": CONST, "mean": 800},
        "output": {"dist": CONST, "mean": 20},
    }
    plain = krun.run_scenario(agent_scenario(num_blocks=160, **kw))
    pinned = krun.run_scenario(
        agent_scenario(num_blocks=160, kv={"prefix_cache": {"pin": ["system"], "pin_max_share": 0.7}}, **kw)
    )
    wl = krun.scenario_workload(pinned.scenario)
    prompts_used = len({int(h[0]) for h in wl.hash_ids})
    assert prompts_used == 2
    # Pinned: every session after the first of its system prompt hits its 800 tokens.
    assert sorted(s.num_cached_tokens for s in pinned.seqs) == [0] * 2 + [800] * 10
    assert pinned.summary["sessions"]["pinned_blocks_peak"] == 100
    hits_plain = sum(s.num_cached_tokens for s in plain.seqs)
    assert hits_plain < 800 * 10  # plain LRU lost a system prompt at least once
    assert plain.summary["sessions"]["pinned_blocks_peak"] == 0


def test_pool_pins_up_to_its_cap_and_never_evicts_pinned() -> None:
    pool = BlockPool(10)
    pool.pin(frozenset({1, 2}), max_blocks=3)
    pool.allocate(6)
    pool.register([1, 2, 3], [2, 2, 2])
    pool.release(0, [1, 2, 3])  # 3 first, then 2 (pinned, 2 blocks), then 1 (over the cap: LRU)
    pool.check()
    assert pool.pinned == {2: 0} and pool.pinned_blocks == 2 and list(pool.lru) == [3, 1]
    assert pool.num_used == 0 and pool.num_cached_free == 6
    evicted = pool.allocate(8)  # takes the 4 empty blocks, then evicts 3 and 1, never 2
    assert evicted == [3, 1] and 2 in pool.refs
    pool.check()
    pool.acquire_cached([2])  # a hit on the pinned entry
    assert pool.pinned_blocks == 0 and pool.refs[2] == 1
    pool.check()


def test_same_seed_same_sessions() -> None:
    sc = agent_scenario(
        sessions=20, rate=2, tool_call_share=0.5, turns={"dist": "uniform", "mean": 4, "stdev": 1}
    )
    a, b = krun.run_scenario(sc), krun.run_scenario(sc)
    assert records(a) == records(b) and [s.arrival_s for s in a.seqs] == [s.arrival_s for s in b.seqs]


def test_a_rejected_turn_ends_its_session_and_is_accounted() -> None:
    # Turn t needs ceil((325 + 70 t) / 16) blocks: a 30-block pool rejects turn 3 (34 blocks),
    # and the session sends nothing after it.
    res = krun.run_scenario(agent_scenario(num_blocks=30, turns={"dist": CONST, "mean": 6}))
    seqs = by_turn(res)
    statuses = [s.status for s in seqs]
    assert RequestStatus.REJECTED in statuses
    k = statuses.index(RequestStatus.REJECTED)
    assert k == 3 and len(seqs) == k + 1  # nothing after the rejected turn was sent
    r = res.summary["requests"]
    assert r["completed"] + r["rejected"] + r["unfinished"] == r["total"] == k + 1
    assert r["not_arrived"] == 6 - (k + 1)
    assert any("never sent" in w for w in res.summary["warnings"])


@st.composite
def agent_cases(draw):  # type: ignore[no-untyped-def]
    agent = {
        "sessions": draw(st.integers(1, 6)),
        "rate": draw(st.sampled_from([0.5, 5.0, 100.0])),
        "turns": {"dist": "uniform", "mean": draw(st.integers(1, 4)), "stdev": 1},
        "system_prompt_tokens": draw(st.sampled_from([0, 40, 160])),
        "system_prompts": draw(st.integers(1, 2)),
        "tool_tokens": draw(st.sampled_from([0, 64])),
        "tool_call_share": draw(st.sampled_from([0.0, 0.5, 1.0])),
        "tool_outputs": draw(st.sampled_from(["keep", "drop", "compress"])),
        "history_turns": draw(st.sampled_from([0, 1, 2])),
        "think_time": draw(st.sampled_from([0, "10ms", "1s"])),
        "tool_time": draw(st.sampled_from([0, "5ms"])),
        "user": {"dist": "uniform", "mean": 30, "stdev": 10},
        "tool_output": {"dist": "uniform", "mean": 80, "stdev": 40},
        "output": {"dist": "uniform", "mean": 20, "stdev": 10},
    }
    kv: dict[str, Any]
    if draw(st.booleans()):  # kv.segments: only for segments the drawn workload has
        seg: dict[str, Any] = {}
        if agent["system_prompt_tokens"] and draw(st.booleans()):
            seg["system"] = "keep"
        if agent["tool_tokens"] and draw(st.booleans()):
            seg["tools"] = "keep"
        if draw(st.booleans()):
            seg["history"] = {
                "policy": "window",
                "turns": draw(st.integers(1, 3)),
                "retain": draw(st.integers(0, 2)),
            }
        if agent["tool_call_share"] and draw(st.booleans()):
            seg["tool_output"] = draw(st.sampled_from(["evict_after_use", "lru"]))
        keeps = "keep" in seg.values()
        kv = {"segments": seg, "prefix_cache": {"pin_max_share": 0.3} if keeps else {}}
    else:
        pin = draw(st.sampled_from([[], ["system"], ["system", "tools"]]))
        # (pin_max_share with nothing pinned is refused: it would be silently ignored)
        kv = {"prefix_cache": {"pin": pin, "pin_max_share": 0.3} if pin else {"pin": pin}}
    scheduler = {
        "max_num_seqs": draw(st.sampled_from([2, 64])),
        "max_batched_tokens": draw(st.sampled_from([64, 2048])),
    }
    cluster = {"gpus_per_node": draw(st.sampled_from([1, 2])), "router": "prefix_affinity"}
    data_blocks = draw(st.integers(40, 200))
    sc = agent_scenario(num_blocks=data_blocks, kv=kv, **agent)
    return dataclasses.replace(
        sc,
        scheduler=dataclasses.replace(sc.scheduler, **scheduler),
        cluster=dataclasses.replace(
            sc.cluster,
            gpus_per_node=cluster["gpus_per_node"],
            router=type(sc.cluster.router)(cluster["router"]),
        ),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=agent_cases())
def test_fast_forward_equals_stepping_with_agent_sessions(sc) -> None:  # type: ignore[no-untyped-def]
    runs = []
    for ff in (True, False):
        res = krun.run_scenario(dataclasses.replace(sc, sim=dataclasses.replace(sc.sim, fast_forward=ff)))
        r = res.summary["requests"]
        assert r["unfinished"] == 0
        assert r["completed"] + r["rejected"] + r["not_arrived"] == len(krun.scenario_workload(sc))
        runs.append(res)
    a, b = runs
    assert records(a) == records(b)
    assert [s.arrival_s for s in a.seqs] == [s.arrival_s for s in b.seqs]
    assert a.summary["sessions"] == b.summary["sessions"]
    assert a.summary["kv_peak_used_blocks"] == b.summary["kv_peak_used_blocks"]


def test_segments_share_defaults_follow_the_documents() -> None:
    """The defaults put system prompt and tools at 40-60% of the context by the fourth turn
    (design documents 003); a run of them reports the share it really had."""
    sc = small_scenario(workload={"synthetic": None, "agent": {"sessions": 30, "rate": 1}})
    res = krun.run_scenario(sc)
    share = res.summary["sessions"]["prompt_share_by_segment"]
    assert set(share) == set(SEGMENTS)
    assert 0.4 <= share["system"] + share["tools"] <= 0.8
    assert sum(share.values()) == pytest.approx(1.0)
    assert np.isfinite(res.summary["ttft_s"]["p99"])

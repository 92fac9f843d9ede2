"""Speculative decoding with the memory hierarchy: swap and auto preemption, write-back and
write-through offload (cold entries included) and the global prefix pool. Story tests with exact
numbers, fast-forward compared with stepping in each."""

from __future__ import annotations

import pytest

import kvsim.run as krun
from kvsim.core.request import Request
from kvsim.core.spec_decode import SpecDecoder
from kvsim.errors import KvsimError
from kvsim.sim.cluster import make_pool_and_scheduler
from tests.helpers import make_workload, records, small_scenario

BLOCK = 16 * 131072  # Llama-3.1-8B bf16, 16-token block, per GPU (tests.helpers)
ALL_REJECTED = {"k": 7, "acceptance": {"mean": 0.0}, "draft": {"kind": "mtp"}}
ALL_ACCEPTED = {"k": 7, "acceptance": {"mean": 1.0}, "draft": {"kind": "mtp"}}

# A (188 blocks: 187 full prompt entries), then B with other content, then A's prompt again as C.
A_IDS, B_IDS = list(range(188)), list(range(1000, 1188))
ABA = make_workload([0.0, 30.0, 60.0], [3000] * 3, [50] * 3, hash_ids=[A_IDS, B_IDS, A_IDS], block_tokens=16)
FULL = 187 * 16  # tokens of the 187 full prompt blocks (at least one token is computed)


def test_a_swap_copies_the_look_ahead_blocks_and_resumes_with_its_computed_tokens():
    """Six blocks, k = 7, every draft rejected: each verify step holds blocks for c + 8 slots. B
    (prompt 33) takes its fourth block for slots 41..48 at c = 41; at c = 42 A (prompt 16, c = 25)
    needs its third, none is free, and B is swapped out holding 4 blocks though its 42 computed
    tokens fill 3: the look-ahead block goes with it (as vLLM keeps it in the block table), and B
    comes back once A has finished with the same 42 computed tokens, 4 blocks and verify-step index."""
    asked: list[tuple[int, int, int]] = []

    def decide(r: Request, blocks: int) -> bool:
        asked.append((r.id, blocks, r.num_computed))
        return True

    spec = SpecDecoder(7, mean=0.0, concentration=None, seed=1)
    sched = make_pool_and_scheduler(6, 16, 4, 256, True, spec=spec, swap_decider=decide)
    a, b = Request(0, 0.0, 16, 40, [], []), Request(1, 0.0, 33, 40, [], [])
    sched.add(a)
    sched.add(b)
    swaps: list[tuple[int, int, bool]] = []
    state = None
    while sched.running or sched.loading or sched.swapped or sched.waiting:
        out = sched.schedule()
        swaps += [(r.id, n, o) for r, n, o in sched.new_swaps]
        sched.new_swaps = []
        if out.preempted:
            state = (b.num_computed, b.spec_steps)
        if out.empty:
            for r, _ in list(sched.loading):
                sched.finish_load(r)
                assert (r.num_computed, r.spec_steps, r.num_blocks) == (*state, 4)
            continue
        sched.advance(out)
    assert asked == [(1, 4, 42)]  # computed tokens' blocks: ceil(42 / 16) = 3
    assert state == (42, 9)
    assert swaps == [(1, 4, True), (1, 4, False)]
    assert a.num_generated == b.num_generated == 40
    assert sched.outstanding_tokens == 0 and sched.kv.pool.num_used == 0


@pytest.mark.parametrize("preemption", ["swap", "auto"])
def test_swap_and_auto_move_the_blocks_held_and_fast_forward_equals_stepping(preemption):
    """The story above in the engine: one swap of 4 blocks (8 MiB; `auto` finds copying them
    cheaper than recomputing 42 tokens), where recompute preempts B 7 times."""
    runs = []
    for ff in (True, False):
        sc = small_scenario(
            num_blocks=6,
            scheduler={"preemption": preemption, "spec_decode": ALL_REJECTED, "swap_space": "1GiB"},
            sim={"seed": 1, "fast_forward": ff},
        )
        runs.append(krun.run_scenario(sc, workload=make_workload([0.0, 0.0], [16, 33], [40, 40])))
    a, b = runs
    assert records(a) == records(b)
    for key in ("swap", "spec_decode", "steps", "replicas", "kv_peak_used_blocks"):
        assert a.summary[key] == b.summary[key], key
    assert a.summary["swap"]["swaps"] == 1 and a.summary["swap"]["recomputes"] == 0
    assert a.summary["swap"]["swapped_bytes"] == 4 * BLOCK
    assert [s.preemptions for s in a.seqs] == [0, 1]
    assert a.summary["steps"] == 70 and a.summary["engine_events"] == 7 < b.summary["engine_events"]
    sc = small_scenario(num_blocks=6, scheduler={"spec_decode": ALL_REJECTED}, sim={"seed": 1})
    rec = krun.run_scenario(sc, workload=make_workload([0.0, 0.0], [16, 33], [40, 40]))
    assert [s.preemptions for s in rec.seqs] == [0, 7] and rec.summary["swap"] is None


@pytest.mark.parametrize("write", ["back", "through"])
@pytest.mark.parametrize("ff", [True, False])
def test_offload_with_verify_steps_writes_and_loads_as_plain_decoding(write, ff):
    """Prompt blocks are registered as usual with speculative decoding on: B's admission evicts A's
    entries (write-back copies them then; write-through copied them at registration) and C loads
    A's 178 full blocks that left HBM from DRAM. Every draft accepted: each answer takes one prefill,
    six verify steps of 8 tokens and a plain decode of its last: 24 steps where decoding takes 150."""
    runs = []
    for spec in (ALL_ACCEPTED, None):
        sc = small_scenario(
            num_blocks=200,
            kv={"offload": {"enabled": True, "write": write, "host_bytes": "4GiB"}},
            scheduler={"spec_decode": spec} if spec else {},
            sim={"seed": 1, "fast_forward": ff},
        )
        runs.append(krun.run_scenario(sc, workload=ABA))
    on, off = runs
    o = on.summary["offload"]
    asked = [
        r.summary["offload"]["written_bytes"] + r.summary["offload"]["write_backlog_bytes"] for r in runs
    ]
    assert asked[0] == asked[1] == (362 if write == "back" else 383) * BLOCK
    # (write-through: the last step's registrations are still in flight when the run ends)
    assert o["written_bytes"] == off.summary["offload"]["written_bytes"] <= asked[0]
    assert o["loads"] == 1 and o["loaded_tokens"] == FULL - 9 * 16  # 9 of its blocks still in HBM
    assert [s.num_cached_tokens for s in on.seqs] == [0, 0, FULL]
    assert on.summary["steps"] == 24 and off.summary["steps"] == 150
    assert on.summary["spec_decode"]["verify_rows"] == 18


@pytest.mark.parametrize("ff", [True, False])
def test_the_global_pool_serves_a_prompt_published_by_a_speculating_replica(ff):
    """A, on replica 0, publishes its prompt's 187 full entries (and its 6 answer blocks at release)
    to the pool; C, A's prompt on replica 1, fetches all of it."""
    sc = small_scenario(
        num_blocks=200,
        kv={"prefix_cache": {"scope": "global"}},
        scheduler={"spec_decode": ALL_ACCEPTED},
        cluster={"gpus_per_node": 2, "router": "round_robin"},
        sim={"seed": 1, "fast_forward": ff},
    )
    wl = make_workload([0.0, 30.0], [3000] * 2, [50] * 2, hash_ids=[A_IDS, A_IDS], block_tokens=16)
    res = krun.run_scenario(sc, workload=wl)
    g = res.summary["global_pool"]
    assert g["published_bytes"] == 193 * BLOCK
    assert g["fetched_tokens"] == FULL
    assert [s.num_cached_tokens for s in res.seqs] == [0, FULL]
    assert [s.replica for s in res.seqs] == [0, 1]
    assert res.summary["steps"] == 16


def _cold_case(ff: bool):  # type: ignore[no-untyped-def]
    """A (3000-token prompt) and B (400-token answer) at 0, then A's prompt again as C at 0.5 s,
    while B verifies in windows; A's entries go cold 30 steps after it finished."""
    wl = make_workload(
        [0.0, 0.0, 0.5],
        [3000, 100, 3000],
        [50, 400, 20],
        hash_ids=[A_IDS, list(range(2000, 2007)), A_IDS],
        block_tokens=16,
    )
    sc = small_scenario(
        num_blocks=400,
        kv={"offload": {"enabled": True, "write": "through", "host_bytes": "4GiB", "cold_after_steps": 30}},
        scheduler={"spec_decode": {"k": 4, "acceptance": {"mean": 0.6}, "draft": {"kind": "mtp"}}},
        sim={"seed": 1, "fast_forward": ff},
    )
    return krun.run_scenario(sc, workload=wl)


def test_a_verify_window_ends_where_a_cached_entry_goes_cold():
    """A's entries go cold at a step inside B's verify steps, before C arrives: stepping moves them
    to DRAM there and C loads them. A verify window must end at that schedule too (else C would
    arrive to find them still in HBM and load nothing)."""
    a, b = _cold_case(True), _cold_case(False)
    assert records(a) == records(b)
    assert a.summary["offload"] == b.summary["offload"]
    assert a.summary["offload"]["loaded_tokens"] == FULL
    assert a.summary["offload"]["cold_demoted_bytes"] == 378 * BLOCK
    assert a.summary["engine_events"] < b.summary["engine_events"]


def test_spec_decoding_is_still_refused_with_token_eviction():
    sc = small_scenario(
        kv={"eviction": {"policy": "h2o"}, "offload": {"enabled": True}},
        scheduler={"spec_decode": ALL_ACCEPTED},
    )
    with pytest.raises(KvsimError, match="not simulated together with kv.eviction yet"):
        krun.run_scenario(sc, workload=make_workload([0.0], [10], [5]))


def _swapped_b(extra: int):  # type: ignore[no-untyped-def]
    """A (prompt 16) and B (prompt 40) prefilled and verified once (k = 7, drafts rejected): B at 41
    computed holding 3 blocks (slots to 48), then swapped out; A takes `extra` more blocks of the 10."""
    spec = SpecDecoder(7, mean=0.0, concentration=None, seed=1)
    sched = make_pool_and_scheduler(10, 16, 4, 256, True, spec=spec, swap_decider=lambda r, n: True)
    a, b = Request(0, 0.0, 16, 100, [], []), Request(1, 0.0, 40, 40, [], [])
    sched.add(a)
    sched.add(b)
    sched.advance(sched.schedule())
    sched.advance(sched.schedule())
    assert (b.num_computed, b.num_blocks) == (41, 3)
    sched.running.remove(b)
    sched._preempt(b)
    assert sched.new_swaps == [(b, 3, True)]
    sched.new_swaps.clear()
    assert sched.kv.allocate_slots(a, extra)
    return sched, b


@pytest.mark.parametrize(("extra", "swapped_in"), [(4, False), (3, True)])
def test_a_swap_in_keeps_room_for_its_next_verify_steps_slots(extra, swapped_in):
    """B's next verify step writes slots 41..49: a fourth block. Its swap-in waits for its 3 blocks,
    the 1% watermark (one block) and that fourth block to be free: 5 of them, not the 4 a plain
    decode of one token would ask (else it comes back to be that step's victim)."""
    sched, b = _swapped_b(extra)
    assert sched.kv.num_free_blocks == 8 - extra
    sched.schedule()
    assert (sched.new_swaps == [(b, 3, False)]) is swapped_in
    assert (b in sched.swapped) is not swapped_in

"""Token eviction with the memory hierarchy: write-back and write-through offload, the global prefix
pool and swap preemption. Story tests with exact numbers (direction and size)."""

from __future__ import annotations

import numpy as np
import pytest

import kvsim.run as krun
from kvsim.core.block_pool import BlockPool, BlockRemoved, BlockRewritten, BlockStored
from kvsim.core.eviction import blocks_for, eviction_from_config
from kvsim.costs.base import ForwardBatch, transfer_time
from tests.helpers import assert_auto_swapped_its_held_blocks, make_workload, small_scenario, spy_preemptions

BLOCK = 16 * 131072  # Llama-3.1-8B bf16, 16-token block, per GPU (tests.helpers)
H2O = {"policy": "h2o", "heavy_ratio": 0.2, "recent_tokens": 64, "pages": "physical"}

# A (188 blocks: 187 full prompt entries), then B with other content, then A's prompt again as C.
A_IDS, B_IDS = list(range(188)), list(range(1000, 1188))
ABA = make_workload([0.0, 30.0, 60.0], [3000] * 3, [50] * 3, hash_ids=[A_IDS, B_IDS, A_IDS], block_tokens=16)
FULL = 187 * 16  # tokens of the 187 full prompt blocks (at least one token is computed)


def test_a_trimmed_entry_leaves_the_index_as_rewritten_not_removed():
    pool = BlockPool(4, events=True)
    pool.allocate(2)
    pool.register([7, 8])
    pool.uncache(8)
    assert pool.take_events() == [BlockStored((7, 8), (1, 1)), BlockRewritten((8,))]
    assert 8 not in pool.refs and pool.private == 1
    pool.check()
    assert not isinstance(BlockRewritten((8,)), BlockRemoved)  # a write-back does not see it


def _offload(write: str, ev: dict | None, ff: bool = True):  # type: ignore[no-untyped-def]
    kv: dict = {"offload": {"enabled": True, "write": write, "host_bytes": "4GiB"}}
    if ev:
        kv["eviction"] = ev
    sc = small_scenario(num_blocks=200, kv=kv, sim={"seed": 1, "fast_forward": ff})
    return krun.run_scenario(sc, workload=ABA)


@pytest.mark.parametrize("ff", [True, False])
def test_write_back_never_copies_an_entry_its_holder_trimmed(ff):
    """Without eviction, B's admission evicts A's cached entries, which are written back to DRAM and
    C loads A's 187 full blocks from there. With H2O every request rewrites its prompt's 187 entries
    at its first trim: they leave HBM's index as rewritten, not evicted, so nothing is written back
    (their content is no longer the prefix's) and C finds A's prompt nowhere."""
    plain, h2o = _offload("back", None, ff), _offload("back", H2O, ff)
    assert plain.summary["offload"]["written_bytes"] == 362 * BLOCK
    assert [s.num_cached_tokens for s in plain.seqs] == [0, 0, FULL]
    assert h2o.summary["eviction"]["cache_entries_invalidated"] == 3 * 187
    assert h2o.summary["offload"]["written_bytes"] == 0
    assert h2o.summary["offload"]["loads"] == 0
    assert [s.num_cached_tokens for s in h2o.seqs] == [0, 0, 0]


@pytest.mark.parametrize("ff", [True, False])
def test_write_through_copies_made_before_the_trim_stay_valid(ff):
    """Write-through copies A's and B's 187 prompt entries to DRAM when they are registered, before
    the trims rewrite them in HBM: they hold the full content, so C loads all of A's from DRAM.
    (Without eviction their generated blocks, cached at release, are written through too.)"""
    plain, h2o = _offload("through", None, ff), _offload("through", H2O, ff)
    assert h2o.summary["offload"]["written_bytes"] == 2 * 187 * BLOCK
    assert plain.summary["offload"]["written_bytes"] > 2 * 187 * BLOCK
    assert [s.num_cached_tokens for s in h2o.seqs] == [0, 0, FULL]
    assert h2o.summary["offload"]["loaded_tokens"] == FULL  # none left in HBM: all from DRAM
    assert plain.summary["offload"]["loaded_tokens"] < FULL  # its HBM kept some of A's


@pytest.mark.parametrize("ff", [True, False])
def test_the_global_pool_keeps_what_was_published_before_a_trim(ff):
    """A's prompt entries are published to the pool when registered; its trim does not take them
    back, so C (A's prompt, HBM holding none of it) fetches all 187 blocks from the pool."""
    sc = small_scenario(
        num_blocks=200,
        kv={"prefix_cache": {"scope": "global"}, "eviction": H2O},
        sim={"seed": 1, "fast_forward": ff},
    )
    res = krun.run_scenario(sc, workload=ABA)
    g = res.summary["global_pool"]
    assert g["published_bytes"] == 2 * 187 * BLOCK  # A's and B's prompts (C's were there already)
    assert g["fetched_tokens"] == FULL and g["fetched_bytes"] == 187 * BLOCK
    assert [s.num_cached_tokens for s in res.seqs] == [0, 0, FULL]


@pytest.mark.parametrize("ff", [True, False])
def test_cold_offload_still_moves_unreferenced_entries_down_with_eviction_on(ff):
    """A (20 entries, one output token: it never decodes, so never evicts) is released at step 1;
    D decodes 200 steps and evicts past 80 tokens (H2O keeps 64 + 20%), rewriting its one prompt
    entry. At the schedule of step 52 A's entries have gone 50 steps untouched and move to DRAM;
    D's rewritten entry never does. C, A's prompt again, loads 19 of A's entries from DRAM."""
    ids_a = list(range(20))
    wl = make_workload(
        [0.0, 0.5, 10.0], [320, 16, 320], [1, 200, 1], hash_ids=[ids_a, [500], ids_a], block_tokens=16
    )
    sc = small_scenario(
        num_blocks=400,
        kv={"offload": {"enabled": True, "cold_after_steps": 50}, "eviction": H2O},
        sim={"seed": 1, "fast_forward": ff},
    )
    res = krun.run_scenario(sc, workload=wl)
    off = res.summary["offload"]
    assert off["cold_demoted_bytes"] == off["written_bytes"] == 20 * BLOCK  # A's, not D's
    assert res.summary["eviction"]["cache_entries_invalidated"] == 1  # D's prompt entry
    c = res.seqs[2]
    load = transfer_time(19 * BLOCK, sc.cluster.topology.host_h2d)
    prefill = krun.make_cost_model(sc).price(ForwardBatch.prefill(16, 304)).seconds
    assert c.num_cached_tokens == 304
    assert c.first_token_s == pytest.approx(10.0 + load + prefill, rel=1e-12)


# ---- swap -----------------------------------------------------------------------------------------
# Two decoders that evict (H2O at 50%): each keeps 16 + c/2 of c tokens, so together they outgrow
# 96 blocks near their ends; B (the newest) is swapped out with its evicted tokens.
SWAP_H2O = {"policy": "h2o", "heavy_ratio": 0.5, "recent_tokens": 16, "pages": "physical"}
SWAP_WL = make_workload([0.0, 0.05], [320, 320], [1200, 1200])


@pytest.mark.parametrize("ff", [True, False])
def test_a_swapped_request_that_evicted_copies_its_resident_blocks_and_resumes_with_them(ff, monkeypatch):
    """B is swapped out holding blocks for its kept tokens only (physical release): the copy is those
    blocks, not its computed tokens' (about twice as many); it comes back with the same evicted
    count and blocks, and decodes on at its budget: its finish is the swap-in plus decode steps
    attending kept(c) tokens."""
    preempted, resumed = spy_preemptions(monkeypatch)
    sc = small_scenario(
        num_blocks=96,
        scheduler={"preemption": "swap"},
        kv={"eviction": SWAP_H2O},
        sim={"seed": 1, "fast_forward": ff},
    )
    res = krun.run_scenario(sc, workload=SWAP_WL)
    a, b = res.seqs
    ((vid, c, g, e, held),) = preempted
    ev = eviction_from_config(sc.kv.eviction)
    assert ev is not None
    assert vid == 1 and (c, g) == (1496, 1177)
    assert e == c - ev.kept(c) == 732 and held == blocks_for(c - e, 16) == 48
    assert held < -(-c // 16) == 94
    sw = res.summary["swap"]
    assert (sw["swaps"], sw["recomputes"], sw["swapped_bytes"]) == (1, 0, held * BLOCK)
    assert resumed == [(c, e, held)]  # the same kept tokens, in the same blocks
    load_end = a.finish_s + transfer_time(held * BLOCK, sc.cluster.topology.host_h2d)
    cm = krun.make_cost_model(sc)
    steps = cm.decode_step_times(1, ev.kept_array(np.arange(c, c + 1200 - g, dtype=np.int64)))
    assert b.finish_s == pytest.approx(load_end + float(steps.sum()), rel=1e-12)
    assert res.summary["requests"]["completed"] == 2


def test_auto_weighs_the_resident_blocks_of_a_victim_that_evicted(monkeypatch):
    """At 8 GB/s, copying B's 48 held blocks out and back beats recomputing its 1,496 tokens, while
    copying blocks for all its computed tokens would not: auto swaps it."""
    preempted, _ = spy_preemptions(monkeypatch)
    sc = small_scenario(
        num_blocks=96,
        scheduler={"preemption": "auto"},
        kv={"eviction": SWAP_H2O},
        cluster={"topology": {"pcie": {"bw": "8GB/s"}}},
    )
    res = krun.run_scenario(sc, workload=SWAP_WL)
    ((_, c, _, _, held),) = preempted
    assert_auto_swapped_its_held_blocks(sc, res, c, held, BLOCK)


def test_recompute_of_a_request_that_evicted_recomputes_its_whole_context_and_evicts_again():
    """With recompute preemption B restarts from nothing: its prompt and generated tokens are
    prefilled again (outstanding tokens rise by all it computed) and it trims once more."""
    sc = small_scenario(num_blocks=96, kv={"eviction": SWAP_H2O})
    res = krun.run_scenario(sc, workload=SWAP_WL)
    b = res.seqs[1]
    assert b.preemptions == 1 and res.summary["requests"]["completed"] == 2
    assert res.summary["eviction"]["trims"] == 3  # A's, B's, B's again after its recompute


# ---- statistics that must not depend on fast-forward ------------------------------------------------
@pytest.mark.parametrize("evict", [True, False])
def test_declined_pool_lookups_count_requests_not_schedules(evict):
    """Found by the property test: request 13, blocked at the head of node 1's queue, looks up a
    prefix homed on node 0 that the slow network makes cheaper to recompute. Stepping looked it up
    at every step (114 declines without eviction), fast-forward once per window (22): a decline
    now counts once per request, the same in both modes."""
    one = [1000000]
    long = [1000001 + j for j in range(5)]
    wl = make_workload(
        [0.0] * 14,
        [1] * 6 + [289] + [1] * 6 + [289],
        [1, 1, 192] + [1] * 11,
        hash_ids=[one] * 6 + [long] + [one] * 6 + [long],
        block_tokens=64,
    )
    kv: dict = {
        "prefix_cache": {"scope": "global", "fetch": "auto", "pool_bytes": 8 * BLOCK},
        "offload": {"enabled": True, "host_bytes": 2 * BLOCK},
    }
    if evict:
        kv["eviction"] = {"policy": "h2o", "heavy_ratio": 0.5, "recent_tokens": 1, "pages": "soft_mark"}
    got = []
    for ff in (True, False):
        sc = small_scenario(
            num_blocks=19,
            scheduler={"max_num_seqs": 4, "max_batched_tokens": 16},
            cluster={
                "nodes": 2,
                "router": "round_robin",
                "topology": {"pcie": {"bw": "1GB/s"}, "network": {"bw": "1GB/s"}},
            },
            kv=kv,
            sim={"seed": 1, "fast_forward": ff},
        )
        got.append(krun.run_scenario(sc, workload=wl).summary["global_pool"])
    assert got[0] == got[1]
    assert got[0]["declined_lookups"] == 1

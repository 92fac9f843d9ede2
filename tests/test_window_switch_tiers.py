"""Sliding-window layers and a format switch with the memory hierarchy: write-back and write-through
offload, the global prefix pool and swap preemption. Both trim through token eviction's path
(`kvsim.core.eviction`), so a trimmed entry leaves HBM as `BlockRewritten`. Exact numbers."""

from __future__ import annotations

import pytest

import kvsim.run as krun
from kvsim.core.eviction import blocks_for, switch_eviction, window_eviction
from kvsim.costs.base import ForwardBatch, transfer_time
from tests.helpers import assert_auto_swapped_its_held_blocks, make_workload, small_scenario, spy_preemptions

BLOCK = 16 * 131072  # Llama-3.1-8B bf16, 16-token block, per GPU (tests.helpers)
WIN = {"name": "llama-3.1-8b", "sliding_window": 1024}  # every layer windowed
HYBRID = {"name": "llama-3.1-8b", "sliding_window": 256, "sliding_window_layers": 16}  # half
SWITCH = {"format": "bf16", "format_switch": {"after_tokens": 256, "format": "fp8"}}  # half the bytes

# A (188 blocks: 187 full prompt entries), then B with other content, then A's prompt again as C.
A_IDS, B_IDS = list(range(188)), list(range(1000, 1188))
ABA = make_workload([0.0, 30.0, 60.0], [3000] * 3, [50] * 3, hash_ids=[A_IDS, B_IDS, A_IDS], block_tokens=16)
FULL = 187 * 16  # tokens of the 187 full prompt blocks (at least one token is computed)


def _run(ff: bool, model: dict | None = None, **kv: object):  # type: ignore[no-untyped-def]
    extra = {} if model is None else {"model": model}
    sc = small_scenario(num_blocks=200, kv=kv, sim={"seed": 1, "fast_forward": ff}, **extra)
    return sc, krun.run_scenario(sc, workload=ABA)


def _offload(write: str) -> dict:
    return {"enabled": True, "write": write, "host_bytes": "4GiB"}


# ---- sliding windows ----------------------------------------------------------------------------
@pytest.mark.parametrize("ff", [True, False])
def test_a_window_rewrites_its_prompt_entries_so_write_back_copies_none(ff):
    """Each 3,000-token prompt registers its 187 full entries, then frees the blocks out of its
    1,024-token window after the prompt (188 -> 65 blocks, 123 freed): the trim rewrites the 187
    entries in place, they leave HBM as rewritten, and write-back copies none of them down."""
    _, res = _run(ff, WIN, offload=_offload("back"))
    s = res.summary
    assert s["sliding_window"]["cache_entries_invalidated"] == 3 * 187
    assert s["sliding_window"]["blocks_freed"] == 3 * (188 - blocks_for(1024, 16)) == 3 * 123
    assert s["offload"]["written_bytes"] == 0 and s["offload"]["loads"] == 0
    assert [q.num_cached_tokens for q in res.seqs] == [0, 0, 0]


@pytest.mark.parametrize("ff", [True, False])
def test_write_through_copies_a_windowed_prompt_whole_and_a_repeat_loads_what_it_keeps(ff):
    """Write-through copies A's and B's 187 entries at registration, before the trims: full content,
    valid hits. C (A's prompt) keeps kept(3,049) = 1,024 tokens, so it takes the first 64 entries
    from DRAM (a hit taken whole must not outgrow what a request keeps: `window_hit_blocks`) and
    recomputes the rest; its registrations of entries DRAM holds already write nothing more."""
    sc, res = _run(ff, WIN, offload=_offload("through"))
    w = window_eviction(sc.model)
    assert w is not None and w.kept(3000 + 50 - 1) == 1024
    off = res.summary["offload"]
    assert off["written_bytes"] == 2 * 187 * BLOCK
    assert (off["loads"], off["loaded_tokens"]) == (1, 1024)
    assert [q.num_cached_tokens for q in res.seqs] == [0, 0, 1024]
    c = res.seqs[2]
    load = transfer_time(64 * BLOCK, sc.cluster.topology.host_h2d)
    prefill = krun.make_cost_model(sc).price(ForwardBatch.prefill(3000 - 1024, 1024)).seconds
    assert c.first_token_s == pytest.approx(60.0 + load + prefill, rel=1e-12)


@pytest.mark.parametrize("ff", [True, False])
def test_the_global_pool_keeps_a_windowed_prompt_published_before_its_trim(ff):
    _, res = _run(ff, WIN, prefix_cache={"scope": "global"})
    g = res.summary["global_pool"]
    assert g["published_bytes"] == 2 * 187 * BLOCK
    assert g["fetched_tokens"] == 1024  # C's kept tokens' entries, as from DRAM above
    assert [q.num_cached_tokens for q in res.seqs] == [0, 0, 1024]


def test_a_repeated_prompt_longer_than_hbm_runs_with_a_window():
    """Found while removing the refusal: a 30,000-token prompt on 1,000 blocks runs windowed (at
    most 4,096 kept + 8,192 new tokens at once), and write-through leaves its first chunk's 512
    entries in DRAM. Its repeat used to load all 512 and then need 1,024 blocks for its first chunk,
    preempting itself forever; it now takes only the 256 entries of its kept 4,096 tokens."""
    ids = list(range(30_000 // 16 + 1))
    wl = make_workload([0.0, 30.0], [30_000] * 2, [10] * 2, hash_ids=[ids, ids], block_tokens=16)
    model = {"name": "llama-3.1-8b", "sliding_window": 4096}
    for ff in (True, False):
        sc = small_scenario(
            num_blocks=1000,
            model=model,
            kv={"offload": {"enabled": True, "write": "through", "host_bytes": "8GiB"}},
            scheduler={"max_batched_tokens": 8192},
            sim={"seed": 1, "fast_forward": ff},
        )
        res = krun.run_scenario(sc, workload=wl)
        assert res.summary["requests"]["completed"] == 2
        assert [q.num_cached_tokens for q in res.seqs] == [0, 4096]
        # A's first chunk (entries 0-511), then the repeat's first chunk from its 256 loaded
        # entries: 256-767, of which DRAM lacks 512-767
        assert res.summary["offload"]["written_bytes"] == (512 + 256) * BLOCK


# ---- swap ----------------------------------------------------------------------------------------
TWO = make_workload([0.0, 0.05], [320, 320], [1200, 1200])


@pytest.mark.parametrize("ff", [True, False])
def test_a_swapped_windowed_request_copies_its_held_blocks_and_resumes_with_them(ff, monkeypatch):
    """Half the layers windowed at 256 tokens: a sequence keeps ceil((c + 256) / 2) of c tokens, so
    two decoders outgrow 96 blocks; B is swapped out at 1,272 tokens holding 48 blocks (its 764 kept
    tokens' and the next token's slot), not the 80 of its computed tokens, and comes back with them."""
    preempted, resumed = spy_preemptions(monkeypatch)
    sc = small_scenario(
        num_blocks=96, model=HYBRID, scheduler={"preemption": "swap"}, sim={"seed": 1, "fast_forward": ff}
    )
    res = krun.run_scenario(sc, workload=TWO)
    w = window_eviction(sc.model)
    assert w is not None
    ((vid, c, g, e, held),) = preempted
    assert (vid, c, g) == (1, 1272, 953)
    assert e == c - w.kept(c) == 508 and held == blocks_for(w.kept(c), 16) == 48 < -(-c // 16) == 80
    sw = res.summary["swap"]
    assert (sw["swaps"], sw["recomputes"], sw["swapped_bytes"]) == (1, 0, held * BLOCK)
    assert resumed == [(c, e, held)]
    assert res.summary["requests"]["completed"] == 2


def test_auto_weighs_the_held_blocks_of_a_windowed_victim(monkeypatch):
    preempted, _ = spy_preemptions(monkeypatch)
    sc = small_scenario(
        num_blocks=96,
        model=HYBRID,
        scheduler={"preemption": "auto"},
        cluster={"topology": {"pcie": {"bw": "8GB/s"}}},
    )
    res = krun.run_scenario(sc, workload=TWO)
    ((_, c, _, _, held),) = preempted
    assert_auto_swapped_its_held_blocks(sc, res, c, held, BLOCK)


# ---- format switch -------------------------------------------------------------------------------
@pytest.mark.parametrize("ff", [True, False])
def test_a_switch_rewrites_its_entries_so_write_back_copies_none(ff):
    """Past 256 tokens a sequence is re-quantized bf16 -> fp8: each prompt's 187 entries are
    rewritten at its crossing (no first-format hit for anyone), so write-back copies nothing."""
    _, res = _run(ff, None, **SWITCH, offload=_offload("back"))
    s = res.summary
    assert s["format_switch"]["cache_entries_invalidated"] == 3 * 187
    # 188 blocks of the prompt down to blocks_for(1,500): the fp8 half
    assert s["format_switch"]["blocks_freed"] == 3 * (188 - blocks_for(1500, 16)) == 3 * 94
    assert s["offload"]["written_bytes"] == 0
    assert [q.num_cached_tokens for q in res.seqs] == [0, 0, 0]


@pytest.mark.parametrize("ff", [True, False])
def test_write_through_keeps_the_first_format_copy_before_the_crossing(ff):
    """Write-through copies the bf16 entries at registration, before the crossing: C reads its
    prompt in bf16 and loads all 187 entries (a switch caps no hit: it trims after the prompt)."""
    _, res = _run(ff, None, **SWITCH, offload=_offload("through"))
    off = res.summary["offload"]
    assert off["written_bytes"] == 2 * 187 * BLOCK
    assert off["loaded_tokens"] == FULL
    assert [q.num_cached_tokens for q in res.seqs] == [0, 0, FULL]
    assert res.summary["format_switch"]["switches"] == 3


@pytest.mark.parametrize("ff", [True, False])
def test_a_swapped_switched_request_copies_its_second_format_blocks(ff, monkeypatch):
    """Three decoders re-quantized to fp8 past 256 tokens outgrow 96 blocks; the newest is swapped
    at 1,009 tokens holding 32 blocks (its 505 first-format token slots), not 64, and resumes
    switched with them."""
    preempted, resumed = spy_preemptions(monkeypatch)
    sc = small_scenario(
        num_blocks=96, kv=SWITCH, scheduler={"preemption": "swap"}, sim={"seed": 1, "fast_forward": ff}
    )
    wl = make_workload([0.0, 0.05, 0.1], [320] * 3, [1200] * 3)
    res = krun.run_scenario(sc, workload=wl)
    sw_ev = switch_eviction(sc.model, sc.kv.format, sc.kv.format_switch)
    assert sw_ev is not None
    ((vid, c, _, e, held),) = preempted
    assert (vid, c) == (2, 1009)
    assert e == c - sw_ev.kept(c) == 504 and held == blocks_for(505, 16) == 32 < -(-c // 16) == 64
    sw = res.summary["swap"]
    assert (sw["swaps"], sw["swapped_bytes"]) == (1, 32 * BLOCK)
    assert resumed == [(c, e, held)]
    s = res.summary
    assert s["requests"]["completed"] == 3 and s["format_switch"]["switches"] == 3  # not re-crossed

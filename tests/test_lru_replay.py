"""The timing-free replay of `bench/lru_replay.py` (the independent check of the global pool, its
LFU and LMCache's chunks): exact numbers on tiny traces."""

from __future__ import annotations

import importlib.util
import sys

from tests.helpers import ROOT

_spec = importlib.util.spec_from_file_location("lru_replay", ROOT / "bench/lru_replay.py")
assert _spec is not None and _spec.loader is not None
replay_mod = importlib.util.module_from_spec(_spec)
sys.modules["lru_replay"] = replay_mod
_spec.loader.exec_module(replay_mod)


def test_entries_keep_whole_chunks_only_and_stop_after_a_cut_one():
    # 1,100 tokens: 68 full 16-token blocks, entries of 32, 32 and 4 blocks.
    assert replay_mod.entries(1100, [7, 8, 9]) == [(7, 32), (8, 32), (9, 4)]
    # 256-token chunks (16 blocks): the 4-block tail is a partial chunk, not stored.
    assert replay_mod.entries(1100, [7, 8, 9], chunk_blocks=16) == [(7, 32), (8, 32)]
    # 800 tokens: 50 blocks, entries 32 and 18; chunked, the second keeps one chunk and ends there.
    assert replay_mod.entries(800, [7, 8, 9], chunk_blocks=16) == [(7, 32), (8, 16)]


def test_a_partial_chunk_is_neither_stored_nor_hit():
    reqs = [(800, [1, 2]), (800, [1, 2])]  # the same 800-token prompt twice
    # 16-token granularity: the second hits its 49 full blocks before the last token (784 tokens).
    assert replay_mod.replay(reqs, float("inf"))["hit_ratio"] == 784 / 1600
    # 256-token chunks: 48 blocks (3 chunks), the last two full blocks recomputed.
    assert replay_mod.replay(reqs, float("inf"), chunk_blocks=16)["hit_ratio"] == 768 / 1600


def test_lfu_replay_keeps_the_reused_entry_that_lru_drops():
    # 512-token prompts (one entry of 32 blocks), a cache of two: A, A, B, C, A.
    reqs = [(512, [1]), (512, [1]), (512, [2]), (512, [3]), (512, [1])]
    hit = 31 * 16  # a full-prompt hit computes the last block's last token: 31 blocks
    lru = replay_mod.replay(reqs, 64)["hit_ratio"]
    lfu = replay_mod.replay(reqs, 64, eviction="lfu")["hit_ratio"]
    assert lru == hit / 2560  # C drops A (least recent); A's third turn misses
    assert lfu == 2 * hit / 2560  # C drops B (one use); A's third turn hits

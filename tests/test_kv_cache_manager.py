"""Stories for the KV cache manager and the fast-forward horizon (pure core, no clock)."""

from __future__ import annotations

from kvsim.core.horizon import decode_window, steps_before
from kvsim.core.kv_cache_manager import BlockRun, KVCacheManager, Tier
from kvsim.core.request import Request
from kvsim.core.sched.output import SchedulerOutput


def _req(i: int, prompt: int, output: int, keys: list[int] | None = None) -> Request:
    keys = keys or []
    return Request(i, 0.0, prompt, output, keys, [1] * len(keys))


def test_a_fully_cached_prompt_still_computes_its_last_block():
    kv = KVCacheManager(10, 16)
    a = _req(0, 32, 4, [1, 2])  # two full blocks, both keyed
    assert kv.admit(a, 0, 32)
    kv.cache_blocks(a, 32)
    assert a.held_keys == [1, 2] and a.num_private == 0
    b = _req(1, 32, 4, [1, 2])
    hits, computed = kv.get_computed_blocks(b)
    assert hits == 2 and computed == 16  # the last block's 16 tokens are recomputed
    assert kv.admit(b, hits, 32 - computed)
    assert b.num_blocks == 2 and b.num_private == 0  # into the block it already holds
    assert kv.block_table(b) == [BlockRun(1, 1, Tier.HBM), BlockRun(2, 1, Tier.HBM)]


def test_allocate_slots_changes_nothing_when_blocks_do_not_fit():
    kv = KVCacheManager(3, 16)
    a = _req(0, 40, 8)
    assert kv.admit(a, 0, 40)  # 3 blocks
    before = (kv.num_free_blocks, a.num_blocks, a.num_private)
    assert not kv.allocate_slots(a, kv.blocks_needed(a, 49))
    assert (kv.num_free_blocks, a.num_blocks, a.num_private) == before
    kv.free(a)
    assert kv.num_free_blocks == 3 and a.num_blocks == 0


def test_equal_content_computed_twice_is_shared_and_the_copy_freed():
    kv = KVCacheManager(10, 16)
    a, b = _req(0, 33, 4, [7, 8]), _req(1, 33, 4, [7, 8])
    assert kv.admit(a, 0, 33) and kv.admit(b, 0, 33)  # both compute it: 3 blocks each
    assert kv.num_free_blocks == 4
    kv.cache_blocks(a, 33)
    kv.cache_blocks(b, 33)  # b's two full blocks are a's: b's copies return to the pool
    assert kv.num_free_blocks == 6 and kv.pool.refs == {7: 2, 8: 2}
    assert b.num_blocks == 3 and b.num_private == 1


def _decoding(kv: KVCacheManager, reqs: list[Request]) -> SchedulerOutput:
    out = SchedulerOutput()
    for r in reqs:
        assert kv.admit(r, 0, r.prompt_len)
        r.num_computed = r.prompt_len
        r.num_generated = 1
        r.num_tokens = r.prompt_len + 1
        assert kv.allocate_slots(r, kv.blocks_needed(r, r.num_tokens))
        out.decode_reqs.append(r)
        out.decode_ctx.append(r.num_computed)
    return out


def test_window_ends_at_the_first_finish():
    kv = KVCacheManager(100, 16)
    out = _decoding(kv, [_req(0, 10, 50), _req(1, 20, 7)])
    w = decode_window(out, kv, 2048)
    assert (w.num_steps, w.bound) == (6, "outputs")  # request 1 has 6 tokens left to sample
    assert w.sum_ctx.tolist() == [30, 32, 34, 36, 38, 40]
    assert w.tokens_attended.tolist() == [32, 34, 36, 38, 40, 42]
    assert decode_window(out, kv, 4).bound == "max_steps"


def test_window_takes_only_empty_blocks():
    kv = KVCacheManager(3, 16)
    (r,) = reqs = [_req(0, 16, 100)]
    out = _decoding(kv, reqs)  # holds 2 blocks (16 prompt tokens + 1): token 17..32 fit in block 2
    assert r.num_blocks == 2 and kv.num_empty_blocks == 1
    w = decode_window(out, kv, 2048)
    # Steps 0..31 write tokens 17..48: blocks 2 and 3; the 33rd step would need a fourth block.
    assert (w.num_steps, w.bound) == (32, "empty_blocks")


def test_steps_before_counts_strictly_earlier_ends():
    ends = [1.0, 2.0, 3.0]
    assert [steps_before(ends, t) for t in (0.5, 1.0, 1.5, 3.0, 9.0)] == [0, 0, 1, 2, 3]
    assert steps_before(ends, 9.0, k=2) == 2


def test_mixed_window_runs_the_full_chunks_of_one_prefill_beside_decodes():
    from kvsim.core.horizon import mixed_window

    kv = KVCacheManager(1000, 16)
    out = _decoding(kv, [_req(0, 10, 50), _req(1, 20, 50)])
    p = _req(2, 1000, 5)
    assert kv.admit(p, 0, 300)
    p.num_computed = 300  # its first chunk ran; the next ones take the rest of a 302-token budget
    assert kv.allocate_slots(p, kv.blocks_needed(p, 600))
    out.prefill_reqs.append(p)
    out.prefill_new.append(300)
    out.prefill_ctx.append(300)
    out.prefill_sampling.append(False)
    out.last_is_prefill = True
    w = mixed_window(out, kv, 2048)
    assert w is not None
    # 700 tokens left: two full chunks of 300 (this one included); the 100-token rest is a real step.
    assert (w.num_steps, w.bound, w.chunk, w.num_decode) == (2, "prefill", 300, 2)
    assert w.prefill_ctx.tolist() == [300, 600] and w.dec_sum_ctx.tolist() == [30, 32]
    assert w.num_sampling.tolist() == [2, 2]  # the prefill samples only at its last chunk
    out.last_is_prefill = False  # a decode after it in running order: not this shape
    assert mixed_window(out, kv, 2048) is None

"""H2O score accumulation, selection and in-place compaction; StreamingLLM keep lists."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kernels import h2o  # noqa: E402
from kernels.kv_cache import PagedKVCache, dequantize_slots_ref, sequence_slots  # noqa: E402
from kernels.paged_decode import paged_decode, paged_decode_ref  # noqa: E402
from kernels.testing import rel_rms  # noqa: E402

# (format, q dtype, context_lens, num_kv_heads, gqa ratio, head_dim, block_size)
CASES = [
    ("fp16", torch.float16, [37, 20], 2, 4, 40, 8),
    ("bf16", torch.bfloat16, [25], 1, 8, 32, 16),
    ("kvquant4/5.0%", torch.float16, [30, 9], 1, 1, 40, 8),
]


def _inputs(case, device):
    fmt, dtype, lens, kv_heads, ratio, head_dim, bs = case
    inputs = h2o.make_inputs(
        fmt, len(lens), max(lens), kv_heads, head_dim, num_q_heads=kv_heads * ratio,
        block_size=bs, dtype=dtype, device=device,
    )  # fmt: skip
    inputs["context_lens"] = torch.tensor(lens, dtype=torch.int32, device=device)
    return inputs


def _twin(cache: PagedKVCache) -> PagedKVCache:
    s = cache.spec
    return PagedKVCache.allocate(
        s.fmt, s.num_blocks, s.block_size, s.num_kv_heads, s.head_dim, pool=cache.pool.clone(),
        k_fp8_scale=cache.k.fp8_scale, v_fp8_scale=cache.v.fp8_scale,
        k_codebook=cache.k.codebook, v_codebook=cache.v.codebook,
    )  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_accumulate_matches_reference_over_two_steps(case, device):
    inputs = _inputs(case, device)
    ref = inputs["scores"].clone()
    for step in range(2):
        if step:
            inputs["q"] = torch.randn_like(inputs["q"])
        h2o.h2o_accumulate(**inputs)
        h2o.h2o_accumulate_ref(**{**inputs, "scores": ref})
    tol = 2e-2 if inputs["q"].dtype == torch.bfloat16 else 2e-3
    assert rel_rms(inputs["scores"], ref) < tol
    ratio = inputs["q"].shape[1] // inputs["cache"].spec.num_kv_heads
    # probabilities of each query head sum to one per step; nothing lands past a context
    sums = inputs["scores"].sum(2)
    torch.testing.assert_close(sums, torch.full_like(sums, 2.0 * ratio), rtol=1e-2, atol=0)
    for b, n in enumerate(inputs["context_lens"].tolist()):
        assert not inputs["scores"][b, :, n:].any()


def test_select_matches_reference_and_keeps_sinks_and_window(device):
    gen = torch.Generator().manual_seed(3)
    scores = torch.rand(3, 2, 50, generator=gen).to(device)
    lens = torch.tensor([50, 12, 31], dtype=torch.int32, device=device)
    keep, num_kept = h2o.h2o_select(scores, lens, num_heavy=6, num_sink=2, num_recent=5)
    assert num_kept.tolist() == [13, 12, 13]
    ref = h2o.h2o_select_ref(scores.cpu(), lens.cpu(), 6, 2, 5)
    for b in range(3):
        kept = keep[b, : num_kept[b]].tolist()
        assert kept == ref[b]
        n = int(lens[b])
        assert {0, 1} | set(range(n - 5, n)) <= set(kept)
        assert (keep[b, num_kept[b] :] == -1).all()


def test_streaming_keep_lists(device):
    keep, num_kept = h2o.streaming_keep(torch.tensor([10, 4, 7], dtype=torch.int32), 2, 4)
    assert num_kept.tolist() == [6, 4, 6]
    assert keep.tolist() == [[0, 1, 6, 7, 8, 9], [0, 1, 2, 3, -1, -1], [0, 1, 3, 4, 5, 6]]


@pytest.mark.parametrize("fmt", ["fp16", "int4/g24", "kvquant4/5.0%"])
def test_compaction_matches_reference_and_decode_sees_kept_tokens(fmt, device):
    inputs = _inputs((fmt, torch.float16, [37, 20], 2, 4, 40, 8), device)
    cache, tables, lens = inputs["cache"], inputs["block_tables"], inputs["context_lens"]
    scores = torch.rand(inputs["scores"].shape, generator=torch.Generator().manual_seed(0))
    keep, num_kept = h2o.h2o_select(scores.to(device), lens, 5, 2, 4)
    ref_cache = _twin(cache)
    kept_k = [
        dequantize_slots_ref(cache, "k", sequence_slots(tables[b], int(lens[b]), 8))[
            keep[b, : num_kept[b]].long()
        ]
        for b in range(2)
    ]
    got = h2o.compact_kv(cache, tables, lens, keep, num_kept)
    want = h2o.compact_kv_ref(ref_cache, tables, lens, keep, num_kept)
    assert torch.equal(cache.pool, ref_cache.pool)
    assert torch.equal(got.block_tables, want.block_tables)
    assert got.context_lens.tolist() == [11, 11]
    assert got.freed.sum(1).tolist() == [3, 1]  # 5 -> 2 blocks and 3 -> 2 blocks
    for b in range(2):
        moved = dequantize_slots_ref(cache, "k", sequence_slots(got.block_tables[b], 11, 8))
        assert torch.equal(moved, kept_k[b])
    after = {**inputs, "block_tables": got.block_tables, "context_lens": got.context_lens}
    after.pop("scores")
    assert rel_rms(paged_decode(**after), paged_decode_ref(**after)) < 2e-3
    new_scores = h2o.compact_scores(scores, keep.cpu(), num_kept.cpu())
    assert torch.equal(new_scores[0, :, :11], scores[0][:, keep[0, :11].long().cpu()])
    assert not new_scores[:, :, 11:].any()


def test_streaming_compaction_keeps_sinks_and_window(device):
    inputs = _inputs(("fp8_e4m3/per_head", torch.bfloat16, [37, 6], 2, 4, 40, 8), device)
    cache, tables, lens = inputs["cache"], inputs["block_tables"], inputs["context_lens"]
    keep, num_kept = h2o.streaming_keep(lens, 4, 8)
    ref_cache = _twin(cache)
    got = h2o.compact_kv(cache, tables, lens, keep, num_kept)
    want = h2o.compact_kv_ref(ref_cache, tables, lens, keep, num_kept)
    assert torch.equal(cache.pool, ref_cache.pool)
    assert got.context_lens.tolist() == [12, 6] and got.freed.sum(1).tolist() == [3, 0]
    assert torch.equal(got.block_tables, want.block_tables)


def test_compaction_rejects_unsorted_keep_lists(device):
    inputs = _inputs(CASES[0], device)
    keep = torch.tensor([[0, 5, 3], [0, 1, 2]], dtype=torch.int32, device=device)
    num_kept = torch.tensor([3, 3], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="strictly increasing"):
        h2o.compact_kv(inputs["cache"], inputs["block_tables"], inputs["context_lens"], keep, num_kept)
    with pytest.raises(ValueError, match="keep_idx must be int32"):
        h2o.compact_kv(inputs["cache"], inputs["block_tables"], inputs["context_lens"], keep.long(), num_kept)
    with pytest.raises(ValueError, match=r"scores must be \[2, 2, max_tokens\]"):
        h2o.h2o_accumulate(**{**inputs, "scores": inputs["scores"][:1]})

"""chunked_prefill: cache writes equal the reference's, outputs match causal attention."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kernels.chunked_prefill import (  # noqa: E402
    chunk_slot_mapping,
    chunked_prefill,
    chunked_prefill_ref,
    make_inputs,
)
from kernels.kv_cache import PagedKVCache, sequence_slots  # noqa: E402
from kernels.kv_write import kv_write_ref  # noqa: E402
from kernels.testing import interpreter, rel_rms  # noqa: E402

INTERP = interpreter()
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.2e-2, torch.float32: 2e-3}

# (format, q dtype, batch, prefix, chunk, num_kv_heads, gqa ratio, head_dim, block_size)
CASES = [
    ("fp16", torch.float16, 2, 11, 6, 1, 4, 32, 8),
    ("bf16", torch.bfloat16, 1, 0, 9, 1, 8, 40, 4),  # no prefix: plain causal prefill
    ("fp8_e4m3/per_head", torch.float16, 1, 7, 5, 2, 1, 32, 8),
    ("int4/g24", torch.float16, 1, 9, 4, 1, 4, 40, 5),
    ("kvquant4/5.0%", torch.float16, 1, 5, 3, 1, 8, 40, 8),
]
GPU_CASES = [
    ("fp16", torch.float16, 4, 3000, 512, 8, 4, 128, 16),
    ("int4/g64", torch.float16, 2, 1000, 300, 8, 4, 128, 16),
    ("kvquant4/1.0%", torch.bfloat16, 2, 1000, 300, 8, 4, 128, 16),
]


def _twin(cache: PagedKVCache) -> PagedKVCache:
    s = cache.spec
    return PagedKVCache.allocate(
        s.fmt, s.num_blocks, s.block_size, s.num_kv_heads, s.head_dim, pool=cache.pool.clone(),
        k_fp8_scale=cache.k.fp8_scale, v_fp8_scale=cache.v.fp8_scale,
        k_codebook=cache.k.codebook, v_codebook=cache.v.codebook,
    )  # fmt: skip


def _run(case, device: str) -> None:
    fmt, dtype, batch, prefix, chunk, kv_heads, ratio, head_dim, bs = case
    inputs = make_inputs(
        fmt, batch, prefix, chunk, kv_heads, head_dim, num_q_heads=kv_heads * ratio,
        block_size=bs, dtype=dtype, device=device,
    )  # fmt: skip
    ref_cache = _twin(inputs["cache"])
    ref = chunked_prefill_ref(**{**inputs, "cache": ref_cache})
    out = chunked_prefill(**inputs, block_n=16)
    if INTERP:
        assert torch.equal(inputs["cache"].pool, ref_cache.pool)
    assert rel_rms(out, ref) < TOL[dtype]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-p{c[3]}-c{c[4]}-r{c[6]}" for c in CASES])
def test_chunked_prefill_matches_reference(case, device):
    _run(case, device)


@pytest.mark.skipif(INTERP, reason="realistic shapes: GPU only (interpreter too slow)")
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_chunked_prefill_gpu_shapes(case, device):
    _run(case, device)


def test_varlen_batch_with_empty_chunk(device):
    # three sequences with 6 cached tokens each and chunks of 4, 0 and 8 new tokens
    gen = torch.Generator().manual_seed(1)
    cache = PagedKVCache.allocate("int8/g16", 12, 4, 1, 32, device)
    block_tables = torch.tensor([[0, 1, 2, 3], [4, 5, 0, 0], [6, 7, 8, 9]], dtype=torch.int32, device=device)
    prefix = torch.cat([sequence_slots(block_tables[b], 6, 4) for b in range(3)])
    kv = torch.randn(2, 18, 1, 32, generator=gen).to(device)
    kv_write_ref(kv[0], kv[1], cache, prefix)
    n = 12
    inputs = {
        "q": torch.randn(n, 4, 32, generator=gen).to(device, torch.float16),
        "key": torch.randn(n, 1, 32, generator=gen).to(device, torch.float16),
        "value": torch.randn(n, 1, 32, generator=gen).to(device, torch.float16),
        "cache": cache,
        "block_tables": block_tables,
        "query_start_loc": torch.tensor([0, 4, 4, n], dtype=torch.int32, device=device),
        "seq_lens": torch.tensor([10, 6, 14], dtype=torch.int32, device=device),
        "sm_scale": 32**-0.5,
    }
    slots = chunk_slot_mapping(block_tables, inputs["query_start_loc"], inputs["seq_lens"], 4)
    assert slots.tolist() == [6, 7, 8, 9, *range(30, 38)]
    ref_cache = _twin(cache)
    ref = chunked_prefill_ref(**{**inputs, "cache": ref_cache})
    out = chunked_prefill(**inputs, block_n=16)
    assert rel_rms(out, ref) < TOL[torch.float16]
    if INTERP:
        assert torch.equal(cache.pool, ref_cache.pool)


def test_chunked_prefill_rejects_bad_inputs():
    inputs = make_inputs("fp16", 2, 4, 3, 1, 16, num_q_heads=2, block_size=4)
    with pytest.raises(ValueError, match=r"query_start_loc must be \[batch \+ 1\] = \[3\]"):
        chunked_prefill(**{**inputs, "query_start_loc": inputs["query_start_loc"][:2]})
    with pytest.raises(ValueError, match="key has 5 tokens, q has 6"):
        chunked_prefill(**{**inputs, "key": inputs["key"][:5]})
    with pytest.raises(ValueError, match=r"q \(varlen tokens\) must be \[batch, num_q_heads, 16\]"):
        chunked_prefill(**{**inputs, "q": inputs["q"][..., :8]})

"""paged_decode against its torch reference over formats, GQA ratios, odd shapes and splits."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kernels.paged_decode import make_inputs, paged_decode, paged_decode_ref  # noqa: E402
from kernels.testing import interpreter, rel_rms  # noqa: E402

INTERP = interpreter()

# q dtype -> (relative RMS, max abs error) against the fp32 reference on the same cache. The
# kernel casts dequantized tiles to fp16 for fp16 queries (vLLM does too) and the output to q's
# dtype; the interpreter's fp32 -> bf16 cast truncates (one bf16 ulp, ~4e-3 relative).
TOL = {
    torch.float16: (2e-3, 5e-3),
    torch.bfloat16: (1.2e-2, 3e-2),
    torch.float32: (2e-3, 5e-3),  # tf32 dots on a GPU
}
# lse from fp32 queries: tf32 dots on a GPU truncate the low mantissa bits; an emulation of sm_90's
# tf32 MMA gave errors up to 1.4e-3 at these shapes, so 2e-3 left too little room.
LSE_ATOL = 4e-3

# (format, q dtype, context_lens, num_kv_heads, gqa ratio, head_dim, block_size)
CASES = [
    ("fp16", torch.float16, [37, 5], 2, 4, 64, 8),
    ("fp16", torch.float32, [16, 1], 1, 8, 32, 16),
    ("bf16", torch.bfloat16, [21, 40], 1, 8, 40, 8),
    ("fp8_e4m3/per_tensor", torch.float16, [30], 2, 1, 64, 16),
    ("fp8_e4m3/per_head", torch.bfloat16, [19, 3], 2, 4, 40, 8),
    ("int8/g32", torch.float16, [33], 1, 4, 64, 16),
    ("int8/g48", torch.bfloat16, [25], 1, 1, 40, 8),
    ("int4/g32", torch.float16, [29, 16], 1, 8, 64, 16),
    ("int4/g24", torch.float16, [17], 2, 4, 40, 5),
    ("int4/g10", torch.float16, [13], 1, 4, 33, 4),  # odd head_dim
    ("kvquant4/1.0%", torch.float16, [26], 1, 4, 64, 16),
    ("kvquant4/5.0%", torch.bfloat16, [23, 9], 1, 8, 40, 8),
]
GPU_CASES = [
    (fmt, dt, [4000, 17, 1500, 8192], 8, 4, 128, 16)
    for fmt, dt in [
        ("fp16", torch.float16),
        ("bf16", torch.bfloat16),
        ("fp8_e4m3/per_head", torch.bfloat16),
        ("int8/g64", torch.float16),
        ("int4/g64", torch.float16),
        ("kvquant4/1.0%", torch.float16),
    ]
]


def _inputs(case, device: str, seed: int = 0):
    fmt, dtype, lens, kv_heads, ratio, head_dim, block_size = case
    inputs = make_inputs(
        fmt, len(lens), max(lens), kv_heads, head_dim, num_q_heads=kv_heads * ratio,
        block_size=block_size, dtype=dtype, device=device, seed=seed,
    )  # fmt: skip
    inputs["context_lens"] = torch.tensor(lens, dtype=torch.int32, device=device)
    return inputs


def _check(out: torch.Tensor, ref: torch.Tensor) -> None:
    rms_tol, abs_tol = TOL[out.dtype]
    assert rel_rms(out, ref) < rms_tol
    assert (out.float() - ref.float()).abs().max().item() < abs_tol


def _ids(cases):
    return [f"{c[0]}-{str(c[1])[6:]}-r{c[4]}-d{c[5]}-bs{c[6]}" for c in cases]


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_paged_decode_matches_reference(case, device):
    inputs = _inputs(case, device)
    ref, ref_lse = paged_decode_ref(**inputs, return_lse=True)
    out, lse = paged_decode(**inputs, num_splits=1, block_n=16, return_lse=True)
    _check(out, ref)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=LSE_ATOL)


SPLIT_CASES = [CASES[0], CASES[4], CASES[7], CASES[11]]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=_ids(SPLIT_CASES))
def test_split_kv_merge_matches_reference(case, device):
    inputs = _inputs(case, device)
    ref, ref_lse = paged_decode_ref(**inputs, return_lse=True)
    # 3 splits of 16 tokens: the short sequences leave some splits empty
    out, lse = paged_decode(**inputs, num_splits=3, block_n=16, return_lse=True)
    _check(out, ref)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=LSE_ATOL)


def test_zero_context_gives_zero_output_and_strided_q(device):
    inputs = _inputs(("int4/g32", torch.float16, [0, 12], 1, 4, 32, 16), device)
    q = inputs["q"]
    wide = torch.zeros(q.shape[0], q.shape[1] * 2, q.shape[2] + 8, dtype=q.dtype, device=device)
    wide[:, ::2, : q.shape[2]] = q
    inputs["q"] = wide[:, ::2, : q.shape[2]]  # non-contiguous heads and rows
    out = paged_decode(**inputs, num_splits=2)
    assert not out[0].any()
    _check(out, paged_decode_ref(**inputs))


@pytest.mark.skipif(INTERP, reason="realistic shapes: GPU only (interpreter too slow)")
@pytest.mark.parametrize("case", GPU_CASES, ids=_ids(GPU_CASES))
def test_paged_decode_gpu_shapes(case, device):
    inputs = _inputs(case, device)
    ref = paged_decode_ref(**inputs)
    for splits in (None, 1):
        _check(paged_decode(**inputs, num_splits=splits), ref)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda i: i.update(q=i["q"][:, :3]), r"num_q_heads \(3\) must be a multiple"),
        (lambda i: i.update(q=i["q"][..., :16]), r"q must be \[batch, num_q_heads, 40\]"),
        (lambda i: i.update(q=i["q"].to(torch.int8)), "q dtype must be"),
        (
            lambda i: i.update(block_tables=i["block_tables"].long()),
            "block_tables dtype must be int32",
        ),
        (
            lambda i: i.update(block_tables=i["block_tables"][:1]),
            r"block_tables must be \[2, max_blocks\]",
        ),
        (
            lambda i: i.update(block_tables=i["block_tables"].t().contiguous().t()),
            "block_tables rows must be contiguous",
        ),
        (
            lambda i: i.update(context_lens=i["context_lens"].long()),
            "context_lens must be contiguous int32",
        ),
        (lambda i: i.update(sm_scale=-1.0), "sm_scale must be a positive"),
        (
            lambda i: i.update(q=i["q"].transpose(1, 2).contiguous().transpose(1, 2)),
            "contiguous along head_dim",
        ),
    ],
)
def test_paged_decode_rejects_bad_inputs(change, match):
    inputs = make_inputs("int4/g24", 2, 20, 2, 40, num_q_heads=8, block_size=4)
    change(inputs)
    with pytest.raises(ValueError, match=match):
        paged_decode(**inputs)


def test_paged_decode_rejects_bad_launch_parameters():
    inputs = make_inputs("fp16", 1, 4, 1, 16)
    with pytest.raises(ValueError, match="num_splits must be a positive integer, got 0"):
        paged_decode(**inputs, num_splits=0)
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16, got 24"):
        paged_decode(**inputs, block_n=24)

"""Defects of the Triton 3.9 interpreter, demonstrated so that they stay visible.

The kernels avoid each of them (see the module docstrings); these tests are strict xfails in the
interpreter (they fail there, and if a Triton release fixes one the xfail turns into an error that
says so) and plain tests on a GPU, where they check that the hardware path is correct.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from kernels.testing import interpreter  # noqa: E402

defect = pytest.mark.xfail(interpreter(), strict=True, reason="Triton 3.9 interpreter defect")


@triton.jit
def _cast_fp8(x_ptr, o_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(o_ptr + i, tl.load(x_ptr + i).to(tl.float8e4nv))


@triton.jit
def _cast_bf16(x_ptr, o_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(o_ptr + i, tl.load(x_ptr + i).to(tl.bfloat16))


@triton.jit
def _dot(a_ptr, b_ptr, o_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    a = tl.load(a_ptr + i[:, None] * N + i[None, :])
    b = tl.load(b_ptr + i[:, None] * N + i[None, :])
    tl.store(o_ptr + i[:, None] * N + i[None, :], tl.dot(a, b))


@triton.jit
def _scalar_and_vector_mask(x_ptr, s_ptr, o_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    ok = tl.load(s_ptr) >= 0
    m = (i < N - 1) & ok
    tl.store(o_ptr + i, tl.load(x_ptr + i, mask=m, other=0.0), mask=m)


@defect
def test_in_kernel_fp8_cast_rounds_like_torch(device):
    """Kernels instead round to fp8 on the bits (kernels.kv_write.fp8_e4m3_bits)."""
    x = (torch.randn(1024) * 50).clamp(-440, 440).to(device)
    out = torch.empty(1024, dtype=torch.float8_e4m3fn, device=device)
    _cast_fp8[(1,)](x, out, N=1024)
    assert torch.equal(out.view(torch.uint8), x.to(torch.float8_e4m3fn).view(torch.uint8))


@defect
def test_in_kernel_bf16_cast_rounds_to_nearest_even(device):
    """The interpreter truncates; kernels store bf16 cache values via kernels.kv_write.bf16_bits.
    (Outputs of bf16 attention are still cast in-kernel: one ulp, within the bf16 tolerance.)"""
    x = torch.randn(1024, device=device)
    out = torch.empty(1024, dtype=torch.bfloat16, device=device)
    _cast_bf16[(1,)](x, out, N=1024)
    assert torch.equal(out, x.to(torch.bfloat16))


@defect
def test_bf16_dot(device):
    """Kernels never give tl.dot bf16 operands: they upcast to fp32 (exact in tf32 on a GPU)."""
    a = torch.randn(16, 16, device=device).to(torch.bfloat16)
    b = torch.randn(16, 16, device=device).to(torch.bfloat16)
    out = torch.empty(16, 16, device=device)
    _dot[(1,)](a, b, out, N=16)
    torch.testing.assert_close(out, a.float() @ b.float(), rtol=1e-2, atol=1e-2)


@defect
def test_scalar_and_vector_bool_mask(device):
    """(scalar bool & vector bool) becomes int32 and load() rejects it; kernels compare vectors."""
    x = torch.randn(16, device=device)
    out = torch.zeros(16, device=device)
    _scalar_and_vector_mask[(1,)](x, torch.tensor([3], device=device), out, N=16)
    assert torch.equal(out[:15], x[:15])

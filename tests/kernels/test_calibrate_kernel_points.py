"""The calibrator's timed calls of the eviction and quantize-on-write kernels (`calibrate.ops`): the
Triton path a CUDA calibration times computes what the torch reference path a CPU one times does,
at tiny shapes (in the interpreter on a CPU, on the GPU where there is one)."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from calibrate.ops import _compact_points, _score_points, _write_points, make_grid  # noqa: E402
from kernels.testing import rel_rms  # noqa: E402
from kvsim.spec.models import load_model  # noqa: E402

FORMATS = ("bf16", "int8/g64", "fp8_e4m3/per_tensor")


def _tiny():  # type: ignore[no-untyped-def]
    model = dataclasses.replace(load_model("llama-3.1-8b"), num_heads=4, num_kv_heads=2, head_dim=32)
    grid = dataclasses.replace(
        make_grid("cpu", True, FORMATS),
        score_batch=(2,),
        score_context=(40,),
        compact_tokens=(12,),
        write_tokens=(5,),
    )
    return model, grid


@pytest.mark.parametrize(
    "build", [_score_points, _compact_points, _write_points], ids=["score", "compact", "write"]
)
def test_triton_points_compute_what_the_reference_points_do(build, device):
    model, grid = _tiny()
    kern = list(build(grid, model, 1, device, triton=True))
    ref = list(build(grid, model, 1, device, triton=False))
    assert len(kern) == len(ref) == len(FORMATS)
    for k, r in zip(kern, ref, strict=True):
        assert k.params["impl"].startswith("triton:") and r.params["impl"].startswith("torch:")
        assert {**k.params, "impl": 0} == {**r.params, "impl": 0} and k.nbytes == r.nbytes > 0
        out_k, out_r = k.fn.func, r.fn.func  # the same inputs (seeded), one call each
        k.fn()
        r.fn()
        if build is _score_points:  # the scores buffer both calls updated
            got, want = k.fn.keywords["scores"], r.fn.keywords["scores"]
            assert got.abs().sum() > 0 and rel_rms(got, want) < 2e-3, out_k
        elif build is _compact_points:  # the cache both compacted in place
            got, want = k.fn.args[0].pool, r.fn.args[0].pool
            assert torch.equal(got, want), (out_k, out_r)
        else:  # the cache both wrote into
            got, want = k.fn.keywords["cache"].pool, r.fn.keywords["cache"].pool
            assert torch.equal(got, want), (out_k, out_r, k.params["format"])

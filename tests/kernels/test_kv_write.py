"""Quantize-on-write stores exactly the bytes the torch reference stores (interpreter: bit-exact;
GPU: fp32 division may differ in the last ulp, so a few codes may differ by one step)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kernels.kv_cache import PagedKVCache, dequantize_slots_ref  # noqa: E402
from kernels.kv_write import kv_write, kv_write_ref, make_inputs  # noqa: E402
from kernels.testing import interpreter, rel_rms  # noqa: E402

INTERP = interpreter()

# (format, head_dim, num_kv_heads, num_tokens, block_size, input dtype)
CASES = [
    ("fp16", 64, 2, 5, 4, torch.float16),
    ("bf16", 40, 1, 5, 4, torch.float32),  # rounding fp32 -> bf16 (RNE on the bits)
    ("fp8_e4m3/per_tensor", 64, 2, 5, 4, torch.float16),
    ("fp8_e4m3/per_head", 40, 2, 4, 3, torch.bfloat16),
    ("int8/g32", 64, 1, 5, 4, torch.float16),
    ("int8/g48", 40, 1, 4, 4, torch.float32),  # one short group
    ("int4/g32", 64, 1, 5, 4, torch.float16),
    ("int4/g24", 40, 2, 4, 5, torch.float16),  # group does not divide head_dim
    ("int4/g16", 36, 1, 3, 4, torch.bfloat16),  # odd nibble count per group boundary
    ("int4/g10", 33, 1, 3, 4, torch.float16),  # odd head_dim: half-empty last byte
    ("kvquant4/1.0%", 64, 1, 5, 4, torch.float16),
    ("kvquant4/5.0%", 33, 1, 3, 4, torch.float32),
    ("kvquant4/5.0%", 40, 2, 4, 4, torch.float16),
]
GPU_CASES = [
    ("fp8_e4m3/per_head", 128, 8, 300, 16, torch.bfloat16),
    ("int4/g64", 128, 8, 300, 16, torch.float16),
    ("kvquant4/1.0%", 128, 8, 300, 16, torch.float16),
]


def _twin(cache: PagedKVCache) -> PagedKVCache:
    s = cache.spec
    return PagedKVCache.allocate(
        s.fmt, s.num_blocks, s.block_size, s.num_kv_heads, s.head_dim,
        pool=torch.zeros_like(cache.pool),
        k_fp8_scale=cache.k.fp8_scale, v_fp8_scale=cache.v.fp8_scale,
        k_codebook=cache.k.codebook, v_codebook=cache.v.codebook,
    )  # fmt: skip


def _run(case, device: str, seed: int = 0):
    fmt, d, h, n, bs, dtype = case
    inputs = make_inputs(fmt, n, h, d, block_size=bs, device=device, dtype=dtype, seed=seed)
    cache = inputs["cache"]
    key, value = inputs["key"], inputs["value"]
    # spread magnitudes: channel outliers, tiny values (fp8 subnormals), one skipped slot
    key[:, :, 3] *= 40.0
    value[:, :, 1] *= 1e-3
    inputs["slot_mapping"][1] = -1
    if cache.k.fp8_scale is not None:  # scale so that the 40x channel saturates at 448
        cache.k.fp8_scale.fill_(20.0 / 448.0)
        cache.v.fp8_scale.copy_(torch.linspace(0.5, 2.0, cache.v.fp8_scale.numel()) / 448.0)
    ref = _twin(cache)
    kv_write(**inputs)
    kv_write_ref(**{**inputs, "cache": ref})
    return inputs, cache, ref


def _check_same(inputs, cache: PagedKVCache, ref: PagedKVCache) -> None:
    if INTERP:
        assert torch.equal(cache.pool, ref.pool), "stored bytes differ from the torch reference"
        return
    slots = inputs["slot_mapping"]
    slots = slots[slots >= 0]
    for side in ("k", "v"):
        got = dequantize_slots_ref(cache, side, slots)
        want = dequantize_slots_ref(ref, side, slots)
        assert rel_rms(got, want) < 1e-3, side
    assert (cache.pool != ref.pool).float().mean().item() < 0.01


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-d{c[1]}-h{c[2]}" for c in CASES])
def test_kv_write_matches_reference(case, device):
    inputs, cache, ref = _run(case, device)
    _check_same(inputs, cache, ref)
    skipped = torch.zeros_like(cache.pool)
    assert cache.pool.any() and not torch.equal(cache.pool, skipped)


@pytest.mark.skipif(INTERP, reason="realistic shapes: GPU only (interpreter too slow)")
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_kv_write_matches_reference_gpu_shapes(case, device):
    _check_same(*_run(case, device))


def test_skipped_slot_leaves_cache_untouched(device):
    inputs = make_inputs("int4/g32", 3, 1, 32, block_size=2, device=device)
    inputs["slot_mapping"].fill_(-1)
    kv_write(**inputs)
    assert not inputs["cache"].pool.any()


def test_fp8_write_saturates_and_rounds_like_torch(device):
    inputs = make_inputs("fp8_e4m3/per_tensor", 2, 1, 64, block_size=2, device=device)
    cache = inputs["cache"]
    cache.k.fp8_scale.fill_(1.0)
    cache.v.fp8_scale.fill_(1.0)
    # ties between fp8 neighbours, subnormals, the largest finite value and beyond
    special = torch.tensor(
        [0.0, -0.0, 1e-9, 2.0**-10, 3 * 2.0**-10, 2.0**-7 + 2.0**-11, 1.0625, 1.1875, -1.1875,
         447.0, 448.0, 464.0, 1e6, -1e6, 239.9, 240.0, 248.0, 0.015625, 0.0146484375, -3.0]
    )  # fmt: skip
    vals = torch.cat([special, torch.randn(64 - len(special)) * 30])
    inputs["key"] = vals.view(1, 1, 64).repeat(2, 1, 1).to(device, torch.float32)
    inputs["value"] = inputs["key"].clone()
    kv_write(**inputs)
    slots = inputs["slot_mapping"]
    got = cache.k.data.view(torch.uint8)[slots // 2, slots % 2]
    want = vals.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).to(device)
    assert torch.equal(got[0, 0], want)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda i: i.update(key=i["key"][:, :, :-1]), r"key must be \[num_tokens, 2, 40\]"),
        (lambda i: i.update(key=i["key"].to(torch.int32)), "key dtype must be"),
        (lambda i: i.update(value=i["value"][:2]), "differ in shape"),
        (lambda i: i.update(slot_mapping=i["slot_mapping"][:2]), r"slot_mapping must be \[4\]"),
        (lambda i: i.update(slot_mapping=i["slot_mapping"].float()), "slot_mapping dtype"),
        (
            lambda i: i.update(key=i["key"].transpose(1, 2).contiguous().transpose(1, 2)),
            "contiguous along head_dim",
        ),
    ],
)
def test_kv_write_rejects_bad_inputs(change, match):
    inputs = make_inputs("int4/g24", 4, 2, 40)
    change(inputs)
    with pytest.raises(ValueError, match=match):
        kv_write(**inputs)

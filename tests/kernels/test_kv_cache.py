"""Cache layouts match kvsim.spec.formats byte for byte; the torch quantizers behave as documented."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from kernels.kv_cache import (  # noqa: E402
    CacheSpec,
    PagedKVCache,
    allocate_layers,
    dequantize_ref,
    fit_codebook,
    quantize_ref,
    resolve_format,
)
from kvsim.spec.formats import make_format  # noqa: E402

FORMATS = [
    ("fp16", {}),
    ("bf16", {}),
    ("fp8_e4m3", {"scale": "per_tensor"}),
    ("fp8_e4m3", {"scale": "per_head"}),
    ("int8", {"group_size": 32}),
    ("int8", {"group_size": 48}),
    ("int4", {"group_size": 64}),
    ("int4", {"group_size": 24}),
    ("kvquant4", {"outlier_fraction": 0.01}),
    ("kvquant4", {"outlier_fraction": 0.05}),
    ("kvquant4", {"outlier_fraction": 0.0}),
]


@pytest.mark.parametrize("name,kwargs", FORMATS)
@pytest.mark.parametrize("head_dim", [40, 64, 128, 75])
def test_bytes_per_token_equal_format_bytes_per_vector(name: str, kwargs: dict, head_dim: int):
    fmt, _ = make_format(name, **kwargs)
    cache = PagedKVCache.allocate(fmt, num_blocks=3, block_size=5, num_kv_heads=3, head_dim=head_dim)
    for side in ("k", "v"):
        assert cache.bytes_per_token_per_head(side) == fmt.bytes_per_vector(head_dim), side
    static = sum(
        t.numel() * t.element_size()
        for p in (cache.k, cache.v)
        for t in (p.fp8_scale, p.codebook)
        if t is not None
    )
    assert static == fmt.static_bytes_per_layer(3)
    # the pool holds exactly the planes plus < 16 bytes of row padding per block
    per_block = 2 * 5 * 3 * fmt.bytes_per_vector(head_dim)
    assert per_block <= cache.spec.row_bytes < per_block + 16


@pytest.mark.parametrize("name,kwargs", FORMATS)
def test_format_names_resolve(name: str, kwargs: dict):
    fmt, _ = make_format(name, **kwargs)
    assert resolve_format(fmt.name) == fmt


@pytest.mark.parametrize("bad", ["fp7", "int4/g3", "int4/x", "kvquant4/abc", "fp8_e4m3/per_row", 3])
def test_bad_format_names_raise_value_error(bad):
    with pytest.raises(ValueError, match="format"):
        resolve_format(bad)


def test_bad_sizes_raise_value_error():
    with pytest.raises(ValueError, match="block_size must be a positive integer, got 0"):
        PagedKVCache.allocate("fp16", 4, 0, 2, 64)
    with pytest.raises(ValueError, match=r"k_codebook must be \[2, 16\]"):
        PagedKVCache.allocate("kvquant4/1.0%", 4, 16, 2, 64, k_codebook=torch.zeros(2, 8))
    with pytest.raises(ValueError, match="pool must be uint8"):
        PagedKVCache.allocate("fp16", 4, 16, 2, 64, pool=torch.zeros(4, 8, dtype=torch.uint8))


def test_layers_share_block_ids():
    pool, caches = allocate_layers("int4/g32", 2, 6, 4, 2, 64)
    assert pool.shape == (2, 6, caches[0].spec.row_bytes)
    caches[1].k.data[3].fill_(7)
    assert pool[1, 3].any() and not pool[0].any()


@pytest.mark.parametrize("name,qmax", [("int8/g32", 255), ("int4/g32", 15)])
def test_int_roundtrip_error_within_half_step(name: str, qmax: int):
    spec = CacheSpec(resolve_format(name), 1, 1, 2, 96)
    x = torch.randn(50, 2, 96)
    x_hat = dequantize_ref(quantize_ref(x, spec), spec)
    groups = x.unflatten(-1, (3, 32))
    step = (groups.amax(-1) - groups.amin(-1)) / qmax
    err = (x_hat - x).abs().unflatten(-1, (3, 32)).amax(-1)
    assert (err <= step * 0.51 + 2e-3).all()  # half a step, plus fp16 rounding of scale/zero


def test_kvquant4_outliers_are_exact_and_largest():
    spec = CacheSpec(resolve_format("kvquant4/5.0%"), 1, 1, 1, 40)
    assert spec.num_outliers == 2
    x = torch.randn(30, 1, 40)
    x[:, 0, 7] = 60.0 * torch.sign(x[:, 0, 7])
    cb = fit_codebook(x, spec.num_outliers)
    planes = quantize_ref(x, spec, codebook=cb)
    assert (planes["outlier_idx"][:, 0, 0] == 7).all()
    top2 = x.abs().topk(2, -1).indices.sort(-1).values
    assert torch.equal(planes["outlier_idx"].long().sort(-1).values, top2)
    x_hat = dequantize_ref(planes, spec, codebook=cb)
    assert torch.equal(x_hat.gather(-1, top2), x.half().float().gather(-1, top2))
    assert math.isclose(float(cb[0, 0]), -1.0) and math.isclose(float(cb[0, -1]), 1.0)

"""Keeps docs/design-documents.md honest: kvsim's side of each comparison, recomputed."""

from kvsim.spec.formats import make_format
from kvsim.spec.models import PRESETS, ModelSpec

FP16, FP8, INT4 = (make_format(n)[0] for n in ("fp16", "fp8", "int4"))
DOCS_30B = ModelSpec(
    name="docs-30b",
    num_layers=65,
    hidden_size=8192,
    num_heads=64,
    num_kv_heads=64,
    head_dim=128,
    intermediate_size=22016,
    vocab_size=32000,
    max_context=2**21,
)


def gb(x: int) -> float:
    return round(x / 1e9, 1)


def test_section_1_table_from_the_formula():
    assert DOCS_30B.kv_bytes_per_token(FP16) == 2 * 65 * 64 * 128 * 2
    assert [gb(DOCS_30B.kv_bytes(c, FP16)) for c in (2**14, 2**17, 2**20, 2**21)] == [
        34.9,
        279.2,
        2233.4,
        4466.8,
    ]
    assert gb(DOCS_30B.kv_bytes(2**20, FP8)) == 1116.7
    assert gb(DOCS_30B.kv_bytes(2**20, INT4)) == 628.1
    # The document's 435.2 GB at 1M is 5.1x below its own formula.
    assert round(DOCS_30B.kv_bytes(2**20, FP16) / 435.2e9, 1) == 5.1


def test_mla_ratio():
    mla = PRESETS["deepseek-v3"].kv_bytes_per_token(FP16)
    assert mla == 70_272
    assert round(2 * 61 * 128 * 128 * 2 / mla) == 57


def test_stacked_table_start():
    assert gb(PRESETS["llama-70b-mha"].kv_bytes(2**20, FP16)) == 2748.8
    assert gb(PRESETS["llama-3.1-70b"].kv_bytes(2**20, FP16)) == 343.6
    assert gb(PRESETS["llama-3.1-70b"].kv_bytes(2**20, FP8)) == 171.8

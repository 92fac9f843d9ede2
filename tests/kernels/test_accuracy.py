"""The accuracy script ranks formats sensibly, and its shipped JSON is complete and well-formed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kernels.accuracy import FORMAT_NAMES, main, measure  # noqa: E402
from kernels.kv_cache import resolve_format  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "kvsim" / "data" / "format_error.json"
KEYS = {"attn_out_rel_rms", "k_rel_rms", "v_rel_rms"}


def test_small_measurement_orders_formats():
    names = ("fp16", "bf16", "int8/g32", "int4/g32", "int4/g128", "kvquant4/0.0%", "kvquant4/2.0%")
    r = measure(names, tokens=256, kv_heads=2, q_heads=4, head_dim=64, queries=4)
    assert r["fp16"] == {k: 0.0 for k in KEYS}
    for key in KEYS:
        assert 0 < r["bf16"][key] < r["int8/g32"][key] < r["int4/g32"][key] < r["int4/g128"][key]
    # keeping outliers exact helps the 4-bit codebook format
    assert r["kvquant4/2.0%"]["k_rel_rms"] < r["kvquant4/0.0%"]["k_rel_rms"]


def test_main_writes_table_and_json(tmp_path):
    md, js = tmp_path / "acc.md", tmp_path / "err.json"
    argv = ["--tokens", "256", "--kv-heads", "1", "--q-heads", "2", "--head-dim", "32"]
    assert main([*argv, "--queries", "2", "--out-md", str(md), "--out-json", str(js)]) == 0
    data = json.loads(js.read_text())
    assert set(data) == {*FORMAT_NAMES, "method", "generated_by"}
    assert "--tokens 256" in data["generated_by"]
    assert md.read_text().count("\n| `") == len(FORMAT_NAMES)


def test_shipped_format_error_json_is_complete():
    data = json.loads(SHIPPED.read_text())
    assert isinstance(data.pop("method"), str) and isinstance(data.pop("generated_by"), str)
    assert set(data) == set(FORMAT_NAMES)
    for name, row in data.items():
        assert resolve_format(name).name == name  # the simulator looks formats up by this name
        assert set(row) == KEYS and all(math.isfinite(v) and v >= 0 for v in row.values())

"""Importing NVIDIA aiconfigurator-core's measured tables as a kvsim profile.

The import tests need the optional extra (``pip install 'kvsim[aiconfigurator]'``) and skip without
it; the shipped profile and the not-installed message are tested everywhere.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from calibrate.cli import main
from kvsim.costs.analytic import AnalyticCostModel
from kvsim.costs.base import ForwardBatch
from kvsim.costs.profile_schema import load_profile
from kvsim.run import make_cost_model
from tests.helpers import ROOT, small_scenario

SHIPPED = ROOT / "scenarios/profiles/aiconfigurator-h200_sxm-vllm-llama-3.1-8b-tp1.json"
SKIP_REASON = "aiconfigurator-core is not installed (pip install 'kvsim[aiconfigurator]')"


@pytest.fixture(scope="module")
def aic() -> None:
    pytest.importorskip("pyarrow", reason=SKIP_REASON)
    pytest.importorskip("aiconfigurator_core", reason=SKIP_REASON)


def _import(tmp_path: Path, system: str, *extra: str) -> Path:
    out = tmp_path / f"{system}.json"
    argv = ["import", "--from-aiconfigurator", "--system", system, "--backend", "vllm"]
    assert main([*argv, "--model", "llama-3.1-8b", "--tp", "1", *extra, "--out", str(out)]) == 0
    return out


def _models(path: Path, gpu: str, fmt: str):
    sc = small_scenario(
        cluster={"gpu": gpu}, cost_model={"kind": "profile", "profile": str(path)}, kv={"format": fmt}
    )
    return make_cost_model(sc), AnalyticCostModel(
        sc.model, sc.cluster.gpu, 1, sc.kv.format, sc.cluster.topology
    )


def _decode(b: int, ctx: int) -> ForwardBatch:
    return ForwardBatch.decode((ctx,) * b)


def _check_prices(path: Path, gpu: str) -> None:
    """Decode within 0.3x-3x of the roofline; decode and prefill grow with work; no stray warnings."""
    for fmt in ("bf16", "fp8"):
        pm, an = _models(path, gpu, fmt)
        times = []
        for b, ctx in ((1, 512), (8, 512), (8, 4096), (64, 4096), (256, 8192)):
            t, ta = pm.step_time(_decode(b, ctx)), an.step_time(_decode(b, ctx))
            assert 0.3 < t / ta < 3.0, (fmt, b, ctx, t, ta)
            times.append(t)
        assert times == sorted(times) and times[0] < times[-1]
        ctx = np.array([1000.0, 8000.0, 64000.0])
        assert np.all(np.diff(pm.decode_step_times(8, ctx)) > 0)
        stray = [w for w in pm.warnings() if "quantize-on-write priced by the analytic model" not in w]
        assert not stray, stray  # (the fp8 cache's write is priced analytically, and says so)
        pre = [pm.step_time(ForwardBatch.prefill(n)) for n in (64, 512, 2048, 8192)]
        assert pre == sorted(pre) and pre[0] < pre[-1]


@pytest.mark.parametrize(
    ("system", "gpu", "device"), [("h200_sxm", "h200-sxm", "H200"), ("h100_sxm", "h100-sxm", "H100")]
)
def test_import_loads_and_prices_like_the_roofline(aic, tmp_path, system, gpu, device):
    prof = load_profile(_import(tmp_path, system))
    assert prof["kind"] == "measured" and prof["backend"] == "cuda" and prof["complete"] is True
    assert prof["source"].startswith("aiconfigurator-core 0.12.0 " + f"{system}/vllm/")
    assert device in prof["device"]["name"] and system in prof["device"]["name"]
    assert prof["provenance"]["license"] == "Apache-2.0" and len(prof["provenance"]["tables"]) == 3
    assert set(prof["ops"]) >= {"gemm", "paged_decode", "chunked_prefill"}
    assert prof["kv_formats"] == ["bf16", "fp8_e4m3/per_tensor"]
    _check_prices(tmp_path / f"{system}.json", gpu)


def test_exact_grid_shapes_are_the_tables_latencies_in_seconds(aic, tmp_path):
    """qkv of Llama-3.1-8B (6144 x 4096) and 1 x 1024 decode are grid points: ms in, seconds out."""
    import pyarrow.parquet as pq

    from calibrate.aiconfigurator import resolve

    src = resolve("h200_sxm", "vllm", None)
    prof = load_profile(_import(tmp_path, "h200_sxm"))
    gemm = pq.read_table(src.table("gemm", "gemm_perf.parquet")).to_pylist()
    want = next(r for r in gemm if (r["gemm_dtype"], r["m"], r["n"], r["k"]) == ("bfloat16", 16, 6144, 4096))
    got = next(p for p in prof["ops"]["gemm"]["points"] if p["layer"] == "qkv" and p["m"] == 16)
    assert got["t_p50"] == pytest.approx(want["latency"] * 1e-3, rel=1e-9) and got["from_nk"] == ["6144x4096"]
    gen = pq.read_table(src.table("attention", "generation_attention_perf.parquet")).to_pylist()
    row = next(
        r
        for r in gen
        if (r["batch_size"], r["isl"] + r["step"], r["num_heads"], r["num_key_value_heads"], r["head_dim"])
        == (1, 1024, 32, 8, 128)
        and r["kv_cache_dtype"] == "bfloat16"
        and r["window_size"] == 0
        and r["kernel_source"] == prof["provenance"]["decode_kernel"]
    )
    dec = next(
        p
        for p in prof["ops"]["paged_decode"]["points"]
        if (p["batch"], p["context"], p["format"]) == (1, 1024, "bf16")
    )
    assert dec["t_p50"] == pytest.approx(row["latency"] * 1e-3, rel=1e-9)
    assert dec["bytes"] == 1024 * 4096  # 8 KV heads x 128 x 2 (K, V) x 2 bytes per token per layer
    # gate_up (n = 28672) lies between measured shapes and is interpolated; lm_head is held at the edge.
    up = next(p for p in prof["ops"]["gemm"]["points"] if p["layer"] == "gate_up")
    assert up["from_nk"] == ["16384x4096", "51200x4096"]
    assert any("lm_head" in n for n in prof["notes"])


def test_decode_grid_is_rectangular_with_filled_cells_marked(aic, tmp_path):
    prof = load_profile(_import(tmp_path, "h200_sxm"))
    pts = [p for p in prof["ops"]["paged_decode"]["points"] if p["format"] == "bf16"]
    batches, contexts = {p["batch"] for p in pts}, {p["context"] for p in pts}
    assert len(pts) == len(batches) * len(contexts)
    assert any("filled" in p for p in pts)
    for b in batches:  # the sweep stops at some context per batch; the longer ones are filled
        row = sorted((p for p in pts if p["batch"] == b), key=lambda p: p["context"])
        flags = ["filled" in p for p in row]
        assert flags == sorted(flags)
        longest = max(p["context"] for p in row if "filled" not in p)
        assert all(p["filled"] == {"rate_of_context": longest} for p in row if "filled" in p)
        assert all(p["batch"] * p["context"] > 128 * 1024 for p in row if "filled" in p)


@pytest.mark.parametrize(
    ("flags", "expect"),
    [
        (["--system", "h999"], "--system: unknown system 'h999'; available: "),
        (["--system", "h200_sxm", "--backend", "tgi"], "--backend: no 'tgi' data for h200_sxm; available: "),
        (["--version", "0.0.1"], "--version: no vllm 0.0.1 data for h200_sxm; available: "),
    ],
)
def test_unknown_system_backend_version_list_what_exists(aic, tmp_path, capsys, flags, expect):
    argv = ["import", "--from-aiconfigurator", "--model", "llama-3.1-8b", "--out", str(tmp_path / "x.json")]
    assert main([*argv, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvsim: error: " + expect)
    assert not (tmp_path / "x.json").exists()


def test_not_installed_gives_the_install_line(tmp_path):
    code = (
        "import sys; sys.modules['aiconfigurator_core'] = None\n"
        "from calibrate.cli import main\n"
        "sys.exit(main(['import', '--from-aiconfigurator', '--model', 'llama-3.1-8b', '--out', 'x.json']))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": ""},
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "kvsim: error: aiconfigurator-core is not installed: pip install 'kvsim[aiconfigurator]'"
    ]


def test_shipped_profile_loads_and_prices_an_h200(tmp_path):
    """Runs without the extra: the shipped import is plain JSON."""
    prof = load_profile(SHIPPED)
    assert prof["source"] == "aiconfigurator-core 0.12.0 h200_sxm/vllm/0.24.0"
    assert prof["provenance"]["license"] == "Apache-2.0"
    _check_prices(SHIPPED, "h200-sxm")

"""bench/bench_kernels.py refuses to run without CUDA, and its interpreter smoke test works."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.testing import interpreter
from tests.helpers import run_guarded

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "bench_kernels.py"


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return run_guarded(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, **env},
    )


def test_refuses_without_cuda():
    done = _run(CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="0")
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "no CUDA device" in done.stderr


@pytest.mark.skipif(not interpreter(), reason="the smoke test is for CPU; on a GPU run the bench")
def test_interpreter_smoke_run_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    done = _run("--interpret", "--only", "decode", "blocks", "--formats", "int4/g64", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "torch:" in done.stdout and "triton:" in done.stdout
    payload = json.loads(out.read_text())
    ops = {r["op"] for r in payload["results"]}
    assert {"paged_decode", "block_gather", "staging_to_pinned_host", "copy_blocks"} <= ops
    assert all(r["gb_per_s"] > 0 and "pct_hbm_peak" in r for r in payload["results"])

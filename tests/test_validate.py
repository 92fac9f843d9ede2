"""``kvsim validate --device cpu --quick`` end to end (~15 s here), and its pieces.

The burst scenario (12 requests at t = 0) is executed twice after a warm-up: with every request
there from the start, each schedule is fixed by the scheduler alone, so the execution's step
compositions and KV blocks in use must equal the simulation's exactly, whatever the step times.
Latency errors are checked against a wide bound only, stated here: every simulated TTFT, TPOT and
E2E p50 within a factor of 4 of the measured one. The CPU here is shared by several engineers'
test runs, and a neighbour's load arriving between the calibration and the execution has slowed
the execution 2.5x (BENCHMARKS.md records the real figures and the load they ran under); what
this test pins exactly is what must not depend on timing: schedules and KV blocks.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from kvsim.results.record import read_summary
from kvsim.spec.models import load_model
from kvsim.validation import scaled_config
from tests.helpers import ROOT, run_guarded

torch = pytest.importorskip("torch")

WIDE = 4.0  # simulated / measured within [1/4, 4] on a shared, noisy CPU


def _run(tmp_path, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_guarded(
        [sys.executable, "-m", "kvsim", "validate", "--device", "cpu", "--quick", *extra],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": ""},
    )


def test_validate_cpu_quick_end_to_end(tmp_path):
    out = tmp_path / "v"
    scen = str(ROOT / "scenarios" / "validate_burst.yaml")
    argv = ["--scenario", scen, "--out", str(out), "--repeats", "2", "--recalibrate", "--no-progress"]
    proc = _run(tmp_path, *argv)
    assert proc.returncode == 0, proc.stderr
    assert "ttft_p50" in proc.stdout and "KV blocks: peak identical in every run: yes" in proc.stdout
    data = json.loads((out / "validate.json").read_text())
    assert data["schema"] == "kvsim-validate" and data["repeats"] == 2 and data["requests"] == 12
    kv = data["kv_blocks"]
    assert kv["peak_identical"] is True and kv["schedules_identical"] == 2
    assert kv["peak_measured"] == kv["peak_simulated"]["profile"] == kv["peak_simulated"]["analytic"]
    assert data["recalibrated"] and [p["path"] for p in data["profiles"]] == [
        "profile-1.json",
        "profile-2.json",
    ]
    rows = {r["metric"]: r for r in data["metrics"]}
    assert rows["kv_peak_blocks"]["profile"]["error"]["median"] == 0.0
    for name in ("ttft_p50", "tpot_p50", "e2e_p50"):
        err = rows[name]["profile"]["error"]["median"]
        assert 1 / WIDE <= 1 + err <= WIDE, (name, err)
    assert data["step_time"]["profile"]["steps"] == 2 * read_summary(out / "exec-1").steps
    assert {p["gemm_dtype"] for p in data["profiles"]} == {"float32"}
    # Run directories in kvsim run's format, the executions with their steps and token times.
    for d in ("exec-1", "exec-2", "sim-profile-1", "sim-profile-2", "sim-analytic-1", "sim-analytic-2"):
        for f in ("summary.json", "requests.csv", "timeseries.csv"):
            assert (out / d / f).is_file(), (d, f)
        s = read_summary(out / d)
        assert s.requests.completed == 12 and s.requests.unfinished == 0 and s.requests.rejected == 0
        assert not [w for w in s.warnings if "far from any real device" in w], d  # a CPU's peaks: validate's
    ex, sim = read_summary(out / "exec-1"), read_summary(out / "sim-profile-1")
    assert ex.steps == sim.steps and ex.kv_peak_used_blocks == sim.kv_peak_used_blocks
    assert ex.config.cost_model.startswith("measured:CPU")
    with (out / "exec-1" / "tokens.csv").open() as f:
        tokens = list(csv.DictReader(f))
    with (out / "exec-1" / "requests.csv").open() as f:
        reqs = list(csv.DictReader(f))
    assert len(tokens) == sum(int(r["output_tokens"]) for r in reqs)  # every token, none twice
    first = {r["id"]: float(r["first_token_s"]) for r in reqs}
    for r in reqs:
        times = [float(t["t_s"]) for t in tokens if t["id"] == r["id"]]
        assert times == sorted(times) and times[0] == pytest.approx(first[r["id"]], abs=1e-6)
    with (out / "exec-1" / "steps.csv").open() as f:
        steps = list(csv.DictReader(f))
    assert len(steps) == ex.steps and max(int(s["kv_used_blocks"]) for s in steps) == ex.kv_peak_used_blocks
    assert (out / "validate.md").read_text().startswith("| metric | measured | profile sim |")
    # The per-op run (the last round's): each op of the simulation's split timed inside the forward.
    ops = {r["op"]: r for r in data["per_op"]["ops"]}
    assert {"gemm:qkv", "gemm:lm_head", "paged_decode", "chunked_prefill", "kv_write", "step_rest:layer",
            "step_rest:embed", "step_overhead"} <= set(ops)  # fmt: skip
    assert all(r["loop_ms_per_step"] > 0 < r["profile_ms_per_step"] for n, r in ops.items() if n != "other")
    assert "op (per-op run)" in proc.stdout and "| op | steps |" in (out / "validate.md").read_text()
    page = (out / "validate.html").read_text()
    assert page.startswith("<!doctype html>") and "<title>kvsim compare: " in page
    assert "Validation: simulated vs measured on CPU" in page
    # A re-run over its own output is allowed (and replaces it): one calibration, one run.
    again = _run(tmp_path, "--scenario", scen, "--out", str(out), "--repeats", "1", "--no-progress")
    assert again.returncode == 0, again.stderr
    redo = json.loads((out / "validate.json").read_text())
    assert redo["repeats"] == 1 and not redo["recalibrated"] and redo["kv_blocks"]["schedules_identical"] == 1
    assert [p["path"] for p in redo["profiles"]] == ["profile.json"] and (out / "sim-profile").is_dir()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_one_line_and_writes_nothing(tmp_path):
    proc = run_guarded(
        [sys.executable, "-m", "kvsim", "validate", "--device", "cuda", "--quick", "--out", "o"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": ""},
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "kvsim: error: --device: CUDA is not available on this machine (torch sees no GPU)"
    )
    assert not (tmp_path / "o").exists()


def test_scaled_config_divides_width_and_depth_and_keeps_head_dim():
    cfg = scaled_config(load_model("llama-3.1-8b"), 8)
    assert cfg["num_hidden_layers"] == 4 and cfg["head_dim"] == 128
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (4, 1)  # GQA ratio 4 kept
    assert cfg["hidden_size"] == 512 and cfg["intermediate_size"] == 1792 and cfg["vocab_size"] == 16032
    same = scaled_config(load_model("llama-3.1-8b"), 1)
    assert (same["hidden_size"], same["num_hidden_layers"], same["vocab_size"]) == (4096, 32, 128256)


def test_block_tables_follow_the_pool_counts():
    from kvsim.core.kv_cache_manager import KVCacheManager
    from kvsim.core.request import Request
    from kvsim.core.sched.scheduler import Scheduler
    from validate.blocks import BlockTables

    kv = KVCacheManager(8, 4, enable_caching=False)
    sched = Scheduler(kv, max_num_seqs=4, max_batched_tokens=64, chunked_prefill=True)
    tables = BlockTables(kv)
    a, b = Request(0, 0.0, 9, 8, [], []), Request(1, 0.0, 5, 2, [], [])
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    tables.sync(out.prefill_reqs)
    assert tables.tables == {0: [0, 1, 2], 1: [3, 4]}  # 9 and 5 tokens in blocks of 4
    _, done = sched.advance(out)
    tables.release(done)
    tables.check()
    for _ in range(4):  # b finishes at its second token; a's 13th token takes b's first id back
        out = sched.schedule()
        tables.sync(out.decode_reqs)
        _, done = sched.advance(out)
        tables.release(done)
        tables.check()
    assert tables.tables == {0: [0, 1, 2, 3]}
    assert sorted(tables.free) == [4, 5, 6, 7] and kv.pool.free == 4


TRITON_VS_TORCH = """
import json, sys
from kvsim.core.kv_cache_manager import KVCacheManager
from kvsim.core.request import Request
from kvsim.core.sched.scheduler import Scheduler
from kvsim.spec.models import load_model
from validate.blocks import BlockTables
from validate.loop import _build
from validate.model import TinyLlama

spec = load_model(sys.argv[1])
runs = []
for triton in (False, True):
    m = TinyLlama(spec, device="cpu", kv_format="bf16", num_blocks=32, block_size=16, seed=0, triton=triton)
    kv = KVCacheManager(32, 16, enable_caching=False)
    s = Scheduler(kv, max_num_seqs=4, max_batched_tokens=40, chunked_prefill=True)
    t = BlockTables(kv)
    toks = {0: list(range(20)), 1: list(range(5, 35))}
    for r in (Request(0, 0, 20, 3, [], []), Request(1, 0, 30, 3, [], [])):
        s.add(r)
    steps = []
    while s.running or s.waiting:
        o = s.schedule()
        t.sync([*o.decode_reqs, *o.prefill_reqs])
        ids = m.forward(_build(o, t, toks, 16, "cpu")).tolist()
        rows = [*o.decode_reqs, *(r for r, f in zip(o.prefill_reqs, o.prefill_sampling) if f)]
        _, done = s.advance(o)
        for r, x in zip(rows, ids):
            toks[r.id].append(x)
        t.release(done)
        steps.append([len(o.decode_reqs), list(o.prefill_new)])
    runs.append({"steps": steps, "tokens": toks})
print(json.dumps(runs))
"""


def test_triton_launch_path_samples_the_tokens_of_the_torch_references(tmp_path):
    """The CUDA path's kernel calls (kv_write, paged_decode, chunked_prefill with slot mappings and
    block tables) run in Triton's interpreter on tiny shapes: the same greedy tokens as the torch
    references, through a chunked prefill, a mixed step and decodes."""
    pytest.importorskip("triton")
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_hidden_layers": 2,
        "vocab_size": 256,
        "max_position_embeddings": 4096,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    proc = run_guarded(
        [sys.executable, "-c", TRITON_VS_TORCH, str(tmp_path / "config.json")],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "", "TRITON_INTERPRET": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    torch_run, triton_run = json.loads(proc.stdout)
    assert torch_run["steps"] == [[0, [20, 20]], [1, [10]], [2, []], [1, []]]
    assert triton_run == torch_run

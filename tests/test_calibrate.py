"""The calibrator on a CPU (tiny grid), resume, flags, and a simulation driven by a CPU profile."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT, make_workload, small_scenario

pytest.importorskip("torch")

from calibrate.cli import main
from kvsim.costs.profile_schema import load_profile
from kvsim.run import run_scenario

SHIPPED = "scenarios/profiles/cpu-quick-llama-3.1-8b.json"


def test_cpu_calibration_writes_a_valid_profile_and_resumes(tmp_path, capsys):
    out = tmp_path / "p.json"
    args = ["--device", "cpu", "--quick", "--reps", "3", "--no-progress", "--out", str(out)]
    assert main([*args, "--ops", "decode,copy"]) == 0
    prof = load_profile(out)
    assert set(prof["ops"]) == {"paged_decode", "copy"} and prof["complete"] is False
    assert prof["backend"] == "cpu" and prof["kind"] == "measured"
    pt = prof["ops"]["paged_decode"]["points"][0]
    assert pt["t_p20"] <= pt["t_p50"] <= pt["t_p80"]
    assert pt["bytes"] == pt["batch"] * pt["context"] * 4096  # 8 KV heads x 128 x 2 (K, V) x 2 bytes
    before = json.loads(out.read_text())["ops"]["copy"]
    assert main([*args, "--ops", "copy,prefill,score,select,compact,write"]) == 0  # copy kept, others added
    after = load_profile(out)
    assert after["ops"]["copy"] == before and "chunked_prefill" in after["ops"]
    assert after["minor_version"] == 2
    # The schema 1.1 ops, at Llama-3.1-8B's per-layer shapes (8 KV heads x 128): grids and work.
    ops = after["ops"]
    shape = {op: [tuple(p[k] for k in keys) for p in ops[op]["points"]] for op, keys in (
        ("h2o_accumulate", ("format", "batch", "context")),
        ("h2o_select", ("tokens",)),
        ("compact_kv", ("format", "tokens")),
        ("kv_write", ("format", "tokens")),
    )}  # fmt: skip
    assert shape == {
        "h2o_accumulate": [("bf16", 1, 128), ("bf16", 1, 512), ("bf16", 4, 128), ("bf16", 4, 512)],
        "h2o_select": [(256,), (4096,)],
        "compact_kv": [("bf16", 64), ("bf16", 512)],
        "kv_write": [("bf16", 1), ("bf16", 16), ("bf16", 256)],
    }
    per_token = {"h2o_accumulate": 2048 + 64, "h2o_select": 32, "compact_kv": 8192, "kv_write": 8192}
    for op, per in per_token.items():
        for p in ops[op]["points"]:
            n = p["batch"] * p["context"] if op == "h2o_accumulate" else p["tokens"]
            assert p["bytes"] == n * per and p["t_p20"] <= p["t_p50"] <= p["t_p80"], (op, p)
    assert {p["impl"] for p in ops["compact_kv"]["points"]} == {"torch:kernels.h2o.compact_kv_ref"}
    assert [p["kept"] for p in ops["h2o_select"]["points"]] == [64, 1024]
    assert "already measured" in capsys.readouterr().err
    assert main([*args[:-2], "--reps", "4", "--out", str(out), "--ops", "copy"]) == 2  # other settings


@pytest.mark.parametrize(
    "argv",
    [
        ["--device", "tpu", "--out", "x.json"],
        ["--device", "cpu"],
        ["--device", "cpu", "--ops", "gemm,bogus", "--out", "x.json"],
        ["import", "--from-aiconfigurator", "--out", "x.json"],
        ["--device", "cpu", "--quick", "--ops", "copy", "--no-progress", "--out", "no/such/dir/p.json"],
    ],
)
def test_bad_flags_give_one_line_and_exit_2(argv, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "calibrate", *argv],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": ""},
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvsim: error:")


PROMPTS, OUTPUTS = [300, 40, 900, 100], [20, 50, 5, 30]


def _sim(ff: bool):
    sc = small_scenario(
        cost_model={"kind": "profile", "profile": SHIPPED, "force": True}, sim={"seed": 1, "fast_forward": ff}
    )
    return run_scenario(sc, workload=make_workload([0.0, 0.01, 0.02, 0.5], PROMPTS, OUTPUTS))


def _records(result) -> list[tuple]:
    return [
        (
            q.id,
            q.replica,
            q.first_scheduled_s,
            q.first_token_s,
            q.finish_s,
            q.num_cached_tokens,
            q.preemptions,
        )
        for q in result.seqs
    ]


def test_simulation_driven_by_a_cpu_profile_and_fast_forward_matches():
    fast, slow = _sim(True), _sim(False)
    s = fast.summary
    assert s["config"]["cost_model"] == "profile:cpu-quick-llama-3.1-8b.json"
    assert "cpu profile: timings are from a CPU, not a GPU" in s["warnings"]
    assert s["requests"]["completed"] == 4
    assert _records(fast) == _records(slow)
    assert fast.summary["engine_events"] < slow.summary["engine_events"]  # multi-step jumps were taken


def test_unforced_gpu_mismatch_is_one_line_error():
    from kvsim.errors import KvsimError

    sc = small_scenario(cost_model={"kind": "profile", "profile": SHIPPED})
    with pytest.raises(KvsimError) as exc:
        run_scenario(sc, workload=make_workload([0.0], [10], [2]))
    assert exc.value.source.endswith(SHIPPED) and "\n" not in str(exc.value)


def test_without_the_kernels_package_attention_falls_back_to_dense_sdpa(tmp_path):
    code = (
        "import sys\n"
        "class B:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('triton', 'kernels'):\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, B())\n"
        "from calibrate.cli import main\n"
        f"sys.exit(main(['--device', 'cpu', '--quick', '--ops', 'decode,score', '--no-progress', '--out', r'{tmp_path / 'p.json'}']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    prof = json.loads((tmp_path / "p.json").read_text())
    assert {p["impl"] for p in prof["ops"]["paged_decode"]["points"]} == {"torch_sdpa_dense"}
    # The eviction and write ops have no stand-in: skipped, said, and priced analytically later.
    assert "h2o_accumulate" not in prof["ops"]
    assert "calibrate: h2o_accumulate skipped: the kernels package is not importable" in proc.stderr


def test_progress_is_one_line_per_op_when_stdout_is_not_a_terminal(tmp_path):
    out = tmp_path / "p.json"
    argv = ["--device", "cpu", "--quick", "--ops", "copy,decode", "--reps", "3", "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "calibrate", *argv],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": ""},
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("calibrate: copy: 3/3 points in ") and "(3/7 in all" in lines[0]
    assert lines[1].startswith("calibrate: paged_decode: 4/4 points in ") and "(7/7 in all" in lines[1]
    assert lines[2].startswith("wrote ")
    assert load_profile(out)["gemm_dtype"] == "float32"  # a CPU times fp32 GEMMs


def test_a_huge_reported_cache_bounds_the_rotation_and_the_timer_does_nothing_between_calls(monkeypatch):
    """Issue 31: a VM reporting a 480 MiB L3 made the timer zero 960 MiB before every call. Now the
    reported cache only sizes the rotation (twice it, 64 MiB to 1 GiB); the timer holds no buffer
    and runs the same calls whatever the cache; and the points' copies stay within the cap."""
    import dataclasses

    import torch

    from calibrate import harness
    from calibrate.ops import make_grid, points
    from kvsim.spec.models import load_model

    mib = 1 << 20
    for llc, want in ((None, 64 * mib), (32 * mib, 64 * mib), (480 * mib, 960 * mib), (4 << 30, 1 << 30)):
        monkeypatch.setattr(harness, "cpu_llc_bytes", lambda llc=llc: llc)
        assert harness.rotation_bytes("cpu") == want
    seen = []
    for llc in (32 * mib, 4 << 30):
        monkeypatch.setattr(harness, "cpu_llc_bytes", lambda llc=llc: llc)
        timer = harness.Timer("cpu", warmup=2, max_reps=3, budget_s=1.0)
        assert not [v for v in vars(timer).values() if isinstance(v, torch.Tensor)]
        calls: list[int] = []
        timer.time([lambda i=i, calls=calls: calls.append(i) for i in range(3)])
        seen.append(calls)
    assert seen[0] == seen[1] == [0, 1, 2, 0, 1]  # 2 warm-up calls, 3 reps, rotated through the copies
    # A 4 GiB cache reported, the cap lowered to keep the test small: every rotation is the cap.
    monkeypatch.setattr(harness, "ROTATE_MAX_BYTES", 4 * mib)
    model = dataclasses.replace(
        load_model("llama-3.1-8b"), hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32,
        intermediate_size=256, vocab_size=1024,
    )  # fmt: skip
    grid = dataclasses.replace(make_grid("cpu", True, None), gemm_m=(1,), lm_head_m=(1,), decode_batch=(1, 4),
                               decode_context=(32, 4096))  # fmt: skip
    for pt in points("gemm", grid, model, 1, "cpu"):
        ws = [c.args[1] for c in pt.calls()]
        one = ws[0].numel() * 4
        assert len({w.data_ptr() for w in ws}) == len(ws)  # distinct copies
        assert len(ws) == min(harness.MAX_COPIES, -(-4 * mib // one)) and (len(ws) - 1) * one < 4 * mib
    dec = list(points("paged_decode", grid, model, 1, "cpu"))
    for pt in dec:
        tabs = [c.keywords["block_tables"] for c in pt.calls()]
        cache = pt.calls()[0].keywords["cache"]
        if cache.spec.num_blocks * cache.pool.shape[1] <= 4 * mib:  # the shared rotation pool
            blocks = torch.cat([t.flatten() for t in tabs])
            assert blocks.unique().numel() == blocks.numel()  # disjoint copies
            assert blocks.numel() * cache.pool.shape[1] <= 4 * mib
        else:  # 4 x 4096 tokens x 512 bytes: larger than the rotation, one copy of its own
            assert len(tabs) == 1 and pt.params["batch"] * pt.params["context"] * 512 > 4 * mib
    assert {len(pt.calls()) > 1 for pt in dec} == {True, False}
    assert {pt.calls()[0].keywords["q"].dtype for pt in dec} == {torch.float32}  # the CPU loop's dtype

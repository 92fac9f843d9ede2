"""kvsim run end to end: files written, summary contract, determinism, one-line errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvsim.cli import main
from kvsim.results.record import read_summary

SCENARIO = """
model: llama-3.1-8b
cluster: {gpu: h100-sxm, gpus_per_node: 2}
workload:
  synthetic: {num_requests: 60, rate: 5, shared_prefix_tokens: 512, session_turns: 2, think_time: 2s}
sim: {seed: 11}
"""


@pytest.fixture
def scenario(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text(SCENARIO)
    return p


def test_run_writes_summary_requests_and_report(scenario, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["run", str(scenario), "--out", str(out), "--no-progress"]) == 0
    s = read_summary(out / "summary.json")  # validates every field against the record
    assert (s.schema, s.version) == ("kvsim-summary", 1) and not s.read_notes
    r = s.requests
    assert r.total == 60 and r.completed + r.rejected + r.unfinished == r.total
    assert s.prefix_hit_rate > 0
    assert [x.index for x in s.replicas] == [0, 1]  # gpus_per_node 2, TP 1: two replicas
    assert sum(x.requests for x in s.replicas) == r.total - r.rejected
    assert (out / "requests.csv").read_text().count("\n") == 61
    assert (out / "report.html").stat().st_size > 10_000
    lines = capsys.readouterr().out.splitlines()
    # the SLO verdicts come first, each met or missed, with the latency at the SLO percentile
    verdict = {True: "met", False: "MISSED"}
    assert lines[0].startswith("SLO TTFT p99 <= 2,000.0 ms: ") and verdict[s.slo.ttft_met] in lines[0]
    assert lines[1].startswith("SLO TPOT p99 <= 100.0 ms: ") and verdict[s.slo.tpot_met] in lines[1]
    assert f"{s.slo.ttft_at_percentile_s * 1e3:,.1f} ms" in lines[0]
    assert any("TTFT" in x and "TPOT" not in x for x in lines[3:])  # the table after them
    # the last line names every file the run wrote, no more
    names = [n.strip().rsplit("/", 1)[-1] for n in lines[-1].removeprefix("wrote ").split(",")]
    assert names == sorted(
        (p.name for p in out.iterdir()),
        key=["summary.json", "requests.csv", "timeseries.csv", "report.html", "plotly.min.js"].index,
    )


def test_report_rebuilds_without_rerunning(scenario, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["run", str(scenario), "--out", str(out), "--no-progress"]) == 0
    first = (out / "report.html").read_bytes()
    (out / "report.html").unlink()
    assert main(["report", str(out)]) == 0
    assert (out / "report.html").read_bytes() == first
    assert main(["report", str(tmp_path / "nowhere")]) == 2
    assert "nowhere" in capsys.readouterr().err


def test_same_seed_identical_summary_apart_from_wall(scenario, tmp_path):
    runs = []
    for name in ("a", "b"):
        assert main(["run", str(scenario), "--out", str(tmp_path / name), "--no-progress"]) == 0
        s = read_summary(tmp_path / name).to_dict()
        for k in ("wall_s", "sim_speed_x"):
            s.pop(k)
        runs.append(s)
    assert runs[0] == runs[1]
    other = tmp_path / "c"
    assert main(["run", str(scenario), "--out", str(other), "--no-progress", "--set", "sim.seed=12"]) == 0
    assert read_summary(other).to_dict()["ttft_s"] != runs[0]["ttft_s"]


@pytest.mark.parametrize(
    "trace,needle",
    [
        (
            "arrival_s,prompt_tokens,output_tokens\n0,10,5\n1,abc,5\n",
            "t.csv:3: prompt_tokens must be an integer",
        ),
        ("arrival_s,prompt_tokens,output_tokens\n5,10,5\n1,10,5\n", "t.csv:3: timestamp goes backwards"),
        ("arrival_s,prompt_tokens,output_tokens\n", "the trace has no requests"),
        ("when,prompt\n", "wrong header"),
    ],
)
def test_bad_traces_one_line_exit_2(tmp_path, trace, needle):
    (tmp_path / "t.csv").write_text(trace)
    (tmp_path / "s.yaml").write_text("model: llama-3.1-8b\ncluster: {gpu: h100}\nworkload: {trace: t.csv}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "kvsim", "run", str(tmp_path / "s.yaml"), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    err = proc.stderr.strip()
    assert needle in err and "\n" not in err and "Traceback" not in err, err


def test_a_check_that_needs_the_memory_plan_is_one_line_at_run_time(scenario, tmp_path, capsys):
    """A host tier sized from the HBM pool is checked against the node's DRAM once the plan exists."""
    overrides = ["--set", "kv.offload.enabled=true", "--set", "kv.offload.hbm_ratio=10000"]
    rc = main(["run", str(scenario), "--out", str(tmp_path / "o"), *overrides])
    assert rc == 2
    assert "kv.offload.hbm_ratio: a host tier of" in capsys.readouterr().err


def test_a_run_refused_at_run_time_leaves_no_output_directory(scenario, tmp_path, capsys):
    """The output directory is made before the work (to fail early); a run refused once the plan or
    the engine exists removes it again if it made it, and keeps one it found."""
    combo = [
        "--set",
        "scheduler.spec_decode={k: 3, acceptance: {mean: 0.7}, draft: {kind: mtp}}",
        "--set",
        "kv.eviction.policy=h2o",
    ]
    assert main(["run", str(scenario), "--out", str(tmp_path / "new"), *combo]) == 2
    assert "not simulated together" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    (tmp_path / "mine").mkdir()
    assert main(["run", str(scenario), "--out", str(tmp_path / "mine"), *combo]) == 2
    assert (tmp_path / "mine").is_dir()


def test_skipped_lines_are_counted_in_the_summary(tmp_path):
    (tmp_path / "t.csv").write_text("arrival_s,prompt_tokens,output_tokens\n0,10,5\n1,abc,5\n2,20,3\n")
    (tmp_path / "s.yaml").write_text(
        "model: llama-3.1-8b\ncluster: {gpu: h100}\nworkload: {trace: t.csv, skip_bad_lines: true}\n"
    )
    assert main(["run", str(tmp_path / "s.yaml"), "--out", str(tmp_path / "o"), "--no-progress"]) == 0
    s = read_summary(tmp_path / "o")
    assert s.workload.skipped_lines == 1
    assert s.requests.completed == 2


def test_max_time_before_the_last_arrival_with_progress_bar(scenario, tmp_path):
    out = tmp_path / "o"
    assert main(["run", str(scenario), "--out", str(out), "--set", "sim.max_time=3s"]) == 0
    r = read_summary(out).requests
    assert r.not_arrived > 0 and r.completed + r.rejected + r.unfinished == r.total


def test_a_run_where_every_request_is_rejected_still_reports(tmp_path, capsys):
    (tmp_path / "t.csv").write_text("arrival_s,prompt_tokens,output_tokens\n0,200000,5\n1,300000,5\n")
    (tmp_path / "s.yaml").write_text("model: llama-3.1-8b\ncluster: {gpu: h100}\nworkload: {trace: t.csv}\n")
    assert main(["run", str(tmp_path / "s.yaml"), "--out", str(tmp_path / "o"), "--no-progress"]) == 0
    s = read_summary(tmp_path / "o")
    assert s.requests.rejected == 2 and s.cost_per_mtok_usd is None
    assert "cost -/M tokens" in capsys.readouterr().out
    assert (tmp_path / "o" / "report.html").exists()


def test_piped_run_prints_a_progress_line_per_quarter(scenario, tmp_path, capsys):
    """capsys is not a terminal: no bar, four plain lines on stderr; --no-progress: none."""
    assert main(["run", str(scenario), "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert [line.split("(")[1].split(")")[0] for line in err] == ["25%", "50%", "75%", "100%"], err
    assert all(line.startswith("simulated ") and " s of arrivals " in line for line in err)
    assert main(["run", str(scenario), "--out", str(tmp_path / "b"), "--no-progress"]) == 0
    assert capsys.readouterr().err == ""


def test_a_finished_run_whose_summary_cannot_be_written_is_one_line_exit_2(
    scenario, tmp_path, capsys, monkeypatch
):
    """A non-finite number reaching the record (a defect) loses neither the run's CSVs nor a
    traceback's worth of stderr: one line naming the field, exit 2."""
    import dataclasses

    import kvsim.run

    real = kvsim.run.run_scenario

    def infinite(*args, **kw):  # type: ignore[no-untyped-def]
        res = real(*args, **kw)
        res.record = dataclasses.replace(res.record, cost_per_mtok_usd=float("inf"))
        return res

    monkeypatch.setattr(kvsim.run, "run_scenario", infinite)
    out = tmp_path / "out"
    assert main(["run", str(scenario), "--out", str(out), "--no-progress"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvsim: error: ")
    assert "summary.json: cost_per_mtok_usd is inf, which strict JSON cannot hold" in lines[0]
    assert "wrote requests.csv, timeseries.csv" in lines[0]
    assert (out / "requests.csv").read_text().count("\n") == 61
    assert not (out / "summary.json").exists() and not (out / "report.html").exists()

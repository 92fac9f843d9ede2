"""kvsim sweep: the product of override axes, each point a full run; validated before anything
runs, failures recorded per point, resumable, and one seed giving one results.csv at any --jobs."""

from __future__ import annotations

import csv
import gzip
from pathlib import Path

import pytest
from plotly.offline import get_plotlyjs

from kvsim.cli import main
from kvsim.report.sweep import write_sweep_report
from kvsim.spec.scenario import load_scenario
from kvsim.sweep.define import expand, grid_factor, load_sweep_file, parse_axis, zip_factor
from kvsim.sweep.local import PointRunner, PointTask
from kvsim.sweep.runner import prepare_sweep, resumable, run_sweep
from kvsim.sweep.table import PARETO_REL_TOL, metrics_of, pareto_front
from tests.helpers import CHROMIUM, chromium_args, run_guarded

SCENARIO = """\
model: llama-3.1-8b
cluster: {gpu: h100-sxm, gpus_per_node: 1}
workload: {synthetic: {num_requests: 24, rate: 6}}
sim: {seed: 5}
"""


@pytest.fixture
def scenario(tmp_path: Path) -> Path:
    p = tmp_path / "s.yaml"
    p.write_text(SCENARIO)
    return p


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def _sweep(scenario: Path, out: Path, *axes: str, jobs: int = 1) -> int:
    return main(["sweep", str(scenario), *axes, "--out", str(out), "--jobs", str(jobs), "--no-progress"])


def test_grid_product_first_axis_slowest_and_zip_varies_together():
    f = [
        grid_factor("kv.format=bf16,fp8"),
        zip_factor(
            [parse_axis("scheduler.max_num_seqs=8,16", "--zip"), parse_axis("kv.block_size=16,32", "--zip")],
            "--zip",
            "--zip",
        ),
    ]
    points = expand(f)
    assert [p.overrides for p in points] == [
        ("kv.format=bf16", "scheduler.max_num_seqs=8", "kv.block_size=16"),
        ("kv.format=bf16", "scheduler.max_num_seqs=16", "kv.block_size=32"),
        ("kv.format=fp8", "scheduler.max_num_seqs=8", "kv.block_size=16"),
        ("kv.format=fp8", "scheduler.max_num_seqs=16", "kv.block_size=32"),
    ]
    assert points[2].id == "002-format=fp8,max_num_seqs=8,block_size=16"
    assert len({p.id for p in points}) == 4


def test_sweep_file_grid_zip_and_points(tmp_path: Path):
    f = tmp_path / "sweep.yaml"
    f.write_text(
        "grid: {kv.format: [bf16, fp8]}\n"
        "points:\n  - {scheduler.max_num_seqs: 8, kv.block_size: 32}\n  - {scheduler.max_num_seqs: 64}\n"
    )
    points = expand(load_sweep_file(str(f)))
    assert [p.overrides for p in points][:2] == [
        ("kv.format=bf16", "scheduler.max_num_seqs=8", "kv.block_size=32"),
        ("kv.format=bf16", "scheduler.max_num_seqs=64"),
    ]
    assert len(points) == 4


def test_bad_axis_is_refused_before_anything_runs(scenario: Path, tmp_path: Path, capsys):
    out = tmp_path / "out"
    code = _sweep(scenario, out, "--grid", "scheduler.max_num_seqs=8,16", "--grid", "kv.format=bf16,fp9")
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2 and len(err) == 1
    assert "--grid kv.format=fp9" in err[0] and "kv.format" in err[0]
    assert not out.exists()


def test_failed_point_is_recorded_and_the_others_complete(scenario: Path, tmp_path: Path, capsys):
    out = tmp_path / "out"
    # A host tier of 10,000 x the HBM pool passes validation and fails when the run has its memory
    # plan (the DRAM does not hold it): a run-time failure.
    code = _sweep(
        scenario,
        out,
        "--grid",
        "kv.offload.enabled=true",
        "--grid",
        "kv.offload.hbm_ratio=0.5,10000",
        "--grid",
        "kv.format=bf16,fp8",
        jobs=2,
    )
    assert code == 1
    rows = _rows(out / "results.csv")
    assert [r["status"] for r in rows] == ["ok", "ok", "failed", "failed"]
    assert "offload" in rows[2]["error"] and rows[0]["error"] == ""
    assert rows[0]["requests_completed"] == "24" and rows[2]["requests_completed"] == ""
    assert sorted(p.name for p in (out / "points").iterdir()) == [rows[0]["id"], rows[1]["id"]]


def _fail_index_1(index: int, overrides: tuple[str, ...]) -> None:
    if index == 1:
        raise RuntimeError("injected")


def test_an_internal_error_in_one_point_does_not_sink_the_sweep(scenario: Path, tmp_path: Path):
    plan = prepare_sweep(str(scenario), [grid_factor("scheduler.max_num_seqs=8,16,32")])
    out = tmp_path / "out"
    out.mkdir()
    outcome = run_sweep(plan, out, jobs=1, reuse=False, before_point=_fail_index_1)
    assert [r.status for r in outcome.results] == ["ok", "failed", "ok"]
    assert outcome.results[1].error == "internal error: RuntimeError: injected"
    assert outcome.failed == 1


def test_resume_skips_finished_points(scenario: Path, tmp_path: Path, capsys):
    out = tmp_path / "out"
    axes = ("--grid", "scheduler.max_num_seqs=8,16,32")
    assert _sweep(scenario, out, *axes) == 0
    first = (out / "results.csv").read_text()
    dirs = sorted((out / "points").iterdir())
    import shutil

    shutil.rmtree(dirs[1])  # as if interrupted while running point 1
    kept = {d.name: (d / "summary.json").stat().st_mtime_ns for d in (dirs[0], dirs[2])}
    capsys.readouterr()
    assert _sweep(scenario, out, *axes) == 0
    assert "2 reused" in capsys.readouterr().out
    assert {d.name: (d / "summary.json").stat().st_mtime_ns for d in (dirs[0], dirs[2])} == kept
    assert (dirs[1] / "summary.json").is_file()
    assert (out / "results.csv").read_text() == first
    # Another definition in the same folder is refused, unless --force.
    assert _sweep(scenario, out, "--grid", "scheduler.max_num_seqs=8,64") == 2
    assert "different set of points" in capsys.readouterr().err
    assert _sweep(scenario, out, "--grid", "scheduler.max_num_seqs=8,64", "--force") == 0
    assert len(list((out / "points").iterdir())) == 2
    # An edited scenario is another sweep too: nothing reused.
    scenario.write_text(SCENARIO.replace("seed: 5", "seed: 6"))
    plan = prepare_sweep(str(scenario), [grid_factor("scheduler.max_num_seqs=8,64")])
    assert resumable(plan, out, force=True) is False


def test_jobs_1_and_2_give_the_same_results(scenario: Path, tmp_path: Path):
    axes = ("--grid", "kv.format=bf16,fp8", "--grid", "scheduler.max_num_seqs=4,64")
    assert _sweep(scenario, tmp_path / "a", *axes, jobs=1) == 0
    assert _sweep(scenario, tmp_path / "b", *axes, jobs=2) == 0
    a, b = (tmp_path / "a" / "results.csv").read_text(), (tmp_path / "b" / "results.csv").read_text()
    assert a == b
    # the folder's lock: held by the parent only (forked workers close their copy), gone at the end
    assert not (tmp_path / "b" / ".kvsim.lock").exists()
    rows = _rows(tmp_path / "a" / "results.csv")
    assert len({r["ttft_p99_s"] for r in rows}) > 1  # the axes change the answer


def test_a_worker_reads_a_shared_workload_once(scenario: Path, tmp_path: Path):
    runner = PointRunner()
    for i, v in enumerate((8, 16)):
        r = runner(PointTask(i, str(scenario), (f"scheduler.max_num_seqs={v}",), tmp_path / f"p{i}"))
        assert r.status == "ok"
    assert runner.workload_reads == 1
    assert runner.cost_models_built == 1  # the same model, GPU and format: one cost model shared
    r = runner(PointTask(2, str(scenario), ("sim.seed=9",), tmp_path / "p2"))
    assert r.status == "ok" and runner.workload_reads == 2
    assert load_scenario(scenario, ("sim.seed=9",)).sim.seed == 9
    r = runner(PointTask(3, str(scenario), ("kv.format=fp8",), tmp_path / "p3"))
    assert r.status == "ok" and runner.cost_models_built == 2  # another format prices otherwise


def test_a_shared_measured_profile_gives_the_results_of_a_fresh_one(tmp_path: Path):
    # Pricing is pure, so a profile cost model shared between points prices each as a fresh one.
    from kvsim.run import run_scenario
    from tests.helpers import ROOT

    prof = ROOT / "tests/goldens/scenarios/profile_h200.yaml"
    runner = PointRunner()
    shared = [
        runner(PointTask(i, str(prof), (f"workload.max_requests={n}",), tmp_path / f"p{i}"))
        for i, n in enumerate((60, 90))
    ]
    assert runner.cost_models_built == 1
    fresh = metrics_of(run_scenario(load_scenario(prof, ("workload.max_requests=90",))).record)
    assert shared[1].metrics == fresh


def test_pareto_front_on_a_hand_made_table():
    # (cost, p99 TTFT): 0 and 3 trade off, 1 is beaten by 0, 2 equals 3, 4 has no latency.
    table = [(1.0, 5.0), (1.5, 6.0), (2.0, 1.0), (2.0, 1.0), (0.5, None), (3.0, 1.0), (0.9, 9.0)]
    assert pareto_front(table) == [True, False, True, True, False, False, True]
    assert pareto_front([]) == []


def test_pareto_front_ignores_differences_below_its_tolerance():
    # 0.4% dearer at the same latency, or 0.02% slower at the same cost: ties, both on the front;
    # 0.8% dearer at the same latency is dominated. Without the tolerance, only the first is on.
    table = [(1.0, 5.0), (1.004, 5.0), (1.0, 5.001), (1.008, 5.0)]
    assert PARETO_REL_TOL == 0.005
    assert pareto_front(table) == [True, True, True, False]
    assert pareto_front(table, rel_tol=0.0) == [True, False, False, False]


def test_pareto_front_in_three_objectives():
    # (cost, latency, accuracy loss): 1 is cheaper and faster than 0 but loses more accuracy, so
    # both are on the front; 2 is beaten by 0 in all three.
    table = [(1.0, 5.0, 0.0), (0.8, 4.0, 0.005), (1.2, 6.0, 0.005)]
    assert pareto_front(table) == [True, True, False]
    assert pareto_front([(c, t) for c, t, _ in table]) == [False, True, False]


def test_sweep_results_and_page_carry_the_accuracy_estimate(scenario: Path, tmp_path: Path):
    out = tmp_path / "out"
    assert _sweep(scenario, out, "--grid", "kv.format=bf16,fp8,int4") == 0
    est = [float(r["accuracy_loss_est"]) for r in _rows(out / "results.csv")]
    assert est == [0.0, 0.005, 0.005]  # a 4-bit format counts at least FP8's loss
    page = (out / "sweep.html").read_text()
    assert "accuracy loss (est.)" in page and "cited, not measured" in page and "Pareto (+ accuracy)" in page


def test_sweep_page_links_every_point(scenario: Path, tmp_path: Path):
    out = tmp_path / "out"
    assert _sweep(scenario, out, "--grid", "kv.format=bf16,fp8", "--grid", "scheduler.max_num_seqs=4,64") == 0
    page = (out / "sweep.html").read_text()
    for r in _rows(out / "results.csv"):
        assert (out / "points" / r["id"] / "report.html").is_file()
        assert f'href="points/{r["id"]}/report.html"' in page
    assert "Heatmap" in page or "heatmap" in page
    assert "Pareto front" in page and "than 0.5% (relative)" in page
    # One plotly.js for the folder: the sweep page and every point's page load it, none inlines it.
    assert page.count("<script src=") == 1 and '<script src="plotly.min.js"></script>' in page
    js = (out / "plotly.min.js").read_text()
    assert js.endswith(get_plotlyjs())
    for r in _rows(out / "results.csv"):
        point = (out / "points" / r["id"] / "report.html").read_text()
        assert '<script src="../../plotly.min.js"></script>' in point and get_plotlyjs()[:500] not in point
        assert not (out / "points" / r["id"] / "plotly.min.js").exists()
    assert page.count("texttemplate") == 2  # both heatmaps show their values in the cells
    before = page
    write_sweep_report(out)
    assert (out / "sweep.html").read_text() == before  # rebuilt from the files: same bytes


@pytest.mark.skipif(not CHROMIUM.exists(), reason="chromium is not installed (.ci/run installs it)")
def test_sweep_page_draws_its_charts_in_headless_chromium(scenario: Path, tmp_path: Path):
    # In a real browser, offline: plotly (inlined) must draw the two heatmaps and the Pareto chart,
    # and every point's link must be in the rendered page.
    out = tmp_path / "out"
    assert _sweep(scenario, out, "--grid", "kv.format=bf16,fp8", "--grid", "scheduler.max_num_seqs=4,64") == 0
    cmd = [
        *chromium_args(tmp_path / "profile", "--virtual-time-budget=5000", "--dump-dom"),
        (out / "sweep.html").resolve().as_uri(),
    ]
    dom = run_guarded(cmd, capture_output=True, text=True, check=False).stdout
    assert dom.count('class="main-svg"') >= 2  # plotly drew both figures (axes grid, Pareto)
    assert dom.count('class="hm"') == 2  # the two heatmaps (p99 TTFT, cost) hold drawn cells
    assert 'class="scatterlayer' in dom  # the Pareto chart's points
    for r in _rows(out / "results.csv"):
        assert f"points/{r['id']}/report.html" in dom


def test_results_parquet_holds_the_same_table_typed(scenario: Path, tmp_path: Path):
    pq = pytest.importorskip("pyarrow.parquet")
    out = tmp_path / "out"
    assert _sweep(scenario, out, "--grid", "kv.format=bf16,fp8") == 0
    table = pq.read_table(out / "results.parquet").to_pylist()
    rows = _rows(out / "results.csv")
    assert [r["index"] for r in table] == [int(r["index"]) for r in rows]
    for got, want in zip(table, rows, strict=True):
        assert got["id"] == want["id"] and got["status"] == want["status"]
        assert got["ttft_p99_s"] == pytest.approx(float(want["ttft_p99_s"]), rel=1e-12)
    # kvsim recognises its own table: a rerun may replace it; a foreign file of that name may not.
    assert _sweep(scenario, out, "--grid", "kv.format=bf16,fp8") == 0
    (out / "results.parquet").write_bytes(b"PAR1 someone else's data PAR1")
    assert _sweep(scenario, out, "--grid", "kv.format=bf16,fp8") == 2


def test_the_ray_executor_gives_the_local_results(scenario: Path, tmp_path: Path):
    # A local Ray instance (started by the sweep, 2 CPUs): the same points, the same table.
    pytest.importorskip("ray")
    local, on_ray = tmp_path / "local", tmp_path / "ray"
    axes = ("--grid", "kv.format=bf16,fp8", "--grid", "scheduler.max_num_seqs=4,64")
    assert _sweep(scenario, local, *axes) == 0
    assert (
        main(
            [
                "sweep",
                str(scenario),
                *axes,
                "--out",
                str(on_ray),
                "--jobs",
                "2",
                "--executor",
                "ray",
                "--no-progress",
            ]
        )
        == 0
    )
    assert (on_ray / "results.csv").read_text() == (local / "results.csv").read_text()
    for r in _rows(on_ray / "results.csv"):
        assert (on_ray / "points" / r["id"] / "report.html").is_file()


def test_ray_address_without_the_ray_executor_is_refused(scenario: Path, tmp_path: Path, capsys):
    rc = main(
        [
            "sweep",
            str(scenario),
            "--grid",
            "kv.format=bf16",
            "--out",
            str(tmp_path / "o"),
            "--ray-address",
            "x:1",
        ]
    )
    assert rc == 2 and "--ray-address: only with --executor ray" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_the_ray_executor_without_ray_installed_is_one_line(scenario: Path, tmp_path: Path):
    import sys
    import textwrap

    code = textwrap.dedent(
        f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] == 'ray':
                    raise ImportError('blocked: ' + name)
        sys.meta_path.insert(0, Block())
        from kvsim.cli import main
        sys.exit(main(["sweep", {str(scenario)!r}, "--grid", "kv.format=bf16", "--out",
                       {str(tmp_path / "o")!r}, "--executor", "ray", "--no-progress"]))
        """
    )
    proc = run_guarded([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert "--executor ray: needs Ray, which is not installed" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_a_points_report_rebuilt_keeps_loading_the_sweeps_plotly(scenario: Path, tmp_path: Path, capsys):
    out = tmp_path / "out"
    assert _sweep(scenario, out, "--grid", "kv.format=bf16,fp8") == 0
    point = out / "points" / _rows(out / "results.csv")[0]["id"]
    before = (point / "report.html").read_bytes()
    assert main(["report", str(point)]) == 0
    assert (point / "report.html").read_bytes() == before  # ../../plotly.min.js, as the sweep wrote it
    assert not (point / "plotly.min.js").exists()


def test_a_piped_sweep_prints_a_line_per_finished_point_on_stderr(scenario: Path, tmp_path: Path, capsys):
    """capsys is not a terminal: no bar, one plain line per point run (stderr, so that stdout holds
    only the summary); a re-run that reuses every point prints none, and so does --no-progress."""
    out = tmp_path / "o"
    argv = ["sweep", str(scenario), "--grid", "kv.format=bf16,fp8", "--grid", "kv.block_size=16,32"]
    assert main([*argv, "--out", str(out), "--jobs", "2"]) == 0
    captured = capsys.readouterr()
    lines = [ln for ln in captured.err.splitlines() if ln.startswith("point ")]
    assert len(lines) == 4 and captured.err.splitlines() == lines
    assert sorted(ln.split(" ")[1] for ln in lines) == ["1/4", "2/4", "3/4", "4/4"]
    assert all(" done (kv.format=" in ln and ", kv.block_size=" in ln and "after " in ln for ln in lines)
    assert all("ETA" in ln for ln in lines[:-1]) and "ETA" not in lines[-1]
    assert "point " not in captured.out
    assert main([*argv, "--out", str(out), "--jobs", "1"]) == 0  # every point reused
    assert "point " not in capsys.readouterr().err
    assert main([*argv, "--out", str(tmp_path / "quiet"), "--jobs", "1", "--no-progress"]) == 0
    assert capsys.readouterr().err == ""


def test_progress_draws_a_bar_on_a_terminal_and_lines_when_piped():
    import io

    from kvsim.progress import PointProgress

    for tty in (True, False):
        buf = io.StringIO()
        bar = PointProgress(3, tty=tty, stream=buf)
        bar.start()
        for k in range(3):
            bar.finished(f"kv.block_size={16 << k}", ok=k != 1)
        bar.stop()
        lines = [ln for ln in buf.getvalue().splitlines() if ln.startswith("point ")]
        assert (bar.done, bar.failed) == (3, 1)
        if tty:
            assert lines == []  # the bar, drawn and removed (transient)
        else:
            assert [ln.split(":")[0] for ln in lines] == [
                "point 1/3 done (kv.block_size=16)",
                "point 2/3 failed (kv.block_size=32)",
                "point 3/3 done (kv.block_size=64)",
            ]
    quiet = io.StringIO()
    off = PointProgress(2, enabled=False, stream=quiet, tty=False)
    off.start()
    off.finished("x", True)
    off.stop()
    assert quiet.getvalue() == ""


def test_a_points_csvs_are_compressed_and_hold_what_kvsim_run_writes(scenario: Path, tmp_path: Path):
    out = tmp_path / "out"
    assert _sweep(scenario, out, "--grid", "kv.format=fp8") == 0
    point = out / "points" / _rows(out / "results.csv")[0]["id"]
    assert not (point / "requests.csv").exists() and not (point / "timeseries.csv").exists()
    run = tmp_path / "run"
    assert main(["run", str(scenario), "--set", "kv.format=fp8", "--out", str(run), "--no-progress"]) == 0
    for name in ("requests.csv", "timeseries.csv"):
        assert gzip.decompress((point / f"{name}.gz").read_bytes()) == (run / name).read_bytes()
    # A comparison of two points reads them; `kvsim run` into a point leaves one form of each CSV.
    assert main(["report", str(point), str(run), "--out", str(tmp_path / "cmp.html")]) == 0
    assert "no usable requests.csv" not in (tmp_path / "cmp.html").read_text(encoding="utf-8")
    assert main(["run", str(scenario), "--set", "kv.format=fp8", "--out", str(point), "--no-progress"]) == 0
    assert (point / "requests.csv").is_file() and not (point / "requests.csv.gz").exists()

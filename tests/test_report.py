"""The HTML report, rebuilt from a hand-written run directory (tests/data/run_fixture)."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from plotly.offline import get_plotlyjs

from kvsim.errors import KvsimError
from kvsim.report import report_command, write_report
from kvsim.report.charts import (
    MAX_CDF_POINTS,
    MAX_POINTS,
    MAX_REPLICA_POINTS,
    MAX_SERIES_POINTS,
    _envelope,
    _latency_figures,
    _timeseries_figures,
)
from kvsim.report.data import _load_csv
from kvsim.report.outputs import check_output_dir, is_kvsim_output
from tests.helpers import CHROMIUM, chromium_args, run_guarded

FIXTURE = Path(__file__).parent / "data" / "run_fixture"


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    shutil.copytree(FIXTURE, d)
    return d


@pytest.fixture(scope="module")
def fixture_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_report(FIXTURE, tmp_path_factory.mktemp("report") / "report.html")


@pytest.fixture(scope="module")
def fixture_html(fixture_out: Path) -> str:
    return fixture_out.read_text(encoding="utf-8")


def test_report_shows_the_scenario_totals_and_percentiles(fixture_html: str):
    html = fixture_html
    assert "kvsim report: fixture-chat-2xh100" in html
    assert "50 = 46 completed + 2 rejected + 2 unfinished" in html
    assert "287.4 ms" in html  # p99 TTFT 0.2874 s
    assert "295.1 ms" in html  # p99.9 TTFT
    assert "another 3 in the trace had not arrived" in html
    assert "TTFT p99 287.4 ms ≤ 250.0 ms" in html
    assert "51,234 prompt + 6,210 output tokens" in html
    assert "hbm: 80 GB HBM3 (fixture)" in html  # one nested level of config shown as lines
    assert "written before summaries carried a schema version" in html  # the reader's note
    assert "sim_speed_x" not in html  # known extra: the report computes it from simulated and wall time
    assert "$0.447" in html
    assert "67.0 GiB of 80.0 GiB (83.8%)" in html
    assert "missed" in html and "met" in html  # TTFT p99 missed its 250 ms target, TPOT met
    assert "prompt_exceeds_kv_capacity" in html
    assert "Accuracy (estimate, not measured by the simulator)" in html
    assert "fixture_extra_key" in html  # unknown keys are shown, not rejected
    for div in ("kvsim-cdf", "kvsim-e2e", "kvsim-throughput", "kvsim-kv", "kvsim-queue"):
        assert f'id="{div}"' in html
    assert "requests.csv has" not in html  # row count agrees with the summary


def test_report_escapes_text_and_loads_plotly_from_the_file_beside_it(fixture_out: Path, fixture_html: str):
    html = fixture_html
    assert "(&lt;end_of_simulation&gt;)" in html
    assert "H100 &amp; fp8" in html
    assert "<end_of_simulation>" not in html
    # plotly.js is not inlined: one copy beside the page, loaded by a relative script src.
    assert html.count("<script src=") == 1 and '<script src="plotly.min.js"></script>' in html
    assert get_plotlyjs()[:500] not in html
    js = (fixture_out.parent / "plotly.min.js").read_text(encoding="utf-8")
    assert js.endswith(get_plotlyjs()) and js.count(get_plotlyjs()[:500]) == 1
    assert is_kvsim_output(fixture_out.parent / "plotly.min.js")


def test_report_is_deterministic(run_dir: Path, tmp_path: Path):
    a = write_report(run_dir, tmp_path / "a.html").read_bytes()
    b = write_report(run_dir, tmp_path / "b.html").read_bytes()
    assert a == b


def test_report_default_path_and_command(run_dir: Path, capsys: pytest.CaptureFixture[str]):
    assert report_command(str(run_dir)) == 0
    assert (run_dir / "report.html").is_file()
    assert "report.html" in capsys.readouterr().out


def test_report_builds_without_optional_files_and_keys(run_dir: Path):
    (run_dir / "timeseries.csv").unlink()
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("accuracy", "warnings", "workload", "replica_busy_fraction"):  # the record's optional fields
        del summary[key]
    del summary["requests"]["not_arrived"]
    (run_dir / "summary.json").write_text(json.dumps(summary))
    html = write_report(run_dir).read_text(encoding="utf-8")
    assert "timeseries.csv not found" in html
    assert 'id="kvsim-cdf"' in html and 'id="kvsim-kv"' not in html
    assert "Accuracy (estimate" not in html
    assert "50 = 46 completed" in html


def test_report_refuses_a_summary_missing_a_required_field(run_dir: Path):
    summary = json.loads((run_dir / "summary.json").read_text())
    del summary["slo"]["tpot_met"]
    (run_dir / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(KvsimError) as exc:
        write_report(run_dir)
    assert str(exc.value).endswith("summary.json: slo.tpot_met: missing")


def test_report_without_any_csv_has_no_plotly(run_dir: Path):
    (run_dir / "timeseries.csv").unlink()
    (run_dir / "requests.csv").unlink()
    html = write_report(run_dir).read_text(encoding="utf-8")
    assert "requests.csv not found" in html
    assert "plotly" not in html.lower()


def test_report_flags_inconsistent_counts(run_dir: Path):
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["requests"]["total"] = 51
    (run_dir / "summary.json").write_text(json.dumps(summary))
    html = write_report(run_dir).read_text(encoding="utf-8")
    assert "requests do not add up" in html
    assert "requests.csv has 50 rows but summary.json counts 51 requests" in html


def test_report_errors_name_the_missing_file(tmp_path: Path):
    with pytest.raises(KvsimError, match="run directory not found"):
        report_command(str(tmp_path / "nope"))
    with pytest.raises(KvsimError) as exc:
        write_report(tmp_path)
    assert "summary.json" in str(exc.value) and "\n" not in str(exc.value)


def test_report_rejects_a_non_number_in_a_csv(run_dir: Path):
    path = run_dir / "requests.csv"
    lines = path.read_text().splitlines()
    fields = lines[1].split(",")
    fields[2] = "soon"  # arrival_s
    lines[1] = ",".join(fields)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(KvsimError, match="line 2.*arrival_s"):
        write_report(run_dir)


@pytest.mark.skipif(not CHROMIUM.exists(), reason="chromium is not installed (.ci/run installs it)")
def test_report_renders_in_headless_chromium(tmp_path: Path):
    html = write_report(FIXTURE, tmp_path / "report.html")
    png = tmp_path / "report.png"
    cmd = [
        *chromium_args(tmp_path / "profile"),
        f"--screenshot={png}",
        "--window-size=1200,2400",
        "--virtual-time-budget=3000",  # let plotly draw before the screenshot
        html.resolve().as_uri(),
    ]
    run_guarded(cmd, capture_output=True, check=False)
    assert png.is_file()
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 50_000  # a blank 1200x2400 page compresses to a few kB


def test_headline_says_how_the_hbm_peak_adds_up(tmp_path: Path):
    from kvsim.cli import main

    sc = tmp_path / "s.yaml"
    sc.write_text(
        "model: llama-3.1-8b\ncluster: {gpu: h100-sxm, gpus_per_node: 1}\n"
        "workload: {synthetic: {num_requests: 16, rate: 6}}\nsim: {seed: 4}\n"
    )
    assert main(["run", str(sc), "--out", str(tmp_path / "r"), "--no-progress"]) == 0
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    reserve = s["memory_plan"]["activation_reserve_bytes"]
    held = (s["hbm_peak_bytes"] - s["weight_bytes_per_gpu"] - reserve) / s["kv_block_bytes"]
    assert held == int(held) and held >= s["kv_peak_used_blocks"]
    html = (tmp_path / "r" / "report.html").read_text(encoding="utf-8")
    assert f"+ {int(held):,} KV blocks held" in html
    assert "cached for prefix reuse (free to evict) as well as those in use" in html
    assert f"at most {s['kv_peak_used_blocks']:,} in use by requests at once" in html
    # ITL beside TPOT in the latency table, as the terminal summary shows it.
    assert "<td>TPOT (per request)</td>" in html and "<td>ITL (per token)</td>" in html


def test_report_command_replaces_only_its_own_plotly_file(run_dir: Path):
    js = run_dir / "plotly.min.js"
    js.write_text("/* a plotly.js kvsim did not write */\n")
    with pytest.raises(KvsimError, match="plotly.min.js exists and was not written by kvsim; use --force"):
        report_command(str(run_dir))
    assert not (run_dir / "report.html").exists()
    assert report_command(str(run_dir), force=True) == 0
    assert is_kvsim_output(js) and js.read_text(encoding="utf-8").endswith(get_plotlyjs())
    assert report_command(str(run_dir)) == 0  # its own file, now: replaced without --force


def _gzip(path: Path) -> Path:
    """`path` replaced by its .gz form, as a sweep's point holds it."""
    gz = path.with_name(path.name + ".gz")
    gz.write_bytes(gzip.compress(path.read_bytes(), mtime=0))
    path.unlink()
    return gz


def test_report_reads_a_points_compressed_csvs(run_dir: Path, tmp_path: Path):
    plain = write_report(run_dir, tmp_path / "plain.html").read_bytes()
    for name in ("requests.csv", "timeseries.csv"):
        assert is_kvsim_output(_gzip(run_dir / name))
    assert write_report(run_dir, tmp_path / "gz.html").read_bytes() == plain


def test_a_foreign_or_broken_csv_gz_is_not_kvsims(tmp_path: Path):
    foreign = tmp_path / "requests.csv.gz"
    foreign.write_bytes(gzip.compress(b"a,b\n1,2\n"))
    assert not is_kvsim_output(foreign)
    (tmp_path / "timeseries.csv.gz").write_bytes(b"not gzip")
    assert not is_kvsim_output(tmp_path / "timeseries.csv.gz")
    with pytest.raises(KvsimError, match="requests.csv.gz exists and was not written by kvsim; use --force"):
        check_output_dir(str(tmp_path), reads=(), force=False)
    assert check_output_dir(str(tmp_path), reads=(), force=True) == tmp_path


def test_envelope_keeps_every_buckets_extremes_within_its_cap():
    rng = np.random.default_rng(3)
    t = np.sort(rng.random(50_000) * 1_000)
    a = rng.integers(0, 30, t.size).astype(float)
    a[12_345] = 500.0  # one spike, one sample wide
    b = np.cumsum(rng.normal(size=t.size))
    for cap in (10, 101, MAX_SERIES_POINTS):
        keep = _envelope(t, (a, b), cap)
        assert keep.size <= cap and keep[0] == 0 and keep[-1] == t.size - 1
        assert 12_345 in keep and a[keep].min() == a.min() and b[keep].max() == b.max()
    assert np.array_equal(_envelope(t[:50], (a[:50],), 50), np.arange(50))  # few enough: all


def test_charts_of_a_large_run_plot_a_bounded_number_of_points(tmp_path: Path):
    rng = np.random.default_rng(1)
    n = 30_000
    arrival = np.sort(rng.random(n) * 3_600)
    first = arrival + rng.exponential(0.2, n)
    finish = first + rng.exponential(5.0, n)
    finish[777] = first[777] + 900.0  # the slowest request
    with (tmp_path / "requests.csv").open("w") as f:
        f.write("arrival_s,first_token_s,finish_s,output_tokens,status\n")
        for row in zip(arrival, first, finish, rng.integers(2, 500, n), strict=True):
            f.write(f"{row[0]:.9f},{row[1]:.9f},{row[2]:.9f},{row[3]},completed\n")
    with (tmp_path / "timeseries.csv").open("w") as f:
        f.write("t_s,replica,kv_used_blocks,kv_cached_blocks,kv_free_blocks,running,waiting\n")
        for r in range(3):
            for i, t in enumerate(np.sort(rng.random(8_000) * 3_600)):
                used = 9_000 if (r, i) == (1, 4_000) else int(rng.integers(0, 1_000))
                f.write(f"{t:.6f},{r},{used},{1_000 - used % 1_000},{9_000 - used},{i % 7},{i % 3}\n")
    requests, ts = _load_csv(tmp_path / "requests.csv"), _load_csv(tmp_path / "timeseries.csv")
    assert requests is not None and ts is not None
    figs = dict(_latency_figures(requests, {})[0]) | dict(_timeseries_figures(ts)[0])
    for trace in figs["cdf"].data:
        assert len(trace.x) <= MAX_CDF_POINTS and trace.y[-1] == 1.0
    (e2e,) = figs["e2e"].data
    assert len(e2e.x) <= MAX_POINTS and max(e2e.y) == np.float32(finish[777] - arrival[777])
    assert len(figs["kv"].data) == 4 * 3  # the sum and each of 3 replicas, 3 layers each
    for trace in (*figs["kv"].data, *figs["queue"].data):
        assert len(trace.x) <= MAX_SERIES_POINTS
    for trace in figs["kv"].data[3:]:
        assert len(trace.x) <= MAX_REPLICA_POINTS
    assert max(figs["kv"].data[0].y) >= 9_000  # the sum keeps replica 1's one-sample spike
    assert max(figs["kv"].data[2 * 3].y) == 9_000  # and so does replica 1's own view

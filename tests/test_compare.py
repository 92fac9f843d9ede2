"""kvsim report A B --out FILE.html: two runs side by side, deltas from the summaries, escaped
names, provenance hashes, and bad inputs refused before anything is written."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
from plotly.offline import get_plotlyjs

from kvsim.cli import main
from kvsim.report.compare import METRICS, compare_page, compare_title, differences, run_labels
from kvsim.report.outputs import is_kvsim_output
from kvsim.report.tables import _get

SCENARIO = """\
name: {name}
model: llama-3.1-8b
cluster: {{gpu: h100-sxm, gpus_per_node: 1}}
workload: {{synthetic: {{num_requests: 16, rate: 6}}}}
sim: {{seed: 3}}
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("cmp")
    out = []
    for name, fmt in (("bf16-run", "bf16"), ("<script>alert(1)</script>", "fp8")):
        sc = root / f"{fmt}.yaml"
        sc.write_text(SCENARIO.format(name=json.dumps(name)))
        d = root / fmt
        argv = ["run", str(sc), "--set", f"kv.format={fmt}", "--out", str(d), "--no-progress"]
        assert main(argv) == 0
        out.append(d)
    return out[0], out[1]


def test_comparison_shows_both_runs_and_their_real_deltas(runs: tuple[Path, Path], tmp_path: Path):
    a, b = runs
    out = tmp_path / "cmp.html"
    assert main(["report", str(a), str(b), "--out", str(out)]) == 0
    page = out.read_text()
    assert page.startswith("<!doctype html>") and "<title>kvsim compare: " in page
    assert "bf16-run" in page
    # The name is user-supplied: escaped in the text, never a live script tag (plotly's JSON too).
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<script>alert(1)" not in page
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in runs)
    got = [float(x) for x in re.findall(r'data-delta="([^"]+)"', page)]
    want = [
        float(_get(sb, *k)) - float(_get(sa, *k))
        for _, k, _ in METRICS
        if isinstance(_get(sa, *k), int | float) and isinstance(_get(sb, *k), int | float)
    ]
    assert len(got) == len(want) == len(METRICS)
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert any(d != 0 for d in got)  # fp8 vs bf16 moves something (HBM peak at least)
    rel = [float(x) for x in re.findall(r'data-rel="([^"]+)"', page)]
    hbm = next(m for m, (lab, *_) in enumerate(METRICS) if lab == "HBM peak")
    assert rel[hbm] == pytest.approx(sb["hbm_peak_bytes"] / sa["hbm_peak_bytes"] - 1)
    # Provenance: each summary.json's SHA-256, a synthetic trace has no file to hash, the version.
    for d in runs:
        assert hashlib.sha256((d / "summary.json").read_bytes()).hexdigest() in page
    assert "Compared by kvsim " in page and "none (analytic cost model)" in page
    # Three figures: the CDFs, KV blocks in use, the queues.
    assert page.count('class="plotly-graph-div"') == 3
    # Rebuilt from the same files: the same bytes; and our own page may be replaced without --force.
    assert main(["report", str(a), str(b), "--out", str(out)]) == 0
    assert out.read_text() == page


def test_trace_hash_or_not_found(runs: tuple[Path, Path], tmp_path: Path):
    a, b = runs
    trace = tmp_path / "t.jsonl"
    trace.write_text("x\n")
    s = json.loads((b / "summary.json").read_text())
    moved = tmp_path / "moved"
    moved.mkdir()
    for name in ("requests.csv", "timeseries.csv"):
        (moved / name).write_bytes((b / name).read_bytes())
    s["config"]["trace"] = str(trace)
    (moved / "summary.json").write_text(json.dumps(s))
    page, _ = compare_page([str(a), str(moved)])
    assert hashlib.sha256(b"x\n").hexdigest() in page
    trace.unlink()
    page, _ = compare_page([str(a), str(moved)])
    assert "not found" in page


@pytest.mark.parametrize(
    "case",
    [
        "not_a_run",
        "twice",
        "out_is_summary",
        "out_is_report",
        "out_is_dir",
        "foreign",
        "foreign_plotly",
        "not_html",
    ],
)
def test_bad_inputs_exit_2_and_write_nothing(runs: tuple[Path, Path], tmp_path: Path, capsys, case: str):
    a, b = runs
    (tmp_path / "empty").mkdir()
    (tmp_path / "mine.html").write_text("<html>mine</html>")
    (tmp_path / "js").mkdir()
    (tmp_path / "js" / "plotly.min.js").write_text("/* someone else's plotly */\n")
    argv = {
        "not_a_run": [str(a), str(tmp_path / "empty"), "--out", str(tmp_path / "c.html")],
        "twice": [str(a), str(a) + "/", "--out", str(tmp_path / "c.html")],
        "out_is_summary": [str(a), str(b), "--out", str(a / "summary.json")],
        "out_is_report": [str(a), str(b), "--out", str(b / "report.html"), "--force"],
        "out_is_dir": [str(a), str(b), "--out", str(tmp_path / "empty")],
        "foreign": [str(a), str(b), "--out", str(tmp_path / "mine.html")],
        # The page's plotly.js goes beside it: a file of that name kvsim did not write stays.
        "foreign_plotly": [str(a), str(b), "--out", str(tmp_path / "js" / "c.html")],
        "not_html": [str(a), str(b), "--out", str(tmp_path / "c.txt")],
    }[case]
    before = {p: p.read_bytes() for d in (a, b, tmp_path) for p in d.rglob("*") if p.is_file()}
    assert main(["report", *argv]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "error" in err[0]
    after = {p: p.read_bytes() for d in (a, b, tmp_path) for p in d.rglob("*") if p.is_file()}
    assert after == before


def test_the_page_says_what_differs_and_labels_each_run_by_it(runs: tuple[Path, Path], tmp_path: Path):
    a, b = runs
    out = tmp_path / "c" / "cmp.html"
    assert main(["report", str(a), str(b), "--out", str(out)]) == 0
    page = out.read_text()
    assert "<h2>What differs between the runs</h2>" in page
    # The override and the config value it set, per run; the cost model shown though alike.
    assert "<tr><td>--set kv.format</td><td>bf16</td><td>fp8</td></tr>" in page
    assert "<td>kv_format</td><td>bf16</td><td>fp8_e4m3/per_tensor</td>" in page
    assert "cost model (the same for every run)" in page
    # Labelled by scenario (they differ) and the differing override, in the title and headline.
    assert "<title>kvsim compare: bf16-run: kv.format=bf16 vs &lt;script&gt;" in page
    assert "A: bf16-run: kv.format=bf16" in page
    # One plotly.js beside the page, loaded from there.
    assert '<script src="plotly.min.js"></script>' in page and is_kvsim_output(out.parent / "plotly.min.js")
    assert get_plotlyjs()[:500] not in page


def test_runs_of_one_scenario_are_labelled_by_their_overrides_not_its_name():
    def summary(*overrides: str, **config: object) -> dict[str, object]:
        return {"scenario": "chat", "config": {"overrides": list(overrides), "seed": 1, **config}}

    runs = [
        summary("kv.format=bf16", kv_format="bf16"),
        summary("kv.format=fp8", "workload.rate_scale=4", kv_format="fp8", rate_scale=4.0),
    ]
    labels = run_labels(runs)
    assert labels == ["kv.format=bf16", "kv.format=fp8, workload.rate_scale=4"]
    assert compare_title(labels, runs) == "chat: kv.format=bf16 vs kv.format=fp8, workload.rate_scale=4"
    rows = dict(differences(runs))
    assert rows["--set workload.rate_scale"] == ["–", "4"] and rows["rate_scale"] == ["–", "4.0"]
    assert "seed" not in rows and "--set kv.format" in rows
    # No overrides at all: the config fields that differ name them.
    plain = [summary(cost_model="analytic"), summary(cost_model="profile:p.json")]
    assert run_labels(plain) == ["cost_model=analytic", "cost_model=profile:p.json"]
    assert next(iter(differences(plain))) == ("cost model", ["analytic", "profile:p.json"])

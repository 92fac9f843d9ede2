"""kvsim plan: bisection over the replica count finds what brute force finds with fewer runs, the
cheapest meeting configuration is chosen, runners-up say why they lost, a search that cannot meet
the SLOs says so (exit 3) with the closest, bad flags are refused before any run, and a re-run
reuses its points; one seed gives one plan.json at any --jobs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvsim.cli import main
from kvsim.report.plan import write_plan_report
from kvsim.spec.hardware import load_gpu
from kvsim.sweep.local import PointRunner, PointTask
from kvsim.sweep.plan import (
    misses,
    parse_loads,
    parse_search,
    parse_slo,
    plan_resumable,
    prepare_plan,
    run_plan,
)

SCENARIO = """\
model: llama-3.1-8b
cluster: {gpu: h100-sxm, gpus_per_node: 1}
workload:
  synthetic: {num_requests: 40, rate: 40, input: {dist: constant, mean: 2048}, output: {dist: constant, mean: 32}}
sim: {seed: 5}
"""


@pytest.fixture
def scenario(tmp_path: Path) -> Path:
    p = tmp_path / "s.yaml"
    p.write_text(SCENARIO)
    return p


def _plan(scenario: Path, out: Path, *flags: str, jobs: int = 1) -> int:
    return main(["plan", str(scenario), *flags, "--out", str(out), "--jobs", str(jobs), "--no-progress"])


def _data(out: Path) -> dict[str, Any]:
    data = json.loads((out / "plan.json").read_text())
    assert isinstance(data, dict)
    return data


def test_bisection_finds_the_brute_force_minimum_with_fewer_runs(scenario: Path, tmp_path: Path):
    slos = [parse_slo("ttft_p99=300ms")]
    planner = prepare_plan(str(scenario), slos, [parse_search("cluster.nodes=1..8")], (1.0,), 0.0)
    # Brute force: every count.
    runner = PointRunner()
    meets = []
    for n in range(1, 9):
        o = planner.point_overrides(planner.combos[0], str(n), 1.0)
        meets.append(not misses(planner, runner(PointTask(n, str(scenario), o, tmp_path / f"bf{n}"))))
    assert meets == sorted(meets), "latency is not monotone in the count here"
    smallest = meets.index(True) + 1
    assert 1 < smallest < 8  # an interior answer, so that bisection has work to do
    out = tmp_path / "plan"
    out.mkdir()
    data = run_plan(planner, out, jobs=1, reuse=False)
    assert data["choice"]["count"] == str(smallest)
    assert data["points_run"] < 8
    assert data["points_run"] == len(list((out / "points").iterdir()))


def test_the_cheapest_meeting_configuration_is_chosen_across_gpus(scenario: Path, tmp_path: Path):
    out = tmp_path / "plan"
    flags = (
        "--slo",
        "ttft_p99=300ms",
        "--slo",
        "tpot_p99=30ms",
        "--search",
        "cluster.gpu=h100-sxm,h200-sxm,a100-80gb",
    )
    assert _plan(scenario, out, *flags, "--search", "cluster.nodes=1..8", jobs=2) == 0
    data = _data(out)
    configs = data["configurations"]
    for e in configs:
        gpu = next(o.split("=", 1)[1] for o in e["overrides"] if o.startswith("cluster.gpu="))
        assert e["gpu_hour_usd"] == load_gpu(gpu).usd_per_hour
        assert e["usd_per_hour"] == pytest.approx(e["gpus"] * e["gpu_hour_usd"])
    meeting = [e for e in configs if e["meets"]]
    assert len({e["combo"] for e in meeting}) >= 2  # a real choice between GPUs
    assert data["choice"]["usd_per_hour"] == min(e["usd_per_hour"] for e in meeting)
    losers = [r for r in data["runners_up"] if r["meets"]]
    assert losers and all(
        "costs $" in r["why"] and r["usd_per_hour"] > data["choice"]["usd_per_hour"] for r in losers
    )
    # The same configuration one replica smaller is a runner-up that names the SLO it misses.
    below = data["runners_up"][0]
    assert (
        below["combo"] == data["choice"]["combo"] and int(below["count"]) == int(data["choice"]["count"]) - 1
    )
    w = below["worst_miss"]
    assert w["what"] in ("ttft_p99", "tpot_p99") and w["what"] in below["why"] and "ms >" in below["why"]
    metric = next(ld for ld in below["loads"] if ld["load"] == w["load"])["metrics"][f"{w['what']}_s"]
    assert w["value"] == metric and metric > w["bound"]
    # plan.html: the choice, each runner-up's reason, every point's report linked; rebuilt, same bytes.
    page = (out / "plan.html").read_text()
    assert "Choice" in page and below["why"].split(" (")[0] in page.replace("&gt;", ">")
    for e in configs:
        for ld in e["loads"]:
            if ld["evaluated"]:
                assert (out / "points" / ld["point"] / "report.html").is_file()
                assert f'href="points/{ld["point"]}/report.html"' in page
    write_plan_report(out)
    assert (out / "plan.html").read_text() == page
    rows = (out / "plan.csv").read_text().splitlines()
    assert len(rows) == 1 + sum(ld["evaluated"] for e in configs for ld in e["loads"])


TINY = """\
model: llama-3.1-8b
cluster: {gpu: h100-sxm, gpus_per_node: 1}
workload:
  synthetic: {num_requests: 4, rate: 4, input: {dist: constant, mean: 128}, output: {dist: constant, mean: 4}}
"""


def _tiny_plan(tmp_path: Path, pricing: str, gpus: str, capsys) -> tuple[dict[str, Any], str, str]:
    """A one-load plan over `gpus` of TINY with `pricing` appended: (plan.json, page, terminal)."""
    (tmp_path / "s.yaml").write_text(TINY + pricing)
    out = tmp_path / "plan"
    assert _plan(tmp_path / "s.yaml", out, "--slo", "e2e_p99=60s", "--search", f"cluster.gpu={gpus}") == 0
    terminal = capsys.readouterr().out
    page = (out / "plan.html").read_text().replace("&#39;", "'")
    return _data(out), page, terminal


def _by_gpu(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["overrides"][0].split("=", 1)[1]: e for e in data["configurations"]}


def test_each_searched_gpu_is_priced_at_its_presets_sourced_rate(tmp_path: Path, capsys):
    data, page, _ = _tiny_plan(tmp_path, "", "h100-sxm,a100-80gb", capsys)
    rows = _by_gpu(data)
    assert set(rows) == {"h100-sxm", "a100-80gb"}
    for gpu, e in rows.items():
        preset = load_gpu(gpu)
        assert (e["gpu_hour_usd"], e["gpu_hour_basis"]) == (preset.usd_per_hour, "preset")
        assert e["gpu_hour_source"] == f"{gpu} preset: {preset.price_source}"
        assert e["gpu_hour_source"] in page
        point = tmp_path / "plan" / "points" / e["loads"][0]["point"] / "summary.json"
        summary = json.loads(point.read_text())  # the run prices as the plan does
        assert summary["config"]["gpu_hour_usd"] == preset.usd_per_hour
        assert summary["config"]["sources"]["price"].endswith(preset.price_source)
    assert rows["h100-sxm"]["gpu_hour_usd"] != rows["a100-80gb"]["gpu_hour_usd"]
    assert "public price surveys May 2026" in rows["h100-sxm"]["gpu_hour_source"]
    assert "estimate: no listed source" in rows["a100-80gb"]["gpu_hour_source"]
    assert data["warnings"] == []
    rows_csv = (tmp_path / "plan" / "plan.csv").read_text().splitlines()
    assert "gpu_hour_source" in rows_csv[0].split(",") and len(rows_csv) == 3


def test_a_per_gpu_price_map_beats_the_scenario_wide_price_which_is_a_warning(tmp_path: Path, capsys):
    pricing = 'pricing: {gpu_hour: 2.0, gpu_hour_by_gpu: {h200: "$4.50/h"}}\n'
    data, page, terminal = _tiny_plan(tmp_path, pricing, "h100-sxm,h200-sxm,a100-80gb", capsys)
    rows = _by_gpu(data)
    h100, h200, a100 = rows["h100-sxm"], rows["h200-sxm"], rows["a100-80gb"]
    assert (h200["gpu_hour_usd"], h200["gpu_hour_basis"]) == (4.5, "gpu_map")
    assert (
        h200["gpu_hour_source"] == "pricing.gpu_hour_by_gpu.h200 (s.yaml)" and h200["price_warning"] is None
    )
    # The scenario's own GPU takes the scenario-wide price silently; another GPU type, with a warning.
    assert (h100["gpu_hour_usd"], h100["gpu_hour_basis"], h100["price_warning"]) == (2.0, "scenario", None)
    assert (a100["gpu_hour_usd"], a100["gpu_hour_basis"]) == (2.0, "scenario")
    warning = a100["price_warning"]
    assert "given for the scenario's h100-sxm, also prices a100-80gb" in warning
    assert data["warnings"] == [warning]
    assert f"warning: {warning}" in terminal and warning in page
    for e in rows.values():
        assert e["usd_per_hour"] == pytest.approx(e["gpus"] * e["gpu_hour_usd"])
        assert e["gpu_hour_source"] in page
    point = tmp_path / "plan" / "points" / a100["loads"][0]["point"] / "summary.json"
    assert warning in json.loads(point.read_text())["warnings"]  # kvsim run says so too


def test_a_piped_plan_prints_a_line_per_point_run_with_a_bound_on_the_total(
    scenario: Path, tmp_path: Path, capsys
):
    """capsys is not a terminal: one plain line per point run, on stderr; the total is a bound
    (<=N) while bisection may stop early; --no-progress prints none."""
    flags = ["--slo", "ttft_p99=300ms", "--search", "cluster.nodes=1..8", "--out", str(tmp_path / "p")]
    assert main(["plan", str(scenario), *flags, "--jobs", "1"]) == 0
    captured = capsys.readouterr()
    lines = [ln for ln in captured.err.splitlines() if ln.startswith("point ")]
    assert captured.err.splitlines() == lines and "point " not in captured.out
    ran = len(list((tmp_path / "p" / "points").iterdir()))
    assert len(lines) == ran and ran < 8
    assert [ln.split(" ")[1].split("/")[0] for ln in lines] == [str(k) for k in range(1, ran + 1)]
    assert lines[0].startswith("point 1/<=") and "(cluster.nodes=8, load 1x)" in lines[0]
    assert all(" done (cluster.nodes=" in ln for ln in lines)
    assert _plan(scenario, tmp_path / "q", "--slo", "ttft_p99=300ms", "--search", "cluster.nodes=1..8") == 0
    assert capsys.readouterr().err == ""


def test_no_feasible_configuration_says_so_with_the_closest(scenario: Path, tmp_path: Path, capsys):
    out = tmp_path / "plan"
    code = _plan(scenario, out, "--slo", "ttft_p99=1ms", "--search", "cluster.nodes=1..4", "--load", "1x,2x")
    assert code == 3
    captured = capsys.readouterr()
    text = captured.out
    assert captured.err.splitlines() == ["kvsim plan: no configuration meets ttft_p99=1ms at 1x, 2x (exit 3)"]
    assert "no configuration in the search meets ttft_p99=1ms" in text and "closest:" in text
    data = _data(out)
    assert data["choice"] is None and data["runners_up"] == []
    closest = data["closest"]
    assert closest["count"] == "4" and "ttft_p99" in closest["why"]
    assert len(list((out / "points").iterdir())) == 2  # only the top of the range, at each load
    assert "No configuration meets the SLOs" in (out / "plan.html").read_text()


def test_rejected_requests_fail_an_slo_unless_allowed(scenario: Path, tmp_path: Path):
    # Lognormal prompts around 64K tokens: some exceed the model's 128K context and are rejected.
    scenario.write_text(
        SCENARIO.replace("{dist: constant, mean: 2048}", "{dist: lognormal, mean: 65536, stdev: 60000}")
    )
    found = {}
    for allowed in (0.0, 0.5):
        planner = prepare_plan(str(scenario), [parse_slo("e2e_p99=1h")], [], (1.0,), allowed)
        out = tmp_path / f"a{allowed}"
        out.mkdir()
        found[allowed] = run_plan(planner, out, jobs=1, reuse=False)
    strict = found[0.0]
    assert strict["choice"] is None
    miss = strict["closest"]["worst_miss"]
    assert miss["what"] == "unserved" and 0 < miss["value"] < 0.5 and "rejected or unfinished" in miss["text"]
    assert found[0.5]["choice"] is not None


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (("--slo", "ttft_p98=2s"), "--slo: unknown SLO metric 'ttft_p98'"),
        (("--slo", "ttft_p99=2"), "--slo: ttft_p99: expected a duration with its unit"),
        (("--slo", "ttft_p99=-1s"), "--slo: ttft_p99: expected a duration with its unit"),
        (
            ("--slo", "ttft_p99=2s", "--search", "cluster.nodes=8..1"),
            "--search: cluster.nodes: expected 1 <= lo <= hi",
        ),
        (
            ("--slo", "ttft_p99=2s", "--search", "cluster.nodes=1..x"),
            "--search: cluster.nodes: expected an integer range",
        ),
        (
            ("--slo", "ttft_p99=2s", "--search", "cluster.gpus_per_node=1..65"),
            "--search cluster.gpus_per_node=65",
        ),
        (("--slo", "ttft_p99=2s", "--search", "kv.format=bf16,fp9"), "--search kv.format=fp9"),
        (("--slo", "ttft_p99=2s", "--load", "2"), "--load: expected loads such as 1x"),
        (("--slo", "ttft_p99=2s", "--load", "0x"), "--load: expected loads such as 1x"),
        (("--slo", "ttft_p99=2s", "--load", "1x,1e-12x"), "--load 1e-12x: synthetic: the last arrival lands"),
        (("--search", "cluster.nodes=1..4"), "give at least one --slo"),
    ],
)
def test_bad_flags_are_refused_before_any_run(scenario: Path, tmp_path: Path, capsys, flags, error):
    out = tmp_path / "plan"
    assert _plan(scenario, out, *flags) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and error in err[0], err
    assert not out.exists()


def test_parsers():
    assert parse_loads("1x, 2x,0.5x") == (1.0, 2.0, 0.5)
    assert parse_slo("tpot_p90=50ms").bound_s == pytest.approx(0.05)
    axis = parse_search("cluster.gpus_per_node=1..4")
    assert axis.count and axis.values == ("1", "2", "3", "4")
    assert not parse_search("cluster.nodes=1,2,4").count


def test_resume_reuses_runs_and_jobs_do_not_change_the_plan(scenario: Path, tmp_path: Path, capsys):
    flags = ("--slo", "ttft_p99=300ms", "--search", "kv.format=bf16,fp8", "--search", "cluster.nodes=1..6")
    a, b = tmp_path / "a", tmp_path / "b"
    assert _plan(scenario, a, *flags, jobs=1) == 0
    assert _plan(scenario, b, *flags, jobs=2) == 0
    first = (a / "plan.json").read_text()
    assert first == (b / "plan.json").read_text()
    assert (a / "plan.csv").read_text() == (b / "plan.csv").read_text()
    points = sorted((a / "points").iterdir())
    shutil.rmtree(points[0])  # as if interrupted while running it
    kept = {p.name: (p / "summary.json").stat().st_mtime_ns for p in points[1:]}
    capsys.readouterr()
    assert _plan(scenario, a, *flags) == 0
    assert f"1 points run, {len(points) - 1} reused" in capsys.readouterr().out
    assert {p.name: (p / "summary.json").stat().st_mtime_ns for p in points[1:]} == kept
    assert (a / "plan.json").read_text() == first
    # Another scenario's plan in the folder is refused unless --force.
    scenario.write_text(SCENARIO.replace("seed: 5", "seed: 6"))
    assert _plan(scenario, a, *flags) == 2
    assert "plan of another scenario" in capsys.readouterr().err
    planner = prepare_plan(str(scenario), [parse_slo("ttft_p99=300ms")], [], (1.0,), 0.0)
    assert plan_resumable(planner, a, force=True) is False and not (a / "points").exists()


def test_an_accuracy_budget_changes_the_answer_and_says_why(scenario: Path, tmp_path: Path, capsys):
    flags = (
        "--slo",
        "ttft_p99=300ms",
        "--search",
        "kv.format=fp8,int4,bf16",
        "--search",
        "cluster.nodes=1..4",
    )
    assert _plan(scenario, tmp_path / "free", *flags) == 0
    free = _data(tmp_path / "free")
    capsys.readouterr()
    assert _plan(scenario, tmp_path / "tight", *flags, "--max-accuracy-loss", "0.1%") == 0
    text = capsys.readouterr().out
    tight = _data(tmp_path / "tight")
    assert free["max_accuracy_loss"] is None and tight["max_accuracy_loss"] == pytest.approx(0.001)
    assert "kv.format=bf16" not in free["choice"]["label"]  # a lossy format is as cheap or cheaper
    assert "kv.format=bf16" in tight["choice"]["label"]
    assert tight["choice"]["usd_per_hour"] >= free["choice"]["usd_per_hour"]
    # Every configuration carries its estimate and whether the budget excluded it.
    by_format = {e["label"].split(",")[0]: e for e in tight["configurations"]}
    assert by_format["kv.format=fp8"]["accuracy"]["loss"] == pytest.approx(0.005)
    assert by_format["kv.format=int4"]["accuracy"]["loss"] == pytest.approx(0.005)  # at least FP8's
    assert by_format["kv.format=bf16"]["accuracy"]["parts"] == []
    assert all(
        e["excluded_by_budget"] == (not e["label"].startswith("kv.format=bf16"))
        for e in tight["configurations"]
    )
    assert not any(e["excluded_by_budget"] for e in free["configurations"])
    # Why the answer differs: the cheapest excluded configuration, its estimate, cited not measured.
    why = tight["budget_excluded"]
    assert why["label"] == free["choice"]["label"] and "cited, not measured" in why["text"]
    assert "exceeds the budget" in text and "within the accuracy budget 0.10%" in text
    page = (tmp_path / "tight" / "plan.html").read_text()
    assert "Why the answer differs" in page and "Accuracy estimates" in page and "losses add" in page
    assert any("exceeds the budget" in e["why"] for e in tight["runners_up"])


def test_a_budget_that_excludes_every_cheaper_meeting_config_says_so(scenario: Path, tmp_path: Path, capsys):
    flags = ("--slo", "ttft_p99=300ms", "--search", "kv.format=fp8,int4", "--search", "cluster.nodes=1..4")
    assert _plan(scenario, tmp_path / "p", *flags, "--max-accuracy-loss", "0%") == 3
    data = _data(tmp_path / "p")
    assert data["choice"] is None and data["budget_excluded"] is not None
    assert "within the accuracy budget" in (tmp_path / "p" / "plan.html").read_text()
    assert "within the accuracy budget 0.00%" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("budget", "error"),
    [
        ("-1%", "--max-accuracy-loss: an accuracy budget below zero"),
        ("one", "--max-accuracy-loss: expected a percentage such as 1%"),
        ("150%", "--max-accuracy-loss: expected a loss below 100%"),
    ],
)
def test_bad_accuracy_budgets_are_refused(scenario: Path, tmp_path: Path, capsys, budget, error):
    out = tmp_path / "plan"
    assert _plan(scenario, out, "--slo", "ttft_p99=2s", f"--max-accuracy-loss={budget}") == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and error in err[0], err
    assert not out.exists()


def test_a_budget_with_nothing_lossy_searched_is_refused(scenario: Path, tmp_path: Path, capsys):
    out = tmp_path / "plan"
    flags = ("--slo", "ttft_p99=2s", "--search", "cluster.nodes=1..2", "--max-accuracy-loss", "1%")
    assert _plan(scenario, out, *flags) == 2
    err = capsys.readouterr().err
    assert "--max-accuracy-loss: no configuration searched uses a lossy technique" in err
    assert not out.exists()


def test_a_disaggregated_split_is_priced_pool_by_pool(tmp_path: Path, capsys):
    """A split search over the decode pool (issue 21): each configuration costs its prefill GPUs at
    the prefill pool's price plus its decode GPUs at the decode pool's, named with their sources."""
    s = tmp_path / "pd.yaml"
    s.write_text(
        SCENARIO.replace(
            "cluster: {gpu: h100-sxm, gpus_per_node: 1}",
            "cluster:\n  gpu: h100-sxm\n  gpus_per_node: 8\n  disaggregation:\n"
            "    prefill: {replicas: 1, gpu_hour: $4/h}\n    decode: {replicas: 1, gpu: a100-80gb}",
        )
    )
    out = tmp_path / "plan"
    rc = _plan(s, out, "--slo", "ttft_p99=60s", "--search", "cluster.disaggregation.decode.replicas=1,2")
    assert rc == 0, capsys.readouterr().err
    data = _data(out)
    a100 = load_gpu("a100-80gb").usd_per_hour
    by_decode = {e["overrides"][0]: e for e in data["configurations"]}
    for n in (1, 2):
        e = by_decode[f"cluster.disaggregation.decode.replicas={n}"]
        assert e["gpus"] == 1 + n
        assert e["usd_per_hour"] == pytest.approx(4.0 + n * a100)
        assert (
            "prefill 1 x $4.00/h" in e["gpu_hour_source"]
            and f"decode {n} x ${a100:.2f}/h" in e["gpu_hour_source"]
        )
    assert data["choice"]["overrides"] == ["cluster.disaggregation.decode.replicas=1"]  # the cheaper split


def test_a_plan_weighs_a_split_against_the_aggregated_cluster(tmp_path: Path, capsys):
    """``cluster.disaggregation.enabled`` as a searched axis: the plan returns the cheaper of the
    aggregated cluster and the split, the other as a runner-up with its cost and why it lost."""
    s = tmp_path / "pd.yaml"
    s.write_text(
        SCENARIO.replace(
            "cluster: {gpu: h100-sxm, gpus_per_node: 1}",
            "cluster:\n  gpu: h100-sxm\n  gpus_per_node: 2\n  disaggregation:\n"
            "    prefill: {replicas: 1, gpu_hour: $9/h}\n    decode: {replicas: 1}",
        )
    )
    out = tmp_path / "plan"
    rc = _plan(s, out, "--slo", "ttft_p99=60s", "--search", "cluster.disaggregation.enabled=false,true")
    assert rc == 0, capsys.readouterr().err
    data = _data(out)
    h100 = load_gpu("h100-sxm").usd_per_hour
    rows = {e["overrides"][0]: e for e in data["configurations"]}
    agg, split = rows["cluster.disaggregation.enabled=false"], rows["cluster.disaggregation.enabled=true"]
    assert (agg["gpus"], split["gpus"]) == (2, 2)
    assert agg["usd_per_hour"] == pytest.approx(2 * h100)
    assert split["usd_per_hour"] == pytest.approx(9.0 + h100)
    assert data["choice"]["overrides"] == agg["overrides"]  # both meet; the aggregated is cheaper
    lost = [r for r in data["runners_up"] if r["overrides"] == split["overrides"]]
    assert lost and f"${split['usd_per_hour']:.2f}/h" in lost[0]["why"]
    point = out / "points" / split["loads"][0]["point"] / "summary.json"
    assert json.loads(point.read_text())["disaggregation"]["transfers"] > 0  # the split ran as one

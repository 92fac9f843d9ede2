"""The summary record (kvsim/results/record.py): one reader, versioned, and the per-replica numbers."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from kvsim.costs.base import ForwardBatch, SeqKind
from kvsim.errors import KvsimError
from kvsim.results.record import SCHEMA, VERSION, RunSummary, read_summary
from kvsim.run import make_cost_model, run_scenario, write_run
from tests.helpers import make_workload, small_scenario


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("run")
    sc = small_scenario(cluster={"gpus_per_node": 2})
    wl = make_workload([0.0, 0.1, 0.2, 3.0], [700, 300, 1200, 90], [40, 12, 30, 5])
    write_run(run_scenario(sc, workload=wl), out)
    return out


def _edit(run_dir: Path, tmp_path: Path, change) -> Path:  # type: ignore[no-untyped-def]
    data = json.loads((run_dir / "summary.json").read_text())
    change(data)
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(data))
    return path


def test_the_file_is_the_record_and_reads_back_unchanged(run_dir: Path):
    text = (run_dir / "summary.json").read_text()
    data = json.loads(text)
    assert list(data)[:2] == ["schema", "version"] and (data["schema"], data["version"]) == (SCHEMA, VERSION)
    rec = read_summary(run_dir)
    assert rec.to_dict() == data
    assert rec.to_json() == text
    assert rec.requests.total == 4 and rec.config.replicas == 2 and rec.memory_plan.num_blocks > 0


def test_a_summary_from_before_the_version_field_reads_as_version_1_with_a_note(run_dir, tmp_path):
    path = _edit(run_dir, tmp_path, lambda d: [d.pop("schema"), d.pop("version"), d.pop("replicas")])
    rec = read_summary(path)
    assert rec.version == 1 and rec.replicas == ()
    assert rec.read_notes == ("written before summaries carried a schema version; read as version 1",)
    assert "read_notes" not in rec.to_dict()


def test_a_summary_from_before_itl_and_chosen_percentiles_reads_unchanged(run_dir, tmp_path):
    """ITL and --percentiles added defaulted fields (the version stays 1, as the record's rule says)."""

    def old(d):  # type: ignore[no-untyped-def]
        d.pop("itl_s"), d.pop("percentiles")
        for key in ("ttft_s", "tpot_s", "e2e_s", "queue_s"):
            d[key].pop("by_percentile")

    rec = read_summary(_edit(run_dir, tmp_path, old))
    assert rec.itl_s is None and rec.percentiles == () and rec.ttft_s.by_percentile == {}
    new = read_summary(run_dir)
    assert new.itl_s is not None and new.itl_s.p50 is not None
    assert dataclasses.replace(new, itl_s=None).ttft_s == rec.ttft_s


@pytest.mark.parametrize(
    "change,expected",
    [
        (
            lambda d: d["itl_s"].update(by_percentile={"p95": "x"}),
            "itl_s.by_percentile.p95: expected a number",
        ),
        (lambda d: d.update(version=2), "version: summary version 2 is newer than this kvsim reads (1)"),
        (lambda d: d.update(schema="vidur-metrics"), "schema: not a kvsim summary: expected 'kvsim-summary'"),
        (lambda d: d.update(version="1"), "version: expected a positive integer, got '1'"),
        (lambda d: d["ttft_s"].update(p99="fast"), "ttft_s.p99: expected a number, got 'fast'"),
        (lambda d: d["requests"].pop("completed"), "requests.completed: missing"),
        (lambda d: d["replicas"][1].update(preemptions=1.5), "replicas[1].preemptions: expected an integer"),
        (lambda d: d["slo"].update(ttft_met="yes"), "slo.ttft_met: expected true or false, got 'yes'"),
        (lambda d: d["memory_plan"].update(blocks=3), "memory_plan.blocks: unknown field"),
    ],
)
def test_a_bad_summary_is_one_line_naming_the_file_and_field(run_dir, tmp_path, change, expected):
    path = _edit(run_dir, tmp_path, change)
    with pytest.raises(KvsimError) as exc:
        read_summary(path)
    msg = str(exc.value)
    assert msg.startswith(f"{path}: ") and expected in msg and "\n" not in msg


def test_foreign_and_corrupt_files(tmp_path: Path):
    cases = {
        "foreign.json": ('{"latency": [1, 2]}', "not a kvsim summary: no 'schema' field"),
        "list.json": ("[1, 2]", "expected a JSON object, got list"),
        "cut.json": ('{"schema": "kvsim-summary",\n "version": ', "line 2: not valid JSON"),
    }
    for name, (text, expected) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(KvsimError, match=expected):
            read_summary(tmp_path / name)
    with pytest.raises(KvsimError, match="summary.json not found"):
        read_summary(tmp_path / "nowhere")


def test_unknown_keys_of_the_same_version_are_kept_and_written_back(run_dir, tmp_path):
    def change(d):  # type: ignore[no-untyped-def]
        d["planner_score"] = 0.5
        d["requests"]["retried"] = 3

    rec = read_summary(_edit(run_dir, tmp_path, change))
    assert rec.extra == {"planner_score": 0.5} and rec.requests.extra == {"retried": 3}
    out = rec.to_dict()
    assert out["planner_score"] == 0.5 and out["requests"]["retried"] == 3
    assert RunSummary.from_dict(out, source="x") == rec


def test_per_replica_records_add_up_to_the_cluster_numbers(run_dir: Path):
    rec = read_summary(run_dir)
    reps = rec.replicas
    assert [r.index for r in reps] == [0, 1]
    assert sum(r.requests for r in reps) == rec.requests.total - rec.requests.rejected
    assert sum(r.steps for r in reps) == rec.steps
    assert sum(r.preemptions for r in reps) == rec.preemptions
    assert max(r.kv_peak_used_blocks for r in reps) == rec.kv_peak_used_blocks
    assert rec.replica_busy_fraction is not None
    assert max(r.busy_fraction for r in reps) == rec.replica_busy_fraction.max
    assert np.mean([r.busy_fraction for r in reps]) == pytest.approx(rec.replica_busy_fraction.mean)
    for r in reps:
        assert 0 < r.kv_mean_used_blocks <= r.kv_peak_used_blocks


@pytest.mark.parametrize("fast_forward", [True, False])
def test_mean_kv_use_of_one_request_is_its_blocks_weighted_by_step_time(fast_forward: bool):
    sc = small_scenario()
    sc = dataclasses.replace(sc, sim=dataclasses.replace(sc.sim, fast_forward=fast_forward))
    res = run_scenario(sc, workload=make_workload([0.0], [1000], [10]))
    cm = make_cost_model(sc)
    # Prefill of 1000 tokens holds ceil(1000 / 16) = 63 blocks; decode step j (1..9) writes token
    # 999 + j and holds ceil((1000 + j) / 16) blocks: 63 through j = 8, 64 at j = 9.
    prefill = cm.step_time(ForwardBatch((SeqKind.PREFILL,), (1000,), (0,), 1))
    decode = cm.decode_step_times(1, np.arange(1000, 1009, dtype=np.int64))
    blocks = np.array([-(-(1000 + j) // 16) for j in range(1, 10)])
    assert blocks.tolist() == [63] * 8 + [64]
    expected = (63 * prefill + float(blocks @ decode)) / res.record.simulated_s
    (rep,) = res.record.replicas
    assert res.record.simulated_s == pytest.approx(prefill + decode.sum(), rel=1e-12)
    assert rep.kv_mean_used_blocks == pytest.approx(expected, rel=1e-12)
    assert rep.kv_peak_used_blocks == 64 and rep.busy_fraction == pytest.approx(1.0)


def test_a_value_summary_json_cannot_hold_names_its_field_and_loses_no_csv(run_dir, tmp_path, monkeypatch):
    """An infinity or NaN in the record (a defect: the bounds refuse the inputs that make one) is
    one line naming each field's dotted path; the CSVs are still written, no summary beside them."""
    res = run_scenario(small_scenario(), workload=make_workload([0.0], [100], [3]))
    good, first = res.record, res.record.replicas[0]
    bad = dataclasses.replace(
        res.record,
        simulated_s=float("inf"),
        replicas=(dataclasses.replace(first, busy_fraction=float("nan")), *res.record.replicas[1:]),
    )
    monkeypatch.setattr(res, "record", bad)
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text((run_dir / "summary.json").read_text())  # an earlier run's
    with pytest.raises(KvsimError) as exc:
        write_run(res, out)
    line = str(exc.value)
    assert "\n" not in line and line.startswith(f"{out / 'summary.json'}: ")
    assert "simulated_s is inf, replicas.0.busy_fraction is nan, which strict JSON cannot hold" in line
    assert line.endswith(f"; wrote requests.csv, timeseries.csv in {out}, not summary.json or the report")
    assert (out / "requests.csv").read_text().count("\n") == 2 and (out / "timeseries.csv").is_file()
    assert not (out / "summary.json").exists()  # not the earlier run's beside this run's CSVs
    with pytest.raises(
        KvsimError, match=r"^summary\.json: simulated_s is inf, replicas\.0\.busy_fraction is nan"
    ):
        bad.to_json()
    assert json.loads(good.to_json())["simulated_s"] == good.simulated_s

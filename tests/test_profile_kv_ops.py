"""Measured token-eviction and quantize-on-write ops in a profile (schema 1.1): a hand-made profile's
tables give known seconds for H2O's score accumulation, a trim's top-k and compaction and
quantize-on-write; a profile without them prices exactly as the analytic model; off the grid the
edge rate is held and flagged; fast-forward equals stepping with them on; bad sections are refused."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from kvsim.core.eviction import EvictionWork
from kvsim.costs.base import ForwardBatch, StepRun
from kvsim.costs.profile import ProfileCostModel, load_profile_cost_model
from kvsim.costs.profile_schema import load_profile
from kvsim.costs.work import (
    compact_bytes_per_token_layer,
    h2o_accumulate_bytes_per_token_layer,
    h2o_select_bytes_per_token_layer,
    quant_write_bytes_per_token_layer,
)
from kvsim.errors import KvsimError
from kvsim.run import run_scenario
from tests.helpers import records, small_scenario
from tests.test_profile import _synthetic

H2O = {"policy": "h2o", "heavy_ratio": 0.2, "recent_tokens": 64, "pages": "physical"}
LAYERS = 32  # Llama-3.1-8B: every layer holds KV
# Per layer and token, one GPU (8 KV heads x 128, tp 1): by hand from the kernels' data.
ACC_BF16 = 4096 / 2 + 2 * 4 * 8  # K half of 4 KiB of bf16 KV, fp32 score read + written per KV head
SELECT = 4 * 8  # fp32 scores of 8 KV heads
COMPACT_BF16 = 2 * 4096  # K and V read and written
WRITE_INT8 = 4096 + 16 * 136  # bf16 in; int8/g64 out: 16 vectors x (128 B + 2 groups x 4 B)
WRITE_INT4 = 4096 + 16 * 72  # int4/g64 out: 16 vectors x (64 B + 2 groups x 4 B)


def _pt(t: float, nbytes: float, **coords: object) -> dict:
    return {**coords, "t_p20": t, "t_p50": t, "t_p80": t, "bytes": nbytes, "flops": 0.0}


def _with_kv_ops(
    formats: tuple[str, ...] = ("bf16", "int8/g64"), write_formats: tuple[str, ...] = ("int8/g64",)
) -> dict:
    """`_synthetic`'s profile with decode and prefill for `formats` and the four 1.1 ops at
    constant rates: accumulate 1e11 B/s, select 3.2e8 B/s, compaction 8.192e10 B/s (1e-7 s per
    token), kv_write 1e10 B/s."""
    data = _synthetic()
    data["minor_version"] = 1
    for op in ("paged_decode", "chunked_prefill"):
        pts = data["ops"][op]["points"]
        data["ops"][op]["points"] = [{**p, "format": f} for f in formats for p in pts]
    acc = {"bf16": ACC_BF16, "int8/g64": 16 * 136 / 2 + 64, "int4/g64": 16 * 72 / 2 + 64}
    ops = data["ops"]
    ops["h2o_accumulate"] = {
        "points": [
            _pt(b * c * acc[f] / 1e11, b * c * acc[f], format=f, batch=b, context=c)
            for f in formats
            for b in (1, 8)
            for c in (128, 1024)
        ]
    }
    ops["h2o_select"] = {"points": [_pt(n * SELECT / 3.2e8, n * SELECT, tokens=n) for n in (1000, 4000)]}
    moved = {"bf16": COMPACT_BF16, "int8/g64": 2 * 16 * 136, "int4/g64": 2 * 16 * 72}
    ops["compact_kv"] = {
        "points": [
            _pt(n * moved[f] / 8.192e10, n * moved[f], tokens=n, format=f)
            for f in formats
            for n in (100, 1000)
        ]
    }
    write = {"int8/g64": WRITE_INT8, "int4/g64": WRITE_INT4}
    ops["kv_write"] = {
        "points": [
            _pt(n * write[f] / 1e10, n * write[f], tokens=n, format=f)
            for f in write_formats
            for n in (16, 256)
        ]
    }
    return data


def _model(tmp_path: Path, data: dict, **kv: object) -> ProfileCostModel:
    p = tmp_path / "p.json"
    p.write_text(json.dumps(data))
    sc = small_scenario(kv=kv, cost_model={"kind": "profile", "profile": str(p)})
    return load_profile_cost_model(sc)


def test_work_per_layer_matches_the_analytic_totals():
    sc = small_scenario()
    m, fmt = sc.model, sc.kv.format
    assert h2o_accumulate_bytes_per_token_layer(m, fmt, 1) == ACC_BF16
    assert h2o_select_bytes_per_token_layer(m, 1) == SELECT
    assert compact_bytes_per_token_layer(m, fmt, 1) == COMPACT_BF16
    int8 = small_scenario(kv={"format": "int8"}).kv.format
    assert quant_write_bytes_per_token_layer(m, int8, 1) == WRITE_INT8
    # The analytic model's all-layer work is the per-layer work times the layers.
    from kvsim.costs.work import ModelWork

    w = ModelWork.of(m, 1, fmt)
    sb, _ = w.h2o_score_work_per_token()
    assert sb == LAYERS * (ACC_BF16 + SELECT)
    assert w.trim_work(1000, 10, 0)[0] == LAYERS * (SELECT * 1000 + COMPACT_BF16 * 10)


def test_eviction_time_from_the_measured_tables(tmp_path):
    cm = _model(tmp_path, _with_kv_ops(), eviction=H2O)
    a = cm.analytic
    work = EvictionWork(trims=2, select_tokens=3000, moved_tokens=664, table_entries=100)
    select = LAYERS * 3000 * SELECT / 3.2e8  # 9.6 ms
    compact = LAYERS * 664 * 1e-7  # 2.1248 ms
    tables = 5e-6 + 4 * 100 / (a.gpu.hbm_bw_bytes_per_s * 0.5)  # not measured: the analytic kernel
    price = cm.eviction_price(work)
    assert price.seconds == pytest.approx(select + compact + tables, rel=1e-12)
    assert select == pytest.approx(9.6e-3, rel=1e-12) and compact == pytest.approx(2.1248e-3, rel=1e-12)
    assert price.off_grid == frozenset() and cm.eviction_time(work) == price.seconds
    # Beyond the grid: the edge rate held (time x tokens), flagged, and named by warnings(ran).
    far = cm.eviction_price(EvictionWork(1, 8000, 4000, 0))
    assert far.seconds == pytest.approx(LAYERS * (8000 * SELECT / 3.2e8 + 4000 * 1e-7), rel=1e-12)
    assert far.off_grid == {"h2o_select", "compact_kv"}
    assert any("h2o_select extrapolated" in w for w in cm.warnings(far.off_grid))
    assert not any("analytic" in w for w in cm.warnings())  # every op the scenario uses is measured


def test_a_profile_without_the_ops_prices_as_the_analytic_model(tmp_path):
    for kv in ({"eviction": H2O}, {"eviction": H2O, "format": "int8"}):
        data = _with_kv_ops()
        for op in ("h2o_accumulate", "h2o_select", "compact_kv", "kv_write"):
            del data["ops"][op]
        del data["minor_version"]  # a 1.0 profile
        cm = _model(tmp_path, data, **kv)
        a = cm.analytic
        for work in (EvictionWork(1, 3000, 664, 100), EvictionWork(3, 0, 50, 7), EvictionWork(1, 10, 0, 0)):
            assert cm.eviction_price(work) == cm.eviction_price(work)
            assert cm.eviction_time(work) == a.eviction_time(work)
            assert cm.eviction_price(work).off_grid == frozenset()
        for n in (1, 100, 5000):
            assert cm._write_time(n) == a._write_time(n)
        tokens = np.array([1000.0, 9000.0])
        assert np.array_equal(cm._score_time(8, tokens, np.log(tokens / 8)), a.decode_score_time(tokens))
        notes = cm.warnings()
        for op, what in (
            ("h2o_accumulate", "H2O score accumulation"),
            ("h2o_select", "a trim's top-k"),
            ("compact_kv", "a trim's compaction"),
        ):
            assert f"profile: {op} not measured (schema 1.1 op); {what} priced by the analytic model" in notes
        wrote = any("kv_write not measured" in n for n in notes)
        assert wrote == (kv.get("format") == "int8")  # a bf16 cache has no quantize-on-write


def test_score_accumulation_per_decode_step_from_the_measured_table(tmp_path):
    data = _with_kv_ops()
    plain = _model(tmp_path, data)
    h2o = _model(tmp_path, data, eviction=H2O)
    a = h2o.analytic
    sums = np.array([8 * 128 - 8.0, 8 * 1000.0, 8 * 1024 - 8.0])
    extra = h2o._decode_attn_time(8, sums) - plain._decode_attn_time(8, sums)
    tokens = sums + 8
    # Accumulation at 1e11 B/s per layer, plus the steady selection's score read at the analytic
    # decode rate (not timed).
    per_token = LAYERS * ACC_BF16 / 1e11 + LAYERS * SELECT / (a.bw * a.ops.decode_attn.e_max)
    assert extra == pytest.approx(tokens * per_token, rel=1e-9)
    assert h2o.step_off_grid(StepRun.decode(8, sums)) == frozenset()
    assert h2o.step_off_grid(StepRun.decode(8, np.array([8 * 4096.0]))) == {"paged_decode", "h2o_accumulate"}
    vec = h2o.decode_step_times(3, np.array([1100, 6000], dtype=np.int64))
    assert vec[0] == h2o.step_time(ForwardBatch.decode((100, 300, 700)))
    assert vec[1] == h2o.step_time(ForwardBatch.decode((2000, 2000, 2000)))


def test_quantize_on_write_from_the_measured_table(tmp_path):
    cm = _model(tmp_path, _with_kv_ops(), format="int8")
    assert cm._write_time(100) == pytest.approx(LAYERS * 100 * WRITE_INT8 / 1e10, rel=1e-12)  # 2.00704 ms
    assert cm._write_time(100) == pytest.approx(2.00704e-3, rel=1e-12)
    assert cm.price(ForwardBatch.prefill(200)).off_grid == frozenset()
    assert "kv_write" in cm.price(ForwardBatch.prefill(1000)).off_grid
    one = ForwardBatch.prefill(200)
    assert cm.step_time(one) == cm.overhead_s + cm._gemm_time(200, 1) + cm._write_time(200) + (
        cm._prefill_attn_time(200, 0)
    )
    # A bf16 cache writes nothing lossy: no write cost, measured table or not.
    assert _model(tmp_path, _with_kv_ops())._write_time(100) == 0.0
    # A format the table lacks: the analytic write, with a note naming the formats it has.
    data = _with_kv_ops(("bf16", "int4/g64"))
    fp = _model(tmp_path, data, format="int4")
    assert fp._write_time(100) == fp.analytic._write_time(100)
    assert any("kv_write not measured for KV format int4/g64 (it has int8/g64)" in n for n in fp.warnings())


@pytest.mark.parametrize(
    "impl", ["torch:kernels.chunked_prefill.chunked_prefill_ref", "triton:kernels.chunked_prefill"]
)
def test_a_prefill_timed_on_kvsims_kernel_pays_no_second_quantize_on_write(tmp_path, impl):
    # kernels.chunked_prefill stores the chunk through kv_write before attending, so its measured
    # time holds a prefill row's write: only decode rows pay kv_write on top (they paid it twice
    # before for the prefill rows, once inside chunked_prefill and once from kv_write's table).
    from kvsim.costs.base import SeqKind

    data = _with_kv_ops()
    for p in data["ops"]["chunked_prefill"]["points"]:
        p["impl"] = impl
    cm = _model(tmp_path, data, format="int8")
    plain = _model(tmp_path, _with_kv_ops(), format="int8")  # no impl: an imported attention table
    one = ForwardBatch.prefill(200)
    assert cm.step_time(one) == cm.overhead_s + cm._gemm_time(200, 1) + cm._prefill_attn_time(200, 0)
    assert plain.step_time(one) - cm.step_time(one) == pytest.approx(
        LAYERS * 200 * WRITE_INT8 / 1e10, rel=1e-9
    )
    mixed = ForwardBatch((SeqKind.DECODE, SeqKind.DECODE, SeqKind.PREFILL), (1, 1, 200), (500, 400, 0), 3)
    assert cm.step_time(mixed) == pytest.approx(
        cm.overhead_s
        + cm._gemm_time(202, 3)
        + cm._write_time(2)
        + cm.prefill_launch_s
        + cm._prefill_attn_time(200, 0)
        + float(cm._decode_attn_time(2, np.array([900.0]))[0]),
        rel=1e-12,
    )
    assert cm._write_time(2) == pytest.approx(LAYERS * 2 * WRITE_INT8 / 1e10, rel=1e-12)
    # The fast paths price the same way.
    vec = cm.step_times(StepRun.mixed(2, np.array([900]), 200, np.array([0]), np.array([3])))
    assert vec[0] == cm.price(mixed).seconds
    dec = cm.decode_step_times(3, np.array([3107]))
    assert dec[0] == cm.price(ForwardBatch.decode((3105, 1, 1))).seconds
    assert dec[0] == plain.decode_step_times(3, np.array([3107]))[0]  # decode rows write as before


def test_mixed_and_decode_runs_equal_price_with_every_measured_op_on(tmp_path):
    from kvsim.costs.base import SeqKind

    cm = _model(tmp_path, _with_kv_ops(), eviction=H2O, format="int8")
    assert cm._score is not None and cm._write is not None  # measured, not analytic
    ctx = np.array([3107, 5000, 12], dtype=np.int64)
    vec = cm.decode_step_times(3, ctx)
    for j, c in enumerate(ctx.tolist()):
        assert vec[j] == cm.price(ForwardBatch.decode((c - 2, 1, 1))).seconds
    pre_ctx, dec = np.array([0, 512, 4096]), np.array([900, 901, 902])
    mixed = cm.step_times(StepRun.mixed(2, dec, 200, pre_ctx, np.array([2, 3, 2])))
    flags = cm.step_off_grid(StepRun.mixed(2, dec, 200, pre_ctx, np.array([2, 3, 2])))
    for j in range(3):
        b = ForwardBatch(
            (SeqKind.DECODE, SeqKind.DECODE, SeqKind.PREFILL),
            (1, 1, 200),
            (int(dec[j]) - 400, 400, int(pre_ctx[j])),
            [2, 3, 2][j],
        )
        assert mixed[j] == cm.price(b).seconds
        assert cm.price(b).off_grid <= flags
    assert "kv_write" not in flags  # 202 new tokens: inside the table (16..256)


def test_a_format_switch_writes_its_second_format_at_the_measured_rate(tmp_path):
    switch = {"format": "int8", "format_switch": {"after_tokens": 1000, "format": "int4"}}
    data = _with_kv_ops(("bf16", "int8/g64", "int4/g64"), write_formats=("int8/g64", "int4/g64"))
    cm = _model(tmp_path, data, **switch)
    assert cm._switched_write_time(100) == pytest.approx(LAYERS * 100 * WRITE_INT4 / 1e10, rel=1e-12)
    assert cm._write_time(100) == pytest.approx(LAYERS * 100 * WRITE_INT8 / 1e10, rel=1e-12)
    notes = cm.warnings()
    assert "profile: the format switch's re-quantization is not measured; analytic estimate used" in notes
    assert not any("kv_write" in n for n in notes)
    # Without int4 points: the switch's writes stay analytic, and a note says so.
    cm = _model(tmp_path, _with_kv_ops(("bf16", "int8/g64", "int4/g64")), **switch)
    assert cm._switched_write_time(100) == cm.analytic._switched_write_time(100)
    assert any("kv_write not measured for KV format int4/g64" in n and "switch" in n for n in cm.warnings())


def _loaded(path: Path, ff: bool):  # type: ignore[no-untyped-def]
    wl = {
        "synthetic": {
            "num_requests": 60,
            "rate": 30,
            "input": {"dist": "uniform", "mean": 1500, "stdev": 500},
            "output": {"dist": "constant", "mean": 120},
        }
    }
    sc = small_scenario(
        kv={"eviction": {**H2O, "pages": "hybrid", "pressure_threshold": 0.6}, "format": "int8"},
        workload=wl,
        sim={"fast_forward": ff},
        cost_model={"kind": "profile", "profile": str(path)},
        cluster={
            "gpu": {"preset": "h100-sxm", "hbm": "20GiB"},
            "gpu_memory_utilization": 1.0,
            "activation_reserve": 0,
        },
    )
    return run_scenario(sc)


def test_fast_forward_equals_stepping_with_the_measured_ops(tmp_path):
    p = tmp_path / "p.json"
    p.write_text(json.dumps(_with_kv_ops()))
    a, b = _loaded(p, True), _loaded(p, False)
    assert records(a) == records(b)
    assert a.summary["eviction"] == b.summary["eviction"] and a.summary["eviction"]["trims"] > 0
    assert a.summary["simulated_s"] == b.summary["simulated_s"]
    assert a.summary["warnings"] == b.summary["warnings"]
    assert a.summary["engine_events"] < b.summary["engine_events"]
    # The trims' time came from the tables: dropping them changes it.
    data = _with_kv_ops()
    del data["ops"]["h2o_select"], data["ops"]["compact_kv"]
    p.write_text(json.dumps(data))
    c = _loaded(p, True)
    assert c.summary["eviction"]["trim_s"] != a.summary["eviction"]["trim_s"]


@pytest.mark.parametrize(
    ("mutate", "field", "text"),
    [
        (
            lambda o: o["kv_write"]["points"][0].update(tokens=-16),
            "ops.kv_write.points[0].tokens",
            "positive",
        ),
        (
            lambda o: o["h2o_select"]["points"].reverse(),
            "ops.h2o_select.points[1].tokens",
            "tokens 1000 after 4000",
        ),
        (
            lambda o: o["h2o_accumulate"]["points"][1].update(context=100),
            "ops.h2o_accumulate.points[1].context",
            "context 100 after 128",
        ),
        (
            lambda o: o["compact_kv"]["points"][0].update(t_p20=0.0),
            "ops.compact_kv.points[0].t_p20",
            "time must",
        ),
        (lambda o: o["compact_kv"]["points"][0].pop("format"), "ops.compact_kv.points[0].format", "a name"),
        (lambda o: o["h2o_select"]["points"][0].pop("bytes"), "ops.h2o_select.points[0].bytes", "a number"),
        (lambda o: o["kv_write"].update(points=[]), "ops.kv_write.points", "non-empty"),
    ],
)
def test_bad_sections_give_one_line_errors(tmp_path, mutate, field, text):
    data = copy.deepcopy(_with_kv_ops())
    mutate(data["ops"])
    p = tmp_path / "p.json"
    p.write_text(json.dumps(data))
    with pytest.raises(KvsimError) as exc:
        load_profile(p)
    msg = str(exc.value)
    assert "\n" not in msg and str(p) in msg and field in msg and text in msg, msg


def test_minor_version_is_checked_and_a_newer_one_is_read(tmp_path):
    data = _with_kv_ops()
    p = tmp_path / "p.json"
    for bad in (-1, "1", True):
        p.write_text(json.dumps({**data, "minor_version": bad}))
        with pytest.raises(KvsimError, match="minor_version: expected an integer >= 0"):
            load_profile(p)
    p.write_text(json.dumps({**data, "minor_version": 7}))  # additions only: still read
    assert load_profile(p)["minor_version"] == 7


def _check_script():  # type: ignore[no-untyped-def]
    import importlib.util

    from tests.helpers import ROOT

    spec = importlib.util.spec_from_file_location(
        "check_profile_kv_ops", ROOT / "bench/check_profile_kv_ops.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_checks_profile_script_passes_a_full_profile_and_names_what_is_missing(tmp_path, capsys):
    check = _check_script()
    data = {**_with_kv_ops(), "kv_formats": ["bf16", "int8/g64"]}
    p, out = tmp_path / "p.json", tmp_path / "r.json"
    p.write_text(json.dumps(data))
    assert check.main([str(p), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    int8 = next(r for r in res["priced"] if r["format"] == "int8/g64")
    assert int8["gpu"] == "h100-sxm" and int8["lossy"] and not res["problems"]
    assert int8["write_s"]["profile"] == pytest.approx(LAYERS * 256 * WRITE_INT8 / 1e10, rel=1e-12)
    assert int8["trim_s"]["off_grid"] == ["compact_kv", "h2o_select"]  # 4096 scored, 1024 moved
    assert [r["tokens"] for r in res["points"]["h2o_select"]] == [1000, 4000]
    del data["ops"]["kv_write"]
    p.write_text(json.dumps(data))
    capsys.readouterr()
    assert check.main([str(p)]) == 1
    err = capsys.readouterr().err
    assert "kv_write: no points" in err and "int8/g64: profile: kv_write not measured" in err


def test_gpu_checks_profile_script_reads_every_calibrated_format_name():
    check = _check_script()
    names = ("bf16", "fp8_e4m3/per_tensor", "fp8_e4m3/per_head", "int8/g64", "int4/g32", "kvquant4/1.0%")
    for name in names:
        sc = small_scenario(kv=check._kv_fields(name))
        assert sc.kv.format.name == name


def test_entropy_statistics_never_priced_by_the_measured_h2o_accumulate(tmp_path):
    # `h2o_accumulate` re-reads K and recomputes QK^T: entropy's statistics (fused into decode
    # attention) are another kernel's work, so they stay analytic, with a note; a trim's top-k is
    # the same ranking as H2O's and uses the measured `h2o_select`.
    ent = {"policy": "entropy", "keep_ratio": 0.25, "recent_tokens": 64, "pages": "physical"}
    cm = _model(tmp_path, _with_kv_ops(), eviction=ent)
    a = cm.analytic
    assert cm._score is None and cm._select is not None
    tokens = np.array([1000.0, 9000.0])
    assert np.array_equal(cm._score_time(8, tokens, np.log(tokens / 8)), a.decode_score_time(tokens))
    assert a.score_s_per_token > 0.0
    sums = np.array([8 * 128 - 8.0, 8 * 4096.0])
    assert "h2o_accumulate" not in cm.step_off_grid(StepRun.decode(8, sums))
    assert any(
        n.startswith("profile: entropy statistics not measured")
        and n.endswith("attention-entropy statistics priced by the analytic model")
        for n in cm.warnings()
    )
    assert not any("h2o_select not measured" in n for n in cm.warnings())
    select = LAYERS * 3000 * SELECT / 3.2e8  # the measured top-k's rate, as for H2O
    only_select = cm.eviction_price(EvictionWork(trims=1, select_tokens=3000))
    assert only_select.seconds == pytest.approx(select, rel=1e-12)

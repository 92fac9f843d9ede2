"""A step's rest in a profile (schema 1.2): `step_rest` (norms, rotary, SiLU, residual adds per
layer; embedding and sampling per step), `step_overhead` (the serving loop's own time per step) and
the decode rows' KV write of a bf16 cache from `kv_write`. A hand-made profile's tables give known
seconds; a profile without them prices as before (the analytic 1 ms, no rest); fast-forward equals
stepping with them on; the calibrator writes them; bad sections are refused."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from kvsim.costs.base import ForwardBatch, SeqKind, StepRun
from kvsim.costs.profile_schema import load_profile
from kvsim.costs.work import quant_write_bytes_per_token_layer, step_rest_bytes_per_token
from kvsim.errors import KvsimError
from tests.helpers import small_scenario
from tests.test_profile import _synthetic
from tests.test_profile_kv_ops import _model, _pt, _with_kv_ops

LAYERS = 32  # Llama-3.1-8B
# Bytes per token (per sampled row for `sample`), one GPU, bf16 activations, by hand:
# layer: norms 2 x 2 x 4096, rotary (32 + 8) x 128 read and written, V's copy 2 x 8 x 128,
# residual adds 2 x 3 x 4096, SiLU-and-mul 3 x 14336: 96,256 elements x 2 B.
LAYER_B = 2 * (2 * 2 * 4096 + 2 * 40 * 128 + 2 * 8 * 128 + 2 * 3 * 4096 + 3 * 14336)  # 192,512
EMBED_B = 2 * (2 * 4096 + 128)  # the row read and written, the rotary tables: 16,640
SAMPLE_B = 2 * (2 * 4096 + 128256)  # the final norm, the logits read: 272,896
WRITE_BF16 = 4096 + 4096  # bf16 K/V read, bf16 written
RATE = 1e10  # B/s of every table below


def _with_step_ops(data: dict | None = None) -> dict:
    """`_synthetic`'s profile plus `step_rest` (every part at 1e10 B/s), `step_overhead` (100 us at
    one row, 400 us at four: time proportional to rows) and a bf16 `kv_write` at 1e10 B/s."""
    data = copy.deepcopy(data or _synthetic())
    data["minor_version"] = 2
    per = {"layer": LAYER_B, "embed": EMBED_B, "sample": SAMPLE_B}
    data["ops"]["step_rest"] = {
        "points": [
            _pt(n * per[part] / RATE, n * per[part], part=part, tokens=n)
            for part in ("layer", "embed", "sample")
            for n in ((1, 16) if part == "sample" else (1, 16, 256))
        ]
    }
    data["ops"]["step_overhead"] = {"points": [_pt(1e-4 * r, 0.0, rows=r) for r in (1, 4)]}
    data["ops"]["kv_write"] = {
        "points": [_pt(n * WRITE_BF16 / RATE, n * WRITE_BF16, format="bf16", tokens=n) for n in (1, 16, 256)]
    }
    return data


def test_bytes_per_token_are_the_hand_counts():
    m = small_scenario().model
    assert step_rest_bytes_per_token(m, 1, "layer") == LAYER_B == 192_512
    assert step_rest_bytes_per_token(m, 1, "embed") == EMBED_B
    assert step_rest_bytes_per_token(m, 1, "sample") == SAMPLE_B
    assert quant_write_bytes_per_token_layer(m, small_scenario().kv.format, 1) == WRITE_BF16


def test_a_decode_step_pays_the_measured_rest_overhead_and_writes(tmp_path):
    cm = _model(tmp_path, _with_step_ops())
    old = _model(tmp_path, _synthetic())
    # Two decode rows: overhead 200 us (100 us per row, log-log between 1 and 4), the layer part
    # 32 x 2 x 19.2512 us, embed 2 x 1.664 us, sample 2 x 27.2896 us, the write 32 x 2 x 0.8192 us.
    want = 200e-6 + 32 * 2 * 19.2512e-6 + 2 * 1.664e-6 + 2 * 27.2896e-6 + 32 * 2 * 0.8192e-6
    assert want == pytest.approx(1542.4128e-6, rel=1e-12)
    assert cm._step_base(2, 2, 2, 2) == pytest.approx(want, rel=1e-12)
    batch = ForwardBatch.decode((300, 700))
    assert cm.price(batch).seconds == pytest.approx(old.price(batch).seconds - 1e-3 + want, rel=1e-12)
    assert cm.price(batch).off_grid == old.price(batch).off_grid == frozenset()
    assert cm.overhead_s == pytest.approx(1e-4, rel=1e-12)  # one row's (`step_overhead`: any rows)


def _kvsims_prefill(data: dict) -> dict:
    """`data` with its chunked_prefill timed on kvsim's kernel (which writes its chunk first)."""
    for p in data["ops"]["chunked_prefill"]["points"]:
        p["impl"] = "triton:kernels.chunked_prefill"
    return data


def test_prefill_rows_pay_no_write_and_sample_only_their_rows(tmp_path):
    cm = _model(tmp_path, _kvsims_prefill(_with_step_ops()))
    old = _model(tmp_path, _kvsims_prefill(_synthetic()))
    # One 200-token chunk that samples, one decode row: 2 rows -> 200 us; layer over 201 tokens;
    # embed over 201; sample over 2 rows; the write for the decode row only (kvsim's
    # chunked_prefill times its chunk's own writes).
    b = ForwardBatch((SeqKind.DECODE, SeqKind.PREFILL), (1, 200), (500, 0), 2)
    want = 200e-6 + (32 * 201 * LAYER_B + 201 * EMBED_B + 2 * SAMPLE_B + 32 * 1 * WRITE_BF16) / RATE
    assert cm.price(b).seconds == pytest.approx(old.price(b).seconds - 1e-3 + want, rel=1e-12)
    # A chunk that does not sample (a prompt's middle chunk) pays no sampling.
    mid = ForwardBatch.prefill(200, 0, sampling=False)
    want = 100e-6 + (32 * 200 * LAYER_B + 200 * EMBED_B) / RATE
    assert cm.price(mid).seconds == pytest.approx(old.price(mid).seconds - 1e-3 + want, rel=1e-12)


def test_over_an_imported_attention_table_every_new_token_pays_its_write(tmp_path):
    """An imported chunked_prefill (no kvsim `impl`: vLLM's attention, whose cache write is a kernel
    of its own) times no write, so a bf16 cache's prefill rows pay `kv_write` too, as a lossy
    part's quantize-on-write does there (they paid none: the 200-token chunk's write was lost)."""
    cm = _model(tmp_path, _with_step_ops())
    old = _model(tmp_path, _synthetic())
    b = ForwardBatch((SeqKind.DECODE, SeqKind.PREFILL), (1, 200), (500, 0), 2)
    want = 200e-6 + (32 * 201 * LAYER_B + 201 * EMBED_B + 2 * SAMPLE_B + 32 * 201 * WRITE_BF16) / RATE
    assert cm.price(b).seconds == pytest.approx(old.price(b).seconds - 1e-3 + want, rel=1e-12)
    # Decode-only steps pay the same either way (their rows' write only).
    kern = _model(tmp_path, _kvsims_prefill(_with_step_ops()))
    assert cm._step_base(2, 2, 2, 2) == kern._step_base(2, 2, 2, 2)


def test_a_profile_without_the_ops_prices_as_before(tmp_path):
    old = _model(tmp_path, _synthetic())
    assert old.overhead_s == 1e-3 and old._rest is None and old._overhead is None
    assert old._dec_write is None
    b = ForwardBatch.decode((300, 700))
    assert old._step_base(2, 2, 2, 2) == 1e-3
    parts = (
        1e-3
        + old._gemm_time(2, 2)
        + old._comm_time(2)
        + float(old._decode_attn_time(2, np.array([1000.0]))[0])
    )
    assert old.price(b).seconds == parts
    # A bf16 kv_write table alone prices the decode rows' writes (and nothing else changes).
    data = _synthetic()
    data["minor_version"] = 2
    data["ops"]["kv_write"] = _with_step_ops()["ops"]["kv_write"]
    w = _model(tmp_path, data)
    assert w._step_base(2, 2, 2, 2) == pytest.approx(1e-3 + 32 * 2 * WRITE_BF16 / RATE, rel=1e-12)
    # A lossy cache: its quantize-on-write (over every new token) is the write; no second one.
    int8 = _model(tmp_path, _with_step_ops(_with_kv_ops()), format="int8")
    assert int8._dec_write is None


def test_off_the_grid_the_edge_rate_is_held_and_flagged(tmp_path):
    cm = _model(tmp_path, _with_step_ops())
    big = ForwardBatch.prefill(1000)  # 1000 tokens > 256: layer and embed held at their edge rates
    assert "step_rest" in cm.price(big).off_grid
    eight = ForwardBatch.decode((100,) * 8)  # 8 rows > 4: the overhead's edge time held, 400 us
    assert "step_overhead" in cm.price(eight).off_grid
    assert cm._overhead_entry(8) == (pytest.approx(4e-4, rel=1e-12), True)
    assert "step_rest" in cm.warnings(cm.price(big).off_grid)[-1]


def test_fast_forward_equals_stepping_with_the_ops_on(tmp_path):
    cm = _model(tmp_path, _with_step_ops())
    ctx = np.array([3107, 5000, 12], dtype=np.int64)
    vec = cm.decode_step_times(3, ctx)
    for j, c in enumerate(ctx.tolist()):
        assert vec[j] == cm.price(ForwardBatch.decode((c - 2, 1, 1))).seconds
    assert cm.step_off_grid(StepRun.decode(3, ctx)) == frozenset()
    pre_ctx, dec = np.array([0, 512, 4096]), np.array([900, 901, 902])
    smp = np.array([2, 3, 2])
    mixed = cm.step_times(StepRun.mixed(2, dec, 200, pre_ctx, smp))
    flags = cm.step_off_grid(StepRun.mixed(2, dec, 200, pre_ctx, smp))
    for j in range(3):
        b = ForwardBatch(
            (SeqKind.DECODE, SeqKind.DECODE, SeqKind.PREFILL),
            (1, 1, 200),
            (int(dec[j]) - 400, 400, int(pre_ctx[j])),
            int(smp[j]),
        )
        assert mixed[j] == cm.price(b).seconds
        assert cm.price(b).off_grid <= flags


@pytest.mark.parametrize(
    ("change", "path", "text"),
    [
        (lambda d: d.update(minor_version=1), "minor_version", "ops.step_rest was added in schema 1.2"),
        (lambda d: d.pop("minor_version"), "minor_version", "the profile declares 1.0"),
        (
            lambda d: d["ops"]["step_rest"].update(
                points=[p for p in d["ops"]["step_rest"]["points"] if p["part"] != "sample"]
            ),
            "ops.step_rest.points",
            "no points for part 'sample'",
        ),
        (
            lambda d: d["ops"]["step_rest"]["points"][0].update(part="norm"),
            "ops.step_rest.points",
            "unknown part 'norm'",
        ),
        (
            lambda d: d["ops"]["step_rest"]["points"][1].update(tokens=1),
            "ops.step_rest.points[1]",
            "same part=layer, tokens=1 as points[0]",
        ),
        (
            lambda d: d["ops"]["step_overhead"]["points"].reverse(),
            "ops.step_overhead.points[1].rows",
            "rows 1 after 4",
        ),
        (
            lambda d: d["ops"]["step_overhead"]["points"][0].pop("rows"),
            "ops.step_overhead.points[0].rows",
            "",
        ),
    ],
)
def test_bad_step_sections_are_refused(tmp_path, change, path, text):
    data = _with_step_ops()
    change(data)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(data))
    with pytest.raises(KvsimError) as exc:
        load_profile(p)
    assert exc.value.path == path and text in exc.value.message


def test_the_calibrator_writes_the_ops_at_the_model_shapes(tmp_path):
    pytest.importorskip("torch")
    from calibrate.cli import main
    from kvsim.spec.models import load_model
    from kvsim.validation import scaled_config

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(scaled_config(load_model("llama-3.1-8b"), 32)))  # hidden 128, 1 layer
    out = tmp_path / "p.json"
    argv = ["--device", "cpu", "--quick", "--reps", "3", "--no-progress", "--model", str(cfg)]
    assert main([*argv, "--ops", "rest,overhead", "--out", str(out)]) == 0
    prof = load_profile(out)
    assert prof["minor_version"] == 2 and set(prof["ops"]) == {"step_rest", "step_overhead"}
    m = load_model(str(cfg))
    rest = prof["ops"]["step_rest"]["points"]
    assert [(p["part"], p["tokens"]) for p in rest] == [
        *(("layer", n) for n in (1, 16, 64)),
        *(("embed", n) for n in (1, 16, 64)),
        *(("sample", n) for n in (1, 16)),
    ]  # the quick grid's GEMM token counts and LM-head rows
    for p in rest:
        assert p["bytes"] == p["tokens"] * step_rest_bytes_per_token(m, 1, p["part"])
        assert p["impl"] == "validate.model.step_rest" and p["t_p20"] <= p["t_p50"] <= p["t_p80"]
    over = prof["ops"]["step_overhead"]["points"]
    assert [p["rows"] for p in over] == [1, 4] and {p["impl"] for p in over} == {"validate.loop.step"}
    assert all(p["bytes"] == 0 and p["t_p50"] > 0 for p in over)


def test_host_work_is_timed_by_the_host_clock_between_synchronisations(monkeypatch):
    """On CUDA, `step_overhead` (host work) is timed by perf_counter between two synchronisations,
    not by CUDA events; checked here with the device calls stubbed."""
    torch = pytest.importorskip("torch")
    from calibrate.harness import Timer

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("sync"))
    timer = Timer("cpu", warmup=0, max_reps=3, budget_s=0.0)
    timer.cuda = True  # as on CUDA
    t = timer.time(lambda: calls.append("fn"), host=True)
    assert t.reps == 3 and calls.count("fn") == 3
    assert calls[:4] == ["sync", "sync", "fn", "sync"]  # after warm-up: sync, then per rep sync fn sync


def test_fast_forward_equals_stepping_in_the_engine_with_the_step_ops(tmp_path):
    """The engine's windows (decode-only and mixed, chunked prefill under load) priced with the step
    ops on equal stepping one by one, request by request."""
    from tests.helpers import ROOT
    from tests.test_engine import profile_under_load

    shipped = ROOT / "scenarios/profiles/aiconfigurator-h200_sxm-vllm-llama-3.1-8b-tp1.json"
    p = tmp_path / "h200-step-ops.json"
    p.write_text(json.dumps(_with_step_ops(json.loads(shipped.read_text()))))
    a, _ = profile_under_load(f"cost_model.profile={p}")
    base, _ = profile_under_load()
    assert a.summary["simulated_s"] != base.summary["simulated_s"]  # the ops are priced


def test_an_mtp_draft_pass_does_not_pay_the_loops_overhead_at_its_rows_again(tmp_path):
    """A profile's `step_overhead` grows with the rows (100 us per row here); a pass of four rows
    inside the step pays its layer's share of the decode batch less the loop's 400 us at four rows,
    not less one row's 100 us (which left 300 us x scale charged once per pass)."""
    from kvsim.costs.draft import DraftCost
    from kvsim.sim.assembly import spec_decode

    cm = _model(tmp_path, _with_step_ops())
    assert cm.step_overhead(4) == pytest.approx(4e-4, rel=1e-12)
    assert cm.step_overhead(1) == cm.overhead_s
    ctx = [100, 200, 300, 400]
    sc = small_scenario(
        scheduler={"spec_decode": {"k": 2, "acceptance": {"mean": 0.5}, "draft": {"kind": "mtp"}}}
    )
    _, draft = spec_decode(sc, cm)
    assert draft is not None and draft.kind == "mtp"
    scale = 1.0 / LAYERS
    want = sum(
        scale * (cm.price(ForwardBatch.decode(tuple(c + j for c in ctx))).seconds - 4e-4) for j in range(2)
    )
    assert draft.seconds(ctx, [2, 2, 2, 2]) == pytest.approx(want, rel=1e-12)
    # Rows that draft unequally: pass 0 has four rows, pass 1 the two that draft a second token.
    want = scale * (cm.price(ForwardBatch.decode(tuple(ctx))).seconds - 4e-4) + scale * (
        cm.price(ForwardBatch.decode((301, 401))).seconds - 2e-4
    )
    assert draft.seconds(ctx, [1, 1, 2, 2]) == pytest.approx(want, rel=1e-12)
    # A constant overhead (the analytic model's, a draft model's) as before.
    assert DraftCost(cm, 1e-4, scale=scale, kind="mtp").seconds(ctx, [1, 1, 1, 1]) == pytest.approx(
        scale * (cm.price(ForwardBatch.decode(tuple(ctx))).seconds - 1e-4), rel=1e-12
    )


def test_a_run_of_mixed_steps_flags_the_overhead_at_each_steps_rows(tmp_path):
    """Three mixed steps of three decodes and one chunk: four rows each, on step_overhead's grid
    (rows 1 to 4). Fast-forward's flags for the run are the steps' own; they counted the run's three
    chunks as one step's rows (six, off the grid), so fast-forward warned where stepping did not."""
    cm = _model(tmp_path, _with_step_ops())
    dec, pre, smp = np.array([900, 903, 906]), np.array([0, 16, 32]), np.array([4, 4, 4])
    stepped: frozenset[str] = frozenset()
    for j in range(3):
        b = ForwardBatch(
            (SeqKind.DECODE,) * 3 + (SeqKind.PREFILL,),
            (1, 1, 1, 16),
            (300, 300, int(dec[j]) - 600, int(pre[j])),
            4,
        )
        stepped |= cm.price(b).off_grid
    assert "step_overhead" not in stepped
    assert cm.step_off_grid(StepRun.mixed(3, dec, 16, pre, smp)) == stepped


def test_the_per_op_split_of_a_step_sums_to_its_price_and_names_each_op(tmp_path):
    """`op_parts` (``kvsim validate``'s per-op table) splits a price as the ops price it: the rest's
    parts, the write and the overhead by hand as above, and nothing left over in ``other``."""
    cm = _model(tmp_path, _kvsims_prefill(_with_step_ops()))
    b = ForwardBatch((SeqKind.DECODE, SeqKind.PREFILL), (1, 200), (500, 0), 2)
    parts = cm.op_parts(b)
    assert set(parts) == {
        *(f"gemm:{x}" for x in ("qkv", "o", "gate_up", "down", "lm_head")),
        "paged_decode", "chunked_prefill", "kv_write", "step_overhead", "other",
        *(f"step_rest:{x}" for x in ("layer", "embed", "sample")),
    }  # fmt: skip
    assert parts["step_overhead"] == pytest.approx(200e-6, rel=1e-12)
    assert parts["step_rest:layer"] == pytest.approx(32 * 201 * LAYER_B / RATE, rel=1e-12)
    assert parts["step_rest:sample"] == pytest.approx(2 * SAMPLE_B / RATE, rel=1e-12)
    assert parts["kv_write"] == pytest.approx(32 * WRITE_BF16 / RATE, rel=1e-12)  # the decode row's
    assert parts["paged_decode"] == pytest.approx(cm._decode_attn_time(1, np.array([500.0]))[0], rel=1e-12)
    assert parts["chunked_prefill"] == pytest.approx(cm._prefill_attn_time(200, 0), rel=1e-12)
    assert abs(parts["other"]) < 1e-12 * cm.price(b).seconds
    assert sum(parts.values()) == pytest.approx(cm.price(b).seconds, rel=1e-12)
    mid = ForwardBatch.prefill(200, 0, sampling=False)  # no decode row, no sampled row
    assert not {"gemm:lm_head", "paged_decode", "kv_write", "step_rest:sample"} & set(cm.op_parts(mid))

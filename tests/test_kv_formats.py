"""Quantized KV formats inside the engine: bytes per block into the memory plan, decode attention at
each format's speed-up, the quantize-on-write cost of new tokens, mixed formats per head, and the
profile refusing a format it has no data for. Direction and size, with exact numbers."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from kvsim.accuracy import accuracy_note
from kvsim.core.memory_plan import plan_memory
from kvsim.costs.analytic import AnalyticCostModel
from kvsim.costs.base import ForwardBatch
from kvsim.costs.profile import ProfileCostModel
from kvsim.errors import KvsimError
from kvsim.results.summarize import typical_shape
from kvsim.run import make_cost_model, run_scenario
from kvsim.spec.formats import format_from_name
from tests.helpers import small_scenario
from tests.test_engine import profile_under_load
from tests.test_profile import _synthetic

AIC = "scenarios/profiles/aiconfigurator-h200_sxm-vllm-llama-3.1-8b-tp1.json"
MIX = {"format": "int8", "format_mix": {"format": "int4", "share": 0.75}}


def _analytic(**kv: object) -> AnalyticCostModel:
    cm = make_cost_model(small_scenario(kv=kv))
    assert isinstance(cm, AnalyticCostModel)
    return cm


def test_bytes_per_token_and_blocks_follow_the_format():
    # Llama-3.1-8B: 32 layers x 8 KV heads x (K, V) x 128 dims.
    # bf16 256 B per vector; int8/g64 128 + 2 groups x 4 B = 136; int4/g64 64 + 8 = 72.
    per_token = {}
    blocks = {}
    for name, kv in {
        "bf16": {"format": "bf16"},
        "int8": {"format": "int8"},
        "int4": {"format": "int4"},
        "mix": MIX,
    }.items():
        p = plan_memory(small_scenario(kv=kv))
        per_token[name], blocks[name] = p.kv_bytes_per_token_per_gpu, p.num_blocks
        assert p.num_blocks == int(p.kv_bytes_per_gpu // (16 * p.kv_bytes_per_token_per_gpu))
    assert per_token == {
        "bf16": 32 * 16 * 256,
        "int8": 32 * 16 * 136,
        "int4": 32 * 16 * 72,
        "mix": 32 * 2 * (2 * 136 + 6 * 72),  # 2 heads int8, 6 heads int4
    }
    assert blocks["bf16"] < blocks["int8"] < blocks["mix"] < blocks["int4"]
    assert blocks["int4"] / blocks["bf16"] == pytest.approx(256 / 72, rel=1e-3)


def test_format_mix_rounds_the_share_to_whole_heads():
    mix = small_scenario(kv={"format": "int8", "format_mix": {"format": "int4", "share": 0.3}}).kv.format_mix
    assert mix is not None and (mix.heads, mix.num_kv_heads, mix.name) == (2, 8, "2/8 heads int4/g64")
    none = small_scenario(kv={"format": "int8", "format_mix": {"format": "int4", "share": 0.0}})
    assert plan_memory(none).kv_bytes_per_token_per_gpu == 32 * 16 * 136  # share 0: all int8


def test_decode_attention_runs_at_each_parts_speed_up():
    ctx = np.array([4096.0 * 64])

    def streamed(**kv: object) -> float:  # the bytes part, less the fitted per-call and per-sequence time
        cm = _analytic(**kv)
        return float(cm._decode_attn_time(64, ctx)[0]) - (cm.decode_launch_s + 64 * cm.decode_per_seq_s)

    bf16 = streamed(format="bf16")
    int8 = streamed(format="int8")
    int4 = streamed(format="int4")
    mix = streamed(**MIX)
    assert int8 == pytest.approx(bf16 / 1.6, rel=1e-12)
    assert int4 == pytest.approx(bf16 / 1.7, rel=1e-12)
    assert mix == pytest.approx(bf16 * (0.25 / 1.6 + 0.75 / 1.7), rel=1e-12)


def test_quantize_on_write_costs_the_new_tokens_bytes_and_nothing_for_bf16():
    bf16, int8, kvq = _analytic(format="bf16"), _analytic(format="int8"), _analytic(format="kvquant4")
    assert bf16._write_time(1000) == 0.0
    bw = bf16.gpu.hbm_bw_bytes_per_s * 0.5
    # Read the token's bf16 K/V (131,072 B) and write it quantized (int8 69,632 B; kvquant4 37,888 B).
    assert int8._write_time(1000) == pytest.approx(1000 * (131072 + 69632) / bw, rel=1e-12)
    assert kvq._write_time(1000) == pytest.approx(1000 * (131072 + 37888) / bw, rel=1e-12)
    # It is inside every step's price: a prefill of 2048 tokens pays it once per token.
    p_int8 = int8.step_time(ForwardBatch.prefill(2048))
    no_write = dataclasses.replace(
        int8.work, quant_write_bytes_per_token=0.0, quant_write_flops_per_token=0.0
    )
    int8_free = _analytic(format="int8")
    int8_free.work, int8_free.write_s_per_token = no_write, 0.0
    assert p_int8 - int8_free.step_time(ForwardBatch.prefill(2048)) == pytest.approx(
        2048 * (131072 + 69632) / bw, rel=1e-9
    )


def test_quantized_decode_step_is_faster_and_fast_forward_prices_agree():
    for kv in ({"format": "bf16"}, {"format": "int8"}, MIX):
        cm = _analytic(**kv)
        sums = np.array([100_000, 100_064, 100_128], dtype=np.int64)
        batch = [
            cm.step_time(ForwardBatch.decode([int(s) // 64] * 63 + [int(s) - 63 * (int(s) // 64)]))
            for s in sums
        ]
        assert cm.decode_step_times(64, sums).tolist() == batch
    t = {
        k: _analytic(**kv).step_time(ForwardBatch.decode([4000] * 64))
        for k, kv in (("bf16", {"format": "bf16"}), ("int8", {"format": "int8"}))
    }
    assert t["int8"] < t["bf16"]


def test_more_sequences_fit_in_int4_so_fewer_preemptions():
    """Under memory pressure the int4 cache holds 3.6x the tokens: fewer preemptions, higher throughput."""
    wl = {
        "synthetic": {
            "num_requests": 120,
            "rate": 200,
            "input": {"dist": "constant", "mean": 3000},
            "output": {"dist": "constant", "mean": 300},
        }
    }
    runs = {}
    for fmt in ("bf16", "int4"):
        sc = small_scenario(
            kv={"format": fmt, "prefix_cache": False},
            workload=wl,
            cluster={
                "gpu": {"preset": "h100-sxm", "hbm": "24GiB"},
                "gpu_memory_utilization": 1.0,
                "activation_reserve": 0,
            },
        )
        runs[fmt] = run_scenario(sc).summary
    b, q = runs["bf16"], runs["int4"]
    assert b["requests"]["completed"] == q["requests"]["completed"] == 120
    assert q["kv_blocks_per_replica"] == pytest.approx(b["kv_blocks_per_replica"] * 256 / 72, rel=1e-3)
    assert q["preemptions"] < b["preemptions"]
    assert q["simulated_s"] < b["simulated_s"]


# kvquant4/1.0% on Llama-3.1-8B: ceil(0.01 x 128) = 2 outliers per vector, 32 layers x 16 vectors.
OUTLIER_BYTES = 32 * 16 * 2 * 4  # fp16 value + int16 index each
OUTLIER_OPS = 32 * 16 * 128 * 2 * 2  # a compare and a select over the vector per outlier


def test_kvquant4_pays_its_outlier_path_over_int4():
    int4, kvq = _analytic(format="int4"), _analytic(format="kvquant4")
    zero = _analytic(format="kvquant4", outlier_fraction=0.0)
    bw = int4.bw * int4.ops.decode_attn.e_max
    vector = int4.gpu.bf16_flops / 15
    tokens = 64 * 4096.0 + 64
    ctx = np.array([64 * 4096.0])
    a, q, z = (float(c._decode_attn_time(64, ctx)[0]) for c in (int4, kvq, zero))
    # The 4-bit codes at int4's speed-up, plus the outliers' bytes and their merge, not overlapped.
    assert q - a == pytest.approx(tokens * (OUTLIER_BYTES / bw + OUTLIER_OPS / vector), rel=1e-9)
    assert z == a  # no outliers: int4's decode attention exactly
    # Quantize-on-write: the codebook search and, per outlier, a selection pass of 9 ops an element.
    assert kvq.work.quant_write_flops_per_token == 32 * 16 * 128 * (34 + 9 * 2)
    assert zero.work.quant_write_flops_per_token == 32 * 16 * 128 * 34
    # A cached prefix's outliers are merged once per prefill chunk (its bytes hide under the FLOPs).
    merged = kvq._prefill_attn_time(512, 2048) - zero._prefill_attn_time(512, 2048)
    assert merged == pytest.approx(2048 * OUTLIER_OPS / vector, rel=1e-9)
    assert kvq._prefill_attn_time(512, 0) == zero._prefill_attn_time(512, 0)
    # The write is bytes-bound (50% of HBM) for all three: kvquant4/0% writes 66 B a vector, int4 72.
    w_bw = int4.gpu.hbm_bw_bytes_per_s * 0.5
    assert zero._write_time(100) == pytest.approx(100 * (131072 + 32 * 16 * 66) / w_bw, rel=1e-12)
    assert int4._write_time(100) == pytest.approx(100 * (131072 + 32 * 16 * 72) / w_bw, rel=1e-12)


def _decode_heavy(fmt: str, fast_forward: bool, **kv: object) -> dict:
    """64 requests arriving together, 2,000-token prompts and 400-token answers: decode steps of
    up to 64 sequences over ~2,000-2,400 tokens each."""
    wl = {
        "synthetic": {
            "num_requests": 64,
            "rate": 1000,
            "input": {"dist": "constant", "mean": 2000},
            "output": {"dist": "constant", "mean": 400},
        }
    }
    sc = small_scenario(kv={"format": fmt, "prefix_cache": False, **kv}, workload=wl)
    sc = dataclasses.replace(sc, sim=dataclasses.replace(sc.sim, fast_forward=fast_forward))
    return run_scenario(sc).summary


def test_kvquant4_tpot_is_a_few_percent_over_int4_stepping_and_fast_forward():
    runs = {
        (name, ff): _decode_heavy(fmt, ff, **kv)
        for name, fmt, kv in (
            ("int4", "int4", {}),
            ("kvquant4", "kvquant4", {}),
            ("kvquant4/0%", "kvquant4", {"outlier_fraction": 0.0}),
        )
        for ff in (True, False)
    }
    for name in ("int4", "kvquant4", "kvquant4/0%"):
        assert runs[(name, True)]["tpot_s"] == runs[(name, False)]["tpot_s"]  # float for float
    tpot = {name: runs[(name, True)]["tpot_s"]["mean"] for name in ("int4", "kvquant4", "kvquant4/0%")}
    # The documents' outlier path: about 3-5% of a decode step (000, section 3.3).
    assert 1.02 < tpot["kvquant4"] / tpot["int4"] < 1.08  # 1.054 here, where attention is heavy
    # No outliers: int4's decode attention; 66 B a vector written instead of 72 (a hair faster).
    assert tpot["kvquant4/0%"] == pytest.approx(tpot["int4"], rel=2e-3)
    assert tpot["kvquant4/0%"] <= tpot["int4"]


def test_profile_without_the_format_is_refused_naming_what_it_has():
    sc = small_scenario(
        cluster={"gpu": "h200-sxm"}, kv={"format": "int4"}, cost_model={"kind": "profile", "profile": AIC}
    )
    with pytest.raises(KvsimError) as exc:
        make_cost_model(sc)
    assert exc.value.path == "ops.paged_decode" and exc.value.source.endswith(AIC.split("/")[-1])
    assert "int4/g64 (it has bf16, fp8_e4m3/per_tensor)" in exc.value.message
    forced = small_scenario(
        cluster={"gpu": "h200-sxm"},
        kv={"format": "int4"},
        cost_model={"kind": "profile", "profile": AIC, "force": True},
    )
    notes = make_cost_model(forced).warnings()
    assert any("paged_decode was not measured for KV format int4/g64" in n for n in notes)
    assert any(
        "kv_write not measured (schema 1.1 op); quantize-on-write priced by the analytic" in n for n in notes
    )


def test_profile_without_kvquant4_rates_adds_its_outlier_merge_and_says_so():
    base = {"cluster": {"gpu": "h200-sxm"}, "cost_model": {"kind": "profile", "profile": AIC, "force": True}}
    kvq = make_cost_model(small_scenario(kv={"format": "kvquant4"}, **base))
    zero = make_cost_model(small_scenario(kv={"format": "kvquant4", "outlier_fraction": 0.0}, **base))
    assert isinstance(kvq, ProfileCostModel) and isinstance(zero, ProfileCostModel)
    merge = kvq.analytic.outlier_merge_s(kvq.fmt)
    assert merge == pytest.approx(OUTLIER_OPS / (kvq.analytic.gpu.bf16_flops / 15), rel=1e-12)
    assert kvq._outlier_s_per_token == merge and zero._outlier_s_per_token == 0.0
    assert any(
        "paged_decode's bf16 rates for KV format kvquant4/1.0%: kvquant4's outlier merge (added)" in n
        for n in kvq.warnings()
    )
    assert not any("outlier merge" in n for n in zero.warnings())
    # The bf16 rates scaled by kvquant4's bytes (its outliers' included), plus the merge.
    ctx = np.array([32 * 3000.0])
    tokens = 32 * 3000.0 + 32
    scaled = (kvq.kv_bytes_per_token_layer / zero.kv_bytes_per_token_layer) * zero._decode_attn_time(32, ctx)
    assert kvq._decode_attn_time(32, ctx)[0] == pytest.approx(scaled[0] + tokens * merge, rel=1e-12)


def test_profile_with_kvquant4_rates_adds_only_the_difference_of_outliers():
    prof = _synthetic()
    for op in ("paged_decode", "chunked_prefill"):
        prof["ops"][op]["points"] = [{**p, "format": "kvquant4/1.0%"} for p in prof["ops"][op]["points"]]
    prof["kv_formats"] = ["kvquant4/1.0%"]
    ana = _analytic(format="kvquant4")

    def model(fraction: float) -> ProfileCostModel:
        fmt = format_from_name(f"kvquant4/{fraction:.1%}")
        return ProfileCostModel(prof, ana.model, 1, fmt, ana, source="t.json", label="t.json")

    same, more = model(0.01), model(0.03)  # 2 and 4 outliers a vector
    assert same._outlier_s_per_token == 0.0 and same._prefill_outlier_s == [0.0]
    assert not any("outlier merge" in n for n in same.warnings())
    assert more._outlier_s_per_token == pytest.approx(ana.outlier_merge_s(ana.fmt), rel=1e-12)  # 2 more
    assert any("kvquant4/1.0% rates for KV format kvquant4/3.0%" in n for n in more.warnings())


def test_fast_forward_equals_stepping_with_a_profile_and_kvquant4():
    a, _ = profile_under_load("kv.format=kvquant4", "cost_model.force=true")
    assert any("outlier merge" in w for w in a.summary["warnings"])


def _fp8_profile(fp8_time: float, *, bf16: bool = True) -> dict:
    """The synthetic profile with fp8 decode and prefill points `fp8_time` times bf16's (at half the
    bytes, so fp8's modelled time is exactly that multiple); without its bf16 points if not `bf16`."""
    prof = _synthetic()
    for op in ("paged_decode", "chunked_prefill"):
        pts = prof["ops"][op]["points"]
        fp8 = [
            {
                **p,
                "format": "fp8_e4m3/per_tensor",
                "bytes": p["bytes"] / 2,
                **{k: p[k] * fp8_time for k in ("t_p20", "t_p50", "t_p80")},
            }
            for p in pts
        ]
        prof["ops"][op]["points"] = (pts if bf16 else []) + fp8
    return prof


def _sign_model(tmp_path: Path, prof: dict, fmt: str = "fp8", **kv: object) -> ProfileCostModel:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    sc = small_scenario(kv={"format": fmt, **kv}, cost_model={"kind": "profile", "profile": str(path)})
    cm = make_cost_model(sc)
    assert isinstance(cm, ProfileCostModel)
    return cm


def test_a_profile_that_disagrees_with_the_fitted_model_on_a_formats_direction_says_so(tmp_path):
    # The fitted H100 model: fp8 decode attention 1.26x faster. This profile: fp8 twice as slow.
    cm = _sign_model(tmp_path, _fp8_profile(2.0))
    (line,) = cm.format_sign_warnings(8, 1000.0)
    assert line.startswith(
        "cost model: the profile and the fitted analytic model disagree on fp8_e4m3/per_tensor's "
        "direction: a decode step of 8 sequences x 1,000 tokens (the run's mean) takes +"
    )
    assert "on analytic (fitted to aiconfigurator h100_sxm tables)" in line and "% vs bf16" in line
    # Agreeing (fp8 faster on both), a bf16 cache, a profile with no bf16 to compare: silent.
    assert _sign_model(tmp_path, _fp8_profile(0.5)).format_sign_warnings(8, 1000.0) == []
    assert _sign_model(tmp_path, _fp8_profile(2.0), "bf16").format_sign_warnings(8, 1000.0) == []
    no_bf16 = _sign_model(tmp_path, _fp8_profile(2.0, bf16=False))
    assert no_bf16.format_sign_warnings(8, 1000.0) == []
    # A change too small for a direction (under 0.1% of the step), and the analytic model itself.
    assert _sign_model(tmp_path, _fp8_profile(1.001)).format_sign_warnings(8, 1000.0) == []
    assert _analytic(format="fp8").format_sign_warnings(8, 1000.0) == []


def test_the_run_warns_once_at_its_typical_shape_stepping_and_fast_forward(tmp_path):
    wl = {"synthetic": {"num_requests": 12, "rate": 50, "input": {"dist": "constant", "mean": 600}}}
    for fp8_time, warned in ((2.0, 1), (0.5, 0)):
        path = tmp_path / f"p{fp8_time}.json"
        path.write_text(json.dumps(_fp8_profile(fp8_time)))
        sc = small_scenario(
            kv={"format": "fp8"}, workload=wl, cost_model={"kind": "profile", "profile": str(path)}
        )
        res = run_scenario(sc)
        lines = [w for w in res.summary["warnings"] if "disagree on fp8_e4m3/per_tensor" in w]
        assert len(lines) == warned
        stepped = run_scenario(dataclasses.replace(sc, sim=dataclasses.replace(sc.sim, fast_forward=False)))
        assert stepped.summary["warnings"] == res.summary["warnings"]  # the shape is the requests'
    finished = [r for r in res.seqs if r.output_len > 1]
    n, ctx = typical_shape(finished, math.fsum(s.busy_s for s in res.stats)) or (0, 0.0)
    assert 1 <= n <= 12 and 600 < ctx < 600 + max(r.output_len for r in finished)
    assert typical_shape([], 1.0) is None


def test_profile_prices_each_part_of_a_mix_at_its_own_rates():
    base = {"cluster": {"gpu": "h200-sxm"}, "cost_model": {"kind": "profile", "profile": AIC}}
    bf16 = make_cost_model(small_scenario(kv={"format": "bf16"}, **base))
    fp8 = make_cost_model(small_scenario(kv={"format": "fp8"}, **base))
    half = make_cost_model(
        small_scenario(kv={"format": "bf16", "format_mix": {"format": "fp8", "share": 0.5}}, **base)
    )
    ctx = np.array([8 * 4000.0])
    a, b, m = (c._decode_attn_time(8, ctx)[0] for c in (bf16, fp8, half))
    assert m == pytest.approx(0.5 * a + 0.5 * b, rel=1e-12)
    pa, pb, pm = (c._prefill_attn_time(1024, 2048) for c in (bf16, fp8, half))
    assert pm == pytest.approx(0.5 * pa + 0.5 * pb, rel=1e-12)


def test_accuracy_estimate_names_both_parts_of_a_mix():
    sc = small_scenario(kv=MIX)
    note = accuracy_note(sc.kv.format, None, sc.kv.format_mix)
    assert note is not None and note["estimate_only"] is True
    assert note["format"] == "int8/g64 with 6/8 heads int4/g64"
    sources = [c["source"] for c in note["literature"]]
    assert any("KV Cache INT8" in s for s in sources) and any("KV Cache INT4" in s for s in sources)
    e8 = accuracy_note(sc.kv.format, None)["kernel_rel_rms"]  # type: ignore[index]
    e4 = accuracy_note(sc.kv.format_mix.format, None)["kernel_rel_rms"]  # type: ignore[index,union-attr]
    assert note["kernel_rel_rms"] == pytest.approx((0.25 * e8**2 + 0.75 * e4**2) ** 0.5)
    assert accuracy_note(small_scenario().kv.format, None) is None


def test_mla_prefill_over_a_prefix_pays_the_latent_up_projection():
    """DeepSeek-V3 (MLA, 128 heads, kv_lora_rank 512, nope 128 + v 128) on 8 GPUs: a chunk over a
    cached prefix up-projects the prefix's latents first; a chunk without prefix does not."""
    sc = small_scenario(
        model="deepseek-v3", cluster={"gpu": "h200-sxm", "gpus_per_node": 8, "tensor_parallel": 8}
    )
    cm = _analytic_of(sc)
    w = cm.work
    assert w.mla_upproj_flops_per_token == 2.0 * 512 * (128 // 8) * (128 + 128) * 61
    p = cm.ops.prefill_attn  # the fitted H200 prefill: e_max plus the ramp on the chunk's own pairs
    rate = cm.gpu.bf16_flops * p.e_max
    ramp = w.prefill_attn_flops(512, 0) * p.n_half / 512
    plain = max(
        (w.prefill_attn_flops(512, 8192) + ramp) / rate,
        w.prefill_kv_bytes(512, 8192) / (cm.bw * p.e_kv),
    )
    assert cm._prefill_attn_time(512, 8192) == pytest.approx(
        (w.prefill_attn_flops(512, 8192) + 8192 * w.mla_upproj_flops_per_token + ramp) / rate, rel=1e-12
    )
    assert cm._prefill_attn_time(512, 8192) > plain
    assert w.mla_upproj_flops(0) == 0.0
    gqa = _analytic(format="bf16")
    assert gqa.work.mla_upproj_flops_per_token == 0.0


def _analytic_of(sc):  # type: ignore[no-untyped-def]
    cm = make_cost_model(sc)
    assert isinstance(cm, AnalyticCostModel)
    return cm

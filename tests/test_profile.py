"""The measured-profile cost model: loading, validation, interpolation, extrapolation, matching."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from kvsim.costs.analytic import AnalyticCostModel
from kvsim.costs.base import ForwardBatch, StepRun
from kvsim.costs.profile import ProfileCostModel, RateTable, load_profile_cost_model
from kvsim.costs.profile_schema import gpu_matches, load_profile
from kvsim.costs.work import attn_flops_per_pair_layer, causal_pairs
from kvsim.errors import KvsimError
from tests.helpers import small_scenario

SHIPPED = "scenarios/profiles/cpu-quick-llama-3.1-8b.json"


def _synthetic(model_name: str = "llama-3.1-8b") -> dict:
    """A hand-made profile (test input only): times follow simple power laws of the sizes."""
    sc = small_scenario()
    m = sc.model
    pts_gemm = [
        {"layer": layer, "m": mm, "t_p20": t, "t_p50": t, "t_p80": t, "bytes": 1.0, "flops": 2.0 * mm * 1e9}
        for layer in ("qkv", "o", "gate_up", "down", "lm_head")
        for mm, t in ((1, 1e-4), (16, 2e-4), (256, 3e-3))
    ]
    pts_dec = [
        {
            "batch": b,
            "context": c,
            "format": "bf16",
            "t_p20": 1e-6 * b * c**0.9,
            "t_p50": 1e-6 * b * c**0.9,
            "t_p80": 1e-6 * b * c**0.9,
            "bytes": 4096.0 * b * c,
            "flops": 1.0,
        }
        for b in (1, 8)
        for c in (128, 1024)
    ]
    pts_pre = [
        {
            "chunk": n,
            "prefix": p,
            "format": "bf16",
            "t_p20": 1e-5 * n,
            "t_p50": 1e-5 * n,
            "t_p80": 1e-5 * n,
            "bytes": 1.0,
            "flops": float(attn_flops_per_pair_layer(m, 1) * causal_pairs(n, p)),
        }
        for n in (32, 256)
        for p in (0, 512)
    ]
    shapes = {
        k: getattr(m, k)
        for k in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size")
    }
    return {
        "schema": "kvsim-profile",
        "version": 1,
        "kind": "measured",
        "backend": "cuda",
        "device": {"name": "NVIDIA H100 80GB HBM3", "memory_bytes": 1, "driver": None, "cuda": "12"},
        "model": {"name": model_name, **shapes},
        "tp": 1,
        "kv_formats": ["bf16"],
        "ops": {
            "gemm": {"points": pts_gemm},
            "paged_decode": {"points": pts_dec},
            "chunked_prefill": {"points": pts_pre},
        },
        "complete": True,
    }


def _write(tmp_path: Path, data: object, name: str = "p.json") -> Path:
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return p


def _model(tmp_path: Path, data: dict | None = None, **cost_model) -> ProfileCostModel:
    p = _write(tmp_path, data or _synthetic())
    sc = small_scenario(cost_model={"kind": "profile", "profile": str(p), **cost_model})
    return load_profile_cost_model(sc)


def test_round_trip_and_name(tmp_path):
    data = _synthetic()
    p = _write(tmp_path, data)
    assert load_profile(p) == data
    assert _model(tmp_path).name == "profile:p.json"


def test_exact_on_grid_points_and_monotone_between(tmp_path):
    cm = _model(tmp_path)
    # GEMM: with the profile's FLOPs equal to the scenario's, time at m on the grid is the measurement.
    table = cm._gemm["qkv"]
    rate, out = table(np.array([1.0, 16.0, 256.0]))
    assert rate == pytest.approx([2e9 / 1e-4, 32e9 / 2e-4, 512e9 / 3e-3], rel=1e-12)
    assert not out.any()
    ms = np.arange(1, 257, dtype=np.float64)
    r, _ = table(ms)
    t = 2.0 * ms * 1e9 / r
    assert np.all(np.diff(t) > 0)
    # Decode: the scenario's KV bytes equal the profile's, so the per-layer time on a grid point is exact.
    per_layer = cm._decode_attn_time(8, np.array([8 * 1024 - 8.0])) / cm.model.num_layers
    assert cm.kv_bytes_per_token_layer == 4096
    assert per_layer[0] == pytest.approx(1e-6 * 8 * 1024**0.9, rel=1e-12)
    ctx = np.linspace(128 * 8, 1024 * 8, 200) - 8
    times = cm._decode_attn_time(8, ctx)
    assert np.all(np.diff(times) > 0)
    assert cm.warnings() == []


def test_extrapolation_holds_the_edge_rate_and_warns(tmp_path):
    cm = _model(tmp_path)
    inside = cm._decode_attn_time(8, np.array([8 * 1024 - 8.0]))[0]
    outside = cm._decode_attn_time(8, np.array([8 * 4096 - 8.0]))[0]
    assert outside == pytest.approx(4 * inside, rel=1e-12)  # rate held, work x4
    assert cm.warnings() == []  # pricing a candidate step is not running it
    assert cm.step_off_grid(StepRun.decode(8, np.array([8 * 1024 - 8.0]))) == frozenset()
    ran = cm.step_off_grid(StepRun.decode(8, np.array([8 * 1024 - 8.0, 8 * 4096 - 8.0])))
    assert ran == {"paged_decode"}
    assert cm.warnings() == []  # asking the flags records nothing either
    assert any("paged_decode extrapolated" in w for w in cm.warnings(ran))


def test_a_prefix_beyond_the_grid_adds_its_pairs_at_the_best_rate_or_its_bytes(tmp_path):
    cm = _model(tmp_path)  # prefill grid: chunk 32/256 x prefix 0/512
    layers, pair = cm.model.num_layers, cm.attn_flops_per_pair_layer
    edge = cm._prefill_attn_time(32, 512)
    assert cm.prefix_extrapolated_s(32, 512) == 0.0  # on the grid: nothing extrapolated
    far = 512 + 100_000
    extra = cm.prefix_extrapolated_s(32, far)
    assert cm._prefill_attn_time(32, far) == pytest.approx(edge + extra, rel=1e-12)
    best = max(pt["flops"] / pt["t_p50"] for pt in _synthetic()["ops"]["chunked_prefill"]["points"])
    pairs = layers * pair * (causal_pairs(32, far) - causal_pairs(32, 512)) / best
    # the further prefix: its pairs at the best measured rate, or its bytes at batch-1 decode speed
    dec_rate = 4096.0 * 1024 / (1e-6 * 1024**0.9)  # held at the decode grid's longest context
    nbytes = layers * 100_000 * cm.kv_bytes_per_token_layer / dec_rate
    assert extra == pytest.approx(max(pairs, nbytes), rel=1e-9)
    # Not the short chunk's rate held over the whole prefix (the rule before issue 29).
    held = layers * pair * causal_pairs(32, far) / (pair * causal_pairs(32, 512) / (1e-5 * 32))
    assert cm._prefill_attn_time(32, far) < held
    assert cm._prefill_attn_time(32, far + 1000) > cm._prefill_attn_time(32, far)


def test_the_run_warns_the_share_of_busy_time_priced_beyond_the_measured_prefixes(tmp_path):
    from kvsim.run import run_scenario

    p = _write(tmp_path, _synthetic())
    sc = small_scenario(
        cost_model={"kind": "profile", "profile": str(p)},
        scheduler={"max_batched_tokens": 256, "chunked_prefill": True},
        workload={
            "synthetic": {
                "num_requests": 2,
                "rate": 1,
                "input": {"dist": "constant", "mean": 4096},
                "output": {"dist": "constant", "mean": 4},
            }
        },
    )
    res = run_scenario(sc)
    extra = sum(s.prefix_extrapolated_s for s in res.stats)
    busy = sum(s.busy_s for s in res.stats)
    assert 0 < extra < busy
    lines = [w for w in res.summary["warnings"] if "cached prefixes longer than its tables hold" in w]
    assert len(lines) == 1
    assert lines[0].startswith(f"cost model: {extra / busy:.1%} of the replicas' busy time")
    # Stepping one by one sums the same seconds as the fast-forward windows did.
    step = run_scenario(dataclasses.replace(sc, sim=dataclasses.replace(sc.sim, fast_forward=False)))
    assert sum(s.prefix_extrapolated_s for s in step.stats) == pytest.approx(extra, rel=1e-9)


def test_decode_step_times_agree_with_step_time(tmp_path):
    cm = _model(tmp_path)
    ctxs = [(100, 300, 700), (128, 128, 128), (5000, 1, 20)]
    sums = np.array([sum(c) for c in ctxs], dtype=np.int64)
    vec = cm.decode_step_times(3, sums)
    for j, c in enumerate(ctxs):
        assert vec[j] == cm.step_time(ForwardBatch.decode(c))


def test_rate_table_rejects_a_ragged_grid():
    with pytest.raises(KvsimError, match="not rectangular"):
        RateTable.build("paged_decode", [(1, 1), (1, 2), (2, 1)], [1.0, 2.0, 3.0], "p.json")


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d.update(schema="other"), "schema"),
        (lambda d: d.update(version=2), "version"),
        (lambda d: d.pop("device"), "device"),
        (lambda d: d["ops"]["gemm"]["points"][0].update(t_p50=0.0), "ops.gemm.points[0].t_p50"),
        (lambda d: d["ops"]["gemm"]["points"][0].update(t_p20=-1.0), "ops.gemm.points[0].t_p20"),
        (lambda d: d["model"].pop("head_dim"), "model.head_dim"),
    ],
)
def test_bad_profiles_give_one_line_errors(tmp_path, mutate, field):
    data = copy.deepcopy(_synthetic())
    mutate(data)
    p = _write(tmp_path, data)
    with pytest.raises(KvsimError) as exc:
        load_profile(p)
    msg = str(exc.value)
    assert "\n" not in msg and str(p) in msg and field in msg


def test_corrupt_json(tmp_path):
    p = _write(tmp_path, '{"schema": "kvsim-profile", ')
    with pytest.raises(KvsimError, match="invalid JSON") as exc:
        load_profile(p)
    assert str(p) in str(exc.value) and "\n" not in str(exc.value)


def test_gpu_and_model_mismatch_refused_unless_forced(tmp_path):
    data = _synthetic()
    data["device"]["name"] = "NVIDIA H200"
    p = _write(tmp_path, data)
    sc = small_scenario(cost_model={"kind": "profile", "profile": str(p)})
    with pytest.raises(KvsimError, match="does not match the scenario's GPU h100-sxm") as exc:
        load_profile_cost_model(sc)
    assert exc.value.source == str(p) and "\n" not in str(exc.value)
    data = _synthetic()
    data["model"]["hidden_size"] = 5120
    with pytest.raises(KvsimError, match="set cost_model.force"):
        _model(tmp_path, data)
    forced = _model(tmp_path, data, force=True)
    assert any("scaled to" in w for w in forced.warnings())


def test_gpu_name_matching():
    assert gpu_matches("NVIDIA H100 80GB HBM3", "cuda", "h100-sxm")
    assert gpu_matches("NVIDIA H200", "cuda", "h200-sxm*")
    assert not gpu_matches("NVIDIA H100 80GB HBM3", "cuda", "a100-80gb")
    assert not gpu_matches("CPU: H100 lookalike", "cpu", "h100-sxm")


def test_shipped_cpu_profile_loads_and_is_labelled():
    sc = small_scenario(cost_model={"kind": "profile", "profile": SHIPPED, "force": True})
    cm = load_profile_cost_model(sc)
    assert "cpu profile: timings are from a CPU, not a GPU" in cm.warnings()
    with pytest.raises(KvsimError, match="does not match"):
        load_profile_cost_model(small_scenario(cost_model={"kind": "profile", "profile": SHIPPED}))
    # Same decomposition as the analytic model: transfers fall back to it for unmeasured links.
    analytic = AnalyticCostModel(sc.model, sc.cluster.gpu, 1, sc.kv.format, sc.cluster.topology)
    h2d = sc.cluster.topology.host_h2d
    assert cm.transfer_time(1e6, h2d) == analytic.transfer_time(1e6, h2d)
    assert cm.transfer_price(1e6, h2d).off_grid == {"link:host_h2d"}
    assert "profile: link host_h2d not measured; analytic transfer time used" in cm.warnings(
        frozenset({"link:host_h2d"})
    )

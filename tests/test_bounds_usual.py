"""The usual ranges of `kvsim.spec.bounds`: a legal value far from any real device is a warning
naming its field; the presets lie inside them; validate's CPU peaks do not warn."""

from __future__ import annotations

import pytest

from kvsim.spec import bounds as B
from kvsim.spec.hardware import PRESETS as GPU_PRESETS
from kvsim.spec.topology import PRESETS as TOPOLOGY_PRESETS
from kvsim.validation import _read_setup, _scenario
from tests.helpers import ROOT, small_scenario

FAR = "is legal but far from any real device"


def test_every_gpu_and_link_preset_lies_in_the_usual_ranges():
    for name, g in GPU_PRESETS.items():
        assert B.far(g.bf16_flops, B.FLOPS) is None, name
        assert B.far(g.fp8_flops, B.FLOPS) is None, name  # 0 (no FP8 tensor cores) is deliberate
        assert B.far(g.hbm_bw_bytes_per_s, B.HBM_BW) is None, name
        assert B.far(g.hbm_bytes, B.HBM_SIZE) is None, name
        assert B.far(g.usd_per_hour, B.PRICE) is None, name
    for name, t in TOPOLOGY_PRESETS.items():
        for link in (t.host_h2d, t.host_d2h, t.nvlink, t.network):
            assert B.far(link.bw_bytes_per_s, B.LINK_BW) is None, (name, link.name)


@pytest.mark.parametrize(
    ("value", "bound", "shown"),
    [
        (9e12, B.FLOPS, "9 TFLOP/s"),
        (21e15, B.FLOPS, "21 PFLOP/s"),
        (99e9, B.HBM_BW, "99 GB/s"),
        (21e12, B.HBM_BW, "21 TB/s"),
        (7 * 2**30, B.HBM_SIZE, "7 GiB"),
        (2**41, B.HBM_SIZE, "2 TiB"),
        (99e6, B.LINK_BW, "99 MB/s"),
        (0.09, B.PRICE, "$0.09/h"),
        (101.0, B.PRICE, "$101/h"),
    ],
)
def test_just_outside_a_usual_range_warns_with_the_range_and_its_source(value, bound, shown):
    why = B.far(value, bound)
    assert why is not None and why.startswith(f"{shown} {FAR} (usual ") and B.SOURCE in why
    lo, hi = bound.usual or (0.0, 0.0)
    assert B.far(lo, bound) is None and B.far(hi, bound) is None  # the edges are usual


def test_a_far_value_is_a_warning_of_its_field_and_a_usual_one_none():
    sc = small_scenario(cluster={"gpu": {"preset": "h100-sxm", "bf16_flops": "5TFLOP/s"}})
    assert [n for n in sc.notes if FAR in n] == [
        "test.yaml: cluster.gpu.bf16_flops: 5 TFLOP/s is legal but far from any real device "
        "(usual 10 TFLOP/s..20 PFLOP/s, kvsim/spec/bounds.py)"
    ]
    assert small_scenario(cluster={"gpu": {"preset": "h100-sxm", "bf16_flops": "500TFLOP/s"}}).notes == ()


def test_validate_on_a_cpu_sets_the_peaks_and_hbm_without_a_warning():
    setup = _read_setup(ROOT / "scenarios" / "validate_burst.yaml")
    cpu = {"bf16_flops": 100e9, "hbm_bw": 10e9}  # what a 2-core CPU measures
    kw = {"model_ref": "llama-3.1-8b", "num_blocks": 64, "block_bytes": 131072.0 * 16, "weight_bytes": 2**20}
    sc = _scenario(setup, gpu_peaks=cpu, **kw)  # type: ignore[arg-type]
    assert sc.cluster.gpu.bf16_flops == 100e9 and sc.cluster.gpu.hbm_bytes < 2**30
    assert not [n for n in sc.notes if FAR in n]

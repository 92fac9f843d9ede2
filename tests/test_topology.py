"""The topology spec: link presets with sources, scenario overrides, the older cluster.gpu keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsim.costs.analytic import AnalyticCostModel
from kvsim.spec.hardware import PRESETS as GPUS
from kvsim.spec.scenario import load_scenario
from kvsim.spec.topology import LINK_NAMES, PRESETS
from tests.helpers import small_scenario

VALID = Path(__file__).parent / "scenarios" / "valid"


def test_every_gpu_preset_has_a_topology_with_sources():
    assert set(PRESETS) == set(GPUS)
    for name, topo in PRESETS.items():
        keys = {k for k, _ in topo.sources}
        assert {"host link", "nvlink", "internode", "per-call overhead", "link latency"} <= keys, name
        for link in LINK_NAMES:
            assert topo.link(link).bw_bytes_per_s > 0
    h100 = PRESETS["h100-sxm"]
    assert (h100.host_h2d.bw_bytes_per_s, h100.host_d2h.bw_bytes_per_s) == (35.2e9, 52.8e9)  # nvbandwidth#24
    assert h100.nvlink.bw_bytes_per_s == 450e9 and h100.network.bw_bytes_per_s == 50e9
    assert h100.host_h2d.per_call_overhead_s == 2.3e-6  # FlexKV PR #193/#203
    # Without NVLink, peer copies (and all-reduces) go over PCIe at its generation's rate.
    assert PRESETS["h100-pcie"].nvlink.bw_bytes_per_s == 64e9
    assert PRESETS["l40s"].nvlink.bw_bytes_per_s == 32e9
    with pytest.raises(KeyError, match="links: host_h2d"):
        h100.link("pcie")


def test_scenario_overrides_each_link_field():
    topo = load_scenario(VALID / "topology.yaml").cluster.topology
    assert topo.host_h2d.bw_bytes_per_s == 30e9 and topo.host_d2h.bw_bytes_per_s == 45e9
    for link in (topo.host_h2d, topo.host_d2h):
        assert link.latency_s == pytest.approx(5e-6) and link.per_call_overhead_s == pytest.approx(8e-6)
        assert link.shared_by == 2
    assert topo.nvlink.bw_bytes_per_s == 380e9 and topo.nvlink.shared_by == 1
    assert topo.network.bw_bytes_per_s == 25e9 and topo.network.latency_s == pytest.approx(10e-6)
    assert topo.node.host_dram_bytes == 2**40
    assert ("pcie", "scenario override") in topo.sources


def test_pcie_bw_sets_both_directions():
    sc = small_scenario(cluster={"gpu": "h100-sxm", "topology": {"pcie": {"bw": "50GB/s"}}})
    t = sc.cluster.topology
    assert t.host_h2d.bw_bytes_per_s == t.host_d2h.bw_bytes_per_s == 50e9
    assert t.host_h2d.per_call_overhead_s == PRESETS["h100-sxm"].host_h2d.per_call_overhead_s


def test_the_older_gpu_link_keys_still_read():
    sc = load_scenario(VALID / "full.yaml")  # cluster.gpu: {preset: h100-sxm, host_h2d: 40GB/s}
    assert sc.cluster.topology.host_h2d.bw_bytes_per_s == 40e9
    assert sc.cluster.topology.host_d2h.bw_bytes_per_s == 52.8e9
    sc = small_scenario(cluster={"gpu": {"preset": "a100", "nvlink": "200GB/s"}})
    assert sc.cluster.topology.nvlink.bw_bytes_per_s == 200e9
    assert sc.cluster.host_dram_bytes == 2 * 2**40


def test_all_reduce_runs_over_the_topology_nvlink():
    def comm(nvlink: str) -> float:
        sc = small_scenario(
            cluster={
                "gpu": "h100-sxm",
                "gpus_per_node": 2,
                "tensor_parallel": 2,
                "topology": {"nvlink": {"bw": nvlink}},
            }
        )
        c = sc.cluster
        return AnalyticCostModel(sc.model, c.gpu, 2, sc.kv.format, c.topology)._comm_time(4096)

    slow, fast = comm("100GB/s"), comm("400GB/s")
    latency = 64 * 10e-6  # two all-reduces per layer at 10 us each
    assert slow - latency == pytest.approx(4 * (fast - latency), rel=1e-12)

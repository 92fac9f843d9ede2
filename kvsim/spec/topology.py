"""The cluster's topology: the links a GPU moves bytes over and the node it sits in.

A `Link` has a bandwidth in each direction it is used (host-to-device and device-to-host are two
links, their measured rates differ), a latency paid once per transfer, an overhead paid per copy
call, and the number of GPUs that share it. Moving ``nbytes`` in ``num_calls`` copies takes
``latency + num_calls x per_call_overhead + nbytes / bandwidth`` (`kvsim.costs.base.transfer_time`):
a per-block ``cudaMemcpyAsync`` loop pays the per-call overhead per block, a batched gather kernel
once. `NodeSpec` holds host DRAM per node (a node's SSD is configured with its tier,
``kv.offload.ssd``: `kvsim.spec.offload`).

Presets follow the GPU preset (a GPU's host link and NVLink come with its platform); each number
names its source in `Topology.sources` (../shared/REFERENCE.md unless noted). A scenario overrides
them under ``cluster.topology`` (`read_topology`). Contention between the sharers is the SimPy
shell's (`kvsim.sim.links`: one FIFO queue per direction per group of ``shared_by`` GPUs). Left
out: NUMA, PCIe switches below the root complex, multi-rail networks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvsim.spec import bounds as B
from kvsim.spec.bounds import bounded
from kvsim.spec.schema import Section
from kvsim.units import parse_bandwidth, parse_duration


@dataclass(frozen=True)
class Link:
    """One direction of one link, per GPU."""

    name: str
    bw_bytes_per_s: float
    latency_s: float  # once per transfer
    per_call_overhead_s: float  # per copy call (launch and driver work)
    shared_by: int = 1  # GPUs whose transfers share this bandwidth

    def __post_init__(self) -> None:
        assert self.bw_bytes_per_s > 0 and self.latency_s >= 0 and self.per_call_overhead_s >= 0
        assert self.shared_by >= 1


@dataclass(frozen=True)
class NodeSpec:
    host_dram_bytes: int  # per node


SHARINGS = ("fifo", "fair")


@dataclass(frozen=True)
class Topology:
    host_h2d: Link  # PCIe, pinned host memory -> GPU
    host_d2h: Link  # PCIe, GPU -> pinned host memory
    nvlink: Link  # GPU <-> GPU within a node: NVLink, or PCIe peer copies where there is none
    network: Link  # GPU <-> GPU across nodes, per GPU's NIC
    node: NodeSpec
    sources: tuple[tuple[str, str], ...] = ()
    # How concurrent transfers on one link direction share it (`kvsim.sim.links`): fifo (one at a
    # time, first come first served) or fair (processor sharing: equal shares of the bandwidth).
    sharing: str = "fifo"

    def link(self, name: str) -> Link:
        """The link named ``host_h2d``, ``host_d2h``, ``nvlink`` or ``network``."""
        if name not in LINK_NAMES:
            raise KeyError(f"unknown link {name!r}; links: {', '.join(LINK_NAMES)}")
        return getattr(self, name)  # type: ignore[no-any-return]


LINK_NAMES = ("host_h2d", "host_d2h", "nvlink", "network")

# ---- presets ------------------------------------------------------------------------------------
# Per-call cost of one cudaMemcpyAsync: about 2.3 us (FlexKV PR #193/#203); one copy per 32 KB
# block reaches only 6-15 GB/s while gather kernels reach link rate (vLLM swap_blocks).
MEMCPY_CALL_S = 2.3e-6
# Peer copies and RDMA go through the same copy engines and driver calls: the same figure, an
# estimate (no measurement on file). Link latency beyond the per-call cost: none on file for
# PCIe and NVLink (the 2.3 us covers launch and first bytes); network one-sided RDMA about 5 us,
# an estimate of NDR InfiniBand's small-message latency (no measurement on file).
NETWORK_LATENCY_S = 5e-6
DEFAULT_HOST_DRAM = 2 * 2**40  # DGX H100 / HGX reference: 2 TB of system memory per node

_PCIE_THEORETICAL = {4: 32e9, 5: 64e9, 6: 128e9}  # x16, per direction (PCI-SIG spec)
_H100_PCIE_MEAS = "H2D 35.2 / D2H 52.8 GB/s pinned, measured on H100 PCIe Gen5 (NVIDIA/nvbandwidth#24)"
_CALLS = (
    (
        "per-call overhead",
        "2.3 us per cudaMemcpyAsync (FlexKV PR #193/#203); peer and RDMA copies assumed alike",
    ),
    (
        "link latency",
        "none beyond the per-call cost for PCIe/NVLink; network 5 us (estimate, no measurement)",
    ),
    ("shared by", "each GPU its own PCIe x16, NVLink and NIC (estimate; set cluster.topology.*.shared_by)"),
    ("host dram", "2 TiB per node (DGX H100 system memory); set cluster.host_dram"),
)


def _preset(
    h2d: float, d2h: float, nvlink: float, network: float, pcie_gen: int, sources: dict[str, str]
) -> Topology:
    peer = nvlink or _PCIE_THEORETICAL[pcie_gen]  # no NVLink: peer copies over PCIe
    return Topology(
        host_h2d=Link("host_h2d", h2d, 0.0, MEMCPY_CALL_S),
        host_d2h=Link("host_d2h", d2h, 0.0, MEMCPY_CALL_S),
        nvlink=Link("nvlink", peer, 0.0, MEMCPY_CALL_S),
        network=Link("network", network, NETWORK_LATENCY_S, MEMCPY_CALL_S),
        node=NodeSpec(DEFAULT_HOST_DRAM),
        sources=tuple(sources.items()) + _CALLS,
    )


_NDR = "400 Gb/s NDR per GPU = 50 GB/s (aiconfigurator system yaml)"
_NVLINK4_SPEC = "NVLink 4: 450 GB/s per direction (spec)"
PRESETS: dict[str, Topology] = {
    "h100-sxm": _preset(
        35.2e9,
        52.8e9,
        450e9,
        50e9,
        5,
        {
            "host link": _H100_PCIE_MEAS,
            "nvlink": "NVLink 4: 450 GB/s per direction (spec); ~380 measured (NVIDIA/nccl#1264)",
            "internode": _NDR,
        },
    ),
    "h100-pcie": _preset(
        35.2e9,
        52.8e9,
        0.0,
        50e9,
        5,
        {
            "host link": _H100_PCIE_MEAS,
            "nvlink": "none modelled (optional 2-GPU bridge); peer copies over PCIe",
            "internode": _NDR,
        },
    ),
    "h200-sxm": _preset(
        35.2e9,
        52.8e9,
        450e9,
        50e9,
        5,
        {
            "host link": "PCIe Gen5; H100's measurement used: " + _H100_PCIE_MEAS,
            "nvlink": _NVLINK4_SPEC,
            "internode": _NDR,
        },
    ),
    "a100-80gb": _preset(
        32e9,
        32e9,
        300e9,
        25e9,
        4,
        {
            "host link": "PCIe Gen4 x16 theoretical 32 GB/s; no published measurement on file",
            "nvlink": "NVLink 3: 600 GB/s total = 300 GB/s per direction (NVIDIA datasheet)",
            "internode": "200 Gb/s HDR per GPU = 25 GB/s (DGX A100 reference design)",
        },
    ),
    "b200": _preset(
        128e9,
        128e9,
        900e9,
        50e9,
        6,
        {
            "host link": "PCIe Gen6 x16 theoretical 128 GB/s; no published measurement on file",
            "nvlink": "NVLink 5: 1.8 TB/s total = 900 GB/s per direction (NVIDIA spec)",
            "internode": "400 Gb/s per GPU = 50 GB/s (DGX B200 reference design)",
        },
    ),
    "l40s": _preset(
        32e9,
        32e9,
        0.0,
        25e9,
        4,
        {
            "host link": "PCIe Gen4 x16 theoretical 32 GB/s; no published measurement on file",
            "nvlink": "none: peer copies over PCIe",
            "internode": "200 Gb/s per GPU = 25 GB/s (assumed NIC)",
        },
    ),
}


# ---- scenario overrides -------------------------------------------------------------------------
def _read_link(s: Section, gpus_per_node: int, bw_keys: tuple[str, ...]) -> dict[str, float | int]:
    out: dict[str, float | int] = {}
    for key in bw_keys:
        if s.has(key):
            out[key] = s.parsed(key, bounded(parse_bandwidth, B.LINK_BW))
    if s.has("latency"):
        out["latency_s"] = s.parsed(
            "latency", bounded(lambda v: parse_duration(v, allow_zero=True), B.LATENCY)
        )
    if s.has("per_call_overhead"):
        out["per_call_overhead_s"] = s.parsed(
            "per_call_overhead", bounded(lambda v: parse_duration(v, allow_zero=True), B.LATENCY)
        )
    if s.has("shared_by"):
        out["shared_by"] = s.int("shared_by", lo=1, hi=gpus_per_node)
    for key in (*bw_keys, "latency", "per_call_overhead", "shared_by"):
        s.raw(key, None)
    s.done()
    return out


def _apply(base: Link, changes: dict[str, float | int], bw: str | None) -> Link:
    common = {k: v for k, v in changes.items() if k in ("latency_s", "per_call_overhead_s", "shared_by")}
    if bw is not None and bw in changes:
        common["bw_bytes_per_s"] = changes[bw]
    return dataclasses.replace(base, **common)  # type: ignore[arg-type]


def read_topology(
    parent: Section,
    base: Topology,
    *,
    gpus_per_node: int,
    host_dram_bytes: int,
    legacy: dict[str, float],
) -> Topology:
    """``base`` with the overrides of ``parent.topology`` (``pcie``, ``nvlink``, ``network``), the
    host DRAM of ``cluster.host_dram`` and the bandwidths of the older ``cluster.gpu`` keys
    (``legacy``: ``host_h2d``, ``host_d2h``, ``nvlink``, in bytes/s; each may be given in one place
    only)."""
    t = parent.section("topology")
    src: list[tuple[str, str]] = []
    h2d, d2h, nvlink, network = base.host_h2d, base.host_d2h, base.nvlink, base.network
    if t.has("pcie"):
        p = Section(t.raw("pcie"), source=t.source, path=t._p("pcie"))
        ch = _read_link(p, gpus_per_node, ("bw", "h2d", "d2h"))
        if "bw" in ch and ("h2d" in ch or "d2h" in ch):
            raise p.err("bw", "give bw (both directions) or h2d/d2h, not both")
        for key in ("h2d", "d2h"):
            if ("bw" in ch or key in ch) and f"host_{key}" in legacy:
                raise p.err(key if key in ch else "bw", f"also set as cluster.gpu.host_{key}; give it once")
        h2d = _apply(h2d, ch, "h2d" if "h2d" in ch else "bw")
        d2h = _apply(d2h, ch, "d2h" if "d2h" in ch else "bw")
        src.append(("pcie", "scenario override"))
    else:
        t.raw("pcie", None)
    for name in ("nvlink", "network"):
        if not t.has(name):
            t.raw(name, None)
            continue
        s = Section(t.raw(name), source=t.source, path=t._p(name))
        ch = _read_link(s, gpus_per_node, ("bw",))
        if name == "nvlink" and "bw" in ch and "nvlink" in legacy:
            raise s.err("bw", "also set as cluster.gpu.nvlink; give it once")
        if name == "nvlink":
            nvlink = _apply(nvlink, ch, "bw")
        else:
            network = _apply(network, ch, "bw")
        src.append((name, "scenario override"))
    sharing = t.choice("sharing", SHARINGS, base.sharing)
    t.done()
    if "host_h2d" in legacy:
        h2d = dataclasses.replace(h2d, bw_bytes_per_s=legacy["host_h2d"])
    if "host_d2h" in legacy:
        d2h = dataclasses.replace(d2h, bw_bytes_per_s=legacy["host_d2h"])
    if "nvlink" in legacy:
        nvlink = dataclasses.replace(nvlink, bw_bytes_per_s=legacy["nvlink"])
    src.extend((k, "scenario override") for k in legacy)
    return Topology(
        h2d, d2h, nvlink, network, NodeSpec(host_dram_bytes), base.sources + tuple(src), sharing=sharing
    )

"""GPU presets: memory, bandwidth, compute, links and price, each number with its source.

"Measured" figures are third-party measurements (named); where none is published the theoretical
figure is used and the source says so. A measured profile from `kvsim calibrate` beats all of these.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from kvsim.errors import KvsimError

GiB = 2**30
MiB = 2**20


@dataclass(frozen=True)
class GPUSpec:
    name: str
    hbm_bytes: int  # memory the driver reports (what an engine can plan with)
    hbm_bw_bytes_per_s: float
    bf16_flops: float  # dense
    fp8_flops: float  # dense; 0 where the GPU has no FP8 tensor cores (falls back to BF16)
    pcie_gen: int
    host_h2d_bytes_per_s: float  # pinned host -> device, measured where published
    host_d2h_bytes_per_s: float
    nvlink_bytes_per_s: float  # per direction per GPU; 0 = no NVLink (PCIe peer copies)
    internode_bytes_per_s: float  # per GPU
    usd_per_hour: float
    sources: tuple[tuple[str, str], ...] = ()

    @property
    def host_link_theoretical_bytes_per_s(self) -> float:
        return {4: 32e9, 5: 64e9, 6: 128e9}[self.pcie_gen]


_H100_PCIE_MEAS = "H2D 35.2 / D2H 52.8 GB/s pinned, measured on H100 PCIe Gen5 (NVIDIA/nvbandwidth#24)"
PRESETS: dict[str, GPUSpec] = {
    "h100-sxm": GPUSpec(
        name="h100-sxm",
        hbm_bytes=81559 * MiB,
        hbm_bw_bytes_per_s=3.35e12,
        bf16_flops=989e12,
        fp8_flops=1979e12,
        pcie_gen=5,
        host_h2d_bytes_per_s=35.2e9,
        host_d2h_bytes_per_s=52.8e9,
        nvlink_bytes_per_s=450e9,
        internode_bytes_per_s=50e9,
        usd_per_hour=3.00,
        sources=(
            ("hbm", "80 GB HBM3, 81,559 MiB reported by nvidia-smi; 3.35 TB/s (NVIDIA H100 datasheet)"),
            ("compute", "BF16 989 / FP8 1,979 TFLOP/s dense (NVIDIA datasheet)"),
            ("host link", _H100_PCIE_MEAS),
            ("nvlink", "NVLink 4: 450 GB/s per direction (spec); ~380 measured (NVIDIA/nccl#1264)"),
            ("internode", "400 Gb/s NDR per GPU = 50 GB/s (aiconfigurator system yaml)"),
            ("price", "$3.00/GPU-h: middle of $1.99-5.00 on-demand, public price surveys May 2026"),
        ),
    ),
    "h100-pcie": GPUSpec(
        name="h100-pcie",
        hbm_bytes=81559 * MiB,
        hbm_bw_bytes_per_s=2.0e12,
        bf16_flops=756e12,
        fp8_flops=1513e12,
        pcie_gen=5,
        host_h2d_bytes_per_s=35.2e9,
        host_d2h_bytes_per_s=52.8e9,
        nvlink_bytes_per_s=0.0,
        internode_bytes_per_s=50e9,
        usd_per_hour=2.50,
        sources=(
            ("hbm", "80 GB HBM2e, 2.0 TB/s (NVIDIA H100 PCIe datasheet)"),
            ("compute", "BF16 756 / FP8 1,513 TFLOP/s dense (NVIDIA datasheet)"),
            ("host link", _H100_PCIE_MEAS),
            ("nvlink", "none modelled (optional 2-GPU bridge); peer copies over PCIe"),
            ("internode", "400 Gb/s NDR per GPU = 50 GB/s (aiconfigurator system yaml)"),
            ("price", "$2.50/GPU-h: low end of H100 on-demand, public price surveys May 2026"),
        ),
    ),
    "h200-sxm": GPUSpec(
        name="h200-sxm",
        hbm_bytes=139 * GiB,
        hbm_bw_bytes_per_s=4.8e12,
        bf16_flops=989e12,
        fp8_flops=1979e12,
        pcie_gen=5,
        host_h2d_bytes_per_s=35.2e9,
        host_d2h_bytes_per_s=52.8e9,
        nvlink_bytes_per_s=450e9,
        internode_bytes_per_s=50e9,
        usd_per_hour=3.80,
        sources=(
            (
                "hbm",
                "141 GB HBM3e, about 139 GiB usable as reported by the driver; 4.8 TB/s "
                "(NVIDIA spec; ../shared/REFERENCE.md)",
            ),
            ("compute", "BF16 989 / FP8 1,979 TFLOP/s dense (NVIDIA spec)"),
            ("host link", "PCIe Gen5; H100's measurement used: " + _H100_PCIE_MEAS),
            ("nvlink", "NVLink 4: 450 GB/s per direction (spec)"),
            ("internode", "400 Gb/s NDR per GPU = 50 GB/s (aiconfigurator system yaml)"),
            ("price", "$3.80/GPU-h: within $2.50-7.00 on-demand, public price surveys May 2026"),
        ),
    ),
    "a100-80gb": GPUSpec(
        name="a100-80gb",
        hbm_bytes=81920 * MiB,
        hbm_bw_bytes_per_s=2.039e12,
        bf16_flops=312e12,
        fp8_flops=0.0,
        pcie_gen=4,
        host_h2d_bytes_per_s=32e9,
        host_d2h_bytes_per_s=32e9,
        nvlink_bytes_per_s=300e9,
        internode_bytes_per_s=25e9,
        usd_per_hour=1.80,
        sources=(
            ("hbm", "80 GB HBM2e, 2.039 TB/s (NVIDIA A100 80GB SXM datasheet)"),
            ("compute", "BF16 312 TFLOP/s dense; no FP8 tensor cores (NVIDIA datasheet)"),
            ("host link", "PCIe Gen4 x16 theoretical 32 GB/s; no published measurement on file"),
            ("nvlink", "NVLink 3: 600 GB/s total = 300 GB/s per direction (NVIDIA datasheet)"),
            ("internode", "200 Gb/s HDR per GPU = 25 GB/s (DGX A100 reference design)"),
            ("price", "$1.80/GPU-h: estimate, no survey on file; set cost.gpu_hour"),
        ),
    ),
    "b200": GPUSpec(
        name="b200",
        hbm_bytes=180 * 10**9,
        hbm_bw_bytes_per_s=8.0e12,
        bf16_flops=2250e12,
        fp8_flops=4500e12,
        pcie_gen=6,
        host_h2d_bytes_per_s=128e9,
        host_d2h_bytes_per_s=128e9,
        nvlink_bytes_per_s=900e9,
        internode_bytes_per_s=50e9,
        usd_per_hour=6.00,
        sources=(
            ("hbm", "180 GB HBM3e per GPU in HGX/DGX B200 (1,440 GB / 8), 8 TB/s (NVIDIA spec)"),
            ("compute", "BF16 2.25 / FP8 4.5 PFLOP/s dense (NVIDIA HGX B200 spec)"),
            ("host link", "PCIe Gen6 x16 theoretical 128 GB/s; no published measurement on file"),
            ("nvlink", "NVLink 5: 1.8 TB/s total = 900 GB/s per direction (NVIDIA spec)"),
            ("internode", "400 Gb/s per GPU = 50 GB/s (DGX B200 reference design)"),
            ("price", "$6.00/GPU-h: estimate, no survey on file; set cost.gpu_hour"),
        ),
    ),
    "l40s": GPUSpec(
        name="l40s",
        hbm_bytes=48 * 10**9,
        hbm_bw_bytes_per_s=864e9,
        bf16_flops=362e12,
        fp8_flops=733e12,
        pcie_gen=4,
        host_h2d_bytes_per_s=32e9,
        host_d2h_bytes_per_s=32e9,
        nvlink_bytes_per_s=0.0,
        internode_bytes_per_s=25e9,
        usd_per_hour=1.20,
        sources=(
            ("memory", "48 GB GDDR6, 864 GB/s (NVIDIA L40S datasheet)"),
            ("compute", "BF16 362 / FP8 733 TFLOP/s dense (NVIDIA datasheet, half the sparse figure)"),
            ("host link", "PCIe Gen4 x16 theoretical 32 GB/s; no published measurement on file"),
            ("nvlink", "none: peer copies over PCIe"),
            ("internode", "200 Gb/s per GPU = 25 GB/s (assumed NIC)"),
            ("price", "$1.20/GPU-h: estimate, no survey on file; set cost.gpu_hour"),
        ),
    ),
}
ALIASES = {"h100": "h100-sxm", "h200": "h200-sxm", "a100": "a100-80gb", "b200-sxm": "b200"}


def load_gpu(name: object, *, source: str | None = None, path: str | None = None) -> GPUSpec:
    if not isinstance(name, str):
        raise KvsimError(f"expected a GPU preset name, got {name!r}", source=source, path=path)
    key = ALIASES.get(name.strip().lower(), name.strip().lower())
    if key in PRESETS:
        return PRESETS[key]
    close = difflib.get_close_matches(key, list(PRESETS) + list(ALIASES), n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}?" if close else f"presets: {', '.join(PRESETS)}"
    raise KvsimError(f"unknown GPU {name!r}; {hint}", source=source, path=path)

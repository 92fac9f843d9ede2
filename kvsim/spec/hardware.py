"""GPU presets: memory, bandwidth, compute and price, each number with its source.

The links a GPU moves bytes over (PCIe to the host, NVLink, the network) are the topology's
(`kvsim.spec.topology`, presets keyed by the same names).

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
    usd_per_hour: float
    price_source: str  # where usd_per_hour comes from, or "estimate: ..." where nothing lists one
    sources: tuple[tuple[str, str], ...] = ()  # the other figures' (the price's is price_source)


PRESETS: dict[str, GPUSpec] = {
    "h100-sxm": GPUSpec(
        name="h100-sxm",
        hbm_bytes=81559 * MiB,
        hbm_bw_bytes_per_s=3.35e12,
        bf16_flops=989e12,
        fp8_flops=1979e12,
        usd_per_hour=3.00,
        price_source="middle of $1.99-5.00 on-demand, public price surveys May 2026",
        sources=(
            ("hbm", "80 GB HBM3, 81,559 MiB reported by nvidia-smi; 3.35 TB/s (NVIDIA H100 datasheet)"),
            ("compute", "BF16 989 / FP8 1,979 TFLOP/s dense (NVIDIA datasheet)"),
        ),
    ),
    "h100-pcie": GPUSpec(
        name="h100-pcie",
        hbm_bytes=81559 * MiB,
        hbm_bw_bytes_per_s=2.0e12,
        bf16_flops=756e12,
        fp8_flops=1513e12,
        usd_per_hour=2.50,
        price_source="estimate: inside the H100's $1.99-5.00 on-demand range (public price surveys May 2026), which lists no PCIe price",
        sources=(
            ("hbm", "80 GB HBM2e, 2.0 TB/s (NVIDIA H100 PCIe datasheet)"),
            ("compute", "BF16 756 / FP8 1,513 TFLOP/s dense (NVIDIA datasheet)"),
        ),
    ),
    "h200-sxm": GPUSpec(
        name="h200-sxm",
        hbm_bytes=139 * GiB,
        hbm_bw_bytes_per_s=4.8e12,
        bf16_flops=989e12,
        fp8_flops=1979e12,
        usd_per_hour=3.80,
        price_source="within $2.50-7.00 on-demand, public price surveys May 2026",
        sources=(
            (
                "hbm",
                "141 GB HBM3e, about 139 GiB usable as reported by the driver; 4.8 TB/s "
                "(NVIDIA spec; ../shared/REFERENCE.md)",
            ),
            ("compute", "BF16 989 / FP8 1,979 TFLOP/s dense (NVIDIA spec)"),
        ),
    ),
    "a100-80gb": GPUSpec(
        name="a100-80gb",
        hbm_bytes=81920 * MiB,
        hbm_bw_bytes_per_s=2.039e12,
        bf16_flops=312e12,
        fp8_flops=0.0,
        usd_per_hour=1.80,
        price_source="estimate: no listed source (below the H100's $1.99-5.00 range, public price surveys May 2026)",
        sources=(
            ("hbm", "80 GB HBM2e, 2.039 TB/s (NVIDIA A100 80GB SXM datasheet)"),
            ("compute", "BF16 312 TFLOP/s dense; no FP8 tensor cores (NVIDIA datasheet)"),
        ),
    ),
    "b200": GPUSpec(
        name="b200",
        hbm_bytes=180 * 10**9,
        hbm_bw_bytes_per_s=8.0e12,
        bf16_flops=2250e12,
        fp8_flops=4500e12,
        usd_per_hour=6.00,
        price_source="estimate: no listed source (above the H200's $2.50-7.00 midpoint, public price surveys May 2026)",
        sources=(
            ("hbm", "180 GB HBM3e per GPU in HGX/DGX B200 (1,440 GB / 8), 8 TB/s (NVIDIA spec)"),
            ("compute", "BF16 2.25 / FP8 4.5 PFLOP/s dense (NVIDIA HGX B200 spec)"),
        ),
    ),
    "l40s": GPUSpec(
        name="l40s",
        hbm_bytes=48 * 10**9,
        hbm_bw_bytes_per_s=864e9,
        bf16_flops=362e12,
        fp8_flops=733e12,
        usd_per_hour=1.20,
        price_source="estimate: no listed source (below the H100's $1.99-5.00 range, public price surveys May 2026)",
        sources=(
            ("memory", "48 GB GDDR6, 864 GB/s (NVIDIA L40S datasheet)"),
            ("compute", "BF16 362 / FP8 733 TFLOP/s dense (NVIDIA datasheet, half the sparse figure)"),
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

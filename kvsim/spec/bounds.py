"""Physical bounds on the rates, sizes and prices a scenario can set: a value outside its range is
refused (one line naming the field, the range and its source), before any work.

Each range is wide, one or two orders of magnitude past any real device on either side, so that
only values no device has are refused (a typo of units, a test of the simulator's limits):

- compute: 1 GFLOP/s .. 100 PFLOP/s: `kvsim validate` runs a CPU as the device (2 cores measure
  about 100 GFLOP/s); a B200 does 4.5 PFLOP/s dense fp8 (NVIDIA datasheet);
- HBM bandwidth: 1 GB/s .. 100 TB/s: the CPU's DRAM, as validate measures it (about 10 GB/s on 2
  cores); a B200's HBM3e 8 TB/s;
- HBM capacity: 1 MiB .. 16 TiB: validate sizes a scaled-down model's device memory to its block
  count (about 65 MiB at scale 8); a B300 has 288 GB;
- link bandwidth: 1 MB/s .. 100 TB/s: a USB 2 link 60 MB/s; NVLink 5 1.8 TB/s per GPU;
- latency and per-call overhead: 0 .. 1 s (a PCIe or RDMA transfer: microseconds);
- host memory, SSD, pool and swap sizes: up to 1 PiB (a DGX H100: 2 TiB DRAM; NVMe JBOFs ~1 PB);
- prices: $0 .. $10,000 an hour (an 8-GPU H100 node lists at ~$98/h on demand, AWS p5.48xlarge).

Inside those, a narrower usual range: a value outside it is legal but far from any real device
(a unit slip: GB for GiB, Gb/s for GB/s), and the run says so in its warnings (`far`):

- compute 10 TFLOP/s .. 20 PFLOP/s: an L4 does 121 TFLOP/s dense bf16, a T4 65 TFLOP/s fp16
  (NVIDIA datasheets); a GB300 15 PFLOP/s dense fp4 (NVIDIA GB300 NVL72 page);
- HBM bandwidth 100 GB/s .. 20 TB/s: an L4's GDDR6 300 GB/s; Rubin's HBM4 13 TB/s (NVIDIA, GTC 2025);
- HBM capacity 8 GiB .. 1 TiB: a T4 16 GB; Rubin Ultra 1 TB of HBM4e (NVIDIA, GTC 2025);
- link bandwidth 100 MB/s .. 20 TB/s: 1 Gb Ethernet 125 MB/s; NVLink 5 1.8 TB/s per GPU;
- prices $0.10 .. $100 an hour: a T4 at ~$0.35/h on demand (GCP list), spot lower; an 8-GPU
  B200 node at ~$114/h (AWS p6-b200.48xlarge) is ~$14 per GPU. $0 is deliberate (hardware
  already paid for, as ``pool_node_cost_per_hour`` documents): no warning.

`kvsim validate` on a CPU sets the GPU's peaks and HBM itself (a CPU's, far below any GPU): it
passes those fields as `quiet` to `kvsim.spec.scenario.scenario_from_dict`, so its runs do not warn.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from kvsim.errors import KvsimError

SOURCE = "kvsim/spec/bounds.py"


@dataclass(frozen=True)
class Bound:
    lo: float
    hi: float
    unit: str  # "FLOP/s", "B/s", "B", "s", "$/h"
    usual: tuple[float, float] | None = None  # legal outside it, but far from any real device


FLOPS = Bound(1e9, 1e17, "FLOP/s", usual=(10e12, 20e15))
HBM_BW = Bound(1e9, 100e12, "B/s", usual=(100e9, 20e12))
HBM_SIZE = Bound(2**20, 16 * 2**40, "B", usual=(8 * 2**30, 2**40))
LINK_BW = Bound(1e6, 100e12, "B/s", usual=(100e6, 20e12))
LATENCY = Bound(0.0, 1.0, "s")
HOST_SIZE = Bound(0.0, 2**50, "B")
PRICE = Bound(0.0, 10_000.0, "$/h", usual=(0.10, 100.0))

_SI = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))
_BIN = ((2**50, "Pi"), (2**40, "Ti"), (2**30, "Gi"), (2**20, "Mi"), (2**10, "Ki"))


def show(v: float, unit: str) -> str:
    """`v` in `unit` with a prefix, e.g. 1 TFLOP/s, 16 TiB, 100 us, $1,000/h."""
    if not math.isfinite(v):
        return f"{v} {unit}"
    if unit == "$/h":
        return f"${v:,.6g}/h"
    if unit == "s":
        if v == 0 or v >= 1:
            return f"{v:.6g} s"
        for f, p in ((1e-3, "m"), (1e-6, "u"), (1e-9, "n")):
            if v >= f:
                return f"{v / f:.6g} {p}s"
        return f"{v:.3g} s"
    table = _BIN if unit == "B" else _SI
    for f, p in table:
        if abs(v) >= f:
            return f"{v / f:.6g} {p}{unit}"
    return f"{v:.6g} {unit}"


def check(v: float, b: Bound) -> float:
    """`v` if it lies within `b`, else a `KvsimError` naming the range and its source."""
    if not (math.isfinite(v) and b.lo <= v <= b.hi):
        raise KvsimError(
            f"{show(v, b.unit)} is outside {show(b.lo, b.unit)}..{show(b.hi, b.unit)} "
            f"(bounds: {SOURCE}, past any real device)"
        )
    return v


def far(v: float, b: Bound) -> str | None:
    """Why `v`, legal, is far from any real device (outside `b`'s usual range), else None."""
    if b.usual is None or v == 0 or b.usual[0] <= v <= b.usual[1]:
        return None
    lo, hi = b.usual
    return (
        f"{show(v, b.unit)} is legal but far from any real device (usual {show(lo, b.unit)}..{show(hi, b.unit)}, "
        f"{SOURCE})"
    )


# The warnings of the values `Section.parsed` reads while a `collect` is open: (field path, line).
_FAR: ContextVar[list[tuple[str, str]] | None] = ContextVar("kvsim_far", default=None)


@contextmanager
def collect() -> Iterator[list[tuple[str, str]]]:
    """Gather `note`'s warnings of the values read inside the block, as (field path, line)."""
    found: list[tuple[str, str]] = []
    token = _FAR.set(found)
    try:
        yield found
    finally:
        _FAR.reset(token)


def note(v: object, parse: object, source: str, path: str) -> None:
    """Record the warning of `v`, read by `parse` at `path`, when `parse` is `bounded`'s and `v`
    lies outside its usual range (inside `collect` only)."""
    b = getattr(parse, "bound", None)
    found = _FAR.get()
    if found is None or not isinstance(b, Bound) or not isinstance(v, int | float):
        return
    why = far(float(v), b)
    if why is not None:
        found.append((path, f"{source}: {path}: {why}"))


def bounded(parse: Callable[[object], float], b: Bound) -> Callable[[object], float]:
    """`parse`, then `check` against `b` (and, read by `Section.parsed`, `note` against its
    usual range)."""

    def go(raw: object) -> float:
        return check(parse(raw), b)

    go.bound = b  # type: ignore[attr-defined]
    return go

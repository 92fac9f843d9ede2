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
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from kvsim.errors import KvsimError

SOURCE = "kvsim/spec/bounds.py"


@dataclass(frozen=True)
class Bound:
    lo: float
    hi: float
    unit: str  # "FLOP/s", "B/s", "B", "s", "$/h"


FLOPS = Bound(1e9, 1e17, "FLOP/s")
HBM_BW = Bound(1e9, 100e12, "B/s")
HBM_SIZE = Bound(2**20, 16 * 2**40, "B")
LINK_BW = Bound(1e6, 100e12, "B/s")
LATENCY = Bound(0.0, 1.0, "s")
HOST_SIZE = Bound(0.0, 2**50, "B")
PRICE = Bound(0.0, 10_000.0, "$/h")

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


def bounded(parse: Callable[[object], float], b: Bound) -> Callable[[object], float]:
    """`parse`, then `check` against `b`."""

    def go(raw: object) -> float:
        return check(parse(raw), b)

    return go

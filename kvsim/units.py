"""Unit strings parsed in one place: sizes, bandwidths, durations, prices.

Everything inside kvsim is SI: bytes, bytes per second, seconds, US dollars. Decimal prefixes (kB,
MB, GB, TB) are powers of 1000 and binary ones (KiB, MiB, GiB, TiB) powers of 1024. Datasheets mix
them (an "80GB" H100 reports 79.6 GiB to the driver), so presets state the byte count they mean and
name the source. A lowercase ``b`` means bits ("400Gb/s" = 50e9 bytes/s).
"""

from __future__ import annotations

import math
import re

from kvsim.errors import KvsimError

_NUM = r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"
_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "kB": 1e3,
    "KB": 1e3,
    "MB": 1e6,
    "GB": 1e9,
    "TB": 1e12,
    "PB": 1e15,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
    "PiB": 2**50,
}
_TIME_UNITS = {
    "": 1.0,
    "s": 1.0,
    "ms": 1e-3,
    "us": 1e-6,
    "µs": 1e-6,
    "ns": 1e-9,
    "min": 60.0,
    "h": 3600.0,
}
_SIZE_RE = re.compile(rf"^\s*{_NUM}\s*([kKMGTP]?i?[Bb]?)\s*$")
_BW_RE = re.compile(rf"^\s*{_NUM}\s*([kKMGTP]?i?[Bb])\s*/\s*s\s*$")
_TIME_RE = re.compile(rf"^\s*{_NUM}\s*(s|ms|us|µs|ns|min|h)?\s*$")
_PRICE_RE = re.compile(rf"^\s*\$?\s*{_NUM}\s*(?:/\s*(?:h|hr|hour|GPU-?h(?:our)?))?\s*$")

# Sanity bounds: values outside these are typos, not hardware (largest node memory ~ a few TiB).
MAX_SIZE_BYTES = 2**60
MAX_BW_BYTES_PER_S = 1e15
MAX_DURATION_S = 1e9


def _finite_positive(value: float, what: str, allow_zero: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise KvsimError(f"expected {what}, got {value!r}")
    if math.isnan(value) or math.isinf(value):
        raise KvsimError(f"expected {what}, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise KvsimError(f"expected {what}, got {value!r}")
    return float(value)


def _unit_factor(unit: str, table: dict[str, float], what: str, raw: object) -> float:
    bits = unit.endswith("b") and unit not in ("",)
    key = unit[:-1] + "B" if bits else unit
    if key not in table:
        raise KvsimError(f"expected {what}, got {raw!r} (unknown unit {unit!r})")
    return table[key] / (8 if bits else 1)


def parse_size(raw: object, *, allow_zero: bool = False) -> int:
    """Bytes from ``"80GiB"``, ``"2TB"``, ``"512MiB"`` or a plain number of bytes."""
    what = 'a size like "80GiB"'
    if isinstance(raw, str):
        m = _SIZE_RE.match(raw)
        if not m:
            raise KvsimError(f"expected {what}, got {raw!r}")
        value = float(m.group(1)) * _unit_factor(m.group(2), _SIZE_UNITS, what, raw)
    else:
        value = _finite_positive(raw, what, allow_zero)  # type: ignore[arg-type]
    value = _finite_positive(value, what, allow_zero)
    if value > MAX_SIZE_BYTES:
        raise KvsimError(f"expected {what}, got {raw!r} (over 1 EiB)")
    return round(value)


def parse_bandwidth(raw: object) -> float:
    """Bytes per second from ``"3.35TB/s"``, ``"64GB/s"``, ``"400Gb/s"`` or a number (bytes/s)."""
    what = 'a bandwidth like "64GB/s"'
    if isinstance(raw, str):
        m = _BW_RE.match(raw)
        if not m:
            raise KvsimError(f"expected {what}, got {raw!r}")
        value = float(m.group(1)) * _unit_factor(m.group(2), _SIZE_UNITS, what, raw)
    else:
        value = _finite_positive(raw, what, False)  # type: ignore[arg-type]
    value = _finite_positive(value, what, False)
    if value > MAX_BW_BYTES_PER_S:
        raise KvsimError(f"expected {what}, got {raw!r} (over 1 PB/s)")
    return value


def parse_duration(raw: object, *, allow_zero: bool = False) -> float:
    """Seconds from ``"2s"``, ``"100ms"``, ``"15us"``, ``"1h"`` or a number of seconds."""
    what = 'a duration like "2s" or "100ms"'
    if isinstance(raw, str):
        m = _TIME_RE.match(raw)
        if not m:
            raise KvsimError(f"expected {what}, got {raw!r}")
        value = float(m.group(1)) * _TIME_UNITS[m.group(2) or ""]
    else:
        value = _finite_positive(raw, what, allow_zero)  # type: ignore[arg-type]
    value = _finite_positive(value, what, allow_zero)
    if value > MAX_DURATION_S:
        raise KvsimError(f"expected {what}, got {raw!r} (over 30 years)")
    return value


def parse_price_per_hour(raw: object) -> float:
    """US dollars an hour (per GPU-hour, or per pool node) from ``"$2.49/h"``, ``"2.49"`` or a number."""
    what = 'a price like "$2.49/h"'
    if isinstance(raw, str):
        m = _PRICE_RE.match(raw)
        if not m:
            raise KvsimError(f"expected {what}, got {raw!r}")
        value = float(m.group(1))
    else:
        value = _finite_positive(raw, what, True)  # type: ignore[arg-type]
    value = _finite_positive(value, what, True)
    if value > 1e4:
        raise KvsimError(f"expected {what}, got {raw!r} (over $10,000 an hour)")
    return value


def format_bytes(n: float) -> str:
    """Human-readable binary size: 343.6 GB style uses decimal; we print both where it matters."""
    for unit, factor in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= factor:
            return f"{n / factor:.2f} {unit}"
    return f"{n:.0f} B"


def format_gb(n: float) -> str:
    """Decimal gigabytes, the unit the design documents and datasheets use."""
    return f"{n / 1e9:.1f} GB"


_FLOPS_RE = re.compile(rf"^\s*{_NUM}\s*([kMGTP]?)\s*(?:FLOP/?s|FLOPS|flop/?s)?\s*$")
_FLOPS_PREFIX = {"": 1.0, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}


def parse_flops(raw: object) -> float:
    """FLOP/s from ``"989TFLOP/s"``, ``"1.979P"`` or a number."""
    what = 'a compute rate like "989TFLOP/s"'
    if isinstance(raw, str):
        m = _FLOPS_RE.match(raw)
        if not m:
            raise KvsimError(f"expected {what}, got {raw!r}")
        value = float(m.group(1)) * _FLOPS_PREFIX[m.group(2)]
    else:
        value = _finite_positive(raw, what, False)  # type: ignore[arg-type]
    value = _finite_positive(value, what, False)
    if value > 1e18:
        raise KvsimError(f"expected {what}, got {raw!r} (over 1 EFLOP/s)")
    return value

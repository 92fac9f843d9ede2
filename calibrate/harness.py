"""Timing harness: percentiles of repeated calls on CUDA (events, L2 flushed) or a CPU (perf_counter).

On CUDA every rep zeroes a 256 MB buffer first, so no rep finds its operands in L2 (50 MB on an
H100, 60 MB on an H200), and each call is bracketed by CUDA events. On a CPU each call is timed with
``time.perf_counter``, after zeroing a buffer twice the last-level cache (at least 64 MB): a serving
loop streams every layer's weights through the cache each step, so a GEMM timed with its weights
hot (the same [k, n] operand every rep) ran up to twice as fast as the same GEMM inside a step
(`kvsim validate` showed it). Reps adapt to a per-point time budget so slow points do not dominate.

Left out: CUDA graphs (launch overhead is part of what the simulator's steps pay), clock locking.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

FLUSH_BYTES = 256 * 1024 * 1024
CPU_FLUSH_MIN_BYTES = 64 * 1024 * 1024


def cpu_llc_bytes() -> int | None:
    """The CPU's last-level cache in bytes (Linux sysfs), or None where it cannot be read."""
    best = None
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for entry in sorted(os.listdir(base)):
            try:
                with open(os.path.join(base, entry, "size")) as f:
                    text = f.read().strip().upper()
            except OSError:
                continue
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            digits = text.rstrip("KMG")
            if digits.isdigit():
                size = int(digits) * mult
                best = size if best is None else max(best, size)
    except OSError:
        return None
    return best


# Device-name substring -> kvsim GPU preset whose peaks (dense bf16 FLOP/s, HBM bytes/s) apply.
PRESET_BY_NAME = (
    ("H100 PCIe", "h100-pcie"),
    ("H100", "h100-sxm"),
    ("H200", "h200-sxm"),
    ("A100", "a100-80gb"),
    ("B200", "b200"),
    ("L40S", "l40s"),
)


@dataclass(frozen=True)
class Timing:
    t_p20: float
    t_p50: float
    t_p80: float
    reps: int


class Timer:
    """Times zero-argument callables on one backend."""

    def __init__(self, backend: str, *, warmup: int, max_reps: int, budget_s: float) -> None:
        self.backend, self.warmup, self.max_reps, self.budget_s = backend, warmup, max_reps, budget_s
        self._flush = (
            torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda") if backend == "cuda" else None
        )
        self._cpu_flush = (
            torch.empty(max(CPU_FLUSH_MIN_BYTES, 2 * (cpu_llc_bytes() or 0)) // 4, dtype=torch.int32)
            if backend == "cpu"
            else None
        )

    def _once(self, fn: Callable[[], object], host: bool) -> float:
        if self._flush is not None and host:  # host work (and the device work it waits for)
            self._flush.zero_()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            return time.perf_counter() - t0
        if self._flush is None:
            if self._cpu_flush is not None:
                self._cpu_flush.zero_()
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        self._flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if hasattr(torch.cuda, "_sleep"):
            # Keep the GPU busy ~50 us more so that the host's launch of `fn` (tens of us for a
            # Triton launcher) overlaps it and is not timed as kernel time.
            torch.cuda._sleep(100_000)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3

    def time(self, fn: Callable[[], object], *, host: bool = False) -> Timing:
        """Percentiles of `fn`'s time. ``host``: on CUDA too by the host's clock, between two
        synchronisations (an op that is host work, as the serving loop's own step: CUDA events
        after a queued sleep would not count the host time the sleep overlaps)."""
        for _ in range(self.warmup):
            fn()
        if self._flush is not None:
            torch.cuda.synchronize()
        first = self._once(fn, host)
        reps = int(min(self.max_reps, max(3, self.budget_s / max(first, 1e-9))))
        times = [first] + [self._once(fn, host) for _ in range(reps - 1)]
        p20, p50, p80 = np.percentile(np.asarray(times), [20, 50, 80])
        return Timing(float(p20), float(p50), float(p80), reps)


def device_info(backend: str) -> dict[str, object]:
    """Name, memory, driver and CUDA version of the device being timed."""
    if backend == "cuda":
        props = torch.cuda.get_device_properties(0)
        driver = None
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            )
            driver = (
                out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
            )
        except (OSError, subprocess.SubprocessError):
            pass
        return {
            "name": props.name,
            "memory_bytes": int(props.total_memory),
            "driver": driver,
            "cuda": torch.version.cuda,
        }
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), name)
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return {
        "name": f"CPU: {name} ({os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads)",
        "memory_bytes": int(mem),
        "driver": None,
        "cuda": None,
    }


def lookup_peaks(device_name: str) -> tuple[float | None, float | None, str | None]:
    """(dense bf16 FLOP/s, HBM bytes/s, preset name) from kvsim's GPU presets, or Nones."""
    from kvsim.spec.hardware import load_gpu

    for hint, preset in PRESET_BY_NAME:
        if hint.lower() in device_name.lower():
            gpu = load_gpu(preset)
            return float(gpu.bf16_flops), float(gpu.hbm_bw_bytes_per_s), preset
    return None, None, None

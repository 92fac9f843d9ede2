"""Timing harness: percentiles of repeated calls on CUDA (events) or a CPU (perf_counter).

Each op is timed in the state the serving loop leaves it in, with no cache flush between calls:

- **Large read-only operands cold.** A step streams every layer's weights and KV through the
  cache, so in the loop a GEMM's weight and an attention layer's KV pool are cold when read. The
  ops (`calibrate.ops`) build several copies of such an operand, and the timer rotates through
  them (`Timer.time` given a sequence of calls): their total reaches `rotation_bytes`, twice the
  cache being defeated (the last-level cache on a CPU, the L2 on a GPU), at least 64 MiB and at
  most 1 GiB (a VM may report its host's whole L3), with at most `MAX_COPIES` copies; one copy
  when the operand alone reaches it. A copy is last read `rotation_bytes` of other copies ago.
- **Small ops warm.** Norms, rotary, activations, KV writes, the embedding, sampling and the
  loop's own overhead are timed with their code and activations warm, as the loop runs them;
  on a CPU each call right after an untimed GEMM at the model's shapes (`calibrate.ops.Point`'s
  ``before``), as in the loop, where each follows one: measured on an EPYC, one GEMM before a
  layer's norms and rotary made them 2-2.5x slower than back-to-back calls (reading 7 MiB first
  did not), so back-to-back timing underpriced them. The ops the loop runs once per layer or once per step
  (the KV write; the embedding, sampling and its own overhead) follow instead one row through the
  GEMM weights the loop streams between two of their calls (`calibrate.ops._after_weights`: one
  layer's, or every layer's and the LM head, at most `rotation_bytes`): after one GEMM they were
  still 2-3x faster than in the loop.

Before, every call zeroed a buffer of twice the LLC: each op ran fully cold, small ones 3-5x
slower than in the loop, and a VM reporting a 480 MiB L3 waited for a 960 MiB zero per call.

On CUDA each call is bracketed by CUDA events after a queued sleep (so that the host's launch is
not timed as kernel time); host work (`host=True`) by the host's clock between two
synchronisations. On a CPU each call is timed with ``time.perf_counter``. Reps adapt to a
per-point time budget so slow points do not dominate.

Left out: CUDA graphs (launch overhead is part of what the simulator's steps pay), clock locking.
"""

from __future__ import annotations

import math
import os
import platform
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

ROTATE_MIN_BYTES = 64 * 1024 * 1024
ROTATE_MAX_BYTES = 1024 * 1024 * 1024
MAX_COPIES = 256  # a tiny operand is not copied thousands of times (its time is small either way)


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


def cache_bytes(backend: str) -> int | None:
    """The cache a cold operand must defeat: the CPU's last-level cache, or the GPU's L2."""
    if backend == "cuda":
        size = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0)
        return int(size) or None
    return cpu_llc_bytes()


def rotation_bytes(backend: str, cache: int | None = None) -> int:
    """Total bytes of the copies a large operand is rotated through: twice `cache` (default: the
    device's, `cache_bytes`), at least `ROTATE_MIN_BYTES`, at most `ROTATE_MAX_BYTES`."""
    c = cache_bytes(backend) if cache is None else cache
    return min(ROTATE_MAX_BYTES, max(ROTATE_MIN_BYTES, 2 * (c or 0)))


def num_copies(operand_bytes: float, backend: str) -> int:
    """How many copies of an operand of `operand_bytes` to rotate through (see the module docstring)."""
    want = math.ceil(rotation_bytes(backend) / max(float(operand_bytes), 1.0))
    return max(1, min(MAX_COPIES, want))


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
    """Times zero-argument callables on one backend. No buffer is held and nothing is flushed: a
    point whose operands must be cold passes its copies' calls, rotated through (`time`)."""

    def __init__(self, backend: str, *, warmup: int, max_reps: int, budget_s: float) -> None:
        self.backend, self.warmup, self.max_reps, self.budget_s = backend, warmup, max_reps, budget_s
        self.cuda = backend == "cuda"

    def _once(
        self, fn: Callable[[], object], host: bool, before: Callable[[], object] | None = None
    ) -> float:
        if before is not None:
            before()
        if self.cuda and host:  # host work (and the device work it waits for)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            return time.perf_counter() - t0
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
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

    def time(
        self,
        fn: Callable[[], object] | Sequence[Callable[[], object]],
        *,
        host: bool = False,
        before: Callable[[], object] | None = None,
    ) -> Timing:
        """Percentiles of `fn`'s time. `fn` may be a sequence of calls (one per copy of a large
        operand): call i runs ``fn[i % len(fn)]``, warm-up included, so that each timed call reads
        a copy the others have pushed out of the cache. ``host``: on CUDA too by the host's clock,
        between two synchronisations (an op that is host work, as the serving loop's own step:
        CUDA events after a queued sleep would not count the host time the sleep overlaps).
        ``before``: an untimed call before each call (warm-up included), the op the loop runs
        just before this one (`calibrate.ops.Point.before`)."""
        calls = [fn] if callable(fn) else list(fn)
        n = len(calls)
        # Warm-up calls: `warmup` of them, fewer once they have taken the point's budget (a slow
        # point is warm after one call; more would only add its seconds).
        done, t0 = 0, time.perf_counter()
        while done < self.warmup and (done == 0 or time.perf_counter() - t0 < self.budget_s):
            if before is not None:
                before()
            calls[done % n]()
            done += 1
        if self.cuda:
            torch.cuda.synchronize()
        first = self._once(calls[done % n], host, before)
        reps = int(min(self.max_reps, max(3, self.budget_s / max(first, 1e-9))))
        times = [first] + [self._once(calls[(done + i) % n], host, before) for i in range(1, reps)]
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

"""Benchmarks of the kernels/ package on a CUDA GPU: achieved GB/s and % of HBM peak.

- paged_decode per KV format over batch 1..64 x context 1K..32K, Llama-3.1-8B-like attention
  (32 query heads, 8 KV heads x head_dim 128, block_size 16). Bytes = K/V bytes of every token
  in the format (metadata included) + q + out; decode is bandwidth bound, so GB/s vs HBM peak is
  the figure of merit.
- block moves: gather of N blocks into a device staging buffer (HBM read + write), the staging
  buffer to pinned host memory and back (PCIe / C2C), and copy-on-write pairs.
- chunked_prefill: a chunk over a paged prefix (the chunk's kv_write included); reports TFLOP/s
  and KV GB/s.

Prints GPU name, driver, torch, triton and CUDA versions; ``--out FILE`` writes every result as
JSON. On a machine without CUDA it exits 2 with a one-line message, unless ``--interpret`` is given:
then it runs tiny shapes in the Triton interpreter as a smoke test (numbers are meaningless).

    python bench/bench_kernels.py --out bench/results.json --hbm-peak-gbps 4800
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

DECODE_FORMATS = (
    "fp16",
    "bf16",
    "fp8_e4m3/per_tensor",
    "fp8_e4m3/per_head",
    "int8/g64",
    "int4/g64",
    "int4/g32",
    "kvquant4/1.0%",
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hbm-peak-gbps", type=float, default=4800.0, help="HBM peak (H200: 4800)")
    p.add_argument("--out", type=Path, help="write results as JSON here")
    p.add_argument("--interpret", action="store_true", help="CPU smoke test in the interpreter")
    p.add_argument(
        "--formats",
        nargs="+",
        help="decode formats (default: " + ", ".join(DECODE_FORMATS).replace("%", "%%") + ")",
    )
    p.add_argument("--batch", nargs="+", type=int, default=[1, 8, 32, 64])
    p.add_argument("--context", nargs="+", type=int, default=[1024, 4096, 16384, 32768])
    p.add_argument("--max-kv-gib", type=float, default=24.0, help="skip larger decode caches")
    p.add_argument("--only", choices=["decode", "blocks", "prefill"], nargs="+")
    return p.parse_args(argv)


def device_info(torch, triton) -> dict[str, str]:
    info = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = str(torch.version.cuda)
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10, check=True,
            )  # fmt: skip
            info["driver"] = out.stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            info["driver"] = "unknown (nvidia-smi not available)"
    else:
        info["gpu"] = "none (Triton interpreter on CPU)"
        info["driver"] = "n/a"
    return info


def timer(torch, triton, interpret: bool) -> Callable[[Callable[[], object]], float]:
    """Seconds per call: triton.testing.do_bench (median, CUDA events) or one wall-clock call."""

    def on_gpu(fn: Callable[[], object]) -> float:
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") / 1e3

    def on_cpu(fn: Callable[[], object]) -> float:
        fn()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return on_cpu if interpret else on_gpu


def filled_cache(torch, fmt: str, tokens_per_seq: int, batch: int, kv_heads: int, head_dim: int,
                 block_size: int, device: str):  # fmt: skip
    """A cache with ``batch`` sequences of random K/V (`kernels.kv_write.fill_random`)."""
    from kernels.kv_cache import PagedKVCache
    from kernels.kv_write import fill_random

    per_seq = -(-tokens_per_seq // block_size)
    num_blocks = batch * per_seq
    cache = PagedKVCache.allocate(fmt, num_blocks, block_size, kv_heads, head_dim, device)
    if cache.k.fp8_scale is not None:
        cache.k.fp8_scale.fill_(4.0 / 448.0)
        cache.v.fp8_scale.fill_(4.0 / 448.0)
    block_tables = torch.randperm(num_blocks, device=device).view(batch, per_seq).to(torch.int32)
    slots = (
        (block_tables.long()[:, :, None] * block_size + torch.arange(block_size, device=device))
        .view(batch, -1)[:, :tokens_per_seq]
        .reshape(-1)
    )
    fill_random(cache, slots)
    return cache, block_tables


def bench_decode(args, torch, measure, device: str) -> list[dict]:
    from kernels.kv_cache import resolve_format
    from kernels.paged_decode import paged_decode

    kv_heads, q_heads, head_dim, block_size = (2, 8, 32, 16) if args.interpret else (8, 32, 128, 16)
    rows = []
    for fmt in args.formats:
        for ctx in args.context:
            for batch in args.batch:
                f = resolve_format(fmt)
                kv_bytes = batch * ctx * kv_heads * 2 * f.bytes_per_vector(head_dim)
                if kv_bytes > args.max_kv_gib * 2**30:
                    continue
                cache, tables = filled_cache(torch, fmt, ctx, batch, kv_heads, head_dim,
                                             block_size, device)  # fmt: skip
                dtype = torch.bfloat16 if fmt == "bf16" else torch.float16
                q = torch.randn(batch, q_heads, head_dim, device=device, dtype=dtype)
                lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
                run = partial(paged_decode, q, cache, tables, lens, head_dim**-0.5,
                              max_context_len=ctx)  # fmt: skip
                seconds = measure(run)
                moved = kv_bytes + 2 * q.numel() * q.element_size() + tables.numel() * 4
                rows.append(record(args, "paged_decode", seconds, moved, format=fmt, batch=batch,
                                   context=ctx, kv_heads=kv_heads, q_heads=q_heads,
                                   head_dim=head_dim, block_size=block_size))  # fmt: skip
                del cache, tables
    return rows


def bench_blocks(args, torch, measure, device: str) -> list[dict]:
    from kernels import block_copy as bc
    from kernels.kv_cache import CacheSpec, resolve_format

    if args.interpret:
        kv_heads, head_dim, num_blocks, moved_blocks = 2, 32, 16, 4
    else:
        kv_heads, head_dim, num_blocks, moved_blocks = 8, 128, 8192, 2048
    rows = []
    for fmt in ("fp16", "int4/g64"):
        spec = CacheSpec(resolve_format(fmt), num_blocks, 16, kv_heads, head_dim)
        pool = torch.randint(0, 255, (num_blocks, spec.row_bytes), dtype=torch.uint8, device=device)
        ids = torch.randperm(num_blocks, device=device)[:moved_blocks]
        nbytes = moved_blocks * spec.row_bytes
        staging = torch.empty(moved_blocks, spec.row_bytes, dtype=torch.uint8, device=device)
        host = torch.empty(moved_blocks, spec.row_bytes, dtype=torch.uint8,
                           pin_memory=not args.interpret)  # fmt: skip
        mapping = torch.stack((ids[: moved_blocks // 2], ids[moved_blocks // 2 :]), 1)
        common = {"format": fmt, "blocks": moved_blocks, "row_bytes": spec.row_bytes}
        cases = [
            ("block_gather", partial(bc.gather_blocks, pool, ids, staging), 2 * nbytes),
            ("block_scatter", partial(bc.scatter_blocks, pool, ids, staging), 2 * nbytes),
            ("copy_blocks", partial(bc.copy_blocks, pool, mapping), nbytes),
            ("staging_to_pinned_host", partial(host.copy_, staging, non_blocking=True), nbytes),
            ("pinned_host_to_staging", partial(staging.copy_, host, non_blocking=True), nbytes),
        ]
        for name, fn, traffic in cases:
            rows.append(record(args, name, measure(fn), traffic, **common))
    return rows


def bench_prefill(args, torch, measure, device: str) -> list[dict]:
    from kernels.chunked_prefill import chunk_slot_mapping, chunked_prefill

    if args.interpret:
        kv_heads, q_heads, head_dim, grid = 1, 4, 32, [(1, 16, 8)]
    else:
        kv_heads, q_heads, head_dim = 8, 32, 128
        grid = [(1, 0, 2048), (1, 4096, 512), (1, 16384, 2048), (4, 4096, 512)]
    rows = []
    formats = ("fp16", "fp8_e4m3/per_tensor", "int4/g64", "kvquant4/1.0%")
    for fmt in formats[:1] if args.interpret else formats:
        for batch, prefix, chunk in grid:
            seq = prefix + chunk
            cache, tables = filled_cache(torch, fmt, seq, batch, kv_heads, head_dim, 16, device)
            n = batch * chunk
            q = torch.randn(n, q_heads, head_dim, device=device, dtype=torch.float16)
            k = torch.randn(n, kv_heads, head_dim, device=device, dtype=torch.float16)
            qsl = torch.arange(batch + 1, device=device, dtype=torch.int32) * chunk
            lens = torch.full((batch,), seq, dtype=torch.int32, device=device)
            slots = chunk_slot_mapping(tables, qsl, lens, 16)  # up front: no sync inside timing
            run = partial(chunked_prefill, q, k, k, cache, tables, qsl, lens, head_dim**-0.5,
                          slot_mapping=slots, max_query_len=chunk)  # fmt: skip
            seconds = measure(run)
            flops = 4.0 * batch * chunk * (prefix + chunk / 2) * q_heads * head_dim
            kv_bytes = batch * seq * kv_heads * 2 * cache.spec.fmt.bytes_per_vector(head_dim)
            row = record(args, "chunked_prefill", seconds, kv_bytes, format=fmt, batch=batch,
                         prefix=prefix, chunk=chunk)  # fmt: skip
            row["tflop_per_s"] = flops / seconds / 1e12
            rows.append(row)
            del cache, tables
    return rows


HOST_LINK_OPS = ("staging_to_pinned_host", "pinned_host_to_staging")


def record(args, op: str, seconds: float, nbytes: int, **shape) -> dict:
    gbps = nbytes / seconds / 1e9
    row = {"op": op, **shape, "time_s": seconds, "bytes": nbytes, "gb_per_s": gbps}
    # Host copies cross PCIe / C2C, not HBM: a share of HBM peak would mislead.
    row["pct_hbm_peak"] = None if op in HOST_LINK_OPS else 100.0 * gbps / args.hbm_peak_gbps
    extra = " ".join(f"{k}={v}" for k, v in shape.items())
    pct = "  host link" if row["pct_hbm_peak"] is None else f"{row['pct_hbm_peak']:5.1f}% peak"
    print(f"{op:<24} {extra:<70} {seconds * 1e6:10.1f} us {gbps:9.1f} GB/s {pct}", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
        args.batch, args.context = [2], [40]
        args.formats = args.formats or ["fp16", "kvquant4/1.0%"]
    args.formats = args.formats or list(DECODE_FORMATS)
    import torch

    if not args.interpret and not torch.cuda.is_available():
        print("bench_kernels: no CUDA device; run on a GPU, or pass --interpret for a CPU smoke "
              "test", file=sys.stderr)  # fmt: skip
        return 2
    import triton

    repo = str(Path(__file__).resolve().parents[1])
    if repo not in sys.path:
        sys.path.insert(0, repo)
    device = "cpu" if args.interpret else "cuda"
    info = device_info(torch, triton)
    print(" | ".join(f"{k}: {v}" for k, v in info.items()))
    print(f"HBM peak for %: {args.hbm_peak_gbps:.0f} GB/s")
    measure = timer(torch, triton, args.interpret)
    only = args.only or ["decode", "blocks", "prefill"]
    results = []
    if "decode" in only:
        results += bench_decode(args, torch, measure, device)
    if "blocks" in only:
        results += bench_blocks(args, torch, measure, device)
    if "prefill" in only:
        results += bench_prefill(args, torch, measure, device)
    if args.out:
        payload = {
            "device": info,
            "hbm_peak_gbps": args.hbm_peak_gbps,
            "interpreter": args.interpret,
            "results": results,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

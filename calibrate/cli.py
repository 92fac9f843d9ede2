"""``python -m calibrate``: measure the ops of `calibrate.ops` and write a kvsim profile.

The profile is rewritten after every op with ``complete: false``; re-running with the same
arguments skips the ops already present, so an interrupted calibration resumes (and another
``--ops`` list with the same settings adds ops to it). ``complete`` means the four ops every profile
needs (gemm, paged_decode, chunked_prefill, copy); the eviction and quantize-on-write ops (schema
1.1: h2o_accumulate, h2o_select, compact_kv, kv_write) and the step's rest and overhead (1.2:
step_rest, step_overhead) are optional, priced analytically (1.2: left out, as before) where a
profile lacks them, and skipped with a line when ``kernels`` is not importable. Mistakes (bad
flags, a foreign --out file) print one line and exit 2. ``--out`` is checked before any work, by
the same rule as ``kvsim run``: never empty, never the model config read, never a folder, and an
existing file that is not a kvsim profile is replaced only with ``--force``.

``python -m calibrate import --from-aiconfigurator --system h200_sxm --backend vllm --model M --out P``
turns NVIDIA's measured tables from the optional ``aiconfigurator-core`` package into a profile
(`calibrate.aiconfigurator`); it needs no GPU and no torch.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvsim.cli import error_line, os_error_line
from kvsim.costs.profile_schema import MINOR_VERSION, MODEL_SHAPE_KEYS, SCHEMA, VERSION, validate_profile
from kvsim.errors import KvsimError
from kvsim.spec.formats import format_from_name

# The ops timed unless --ops says otherwise (names or `calibrate.ops.OP_ALIASES`; that module imports
# torch, which the flags are checked before).
DEFAULT_OPS = "gemm,decode,prefill,copy,score,select,compact,write,rest,overhead"
# An existing --out larger than this is not read to tell whether it is a profile (the shipped ones
# are under 1 MB): it is not one kvsim would resume.
_MAX_PROFILE_BYTES = 256 << 20


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise KvsimError(message, source=self.prog)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="kvsim calibrate",
        usage="%(prog)s --device {cuda,cpu} --out OUT [options]\n"
        "       %(prog)s import --from-aiconfigurator --model MODEL --out OUT [options]",
        description="Time GEMM/attention/copy ops and write a kvsim profile; or, with `import`,\n"
        "turn another tool's measured tables into one.",
        epilog="subcommands:\n  import    a profile from NVIDIA aiconfigurator's measured tables, no GPU "
        "needed (kvsim calibrate import --help)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--device", choices=("cuda", "cpu"), required=True)
    p.add_argument(
        "--quick",
        action="store_true",
        help="a tiny grid (< 2 min on a GPU, < 60 s on a CPU for Llama-3.1-8B's shapes); on a CPU, "
        "GEMMs are timed in fp32 (bf16 matmuls are several times slower there), on CUDA in bf16",
    )
    p.add_argument(
        "--ops",
        default=DEFAULT_OPS,
        help=f"comma list of {DEFAULT_OPS} (score: H2O score accumulation, select: H2O top-k, "
        "compact: KV compaction, write: quantize-on-write, rest: a step's norms, rotary, SiLU, "
        "residual adds, embedding and sampling, overhead: the serving loop's own time per step)",
    )
    p.add_argument("--model", default="llama-3.1-8b", help="kvsim model preset or config.json path")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree the shapes are split by")
    p.add_argument("--formats", default=None, help="KV formats for attention, e.g. bf16,fp8_e4m3/per_tensor")
    p.add_argument("--reps", type=int, default=None, help="max timed reps per point (default 50, quick 10)")
    for flag, what in (
        ("--max-tokens", "tokens of one step (GEMM rows, prefill chunks)"),
        ("--max-batch", "decode batch (and sampled rows)"),
        ("--max-context", "context per sequence (decode context, prefill prefix)"),
    ):
        p.add_argument(flag, type=int, default=None, help=f"extend the grid up to this many {what}")
    p.add_argument("--peak-flops", type=float, default=None, help="dense bf16 FLOP/s for util_flops")
    p.add_argument("--peak-bw", type=float, default=None, help="memory bytes/s for util_bw")
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (on a terminal) nor one line per op (when stdout is not a terminal)",
    )
    p.add_argument("--out", required=True, help="profile JSON to write (resumed if it exists)")
    p.add_argument("--force", action="store_true", help="replace an --out file that is not a kvsim profile")
    return p


def _import_command(argv: list[str]) -> int:
    p = _Parser(prog="kvsim calibrate import", description="Import measured op timings from another tool.")
    p.add_argument("--from-aiconfigurator", action="store_true", required=True)
    p.add_argument("--system", default="h200_sxm", help="aiconfigurator system, e.g. h100_sxm, h200_sxm")
    p.add_argument("--backend", default="vllm", help="serving framework whose kernels: vllm, sglang, trtllm")
    p.add_argument("--version", default=None, help="framework version of the tables (default: newest)")
    p.add_argument("--model", required=True, help="kvsim model preset or config.json path")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree the shapes are split by")
    p.add_argument("--gemm-dtype", default="bfloat16", choices=("bfloat16", "fp8"), help="dtype of `gemm`")
    p.add_argument("--attn-kernel", default=None, help="attention kernel_source (default: best covered)")
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--force", action="store_true", help="replace an --out file that is not a kvsim profile")
    args = p.parse_args(argv)
    from calibrate.aiconfigurator import build_profile, resolve
    from kvsim.spec.models import load_model

    model = load_model(args.model, base_dir=Path.cwd(), source="--model")
    _check_out(args.out, model.config_path, force=args.force)
    src = resolve(args.system, args.backend, args.version)
    prof = build_profile(src, model, args.tp, gemm_dtype=args.gemm_dtype, attn_kernel=args.attn_kernel)
    validate_profile(prof, source=args.out)
    out = Path(args.out)
    _write(out, prof)  # _check_out allowed it: new, a kvsim profile, or --force
    n = sum(len(v["points"]) for v in prof["ops"].values())
    print(f"wrote {out} ({n} points from {prof['source']})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "import":
            return _import_command(argv[1:])
        return calibrate(build_parser().parse_args(argv))
    except KvsimError as exc:
        print(error_line(exc), file=sys.stderr)
        return 2
    except OSError as exc:  # a write the checks could not foresee: a full disk, a folder made read-only
        print(os_error_line(exc), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("calibrate: interrupted (the profile so far is on disk; re-run to resume)", file=sys.stderr)
        return 130


def _resolve_ops(text: str) -> list[str]:
    from calibrate.ops import OP_ALIASES, OPS

    out = []
    for name in filter(None, (t.strip() for t in text.split(","))):
        op = OP_ALIASES.get(name, name)
        if op not in OPS:
            raise KvsimError(f"unknown op {name!r}; expected some of {DEFAULT_OPS}", source="--ops")
        if op not in out:
            out.append(op)
    if not out:
        raise KvsimError("no ops given", source="--ops")
    return out


def _write(path: Path, prof: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(prof, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        raise KvsimError(f"cannot write the profile: {exc.strerror or exc}", source=str(path)) from None


def _existing_profile(path: Path) -> dict[str, Any] | None:
    """The valid kvsim profile at `path`, or None if the file is anything else."""
    try:
        if path.stat().st_size > _MAX_PROFILE_BYTES:  # not read whole to be told it is not ours
            return None
        prof = json.loads(path.read_text(encoding="utf-8"))
        validate_profile(prof, source=str(path))
    except (OSError, ValueError, RecursionError, KvsimError):
        return None
    return prof


def _check_out(out: str, model_config: Path | None, *, force: bool) -> Path:
    """Refuse an --out that is empty, a folder, the model config read, or (without `force`) an
    existing file that is not a kvsim profile. Runs before any measurement or import."""
    if not out.strip():
        raise KvsimError("empty path (an unset shell variable?); give a profile file", source="--out")
    path = Path(out)
    if path.is_dir():
        raise KvsimError(f"{out} is a directory; give a profile file", source="--out")
    if not path.parent.is_dir():
        raise KvsimError(f"the folder of {out} does not exist", source="--out")
    from kvsim.report.outputs import special_file

    special = special_file(path)
    if special:  # /dev/null, a FIFO: reading one blocks or is empty; replacing a device loses it
        raise KvsimError(f"{out} is {special}; give a profile file", source="--out")
    if model_config is not None and path.exists():
        try:
            same = os.path.samefile(path, model_config)
        except OSError:
            same = False
        if same:
            raise KvsimError(f"{out} is the model config this command reads", source="--out")
    if path.exists() and not force and _existing_profile(path) is None:
        raise KvsimError(
            f"{out} exists and is not a kvsim profile; use --force to replace it or choose another --out",
            source="--out",
        )
    return path


def _load_existing(path: Path, settings: dict[str, Any], *, force: bool) -> dict[str, Any] | None:
    """The profile to resume, or None to start afresh (no file, or `force` over a foreign one)."""
    if not path.exists():
        return None
    prof = _existing_profile(path)
    if prof is None:
        assert force  # _check_out refused it otherwise
        return None
    if prof.get("calibration") != settings:
        if force:
            return None
        raise KvsimError(
            "exists from a calibration with other settings; remove it, choose another --out or use --force",
            source=str(path),
        )
    return prof


def calibrate(args: argparse.Namespace) -> int:
    from kvsim.spec.models import Attention, load_model

    model = load_model(args.model, base_dir=Path.cwd(), source="--model")
    out = _check_out(args.out, model.config_path, force=args.force)  # before torch and any timing
    import torch

    from calibrate.harness import Timer, device_info, lookup_peaks
    from calibrate.ops import count, extend_grid, gemm_dtype, make_grid, points, unavailable

    backend = args.device
    if backend == "cuda" and not torch.cuda.is_available():
        raise KvsimError("CUDA is not available on this machine", source="--device")
    if args.tp < 1:
        raise KvsimError(f"expected a positive integer, got {args.tp}", source="--tp")
    if model.is_moe or model.attention is Attention.MLA:
        raise KvsimError(f"{model.name}: only dense GQA/MHA models are calibrated", source="--model")
    ops = _resolve_ops(args.ops)
    formats = tuple(f.strip() for f in args.formats.split(",")) if args.formats else None
    for flag in ("max_tokens", "max_batch", "max_context"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            raise KvsimError(f"expected a positive integer, got {v}", source="--" + flag.replace("_", "-"))
    grid = extend_grid(
        make_grid(backend, args.quick, formats),
        max_tokens=args.max_tokens,
        max_batch=args.max_batch,
        max_context=args.max_context,
    )
    for f in formats or ():
        try:
            format_from_name(f)
        except KvsimError as exc:
            raise KvsimError(exc.message, source="--formats") from None
    reps = args.reps or (10 if args.quick else 50)
    settings = {
        "backend": backend,
        "quick": args.quick,
        "model": model.name,
        "tp": args.tp,
        "formats": list(grid.formats),
        "reps": reps,
        **{
            k: getattr(args, k)
            for k in ("max_tokens", "max_batch", "max_context")
            if getattr(args, k) is not None
        },
    }
    dev = device_info(backend)
    peak_flops, peak_bw, preset = lookup_peaks(str(dev["name"]))
    peak_flops = args.peak_flops or peak_flops
    peak_bw = args.peak_bw or peak_bw
    prof = _load_existing(out, settings, force=args.force)
    if prof is None:
        try:
            import triton

            triton_version = triton.__version__
        except Exception:  # triton is optional on a CPU
            triton_version = None
        shapes = {k: int(getattr(model, k)) for k in MODEL_SHAPE_KEYS}
        prof = {
            "schema": SCHEMA,
            "version": VERSION,
            "minor_version": MINOR_VERSION,
            "kind": "measured",
            "backend": backend,
            "source": f"python -m calibrate --device {backend}{' --quick' if args.quick else ''}",
            "device": dev,
            "peaks": {"bf16_flops": peak_flops, "bw_bytes_per_s": peak_bw, "preset": preset},
            "torch": torch.__version__,
            "triton": triton_version,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "host": platform.node(),
            "model": {"name": model.name, "num_layers": model.num_layers, **shapes},
            "tp": args.tp,
            "kv_formats": list(grid.formats),
            # GEMMs in fp32 on a CPU (bf16 matmuls are several times slower there), bf16 on CUDA.
            "gemm_dtype": str(gemm_dtype(backend)).removeprefix("torch."),
            "calibration": settings,
            "ops": {},
            "complete": False,
        }
    todo = [op for op in ops if op not in prof["ops"]]
    for op in list(todo):
        why = unavailable(op)
        if why is not None:  # optional ops: the cost model prices them analytically without points
            print(f"calibrate: {op} skipped: {why}", file=sys.stderr)
            todo.remove(op)
    skipped = [op for op in ops if op in prof["ops"]]
    if skipped:
        print(f"resuming {out}: {', '.join(skipped)} already measured", file=sys.stderr)
    timer = Timer(backend, warmup=2 if args.quick else 5, max_reps=reps, budget_s=0.3 if args.quick else 2.0)
    total = sum(count(op, grid, backend) for op in todo)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    # Not a terminal (a log, CI, a pipe): the bar would draw nothing, so one line per op instead.
    lines = not args.no_progress and not sys.stdout.isatty()
    done = 0
    t_start = time.perf_counter()
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        disable=args.no_progress or lines,
        transient=True,
    ) as bar:
        task = bar.add_task("calibrating", total=total)
        for op in todo:
            bar.update(task, description=op)
            t_op = time.perf_counter()
            rows = []
            for pt in points(op, grid, model, args.tp, backend):
                t = timer.time(pt.calls(), host=pt.host, before=pt.before)
                row: dict[str, Any] = dict(pt.params)
                row.update(
                    {
                        "t_p20": t.t_p20,
                        "t_p50": t.t_p50,
                        "t_p80": t.t_p80,
                        "reps": t.reps,
                        "bytes": pt.nbytes,
                        "flops": pt.flops,
                    }
                )
                row["bw_bytes_per_s"] = pt.nbytes / t.t_p50
                row["flops_per_s"] = pt.flops / t.t_p50
                row["util_bw"] = row["bw_bytes_per_s"] / peak_bw if peak_bw else None
                row["util_flops"] = row["flops_per_s"] / peak_flops if peak_flops else None
                rows.append(row)
                bar.advance(task)
            prof["ops"][op] = {"points": rows}
            _write(out, prof)
            done += len(rows)
            if lines:
                print(
                    f"calibrate: {op}: {len(rows)}/{count(op, grid, backend)} points in "
                    f"{time.perf_counter() - t_op:.1f} s ({done}/{total} in all, "
                    f"{time.perf_counter() - t_start:.1f} s)",
                    flush=True,
                )
            if backend == "cuda":
                torch.cuda.empty_cache()
    prof["complete"] = all(op in prof["ops"] for op in ("gemm", "paged_decode", "chunked_prefill", "copy"))
    _write(out, prof)
    print(f"wrote {out} ({sum(len(v['points']) for v in prof['ops'].values())} points)")
    return 0

"""The ``kvsim`` command line: kv-size, run, sweep, plan, report, validate, calibrate.

Any `KvsimError` (and argparse's own complaints) becomes one line on stderr and exit code 2;
``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvsim.errors import KvsimError
from kvsim.spec.schema import did_you_mean

if TYPE_CHECKING:
    from kvsim.kvsize import GPUMemoryRow, KVSizeRow
    from kvsim.spec.hardware import GPUSpec
    from kvsim.spec.models import ModelSpec
    from kvsim.spec.parallel import ParallelLayout


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        m = re.match(r"argument (\S+): invalid choice: '(.*)' \(choose from (.*)\)$", message)
        if m:  # the choices listed after a suggestion, so that a cut line keeps it
            choices = re.findall(r"'([^']*)'", m.group(3))
            hint = did_you_mean(m.group(2), choices)
            message = f"argument {m.group(1)}: invalid choice: '{m.group(2)}';{hint} choose from {', '.join(choices)}"
        raise KvsimError(message, source=self.prog)


def _unknown_flags(parser: argparse.ArgumentParser, argv: list[str], exc: KvsimError) -> KvsimError:
    """argparse's ``unrecognized arguments: --no-progres`` with the subcommand's closest flag."""
    if not exc.message.startswith("unrecognized arguments: "):
        return exc
    flags = [a for a in exc.message.removeprefix("unrecognized arguments: ").split() if a.startswith("--")]
    sub = next((a for a in argv if not a.startswith("-")), None)
    options = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and sub in action.choices:
            options |= set(action.choices[sub]._option_string_actions)
    hint = did_you_mean(flags[0].partition("=")[0], sorted(options)) if flags else ""
    return KvsimError(exc.message + (f";{hint}" if hint else ""), source=exc.source)


def one_line(text: str, limit: int = 280) -> str:
    """An error as one line of at most `limit` characters (the end cut, its length said), whatever
    a message quoted: the promise is one short line per mistake."""
    text = " ".join(text.split())
    return text if len(text) <= limit else f"{text[: limit - 30]}... ({len(text):,} characters)"


def os_error_line(exc: OSError) -> str:
    """The one line of a read or write the system refused and no check caught first (a full disk,
    a folder made read-only mid-run): the user's environment, not kvsim's defect, so exit 2."""
    what = f"{exc.filename}: " if exc.filename else ""
    return f"kvsim: error: {one_line(what + (exc.strerror or str(exc)))}"


def error_line(exc: KvsimError) -> str:
    """The one line a user mistake prints, from every subcommand (calibrate's too): ``kvsim: error: ``
    once, then the source without a second ``kvsim`` (``kvsim run: ...`` reads ``run: ...``)."""
    text = str(exc)
    for lead in ("kvsim: ", "kvsim "):
        text = text.removeprefix(lead)
    return f"kvsim: error: {one_line(text)}"


def _positive_int(text: str) -> int:
    try:
        v = int(text.replace("_", "").replace(",", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def _percentiles(text: str) -> tuple[float, ...]:
    out: list[float] = []
    for part in text.split(","):
        try:
            q = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected percentiles such as 50,90,99,99.9, got {text!r}"
            ) from None
        if not 0 <= q <= 100:  # nan and inf fail too
            raise argparse.ArgumentTypeError(f"expected percentiles in [0, 100], got {part.strip()!r}")
        if q not in out:
            out.append(q)
    return tuple(out)


def _context(text: str) -> int:
    t = text.strip().upper()
    mult = 1
    if t.endswith("K"):
        mult, t = 1024, t[:-1]
    elif t.endswith("M"):
        mult, t = 1024 * 1024, t[:-1]
    return _positive_int(t) * mult


def cmd_kv_size(args: argparse.Namespace) -> int:
    from kvsim.accuracy import accuracy_note
    from kvsim.kvsize import kv_size_rows, rows_to_json
    from kvsim.spec.formats import make_format
    from kvsim.spec.hardware import load_gpu
    from kvsim.spec.models import load_model
    from kvsim.spec.schema import shorten

    model = load_model(args.model, base_dir=Path.cwd(), source="--model")
    gpu = load_gpu(args.gpu, source="--gpu")
    notes: list[str] = []
    formats = []
    for name in args.format or ["bf16", "fp8", "int4", "kvquant4"]:
        try:
            fmt, note = make_format(name, group_size=args.group_size, outlier_fraction=args.outlier_fraction)
        except KvsimError as exc:
            raise KvsimError(shorten(exc.message, 200), source="--format") from None
        formats.append(fmt)
        if note:
            notes.append(note)
    contexts = args.context or [4096, 32768, 131072, 1048576]
    over = [c for c in contexts if c > model.max_context]
    if over:
        notes.append(f"context {over[0]:,} exceeds {model.name}'s max context {model.max_context:,}")
    rows = kv_size_rows(model, formats, contexts, batch=args.batch, gpu=gpu, num_gpus=args.gpus)
    accuracy = [a for a in (accuracy_note(f, None) for f in formats) if a is not None]
    layout, per_gpu = _kv_size_layout(args, model, gpu, rows)
    if args.json:
        out = {**rows_to_json(model, rows, notes), "accuracy": accuracy}
        if layout is not None:
            out["layout"] = layout.describe(args.gpus)
            out["per_gpu"] = [asdict(r) for r in per_gpu]
        print(json.dumps(out, indent=2))
        return 0
    from kvsim.render import print_kv_size

    print_kv_size(model, gpu, args.gpus, rows, notes, accuracy)
    if layout is not None:
        from kvsim.render import print_gpu_memory

        print_gpu_memory(layout.describe(args.gpus), per_gpu)
    return 0


def _kv_size_layout(
    args: argparse.Namespace, model: ModelSpec, gpu: GPUSpec, rows: list[KVSizeRow]
) -> tuple[ParallelLayout | None, list[GPUMemoryRow]]:
    """``--attention`` / ``--ep`` / ``--pp`` / ``--cp``: the layout (validated as ``cluster.parallel``)
    and its per-GPU rows."""
    if args.attention is None and args.ep is None and args.pp is None and args.cp is None:
        return None, []
    from kvsim.kvsize import gpu_memory_rows
    from kvsim.spec.parallel import read_parallel
    from kvsim.spec.schema import Section

    given = {
        "attention": args.attention or "tp",
        "expert_parallel": args.ep or 1,
        "pipeline_parallel": args.pp or 1,
        "context_parallel": args.cp or 1,
    }
    cluster = Section({"parallel": given}, source="--attention/--ep/--pp/--cp", path="")
    layout = read_parallel(cluster, model, args.gpus)
    assert layout is not None
    return layout, gpu_memory_rows(model, rows, gpu=gpu, num_gpus=args.gpus, layout=layout)


def cmd_run(args: argparse.Namespace) -> int:
    from kvsim.render import print_summary
    from kvsim.report import write_report
    from kvsim.report.outputs import RUN_FILES, check_output_dir, discard_if_empty
    from kvsim.run import run_scenario, write_run
    from kvsim.spec.scenario import load_scenario

    if not args.out.strip():  # before reading anything: an unset shell variable
        check_output_dir(args.out, reads=(), force=args.force)
    sc = load_scenario(args.scenario, args.set)
    reads = (
        ("scenario", Path(args.scenario)),
        ("trace", sc.workload.trace),
        ("model config", sc.model.config_path),
        ("profile", sc.cost_model.profile),
    )
    if args.save_detailed and args.format is None:
        raise KvsimError("only with --format vllm-bench", source="--save-detailed")
    extra = ("vllm_bench.json",) if args.format == "vllm-bench" else ()
    events_path, events = None, None
    if args.kv_events is not None:
        from kvsim.sim.kv_events import KVEventLog, check_events_path

        events_path = check_events_path(
            args.kv_events, reads=reads, out=Path(args.out), writes=(*RUN_FILES, *extra), force=args.force
        )
        events = KVEventLog(sc.kv.block_size)
    existed = Path(args.out).is_dir()
    out = check_output_dir(args.out, reads=reads, force=args.force, files=(*RUN_FILES, *extra))
    try:
        result = run_scenario(
            sc, progress=not args.no_progress, percentiles=args.percentiles, kv_events=events
        )
    except BaseException:
        discard_if_empty(out, existed)
        raise
    try:
        write_run(result, out)
        write_report(out)
        if args.format == "vllm-bench":
            from kvsim.interop.bench_json import write_bench_json

            write_bench_json(result, out, detailed=args.save_detailed, percentiles=args.percentiles)
    except OSError as exc:
        raise KvsimError(f"cannot write results: {exc}", source="--out") from None
    if events is not None and events_path is not None:
        try:
            events.write(events_path)
        except OSError as exc:
            raise KvsimError(
                f"cannot write {events_path}: {exc.strerror or exc}", source="--kv-events"
            ) from None
    print_summary(result.record)
    also = f", {out / extra[0]}" if extra else ""
    also += f", {events_path}" if events_path is not None else ""
    names = ("summary.json", "requests.csv", "timeseries.csv", "tiers.csv", "links.csv", "report.html")
    written = [str(out / n) for n in (*names, "plotly.min.js") if (out / n).is_file()]
    print(f"wrote {', '.join(written)}{also}")
    return 0


def cmd_stack(args: argparse.Namespace) -> int:
    from rich.table import Table

    from kvsim.render import console
    from kvsim.report.outputs import check_output_dir, discard_if_empty
    from kvsim.report.stack import HEADER, stack_cells, write_stack_report
    from kvsim.spec.scenario import load_scenario
    from kvsim.stack import stack_json, stack_rows, write_stack_json

    files = ("stack.json", "stack.html")
    if args.out is not None and not args.out.strip():
        check_output_dir(args.out, reads=(), force=args.force, files=files)
    sc = load_scenario(args.scenario, args.set)
    out = None
    existed = args.out is not None and Path(args.out).is_dir()
    if args.out is not None:
        reads = (("scenario", Path(args.scenario)), ("trace", sc.workload.trace))
        out = check_output_dir(args.out, reads=reads, force=args.force, files=files)
    try:
        data = stack_json(sc, stack_rows(sc, progress=not args.no_progress))
        if args.claims:
            from kvsim.claims import check_claims

            def said(label: str) -> None:
                if not args.no_progress:
                    print(f"claims: running {label}", file=sys.stderr)

            data["claims"] = [c.to_dict() for c in check_claims(sc, progress=said)]
    except BaseException:
        if out is not None:
            discard_if_empty(out, existed)
        raise
    if args.json:
        print(json.dumps(data, indent=2, allow_nan=False))
    else:
        t = Table(title=f"kvsim stack: {sc.name}", title_justify="left")
        for h in HEADER:
            t.add_column(h)
        for r in data["rows"]:
            t.add_row(*stack_cells(r))
        console().print(t)
        print(f"claimed column: {data['claimed_source']}")
        print(f"cost column: {data['cost_basis']}")
        if "claims" in data:
            from kvsim.report.stack import CLAIM_HEADER, claim_cells

            t = Table(title="the documents' rules, checked", title_justify="left")
            for h in CLAIM_HEADER:
                t.add_column(h)
            for c in data["claims"]:
                t.add_row(*claim_cells(c, sep="\n"))
            console().print(t)
    if out is not None:
        try:
            write_stack_json(out / "stack.json", data)
            write_stack_report(out, data)
        except OSError as exc:
            raise KvsimError(f"cannot write results: {exc}", source="--out") from None
        if not args.json:
            print(f"wrote {out / 'stack.json'}, {out / 'stack.html'}")
    return 0


class _AxisAction(argparse.Action):
    """--grid and --zip into one list, in the order given (the first axis varies slowest)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        axes = list(getattr(namespace, "axes", None) or [])
        axes.append((str(option_string), str(values)))
        namespace.axes = axes


def cmd_sweep(args: argparse.Namespace) -> int:
    from kvsim.report import point_reports
    from kvsim.report.outputs import check_output_dir
    from kvsim.report.sweep import SWEEP_FILES, write_sweep_report
    from kvsim.sweep.define import Factor, grid_factor, load_sweep_file, parse_axis, zip_factor
    from kvsim.sweep.runner import prepare_sweep, resumable, run_sweep

    if not args.out.strip():  # before reading anything: an unset shell variable
        check_output_dir(args.out, reads=(), force=args.force, files=SWEEP_FILES)
    if args.ray_address is not None and args.executor != "ray":
        raise KvsimError("only with --executor ray", source="--ray-address")
    if args.executor == "ray":
        from kvsim.sweep.ray_executor import preflight

        preflight(args.ray_address)
    factors: list[Factor | None] = list(load_sweep_file(args.file)) if args.file else []
    zipped: list[tuple[str, list[str]]] = []
    for flag, text in args.axes or []:
        if flag == "--grid":
            factors.append(grid_factor(text))
        else:
            if not zipped:
                factors.append(None)  # the zip group's place: where its first axis was given
            zipped.append(parse_axis(text, "--zip"))
    full = [f if f is not None else zip_factor(zipped, "--zip", "--zip") for f in factors]
    plan = prepare_sweep(args.scenario, full)  # every point validated before anything is written
    reads = (*plan.reads, ("sweep file", Path(args.file) if args.file else None))
    out = check_output_dir(args.out, reads=reads, force=args.force, files=SWEEP_FILES)
    reuse = resumable(plan, out, force=args.force)
    jobs = args.jobs or os.cpu_count() or 1
    try:
        outcome = run_sweep(
            plan,
            out,
            jobs=jobs,
            reuse=reuse,
            finish=point_reports(out),
            progress=not args.no_progress,
            executor=args.executor,
            ray_address=args.ray_address,
        )
        page = write_sweep_report(out)
    except OSError as exc:
        raise KvsimError(f"cannot write results: {exc}", source="--out") from None
    n = len(outcome.results)
    reused = f", {outcome.reused} reused from an earlier run" if outcome.reused else ""
    print(f"{n} points: {n - outcome.failed} ok, {outcome.failed} failed{reused}")
    for r in outcome.results:
        if r.status != "ok":
            print(f"  failed: {plan.points[r.index].id}: {r.error}", file=sys.stderr)
    parquet = (
        f", {out / 'results.parquet'}"
        if outcome.parquet
        else " (no results.parquet: pip install 'kvsim[sweep]')"
    )
    print(f"wrote {out / 'results.csv'}{parquet}, {page}")
    return 1 if outcome.failed else 0


def cmd_plan(args: argparse.Namespace) -> int:
    from kvsim.report import point_reports
    from kvsim.report.outputs import check_output_dir
    from kvsim.report.plan import write_plan_report
    from kvsim.sweep.plan import (
        PLAN_FILES,
        parse_accuracy_budget,
        parse_loads,
        parse_search,
        parse_slo,
        plan_resumable,
        prepare_plan,
        run_plan,
    )

    if not args.out.strip():  # before reading anything: an unset shell variable
        check_output_dir(args.out, reads=(), force=args.force, files=PLAN_FILES)
    slos = [parse_slo(t) for t in args.slo]
    axes = [parse_search(t) for t in args.search]
    loads = parse_loads(args.load)
    budget = None if args.max_accuracy_loss is None else parse_accuracy_budget(args.max_accuracy_loss)
    planner = prepare_plan(args.scenario, slos, axes, loads, args.max_unserved, budget)  # every point checked
    out = check_output_dir(args.out, reads=planner.reads, force=args.force, files=PLAN_FILES)
    reuse = plan_resumable(planner, out, force=args.force)
    jobs = args.jobs or os.cpu_count() or 1

    try:
        data = run_plan(
            planner, out, jobs=jobs, reuse=reuse, finish=point_reports(out), progress=not args.no_progress
        )
        page = write_plan_report(out)
    except OSError as exc:
        raise KvsimError(f"cannot write results: {exc}", source="--out") from None
    from kvsim.render import print_plan

    print_plan(data)
    print(f"wrote {out / 'plan.json'}, {out / 'plan.csv'}, {page}")
    if data["choice"] is not None:
        return 0
    ran = [ld for c in data["configurations"] for ld in c["loads"] if ld.get("evaluated")]
    if ran and all(ld.get("status") == "failed" for ld in ran):  # not a verdict on the SLOs: an error
        raise KvsimError(f"every point failed to run; the first: {ran[0].get('error')}", source="kvsim plan")
    slos = ", ".join(s["text"] for s in data["slos"])
    print(
        f"kvsim plan: no configuration meets {slos} at {', '.join(data['loads'])} (exit 3)", file=sys.stderr
    )
    return 3


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction such as 0.01, got {text!r}") from None
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text!r}")
    return v


def cmd_report(args: argparse.Namespace) -> int:
    from kvsim.report import report_command
    from kvsim.report.compare import compare_command

    if args.out is not None:
        return compare_command(args.run_dir, args.out, force=args.force)
    if len(args.run_dir) > 1:
        raise KvsimError(
            "several run directories are compared into one page; give --out FILE.html", source="kvsim report"
        )
    return report_command(args.run_dir[0], force=args.force)


def cmd_validate(args: argparse.Namespace) -> int:
    if args.against is not None:
        from kvsim.interop.against import against_command

        used = [
            f for f in ("device", "quick", "recalibrate", "scale") if getattr(args, f) not in (None, False)
        ]
        if used:
            raise KvsimError(f"--{used[0]} is for a device run, not with --against", source="validate")
        return against_command(args)
    if args.seed is not None:
        raise KvsimError("only with --against", source="--seed")
    for flag in ("device", "out"):
        if getattr(args, flag) is None:
            raise KvsimError(f"the following arguments are required: --{flag}", source="kvsim validate")
    from kvsim.validation import validate_command

    return validate_command(args)


def cmd_calibrate(args: argparse.Namespace, rest: list[str]) -> int:
    """Runs ``python -m calibrate`` in a child process: kvsim itself never imports torch."""
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "calibrate", *rest], env=env, check=False)
    return proc.returncode


def version() -> str:
    """The installed distribution's version; `kvsim.__version__` when run from a source tree."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("kvsim")
    except PackageNotFoundError:
        from kvsim import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kvsim", description="KV-cache-centred LLM inference cluster simulator")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.add_argument("--version", action="version", version=f"kvsim {version()}")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)

    k = sub.add_parser("kv-size", help="KV-cache memory per sequence and batch, and whether it fits")
    k.add_argument("--model", default="llama-3.1-8b", help="preset name or path to config.json")
    k.add_argument("--format", action="append", help="KV format (repeatable); default bf16,fp8,int4,kvquant4")
    k.add_argument("--context", action="append", type=_context, help="context length, e.g. 131072 or 128K")
    k.add_argument("--batch", type=_positive_int, default=1)
    k.add_argument("--gpu", default="h100-sxm")
    k.add_argument("--gpus", type=_positive_int, default=8, help="GPUs the model is spread over")
    k.add_argument("--group-size", type=_positive_int, default=64)
    k.add_argument("--outlier-fraction", type=float, default=0.01)
    k.add_argument("--json", action="store_true", help="print one JSON object")
    k.add_argument("--attention", choices=["tp", "dp"], help="MoE layout: attention TP or DP over --gpus")
    k.add_argument("--ep", type=_positive_int, help="MoE layout: experts over this many ranks of --gpus")
    k.add_argument("--pp", type=_positive_int, help="pipeline stages, each of --gpus GPUs (x --cp)")
    k.add_argument("--cp", type=_positive_int, help="context-parallel ranks, each of --gpus GPUs")
    k.set_defaults(func=cmd_kv_size)

    r = sub.add_parser("run", help="simulate a scenario and write summary.json, requests.csv, report.html")
    r.add_argument("scenario", help="scenario YAML file")
    r.add_argument("--out", required=True, help="output directory")
    r.add_argument("--force", action="store_true", help="replace files in --out that kvsim did not write")
    r.add_argument("--set", action="append", default=[], metavar="PATH=VALUE", help="override a field")
    r.add_argument("--no-progress", action="store_true")
    r.add_argument(
        "--percentiles",
        type=_percentiles,
        default=(),
        metavar="50,90,99,99.9",
        help="latency percentiles for the table and each distribution's by_percentile (vLLM bench's "
        "--metric-percentiles); default p50, p90, p99 shown, p50..p99.9 written",
    )
    r.add_argument(
        "--format",
        choices=("vllm-bench",),
        help="also write the result in another tool's schema: vllm-bench writes vllm_bench.json, "
        "vllm bench serve's result keys in its units (kvsim/interop/bench_json.py)",
    )
    r.add_argument(
        "--save-detailed",
        action="store_true",
        help="with --format vllm-bench: the per-request lists too (input_lens, output_lens, ttfts, itls)",
    )
    r.add_argument(
        "--kv-events",
        metavar="FILE.jsonl",
        help="also write the replicas' KV events (vLLM's BlockStored / BlockRemoved batches, one JSON "
        "line each; kvsim/sim/kv_events.py)",
    )
    r.set_defaults(func=cmd_run)

    st = sub.add_parser(
        "stack", help="the design documents' technique-stacking table, simulated for a scenario"
    )
    st.add_argument("scenario", help="scenario YAML file (its model, cluster and trace)")
    st.add_argument("--out", help="also write stack.json and stack.html into this directory")
    st.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    st.add_argument("--force", action="store_true", help="replace files in --out that kvsim did not write")
    st.add_argument("--set", action="append", default=[], metavar="PATH=VALUE", help="override a field")
    st.add_argument("--no-progress", action="store_true", help="no progress bar or lines on stderr")
    st.add_argument(
        "--claims",
        action="store_true",
        help="also check the documents' selection rules on the scenario (about 8 more runs, 200 requests each)",
    )
    st.set_defaults(func=cmd_stack)

    sw = sub.add_parser("sweep", help="run a scenario over a grid of overrides; results.csv and sweep.html")
    sw.add_argument("scenario", help="scenario YAML file")
    sw.add_argument(
        "--grid", action=_AxisAction, metavar="PATH=V1,V2", help="an axis of the product (repeatable)"
    )
    sw.add_argument(
        "--zip", action=_AxisAction, metavar="PATH=V1,V2", help="axes varied together (repeat; equal lengths)"
    )
    sw.add_argument("--file", help="sweep file: grid, zip and/or points (scenarios/README.md)")
    sw.add_argument("--out", required=True, help="output directory (a re-run resumes)")
    sw.add_argument("--jobs", type=_positive_int, help="worker processes (default: CPU count)")
    sw.add_argument(
        "--executor",
        choices=("local", "ray"),
        default="local",
        help="local processes, or a Ray cluster (pip install 'kvsim[ray]'; every node sees --out)",
    )
    sw.add_argument("--ray-address", help="Ray cluster address (default: start a local Ray instance)")
    sw.add_argument(
        "--force", action="store_true", help="replace files kvsim did not write, or another sweep"
    )
    sw.add_argument("--no-progress", action="store_true")
    sw.set_defaults(func=cmd_sweep, axes=[])

    pl = sub.add_parser(
        "plan", help="the cheapest configuration meeting latency SLOs; plan.json and plan.html"
    )
    pl.add_argument("scenario", help="scenario YAML file")
    pl.add_argument(
        "--slo", action="append", default=[], metavar="METRIC=DURATION", help="e.g. ttft_p99=2s (repeatable)"
    )
    pl.add_argument(
        "--search",
        action="append",
        default=[],
        metavar="PATH=LO..HI|V1,V2",
        help="a bisected count range (one) or values to try (repeatable)",
    )
    pl.add_argument(
        "--load", metavar="1x,2x", help="multiples of the scenario's arrival rate to meet (default 1x)"
    )
    pl.add_argument(
        "--max-unserved",
        type=_fraction,
        default=0.0,
        metavar="F",
        help="fraction of requests that may be rejected or unfinished (default 0)",
    )
    pl.add_argument(
        "--max-accuracy-loss",
        metavar="PCT",
        help="keep configurations whose cited accuracy-loss estimate is at most this, e.g. 1%%",
    )
    pl.add_argument("--out", required=True, help="output directory (a re-run reuses its points)")
    pl.add_argument("--jobs", type=_positive_int, help="worker processes (default: CPU count)")
    pl.add_argument("--force", action="store_true", help="replace files kvsim did not write, or another plan")
    pl.add_argument("--no-progress", action="store_true")
    pl.set_defaults(func=cmd_plan)

    rep = sub.add_parser("report", help="rebuild report.html from a run directory, without re-running")
    rep.add_argument("run_dir", nargs="+", help="directory written by kvsim run (several: a comparison)")
    rep.add_argument(
        "--out", help="write a comparison of the runs (the first is the baseline) to this .html file"
    )
    rep.add_argument("--force", action="store_true", help="replace a report file that kvsim did not write")
    rep.set_defaults(func=cmd_report)

    v = sub.add_parser(
        "validate",
        help="execute a short trace on a device, simulate it, and write the error table",
        description="Calibrate the device, execute the trace with a scaled-down model driven by kvsim's "
        "own scheduler, simulate it with the fresh profile and with the analytic model, and compare "
        "(validate.json, validate.html, a terminal table; see kvsim/validation.py).",
    )
    v.add_argument("--device", choices=("cpu", "cuda"), help="the device to execute on (not with --against)")
    v.add_argument(
        "--against",
        metavar="RESULT.json",
        help="instead: a vllm bench serve or SGLang bench_serving result, its workload simulated on "
        "--scenario (default scenarios/default.yaml) and compared (kvsim/interop/against.py)",
    )
    v.add_argument(
        "--seed",
        type=int,
        help="with --against: the benchmark's --seed (default the tool's: vLLM 0, SGLang 1)",
    )
    v.add_argument(
        "--quick",
        action="store_true",
        help="refuse traces over 64 requests, 16,384 tokens or 30 s of arrivals (a check, not a shortcut: the "
        "default trace is within them and takes about 1 min on a 2-core CPU, calibration included)",
    )
    v.add_argument("--out", help="output directory (required without --against)")
    v.add_argument(
        "--scenario",
        help="scenario YAML (default scenarios/validate.yaml; scenarios/default.yaml with --against)",
    )
    v.add_argument("--repeats", type=_positive_int, default=3, help="executions recorded (default 3)")
    v.add_argument(
        "--recalibrate",
        action="store_true",
        help="calibrate again before every execution, each simulated with its own profile "
        "(on a shared machine, so that each run follows its calibration by seconds)",
    )
    v.add_argument(
        "--scale",
        type=_positive_int,
        default=None,
        help="divide the model's width and depth by this (default 8 on a CPU, 1 on CUDA)",
    )
    v.add_argument(
        "--num-blocks", type=_positive_int, default=256, help="KV blocks of the pool (default 256)"
    )
    v.add_argument(
        "--cpu-threads",
        type=_positive_int,
        default=1,
        help="torch threads on a CPU, calibration and execution alike (default 1: steadier on a shared CPU)",
    )
    v.add_argument("--force", action="store_true", help="replace files in --out that kvsim did not write")
    v.add_argument("--no-progress", action="store_true")
    v.set_defaults(func=cmd_validate)

    sub.add_parser(
        "calibrate",
        help="measure per-op costs on a device, or import measured tables (kvsim calibrate --help)",
        add_help=False,
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    if (argv and argv[0] == "calibrate") or (
        len(argv) > 1 and argv[0] == "--debug" and argv[1] == "calibrate"
    ):
        i = argv.index("calibrate")
        return cmd_calibrate(argparse.Namespace(), argv[i + 1 :])
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except KvsimError as exc:
            raise _unknown_flags(parser, argv, exc) from None
        if not getattr(args, "func", None):
            build_parser().print_help()
            return 2
        return int(args.func(args))
    except KvsimError as exc:
        if debug:
            raise
        print(error_line(exc), file=sys.stderr)
        return 2
    except OSError as exc:  # after the commands' own checks: a disk full or a folder gone mid-run
        if debug:
            raise
        print(os_error_line(exc), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvsim: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a defect in kvsim, not the user's input: one line, exit 1
        if debug:
            raise
        print(
            f"kvsim: internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)",
            file=sys.stderr,
        )
        return 1
    finally:  # the output folder's lock, taken by the command's --out check (kvsim.report.outputs)
        outputs = sys.modules.get("kvsim.report.outputs")
        if outputs is not None:
            outputs.release_output_locks()


if __name__ == "__main__":
    sys.exit(main())

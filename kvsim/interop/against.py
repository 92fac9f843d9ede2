"""``kvsim validate --against RESULT.json``: a real engine's benchmark next to kvsim's prediction.

Reads a ``vllm bench serve`` result (``--save-result --save-detailed``) or an SGLang
``bench_serving`` result (``--output-details``; JSONL, one run a line: the last is read), rebuilds
the workload it sent and simulates it on the scenario's cluster (default ``scenarios/default.yaml``):

- lengths: ``input_lens`` and ``output_lens`` (the tokens each request really produced); failed
  requests (output 0 or an error) are left out, as the tools leave them out of their metrics;
- arrivals: ``request_rate`` (``inf``: all at 0) and ``burstiness`` drawn as the tool draws them
  (vLLM: `kvsim.spec.bench.bench_arrivals`; SGLang: Poisson gaps after each request, unscaled),
  seeded with ``--seed`` (default the tool's own: 0 for vLLM, 1 for SGLang). Neither tool saves its
  arrival times, so the draws match the run's only where nothing else drew from numpy's global
  generator first (vLLM's ShareGPT and random datasets do not; SGLang's random dataset does);
  otherwise the process is the same, the instants are not.

It prints the error table of `kvsim validate` (measured, simulated, simulated / measured - 1) for
every metric the file holds: mean, median and percentiles of TTFT, TPOT, ITL and E2E latency, the
request and output throughput and the duration. Refused (one line, exit 2): another tool's file,
a version without the keys read here, no per-request data, ramp-up arrivals, and a client-side
``max_concurrency`` (kvsim's arrivals are open-loop: a concurrency limit is not simulated).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvsim.errors import KvsimError
from kvsim.interop.bench_json import FILE as BENCH_FILE
from kvsim.interop.bench_json import bench_result
from kvsim.run import RunResult, run_scenario, write_run
from kvsim.spec.bench import bench_arrivals
from kvsim.spec.scenario import Scenario
from kvsim.spec.schema import shorten
from kvsim.spec.workload import Workload

SCHEMA = "kvsim-against"
VERSION = 1
FILE = "against.json"
ROOT = Path(__file__).resolve().parent.parent.parent
DEFAULT_SCENARIO = ROOT / "scenarios" / "default.yaml"
DEFAULT_SEED = {"vllm": 0, "sglang": 1}
_LATENCY = ("ttft", "tpot", "itl", "e2el")
_STAT = re.compile(r"^(mean|median|p\d+(?:\.\d+)?)_(ttft|tpot|itl|e2el|e2e_latency)_ms$")


@dataclass(frozen=True)
class BenchRun:
    """One benchmark result: the tool that wrote it, its keys, and where it came from."""

    tool: str  # "vllm" | "sglang"
    data: dict[str, Any]
    source: str
    note: str | None  # e.g. "line 3 of 3"


def read_bench_result(path: Path) -> BenchRun:
    """The result in `path`; a `KvsimError` naming the file for anything it cannot use."""
    src = str(path)
    if not path.is_file():
        raise KvsimError("result file not found", source=src)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise KvsimError(f"cannot read the result: {shorten(str(exc), 120)}", source=src) from None
    note = None
    try:
        data = json.loads(text)  # SGLang writes request_rate inf as Infinity: the plain parser
    except ValueError:
        lines = [ln for ln in text.splitlines() if ln.strip()]
        try:
            data = json.loads(lines[-1]) if lines else None
        except ValueError:
            data = None
        if data is None:
            raise KvsimError(
                "not a JSON result (vllm bench serve or SGLang bench_serving)", source=src
            ) from None
        note = f"line {len(lines)} of {len(lines)}"
    if not isinstance(data, dict):
        raise KvsimError(f"expected one JSON object, got a {type(data).__name__}", source=src)
    if data.get("schema") == "kvsim-summary":
        raise KvsimError(
            "is kvsim's own summary.json; --against reads a vllm bench serve or SGLang bench_serving result",
            source=src,
        )
    if "total_output_tokens_retokenized" in data or "mean_e2e_latency_ms" in data:
        tool = "sglang"
    elif "mean_ttft_ms" in data and ({"endpoint_type", "tokenizer_id", "burstiness"} & data.keys()):
        tool = "vllm"
    else:
        keys = ", ".join(list(map(str, data))[:6])
        raise KvsimError(
            f"not a vllm bench serve or SGLang bench_serving result (keys: {shorten(keys, 100)})", source=src
        )
    name = "vllm bench serve" if tool == "vllm" else "SGLang bench_serving"
    for key in ("completed", "duration", "request_rate", "mean_ttft_ms"):
        if key not in data:
            raise KvsimError(f"has no {key!r}: a {name} version kvsim does not read", source=src)
    if "input_lens" not in data or "output_lens" not in data:
        flag = "--save-result --save-detailed" if tool == "vllm" else "--output-details"
        raise KvsimError(
            f"has no per-request data (input_lens, output_lens): rerun {name} with {flag}", source=src
        )
    if data.get("ramp_up_strategy") is not None:
        raise KvsimError(
            f"ramp-up arrivals ({data['ramp_up_strategy']}) are not rebuilt; use a fixed --request-rate",
            source=src,
        )
    if data.get("max_concurrency") is not None:
        raise KvsimError(
            f"max_concurrency {data['max_concurrency']}: a client-side concurrency limit is not simulated "
            "(kvsim's arrivals are open-loop); compare a run without --max-concurrency",
            source=src,
        )
    return BenchRun(tool, data, src, note)


def _lens(run: BenchRun) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prompt, output, ok) per request sent; ok: it completed (output > 0, no error)."""
    d = run.data
    ins, outs = d["input_lens"], d["output_lens"]
    for key, v in (("input_lens", ins), ("output_lens", outs)):
        if not isinstance(v, list) or not all(type(x) is int and x >= 0 for x in v):
            raise KvsimError(f"{key} must be a list of integers >= 0", source=run.source)
    if len(ins) != len(outs) or not ins:
        raise KvsimError(
            f"input_lens has {len(ins)} entries, output_lens {len(outs)}: expected equal, at least one",
            source=run.source,
        )
    errors = d.get("errors")
    failed = (
        [bool(e) for e in errors]
        if isinstance(errors, list) and len(errors) == len(ins)
        else [False] * len(ins)
    )
    prompt = np.array(ins, np.int64)
    output = np.array(outs, np.int64)
    ok = (output > 0) & (prompt > 0) & ~np.array(failed, bool)
    if not ok.any():
        raise KvsimError("no request completed (every output_lens is 0 or has an error)", source=run.source)
    return prompt, output, ok


def _rate(run: BenchRun) -> float:
    v = run.data["request_rate"]
    if v == "inf" or (isinstance(v, float) and math.isinf(v) and v > 0):
        return math.inf
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise KvsimError(
            f"request_rate must be a number > 0 or inf, got {shorten(repr(v))}", source=run.source
        )
    return float(v)


def arrivals(run: BenchRun, n: int, seed: int) -> np.ndarray:
    """(n,) arrival times (s) as the tool drew them (module docstring)."""
    rate = _rate(run)
    if run.tool == "vllm":
        burst = run.data.get("burstiness", 1.0)
        if isinstance(burst, bool) or not isinstance(burst, (int, float)) or not burst > 0:
            raise KvsimError(
                f"burstiness must be a number > 0, got {shorten(repr(burst))}", source=run.source
            )
        return bench_arrivals(n, rate, float(burst), seed)
    if math.isinf(rate):
        return np.zeros(n)
    gaps = np.random.RandomState(seed).exponential(1.0 / rate, n)  # SGLang: sleep after each request
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])


def rebuilt_workload(run: BenchRun, seed: int) -> tuple[Workload, int]:
    """The workload the benchmark sent (its completed requests) and how many failed ones were left out."""
    prompt, output, ok = _lens(run)
    t = arrivals(run, len(prompt), seed)
    wl = Workload(
        arrival_s=t[ok],
        prompt_tokens=prompt[ok],
        output_tokens=output[ok],
        hash_ids=None,  # the prompts' text is not in the result: no prefix sharing is assumed
        hash_block_tokens=16,
        source=run.source,
        line_numbers=None,
        skipped_lines=0,
        dropped={},
    )
    return wl, int((~ok).sum())


def _measured(run: BenchRun) -> dict[str, tuple[float, str]]:
    """metric name (vLLM's key) -> (value in SI units, unit) for every metric the file holds."""
    d = run.data
    out: dict[str, tuple[float, str]] = {}
    for key, v in d.items():
        m = _STAT.match(key)
        if m and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            metric = "e2el" if m.group(2) == "e2e_latency" else m.group(2)
            out[f"{m.group(1)}_{metric}_ms"] = (v / 1000.0, "s")
    for key, unit in (("request_throughput", "req/s"), ("output_throughput", "tok/s"), ("duration", "s")):
        v = d.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[key] = (float(v), unit)
    return out


def _order(name: str) -> tuple[int, int, float]:
    for i, m in enumerate(_LATENCY):
        if name.endswith(f"_{m}_ms"):
            stat = name.split("_")[0]
            rank = {"mean": -2.0, "median": -1.0}.get(stat)
            return (0, i, rank if rank is not None else float(stat[1:]))
    return (1, 0, 0.0)


def against(
    run: BenchRun, sc: Scenario, *, seed: int | None = None, progress: bool = False
) -> tuple[dict[str, Any], RunResult]:
    """Simulate the benchmark's workload on `sc`; the table (``against.json``'s content) and the run."""
    s = DEFAULT_SEED[run.tool] if seed is None else seed
    wl, failed = rebuilt_workload(run, s)
    measured = _measured(run)
    pcts = sorted({float(k.split("_")[0][1:]) for k in measured if k.startswith("p")})
    sc = replace(sc, workload=replace(sc.workload, max_requests=None))
    result = run_scenario(sc, progress=progress, workload=wl, percentiles=tuple(pcts))
    sim = bench_result(result, percentiles=tuple(pcts) or (99.0,))
    rows = []
    for name in sorted(measured, key=_order):
        meas, unit = measured[name]
        v = sim.get(name)
        simv = None if v is None else (v / 1000.0 if name.endswith("_ms") else float(v))
        err = None if simv is None or meas == 0 else simv / meas - 1.0
        rows.append({"metric": name, "unit": unit, "measured": meas, "simulated": simv, "error": err})
    notes = []
    if run.note:
        notes.append(f"read the last result of the file ({run.note})")
    if failed:
        notes.append(f"{failed:,} failed requests of the benchmark left out")
    model = run.data.get("model_id") or run.data.get("model")
    if model:
        notes.append(f"measured with model {shorten(str(model), 80)}; simulated: {sc.model.name} ({sc.name})")
    notes.append(f"arrivals drawn as {run.tool}'s, seed {s} (the file holds no arrival times)")
    notes.append("the prompts' text is not in the file: no prefix sharing between requests is simulated")
    data = {
        "schema": SCHEMA,
        "version": VERSION,
        "result": run.source,
        "tool": run.tool,
        "scenario": sc.source,
        "requests": len(wl),
        "metrics": rows,
        "notes": notes,
        "warnings": list(result.record.warnings),
    }
    return data, result


def table_lines(data: dict[str, Any]) -> list[str]:
    """The error table as text lines, as `kvsim validate`'s."""
    from kvsim.validation import _num, _pct

    tool = "vllm bench serve" if data["tool"] == "vllm" else "SGLang bench_serving"
    head = f"{'metric':<20} {'measured':>12} {'simulated':>12} {'error':>9}"
    lines = [f"kvsim validate --against {data['result']} ({tool}, {data['requests']:,} requests)", head]
    lines.append("-" * len(head))
    for r in data["metrics"]:
        u = r["unit"]
        lines.append(
            f"{r['metric']:<20} {_num(r['measured'], u):>12} {_num(r['simulated'], u):>12} {_pct(r['error']):>9}"
        )
    lines += [f"note: {n}" for n in data["notes"]]
    lines += [f"warning: {w}" for w in data["warnings"]]
    return lines


def against_command(args: Any) -> int:
    """``kvsim validate --against RESULT [--scenario S] [--seed N] [--out DIR]``."""
    from kvsim.report.outputs import RUN_FILES, check_output_dir
    from kvsim.spec.scenario import load_scenario

    if args.out is not None and not args.out.strip():
        check_output_dir(args.out, reads=(), force=args.force)
    run = read_bench_result(Path(args.against))
    scenario = args.scenario or str(DEFAULT_SCENARIO)
    sc = load_scenario(scenario, getattr(args, "set", None) or [])
    out = None
    if args.out is not None:
        reads = (("result", Path(args.against)), ("scenario", Path(scenario)))
        out = check_output_dir(args.out, reads=reads, force=args.force, files=(*RUN_FILES, FILE, BENCH_FILE))
    data, result = against(run, sc, seed=args.seed, progress=not args.no_progress)
    if out is not None:
        try:
            write_run(result, out)
            (out / FILE).write_text(json.dumps(data, indent=2, allow_nan=False) + "\n", encoding="utf-8")
            (out / BENCH_FILE).write_text(
                json.dumps(bench_result(result, detailed=True)) + "\n", encoding="utf-8"
            )
        except OSError as exc:
            raise KvsimError(f"cannot write results: {exc}", source="--out") from None
    for line in table_lines(data):
        print(line)
    if out is not None:
        print(f"wrote {out / FILE}, {out / BENCH_FILE}, {out / 'summary.json'}")
    return 0

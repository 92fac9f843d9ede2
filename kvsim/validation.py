"""``kvsim validate``: execute a short trace for real, simulate the same trace, and publish the error.

1. **Calibrate** the device just before (``python -m calibrate --device D --quick``, a child
   process), at the shapes of the model validated and with its grid reaching the trace's largest
   step, decode batch and context, so that no step is priced off the grid.
2. **Execute** the trace (``python -m validate``, a child process: kvsim never imports torch): a
   Llama-shaped model with random weights, scaled down from the scenario's model (`scaled_config`),
   over a real paged KV pool driven by `kernels/`, scheduled by kvsim's own pure
   `kvsim.core` scheduler and KV cache manager. Arrivals follow the wall clock. A warm-up run is
   discarded, then ``--repeats`` runs are recorded. With ``--recalibrate`` steps 1 and 2 alternate:
   each run follows its own calibration by seconds and is simulated with it (on a shared machine
   the neighbours' load drifts between a calibration and runs tens of seconds later).
3. **Simulate** the same trace and configuration twice: priced by the profile just measured, and by
   the analytic model (on a CPU with the device's measured peaks: the fastest GEMM's FLOP/s and the
   fastest memory op's bytes/s; on a GPU with its preset's datasheet peaks). Both simulations step
   one by one (``sim.fast_forward: false``: equal results, and every step's schedule is recorded).
4. **Compare**: TTFT, TPOT and E2E at p50/p90/p99, output throughput and peak KV blocks, each as
   simulated / measured - 1 per repeat (median and range over repeats); and the per-step error:
   each measured step priced by the cost model for its own batch composition (this separates cost
   error from scheduling divergence). Written as ``validate.json``, ``validate.html`` (the
   comparison page of the median run against both simulations, with the error table on top) and a
   terminal table; each run is a run directory (``exec-1/`` ..., ``sim-profile/``,
   ``sim-analytic/``; with ``--recalibrate`` one ``sim-*-N/`` per run) in `kvsim run`'s format, the executions adding ``steps.csv`` and
   ``tokens.csv`` (every token's time).

Validation runs one replica at tensor parallelism 1 with prefix caching off, a KV pool of
``--num-blocks`` blocks in both the execution and the simulations (the simulated GPU's HBM is sized
to give exactly that many).
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from kvsim.core.request import Request, RequestStatus
from kvsim.core.sched.output import SchedulerOutput, SeqKind
from kvsim.core.sched.scheduler import Scheduler
from kvsim.costs.base import CostModel, ForwardBatch
from kvsim.errors import KvsimError
from kvsim.report.compare import compare_page
from kvsim.report.html import write_plotly_js
from kvsim.report.outputs import LOCK_FILE, check_output_dir
from kvsim.results.io import write_requests_csv, write_timeseries_csv
from kvsim.results.record import BusyFraction, ReplicaRecord, RunSummary, write_summary
from kvsim.results.summary import summarize
from kvsim.run import RunResult, make_cost_model, run_scenario, scenario_workload, write_run
from kvsim.sim.cluster import make_pool_and_scheduler
from kvsim.spec.models import ModelSpec
from kvsim.spec.scenario import Scenario, scenario_from_dict
from kvsim.spec.workload import Workload
from kvsim.spec.yaml_loader import read_yaml
from kvsim.validation_ops import per_op_lines, per_op_markdown, per_op_summary

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SCENARIO = ROOT / "scenarios" / "validate.yaml"
SCHEMA = "kvsim-validate"
VERSION = 1
# --quick limits: a short trace (each execution at most 30 s of arrivals and its drain). They do not
# shorten a run: the default trace (32 requests over 5 s) is within them, and with its calibration,
# warm-up and 3 runs takes about 1 min on a 2-core CPU (2 min with --recalibrate).
QUICK_MAX_REQUESTS = 64
QUICK_MAX_TOKENS = 16_384  # prompt + output tokens over the whole trace
QUICK_MAX_SPAN_S = 30.0
# The targets on a CPU with the just-calibrated profile (issue 13): |error| at p50, p99.
TARGET_P50, TARGET_P99 = 0.05, 0.10
METRICS = (
    ("ttft_p50", "s", ("ttft_s", "p50")),
    ("ttft_p90", "s", ("ttft_s", "p90")),
    ("ttft_p99", "s", ("ttft_s", "p99")),
    ("tpot_p50", "s", ("tpot_s", "p50")),
    ("tpot_p90", "s", ("tpot_s", "p90")),
    ("tpot_p99", "s", ("tpot_s", "p99")),
    ("e2e_p50", "s", ("e2e_s", "p50")),
    ("e2e_p90", "s", ("e2e_s", "p90")),
    ("e2e_p99", "s", ("e2e_s", "p99")),
    ("output_throughput", "tok/s", ("output_throughput_tok_s",)),
    ("kv_peak_blocks", "blocks", ("kv_peak_used_blocks",)),
)
MODELS = ("profile", "analytic")


# ---- the model validated ----------------------------------------------------------------------------
def scaled_config(model: ModelSpec, scale: int) -> dict[str, Any]:
    """A Hugging Face ``config.json`` of `model` scaled down by `scale`: query and KV heads, hidden
    size, FFN width, vocabulary and layers divided by `scale` (at least one of each; widths rounded
    up to 16), head_dim and the query/KV head ratio kept (the attention kernels' shapes)."""

    def div(x: int, mult: int = 1) -> int:
        return max(mult, -(-max(1, x // scale) // mult) * mult)

    kv_heads = div(model.num_kv_heads)
    heads = kv_heads * max(1, model.num_heads // model.num_kv_heads)
    return {
        "_source": f"kvsim validate: {model.name} scaled down {scale}x (random weights)",
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": heads * model.head_dim if scale > 1 else model.hidden_size,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": model.head_dim,
        "intermediate_size": div(model.intermediate_size, 16),
        "vocab_size": div(model.vocab_size, 16),
        "num_hidden_layers": div(model.num_layers),
        "max_position_embeddings": model.max_context,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


# ---- scenarios ----------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Setup:
    data: dict[str, Any]  # the scenario file's mapping, paths made absolute
    source: str
    base_dir: Path


def _read_setup(path: Path) -> _Setup:
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise KvsimError("expected a mapping at the top of the scenario", source=str(path))
    data = copy.deepcopy(data)
    wl = data.get("workload")
    if isinstance(wl, dict) and isinstance(wl.get("trace"), str):
        t = Path(wl["trace"])
        wl["trace"] = str(t if t.is_absolute() else (path.parent / t).resolve())
    return _Setup(data, str(path), path.parent)


def _scenario(
    setup: _Setup,
    *,
    model_ref: str,
    num_blocks: int | None,
    block_bytes: float = 0.0,
    weight_bytes: int = 0,
    cost_model: dict[str, Any] | None = None,
    gpu_peaks: dict[str, float] | None = None,
) -> Scenario:
    d = copy.deepcopy(setup.data)
    if isinstance(d.get("model"), dict):
        d["model"]["name"] = model_ref
    else:
        d["model"] = model_ref
    cluster = d.setdefault("cluster", {}) if isinstance(d.get("cluster"), dict) else {}
    d["cluster"] = cluster
    gpu = cluster.get("gpu", "h100-sxm")
    gpu = dict(gpu) if isinstance(gpu, dict) else {"preset": gpu}
    cluster.update({"nodes": 1, "gpus_per_node": 1, "tensor_parallel": 1})
    cluster.pop("replicas", None)
    if num_blocks is not None:  # HBM sized so that the memory plan gives exactly num_blocks
        gpu["hbm"] = int(weight_bytes + num_blocks * block_bytes + block_bytes // 2)
        cluster["gpu_memory_utilization"] = 1.0
        cluster["activation_reserve"] = 0
    gpu.update(gpu_peaks or {})
    cluster["gpu"] = gpu
    kv = d.setdefault("kv", {}) if isinstance(d.get("kv"), dict) else {}
    d["kv"] = kv
    kv["prefix_cache"] = {"scope": "none"}
    if cost_model is not None:
        d["cost_model"] = cost_model
    sim = d.setdefault("sim", {}) if isinstance(d.get("sim"), dict) else {}
    d["sim"] = sim
    sim["fast_forward"] = False  # every step through schedule(), recorded
    sim.pop("max_time", None)
    # The GPU figures set here are validate's (a CPU's peaks, HBM sized to the blocks), not the
    # user's: no warning that they are far from any real GPU.
    quiet = [f"cluster.gpu.{k}" for k in (gpu_peaks or {})] + (
        ["cluster.gpu.hbm"] if num_blocks is not None else []
    )
    return scenario_from_dict(d, source=setup.source, base_dir=setup.base_dir, quiet=quiet)


def _refuse_discarded(setup: _Setup) -> None:
    """Refuse the scenario options validate overrides (`_scenario`: one GPU, HBM sized to
    --num-blocks, no prefix cache, its own cost models, every step recorded): each would be dropped
    without a word. Checked on the file's mapping, before the overrides."""
    d = setup.data

    def given(section: str, key: str) -> Any:
        sec = d.get(section)
        return sec.get(key) if isinstance(sec, dict) else None

    why = "validate executes one GPU (set to 1); leave it out"
    for key in ("nodes", "gpus_per_node", "tensor_parallel", "replicas"):
        if given("cluster", key) not in (None, 1):
            raise KvsimError(why, source=setup.source, path=f"cluster.{key}")
    for key in ("gpu_memory_utilization", "activation_reserve"):
        if given("cluster", key) is not None:
            raise KvsimError(
                "validate sizes HBM to --num-blocks; leave it out", source=setup.source, path=f"cluster.{key}"
            )
    gpu = given("cluster", "gpu")
    if isinstance(gpu, dict) and gpu.get("hbm") is not None:
        raise KvsimError(
            "validate sizes HBM to --num-blocks; leave it out", source=setup.source, path="cluster.gpu.hbm"
        )
    pc = given("kv", "prefix_cache")
    if pc not in (None, False) and not (
        isinstance(pc, dict) and set(pc) <= {"scope"} and pc.get("scope") == "none"
    ):
        raise KvsimError(
            "validate runs without a prefix cache (validate/blocks.py maps every block); give {scope: none} or leave it out",
            source=setup.source,
            path="kv.prefix_cache",
        )
    cm = d.get("cost_model")
    if cm is not None and not (isinstance(cm, dict) and set(cm) <= {"kind"} and cm.get("kind") == "analytic"):
        raise KvsimError(
            "validate simulates with its fresh profile and with the analytic model; leave it out",
            source=setup.source,
            path="cost_model",
        )
    if given("sim", "max_time") is not None:
        raise KvsimError(
            "validate records every step of the whole trace; leave it out",
            source=setup.source,
            path="sim.max_time",
        )
    off = given("kv", "offload")
    if isinstance(off, dict) and off.get("enabled") is True:
        raise KvsimError(UNEXECUTED, source=setup.source, path="kv.offload")


UNEXECUTED = "the real loop does not execute it (validate/loop.py), so nothing would compare it; leave it out"


def _refuse_unexecuted(setup: _Setup, base: Scenario) -> None:
    """Refuse what the real loop does not execute (validate/loop.py): the simulation would run it
    and the comparison would set a mechanism against a loop without it."""
    unexecuted = (
        ("kv.eviction", base.kv.eviction.policy != "none"),
        ("kv.format_mix", base.kv.format_mix is not None),
        ("kv.format_switch", base.kv.format_switch is not None),
        ("scheduler.spec_decode", base.scheduler.spec_decode is not None),
        ("scheduler.preemption", base.scheduler.preemption != "recompute"),
    )
    for path, on in unexecuted:
        if on:
            raise KvsimError(UNEXECUTED, source=setup.source, path=path)


def check_quick(wl: Workload, source: str) -> None:
    n = len(wl)
    tokens = int(wl.prompt_tokens.sum() + wl.output_tokens.sum()) if n else 0
    span = float(wl.arrival_s[-1]) if n else 0.0
    if n > QUICK_MAX_REQUESTS:
        raise KvsimError(
            f"the trace has {n:,} requests; --quick executes at most {QUICK_MAX_REQUESTS} "
            "(drop --quick or cap workload.max_requests)",
            source=source,
            path="workload",
        )
    if tokens > QUICK_MAX_TOKENS:
        raise KvsimError(
            f"the trace has {tokens:,} prompt + output tokens; --quick executes at most {QUICK_MAX_TOKENS:,}",
            source=source,
            path="workload",
        )
    if span > QUICK_MAX_SPAN_S:
        raise KvsimError(
            f"the trace spans {span:.1f} s; --quick executes at most {QUICK_MAX_SPAN_S:.0f} s of arrivals",
            source=source,
            path="workload",
        )
    if n == 0:
        raise KvsimError("the trace has no requests", source=source, path="workload")


# ---- children -------------------------------------------------------------------------------------------
def _child(module: str, argv: list[str], what: str, *, progress: bool, threads: int | None) -> None:
    env = dict(os.environ)
    if threads is not None:  # torch's CPU thread pool: the calibration and the execution alike
        env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", module, *argv],
        env=env,
        check=False,
        stdout=None if progress else subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    if proc.returncode == 0:
        return
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else f"exit status {proc.returncode}"
    if proc.returncode == 2 and ": error: " in last:  # the child's one-line complaint about our input
        raise KvsimError(last.split(": error: ", 1)[1], source="kvsim validate")
    raise RuntimeError(f"{what} failed ({module}, exit {proc.returncode}): {last}")


# ---- recording the simulated schedule ----------------------------------------------------------------
class _RecordingScheduler(Scheduler):
    """A scheduler that keeps every step's composition (the simulations step one by one)."""

    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.log: list[tuple[Any, ...]] = []

    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        if not out.empty:
            self.log.append(
                _composition(out.decode_ctx, out.prefill_new, out.prefill_ctx, self.kv.pool.num_used)
            )
        return out


def _composition(dec_ctx: Any, pre_new: Any, pre_ctx: Any, used: int) -> tuple[Any, ...]:
    return (tuple(dec_ctx), tuple(pre_new), tuple(pre_ctx), int(used))


def _simulate(sc: Scenario) -> tuple[RunResult, list[tuple[Any, ...]]]:
    made: list[_RecordingScheduler] = []

    def make(*args: Any, **kw: Any) -> Scheduler:
        base = make_pool_and_scheduler(*args, **kw)
        s = _RecordingScheduler(
            base.kv,
            max_num_seqs=base.max_num_seqs,
            max_batched_tokens=base.max_batched_tokens,
            chunked_prefill=base.chunked_prefill,
            spec=base.spec,
            host=base.host,
            swap_decider=base.swap_decider,
        )
        made.append(s)
        return s

    res = run_scenario(sc, make_scheduler=make)
    return res, made[0].log


# ---- the executions as run directories ------------------------------------------------------------------
def _nan(x: Any) -> float:
    return float("nan") if x is None else float(x)


def exec_result(
    run: dict[str, Any], sim: RunResult, wl: Workload, device: str
) -> tuple[RunSummary, list[Request]]:
    """The summary of one execution, in the simulation's record shape (same scenario, measured)."""
    sc = sim.scenario
    seqs = []
    for r in run["requests"]:
        i = int(r["id"])
        s = Request(i, float(wl.arrival_s[i]), int(wl.prompt_tokens[i]), int(wl.output_tokens[i]), [], [])
        s.status = RequestStatus(r["status"])
        s.reason = r["reason"]
        s.first_scheduled_s = _nan(r["first_scheduled_s"])
        s.first_token_s = _nan(r["first_token_s"])
        s.finish_s = _nan(r["finish_s"])
        s.preemptions = int(r["preemptions"])
        if s.status is not RequestStatus.REJECTED:
            s.replica, s.num_cached_tokens = 0, 0
        seqs.append(s)
    steps = run["steps"]
    busy = float(sum(st[1] for st in steps))
    span = max([float(st[0]) + float(st[1]) for st in steps] + [float(wl.arrival_s[-1])])
    kv_block_s = float(sum(st[1] * st[6] for st in steps))
    parts = summarize(
        seqs,
        simulated_s=span,
        num_gpus=1,
        gpu_hour_usd=sc.gpu_hour_usd,
        ttft_slo_s=sc.slo.ttft_s,
        tpot_slo_s=sc.slo.tpot_s,
        percentile=sc.slo.percentile,
    )
    rec = dataclasses.replace(
        sim.record,
        **parts,
        kv_peak_used_blocks=int(run["peak_used_blocks"]),
        hbm_peak_bytes=int(
            sim.plan.weight_bytes_per_gpu
            + sim.plan.activation_reserve_bytes
            + int(run["peak_used_blocks"]) * sim.plan.block_bytes_per_gpu
        ),
        prefix_cache_evictions=0,
        steps=len(steps),
        replica_busy_fraction=BusyFraction(mean=busy / span, max=busy / span),
        engine_events=len(steps),
        simulated_s=span,
        wall_s=float(run["wall_s"]),
        sim_speed_x=1.0,
        warnings=(f"measured on {device}: an execution of the trace, not a simulation",),
        config=dataclasses.replace(sim.record.config, cost_model=f"measured:{device}", profile=""),
        replicas=(
            ReplicaRecord(
                index=0,
                requests=sum(1 for s in seqs if s.replica == 0),
                steps=len(steps),
                busy_fraction=busy / span,
                kv_peak_used_blocks=int(run["peak_used_blocks"]),
                kv_mean_used_blocks=kv_block_s / span,
                preemptions=int(sum(s.preemptions for s in seqs)),
            ),
        ),
    )
    return rec, seqs


def write_exec_dir(out: Path, run: dict[str, Any], rec: RunSummary, seqs: list[Request]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_summary(out / "summary.json", rec)
    write_requests_csv(out / "requests.csv", seqs)
    write_timeseries_csv(out / "timeseries.csv", [tuple(s) for s in run["samples"]])
    with (out / "steps.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(("step", "t_start_s", "seconds", "num_decode", "decode_ctx", "prefill_new", "prefill_ctx",
                    "num_sampling", "kv_used_blocks", "preempted"))  # fmt: skip
        for i, st in enumerate(run["steps"]):
            w.writerow((i, repr(round(st[0], 6)), repr(st[1]), len(st[2]), " ".join(map(str, st[2])),
                        " ".join(map(str, st[3])), " ".join(map(str, st[4])), st[5], st[6], st[7]))  # fmt: skip
    with (out / "tokens.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(("id", "token", "t_s"))
        for r in run["requests"]:
            for j, t in enumerate(r["token_times"]):
                w.writerow((r["id"], j, repr(round(t, 6))))


# ---- errors -------------------------------------------------------------------------------------------------
def _get(summary: dict[str, Any], keys: tuple[str, ...]) -> float | None:
    v: Any = summary
    for k in keys:
        v = v.get(k) if isinstance(v, dict) else None
    return None if v is None else float(v)


def _spread(xs: list[float | None]) -> dict[str, float | None]:
    ok = [x for x in xs if x is not None and math.isfinite(x)]
    if not ok:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(ok), "min": min(ok), "max": max(ok)}


def _rel(sim: float | None, meas: float | None) -> float | None:
    if sim is None or meas is None or meas == 0:
        return None
    return sim / meas - 1.0


def step_errors(cost: CostModel, steps: list[list[Any]]) -> list[float]:
    """(predicted / measured - 1) of each measured step, priced for its own batch composition."""
    errs = []
    for st in steps:
        dec_ctx, pre_new, pre_ctx, n_smp = st[2], st[3], st[4], st[5]
        m = len(dec_ctx)
        batch = ForwardBatch(
            (SeqKind.DECODE,) * m + (SeqKind.PREFILL,) * len(pre_new),
            (1,) * m + tuple(pre_new),
            tuple(dec_ctx) + tuple(pre_ctx),
            int(n_smp),
        )
        errs.append(cost.price(batch).seconds / float(st[1]) - 1.0)
    return errs


def error_table(execs: list[dict[str, Any]], sims: list[dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per metric: the measured values, and per cost model the simulated value (the median over
    runs when each run has its own calibration) and each run's error against its own simulation."""
    rows = []
    for name, unit, keys in METRICS:
        meas = [_get(e, keys) for e in execs]
        row: dict[str, Any] = {"metric": name, "unit": unit, "measured": {**_spread(meas), "runs": meas}}
        for m in MODELS:
            vals = [_get(s[m], keys) for s in sims]
            errs = [_rel(v, x) for v, x in zip(vals, meas, strict=True)]
            row[m] = {
                "value": _spread(vals)["median"],
                "runs": vals,
                "error": {**_spread(errs), "runs": errs},
            }
        rows.append(row)
    return rows


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def _num(x: float | None, unit: str) -> str:
    if x is None:
        return "-"
    if unit == "s":
        return f"{x * 1e3:.1f} ms" if x < 10 else f"{x:.2f} s"
    if unit == "blocks":
        return f"{x:.0f}"
    return f"{x:,.1f}"


def table_lines(data: dict[str, Any]) -> list[str]:
    """The error table as text lines (the terminal's and the README's)."""
    head = f"{'metric':<18} {'measured (median [min, max])':<34} {'profile sim':>11} {'error':>18} {'analytic sim':>12} {'error':>18}"
    lines = [head, "-" * len(head)]
    for r in data["metrics"]:
        u = r["unit"]
        me = r["measured"]
        meas = f"{_num(me['median'], u)} [{_num(me['min'], u)}, {_num(me['max'], u)}]"
        cells = []
        for m in MODELS:
            e = r[m]["error"]
            span = (
                f"{_pct(e['median'])} [{_pct(e['min'])}, {_pct(e['max'])}]"
                if len(me["runs"]) > 1
                else _pct(e["median"])
            )
            cells.append((_num(r[m]["value"], u), span))
        lines.append(
            f"{r['metric']:<18} {meas:<34} {cells[0][0]:>11} {cells[0][1]:>18} {cells[1][0]:>12} {cells[1][1]:>18}"
        )
    for m in MODELS:
        st = data["step_time"][m]
        lines.append(
            f"per-step time, {m}: median error {_pct(st['median_error'])}, median |error| "
            f"{_pct(st['median_abs_error'])}, p90 |error| {_pct(st['p90_abs_error'])} over {st['steps']} steps "
            f"(decode-only steps {_pct(st['median_error_by_kind']['decode_only'])}, "
            f"with a prefill {_pct(st['median_error_by_kind']['with_prefill'])})"
        )
    kv = data["kv_blocks"]
    lines.append(
        f"KV blocks: peak identical in every run: {'yes' if kv['peak_identical'] else 'NO'}; "
        f"schedules identical to the simulation's: {kv['schedules_identical']}/{kv['runs']} runs"
    )
    return lines


def markdown_table(data: dict[str, Any]) -> str:
    """The error table in Markdown (``validate.md``: for a README or a benchmark page)."""
    names = {
        "ttft": "TTFT",
        "tpot": "TPOT",
        "e2e": "E2E",
        "output_throughput": "output throughput",
        "kv_peak_blocks": "peak KV blocks",
    }
    out = [
        "| metric | measured | profile sim | error | analytic sim | error |",
        "|---|---|---|---|---|---|",
    ]
    for r in data["metrics"]:
        stem, _, pct = r["metric"].rpartition("_")
        label = f"{names[stem]} {pct}" if stem in names else names.get(r["metric"], r["metric"])
        u = r["unit"]
        cells = [label, _num(r["measured"]["median"], u) + (f" {u}" if u not in ("s", "blocks") else "")]
        for m in MODELS:
            e = r[m]["error"]
            cells += [_num(r[m]["value"], u), f"{_pct(e['median'])} [{_pct(e['min'])}, {_pct(e['max'])}]"]
        out.append("| " + " | ".join(cells) + " |")
    st = data["step_time"]
    out.append(
        "| per-step time (same batch) | {} steps | | median {}, p90 \\|error\\| {} | | median {} |".format(
            st["profile"]["steps"],
            _pct(st["profile"]["median_error"]),
            _pct(st["profile"]["p90_abs_error"]).lstrip("+"),
            _pct(st["analytic"]["median_error"]),
        )
    )
    return "\n".join(out) + "\n"


def _html_table(data: dict[str, Any]) -> str:
    """The error table as HTML, built from the report's escaped parts (`kvsim.report.html`)."""
    from kvsim.report import html

    rows = []
    for r in data["metrics"]:
        u = r["unit"]
        me = r["measured"]
        tds = [r["metric"], f"{_num(me['median'], u)} [{_num(me['min'], u)}, {_num(me['max'], u)}]"]
        for m in MODELS:
            e = r[m]["error"]
            tds += [_num(r[m]["value"], u), f"{_pct(e['median'])} [{_pct(e['min'])}, {_pct(e['max'])}]"]
        rows.append(tds)
    header = ["metric", "measured", "profile sim", "error", "analytic sim", "error"]
    return str(
        html.section(
            f"Validation: simulated vs measured on {data['device']['name']}",
            html.para(
                f"{data['model']['how']}; {data['repeats']} runs, errors as simulated / measured - 1 "
                "(median [min, max] over runs)."
            ),
            html.table(rows, header),
            html.items(table_lines(data)[-3:]),
        )
    )


# ---- the command ---------------------------------------------------------------------------------------------
def _check_cuda() -> None:
    """Refuse ``--device cuda`` where torch sees no GPU (asked of a child: kvsim never imports torch)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    code = "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, check=False, capture_output=True)
    if proc.returncode == 3:
        raise KvsimError("CUDA is not available on this machine (torch sees no GPU)", source="--device")
    if proc.returncode != 0:
        raise KvsimError("cannot import torch, which executing the trace needs", source="--device")


def _check_ours(out: Path, *, force: bool) -> None:
    """A non-empty --out must hold an earlier validation (its validate.json), unless --force."""
    try:
        names = [p.name for p in out.iterdir() if p.name not in (".kvsim-validate-probe", LOCK_FILE)]
    except OSError as exc:
        raise KvsimError(f"cannot read {out}: {exc.strerror or exc}", source="--out") from None
    if not names or force:
        return
    try:
        ours = json.loads((out / "validate.json").read_text(encoding="utf-8")).get("schema") == SCHEMA
    except (OSError, ValueError, AttributeError, RecursionError):
        ours = False
    if not ours:
        raise KvsimError(
            f"{out} holds files and no earlier kvsim validation; use --force or an empty folder",
            source="--out",
        )


def _probe_writable(out: Path) -> None:
    probe = out / ".kvsim-validate-probe"
    try:
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise KvsimError(f"cannot write into {out}: {exc.strerror or exc}", source="--out") from None


def _device_peaks(prof: dict[str, Any]) -> dict[str, float]:
    """A CPU's peaks as measured by its calibration: fastest GEMM FLOP/s, fastest memory op bytes/s."""
    flops = max(float(p["flops_per_s"]) for p in prof["ops"]["gemm"]["points"])
    bw = max(float(p["bw_bytes_per_s"]) for op in ("paged_decode", "copy") for p in prof["ops"][op]["points"])
    return {"bf16_flops": flops, "hbm_bw": bw}


def _first_missing(path: Path) -> Path | None:
    """The outermost folder of `path` that does not exist yet (what a failed command removes)."""
    missing = None
    for p in (path, *path.parents):
        if p.exists() or p.is_symlink():
            break
        missing = p
    return missing


def validate_command(args: Any) -> int:
    """`kvsim validate`; a refused command leaves no folder it created behind."""
    created = _first_missing(Path(args.out)) if args.out.strip() else None
    try:
        return _validate(args)
    except KvsimError:
        if created is not None and created.is_dir():
            shutil.rmtree(created, ignore_errors=True)
        raise


def _validate(args: Any) -> int:
    progress = not args.no_progress

    def say(msg: str) -> None:
        if progress:
            print(f"validate: {msg}", file=sys.stderr, flush=True)

    if not args.out.strip():
        check_output_dir(args.out, reads=(), force=args.force, files=())
    scen_path = Path(args.scenario) if args.scenario else DEFAULT_SCENARIO
    setup = _read_setup(scen_path)
    _refuse_discarded(setup)
    base = _scenario(setup, model_ref=_model_name(setup), num_blocks=None)
    wl = scenario_workload(base)
    if args.quick:
        check_quick(wl, setup.source)
    if not len(wl):
        raise KvsimError("the trace has no requests", source=setup.source, path="workload")
    if base.model.is_moe or base.model.attention.value == "mla":
        raise KvsimError(
            f"{base.model.name}: only dense GQA/MHA models are validated", source=setup.source, path="model"
        )
    kv_fmt = base.kv.format.name
    if kv_fmt not in ("bf16", "fp16"):
        raise KvsimError(
            f"validation executes bf16 or fp16 KV caches, got {kv_fmt}", source=setup.source, path="kv.format"
        )
    _refuse_unexecuted(setup, base)
    if args.device == "cuda":
        _check_cuda()  # before anything is written
    out = check_output_dir(
        args.out,
        reads=(("scenario", scen_path), ("trace", base.workload.trace)),
        force=args.force,
        files=(),
    )
    _check_ours(out, force=args.force)
    _probe_writable(out)
    shown = out
    # Absolute: the scaled config.json and the profiles written here are read back through
    # scenarios whose relative paths resolve against the scenario's folder, not the working one.
    out = out.absolute()
    threads = args.cpu_threads if args.device == "cpu" else None
    scale = args.scale if args.scale is not None else (8 if args.device == "cpu" else 1)
    cfg = scaled_config(base.model, scale)
    model_dir = out / "model" / f"{base.model.name}-div{scale}"
    model_path = model_dir / "config.json"
    try:
        model_dir.mkdir(parents=True, exist_ok=True)
        model_path.write_text(json.dumps(cfg, indent=1) + "\n")
    except OSError as exc:
        raise KvsimError(f"cannot write into {out}: {exc.strerror or exc}", source="--out") from None
    scaled = _scenario(setup, model_ref=str(model_path), num_blocks=None).model
    bs = base.kv.block_size
    block_bytes = scaled.kv_bytes_per_token(base.kv.format) * scaled.kv_share(1) * bs
    weight_bytes = math.ceil(scaled.weight_bytes)
    nb = args.num_blocks

    def scenario_for(cost: dict[str, Any], peaks: dict[str, float] | None = None) -> Scenario:
        return _scenario(
            setup,
            model_ref=str(model_path),
            num_blocks=nb,
            block_bytes=block_bytes,
            weight_bytes=weight_bytes,
            cost_model=cost,
            gpu_peaks=peaks,
        )

    sc_an = scenario_for({"kind": "analytic"})
    sched = sc_an.scheduler
    max_seq = int((wl.prompt_tokens + wl.output_tokens).max())
    loads: dict[str, float | None] = {"before_calibration": _load_average()}
    # Rounds of (a calibration, then executions): one round of --repeats runs, or with
    # --recalibrate one round per run, so each execution follows its own calibration by seconds.
    rounds = [1] * args.repeats if args.recalibrate else [args.repeats]
    for stale in (*out.glob("profile*.json"), *out.glob("records*.json")):
        stale.unlink()  # calibrated afresh: the calibrator would resume an old profile
    run_cfg = {
        "device": args.device,
        "model_config": str(model_path),
        "kv_format": kv_fmt,
        "block_size": bs,
        "num_blocks": nb,
        "max_num_seqs": sched.max_num_seqs,
        "max_batched_tokens": sched.max_batched_tokens,
        "chunked_prefill": sched.chunked_prefill,
        "requests": {
            "arrival_s": wl.arrival_s.tolist(),
            "prompt": wl.prompt_tokens.tolist(),
            "output": wl.output_tokens.tolist(),
        },
        "seed": base.sim.seed,
        "warmup_runs": 1,
        "progress": progress,
    }
    records: dict[str, Any] = {}
    runs: list[tuple[int, dict[str, Any]]] = []  # (round, run)
    profs: list[dict[str, Any]] = []
    for r, n_runs in enumerate(rounds, 1):
        tag = "" if len(rounds) == 1 else f"-{r}"
        prof_path = out / f"profile{tag}.json"
        say(f"calibrating {args.device} for {scaled.name} ({scale}x smaller than {base.model.name})")
        _child(
            "calibrate",
            [
                "--device",
                args.device,
                "--quick",
                # The ops a bf16/fp16 trace without token eviction is priced with: the GEMMs and
                # attention, the decode rows' KV writes (`write`, in the cache's format), the rest
                # of a step (norms, rotary, SiLU, residual adds, embedding, sampling) and the loop's
                # own time per step (the eviction ops would add CPU time and go unused).
                "--ops",
                "gemm,decode,prefill,copy,write,rest,overhead",
                "--model",
                str(model_path),
                "--formats",
                kv_fmt,
                "--max-tokens",
                str(sched.max_batched_tokens),
                "--max-batch",
                str(sched.max_num_seqs),
                "--max-context",
                str(max_seq),
                "--out",
                str(prof_path),
                "--force",
                *(() if progress else ("--no-progress",)),
            ],
            "calibration",
            progress=progress,
            threads=threads,
        )
        profs.append(json.loads(prof_path.read_text()))
        loads[f"after_calibration{tag}"] = _load_average()
        cfg_path = out / "validate-config.json"
        cfg_path.write_text(json.dumps({**run_cfg, "repeats": n_runs, "op_timing": r == len(rounds)}) + "\n")
        say(f"executing {len(wl)} requests, {n_runs} run{'s' if n_runs > 1 else ''} after a warm-up")
        rec_path = out / f"records{tag}.json"
        _child("validate", ["--config", str(cfg_path), "--out", str(rec_path)], "execution",
               progress=progress, threads=threads)  # fmt: skip
        got = json.loads(rec_path.read_text())
        loads[f"after_execution{tag}"] = _load_average()
        records = records or got
        op_run = got.get("op_run")  # the last round's per-op run (`kvsim.validation_ops`)
        runs.extend((r, run) for run in got["runs"])
    device_name = str(records["device"]["name"])
    say("simulating with the profile and the analytic model")
    sims: list[dict[str, RunResult]] = []  # per round
    logs: list[dict[str, list[tuple[Any, ...]]]] = []
    costs: list[dict[str, CostModel]] = []
    for r, prof in enumerate(profs, 1):
        tag = "" if len(rounds) == 1 else f"-{r}"
        peaks = _device_peaks(prof) if args.device == "cpu" else None
        scs = {
            "profile": scenario_for(
                {"kind": "profile", "profile": str(out / f"profile{tag}.json"), "force": True}
            ),
            "analytic": scenario_for({"kind": "analytic"}, peaks),
        }
        sims.append({})
        logs.append({})
        for name, sc in scs.items():
            res, log = _simulate(sc)
            if res.plan.num_blocks != nb:  # pragma: no cover - the HBM sizing is exact
                raise RuntimeError(f"the simulated pool has {res.plan.num_blocks} blocks, not {nb}")
            sims[-1][name], logs[-1][name] = res, log
            write_run(res, out / f"sim-{name}{tag}")
        costs.append({m: make_cost_model(sims[-1][m].scenario) for m in MODELS})
    exec_summaries: list[dict[str, Any]] = []
    run_sims: list[dict[str, dict[str, Any]]] = []
    same_schedule = 0
    peak_same = True
    step_errs: dict[str, list[list[float]]] = {m: [] for m in MODELS}
    for i, (r, run) in enumerate(runs, 1):
        sim = sims[r - 1]
        rec, seqs = exec_result(run, sim["profile"], wl, device_name)
        write_exec_dir(out / f"exec-{i}", run, rec, seqs)
        exec_summaries.append(rec.to_dict())
        run_sims.append({m: sim[m].summary for m in MODELS})
        comp = [_composition(st[2], st[3], st[4], st[6]) for st in run["steps"]]
        same_schedule += comp == logs[r - 1]["profile"]
        peak_same &= all(rec.kv_peak_used_blocks == sim[m].record.kv_peak_used_blocks for m in MODELS)
        for m in MODELS:
            step_errs[m].append(step_errors(costs[r - 1][m], run["steps"]))
    metrics = error_table(exec_summaries, run_sims)
    step_time = {}
    decode_only = np.asarray([not st[3] for _, run in runs for st in run["steps"]], dtype=bool)
    for m in MODELS:
        allerr = np.asarray([e for run_errs in step_errs[m] for e in run_errs])
        by_kind = {
            kind: float(np.median(allerr[mask])) if mask.any() else None
            for kind, mask in (("decode_only", decode_only), ("with_prefill", ~decode_only))
        }
        step_time[m] = {
            "median_error_by_kind": by_kind,
            "median_error": float(np.median(allerr)) if allerr.size else None,
            "median_abs_error": float(np.median(np.abs(allerr))) if allerr.size else None,
            "p90_abs_error": float(np.percentile(np.abs(allerr), 90)) if allerr.size else None,
            "steps": int(allerr.size),
            "per_run_median_error": [float(np.median(e)) if e else None for e in step_errs[m]],
        }
    e2e = [_get(s, ("e2e_s", "p50")) or 0.0 for s in exec_summaries]
    median_run = int(np.argsort(e2e)[len(e2e) // 2]) + 1
    data = {
        "schema": SCHEMA,
        "version": VERSION,
        "device": records["device"],
        "backend": args.device,
        "torch": records.get("torch"),
        "scenario": str(scen_path),
        "model": {
            "name": scaled.name,
            "from": base.model.name,
            "scale": scale,
            "config": cfg,
            "how": f"{base.model.name} scaled down {scale}x ({cfg['num_hidden_layers']} layers, hidden "
            f"{cfg['hidden_size']}, {cfg['num_attention_heads']}/{cfg['num_key_value_heads']} heads of "
            f"{cfg['head_dim']}, FFN {cfg['intermediate_size']}, vocab {cfg['vocab_size']}), random weights",
        },
        "requests": len(wl),
        "num_blocks": nb,
        "block_size": bs,
        "repeats": len(runs),
        "recalibrated": bool(args.recalibrate),
        "median_run": f"exec-{median_run}",
        "profiles": [
            {
                "path": f"profile{'' if len(rounds) == 1 else f'-{r}'}.json",
                "gemm_dtype": p.get("gemm_dtype"),
                "date": p.get("date"),
            }
            for r, p in enumerate(profs, 1)
        ],
        "analytic_peaks": _device_peaks(profs[0])
        if args.device == "cpu"
        else "the GPU preset's datasheet peaks",
        "metrics": metrics,
        "step_time": step_time,
        "kv_blocks": {
            "peak_identical": bool(peak_same),
            "schedules_identical": same_schedule,
            "runs": len(runs),
            "peak_measured": [s["kv_peak_used_blocks"] for s in exec_summaries],
            "peak_simulated": {m: [s[m]["kv_peak_used_blocks"] for s in run_sims] for m in MODELS},
        },
        # The host's 1-minute load average around each phase: on a shared machine, other jobs'
        # load between the calibration and the execution moves the errors more than anything else.
        "load_average": loads,
        "targets": {"p50_abs_error": TARGET_P50, "p99_abs_error": TARGET_P99, "kv_blocks": "identical"},
        "per_op": per_op_summary(costs[-1]["profile"], op_run),
    }
    try:
        (out / "validate.json").write_text(json.dumps(_finite(data), indent=1) + "\n")
        (out / "validate.md").write_text(markdown_table(data) + per_op_markdown(data["per_op"]))
        tag = "" if len(rounds) == 1 else f"-{runs[median_run - 1][0]}"
        page, _ = compare_page(
            [str(out / f"exec-{median_run}"), str(out / f"sim-profile{tag}"), str(out / f"sim-analytic{tag}")]
        )
        page = page.replace("</h1>", "</h1>\n" + _html_table(data), 1)
        (out / "validate.html").write_text(page, encoding="utf-8")
        write_plotly_js(out)  # the page's charts load it from beside it
    except OSError as exc:
        raise KvsimError(f"cannot write results: {exc.strerror or exc}", source="--out") from None
    print(f"validation on {device_name}: {data['model']['how']}, {len(wl)} requests, {data['repeats']} runs")
    la = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in loads.items() if v is not None)
    if la:
        print(f"host load average: {la}")
    for line in [*table_lines(data), *per_op_lines(data["per_op"])]:
        print(line)
    print(f"wrote {shown / 'validate.json'}, {shown / 'validate.html'}")
    return 0


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # not every OS reports one
        return None


def _finite(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def _model_name(setup: _Setup) -> str:
    m = setup.data.get("model")
    if isinstance(m, dict):
        m = m.get("name")
    if not isinstance(m, str):
        raise KvsimError(
            "expected a model preset name or a config.json path", source=setup.source, path="model"
        )
    if m.endswith(".json") or "/" in m:
        p = Path(m)
        return str(p if p.is_absolute() else (setup.base_dir / p).resolve())
    return m

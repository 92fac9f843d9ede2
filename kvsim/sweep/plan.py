"""The capacity planner (``kvsim plan``): the cheapest configuration that meets latency SLOs.

A plan searches *discrete* axes (``--search kv.format=bf16,fp8``: every value tried) and at most
one *count* axis (``--search cluster.nodes=1..64``: an integer range). Latency is taken to fall as
the count grows for fixed discrete choices (more replicas of the same GPU, TP and format), so for
every combination of the discrete values and every load (``--load 2x``: ``workload.rate_scale``
times 2) the smallest count that meets every SLO is found by bisection: the top of the range is run
first (when it misses, no count in the range meets), then halves of the interval, about
``1 + log2(range)`` runs instead of one per count. A point that fails to run counts as missing.
A combination's candidate is the largest of its per-load minimums, run at every load (the runs
bisection skipped are made, so that the choice is checked, not assumed).

All candidates serve the same traffic, so the cheapest is the one with the lowest cluster price
per hour (GPUs x $/GPU-hour, plus its dedicated pool nodes' $/hour, ``kv.prefix_cache.pool_nodes``).
Each GPU type is priced at its own rate (`kvsim.spec.scenario.resolve_gpu_price`:
``pricing.gpu_hour_by_gpu`` > ``pricing.gpu_hour`` > the preset's sourced price); a scenario-wide
``pricing.gpu_hour`` applied to a searched GPU other than the scenario's own is a warning;
cost per million tokens is shown beside it. An SLO bounds a percentile of TTFT, TPOT or E2E and
also demands that no request is rejected or left unfinished, unless ``--max-unserved`` allows a
fraction. Every point is a full run through the sweep's runner (`kvsim.sweep.local`), cached by
its overrides under ``DIR/points/`` so an interrupted or widened plan reuses what it ran.
"""

from __future__ import annotations

import csv
import hashlib
import io
import itertools
import json
import math
import re
import shutil
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvsim.accuracy import ESTIMATE_BASIS, accuracy_estimate, loss_text, within_budget
from kvsim.errors import KvsimError
from kvsim.progress import PointProgress
from kvsim.spec.scenario import GpuPrice, PriceBasis, Scenario, load_scenario
from kvsim.spec.schema import shorten
from kvsim.spec.workload import ARRIVAL_FIELDS, load_workload
from kvsim.sweep.define import Factor, SweepPoint, parse_axis, point_id
from kvsim.sweep.local import Finish, PointTask, run_points
from kvsim.sweep.runner import finished_result, prepare_sweep, refuse_foreign_points, write_atomic
from kvsim.sweep.table import METRIC_COLUMNS, PointResult, file_sha256
from kvsim.units import parse_duration

SCHEMA = "kvsim-plan"
VERSION = 1
PLAN_FILES = ("plan.json", "plan.csv", "plan.html", "plotly.min.js")  # plotly: the points' pages
POINTS = "points"
LOAD_PATH = "workload.rate_scale"
MAX_COUNT_SPAN = 100_000  # a lo..hi range wider than this is a typo; bisection itself would cope
_SLO = re.compile(r"^(ttft|tpot|e2e)_(p50|p90|p99)$")
_DURATION = re.compile(r"^\s*[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?\s*(s|ms|us|µs|ns|min|h)\s*$")
_RANGE = re.compile(r"^\s*(-?\d+)\s*\.\.\s*(-?\d+)\s*$")
_LOAD = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*x\s*$")
CSV_HEAD = ("id", "config", "load")


# ------------------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Slo:
    name: str  # ttft_p99
    column: str  # its results-table column, ttft_p99_s
    bound_s: float
    text: str  # as given, for messages: ttft_p99=2s


@dataclass(frozen=True)
class SearchAxis:
    path: str
    values: tuple[str, ...]  # value texts; for a count axis, every integer lo..hi
    count: bool  # a lo..hi range: the bisected axis


def parse_slo(text: str) -> Slo:
    """``ttft_p99=2s``: a latency percentile (ttft, tpot, e2e x p50, p90, p99) and a duration with
    its unit."""
    name, eq, value = text.partition("=")
    name = name.strip()
    if not eq:
        raise KvsimError(
            f"expected METRIC=DURATION such as ttft_p99=2s, got {shorten(repr(text))}", source="--slo"
        )
    if not _SLO.match(name):
        raise KvsimError(
            f"unknown SLO metric {shorten(repr(name))}; expected ttft, tpot or e2e with _p50, _p90 or _p99",
            source="--slo",
        )
    if not _DURATION.match(value):
        raise KvsimError(
            f"{name}: expected a duration with its unit such as 2s or 50ms, got {shorten(repr(value))}",
            source="--slo",
        )
    try:
        bound = parse_duration(value.strip())
    except KvsimError as exc:
        raise KvsimError(f"{name}: {exc.message}", source="--slo") from None
    return Slo(name, f"{name}_s", bound, f"{name}={value.strip()}")


def parse_search(text: str) -> SearchAxis:
    """``PATH=lo..hi`` (a count axis) or ``PATH=V1,V2,...`` (a discrete axis)."""
    key, eq, vals = text.partition("=")
    m = _RANGE.match(vals) if eq else None
    if m is None:
        if eq and ".." in vals:
            raise KvsimError(
                f"{key.strip()}: expected an integer range lo..hi such as 1..64, got {shorten(repr(vals))}",
                source="--search",
            )
        path, sets = parse_axis(text, "--search")
        return SearchAxis(path, tuple(s.split("=", 1)[1] for s in sets), False)
    path, _ = parse_axis(f"{key}=0", "--search")
    lo, hi = int(m.group(1)), int(m.group(2))
    if lo < 1 or hi < lo:
        raise KvsimError(f"{path}: expected 1 <= lo <= hi, got {lo}..{hi}", source="--search")
    if hi - lo >= MAX_COUNT_SPAN:
        raise KvsimError(f"{path}: {lo}..{hi} spans over {MAX_COUNT_SPAN:,} values", source="--search")
    return SearchAxis(path, tuple(str(v) for v in range(lo, hi + 1)), True)


def parse_loads(text: str | None) -> tuple[float, ...]:
    """``1x,2x,4x`` -> (1.0, 2.0, 4.0): multiples of the scenario's arrival rate."""
    if text is None:
        return (1.0,)
    out: list[float] = []
    for part in text.split(","):
        m = _LOAD.match(part)
        k = float(m.group(1)) if m else 0.0
        if not m or not math.isfinite(k) or k <= 0:
            raise KvsimError(
                f"expected loads such as 1x,2x,0.5x, got {shorten(repr(part.strip()))}", source="--load"
            )
        if k in out:
            raise KvsimError(f"{part.strip()} is given twice", source="--load")
        out.append(k)
    return tuple(out)


_BUDGET = re.compile(r"^\s*(-?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(%?)\s*$")


def parse_accuracy_budget(text: str) -> float:
    """``1%`` or ``0.01`` -> 0.01: the accuracy points a configuration may lose (its combined
    cited estimate, `kvsim.accuracy.accuracy_estimate`)."""
    m = _BUDGET.match(text)
    if m is None:
        raise KvsimError(
            f"expected a percentage such as 1% or 0.5%, got {shorten(repr(text))}",
            source="--max-accuracy-loss",
        )
    v = float(m.group(1)) / (100 if m.group(2) else 1)
    if not math.isfinite(v) or v < 0:
        raise KvsimError(f"an accuracy budget below zero: {text.strip()}", source="--max-accuracy-loss")
    if v >= 1:
        raise KvsimError(
            f"expected a loss below 100%, got {text.strip()} (a fraction: 0.01, or 1%)",
            source="--max-accuracy-loss",
        )
    return v


def load_label(k: float) -> str:
    return f"{k:g}x"


# ----------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Combo:
    """One combination of the discrete axes' values."""

    index: int
    overrides: tuple[str, ...]


@dataclass(frozen=True)
class Planner:
    scenario: Path
    slos: tuple[Slo, ...]
    axes: tuple[SearchAxis, ...]
    loads: tuple[float, ...]
    max_unserved: float
    combos: tuple[Combo, ...]
    count: SearchAxis | None
    base_rate_scale: float
    keys: dict[tuple[str, ...], Hashable]  # each point's overrides -> its workload key
    # configuration overrides -> (GPUs, $/GPU-h and its source, $/h of the dedicated pool nodes)
    cost: dict[tuple[str, ...], tuple[int, GpuPrice, float]]
    reads: tuple[tuple[str, Path | None], ...]
    # configuration overrides -> its combined accuracy-loss estimate (cited, not measured)
    accuracy: dict[tuple[str, ...], dict[str, Any]] = field(default_factory=dict)
    max_accuracy_loss: float | None = None  # --max-accuracy-loss (None: no budget)

    def excluded(self, config: tuple[str, ...]) -> bool:
        """Whether the accuracy budget excludes this configuration."""
        if self.max_accuracy_loss is None:
            return False
        return not within_budget(self.accuracy[config], self.max_accuracy_loss)

    def point_overrides(self, combo: Combo, count: str | None, load: float) -> tuple[str, ...]:
        o = list(combo.overrides)
        if count is not None and self.count is not None:
            o.append(f"{self.count.path}={count}")
        o.append(f"{LOAD_PATH}={self.base_rate_scale * load!r}")
        return tuple(o)

    def config_overrides(self, combo: Combo, count: str | None) -> tuple[str, ...]:
        o = list(combo.overrides)
        if count is not None and self.count is not None:
            o.append(f"{self.count.path}={count}")
        return tuple(o)


def prepare_plan(
    scenario: str,
    slos: Sequence[Slo],
    axes: Sequence[SearchAxis],
    loads: Sequence[float],
    max_unserved: float,
    max_accuracy_loss: float | None = None,
) -> Planner:
    """Check the search and load every point's scenario (every count, value and load) before
    anything runs; the first bad value raises one `KvsimError` naming its flag and value."""
    if not slos:
        raise KvsimError("give at least one --slo, such as --slo ttft_p99=2s", source="kvsim plan")
    names = [s.name for s in slos]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise KvsimError(f"{dup} is given twice", source="--slo")
    counts = [a for a in axes if a.count]
    if len(counts) > 1:
        raise KvsimError(
            f"one lo..hi range is bisected; got two ({counts[0].path}, {counts[1].path}): list the other's values",
            source="--search",
        )
    seen: set[str] = set()
    for a in axes:
        if a.path in seen:
            raise KvsimError(f"{a.path} is searched twice", source="--search")
        if a.path == LOAD_PATH:
            raise KvsimError(f"{LOAD_PATH} is set by --load; give loads there", source="--search")
        seen.add(a.path)
    if not 0 <= max_unserved < 1:
        raise KvsimError(f"expected a fraction in [0, 1), got {max_unserved!r}", source="--max-unserved")
    base = load_scenario(scenario)
    ordered = [a for a in axes if not a.count] + counts  # as Planner.point_overrides orders them
    factors = [
        Factor(f"--search {a.path}", (a.path,), tuple((f"{a.path}={v}",) for v in a.values)) for a in ordered
    ]
    rates = tuple((f"{LOAD_PATH}={base.workload.rate_scale * k!r}",) for k in loads)
    for k, (rate,) in zip(loads, rates, strict=True):
        try:
            load_scenario(scenario, (rate,))
        except KvsimError as exc:
            raise KvsimError(str(exc), source=f"--load {load_label(k)}") from None
    sweep = prepare_sweep(scenario, [*factors, Factor("--load", (LOAD_PATH,), rates)])
    keys = {p.overrides: k for p, k in zip(sweep.points, sweep.keys, strict=True)}
    _check_slowest_load(scenario, sweep.points, sweep.keys, loads, rates)
    cost: dict[tuple[str, ...], tuple[int, GpuPrice, float]] = {}
    accuracy: dict[tuple[str, ...], dict[str, Any]] = {}
    for p in sweep.points[:: len(loads)]:
        sc = load_scenario(scenario, p.overrides)
        cost[p.overrides[:-1]] = (sc.cluster.num_gpus, plan_price(sc), sc.pool_nodes_usd_per_hour)
        accuracy[p.overrides[:-1]] = accuracy_estimate(sc.kv)
    if max_accuracy_loss is not None and not any(e["parts"] for e in accuracy.values()):
        raise KvsimError(
            "no configuration searched uses a lossy technique with an accuracy estimate (kv.format "
            "fp8/int8/int4/kvquant4, kv.eviction): the budget would decide nothing",
            source="--max-accuracy-loss",
        )
    discrete = [a for a in axes if not a.count]
    combos = tuple(
        Combo(i, tuple(f"{a.path}={v}" for a, v in zip(discrete, vs, strict=True)))
        for i, vs in enumerate(itertools.product(*(a.values for a in discrete)))
    )
    return Planner(
        Path(scenario),
        tuple(slos),
        tuple(axes),
        tuple(loads),
        max_unserved,
        combos,
        counts[0] if counts else None,
        base.workload.rate_scale,
        keys,
        cost,
        sweep.reads,
        accuracy,
        max_accuracy_loss,
    )


def plan_price(sc: Scenario) -> GpuPrice:
    """The $/GPU-hour a configuration is ranked by: the cluster's; with ``cluster.disaggregation``,
    the mean over both pools' GPUs at each pool's price (GPUs x it is what the pools cost an hour),
    naming each pool's price and where it comes from."""
    d = sc.cluster.disaggregation
    if d is None:
        return sc.gpu_price
    parts = [f"{q.role} {q.num_gpus} x ${q.price.usd_per_hour:.2f}/h ({q.price.source})" for q in d.pools]
    basis = {q.price.basis for q in d.pools}
    return GpuPrice(
        sc.gpu_hour_usd,
        d.prefill.price.basis if len(basis) == 1 else PriceBasis.SCENARIO,
        "the pools' GPUs: " + "; ".join(parts),
        warning="; ".join(q.price.warning for q in d.pools if q.price.warning),
    )


def _check_slowest_load(
    scenario: str,
    points: Sequence[SweepPoint],
    keys: Sequence[Hashable],
    loads: Sequence[float],
    rates: Sequence[tuple[str]],
) -> None:
    """Read each distinct workload once at the smallest load, where its arrivals are the latest:
    a load so small that the last arrival lands past the time bound (``--load 1e-12x``) is bad
    input, refused here before any run, not a plan of failed points ending "none meets"."""
    slowest = rates[loads.index(min(loads))][0]
    seen: set[Hashable] = set()
    for p, key in zip(points, keys, strict=True):
        if p.overrides[-1] != slowest or key in seen:
            continue
        seen.add(key)
        sc = load_scenario(scenario, p.overrides)
        try:
            load_workload(sc.workload, seed=sc.sim.seed)
        except KvsimError as exc:
            if exc.path not in ARRIVAL_FIELDS:
                raise
            raise KvsimError(
                f"{exc.source}: {exc.message.removesuffix('; raise it')}; give a larger load",
                source=f"--load {load_label(min(loads))}",
            ) from None


# ----------------------------------------------------------------------------------- verdicts


@dataclass(frozen=True)
class Miss:
    what: str  # the SLO's name, or "unserved", or "run"
    value: float | None
    bound: float
    relative: float  # how far over the bound, as a fraction of it (inf: no value)

    def text(self) -> str:
        if self.what == "run":
            return "the run failed"
        if self.what == "unserved":
            assert self.value is not None
            return f"{self.value:.1%} of requests rejected or unfinished (at most {self.bound:.1%})"
        if self.value is None:
            return f"{self.what}: no request completed"
        return f"{self.what} {_dur(self.value)} > {_dur(self.bound)} (+{_dur(self.value - self.bound)}, +{self.relative:.0%})"


def _dur(s: float) -> str:
    return f"{s * 1e3:.4g} ms" if s < 1 else f"{s:.4g} s"


def misses(planner: Planner, r: PointResult) -> list[Miss]:
    """What a point misses, worst first; empty when it meets every SLO."""
    if r.status != "ok":
        return [Miss("run", None, 0.0, math.inf)]
    out: list[Miss] = []
    m = r.metrics
    total = m.get("requests_total") or 0
    unserved = (m.get("requests_rejected") or 0) + (m.get("requests_unfinished") or 0)
    frac = unserved / total if total else 0.0
    if frac > planner.max_unserved:
        out.append(Miss("unserved", frac, planner.max_unserved, frac - planner.max_unserved))
    for s in planner.slos:
        v = m.get(s.column)
        if v is None:
            out.append(Miss(s.name, None, s.bound_s, math.inf))
        elif v > s.bound_s:
            out.append(Miss(s.name, float(v), s.bound_s, float(v) / s.bound_s - 1))
    return sorted(out, key=lambda x: -x.relative)


@dataclass
class PlanRun:
    """The points run so far: overrides -> result; `ran` and `reused` count them. `progress` counts
    the points to run; its total is those run plus a bound on those still to come (`ensure`'s
    `after`)."""

    planner: Planner
    out: Path
    jobs: int
    finish: Finish | None
    reuse: bool
    results: dict[tuple[str, ...], PointResult] = field(default_factory=dict)
    ran: int = 0
    reused: int = 0
    progress: PointProgress | None = None

    def ensure(self, wanted: Sequence[tuple[str, ...]], after: int = 0) -> None:
        """Run (or reuse) every point in `wanted` not yet known, in parallel; `after`: at most how
        many points the plan runs after these (the progress total)."""
        todo = [o for o in dict.fromkeys(wanted) if o not in self.results]
        tasks: list[PointTask] = []
        for o in todo:
            d = self.out / POINTS / plan_point_id(o)
            prior = finished_result(o, d) if self.reuse else None
            if prior is not None:
                self.results[o] = prior
                self.reused += 1
            else:
                tasks.append(PointTask(len(tasks), str(self.planner.scenario), o, d))
        bar = self.progress
        if bar is not None:
            bar.set_total(self.ran + len(tasks) + after, bound=after > 0)
        if not tasks:
            return
        labels = {t.index: point_label(self.planner, t.overrides) for t in tasks}
        done = run_points(
            tasks,
            [self.planner.keys[t.overrides] for t in tasks],
            jobs=self.jobs,
            finish=self.finish,
            on_started=bar.start if bar else None,
            on_result=(lambda r: bar.finished(labels[r.index], r.status == "ok")) if bar else None,
        )
        if bar is not None:
            bar.pause()
        for t, r in zip(tasks, done, strict=True):
            self.results[t.overrides] = r
        self.ran += len(tasks)

    def meets(self, o: tuple[str, ...]) -> bool:
        return not misses(self.planner, self.results[o])


def point_label(p: Planner, overrides: tuple[str, ...]) -> str:
    """A point as a progress line names it: its configuration's overrides and its load."""
    load = float(overrides[-1].split("=", 1)[1]) / p.base_rate_scale
    return ", ".join([*overrides[:-1], f"load {load_label(round(load, 9))}"])


def _rounds(gap: int) -> int:
    """Bisection rounds that narrow a (bad, good) gap to 1: ceil(log2(gap))."""
    return max(gap - 1, 0).bit_length()


def plan_point_id(overrides: tuple[str, ...]) -> str:
    """A point's directory name: its overrides (as the sweep shortens them) and a hash of them,
    so that the same overrides find the same directory whatever order the plan ran them in."""
    slug = point_id(0, overrides, 1).split("-", 1)[1]
    digest = hashlib.sha256("\n".join(overrides).encode()).hexdigest()[:10]
    return f"{slug}-{digest}"


def search(run: PlanRun) -> dict[tuple[int, int], str | None]:
    """Per (combo, load index): the smallest count that meets (None: none in the range). Groups
    bisect side by side, one probe each per round, so a round's runs go to the pool together.
    Without a count axis, every combo is run at every load."""
    p = run.planner
    groups = [(c, li) for c in p.combos for li in range(len(p.loads))]
    if p.count is None:
        run.ensure([p.point_overrides(c, None, p.loads[li]) for c, li in groups])
        return {
            (c.index, li): (None if not run.meets(p.point_overrides(c, None, p.loads[li])) else "")
            for c, li in groups
        }
    values = p.count.values
    # bad: highest index known to miss (-1: none); good: lowest index known to meet (None: unknown)
    state: dict[tuple[int, int], tuple[int, int | None]] = {}
    top = len(values) - 1
    # Each candidate is then checked at its other loads (run_plan): at most combos x (loads - 1).
    checks = len(p.combos) * (len(p.loads) - 1)
    run.ensure(
        [p.point_overrides(c, values[top], p.loads[li]) for c, li in groups],
        after=len(groups) * _rounds(len(values)) + checks,
    )
    for c, li in groups:
        ok = run.meets(p.point_overrides(c, values[top], p.loads[li]))
        state[(c.index, li)] = (-1, top) if ok else (top, None)
    while True:
        probes: dict[tuple[int, int], int] = {}
        for (ci, li), (bad, good) in state.items():
            if good is not None and good - bad > 1:
                probes[(ci, li)] = (bad + good) // 2
        if not probes:
            break
        later = sum(
            _rounds(good - bad) - 1 for bad, good in state.values() if good is not None and good - bad > 1
        )
        run.ensure(
            [p.point_overrides(p.combos[ci], values[m], p.loads[li]) for (ci, li), m in probes.items()],
            after=later + checks,
        )
        for (ci, li), m in probes.items():
            bad, good = state[(ci, li)]
            ok = run.meets(p.point_overrides(p.combos[ci], values[m], p.loads[li]))
            state[(ci, li)] = (bad, m) if ok else (m, good)
    return {k: (values[good] if good is not None else None) for k, (bad, good) in state.items()}


# ------------------------------------------------------------------------------------ results


def _config_entry(run: PlanRun, combo: Combo, count: str | None) -> dict[str, Any]:
    p = run.planner
    gpus, price, other = p.cost[p.config_overrides(combo, count)]
    loads = []
    for k in p.loads:
        o = p.point_overrides(combo, count, k)
        r = run.results.get(o)
        if r is None:
            loads.append({"load": load_label(k), "evaluated": False})
            continue
        ms = misses(p, r)
        loads.append(
            {
                "load": load_label(k),
                "evaluated": True,
                "point": plan_point_id(o),
                "status": r.status,
                "error": r.error,
                "meets": not ms,
                "misses": [
                    {"what": m.what, "value": m.value, "bound": m.bound, "text": m.text()} for m in ms
                ],
                "cost_per_mtok_usd": r.metrics.get("cost_per_mtok_usd"),
                "metrics": {c: _finite(r.metrics.get(c)) for c in METRIC_COLUMNS},
            }
        )
    evaluated = [e for e in loads if e["evaluated"]]
    meets = len(evaluated) == len(loads) and all(e["meets"] for e in evaluated)
    return {
        "combo": combo.index,
        "overrides": list(p.config_overrides(combo, count)),
        "label": ", ".join(p.config_overrides(combo, count)) or "(the scenario as written)",
        "count": count,
        "gpus": gpus,
        "gpu_hour_usd": price.usd_per_hour,
        "gpu_hour_basis": str(price.basis),
        "gpu_hour_source": price.source,
        "price_warning": price.warning or None,
        "pool_nodes_usd_per_hour": other,
        "usd_per_hour": gpus * price.usd_per_hour + other,
        "meets": meets,
        "worst_miss": _worst(evaluated),
        "accuracy": p.accuracy.get(p.config_overrides(combo, count)),
        "excluded_by_budget": p.excluded(p.config_overrides(combo, count)),
        "loads": loads,
    }


def _finite(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _worst(evaluated: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The largest miss over the evaluated loads (None when it meets them all)."""
    worst: tuple[float, dict[str, Any]] | None = None
    for e in evaluated:
        for m in e["misses"]:
            rel = math.inf if m["what"] == "run" or m["value"] is None else _rel(m)
            if worst is None or rel > worst[0]:
                worst = (rel, {**m, "load": e["load"], "relative": None if math.isinf(rel) else rel})
    return worst[1] if worst else None


def _rel(m: dict[str, Any]) -> float:
    if m["what"] == "unserved":
        return float(m["value"]) - float(m["bound"])
    return float(m["value"]) / float(m["bound"]) - 1


def _why_lost(entry: dict[str, Any], choice: dict[str, Any] | None, budget: float | None = None) -> str:
    if entry.get("excluded_by_budget") and budget is not None:
        head = f"accuracy estimate {loss_text(entry['accuracy'])} exceeds the budget {budget:.2%} (cited, not measured)"
        if entry["meets"]:
            return f"{head}; it meets the SLOs at ${entry['usd_per_hour']:.2f}/h"
        return f"{head}; and it {_why_lost({**entry, 'excluded_by_budget': False}, choice)}"
    if not entry["meets"]:
        w = entry["worst_miss"]
        if w is None:
            return "not run at every load"
        others = [
            f"at {ld['load']}: {ld['misses'][0]['text']}"
            for ld in entry["loads"]
            if ld.get("evaluated") and ld["misses"] and ld["load"] != w["load"]
        ]
        return f"misses at {w['load']}: {w['text']}" + "".join(f"; also {o}" for o in others)
    assert choice is not None
    extra = entry["usd_per_hour"] - choice["usd_per_hour"]
    if extra == 0:
        return f"meets the SLOs at the same ${entry['usd_per_hour']:.2f}/h; the choice came first in search order"
    return f"meets the SLOs but costs ${entry['usd_per_hour']:.2f}/h, +${extra:.2f}/h (+{extra / choice['usd_per_hour']:.0%})"


def run_plan(
    planner: Planner,
    out: Path,
    *,
    jobs: int,
    reuse: bool,
    finish: Finish | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Search, then write ``plan.json`` and ``plan.csv`` into `out`; returns the plan.json data.
    `progress`: on stderr, a bar on a terminal, a line per point run when piped (`kvsim.progress`)."""
    (out / POINTS).mkdir(parents=True, exist_ok=True)
    write_atomic(out / "plan.json", json.dumps(_header(planner) | {"state": "running"}, indent=2) + "\n")
    bar = PointProgress(0, bound=True) if progress else None
    run = PlanRun(planner, out, jobs, finish, reuse, progress=bar)
    try:
        mins = search(run)
        _check_candidates(run, mins)
    finally:
        if bar is not None:
            bar.stop()
    return _write_plan(run, mins)


def _candidates(run: PlanRun, mins: dict[tuple[int, int], str | None]) -> list[tuple[Combo, str | None]]:
    """Each combo meeting at every load: with its count, the largest of its per-load minimums."""
    p = run.planner
    candidates: list[tuple[Combo, str | None]] = []
    for c in p.combos:
        per_load = [mins[(c.index, li)] for li in range(len(p.loads))]
        if all(v is not None for v in per_load):
            if p.count is None:
                candidates.append((c, None))
            else:
                need = max(int(v) for v in per_load if v is not None)
                candidates.append((c, str(need)))
    return candidates


def _check_candidates(run: PlanRun, mins: dict[tuple[int, int], str | None]) -> None:
    """Run each candidate at every load (bisection may have met a load at a smaller count only)."""
    p = run.planner
    run.ensure([p.point_overrides(c, n, k) for c, n in _candidates(run, mins) for k in p.loads])


def _write_plan(run: PlanRun, mins: dict[tuple[int, int], str | None]) -> dict[str, Any]:
    planner, out = run.planner, run.out
    p = planner
    candidates = _candidates(run, mins)
    configs: dict[tuple[int, str | None], dict[str, Any]] = {}
    count_pos = {v: i for i, v in enumerate(p.count.values)} if p.count else {}
    for c in p.combos:
        ran = {
            o_count(p, o)
            for o in run.results
            if p.count is not None and len(o) == len(c.overrides) + 2 and o[: len(c.overrides)] == c.overrides
        }
        in_order = sorted(ran, key=lambda v: count_pos[v])
        counts: list[str | None] = [None] if p.count is None else list(in_order)
        for n in counts:
            configs[(c.index, n)] = _config_entry(run, c, n)
    cand = [configs[(c.index, n)] for c, n in candidates]
    notes = []
    for e in cand:  # a miss at a load that a smaller count met: bisection's premise did not hold
        for li, ld in enumerate(e["loads"]):
            smaller = mins[(e["combo"], li)]
            if ld.get("evaluated") and not ld["meets"] and p.count is not None and smaller != e["count"]:
                notes.append(
                    f"{e['label']} misses at {ld['load']} although {p.count.path}={smaller} met it: latency "
                    f"is not monotone in {p.count.path} here; larger counts were not tried"
                )
    meeting = sorted((e for e in cand if e["meets"]), key=lambda e: (e["usd_per_hour"], e["combo"]))
    feasible = [e for e in meeting if not e["excluded_by_budget"]]
    choice = feasible[0] if feasible else None
    budget = p.max_accuracy_loss
    # The answer without the budget, when the budget changed it: the cheapest that meets the SLOs.
    unbudgeted = meeting[0] if meeting and meeting[0] is not choice else None
    budget_note = None
    if unbudgeted is not None and budget is not None:
        budget_note = {
            "label": unbudgeted["label"],
            "usd_per_hour": unbudgeted["usd_per_hour"],
            "accuracy": unbudgeted["accuracy"],
            "text": (
                f"without --max-accuracy-loss {budget:.2%} the choice would be {unbudgeted['label']} at "
                f"${unbudgeted['usd_per_hour']:.2f}/h; its accuracy estimate {loss_text(unbudgeted['accuracy'])} "
                "(cited, not measured) exceeds the budget"
            ),
        }
    runners: list[dict[str, Any]] = []
    if choice is not None:
        others = [e for e in meeting if e is not choice]
        infeasible_best = []
        for c in p.combos:
            if any(e["combo"] == c.index for e in meeting):
                continue
            tried = [e for (ci, _), e in configs.items() if ci == c.index]
            if tried:
                infeasible_best.append(min(tried, key=_closeness))
        below = None
        if p.count is not None and choice["count"] is not None:
            prev = [
                e
                for (ci, n), e in configs.items()
                if ci == choice["combo"] and n is not None and count_pos[n] < count_pos[choice["count"]]
            ]
            if prev:
                below = max(prev, key=lambda e: count_pos[e["count"]])
        runners = [*([below] if below else []), *others, *sorted(infeasible_best, key=_closeness)]
        runners = [{**e, "why": _why_lost(e, choice, budget)} for e in runners]
        closest = None
    else:
        closest_e = min(configs.values(), key=_closeness) if configs else None
        closest = {**closest_e, "why": _why_lost(closest_e, None, budget)} if closest_e else None
    data = _header(planner) | {
        "state": "done",
        "choice": choice,
        "runners_up": runners,
        "closest": closest,
        "budget_excluded": budget_note,
        "notes": notes,
        "warnings": price_warnings(planner),
        "configurations": list(configs.values()),
    }
    write_atomic(out / "plan.json", json.dumps(data, indent=2, allow_nan=False) + "\n")
    write_atomic(out / "plan.csv", plan_csv(data))
    return data | {"points_run": run.ran, "points_reused": run.reused}  # not in plan.json: one seed, one file


def price_warnings(p: Planner) -> list[str]:
    """Each distinct warning of the configurations' prices (a scenario-wide ``pricing.gpu_hour``
    applied to a GPU type other than the scenario's own), in search order."""
    return list(dict.fromkeys(price.warning for _, price, _ in p.cost.values() if price.warning))


def o_count(p: Planner, o: tuple[str, ...]) -> str:
    assert p.count is not None
    prefix = f"{p.count.path}="
    return next(x[len(prefix) :] for x in o if x.startswith(prefix))


def _closeness(e: dict[str, Any]) -> tuple[float, float]:
    w = e["worst_miss"]
    if w is None:
        return (-1.0, e["usd_per_hour"])
    rel = w.get("relative")
    return (math.inf if rel is None else rel, e["usd_per_hour"])


def _header(p: Planner) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "version": VERSION,
        "scenario": str(p.scenario.resolve()),
        "scenario_sha256": file_sha256(p.scenario),
        "slos": [{"name": s.name, "bound_s": s.bound_s, "text": s.text} for s in p.slos],
        "max_unserved": p.max_unserved,
        "search": [
            {"path": a.path, "range": [int(a.values[0]), int(a.values[-1])]}
            if a.count
            else {"path": a.path, "values": list(a.values)}
            for a in p.axes
        ],
        "loads": [load_label(k) for k in p.loads],
        "max_accuracy_loss": p.max_accuracy_loss,
        "accuracy_rule": next(iter(p.accuracy.values()), {}).get("rule"),
        "accuracy_basis": ESTIMATE_BASIS,
        "cost_basis": (
            "cluster $/hour (GPUs x $/GPU-hour + dedicated pool nodes' $/hour): every configuration "
            "serves the same traffic"
        ),
        "price_rule": (
            "each GPU type at its own $/GPU-hour: pricing.gpu_hour_by_gpu, else pricing.gpu_hour, "
            "else the GPU preset's price (each row's gpu_hour_source says which)"
        ),
    }


def plan_csv(data: dict[str, Any]) -> str:
    """One row per point run: its configuration, load, verdict, price and headline metrics."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(
        [
            *CSV_HEAD,
            *("status", "meets", "misses", "gpus", "usd_per_hour", "gpu_hour_usd", "gpu_hour_source"),
            *METRIC_COLUMNS,
        ]
    )
    for e in data["configurations"]:
        for ld in e["loads"]:
            if not ld["evaluated"]:
                continue
            w.writerow(
                [
                    ld["point"],
                    e["label"],
                    ld["load"],
                    ld["status"],
                    "true" if ld["meets"] else "false",
                    "; ".join(m["text"] for m in ld["misses"]),
                    e["gpus"],
                    repr(e["usd_per_hour"]),
                    repr(e["gpu_hour_usd"]),
                    e["gpu_hour_source"],
                    *(_cell(ld["metrics"].get(c)) for c in METRIC_COLUMNS),
                ]
            )
    return buf.getvalue()


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v) if isinstance(v, float) else str(v)


# ----------------------------------------------------------------------------- files and resume


def read_plan(path: Path) -> dict[str, Any] | None:
    """The plan.json at `path`, or None when it is not one kvsim wrote."""
    try:
        if path.stat().st_size > 64 << 20:
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) and data.get("schema") == SCHEMA else None


def is_plan_csv(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            head = f.readline(65536).decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    return head.startswith(",".join(CSV_HEAD) + ",status,meets,")


def plan_resumable(planner: Planner, out: Path, *, force: bool) -> bool:
    """Whether the points under `out` may be reused: a plan.json of the same scenario (path and
    content) is there. Another scenario's plan is refused unless `force` (its points are then
    removed); so is a points folder with no plan.json."""
    old = read_plan(out / "plan.json") if (out / "plan.json").is_file() else None
    if old is None:
        refuse_foreign_points(out, "plan.json", "plan", force=force)
        return False
    new = _header(planner)
    if old.get("scenario") == new["scenario"] and old.get("scenario_sha256") == new["scenario_sha256"]:
        return True
    if not force:
        raise KvsimError(
            f"{out / 'plan.json'} is a plan of another scenario; use --force to replace it, or another --out",
            source="--out",
        )
    shutil.rmtree(out / POINTS, ignore_errors=True)  # kvsim wrote them: a plan's points folder
    return False

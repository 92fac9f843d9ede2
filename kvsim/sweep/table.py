"""A sweep's files: the manifest ``sweep.json``, the results table ``results.csv``, the Pareto front.

``sweep.json`` states what was swept (the scenario's path and SHA-256, the factors, and every
point's id and overrides); a re-run compares it to decide whether it is resuming the same sweep.
``results.csv`` has one row per point, in point order: ``index``, ``id``, one column per swept
path (the override's value text), ``status`` (ok, failed), ``error``, then the headline metrics
taken from each point's summary (never recomputed). Wall-clock fields are left out on purpose, so
that one seed gives one file whatever the number of workers.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsim.errors import KvsimError
from kvsim.results.record import RunSummary
from kvsim.sweep.define import Factor, SweepPoint

SCHEMA = "kvsim-sweep"
VERSION = 1
FIXED_COLUMNS = ("index", "id")
STATUS_COLUMNS = ("status", "error")

# Column -> how to read it from a run summary: every headline metric of `kvsim run`.
METRICS: tuple[tuple[str, Any], ...] = (
    ("requests_total", lambda s: s.requests.total),
    ("requests_completed", lambda s: s.requests.completed),
    ("requests_rejected", lambda s: s.requests.rejected),
    ("requests_unfinished", lambda s: s.requests.unfinished),
    ("ttft_p50_s", lambda s: s.ttft_s.p50),
    ("ttft_p90_s", lambda s: s.ttft_s.p90),
    ("ttft_p99_s", lambda s: s.ttft_s.p99),
    ("tpot_p50_s", lambda s: s.tpot_s.p50),
    ("tpot_p90_s", lambda s: s.tpot_s.p90),
    ("tpot_p99_s", lambda s: s.tpot_s.p99),
    ("e2e_p50_s", lambda s: s.e2e_s.p50),
    ("e2e_p90_s", lambda s: s.e2e_s.p90),
    ("e2e_p99_s", lambda s: s.e2e_s.p99),
    ("throughput_tok_s", lambda s: s.throughput_tok_s),
    ("output_throughput_tok_s", lambda s: s.output_throughput_tok_s),
    ("goodput_req_s", lambda s: s.goodput_req_s),
    ("slo_met", lambda s: s.slo.ttft_met and s.slo.tpot_met),
    ("cost_usd", lambda s: s.cost_usd),
    ("cost_per_mtok_usd", lambda s: s.cost_per_mtok_usd),
    ("hbm_peak_bytes", lambda s: s.hbm_peak_bytes),
    ("hbm_capacity_bytes", lambda s: s.hbm_capacity_bytes),
    ("prefix_hit_rate", lambda s: s.prefix_hit_rate),
    ("preemptions", lambda s: s.preemptions),
    # the combined accuracy-loss estimate (cited, not measured; empty for summaries before it)
    ("accuracy_loss_est", lambda s: s.accuracy_estimate.loss if s.accuracy_estimate else None),
)
METRIC_COLUMNS = tuple(name for name, _ in METRICS)


@dataclass(frozen=True)
class PointResult:
    """One point's outcome: its metrics (column -> value) when it ran, else its error."""

    index: int
    status: str  # "ok" or "failed"
    error: str
    metrics: dict[str, Any]


def metrics_of(summary: RunSummary) -> dict[str, Any]:
    return {name: get(summary) for name, get in METRICS}


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def manifest(scenario: Path, factors: Sequence[Factor], points: Sequence[SweepPoint]) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "version": VERSION,
        "scenario": str(scenario.resolve()),
        "scenario_sha256": file_sha256(scenario),
        "factors": [
            {"label": f.label, "paths": list(f.paths), "sets": [list(s) for s in f.sets]} for f in factors
        ],
        "points": [{"index": p.index, "id": p.id, "overrides": list(p.overrides)} for p in points],
    }


def read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest at `path`, or None when it is not a kvsim sweep manifest."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("points"), list):
        return None
    return data


def swept_paths(factors: Sequence[Factor]) -> list[str]:
    return [p for f in factors for p in f.paths]


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ""
    return str(v)


def results_csv(paths: Sequence[str], points: Sequence[SweepPoint], results: Sequence[PointResult]) -> str:
    """The table's text; `results` in any order, rows in point order."""
    by_index = {r.index: r for r in results}
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow([*FIXED_COLUMNS, *paths, *STATUS_COLUMNS, *METRIC_COLUMNS])
    for p in points:
        r = by_index[p.index]
        values = dict(o.split("=", 1) for o in p.overrides)
        w.writerow(
            [
                p.index,
                p.id,
                *(values.get(k, "") for k in paths),
                r.status,
                r.error,
                *(_cell(r.metrics.get(c)) for c in METRIC_COLUMNS),
            ]
        )
    return buf.getvalue()


PARQUET_KEY = b"kvsim-sweep-results"  # schema metadata that marks a results.parquet as kvsim's own


def results_parquet(path: Path, csv_text: str) -> bool:
    """Write the results table as Parquet (typed: index an integer, metrics floats or booleans,
    empty cells null) beside ``results.csv``; False, writing nothing, where pyarrow is not installed
    (``pip install 'kvsim[sweep]'``)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        return False
    rows = list(csv.DictReader(io.StringIO(csv_text)))
    header = next(csv.reader(io.StringIO(csv_text)))
    columns: dict[str, Any] = {}
    for name in header:
        cells = [r[name] for r in rows]
        if name == "index":
            columns[name] = pa.array([int(c) for c in cells], pa.int64())
        elif name in METRIC_COLUMNS and all(c in ("", "true", "false") for c in cells):
            columns[name] = pa.array([None if not c else c == "true" for c in cells], pa.bool_())
        elif name in METRIC_COLUMNS:
            columns[name] = pa.array([float(c) if c else None for c in cells], pa.float64())
        else:
            columns[name] = pa.array(cells, pa.string())
    table = pa.table(columns).replace_schema_metadata({PARQUET_KEY: b"1"})
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)
    return True


def is_results_parquet(path: Path) -> bool:
    """Whether `path` is a results.parquet kvsim wrote (read without pyarrow: the footer's magic
    and our metadata key in the file)."""
    data = path.read_bytes()
    return data[:4] == b"PAR1" and data[-4:] == b"PAR1" and PARQUET_KEY in data[-65536:]


def read_results(path: Path) -> list[dict[str, str]]:
    """The rows of a ``results.csv`` (column -> text); `KvsimError` when it is not one."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KvsimError(f"cannot read: {exc}", source=str(path)) from None
    rows = list(csv.DictReader(io.StringIO(text)))
    if not text.startswith(",".join(FIXED_COLUMNS) + ","):
        raise KvsimError("not a kvsim sweep results table (no index,id header)", source=str(path))
    return rows


def is_results_csv(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            head = f.readline(65536).decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    cols = head.rstrip("\r\n").split(",")
    return cols[:2] == list(FIXED_COLUMNS) and set(STATUS_COLUMNS + METRIC_COLUMNS) <= set(cols)


# Differences smaller than this share of the larger value are ties for the Pareto front: a
# simulated cost or latency 0.5% apart is within the model's own error, and marking one point
# dominated by it would rank noise. The sweep page states it.
PARETO_REL_TOL = 0.005


def pareto_front(points: Sequence[Sequence[float | None]], rel_tol: float = PARETO_REL_TOL) -> list[bool]:
    """For tuples of objectives, all lower-is-better ((cost, latency), or (cost, latency, accuracy
    loss)): whether each is on the Pareto front (no other point is no worse in every objective and
    better in one, where values within `rel_tol` of each other, relative to the larger, count as
    equal). A tuple with a missing or non-finite value is never on it; equal tuples are on it
    together."""

    def better(a: float, b: float) -> bool:  # a lower than b by more than the tolerance
        return a < b - rel_tol * max(abs(a), abs(b))

    valid: list[tuple[list[float], int]] = []
    for i, pt in enumerate(points):
        vals = [v for v in pt if v is not None and math.isfinite(v)]
        if len(vals) == len(pt):
            valid.append((vals, i))
    on = [False] * len(points)
    for a, i in valid:
        on[i] = not any(
            all(not better(y, x) for x, y in zip(b, a, strict=True))
            and any(better(x, y) for x, y in zip(b, a, strict=True))
            for b, j in valid
            if j != i
        )
    return on

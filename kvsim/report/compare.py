"""Several runs side by side in one HTML page: ``kvsim report A B ... --out FILE.html``.

Reads each run directory as the run report does (``summary.json`` through
`kvsim.results.record.read_summary`; ``requests.csv`` and ``timeseries.csv`` optional, either plain or
as a point's ``.csv.gz``). Shows what
differs between the runs (their ``--set`` overrides, every recorded config field not shared by
all, the cost model), labels each run by it (the title too), a
headline table with every run's delta against the first (absolute and relative), the TTFT and TPOT
CDFs of all runs overlaid, KV blocks in use and queue length over time, each run's warnings, and
where each run came from: scenario name, trace and profile, SHA-256 of ``summary.json`` (and of the
trace/profile files when they are still at the recorded paths), and the kvsim version writing the
page, so that a comparison can be reproduced.

Leaves out: per-replica detail (each run's own report has it) and any recomputation of the
summary's percentiles. Everything user-supplied (names, paths, warnings) is escaped (the page is
a template); plotly.js is loaded from ``plotly.min.js`` beside the page; the page holds no
generation time, so the same inputs give the same bytes.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import plotly.graph_objects as go
from markupsafe import Markup
from plotly.subplots import make_subplots

from kvsim.errors import KvsimError
from kvsim.report import html as h
from kvsim.report.charts import _cdf, _counts, _envelope, _f32, _figure_html, _series_on_grid
from kvsim.report.data import _Csv, _load_csv
from kvsim.report.outputs import check_output_dir, same_file
from kvsim.report.tables import _dur, _float, _get, _gib, _int, _is_num, _note, _pct, _table, _usd
from kvsim.results.record import read_summary

_READS = (
    "summary.json",
    "requests.csv",
    "requests.csv.gz",
    "timeseries.csv",
    "timeseries.csv.gz",
    "report.html",
)
_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")

# (label, path into summary.json, formatter); a delta is shown with the same formatter.
METRICS: tuple[tuple[str, tuple[str, ...], Callable[[Any], str]], ...] = (
    ("requests", ("requests", "total"), _int),
    ("completed", ("requests", "completed"), _int),
    ("TTFT p50", ("ttft_s", "p50"), _dur),
    ("TTFT p99", ("ttft_s", "p99"), _dur),
    ("TPOT p50", ("tpot_s", "p50"), _dur),
    ("TPOT p99", ("tpot_s", "p99"), _dur),
    ("E2E p50", ("e2e_s", "p50"), _dur),
    ("E2E p99", ("e2e_s", "p99"), _dur),
    ("throughput (tok/s)", ("throughput_tok_s",), lambda v: _float(v, ",.0f")),
    ("goodput (req/s)", ("goodput_req_s",), lambda v: _float(v, ",.2f")),
    ("cost per M tokens", ("cost_per_mtok_usd",), _usd),
    ("HBM peak", ("hbm_peak_bytes",), _gib),
    ("prefix hit rate", ("prefix_hit_rate",), _pct),
    ("preemptions", ("preemptions",), _int),
)


def kvsim_version() -> str:
    """The installed kvsim's version, else the package's ``__version__``, else "unknown"."""
    try:
        return importlib.metadata.version("kvsim")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        from kvsim import __version__

        return str(__version__)
    except ImportError:
        return "unknown"


@dataclass(frozen=True)
class _Run:
    path: Path
    label: str
    summary: dict[str, Any]
    requests: _Csv | None
    timeseries: _Csv | None


def _sha256(path: Path) -> str | None:
    try:
        h = hashlib.sha256()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()
    except OSError:
        return None


def check_inputs(run_dirs: Sequence[str], out: str, *, force: bool) -> Path:
    """Refuse bad run directories, one given twice, or an --out that is not ours to write. Returns
    the output path (its folder created)."""
    seen: list[Path] = []
    for d in run_dirs:
        if not d.strip():
            raise KvsimError(
                "empty path (an unset shell variable?); give a run directory", source="kvsim report"
            )
        p = Path(d)
        if not p.is_dir():
            raise KvsimError(
                "run directory " + ("is not a directory" if p.exists() else "not found"), source=d
            )
        if not (p / "summary.json").is_file():
            raise KvsimError("summary.json not found; is this a kvsim run directory?", source=d)
        for q in seen:
            if same_file(p, q):
                raise KvsimError(f"the same run directory is given twice (also as {q})", source=d)
        seen.append(p)
    if not out.strip():
        raise KvsimError("empty path (an unset shell variable?); give a file ending in .html", source="--out")
    target = Path(out)
    if target.suffix.lower() != ".html":
        raise KvsimError(f"{out}: a comparison report is an .html file", source="--out")
    reads = [(name, p / name) for p in seen for name in _READS]
    for what, p in reads:
        if same_file(target, p):
            raise KvsimError(
                f"{out} is the {what} of a run this command reads; choose another --out", source="--out"
            )
        if target.exists() and p.parent.exists() and same_file(target, p.parent):
            raise KvsimError(f"{out} is a run directory this command reads", source="--out")
    files = (target.name, h.PLOTLY_JS)  # the page and the plotly.js beside it
    check_output_dir(str(target.parent), reads=reads, force=force, files=files, flag="--out")
    return target


def _load(run_dirs: Sequence[str]) -> list[_Run]:
    runs: list[_Run] = []
    for d in run_dirs:
        p = Path(d)
        s = read_summary(p / "summary.json").to_dict()
        runs.append(
            _Run(
                p,
                str(s.get("scenario") or p.name),
                s,
                _load_csv(p / "requests.csv"),
                _load_csv(p / "timeseries.csv"),
            )
        )
    labels = run_labels([r.summary for r in runs])
    # Runs that still read alike (nothing recorded differs) are named by their directories too.
    return [
        replace(r, label=f"{lab} ({r.path.name})" if labels.count(lab) > 1 else lab)
        for r, lab in zip(runs, labels, strict=True)
    ]


# Config fields that differ between any two runs without saying how they were run.
_NOT_A_SETTING = frozenset({"overrides", "scenario_path"})
_LABEL_WIDTH = 80


def _value(v: Any) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        return ", ".join(_value(x) for x in v) if v else "none"
    return json.dumps(v, sort_keys=True)


def _settings(s: dict[str, Any]) -> dict[str, str]:
    """A run's recorded settings as "path": "value" text: the config (one level of nesting
    flattened with dots) and the scenario's name."""
    out = {"scenario": str(s.get("scenario") or "–")}
    cfg = s.get("config")
    for k, v in (cfg if isinstance(cfg, dict) else {}).items():
        if k in _NOT_A_SETTING:
            continue
        if isinstance(v, dict):
            out.update({f"{k}.{k2}": _value(v2) for k2, v2 in v.items()})
        else:
            out[str(k)] = _value(v)
    return out


def _overrides(s: dict[str, Any]) -> dict[str, str]:
    """The run's ``--set`` overrides, path to value, in the order given."""
    got = _get(s, "config", "overrides")
    out: dict[str, str] = {}
    for o in got if isinstance(got, list) else []:
        path, _, value = str(o).partition("=")
        out[path] = value
    return out


def differences(summaries: Sequence[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """What differs between the runs: ("--set PATH", each run's value) for every override not given
    alike to all, then (config field, values) for every recorded setting that differs, the scenario
    file included; "–" where a run has none. The cost model comes first, differing or not."""
    rows: list[tuple[str, list[str]]] = []
    overrides = [_overrides(s) for s in summaries]
    for path in dict.fromkeys(p for o in overrides for p in o):
        values = [o.get(path, "–") for o in overrides]
        if len(set(values)) > 1:
            rows.append((f"--set {path}", values))
    settings = [_settings(s) for s in summaries]
    for key in dict.fromkeys(k for st in settings for k in st):
        values = [st.get(key, "–") for st in settings]
        if len(set(values)) > 1:
            rows.append((key, values))
    paths = [str(_get(s, "config", "scenario_path") or "–") for s in summaries]
    if len(set(paths)) > 1:
        rows.append(("scenario file", paths))
    cost = [_cost_model(s) for s in summaries]
    if len(set(cost)) == 1:
        rows.insert(0, ("cost model (the same for every run)", cost))
    else:
        rows = [r for r in rows if r[0] not in ("cost_model", "profile")]
        rows.insert(0, ("cost model", cost))
    return rows


def _cost_model(s: dict[str, Any]) -> str:
    cm = str(_get(s, "config", "cost_model") or "–")
    prof = _profile(s)
    return f"{cm}, profile {prof}" if prof and prof not in cm else cm


def run_labels(summaries: Sequence[dict[str, Any]]) -> list[str]:
    """Each run named by what sets it apart: its overrides that differ from the other runs'
    ("kv.format=fp8, workload.rate_scale=4"), else the config fields that differ, led by the
    scenario's name where the runs are of different scenarios; a lone run by its scenario."""
    names = [str(s.get("scenario") or "–") for s in summaries]
    if len(summaries) < 2:
        return names
    overrides = [_overrides(s) for s in summaries]
    differing = [
        p for p in dict.fromkeys(p for o in overrides for p in o) if len({o.get(p) for o in overrides}) > 1
    ]
    settings = [_settings(s) for s in summaries]
    fields = [
        k
        for k in dict.fromkeys(k for st in settings for k in st)
        if k != "scenario" and "." not in k and len({st.get(k) for st in settings}) > 1
    ]
    labels = []
    for name, o, st in zip(names, overrides, settings, strict=True):
        parts = [f"{p}={o[p]}" for p in differing if p in o]
        if not parts:
            parts = [f"{k}={st[k]}" for k in fields[:3] if k in st]
        text = ", ".join(parts)
        if len(text) > _LABEL_WIDTH:
            text = text[: _LABEL_WIDTH - 3] + "..."
        if len(set(names)) > 1:
            text = f"{name}: {text}" if text else name
        labels.append(text or name)
    return labels


def deltas(
    first: dict[str, Any], other: dict[str, Any]
) -> list[tuple[str, Any, Any, float | None, float | None]]:
    """(metric, first value, other value, other - first, (other - first) / first) per headline metric;
    None where either value is missing or the first is zero (for the relative one)."""
    out = []
    for label, keys, _ in METRICS:
        a, b = _get(first, *keys), _get(other, *keys)
        d = rel = None
        if _is_num(a) and _is_num(b):
            d = float(b) - float(a)
            rel = d / float(a) if a != 0 else None
        out.append((label, a, b, d, rel))
    return out


def _signed(fmt: Callable[[Any], str], d: float) -> str:
    return ("+" if d > 0 else "−" if d < 0 else "±") + fmt(abs(d))


def _tag(i: int) -> str:
    return chr(ord("A") + i) if i < 26 else str(i)


def _differences(runs: list[_Run]) -> Markup:
    rows = differences([r.summary for r in runs])
    header = ["", *(f"{_tag(i)}: {r.label}" for i, r in enumerate(runs))]
    body = [[key, *values] for key, values in rows]
    only_cost = len(rows) == 1
    return h.section(
        "What differs between the runs",
        _table(body, header, cls="kv"),
        _note("Nothing else recorded in the runs' summary.json differs: the same config and overrides.")
        if only_cost
        else _note(
            "From each run's summary.json: its --set overrides and every config field with a value "
            "not shared by all runs (each run is labelled by them)."
        ),
    )


def _headline(runs: list[_Run]) -> Markup:
    header = ["metric", f"A: {runs[0].label}"]
    for i, r in enumerate(runs[1:], start=1):
        tag = _tag(i)
        header += [f"{tag}: {r.label}", f"Δ {tag} − A", f"Δ {tag} / A"]
    rows = []
    per = [deltas(runs[0].summary, r.summary) for r in runs[1:]]
    for m, (label, keys, fmt) in enumerate(METRICS):
        row: list[Any] = [label, fmt(_get(runs[0].summary, *keys))]
        for d in per:
            _, _, b, diff, rel = d[m]
            row.append(fmt(b))
            row.append(h.span(_signed(fmt, diff), delta=repr(diff)) if diff is not None else "–")
            row.append(h.span(f"{rel:+.1%}", rel=repr(rel)) if rel is not None else "–")
        rows.append(row)
    return h.section("Headline, each run against the first (A)", _table(rows, header, cls="num"))


def _ttft_tpot(r: _Csv) -> tuple[np.ndarray, np.ndarray] | None:
    if not r.has("arrival_s", "first_token_s", "finish_s", "output_tokens", "status") or r.rows == 0:
        return None
    arrival, first, finish = r.num("arrival_s"), r.num("first_token_s"), r.num("finish_s")
    out_tok, done = r.num("output_tokens"), r.text("status") == "completed"
    ttft = (first - arrival)[done & np.isfinite(first)]
    ok = done & np.isfinite(first) & (out_tok > 1)  # TPOT excludes the first token, as the summary does
    return ttft, (finish - first)[ok] / (out_tok[ok] - 1)


def _totals(ts: _Csv) -> tuple[np.ndarray, dict[str, np.ndarray]] | None:
    """KV used blocks, running and waiting summed over replicas, on the run's own time grid (thinned
    as the report's are, `_envelope`)."""
    cols = ("kv_used_blocks", "running", "waiting")
    if not ts.has("t_s", "replica", *cols) or ts.rows == 0:
        return None
    t, rep = ts.num("t_s"), ts.num("replica")
    ok = np.isfinite(t) & np.isfinite(rep)
    if not ok.any():
        return None
    grid = np.unique(t[ok])
    total = {c: np.zeros(grid.size) for c in cols}
    for r in np.unique(rep[ok]):
        m = ok & (rep == r)
        order = np.argsort(t[m], kind="stable")
        for c in cols:
            total[c] += _series_on_grid(t[m][order], np.nan_to_num(ts.num(c)[m][order]), grid)
    keep = _envelope(grid, tuple(total.values()))  # the report's rule for series over time
    return _f32(grid[keep]), {c: _counts(v[keep]) for c, v in total.items()}


def _charts(runs: list[_Run]) -> tuple[Markup, int]:
    """The charts' HTML and how many plotly figures it holds."""
    out: list[Markup] = []
    n = 0
    cdf = make_subplots(rows=1, cols=2, subplot_titles=("TTFT", "TPOT"), horizontal_spacing=0.08)
    kv, queue = go.Figure(), go.Figure()
    any_cdf = any_ts = False
    for i, r in enumerate(runs):
        color = _COLORS[i % len(_COLORS)]
        lat = _ttft_tpot(r.requests) if r.requests is not None else None
        if lat is None:
            out.append(_note(f"{r.label}: no usable requests.csv; left out of the CDFs."))
        else:
            for col, vals in ((1, lat[0]), (2, lat[1])):
                x, y = _cdf(vals)
                cdf.add_trace(
                    go.Scatter(
                        x=x,
                        y=y,
                        mode="lines",
                        line_shape="hv",
                        name=r.label,
                        legendgroup=str(i),
                        line={"color": color},
                        showlegend=col == 1,
                    ),
                    row=1,
                    col=col,
                )
            any_cdf = True
        tot = _totals(r.timeseries) if r.timeseries is not None else None
        if tot is None:
            out.append(_note(f"{r.label}: no usable timeseries.csv; left out of the charts over time."))
            continue
        grid, total = tot
        kv.add_trace(
            go.Scatter(
                x=grid,
                y=total["kv_used_blocks"],
                name=r.label,
                mode="lines",
                line_shape="hv",
                line={"color": color},
            )
        )
        for series, dash in (("waiting", "solid"), ("running", "dot")):
            queue.add_trace(
                go.Scatter(
                    x=grid,
                    y=total[series],
                    name=f"{r.label}: {series}",
                    mode="lines",
                    line_shape="hv",
                    line={"color": color, "dash": dash},
                )
            )
        any_ts = True
    if any_cdf:
        for col in (1, 2):
            cdf.update_xaxes(type="log", title_text="seconds (log)", row=1, col=col)
        cdf.update_yaxes(title_text="fraction of requests", range=[0, 1.02], row=1, col=1)
        cdf.update_layout(title="Latency CDFs of completed requests (from each requests.csv)", height=400)
        out.append(_figure_html("cmp-cdf", cdf))
        n += 1
    if any_ts:
        kv.update_layout(
            title="KV blocks in use (sum over replicas)",
            height=360,
            xaxis_title="simulated time (s)",
            yaxis_title="blocks",
        )
        queue.update_layout(
            title="Waiting (solid) and running (dotted) requests, sum over replicas",
            height=360,
            xaxis_title="simulated time (s)",
            yaxis_title="requests",
        )
        out += [_figure_html("cmp-kv", kv), _figure_html("cmp-queue", queue)]
        n += 2
    return h.section("Charts", *out), n


def _file_hash(recorded: Any) -> Markup | str:
    if not isinstance(recorded, str) or not recorded or recorded == "synthetic":
        return "–"
    digest = _sha256(Path(recorded))
    return h.code(digest) if digest else "not found"


def _profile(s: dict[str, Any]) -> str | None:
    p = _get(s, "config", "profile")
    if isinstance(p, str) and p:
        return p
    cm = _get(s, "config", "cost_model")
    if isinstance(cm, str) and cm.startswith("profile:"):
        return cm[len("profile:") :]
    return None


def _provenance(runs: list[_Run], version: str) -> Markup:
    rows = []
    for i, r in enumerate(runs):
        s = r.summary
        trace, profile = _get(s, "config", "trace"), _profile(s)
        scenario_path = _get(s, "config", "scenario_path")
        digest = _sha256(r.path / "summary.json") or "not found"
        rows.append(
            [
                _tag(i),
                str(s.get("scenario") or "–"),
                str(scenario_path) if scenario_path else "–",
                str(r.path),
                h.code(digest),
                str(trace) if trace is not None else "–",
                _file_hash(trace),
                profile if profile else "none (analytic cost model)",
                _file_hash(profile) if profile else "–",
                str(_get(s, "config", "kv_format") or "–"),
                str(_get(s, "config", "seed") if _get(s, "config", "seed") is not None else "–"),
            ]
        )
    header = [
        "run",
        "scenario",
        "scenario file",
        "run directory",
        "summary.json SHA-256",
        "trace",
        "trace SHA-256",
        "profile",
        "profile SHA-256",
        "KV format",
        "seed",
    ]
    schemas = ", ".join(f"{s.summary.get('schema')} v{s.summary.get('version')}" for s in runs)
    return h.section(
        "Where each run came from",
        _table(rows, header),
        h.para(f"Compared by kvsim {version}; each summary.json was written by schema {schemas}."),
    )


def _warnings(runs: list[_Run]) -> Markup | str:
    parts = []
    for r in runs:
        w = r.summary.get("warnings") or []
        if w:
            parts += [h.para(f"{r.label}:"), h.items(str(x) for x in w)]
    return h.section("Warnings", *parts) if parts else ""


def compare_title(labels: Sequence[str], summaries: Sequence[dict[str, Any]]) -> str:
    """ "A vs B", led by the scenario's name when every run is of the one scenario (their labels
    then say what sets them apart)."""
    names = {str(s.get("scenario") or "") for s in summaries}
    title = " vs ".join(labels)
    return f"{names.pop()}: {title}" if len(names) == 1 and len(summaries) > 1 else title


def compare_page(run_dirs: Sequence[str], plotly_src: str = h.PLOTLY_JS) -> tuple[str, int]:
    """The comparison page's HTML for `run_dirs` (the first is the baseline) and its number of
    figures; its charts load plotly.js from `plotly_src` (the caller writes it: `h.write_plotly_js`)."""
    runs = _load(run_dirs)
    charts, n_figs = _charts(runs)
    title = compare_title([r.label for r in runs], [r.summary for r in runs])
    sections = [
        _differences(runs),
        _headline(runs),
        charts,
        _warnings(runs),
        _provenance(runs, kvsim_version()),
    ]
    page = h.render(
        "compare.html.j2", title=title, sections=sections, plotly_src=plotly_src if n_figs else None
    )
    return page, n_figs


def compare_command(run_dirs: Sequence[str], out: str, *, force: bool = False) -> int:
    """``kvsim report A B ... --out FILE.html``: write the comparison page; exit code 0."""
    target = check_inputs(run_dirs, out, force=force)
    page, n_figs = compare_page(run_dirs)
    try:
        target.write_text(page, encoding="utf-8")
        if n_figs:
            h.write_plotly_js(target.parent)
    except OSError as exc:
        raise KvsimError(f"cannot write the report: {exc.strerror or exc}", source=out) from None
    print(f"wrote {target}")
    return 0

"""One self-contained HTML report rebuilt from a run directory, without re-running the simulation.

Reads what ``kvsim run`` wrote: ``summary.json`` (required), ``requests.csv`` and ``timeseries.csv``
(each optional; a missing one leaves a note where its charts would be). Shows the scenario and its
config; a headline table (request accounting, TTFT/TPOT/E2E/queueing percentiles, throughput,
goodput against the SLO, cost, HBM peak vs capacity, prefix hits, preemptions, simulated vs wall
time); charts (TTFT and TPOT CDFs, E2E vs arrival, KV-block occupancy, running/waiting queues,
output throughput over time); warnings; rejection reasons; and, when the summary carries one, the
accuracy estimate, labelled as cited rather than measured.

Leaves out: per-request tables (the CSV is the place for those), any recomputation of the headline
percentiles (they are the simulator's numbers from ``summary.json``), and generation timestamps, so
that the same run directory always yields the same bytes. plotly.js is embedded once, inline, so
the file opens offline. This is the only kvsim module that plots.
"""

from __future__ import annotations

import csv
import html
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

from kvsim.errors import KvsimError

# A scatter of more points than this makes the file and the browser slow for no visible gain.
MAX_POINTS = 5_000
# Time-series lines need far fewer points than a 1,200 px wide chart has pixels.
MAX_SERIES_POINTS = 2_000
# The occupancy selector shows the sum and at most this many individual replicas.
MAX_REPLICA_VIEWS = 8
# (div id suffix, figure) pairs and notes on what was left out.
_Figures = tuple[list[tuple[str, go.Figure]], list[str]]
_PLOT_CONFIG = {"responsive": True, "displaylogo": False}
_TEMPLATE = "plotly_white"


# --------------------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class _Csv:
    """Columns of one CSV file, as the strings it held; ``rows`` is the count of data rows."""

    path: Path
    columns: dict[str, list[str]]
    rows: int

    def has(self, *names: str) -> bool:
        return all(n in self.columns for n in names)

    def num(self, name: str) -> np.ndarray:
        """Column ``name`` as float64, NaN where empty (a time that was never reached)."""
        out = np.full(self.rows, np.nan)
        for i, text in enumerate(self.columns[name]):
            text = text.strip()
            if not text:
                continue
            try:
                out[i] = float(text)
            except ValueError:
                raise KvsimError(
                    f"expected a number in column {name!r}, got {text!r}",
                    source=str(self.path),
                    path=f"line {i + 2}",
                ) from None
        return out

    def text(self, name: str) -> np.ndarray:
        return np.array([t.strip() for t in self.columns[name]], dtype=object)


def _load_summary(run_dir: Path) -> dict[str, Any]:
    if not run_dir.is_dir():
        raise KvsimError("run directory not found", source=str(run_dir))
    path = run_dir / "summary.json"
    if not path.is_file():
        raise KvsimError("summary.json not found; is this a kvsim run directory?", source=str(path))
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise KvsimError(f"not valid JSON: {exc.msg}", source=str(path), path=f"line {exc.lineno}") from None
    if not isinstance(data, dict):
        raise KvsimError(f"expected a JSON object, got {type(data).__name__}", source=str(path))
    return data


def _load_csv(path: Path) -> _Csv | None:
    if not path.is_file():
        return None
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            return _Csv(path, {}, 0)
        header = [h.strip() for h in header]
        cols: list[list[str]] = [[] for _ in header]
        rows = 0
        for row in reader:
            if not row:
                continue
            for j in range(len(header)):
                cols[j].append(row[j] if j < len(row) else "")
            rows += 1
    return _Csv(path, dict(zip(header, cols, strict=True)), rows)


# ----------------------------------------------------------------------------------- formatting


def _get(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _dur(v: Any) -> str:
    """Seconds, shown as ms below one second (TTFT/TPOT live there), else as seconds."""
    if not _is_num(v):
        return "–"
    if abs(v) < 1.0:
        return f"{v * 1e3:,.1f} ms"
    return f"{v:,.2f} s"


def _int(v: Any) -> str:
    return f"{int(v):,}" if _is_num(v) else "–"


def _float(v: Any, fmt: str = ",.1f", unit: str = "") -> str:
    return f"{v:{fmt}}{unit}" if _is_num(v) else "–"


def _pct(v: Any) -> str:
    return f"{v:.1%}" if _is_num(v) else "–"


def _gib(v: Any) -> str:
    return f"{v / 2**30:,.1f} GiB" if _is_num(v) else "–"


def _usd(v: Any) -> str:
    return f"${v:,.3f}" if _is_num(v) else "–"


def _percentile_label(v: Any) -> str:
    if _is_num(v):
        return f"p{v * 100:g}" if v <= 1 else f"p{v:g}"
    return str(v) if v is not None else "–"


def _plural(n: Any, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _met(v: Any) -> str:
    if v is True:
        return '<span class="ok">met</span>'
    if v is False:
        return '<span class="bad">missed</span>'
    return "–"


def _plain(v: Any, depth: int = 0) -> str:
    """Any JSON value as short escaped text (config and unknown summary fields)."""
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int | float):
        return _float(v, ",.6g")
    if isinstance(v, str):
        return html.escape(v)
    if isinstance(v, dict) and v and depth == 0:  # one level of nesting reads better as lines
        return "<br>".join(f"{html.escape(str(k))}: {_plain(x, depth + 1)}" for k, x in v.items())
    if isinstance(v, list) and not v:
        return "none"
    text = json.dumps(v, sort_keys=True, separators=(",", ": "))
    if len(text) > 300:
        text = text[:297] + "..."
    return html.escape(text)


def _table(rows: Iterable[Iterable[str]], header: Iterable[str] | None = None, cls: str = "") -> str:
    """Cells are already-escaped HTML."""
    parts = [f'<table class="{cls}">' if cls else "<table>"]
    if header is not None:
        parts.append("<tr>" + "".join(f"<th>{h}</th>" for h in header) + "</tr>")
    parts.extend("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    parts.append("</table>")
    return "\n".join(parts)


def _note(text: str) -> str:
    return f'<p class="note">{html.escape(text)}</p>'


# -------------------------------------------------------------------------------------- sections

_KNOWN_KEYS = frozenset(
    """scenario requests ttft_s tpot_s e2e_s queue_s throughput_tok_s output_throughput_tok_s goodput_req_s slo
    hbm_peak_bytes hbm_capacity_bytes weight_bytes_per_gpu kv_blocks_per_replica kv_block_bytes prefix_hit_rate
    preemptions cost_per_mtok_usd cost_per_output_mtok_usd gpu_hours simulated_s wall_s warnings config
    accuracy tokens cost_usd sim_speed_x""".split()
)


def _config_section(s: dict[str, Any]) -> str:
    cfg = s.get("config")
    if not isinstance(cfg, dict) or not cfg:
        return "<h2>Config</h2>" + _note("summary.json carries no config.")
    rows = [(html.escape(str(k)), _plain(v)) for k, v in cfg.items()]
    return "<h2>Config</h2>\n" + _table(rows, cls="kv")


def _accounting(s: dict[str, Any], requests: _Csv | None) -> tuple[str, list[str]]:
    req = s.get("requests") if isinstance(s.get("requests"), dict) else {}
    total, done, rej, unf = (req.get(k) for k in ("total", "completed", "rejected", "unfinished"))
    notes = []
    if all(_is_num(v) for v in (total, done, rej, unf)) and total != done + rej + unf:
        notes.append(
            f"requests do not add up: total {total} != completed + rejected + unfinished {done + rej + unf}."
        )
    if requests is not None and _is_num(total) and requests.rows != total:
        notes.append(
            f"requests.csv has {requests.rows:,} rows but summary.json counts {int(total):,} requests."
        )
    text = f"{_int(total)} = {_int(done)} completed + {_int(rej)} rejected + {_int(unf)} unfinished"
    if _is_num(req.get("not_arrived")) and req["not_arrived"] > 0:
        text += f" (another {_int(req['not_arrived'])} in the trace had not arrived when the run ended)"
    return text, notes


def _headline_section(s: dict[str, Any], requests: _Csv | None) -> str:
    accounted, notes = _accounting(s, requests)
    slo = s.get("slo") if isinstance(s.get("slo"), dict) else {}
    pct = _percentile_label(slo.get("percentile"))

    lat_rows = []
    for key, label in (
        ("ttft_s", "TTFT"),
        ("tpot_s", "TPOT"),
        ("e2e_s", "E2E latency"),
        ("queue_s", "queueing"),
    ):
        d = s.get(key) if isinstance(s.get(key), dict) else {}
        lat_rows.append((label, *(_dur(d.get(q)) for q in ("mean", "p50", "p90", "p99", "p999"))))
    latency = _table(lat_rows, header=("", "mean", "p50", "p90", "p99", "p99.9"), cls="num")

    peak, cap = s.get("hbm_peak_bytes"), s.get("hbm_capacity_bytes")
    hbm = f"{_gib(peak)} of {_gib(cap)}"
    if _is_num(peak) and _is_num(cap) and cap > 0:
        hbm += f" ({peak / cap:.1%})"
    if _is_num(s.get("weight_bytes_per_gpu")):
        hbm += f"; weights {_gib(s['weight_bytes_per_gpu'])} per GPU"
    kv_pool = f"{_int(s.get('kv_blocks_per_replica'))} blocks per replica"
    if _is_num(s.get("kv_block_bytes")):
        kv_pool += f" x {s['kv_block_bytes'] / 2**20:,.2f} MiB"
    sim, wall = s.get("simulated_s"), s.get("wall_s")
    timing = f"{_float(sim, ',.1f', ' s')} simulated in {_float(wall, ',.2f', ' s')} wall"
    if _is_num(sim) and _is_num(wall) and wall > 0:
        timing += f" ({sim / wall:,.0f}x real time)"
    slo_text = "; ".join(
        f"{name} {pct}"
        + (f" {_dur(slo[f'{key}_at_percentile_s'])}" if _is_num(slo.get(f"{key}_at_percentile_s")) else "")
        + f" ≤ {_dur(slo.get(f'{key}_s'))}: {_met(slo.get(f'{key}_met'))}"
        for name, key in (("TTFT", "ttft"), ("TPOT", "tpot"))
    )
    slo_text += f"; {_pct(slo.get('good_fraction'))} of requests met both"
    gpu_hours = s.get("gpu_hours")
    tput = (
        f"{_float(s.get('throughput_tok_s'), ',.0f', ' tok/s')} "
        f"(output {_float(s.get('output_throughput_tok_s'), ',.0f', ' tok/s')})"
    )
    tokens = s.get("tokens") if isinstance(s.get("tokens"), dict) else {}
    if _is_num(tokens.get("prompt")) and _is_num(tokens.get("output")):
        tput += f"; {_int(tokens['prompt'])} prompt + {_int(tokens['output'])} output tokens completed"
    cost = (
        f"{_usd(s.get('cost_per_mtok_usd'))} ({_usd(s.get('cost_per_output_mtok_usd'))} per million output "
        f"tokens; {_float(gpu_hours, ',.2f', ' GPU-hours')}"
        + (f", {_usd(s['cost_usd'])} in all" if _is_num(s.get("cost_usd")) else "")
        + ")"
    )
    rows = [
        ("requests (total = completed + rejected + unfinished)", accounted),
        ("throughput", tput),
        ("goodput", f"{_float(s.get('goodput_req_s'), ',.2f', ' req/s')}"),
        ("SLO targets", slo_text),
        ("cost per million tokens", cost),
        ("HBM peak vs capacity (per GPU)", hbm),
        ("KV pool", kv_pool),
        ("prefix-cache hit rate", _pct(s.get("prefix_hit_rate"))),
        ("preemptions", _int(s.get("preemptions"))),
        ("simulated vs wall time", timing),
    ]
    out = ["<h2>Headline</h2>", _table(rows, cls="kv"), latency]
    out.extend(f'<p class="warn">{html.escape(n)}</p>' for n in notes)
    return "\n".join(out)


def _warnings_section(s: dict[str, Any]) -> str:
    warnings = s.get("warnings")
    if not isinstance(warnings, list) or not warnings:
        return "<h2>Warnings</h2>\n" + _note("None.")
    items = "".join(f"<li>{html.escape(str(w))}</li>" for w in warnings)
    return f'<h2>Warnings</h2>\n<ul class="warn">{items}</ul>'


def _rejections_section(s: dict[str, Any]) -> str:
    reasons = _get(s, "requests", "rejected_reasons")
    if not isinstance(reasons, dict) or not reasons:
        return "<h2>Rejection reasons</h2>\n" + _note("No requests were rejected.")
    items = sorted(reasons.items(), key=lambda kv: (-(kv[1] if _is_num(kv[1]) else 0), str(kv[0])))
    rows = [(html.escape(str(k)), _int(v)) for k, v in items]
    return "<h2>Rejection reasons</h2>\n" + _table(rows, header=("reason", "requests"), cls="num")


def _accuracy_section(s: dict[str, Any]) -> str:
    acc = s.get("accuracy")
    if not isinstance(acc, dict):
        return ""
    out = [
        "<h2>Accuracy (estimate, not measured by the simulator)</h2>",
        '<p class="note">The simulator does not run the model. These are cited estimates for the KV '
        "format, plus the numerical error of kvsim's own kernels for it on synthetic K/V; they say "
        "nothing about this trace's outputs.</p>",
    ]
    rows = [("KV format", _plain(acc.get("format")))]
    rms = acc.get("kernel_rel_rms")
    rows.append(
        ("attention-output relative RMS error (kernels)", f"{rms:.3g}" if _is_num(rms) else "not measured")
    )
    if acc.get("kernel_method"):
        rows.append(("how it was measured", _plain(acc.get("kernel_method"))))
    if acc.get("note"):
        rows.append(("note", _plain(acc.get("note"))))
    out.append(_table(rows, cls="kv"))
    lit = acc.get("literature")
    if isinstance(lit, list) and lit:
        cited = [(_plain(_get(x, "claim")), _plain(_get(x, "source"))) for x in lit if isinstance(x, dict)]
        out.append(_table(cited, header=("claim (cited)", "source")))
    return "\n".join(out)


def _extras_section(s: dict[str, Any]) -> str:
    extra = [(html.escape(str(k)), _plain(v)) for k, v in s.items() if k not in _KNOWN_KEYS]
    if not extra:
        return ""
    return "<h2>Other summary fields</h2>\n" + _table(extra, cls="kv")


# ---------------------------------------------------------------------------------------- charts


def _stride(n: int, k: int) -> np.ndarray:
    """At most ``k`` evenly spaced indices into ``n`` items, first and last included."""
    if n <= k:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, k).round().astype(np.int64))


def _cdf(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    v = np.sort(values[np.isfinite(values) & (values > 0)])  # log x: zero durations cannot show
    y = np.arange(1, v.size + 1) / max(v.size, 1)
    idx = _stride(v.size, MAX_POINTS)
    return v[idx], y[idx]


def _latency_figures(r: _Csv, slo: dict[str, Any]) -> _Figures:
    need = ("arrival_s", "first_token_s", "finish_s", "output_tokens", "status")
    if not r.has(*need):
        missing = [c for c in need if c not in r.columns]
        return [], [f"requests.csv lacks column(s) {', '.join(missing)}; latency charts left out."]
    arrival, first, finish = r.num("arrival_s"), r.num("first_token_s"), r.num("finish_s")
    out_tok, status = r.num("output_tokens"), r.text("status")
    done = status == "completed"
    ttft = (first - arrival)[done & np.isfinite(first)]
    # TPOT excludes the first token, as the summary does; one-token requests have none.
    tpot_ok = done & np.isfinite(first) & (out_tok > 1)
    tpot = (finish - first)[tpot_ok] / (out_tok[tpot_ok] - 1)

    figs: list[tuple[str, go.Figure]] = []
    cdf = make_subplots(rows=1, cols=2, subplot_titles=("TTFT", "TPOT"), horizontal_spacing=0.08)
    for col, vals in ((1, ttft), (2, tpot)):
        x, y = _cdf(vals)
        cdf.add_trace(go.Scatter(x=x, y=y, mode="lines", line_shape="hv", showlegend=False), row=1, col=col)
        cdf.update_xaxes(type="log", title_text="seconds (log)", row=1, col=col)
        target = slo.get("ttft_s" if col == 1 else "tpot_s")
        if _is_num(target) and target > 0:
            cdf.add_vline(x=target, line_dash="dash", line_color="#888", row=1, col=col)
            cdf.add_annotation(
                x=math.log10(target), y=0.05, text="SLO", showarrow=False, xanchor="left", row=1, col=col
            )
    cdf.update_yaxes(title_text="fraction of requests", range=[0, 1.02], row=1, col=1)
    cdf.update_layout(
        title="Latency CDFs of completed requests (from requests.csv; dashed: SLO target)", height=380
    )
    figs.append(("cdf", cdf))

    ok = done & np.isfinite(finish) & np.isfinite(arrival)
    a, e = arrival[ok], (finish - arrival)[ok]
    order = np.argsort(a, kind="stable")
    a, e = a[order], e[order]
    keep = _stride(a.size, MAX_POINTS - 100)
    if a.size > keep.size:  # evenly spaced points hide the tail; keep the 100 slowest as well
        keep = np.union1d(keep, np.argsort(-e, kind="stable")[:100])
    title = "E2E latency vs arrival time (completed requests"
    title += f"; {keep.size:,} of {a.size:,} shown)" if keep.size < a.size else ")"
    scatter = go.Figure(
        go.Scattergl(x=a[keep], y=e[keep], mode="markers", marker={"size": 4, "opacity": 0.6})
    )
    scatter.update_layout(title=title, height=380, xaxis_title="arrival (s)", yaxis_title="E2E latency (s)")
    figs.append(("e2e", scatter))

    if ok.any():
        t_end = float(np.nanmax(finish[ok]))
        nbins = int(min(100, max(10, math.sqrt(ok.sum()))))
        edges = np.linspace(0.0, max(t_end, 1e-9), nbins + 1)
        tok, _ = np.histogram(finish[ok], bins=edges, weights=out_tok[ok])
        width = edges[1] - edges[0]
        tput = go.Figure(go.Bar(x=edges[:-1] + width / 2, y=tok / width, width=width, marker_line_width=0))
        tput.update_layout(
            title="Output throughput (tokens of completed requests, counted when each finishes)",
            height=340,
            xaxis_title="simulated time (s)",
            yaxis_title="output tokens/s",
            bargap=0,
        )
        figs.append(("throughput", tput))
    return figs, []


def _series_on_grid(t: np.ndarray, v: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Step-hold the samples ``(t, v)`` (sorted by t) onto ``grid``; 0 before the first sample."""
    i = np.searchsorted(t, grid, side="right") - 1
    return np.where(i >= 0, v[np.clip(i, 0, None)], 0.0)


def _timeseries_figures(ts: _Csv) -> _Figures:
    need = ("t_s", "replica", "kv_used_blocks", "kv_cached_blocks", "kv_free_blocks", "running", "waiting")
    if not ts.has(*need):
        missing = [c for c in need if c not in ts.columns]
        return [], [f"timeseries.csv lacks column(s) {', '.join(missing)}; occupancy charts left out."]
    t = ts.num("t_s")
    replica = ts.num("replica")
    cols = {c: ts.num(c) for c in need[2:]}
    ok = np.isfinite(t) & np.isfinite(replica)
    if not ok.any():
        return [], ["timeseries.csv has no samples; occupancy charts left out."]
    grid = np.unique(t[ok])
    grid = grid[_stride(grid.size, MAX_SERIES_POINTS)]
    replicas = [int(x) for x in np.unique(replica[ok])]
    per: dict[int, dict[str, np.ndarray]] = {}
    for rep in replicas:
        m = ok & (replica == rep)
        order = np.argsort(t[m], kind="stable")
        per[rep] = {
            c: _series_on_grid(t[m][order], np.nan_to_num(v[m][order]), grid) for c, v in cols.items()
        }
    total = {c: sum(per[r][c] for r in replicas) for c in cols}

    views: list[tuple[str, dict[str, np.ndarray]]] = [(f"sum of {_plural(len(replicas), 'replica')}", total)]
    if len(replicas) > 1:
        views += [(f"replica {r}", per[r]) for r in replicas[:MAX_REPLICA_VIEWS]]
    occ = go.Figure()
    layers = (
        ("kv_used_blocks", "KV used"),
        ("kv_cached_blocks", "cached, free to evict"),
        ("kv_free_blocks", "free"),
    )
    colors = ("#d62728", "#ff7f0e", "#2ca02c")
    for vi, (_, series) in enumerate(views):
        for (col, label), color in zip(layers, colors, strict=True):
            occ.add_trace(
                go.Scatter(
                    x=grid,
                    y=series[col],
                    name=label,
                    stackgroup="kv",
                    mode="lines",
                    line={"width": 0.5, "color": color},
                    line_shape="hv",
                    visible=vi == 0,
                    legendgroup=label,
                    showlegend=True,
                )
            )
    title = "KV-cache blocks over time"
    if len(views) > 1:
        buttons = []
        for vi, (label, _) in enumerate(views):
            visible = [i // len(layers) == vi for i in range(len(views) * len(layers))]
            buttons.append({"label": label, "method": "update", "args": [{"visible": visible}]})
        occ.update_layout(
            updatemenus=[{"buttons": buttons, "x": 1.0, "xanchor": "right", "y": 1.18, "yanchor": "top"}]
        )
        if len(replicas) > MAX_REPLICA_VIEWS:
            title += f" (selector lists the first {MAX_REPLICA_VIEWS} replicas)"
    occ.update_layout(title=title, height=380, xaxis_title="simulated time (s)", yaxis_title="blocks")

    queue = go.Figure()
    for col, label in (("running", "running"), ("waiting", "waiting")):
        queue.add_trace(go.Scatter(x=grid, y=total[col], name=label, mode="lines", line_shape="hv"))
    queue.update_layout(
        title=f"Running and waiting requests (sum over {_plural(len(replicas), 'replica')})",
        height=340,
        xaxis_title="simulated time (s)",
        yaxis_title="requests",
    )
    return [("kv", occ), ("queue", queue)], []


def _figure_html(div_id: str, fig: go.Figure) -> str:
    fig.update_layout(template=_TEMPLATE, margin={"l": 60, "r": 20, "t": 60, "b": 50})
    return pio.to_html(
        fig,
        include_plotlyjs=False,
        full_html=False,
        div_id=f"kvsim-{div_id}",
        config=_PLOT_CONFIG,
        default_height=f"{fig.layout.height or 380}px",
    )


def _charts_section(requests: _Csv | None, timeseries: _Csv | None, slo: dict[str, Any]) -> tuple[str, bool]:
    """HTML for the charts and whether any figure needs plotly.js."""
    out = ["<h2>Charts</h2>"]
    any_fig = False
    sources: tuple[tuple[str, _Csv | None, Callable[[_Csv], _Figures]], ...] = (
        ("requests.csv", requests, lambda r: _latency_figures(r, slo)),
        ("timeseries.csv", timeseries, _timeseries_figures),
    )
    for name, data, build in sources:
        if data is None:
            out.append(_note(f"{name} not found in the run directory; its charts are left out."))
            continue
        if data.rows == 0:
            out.append(_note(f"{name} has no rows; its charts are left out."))
            continue
        figs, notes = build(data)
        out.extend(_note(n) for n in notes)
        for div_id, fig in figs:
            out.append(_figure_html(div_id, fig))
            any_fig = True
    return "\n".join(out), any_fig


# ------------------------------------------------------------------------------------------ page

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0; color: #222; background: #fff; }
main { max-width: 1150px; margin: 0 auto; padding: 16px 24px 48px; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 8px 0 12px; font-size: 0.92em; }
th, td { border: 1px solid #ddd; padding: 3px 8px; vertical-align: top; } th { background: #f4f4f4; }
table.num td:not(:first-child) { text-align: right; font-variant-numeric: tabular-nums; }
table.kv td:first-child { color: #555; white-space: nowrap; }
.note { color: #666; font-style: italic; } .warn { color: #8a5300; }
.ok { color: #1a7f37; font-weight: 600; } .bad { color: #c62828; font-weight: 600; }
"""


def _page(s: dict[str, Any], run_dir: Path) -> str:
    scenario = str(s.get("scenario") or run_dir.name)
    requests = _load_csv(run_dir / "requests.csv")
    slo = s.get("slo") if isinstance(s.get("slo"), dict) else {}
    charts, any_fig = _charts_section(requests, _load_csv(run_dir / "timeseries.csv"), slo)
    model, gpu = _get(s, "config", "model"), _get(s, "config", "gpu")
    n_gpu, reps = _get(s, "config", "num_gpus"), _get(s, "config", "replicas")
    sub = " · ".join(
        html.escape(str(x))
        for x in (
            model,
            f"{n_gpu} x {gpu}" if gpu is not None and n_gpu is not None else gpu,
            _plural(reps, "replica") if reps is not None else None,
            _get(s, "config", "kv_format"),
        )
        if x is not None
    )
    head_js = f"<script>{get_plotlyjs()}</script>" if any_fig else ""
    body = [
        f"<h1>kvsim report: {html.escape(scenario)}</h1>",
        f'<p class="sub">{sub}</p>' if sub else "",
        _headline_section(s, requests),
        _warnings_section(s),
        charts,
        _rejections_section(s),
        _accuracy_section(s),
        _config_section(s),
        _extras_section(s),
    ]
    return (
        '<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>kvsim: {html.escape(scenario)}</title>\n<style>{_CSS}</style>\n{head_js}\n</head>\n"
        "<body><main>\n" + "\n".join(b for b in body if b) + "\n</main></body>\n</html>\n"
    )


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    """Write one self-contained HTML report for ``run_dir`` to ``out`` (default run_dir/report.html).

    Reads summary.json (required; `KvsimError` when missing or malformed), requests.csv and
    timeseries.csv (optional). The same inputs give byte-identical output. Returns the path written.
    """
    run_dir = Path(run_dir)
    summary = _load_summary(run_dir)
    out = Path(out) if out is not None else run_dir / "report.html"
    out.write_text(_page(summary, run_dir), encoding="utf-8")
    return out


def report_command(run_dir: str) -> int:
    """``kvsim report RUN_DIR``: rebuild report.html from an existing run directory; exit code 0."""
    path = write_report(Path(run_dir))
    print(f"wrote {path}")
    return 0

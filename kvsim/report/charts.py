"""The report's plotly figures from requests.csv and timeseries.csv (the only plotting code in kvsim).

What is plotted is thinned by stated rules (docs/architecture.md, "report"); the tables and the
headline keep the exact numbers. A CDF is drawn at most `MAX_CDF_POINTS` samples evenly spaced in
rank (first and last kept); the E2E scatter shows at most `MAX_POINTS` requests evenly spaced in
arrival order plus the `SLOWEST_KEPT` slowest; a series over time keeps all its samples up to
`MAX_SERIES_POINTS` (`MAX_REPLICA_POINTS` for one replica's view in the occupancy selector),
beyond that an envelope (`_envelope`). Times and latencies are plotted as float32 (7 significant
digits), counts as integers, so plotly stores them in fewer bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio
from markupsafe import Markup
from plotly.subplots import make_subplots

from kvsim.report import html as h
from kvsim.report.data import _Csv
from kvsim.report.tables import _is_num, _note, _plural
from kvsim.results.record import RunSummary

# A CDF drawn with every sample of thousands looks the same as one at this many quantiles (each
# step at most 1/1,000 of the requests, under a pixel of the chart's height).
MAX_CDF_POINTS = 1_000
# The E2E scatter: at most this many requests, of which the slowest `SLOWEST_KEPT` always.
MAX_POINTS = 2_000
SLOWEST_KEPT = 100
# A series over time: at most this many samples per trace (an envelope beyond), about one per
# pixel of a page-wide chart.
MAX_SERIES_POINTS = 1_000
# The occupancy selector shows the sum and at most this many individual replicas, each at most
# this many samples per layer (a second look, beside the replicas table's exact peaks and means).
MAX_REPLICA_VIEWS = 8
MAX_REPLICA_POINTS = 500
# (div id suffix, figure) pairs and notes on what was left out.
_Figures = tuple[list[tuple[str, go.Figure]], list[str]]
_PLOT_CONFIG = {"responsive": True, "displaylogo": False}
_TEMPLATE = "plotly_white"


def _stride(n: int, k: int) -> np.ndarray:
    """At most ``k`` evenly spaced indices into ``n`` items, first and last included."""
    if n <= k:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, k).round().astype(np.int64))


def _envelope(t: np.ndarray, series: Sequence[np.ndarray], cap: int = MAX_SERIES_POINTS) -> np.ndarray:
    """Which samples of step-held series to plot: indices into ``t`` (sorted), at most `cap`.

    Every sample when there are `cap` or fewer. Otherwise the time span is cut into equal buckets
    and each keeps, for every one of `series`, the sample where it is lowest and the one where it
    is highest (the first and last samples are kept too). The bucket count starts at
    ``(cap - 2) // (2 * len(series))``, which always fits, and doubles while the result still
    fits in `cap` (a flat series adds no samples). So every spike and dip is drawn at its height;
    a level between a bucket's extremes may be drawn up to one bucket (a few pixels) too wide.
    """
    n = t.size
    if n <= cap:
        return np.arange(n)
    flat = [np.nan_to_num(np.asarray(s, dtype=np.float64)) for s in series]  # a gap plots as 0
    buckets = max(1, (cap - 2) // (2 * max(len(flat), 1)))
    keep = _extremes(t, flat, buckets)
    while buckets < n:
        finer = _extremes(t, flat, buckets * 2)
        if finer.size > cap:
            break
        keep, buckets = finer, buckets * 2
    return keep


def _extremes(t: np.ndarray, series: Sequence[np.ndarray], buckets: int) -> np.ndarray:
    """`_envelope`'s samples for `buckets` equal time buckets."""
    n = t.size
    edges = np.searchsorted(t, np.linspace(t[0], t[-1], buckets + 1)[1:-1], side="left")
    starts = np.concatenate(([0], edges))
    ends = np.concatenate((edges, [n]))
    nonempty = ends > starts
    starts, ends = starts[nonempty], ends[nonempty]
    keep = [np.array([0, n - 1])]
    for s in series:
        for reduce in (np.minimum, np.maximum):
            extreme = reduce.reduceat(s, starts)  # per bucket; then the first sample reaching it
            hit = np.flatnonzero(s == np.repeat(extreme, ends - starts))
            keep.append(hit[np.searchsorted(hit, starts)])
    return np.unique(np.concatenate(keep))


def _f32(x: np.ndarray) -> np.ndarray:
    """Float data for a chart: float32 is 7 significant digits, more than a chart can show."""
    return np.asarray(x, dtype=np.float32)


def _counts(x: np.ndarray) -> np.ndarray:
    """Counts for a chart as integers (plotly stores them in the fewest bytes), floats if any is not."""
    x = np.asarray(x, dtype=np.float64)
    if x.size and np.all(np.isfinite(x)) and np.all(x == np.round(x)) and np.abs(x).max() < 2**31:
        return x.astype(np.int64)
    return x


def _cdf(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    v = np.sort(values[np.isfinite(values) & (values > 0)])  # log x: zero durations cannot show
    y = np.arange(1, v.size + 1) / max(v.size, 1)
    idx = _stride(v.size, MAX_CDF_POINTS)
    return _f32(v[idx]), _f32(y[idx])


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
    keep = _stride(a.size, MAX_POINTS - SLOWEST_KEPT)
    if a.size > keep.size:  # evenly spaced points hide the tail; keep the slowest as well
        keep = np.union1d(keep, np.argsort(-e, kind="stable")[:SLOWEST_KEPT])
    title = "E2E latency vs arrival time (completed requests"
    title += f"; {keep.size:,} of {a.size:,} shown)" if keep.size < a.size else ")"
    scatter = go.Figure(
        go.Scattergl(x=_f32(a[keep]), y=_f32(e[keep]), mode="markers", marker={"size": 4, "opacity": 0.6})
    )
    scatter.update_layout(title=title, height=380, xaxis_title="arrival (s)", yaxis_title="E2E latency (s)")
    figs.append(("e2e", scatter))

    if ok.any():
        t_end = float(np.nanmax(finish[ok]))
        nbins = int(min(100, max(10, math.sqrt(ok.sum()))))
        edges = np.linspace(0.0, max(t_end, 1e-9), nbins + 1)
        tok, _ = np.histogram(finish[ok], bins=edges, weights=out_tok[ok])
        width = edges[1] - edges[0]
        tput = go.Figure(
            go.Bar(x=_f32(edges[:-1] + width / 2), y=_f32(tok / width), width=width, marker_line_width=0)
        )
        tput.update_layout(
            title="Output throughput (tokens of completed requests, counted when each finishes)",
            height=340,
            xaxis_title="simulated time (s)",
            yaxis_title="output tokens/s",
            bargap=0,
        )
        figs.append(("throughput", tput))
    return figs, []


def capacity_timeline(record: RunSummary) -> tuple[list[float], list[int], str] | None:
    """Replicas up from each instant on, with what changed them: the autoscaler's timeline, or,
    with faults, the replicas less those down (overlapping outages counted once each); None when
    every replica is up throughout."""
    if record.autoscale is not None:
        a = record.autoscale
        return list(a.timeline_t_s), list(a.timeline_replicas), "autoscaler"
    if record.faults is None or not record.faults.outages:
        return None
    n = record.config.replicas
    deltas: dict[float, int] = {0.0: 0}
    for o in record.faults.outages:
        deltas[o.down_s] = deltas.get(o.down_s, 0) - 1
        deltas[o.up_s] = deltas.get(o.up_s, 0) + 1
    ts, ns, up = [], [], n
    for t in sorted(deltas):
        up += deltas[t]
        ts.append(t)
        ns.append(up)
    return ts, ns, "faults"


def _capacity_figures(cap: tuple[list[float], list[int], str], r: _Csv | None, end_s: float) -> _Figures:
    """Replicas up over time above the latency and prefix hit rate of the requests arriving then
    (per time bin: TTFT p50 and p99 of those completed, cached over prompt tokens of all)."""
    ts, ns, why = cap
    rows = (
        3
        if r is not None and r.has("arrival_s", "first_token_s", "status", "prompt_tokens", "cached_tokens")
        else 1
    )
    titles = ("replicas up", "TTFT by arrival (p50, p99)", "prefix hit rate by arrival")[:rows]
    fig = make_subplots(rows=rows, cols=1, shared_xaxes=True, vertical_spacing=0.06, subplot_titles=titles)
    end = max(end_s, ts[-1] if ts else 0.0)
    fig.add_trace(
        go.Scatter(
            x=_f32(np.array([*ts, end])), y=[*ns, ns[-1]], mode="lines", line_shape="hv", name="replicas up"
        ),
        row=1,
        col=1,
    )
    fig.update_yaxes(title_text="replicas", rangemode="tozero", row=1, col=1)
    notes: list[str] = []
    if rows == 3:
        assert r is not None
        arrival, first = r.num("arrival_s"), r.num("first_token_s")
        prompt, cached = r.num("prompt_tokens"), r.num("cached_tokens")
        ok = np.isfinite(arrival)
        nbins = int(min(100, max(10, math.sqrt(max(int(ok.sum()), 1)))))
        edges = np.linspace(0.0, max(end, 1e-9), nbins + 1)
        mid = (edges[:-1] + edges[1:]) / 2
        which = np.clip(np.searchsorted(edges, arrival[ok], side="right") - 1, 0, nbins - 1)
        ttft = (first - arrival)[ok]
        done = (r.text("status") == "completed")[ok] & np.isfinite(ttft)
        p50 = np.full(nbins, np.nan)
        p99 = np.full(nbins, np.nan)
        hit = np.full(nbins, np.nan)
        pr, ca = np.nan_to_num(prompt[ok]), np.nan_to_num(cached[ok])
        for b in range(nbins):
            m = which == b
            d = ttft[m & done]
            if d.size:
                p50[b], p99[b] = np.percentile(d, 50), np.percentile(d, 99)
            if pr[m].sum() > 0:
                hit[b] = ca[m].sum() / pr[m].sum()
        for y, name in ((p50, "TTFT p50"), (p99, "TTFT p99")):
            fig.add_trace(go.Scatter(x=_f32(mid), y=_f32(y), mode="lines+markers", name=name), row=2, col=1)
        fig.add_trace(
            go.Scatter(x=_f32(mid), y=_f32(hit), mode="lines+markers", name="hit rate"), row=3, col=1
        )
        fig.update_yaxes(title_text="seconds", type="log", row=2, col=1)
        fig.update_yaxes(title_text="share", range=[0, 1.02], row=3, col=1)
    else:
        notes.append(
            "requests.csv lacks the columns for latency and hit rate by arrival; capacity alone drawn."
        )
    fig.update_xaxes(title_text="simulated time (s)", row=rows, col=1)
    src = "the autoscaler's replicas up" if why == "autoscaler" else "replicas up less those down (faults)"
    fig.update_layout(
        title=f"Capacity over time ({src}) beside latency and hit rate", height=220 + 180 * rows
    )
    return [("capacity", fig)], notes


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
    grid = np.unique(t[ok])  # every replica's sample times: the sum steps at each
    replicas = [int(x) for x in np.unique(replica[ok])]
    total = {c: np.zeros(grid.size) for c in cols}
    own: dict[int, tuple[np.ndarray, dict[str, np.ndarray]]] = {}  # a replica on its own samples
    for rep in replicas:
        m = ok & (replica == rep)
        order = np.argsort(t[m], kind="stable")
        tr = t[m][order]
        vals = {c: np.nan_to_num(v[m][order]) for c, v in cols.items()}
        for c in cols:
            total[c] += _series_on_grid(tr, vals[c], grid)
        if len(replicas) > 1 and len(own) < MAX_REPLICA_VIEWS:
            own[rep] = (tr, vals)

    def view(
        tv: np.ndarray, series: dict[str, np.ndarray], cap: int
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The KV stack's samples drawn: `_envelope` of its two edges (its top is the pool)."""
        used, cached = series["kv_used_blocks"], series["kv_cached_blocks"]
        keep = _envelope(tv, (used, used + cached), cap)
        return _f32(tv[keep]), {c: _counts(series[c][keep]) for c, _ in layers}

    layers = (
        ("kv_used_blocks", "KV used"),
        ("kv_cached_blocks", "cached, free to evict"),
        ("kv_free_blocks", "free"),
    )
    views = [(f"sum of {_plural(len(replicas), 'replica')}", view(grid, total, MAX_SERIES_POINTS))]
    views += [(f"replica {r}", view(*own[r], MAX_REPLICA_POINTS)) for r in own]
    occ = go.Figure()
    colors = ("#d62728", "#ff7f0e", "#2ca02c")
    for vi, (_, (x, series)) in enumerate(views):
        for (col, label), color in zip(layers, colors, strict=True):
            occ.add_trace(
                go.Scatter(
                    x=x,
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
    keep = _envelope(grid, (total["running"], total["waiting"]))
    for col, label in (("running", "running"), ("waiting", "waiting")):
        queue.add_trace(
            go.Scatter(
                x=_f32(grid[keep]), y=_counts(total[col][keep]), name=label, mode="lines", line_shape="hv"
            )
        )
    queue.update_layout(
        title=f"Running and waiting requests (sum over {_plural(len(replicas), 'replica')})",
        height=340,
        xaxis_title="simulated time (s)",
        yaxis_title="requests",
    )
    return [("kv", occ), ("queue", queue)], []


def _tiers_figures(tc: _Csv) -> _Figures:
    """Occupancy of the tiers below HBM over time (tiers.csv): one line per tier, GiB."""
    if not tc.has("t_s", "tier", "used_bytes"):
        return [], ["tiers.csv lacks its columns; the tier occupancy chart is left out."]
    t, used, tier = tc.num("t_s"), tc.num("used_bytes"), tc.text("tier")
    fig = go.Figure()
    for name in sorted(set(tier.tolist())):
        m = (tier == name) & np.isfinite(t)
        tt, gib = t[m], used[m] / 2**30
        idx = _envelope(tt, (gib,))
        fig.add_trace(
            go.Scatter(x=_f32(tt[idx]), y=_f32(gib[idx]), name=str(name), mode="lines", line_shape="hv")
        )
    fig.update_layout(
        title="Tiers below HBM: occupancy over time",
        height=340,
        xaxis_title="simulated time (s)",
        yaxis_title="GiB (a replica's blocks, all its GPUs)",
    )
    return [("tiers", fig)], []


def _links_figures(lc: _Csv) -> _Figures:
    """Each link's utilisation over time (links.csv): busy seconds asked for per sampling interval."""
    if not lc.has("t_s", "link", "busy_s"):
        return [], ["links.csv lacks its columns; the link utilisation chart is left out."]
    t, busy, link = lc.num("t_s"), lc.num("busy_s"), lc.text("link")
    fig = go.Figure()
    for name in sorted(set(link.tolist())):
        m = (link == name) & np.isfinite(t)
        tt, bb = t[m], busy[m]
        if tt.size < 2:
            continue
        dt = np.diff(tt)
        util = np.divide(np.diff(bb), dt, out=np.zeros_like(dt), where=dt > 0)
        idx = _envelope(tt[1:], (util,))
        fig.add_trace(
            go.Scatter(x=_f32(tt[1:][idx]), y=_f32(util[idx]), name=str(name), mode="lines", line_shape="hv")
        )
    if not fig.data:
        return [], ["links.csv has too few samples for a utilisation chart."]
    fig.update_layout(
        title="Link utilisation over time (transfers asked for per interval)",
        height=340,
        xaxis_title="simulated time (s)",
        yaxis_title="busy share",
    )
    return [("links", fig)], []


def _template_for(fig: go.Figure) -> go.layout.Template:
    """`_TEMPLATE` with trace defaults for only the trace types `fig` has: the same look, without
    7 KB of defaults for heatmaps, contours and the rest in every figure."""
    base = pio.templates[_TEMPLATE]
    types = sorted({str(trace.type) for trace in fig.data})
    return go.layout.Template(layout=base.layout, data={t: base.data[t] for t in types if base.data[t]})


def _figure_html(div_id: str, fig: go.Figure) -> Markup:
    """The figure's div and the script drawing it (plotly's own HTML; its JSON is escaped for a
    script element, so user text in labels cannot close it)."""
    fig.update_layout(template=_template_for(fig), margin={"l": 60, "r": 20, "t": 60, "b": 50})
    return Markup(
        pio.to_html(
            fig,
            include_plotlyjs=False,
            full_html=False,
            div_id=f"kvsim-{div_id}",
            config=_PLOT_CONFIG,
            default_height=f"{fig.layout.height or 380}px",
        )
    )


def _charts_section(
    requests: _Csv | None,
    timeseries: _Csv | None,
    slo: dict[str, Any],
    tiers: _Csv | None = None,
    links: _Csv | None = None,
    capacity: tuple[tuple[list[float], list[int], str], float] | None = None,
) -> tuple[Markup, bool]:
    """HTML for the charts and whether any figure needs plotly.js (``tiers.csv`` only where the run
    wrote one: memory tiers on; `capacity`, where replicas were not all up throughout)."""
    out: list[Markup] = []
    any_fig = False
    sources: tuple[tuple[str, _Csv | None, Callable[[_Csv], _Figures]], ...] = (
        ("requests.csv", requests, lambda r: _latency_figures(r, slo)),
        ("timeseries.csv", timeseries, _timeseries_figures),
    )
    if tiers is not None:
        sources += (("tiers.csv", tiers, _tiers_figures),)
    if links is not None:
        sources += (("links.csv", links, _links_figures),)
    if capacity is not None:  # (timeline, the run's end): an autoscaled run or one with faults
        cap, end_s = capacity
        sources += (("requests.csv", requests, lambda r: _capacity_figures(cap, r, end_s)),)
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
    return h.section("Charts", *out), any_fig


# ------------------------------------------------------------------------------------------ page

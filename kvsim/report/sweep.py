"""A sweep's HTML page (``DIR/sweep.html``), rebuilt from ``sweep.json`` and ``results.csv``.

Shows: a table of the points (each linking to its own ``points/<id>/report.html``, failed ones
with their error); p99 TTFT and cost per million tokens as lines over a sweep of one factor, or
as heatmaps over a sweep of two (a factor: one ``--grid`` axis, the ``--zip`` group, or a sweep
file's ``points``); and cost versus p99 TTFT for every point that ran, with the Pareto front
(no point both cheaper and faster) marked. A sweep of more than two factors gets the table and
the Pareto chart only. Numbers are read from results.csv, never recomputed; plotly.js is loaded
from ``plotly.min.js`` beside the page (the one copy the points' pages share too), so the folder
opens offline, and the same files give the same bytes. The Pareto front treats differences below
`kvsim.sweep.table.PARETO_REL_TOL` as ties (stated on the page).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any
from urllib.parse import quote

import plotly.graph_objects as go
from markupsafe import Markup
from plotly.subplots import make_subplots

from kvsim.errors import KvsimError
from kvsim.report import html as h
from kvsim.report.charts import _figure_html
from kvsim.report.html import PLOTLY_JS
from kvsim.report.tables import _table
from kvsim.sweep.table import PARETO_REL_TOL, pareto_front, read_manifest, read_results

SWEEP_FILES = ("sweep.json", "results.csv", "results.parquet", "sweep.html", PLOTLY_JS)
_SHOWN = (  # column, header, format
    ("ttft_p99_s", "TTFT p99 (s)", ".4g"),
    ("tpot_p99_s", "TPOT p99 (s)", ".4g"),
    ("e2e_p99_s", "E2E p99 (s)", ".4g"),
    ("throughput_tok_s", "throughput (tok/s)", ",.0f"),
    ("goodput_req_s", "goodput (req/s)", ".4g"),
    ("cost_per_mtok_usd", "$ / M tok", ".4g"),
    ("accuracy_loss_est", "accuracy loss (est.)", ".1%"),
    ("requests_completed", "completed", ",.0f"),
    ("requests_rejected", "rejected", ",.0f"),
)
_CHARTED = (("ttft_p99_s", "p99 TTFT (s)"), ("cost_per_mtok_usd", "cost per million tokens ($)"))


def _num(text: str | None) -> float | None:
    try:
        v = float(text) if text else None
    except ValueError:
        return None
    return v if v is not None and math.isfinite(v) else None


def _set_label(sets_entry: list[str], paths: list[str]) -> str:
    if len(paths) == 1 and len(sets_entry) == 1:
        return sets_entry[0].split("=", 1)[1]
    return ", ".join(sets_entry)


def _factor_charts(factors: list[dict[str, Any]], rows: list[dict[str, str]]) -> tuple[str, go.Figure | None]:
    """A line chart over one factor or heatmaps over two; (a note, None) otherwise. Factors with a
    single value are left out (they multiply the point count by one, so indices are unchanged)."""
    factors = [f for f in factors if len(f["sets"]) > 1]
    if not 1 <= len(factors) <= 2:
        return f"A sweep of {len(factors)} factors: see the table and the Pareto chart.", None
    labels = [[_set_label(s, f["paths"]) for s in f["sets"]] for f in factors]
    by_index = {int(r["index"]): r for r in rows}
    if len(factors) == 1:
        fig = make_subplots(rows=1, cols=2, subplot_titles=[t for _, t in _CHARTED], horizontal_spacing=0.12)
        for col, (column, _) in enumerate(_CHARTED, start=1):
            y = [_num(by_index[i].get(column)) if i in by_index else None for i in range(len(labels[0]))]
            fig.add_trace(
                go.Scatter(x=labels[0], y=y, mode="lines+markers", showlegend=False), row=1, col=col
            )
            fig.update_xaxes(title_text=factors[0]["label"], type="category", row=1, col=col)
        return "", fig
    # Two heatmaps sharing the y axis (its labels once, on the left), each with its colour bar in
    # the gap to its right, clear of the next plot; every cell shows its value.
    gap = 0.16
    fig = make_subplots(
        rows=1,
        cols=2,
        subplot_titles=[t for _, t in _CHARTED],
        horizontal_spacing=gap,
        shared_yaxes=True,
    )
    n1 = len(labels[1])
    width = (1 - gap) / 2
    for col, (column, title) in enumerate(_CHARTED, start=1):
        z = [
            [_num(by_index[i * n1 + j].get(column)) if i * n1 + j in by_index else None for j in range(n1)]
            for i in range(len(labels[0]))
        ]
        text = [["–" if v is None else f"{v:.3g}" for v in row] for row in z]
        fig.add_trace(
            go.Heatmap(
                x=labels[1],
                y=labels[0],
                z=z,
                text=text,
                texttemplate="%{text}",
                colorscale="Viridis",
                colorbar={
                    "title": {"text": title.split(" (")[0], "side": "right"},
                    "x": width + 0.01 if col == 1 else 1.01,
                    "xanchor": "left",
                    "thickness": 12,
                    "len": 0.9,
                },
                hovertemplate="%{y} · %{x}: %{z:.4g}<extra></extra>",
            ),
            row=1,
            col=col,
        )
        fig.update_xaxes(title_text=factors[1]["label"], type="category", row=1, col=col)
    fig.update_yaxes(title_text=factors[0]["label"], type="category", row=1, col=1)
    fig.update_yaxes(type="category", row=1, col=2)
    fig.update_layout(height=max(360, 120 + 40 * len(labels[0])))
    return "", fig


def _pareto_chart(rows: list[dict[str, str]], front: list[bool]) -> go.Figure | None:
    pts = [
        (r, on)
        for r, on in zip(rows, front, strict=True)
        if _num(r.get("cost_per_mtok_usd")) is not None and _num(r.get("ttft_p99_s")) is not None
    ]
    if not pts:
        return None
    fig = go.Figure()
    for on, name, marker in (
        (False, "dominated", {"size": 8, "color": "#9e9e9e"}),
        (True, "Pareto front", {"size": 12, "color": "#c62828", "symbol": "star"}),
    ):
        chosen = sorted(
            (r for r, o in pts if o == on),
            key=lambda r: (_num(r["ttft_p99_s"]), _num(r["cost_per_mtok_usd"])),
        )
        if chosen:
            fig.add_trace(
                go.Scatter(
                    x=[_num(r["ttft_p99_s"]) for r in chosen],
                    y=[_num(r["cost_per_mtok_usd"]) for r in chosen],
                    text=[r["id"] for r in chosen],
                    mode="lines+markers" if on else "markers",
                    line={"shape": "hv", "color": "#c62828"} if on else None,
                    marker=marker,
                    name=name,
                    hovertemplate="%{text}<br>p99 TTFT %{x:.4g} s<br>$%{y:.4g} / M tok<extra></extra>",
                )
            )
    fig.update_layout(
        title="cost versus p99 TTFT (lower-left is better)",
        xaxis_title="p99 TTFT (s)",
        yaxis_title="cost per million tokens ($)",
        height=420,
    )
    return fig


def _points_table(
    rows: list[dict[str, str]], paths: list[str], front: list[bool], front3: list[bool] | None
) -> Markup:
    extra = [] if front3 is None else ["Pareto (+ accuracy)"]
    header = ["#", "point", *paths, "status", *(t for _, t, _ in _SHOWN), "Pareto", *extra]
    body: list[list[Any]] = []
    for r, on in zip(rows, front, strict=True):
        pid = r["id"]
        link = h.link(f"points/{quote(pid, safe='=,+')}/report.html", pid) if r["status"] == "ok" else pid
        status = (
            h.span("ok", "ok")
            if r["status"] == "ok"
            else h.join((h.span(r["status"], "bad"), ": ", r.get("error", "")))
        )
        cells = []
        for column, _, fmt in _SHOWN:
            v = _num(r.get(column))
            cells.append("–" if v is None else format(v, fmt))
        body.append(
            [
                r["index"],
                link,
                *(r.get(p, "") for p in paths),
                status,
                *cells,
                "★" if on else "",
                *([] if front3 is None else ["★" if front3[len(body)] else ""]),
            ]
        )
    return _table(body, header, cls="num")


def _page(sweep_dir: Path) -> tuple[str, bool]:
    """The page and whether it has charts (and so loads plotly.min.js beside it)."""
    man = read_manifest(sweep_dir / "sweep.json")
    if man is None:
        raise KvsimError("not a kvsim sweep manifest", source=str(sweep_dir / "sweep.json"))
    rows = read_results(sweep_dir / "results.csv")
    factors = man.get("factors") or []
    paths = [p for f in factors for p in f["paths"]]
    front = pareto_front([(_num(r.get("cost_per_mtok_usd")), _num(r.get("ttft_p99_s"))) for r in rows])
    # A third objective, the cited accuracy-loss estimate, where any point is lossy.
    lossy = any((_num(r.get("accuracy_loss_est")) or 0) > 0 for r in rows)
    front3 = (
        pareto_front(
            [
                (
                    _num(r.get("cost_per_mtok_usd")),
                    _num(r.get("ttft_p99_s")),
                    _num(r.get("accuracy_loss_est")),
                )
                for r in rows
            ]
        )
        if lossy
        else None
    )
    name = Path(str(man.get("scenario", "sweep"))).stem
    failed = sum(r["status"] != "ok" for r in rows)
    note, fig = _factor_charts(factors, rows)
    pareto = _pareto_chart(rows, front)
    figs = [_figure_html(i, f) for i, f in (("sweep-axes", fig), ("sweep-pareto", pareto)) if f is not None]
    page = h.render(
        "sweep.html.j2",
        name=name,
        points=len(rows),
        failed=failed,
        scenario=str(man.get("scenario")),
        sha=str(man.get("scenario_sha256", ""))[:12],
        table=_points_table(rows, paths, front, front3),
        accuracy_note=(
            "accuracy loss (est.): cited, not measured (kvsim.accuracy; stacked techniques' losses "
            "add, a kvsim assumption); the second Pareto column adds it as a third objective"
            if front3 is not None
            else None
        ),
        tolerance=f"{PARETO_REL_TOL:.1%}",
        note=note,
        figures=figs,
        plotly_src=PLOTLY_JS if figs else None,
    )
    return page, bool(figs)


def write_sweep_report(sweep_dir: Path) -> Path:
    """Write ``sweep_dir/sweep.html`` from its sweep.json and results.csv; returns its path."""
    out = Path(sweep_dir) / "sweep.html"
    page, any_fig = _page(Path(sweep_dir))
    try:
        out.write_text(page, encoding="utf-8")
        if any_fig:
            h.write_plotly_js(out.parent)
    except OSError as exc:
        raise KvsimError(f"cannot write the sweep report: {exc.strerror or exc}", source=str(out)) from None
    return out

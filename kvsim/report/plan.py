"""A plan's self-contained HTML page (``DIR/plan.html``), rebuilt from ``plan.json``.

Shows the choice (or, when nothing in the search meets the SLOs, that fact and the closest
configuration with what it misses by), the runner-up configurations with why each lost (the SLO
missed and by how much, or the extra cost), and every point run, each linking to its own
``points/<id>/report.html``. No script and no network: the same plan.json gives the same bytes.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any
from urllib.parse import quote

from kvsim.errors import KvsimError
from kvsim.report import _CSS
from kvsim.report.tables import _table
from kvsim.sweep.plan import read_plan

_SHOWN = (  # column, header, format
    ("ttft_p99_s", "TTFT p99 (s)", ".4g"),
    ("tpot_p99_s", "TPOT p99 (s)", ".4g"),
    ("e2e_p99_s", "E2E p99 (s)", ".4g"),
    ("cost_per_mtok_usd", "$ / M tok", ".4g"),
    ("requests_completed", "completed", ",.0f"),
    ("requests_rejected", "rejected", ",.0f"),
    ("requests_unfinished", "unfinished", ",.0f"),
)


def _e(v: Any) -> str:
    return html.escape(str(v))


def _config_line(e: dict[str, Any]) -> str:
    # A configuration's $/h includes its dedicated pool nodes (absent in plans written before them).
    pool = e.get("pool_nodes_usd_per_hour") or 0.0
    return (
        f"<b>{_e(e['label'])}</b>: {e['gpus']} GPU{'s' if e['gpus'] != 1 else ''} x "
        f"${e['gpu_hour_usd']:.2f}/GPU-h"
        + (f" + ${pool:.2f}/h of pool nodes" if pool else "")
        + f" = <b>${e['usd_per_hour']:.2f}/h</b>"
    )


def _mtok(e: dict[str, Any]) -> str:
    parts = [
        f"{_e(ld['load'])}: ${ld['cost_per_mtok_usd']:.4g}/M tok"
        for ld in e["loads"]
        if ld.get("evaluated") and ld.get("cost_per_mtok_usd") is not None
    ]
    return "; ".join(parts)


def _runners(rows: list[dict[str, Any]]) -> str:
    body = [[_e(e["label"]), f"{e['gpus']}", f"${e['usd_per_hour']:.2f}", _e(e["why"])] for e in rows]
    return _table(body, ["configuration", "GPUs", "$/hour", "why it lost"], cls="num")


def _points(configs: list[dict[str, Any]]) -> str:
    body = []
    for e in configs:
        for ld in e["loads"]:
            if not ld.get("evaluated"):
                continue
            pid = _e(ld["point"])
            link = (
                f'<a href="points/{html.escape(quote(ld["point"], safe="=,+"))}/report.html">{pid}</a>'
                if ld["status"] == "ok"
                else pid
            )
            verdict = (
                '<span class="ok">meets</span>'
                if ld["meets"]
                else '<span class="bad">misses</span>: ' + _e("; ".join(m["text"] for m in ld["misses"]))
            )
            if ld["status"] != "ok":
                verdict += f" ({_e(ld['error'])})"
            cells = []
            for column, _, fmt in _SHOWN:
                v = ld["metrics"].get(column)
                cells.append("–" if v is None else format(v, fmt))
            body.append([link, _e(e["label"]), _e(ld["load"]), f"${e['usd_per_hour']:.2f}", verdict, *cells])
    header = ["point", "configuration", "load", "$/hour", "verdict", *(h for _, h, _ in _SHOWN)]
    return _table(body, [_e(h) for h in header], cls="num")


def _page(plan_dir: Path) -> str:
    data = read_plan(plan_dir / "plan.json")
    if data is None or data.get("state") != "done":
        raise KvsimError("not a finished kvsim plan", source=str(plan_dir / "plan.json"))
    name = Path(str(data.get("scenario", "plan"))).stem
    slos = ", ".join(s["text"] for s in data["slos"])
    unserved = (
        f"at most {data['max_unserved']:.1%} of requests rejected or unfinished"
        if data["max_unserved"]
        else "no request rejected or unfinished"
    )
    search = "; ".join(
        f"{s['path']}={s['range'][0]}..{s['range'][1]} (bisected)"
        if "range" in s
        else f"{s['path']}={','.join(s['values'])}"
        for s in data["search"]
    )
    body = [
        f"<h1>kvsim plan: {_e(name)}</h1>",
        f'<p class="sub">SLOs {_e(slos)} and {_e(unserved)}, at loads {_e(", ".join(data["loads"]))} · '
        f"search {_e(search or '(none)')} · scenario {_e(data['scenario'])} · sha256 "
        f"{_e(str(data.get('scenario_sha256', ''))[:12])}</p>",
        f'<p class="note">Cheapest by {_e(data["cost_basis"])}.</p>',
    ]
    choice = data.get("choice")
    if choice is not None:
        body += [
            "<h2>Choice</h2>",
            f"<p>{_config_line(choice)}; meets every SLO at every load. {_e(_mtok(choice))}</p>",
            "<h2>Runners-up</h2>",
            _runners(data["runners_up"])
            if data["runners_up"]
            else '<p class="note">No other configuration was evaluated.</p>',
        ]
    else:
        closest = data.get("closest")
        body += [
            "<h2>No configuration meets the SLOs</h2>",
            f'<p class="bad">Nothing in the search range meets {_e(slos)} at every load.</p>',
        ]
        if closest is not None:
            body.append(f"<p>Closest: {_config_line(closest)}; {_e(closest['why'])}.</p>")
    body += [f'<p class="warn">{_e(n)}</p>' for n in data.get("notes", [])]
    body += ["<h2>Points run</h2>", _points(data["configurations"])]
    return (
        '<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>kvsim plan: {_e(name)}</title>\n<style>{_CSS}</style>\n</head>\n"
        "<body><main>\n" + "\n".join(body) + "\n</main></body>\n</html>\n"
    )


def write_plan_report(plan_dir: Path) -> Path:
    """Write ``plan_dir/plan.html`` from its plan.json; returns its path."""
    out = Path(plan_dir) / "plan.html"
    page = _page(Path(plan_dir))
    try:
        out.write_text(page, encoding="utf-8")
    except OSError as exc:
        raise KvsimError(f"cannot write the plan report: {exc.strerror or exc}", source=str(out)) from None
    return out

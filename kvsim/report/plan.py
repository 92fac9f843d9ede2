"""A plan's HTML page (``DIR/plan.html``), rebuilt from ``plan.json``.

Shows the choice (or, when nothing in the search meets the SLOs, that fact and the closest
configuration with what it misses by), the runner-up configurations with why each lost (the SLO
missed and by how much, or the extra cost), each $/GPU-hour used with where it comes from, and
every point run, each linking to its own
``points/<id>/report.html``. No script and no network: the same plan.json gives the same bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

from markupsafe import Markup

from kvsim.accuracy import loss_text
from kvsim.errors import KvsimError
from kvsim.report import html as h
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


def _config_line(e: dict[str, Any]) -> Markup:
    # A configuration's $/h includes its dedicated pool nodes (absent in plans written before them).
    pool = e.get("pool_nodes_usd_per_hour") or 0.0
    return h.join(
        (
            h.bold(e["label"]),
            f": {e['gpus']} GPU{'s' if e['gpus'] != 1 else ''} x ${e['gpu_hour_usd']:.2f}/GPU-h"
            + (f" + ${pool:.2f}/h of pool nodes" if pool else "")
            + " = ",
            h.bold(f"${e['usd_per_hour']:.2f}/h"),
            f" ($/GPU-h: {e['gpu_hour_source']})" if e.get("gpu_hour_source") else "",
        )
    )


def _prices(configs: list[dict[str, Any]]) -> Markup | None:
    """One row per $/GPU-hour and source used, with the configurations priced at it (None for a
    plan written before rows carried their price's source)."""
    by: dict[tuple[float, str], list[str]] = {}
    for e in configs:
        if e.get("gpu_hour_source") is None:
            return None
        by.setdefault((e["gpu_hour_usd"], e["gpu_hour_source"]), []).append(e["label"])
    body = [
        [
            f"${usd:.2f}",
            source,
            f"{len(labels)}: " + "; ".join(labels[:3]) + ("; ..." if len(labels) > 3 else ""),
        ]
        for (usd, source), labels in by.items()
    ]
    return _table(body, ["$/GPU-h", "where it comes from", "configurations"], cls="num")


def _mtok(e: dict[str, Any]) -> str:
    parts = [
        f"{ld['load']}: ${ld['cost_per_mtok_usd']:.4g}/M tok"
        for ld in e["loads"]
        if ld.get("evaluated") and ld.get("cost_per_mtok_usd") is not None
    ]
    return "; ".join(parts)


def _acc(e: dict[str, Any]) -> str:
    """A configuration's accuracy estimate cell (– in plans written before estimates), marked as
    excluded where the budget excluded it."""
    if "accuracy" not in e:
        return "–"
    return loss_text(e["accuracy"]) + (" (over budget)" if e.get("excluded_by_budget") else "")


def _runners(rows: list[dict[str, Any]]) -> Markup:
    body = [[e["label"], f"{e['gpus']}", f"${e['usd_per_hour']:.2f}", _acc(e), e["why"]] for e in rows]
    return _table(body, ["configuration", "GPUs", "$/hour", "accuracy loss (est.)", "why it lost"], cls="num")


def _estimates(configs: list[dict[str, Any]]) -> Markup | None:
    """One row per distinct lossy part among the configurations: its estimate, basis and source
    (None when nothing searched is lossy, or a plan written before estimates)."""
    seen: dict[str, dict[str, Any]] = {}
    for e in configs:
        for part in (e.get("accuracy") or {}).get("parts", []):
            seen.setdefault(part["technique"], part)
    if not seen:
        return None
    body = [
        [
            t,
            ("more than " if p.get("lower_bound") else "") + f"{p['loss']:.2%}",
            p["basis"],
            p["source"],
        ]
        for t, p in seen.items()
    ]
    return _table(body, ["technique", "loss (est.)", "basis", "source"], cls="num")


def _points(configs: list[dict[str, Any]]) -> Markup:
    body = []
    for e in configs:
        for ld in e["loads"]:
            if not ld.get("evaluated"):
                continue
            pid = ld["point"]
            link = (
                h.link(f"points/{quote(pid, safe='=,+')}/report.html", pid) if ld["status"] == "ok" else pid
            )
            verdict = (
                h.span("meets", "ok")
                if ld["meets"]
                else h.join((h.span("misses", "bad"), ": ", "; ".join(m["text"] for m in ld["misses"])))
            )
            if ld["status"] != "ok":
                verdict = h.join((verdict, f" ({ld['error']})"))
            cells = []
            for column, _, fmt in _SHOWN:
                v = ld["metrics"].get(column)
                cells.append("–" if v is None else format(v, fmt))
            body.append([link, e["label"], ld["load"], f"${e['usd_per_hour']:.2f}", _acc(e), verdict, *cells])
    header = [
        "point",
        "configuration",
        "load",
        "$/hour",
        "accuracy loss (est.)",
        "verdict",
        *(t for _, t, _ in _SHOWN),
    ]
    return _table(body, header, cls="num")


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
    choice, closest = data.get("choice"), data.get("closest")
    budget = data.get("max_accuracy_loss")
    excluded = data.get("budget_excluded")
    return h.render(
        "plan.html.j2",
        name=name,
        slos=slos,
        unserved=unserved,
        loads=", ".join(data["loads"]),
        search=search or "(none)",
        scenario=data["scenario"],
        sha=str(data.get("scenario_sha256", ""))[:12],
        cost_basis=data["cost_basis"],
        choice=None if choice is None else _config_line(choice),
        choice_mtok="" if choice is None else _mtok(choice),
        choice_acc=None if choice is None or "accuracy" not in choice else loss_text(choice["accuracy"]),
        budget=None if budget is None else f"{budget:.2%}",
        budget_why=None if excluded is None else excluded["text"],
        accuracy_rule=data.get("accuracy_rule"),
        accuracy_basis=data.get("accuracy_basis"),
        estimates=_estimates(data["configurations"]),
        runners_up=_runners(data["runners_up"]) if choice is not None and data["runners_up"] else None,
        closest=None if choice is not None or closest is None else _config_line(closest),
        closest_why="" if closest is None else closest["why"],
        notes=data.get("notes", []),
        warnings=data.get("warnings", []),
        price_rule=data.get("price_rule", ""),
        prices=_prices(data["configurations"]),
        points=_points(data["configurations"]),
        plotly_src=None,
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

"""``stack.html``: the technique-stacking table of ``kvsim stack`` (`kvsim.stack`), beside the
design documents' claimed row; built from ``stack.json``."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from kvsim.report import _CSS
from kvsim.report.tables import _table


def _e(v: Any) -> str:
    return html.escape(str(v))


def _gb(v: Any) -> str:
    return "-" if v is None else f"{v / 1e9:,.2f} GB"


def _ms(v: Any) -> str:
    return "-" if v is None else f"{v * 1e3:,.1f} ms"


def _usd(v: Any) -> str:
    return "-" if v is None else f"${v:,.3f}"


def stack_cells(r: dict[str, Any]) -> list[str]:
    """One row's cells as plain text (the terminal table uses them too)."""
    return [
        str(r["label"]),
        _gb(r["kv_bytes_1m"]),
        "-" if r["hbm_peak_bytes"] is None else f"{r['hbm_peak_bytes'] / 2**30:,.1f} GiB",
        _ms(r["ttft_p99_s"]),
        _ms(r["tpot_p99_s"]),
        _usd(r["cost_per_mtok_usd"]),
        f"{r['claimed_memory']}, {r['claimed_cost']}",
        str(r["note"]),
    ]


HEADER = (
    "technique",
    "KV of one 1M-token sequence",
    "HBM in use at peak, per GPU",
    "TTFT p99",
    "TPOT p99",
    "cost / M tokens",
    "documents claim (memory, cost per 1M)",
    "note",
)


def write_stack_report(out_dir: Path, data: dict[str, Any]) -> Path:
    rows = [[_e(c) for c in stack_cells(r)] for r in data["rows"]]
    body = [
        f"<h1>kvsim stack: {_e(data['scenario'])}</h1>",
        f'<p class="sub">{_e(data["model"])} on {_e(data["gpu"])}, trace {_e(data["trace"])}; every row '
        "simulated with the techniques above it on</p>",
        _table(rows, header=HEADER),
        f'<p class="note">Claimed column: {_e(data["claimed_source"])}. KV bytes are exact for the '
        "model (window caps applied, H2O's kept share); paging and sharing do not change one "
        "sequence's bytes. Accuracy effects of FP8 and H2O are cited estimates (see a run's "
        "report), not simulated.</p>",
        f'<p class="note">Cost column: {_e(data.get("cost_basis", ""))}.</p>',
    ]
    page = (
        '<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>kvsim stack: {_e(data['scenario'])}</title>\n<style>{_CSS}</style>\n</head>\n"
        "<body><main>\n" + "\n".join(body) + "\n</main></body>\n</html>\n"
    )
    path = Path(out_dir) / "stack.html"
    path.write_text(page)
    return path

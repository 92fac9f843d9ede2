"""``stack.html``: the technique-stacking table of ``kvsim stack`` (`kvsim.stack`), beside the
design documents' claimed row; built from ``stack.json``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvsim.report import html as h
from kvsim.report.tables import _table


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
    page = h.render(
        "stack.html.j2",
        scenario=data["scenario"],
        model=data["model"],
        gpu=data["gpu"],
        trace=data["trace"],
        table=_table([stack_cells(r) for r in data["rows"]], header=HEADER),
        claimed_source=data["claimed_source"],
        cost_basis=data.get("cost_basis", ""),
        plotly_src=None,
    )
    path = Path(out_dir) / "stack.html"
    path.write_text(page, encoding="utf-8")
    return path

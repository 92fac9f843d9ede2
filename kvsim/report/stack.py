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


CLAIM_HEADER = ("rule (source)", "verdict", "why", "compared", "runs behind it")


def _run_cell(r: dict[str, Any]) -> str:
    m = r["metrics"]
    return (
        f"{r['label']} ({r['settings']}): cost ${m['cost_per_mtok_usd']:,.4f}/M, "
        f"TPOT p99 {m['tpot_p99_s'] * 1e3:,.2f} ms, peak {m['peak_concurrent_sequences']} seqs, "
        f"{m['kv_peak_used_blocks']:,} KV blocks at peak, pool {m['kv_tokens_per_replica']:,} tokens"
    )


def claim_cells(c: dict[str, Any], sep: str = "; ") -> list[str]:
    """One checked rule's cells as plain text (terminal and page; `sep` between its runs)."""
    runs = sep.join(_run_cell(r) for r in c["runs"]) or "none"
    return [f"{c['rule']} ({c['source']})", str(c["verdict"]), str(c["why"]), str(c["metric"]), runs]


def write_stack_report(out_dir: Path, data: dict[str, Any]) -> Path:
    page = h.render(
        "stack.html.j2",
        scenario=data["scenario"],
        model=data["model"],
        gpu=data["gpu"],
        trace=data["trace"],
        table=_table([stack_cells(r) for r in data["rows"]], header=HEADER),
        claims=(
            _table([claim_cells(c) for c in data["claims"]], header=CLAIM_HEADER)
            if "claims" in data
            else None
        ),
        claimed_source=data["claimed_source"],
        cost_basis=data.get("cost_basis", ""),
        plotly_src=None,
    )
    path = Path(out_dir) / "stack.html"
    path.write_text(page, encoding="utf-8")
    return path

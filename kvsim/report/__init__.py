"""One self-contained HTML report rebuilt from a run directory, without re-running the simulation.

Reads what ``kvsim run`` wrote: ``summary.json`` (required, through `kvsim.results.record.read_summary`), ``requests.csv`` and ``timeseries.csv``
(each optional; a missing one leaves a note where its charts would be). Shows the scenario and its
config; a headline table (request accounting, TTFT/TPOT/E2E/queueing percentiles, throughput,
goodput against the SLO, cost, HBM peak vs capacity, prefix hits, preemptions, simulated vs wall
time); charts (TTFT and TPOT CDFs, E2E vs arrival, KV-block occupancy, running/waiting queues,
output throughput over time); warnings; a per-replica table (requests, busy fraction, peak and
mean KV blocks, preemptions); the memory tiers when any is on (prefix hits per tier, loads,
write-backs, the global pool, swaps, waits for KV, and each link's traffic and utilisation, and,
from ``tiers.csv`` and ``links.csv``, each tier's occupancy and each link's utilisation over time);
rejection reasons; and, when the summary carries one, the
accuracy estimate, labelled as cited rather than measured.

Leaves out: per-request tables (the CSV is the place for those), any recomputation of the headline
percentiles (they are the simulator's numbers from ``summary.json``), and generation timestamps, so
that the same run directory always yields the same bytes. plotly.js is embedded once, inline, so
the file opens offline. This package (data, tables, charts) is the only part of kvsim that plots.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from plotly.offline import get_plotlyjs

from kvsim.errors import KvsimError
from kvsim.report.charts import _charts_section
from kvsim.report.data import _load_csv, _load_summary
from kvsim.report.outputs import check_output_dir
from kvsim.report.tables import (
    _accuracy_section,
    _config_section,
    _eviction_section,
    _extras_section,
    _get,
    _headline_section,
    _plural,
    _rejections_section,
    _replicas_section,
    _sessions_section,
    _switch_section,
    _tiers_section,
    _warnings_section,
    _window_section,
)
from kvsim.results.record import RunSummary

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


def _page(record: RunSummary, run_dir: Path) -> str:
    s = record.to_dict()  # the sections below index the JSON form; new ones read the record
    scenario = str(s.get("scenario") or run_dir.name)
    requests = _load_csv(run_dir / "requests.csv")
    slo: dict[str, Any] = s["slo"]  # validated by the reader
    charts, any_fig = _charts_section(
        requests,
        _load_csv(run_dir / "timeseries.csv"),
        slo,
        _load_csv(run_dir / "tiers.csv"),
        _load_csv(run_dir / "links.csv"),
    )
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
        "".join(f'<p class="note">summary.json: {html.escape(n)}</p>' for n in record.read_notes),
        _headline_section(s, requests),
        _warnings_section(s),
        _replicas_section(record),
        _tiers_section(record),
        _sessions_section(record),
        charts,
        _rejections_section(s),
        _accuracy_section(s),
        _eviction_section(s),
        _window_section(s),
        _switch_section(s),
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
    page = _page(summary, run_dir)
    try:
        out.write_text(page, encoding="utf-8")
    except OSError as exc:
        raise KvsimError(f"cannot write the report: {exc.strerror or exc}", source=str(out)) from None
    return out


def report_command(run_dir: str, *, force: bool = False) -> int:
    """``kvsim report RUN_DIR``: rebuild report.html from an existing run directory; exit code 0.
    The report is checked first: never over the run's inputs, a folder, or a file kvsim did not
    write (unless `force`)."""
    if not run_dir.strip():
        raise KvsimError("empty path (an unset shell variable?); give a run directory", source="kvsim report")
    root = Path(run_dir)
    if not root.is_dir():
        what = "is not a directory" if root.exists() else "not found"
        raise KvsimError(f"run directory {what}", source=run_dir)
    reads = tuple((name, root / name) for name in ("summary.json", "requests.csv", "timeseries.csv"))
    check_output_dir(run_dir, reads=reads, force=force, files=("report.html",), flag="kvsim report")
    path = write_report(root)
    print(f"wrote {path}")
    return 0

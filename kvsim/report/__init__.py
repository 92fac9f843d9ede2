"""One HTML report rebuilt from a run directory, without re-running the simulation.

Reads what ``kvsim run`` wrote: ``summary.json`` (required, through `kvsim.results.record.read_summary`), ``requests.csv`` and ``timeseries.csv``
(each optional, plain or as a point's ``.csv.gz``; a missing one leaves a note where its charts would be). Shows the scenario and its
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
that the same run directory always yields the same bytes. Charts plot thinned data by stated rules
(`kvsim.report.charts`); the tables hold the exact numbers. plotly.js is loaded from
``plotly.min.js`` beside the page (or, for a sweep's or plan's point, in the sweep's folder), so
the page opens offline. This package (data, tables, charts) is the only part of kvsim that plots.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from kvsim.errors import KvsimError
from kvsim.report import html as h
from kvsim.report.charts import _charts_section, capacity_timeline
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
    _pools_section,
    _rejections_section,
    _replicas_section,
    _sessions_section,
    _switch_section,
    _tiers_section,
    _warnings_section,
    _window_section,
)
from kvsim.results.record import RunSummary

# A sweep's or plan's point reports lie in DIR/points/<id>/ and share DIR/plotly.min.js.
POINT_PLOTLY_SRC = f"../../{h.PLOTLY_JS}"


def _capacity(
    record: RunSummary, s: dict[str, Any]
) -> tuple[tuple[list[float], list[int], str], float] | None:
    cap = capacity_timeline(record)
    end = s.get("simulated_s")
    return None if cap is None else (cap, float(end) if isinstance(end, (int, float)) else cap[0][-1])


def _page(record: RunSummary, run_dir: Path, plotly_src: str) -> tuple[str, bool]:
    """The page and whether it has charts (so needs plotly.js, loaded from `plotly_src`)."""
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
        _capacity(record, s),
    )
    model, gpu = _get(s, "config", "model"), _get(s, "config", "gpu")
    n_gpu, reps = _get(s, "config", "num_gpus"), _get(s, "config", "replicas")
    sub = [
        str(x)
        for x in (
            model,
            f"{n_gpu} x {gpu}" if gpu is not None and n_gpu is not None else gpu,
            _plural(reps, "replica") if reps is not None else None,
            _get(s, "config", "kv_format"),
        )
        if x is not None
    ]
    sections = [
        _headline_section(s, requests),
        _warnings_section(s),
        _pools_section(record),
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
    page = h.render(
        "report.html.j2",
        scenario=scenario,
        sub=sub,
        read_notes=record.read_notes,
        sections=sections,
        plotly_src=plotly_src if any_fig else None,
    )
    return page, any_fig


def write_report(run_dir: Path, out: Path | None = None, *, plotly_src: str | None = None) -> Path:
    """Write the HTML report for ``run_dir`` to ``out`` (default run_dir/report.html).

    Its charts load plotly.js from `plotly_src`, relative to the page; by default from
    ``plotly.min.js`` beside it, written here when the page has charts. A caller passing
    `plotly_src` writes that file itself (`point_reports`). Reads summary.json (required;
    `KvsimError` when missing or malformed), requests.csv and timeseries.csv (optional). The same
    inputs give byte-identical output. Returns the path written.
    """
    run_dir = Path(run_dir)
    summary = _load_summary(run_dir)
    out = Path(out) if out is not None else run_dir / "report.html"
    page, any_fig = _page(summary, run_dir, plotly_src or h.PLOTLY_JS)
    try:
        out.write_text(page, encoding="utf-8")
    except OSError as exc:
        raise KvsimError(f"cannot write the report: {exc.strerror or exc}", source=str(out)) from None
    if any_fig and plotly_src is None:
        h.write_plotly_js(out.parent)
    return out


def point_reports(root: Path) -> partial[Path]:
    """What writes a sweep's or plan's point reports (``root/points/<id>/report.html``): each
    loads the one ``root/plotly.min.js``, written here, before any point runs."""
    h.write_plotly_js(root)
    return partial(write_report, plotly_src=POINT_PLOTLY_SRC)


def _plotly_src_for(run_dir: Path) -> str | None:
    """A point of a sweep or plan (``DIR/points/<id>``, DIR holding kvsim's plotly.min.js) shares
    that file; any other run directory gets its own (None)."""
    up = run_dir.resolve().parent
    if up.name == "points" and h.is_plotly_js(up.parent / h.PLOTLY_JS):
        return POINT_PLOTLY_SRC
    return None


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
    names = ("summary.json", "requests.csv", "requests.csv.gz", "timeseries.csv", "timeseries.csv.gz")
    reads = tuple((name, root / name) for name in names)
    shared = _plotly_src_for(root)
    files = ("report.html",) if shared else ("report.html", h.PLOTLY_JS)
    check_output_dir(run_dir, reads=reads, force=force, files=files, flag="kvsim report")
    path = write_report(root, plotly_src=shared)
    print(f"wrote {path}")
    return 0

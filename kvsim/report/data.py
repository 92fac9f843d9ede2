"""Reading a run directory's files for the report: summary.json (through its one reader) and the CSVs."""

from __future__ import annotations

import csv
import gzip
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvsim.errors import KvsimError
from kvsim.results.io import GZ
from kvsim.results.record import RunSummary, read_summary
from kvsim.spec.schema import shorten

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
                    f"expected a number in column {name!r}, got {shorten(repr(text))}",
                    source=str(self.path),
                    path=f"line {i + 2}",
                ) from None
        return out

    def text(self, name: str) -> np.ndarray:
        return np.array([t.strip() for t in self.columns[name]], dtype=object)


def _load_summary(run_dir: Path) -> RunSummary:
    """The run's summary through the one reader (`kvsim.results.record.read_summary`)."""
    if not run_dir.is_dir():
        raise KvsimError("run directory not found", source=str(run_dir))
    return read_summary(run_dir / "summary.json")


def csv_path(path: Path) -> Path | None:
    """The file holding CSV `path` (``DIR/requests.csv``): itself, else its compressed form
    ``DIR/requests.csv.gz`` (a sweep's or plan's point), else None."""
    for p in (path, path.with_name(path.name + GZ)):
        if p.exists():
            return p
    return None


def _load_csv(path: Path) -> _Csv | None:
    """CSV `path` or its ``.gz`` form (`csv_path`); None when neither exists."""
    found = csv_path(path)
    if found is None:
        return None
    try:
        return _read_csv(found)
    except (OSError, EOFError, zlib.error, UnicodeDecodeError, csv.Error) as exc:
        raise KvsimError(f"cannot read: {shorten(str(exc), 120)}", source=str(found)) from None


def _read_csv(path: Path) -> _Csv:
    opened = (
        gzip.open(path, "rt", newline="", encoding="utf-8")
        if path.suffix == GZ
        else path.open(newline="", encoding="utf-8")
    )
    with opened as f:
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

"""Run-directory files: per-request records (``requests.csv``) and the occupancy time series.

Each writer writes plain CSV, or gzip-compressed CSV when its path ends in ``.gz`` (a sweep's or
plan's points: `csv_name`); the compressed bytes hold no time stamp or file name, so the same
rows give the same file.
"""

from __future__ import annotations

import csv
import gzip
import io
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from kvsim.core.request import Request
from kvsim.results.summary import status_of

REQUEST_COLUMNS = (
    "id",
    "replica",
    "arrival_s",
    "first_scheduled_s",
    "first_token_s",
    "finish_s",
    "prompt_tokens",
    "output_tokens",
    "cached_tokens",
    "preemptions",
    "status",
    "reason",
)


GZ = ".gz"


def csv_name(name: str, compress: bool) -> str:
    """The file name a run writes `name` (``requests.csv``...) under: with ``.gz`` when compressed."""
    return name + GZ if compress else name


@contextmanager
def _open_csv(path: Path) -> Iterator[TextIO]:
    """`path` for writing CSV text; gzip-compressed (level 6, no mtime or name) for a ``.gz`` path."""
    if path.suffix != GZ:
        with path.open("w", newline="") as f:
            yield f
        return
    with (
        path.open("wb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=6, mtime=0) as gz,
    ):
        with io.TextIOWrapper(gz, encoding="utf-8", newline="") as f:
            yield f


def _t(x: float) -> str:
    return "" if x != x else repr(round(x, 9))


def write_requests_csv(path: Path, seqs: list[Request]) -> None:
    with _open_csv(path) as f:
        w = csv.writer(f)
        w.writerow(REQUEST_COLUMNS)
        for s in seqs:
            w.writerow(
                (
                    s.id,
                    s.replica,
                    _t(s.arrival_s),
                    _t(s.first_scheduled_s),
                    _t(s.first_token_s),
                    _t(s.finish_s),
                    s.prompt_len,
                    s.output_len,
                    max(s.num_cached_tokens, 0),
                    s.preemptions,
                    status_of(s),
                    s.reason,
                )
            )


def write_timeseries_csv(path: Path, samples: list[tuple[float, int, int, int, int, int, int]]) -> None:
    with _open_csv(path) as f:
        w = csv.writer(f)
        w.writerow(
            ("t_s", "replica", "kv_used_blocks", "kv_cached_blocks", "kv_free_blocks", "running", "waiting")
        )
        for row in sorted(samples):
            w.writerow((repr(round(row[0], 6)), *row[1:]))


TIER_COLUMNS = ("t_s", "tier", "used_bytes")


def write_tiers_csv(path: Path, samples: list[tuple[float, str, int]]) -> None:
    """Occupancy of the tiers below HBM over time (``kv.offload``, the global pool): one row per
    sample and tier, ``tier`` as ``node0/dram``, ``node0/ssd`` or ``global``."""
    with _open_csv(path) as f:
        w = csv.writer(f)
        w.writerow(TIER_COLUMNS)
        for t, tier, used in samples:
            w.writerow((repr(round(t, 6)), tier, used))


LINK_COLUMNS = ("t_s", "link", "bytes", "busy_s")


def write_links_csv(path: Path, samples: list[tuple[float, str, float, float]]) -> None:
    """Traffic of every link over time (``kv.offload``, swap, the global pool): at each sample, the
    bytes and busy seconds of the transfers asked for so far, per link direction (``node0/host_h2d/0``)."""
    with _open_csv(path) as f:
        w = csv.writer(f)
        w.writerow(LINK_COLUMNS)
        for t, link, nbytes, busy in samples:
            w.writerow((repr(round(t, 6)), link, repr(nbytes), repr(busy)))

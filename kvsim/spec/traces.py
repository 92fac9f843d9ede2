"""Trace readers: request arrivals and lengths from a file, as numpy arrays.

A `Workload` holds, per request, its arrival time (s), prompt and output lengths (tokens) and, when the
source has prefix information, the chained block hashes of its prompt (``hash_ids``): one int64 id per
``hash_block_tokens``-token block, the last block possibly partial. Ids are *prefix-unique*: an equal id
means the whole prompt prefix up to and including that block is identical, which is all a prefix cache
needs. ``load_workload(cfg, seed=...)`` reads one of the trace formats below or runs the synthetic
generator, then applies the window, the rate scale and the request cap, in that order.

Trace formats (``workload.format``):

- ``mooncake``: JSONL ``{"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}``,
  512-token blocks, ``len(hash_ids) == ceil(input_length / 512)``.
- ``azure`` (2023 and 2024): CSV ``TIMESTAMP,ContextTokens,GeneratedTokens``; wall-clock timestamps
  (``2023-11-16 18:15:46.6805900``, any number of fractional digits, optional ``T``, ``Z`` or ``+HH:MM``)
  taken relative to the first row. No prefix information.
- ``burstgpt``: CSV ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type`` (extra
  columns such as ``Session ID`` ignored), timestamps in seconds. Rows with 0 response tokens are
  BurstGPT's failed requests: dropped and counted in ``dropped["burstgpt_failed_zero_response"]``.
- ``vidur``: CSV ``arrived_at,num_prefill_tokens,num_decode_tokens`` (seconds), extra columns ignored.
- ``generic``: chosen by the file's extension.

  * ``.csv``: header ``arrival_s,prompt_tokens,output_tokens`` (extra columns ignored), one request a
    row: arrival time in seconds, prompt and output lengths in tokens (integers >= 1).
  * ``.jsonl``: one JSON object a line with keys ``arrival_s`` (number, seconds), ``prompt_tokens``
    and ``output_tokens`` (integers >= 1) and, optionally, ``hash_ids``: a list of
    ``ceil(prompt_tokens / hash_block_tokens)`` integers, one per block of the prompt, equal for equal
    block content. Give ``hash_ids`` on every line or on none. The block size ``hash_block_tokens``
    (default 16) is fixed by the first line; later lines may repeat it but not change it. Other keys
    are ignored.

In both JSONL formats, if an id ever follows two different ids, all ids are renumbered along the
chain (a block's new id names its whole prefix), so plain per-block content hashes work too; the
bundled Mooncake traces are already chained and load unchanged.

Rules for every trace, one for all formats: times are non-decreasing (a timestamp that goes backwards
is an error, never silently reordered); blank lines are ignored; a malformed line is an error
``FILE:LINE: what is wrong`` unless ``skip_bad_lines``, which skips and counts it. A numeric time must
be finite, >= 0 and below `MAX_TIME_S` (2^33 s, about 272 years: beyond it float64 no longer
resolves a microsecond, so a trace in epoch milli-, micro- or nanoseconds read as seconds is refused
rather than turned into zero latencies); token counts are integers in [1, `MAX_TOKENS`]. Every trace
is rebased to its first request (the first row read, a BurstGPT failed row included): trace time 0 is
that row, and the original start (Mooncake's ms / 1000, Azure's seconds since the Unix epoch, the
file's seconds otherwise) is reported as ``origin_s``. The window ``[start, start + duration)`` is in
that rebased trace time and rebased again to 0; ``rate_scale`` k then divides the times (k = 2
replays twice as fast). Requests outside the window or beyond ``max_requests`` are counted, never
dropped without a number (`kvsim.spec.workload`). Files may start with a UTF-8 BOM and use CRLF.

Left out: token contents, per-request models or adapters, priorities, BurstGPT's session and model
columns, and closed-loop clients (arrivals never depend on how fast the cluster serves).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Iterator
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np

from kvsim.errors import KvsimError
from kvsim.spec.jsonfile import JsonError
from kvsim.spec.jsonfile import loads as json_loads
from kvsim.spec.scenario import WorkloadConfig
from kvsim.spec.schema import shorten

MOONCAKE_BLOCK_TOKENS = 512
MAX_TIME_S = float(2**33)  # float64 spacing at 2^33 s is 2^-19 s = 1.9 us; below it, under 1 us
MAX_TOKENS = 1 << 30  # tokens per prompt or output; the longest context of any preset is 2^21
GENERIC_BLOCK_TOKENS = 16
BURSTGPT_FAILED = "burstgpt_failed_zero_response"

_CSV_COLUMNS: dict[str, tuple[str, str, str]] = {
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "burstgpt": ("Timestamp", "Request tokens", "Response tokens"),
    "vidur": ("arrived_at", "num_prefill_tokens", "num_decode_tokens"),
    "generic": ("arrival_s", "prompt_tokens", "output_tokens"),
}
_BURSTGPT_HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type"


class _BadLine(Exception):
    """A malformed line; the reader turns it into a located error or a skip."""


class _Rows:
    """Accumulates parsed rows; owns the bad-line policy and the ordering check."""

    def __init__(self, path: Path, skip_bad: bool) -> None:
        self.file = str(path)
        self.skip_bad = skip_bad
        self.t: list[float] = []
        self.prompt: list[int] = []
        self.output: list[int] = []
        self.lines: list[int] = []
        self.hashes: list[np.ndarray] = []
        self.skipped = 0
        self.dropped: dict[str, list[float]] = {}
        self.prev_t = -math.inf
        self.prev_raw: Any = None
        self.first_t: float | None = None  # trace time of the first row read: the rebasing origin
        self.epoch_offset_s = 0.0  # trace time -> the trace's own clock (Azure: Unix epoch seconds)

    def error(self, line: int, message: str) -> KvsimError:
        return KvsimError(message, source=f"{self.file}:{line}")

    def bad(self, line: int, message: str) -> None:
        if not self.skip_bad:
            raise self.error(line, message)
        self.skipped += 1

    def order(self, line: int, t: float, raw: Any) -> None:
        """Reject a timestamp before the previous one (`raw` is the value as written, for the message)."""
        if t < self.prev_t:
            raise self.error(
                line,
                f"timestamp goes backwards ({shorten(str(raw))} < previous {shorten(str(self.prev_raw))})",
            )
        if self.first_t is None:
            self.first_t = t
        self.prev_t = t
        self.prev_raw = raw

    def add(self, line: int, t: float, prompt: int, output: int) -> None:
        self.t.append(t)
        self.prompt.append(prompt)
        self.output.append(output)
        self.lines.append(line)

    def drop(self, reason: str, t: float) -> None:
        self.dropped.setdefault(reason, []).append(t)


def _int(value: Any, name: str, lo: int, hi: int = MAX_TOKENS) -> int:
    """An integer in [lo, hi] from a JSON value or CSV text; integral floats (``512.0``) are accepted."""
    if type(value) is int:
        v = value
    elif type(value) is str:
        try:
            v = int(value)
        except ValueError:  # "512.0", "1e3", or more digits than Python converts
            try:
                f = float(value)
            except ValueError:
                raise _BadLine(f"{name} must be an integer >= {lo}, got {_shown(value)}") from None
            if not f.is_integer():
                raise _BadLine(f"{name} must be an integer >= {lo}, got {_shown(value)}") from None
            v = int(f)
    elif type(value) is float and value.is_integer():
        v = int(value)
    else:
        raise _BadLine(f"{name} must be an integer >= {lo}, got {_shown(value)}")
    if v < lo:
        raise _BadLine(f"{name} must be an integer >= {lo}, got {_shown(value)}")
    if v > hi:
        raise _BadLine(f"{name} must be at most {hi:,}, got {_shown(value)}")
    return v


def _shown(value: Any) -> str:
    return type(value).__name__ if isinstance(value, (dict, list)) else shorten(repr(value))


def _num(value: Any, name: str, per_s: float = 1.0) -> float:
    """A time in seconds from a JSON number or CSV text in the file's unit (`per_s` units a second):
    finite, >= 0 and below `MAX_TIME_S`."""
    v = math.nan
    if type(value) is int:
        v = float(value) if abs(value) < 1e300 else math.inf
    elif type(value) is float:
        v = value
    elif type(value) is str:
        try:
            v = float(value)
        except ValueError:
            pass
    where = "" if name.lower() == "timestamp" else f" in {name}"
    if not math.isfinite(v):
        raise _BadLine(f"unparseable timestamp {_shown(value)}{where}")
    if v < 0:
        raise _BadLine(f"negative timestamp {_shown(value)}{where}; trace times must be >= 0")
    t = v / per_s
    if t >= MAX_TIME_S:
        unit = "s" if per_s == 1.0 else "ms"
        raise _BadLine(
            f"timestamp {_shown(value)}{where} is too large (at most {MAX_TIME_S * per_s:.3g} {unit}, where "
            "float64 still resolves 1 us); kvsim reads seconds: convert ms/us/ns first"
        )
    return t


def _ids(value: Any, prompt: int, block: int) -> np.ndarray:
    if not isinstance(value, list):
        raise _BadLine(f"hash_ids must be a list of integers, got {type(value).__name__}")
    want = -(-prompt // block)
    if len(value) != want:
        raise _BadLine(f"hash_ids has {len(value)} ids, expected ceil({prompt} / {block}) = {want}")
    try:
        arr = np.array(value)
    except (ValueError, OverflowError):
        raise _BadLine("hash_ids must be a list of integers") from None
    if arr.dtype.kind != "i" or arr.ndim != 1:
        raise _BadLine("hash_ids must be a list of integers")
    return arr.astype(np.int64, copy=False)


def _open(path: Path) -> Iterator[str]:
    """The file's lines; a leading UTF-8 BOM is dropped, CRLF kept for the readers to strip."""
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            yield from f
    except (OSError, UnicodeDecodeError) as exc:
        raise KvsimError(f"cannot read the trace: {shorten(str(exc), 120)}", source=str(path)) from None


def _json_lines(path: Path, rows: _Rows) -> Iterator[tuple[int, dict[str, Any]]]:
    for n, text in enumerate(_open(path), 1):
        if not text.strip():
            continue
        try:
            obj = json_loads(text)
        except JsonError as exc:
            rows.bad(n, exc.message)
            continue
        if type(obj) is not dict:
            rows.bad(n, f"expected a JSON object, got {type(obj).__name__}")
            continue
        yield n, obj


def _missing(obj: dict[str, Any], keys: Iterable[str]) -> str:
    return ", ".join(repr(k) for k in keys if k not in obj)


def _read_mooncake(path: Path, rows: _Rows) -> int:
    keys = ("timestamp", "input_length", "output_length", "hash_ids")
    g = MOONCAKE_BLOCK_TOKENS
    for n, obj in _json_lines(path, rows):
        try:
            try:
                raw_t = obj["timestamp"]
                prompt = _int(obj["input_length"], "input_length", 1)
                output = _int(obj["output_length"], "output_length", 1)
                ids = _ids(obj["hash_ids"], prompt, g)
            except KeyError:
                raise _BadLine(f"missing field {_missing(obj, keys)}") from None
            t = _num(raw_t, "timestamp", per_s=1000.0)  # Mooncake times are ms
        except _BadLine as exc:
            rows.bad(n, str(exc))
            continue
        rows.order(n, t, raw_t)
        rows.add(n, t, prompt, output)
        rows.hashes.append(ids)
    return g


def _read_generic_jsonl(path: Path, rows: _Rows) -> int | None:
    keys = ("arrival_s", "prompt_tokens", "output_tokens")
    block: int | None = None
    with_ids: bool | None = None
    for n, obj in _json_lines(path, rows):
        try:
            try:
                raw_t = obj["arrival_s"]
                prompt = _int(obj["prompt_tokens"], "prompt_tokens", 1)
                output = _int(obj["output_tokens"], "output_tokens", 1)
            except KeyError:
                raise _BadLine(f"missing field {_missing(obj, keys)}") from None
            t = _num(raw_t, "arrival_s")
            g = _int(obj["hash_block_tokens"], "hash_block_tokens", 1) if "hash_block_tokens" in obj else None
            has = "hash_ids" in obj
            if with_ids is None:
                with_ids, block = has, g or GENERIC_BLOCK_TOKENS
            elif has != with_ids:
                raise _BadLine("give hash_ids on every line or on none" + ("" if has else " (missing here)"))
            if g is not None and g != block:
                raise _BadLine(f"hash_block_tokens {g} differs from the first line's {block}")
            assert block is not None
            ids = _ids(obj["hash_ids"], prompt, block) if has else None
        except _BadLine as exc:
            rows.bad(n, str(exc))
            continue
        rows.order(n, t, raw_t)
        rows.add(n, t, prompt, output)
        if ids is not None:
            rows.hashes.append(ids)
    return block if with_ids else None


_EPOCH_DAY = date(1970, 1, 1).toordinal()


class _AzureClock:
    """Seconds since the first row's date, from ``YYYY-MM-DD HH:MM:SS[.fff...][Z|+HH:MM]``.

    Hand-parsed: ``datetime.fromisoformat`` rejects 7 fractional digits before Python 3.11 and is no
    faster; days are cached, so a row costs a few slices and one float().
    """

    def __init__(self) -> None:
        self.days: dict[str, int] = {}
        self.base: int | None = None

    def epoch_offset_s(self) -> float:
        """Seconds from the Unix epoch to the first row's day (UTC)."""
        return 0.0 if self.base is None else float((self.base - _EPOCH_DAY) * 86400)

    def seconds(self, text: str) -> float:
        s = text.strip()
        try:
            if len(s) < 19 or s[10] not in " T" or s[13] != ":" or s[16] != ":":
                raise ValueError
            day = self.days.get(s[:10])
            if day is None:
                day = self.days[s[:10]] = date.fromisoformat(s[:10]).toordinal()
            if self.base is None:
                self.base = day
            clock = s[11:]
            offset = 0
            if clock[-1] == "Z":
                clock = clock[:-1]
            elif len(clock) > 8 and clock[-6] in "+-" and clock[-3] == ":":
                sign = 1 if clock[-6] == "+" else -1
                offset = sign * (int(clock[-5:-3]) * 3600 + int(clock[-2:]) * 60)
                clock = clock[:-6]
            h, m, sec = int(clock[0:2]), int(clock[3:5]), float(clock[6:])
            if not (0 <= h < 24 and 0 <= m < 60 and 0 <= sec < 61) or not clock[6:8].isdigit():
                raise ValueError
        except (ValueError, IndexError):
            raise _BadLine(f"unparseable timestamp {shorten(repr(text))}") from None
        t = (day - self.base) * 86400 + h * 3600 + m * 60 + sec - offset
        if abs(t) >= MAX_TIME_S:
            raise _BadLine(
                f"timestamp {shorten(repr(text))} is more than {MAX_TIME_S:.3g} s from the first row's day"
            )
        return t


def _csv_records(reader: Any, rows: _Rows) -> Iterator[list[str]]:
    """csv.reader's rows, its own errors (a field over its 128 KiB limit, a NUL byte) located."""
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            raise rows.error(reader.line_num, f"unreadable CSV ({shorten(str(exc), 80)})") from None
        yield row


def _read_csv(path: Path, rows: _Rows, fmt: str) -> None:
    t_col, p_col, o_col = _CSV_COLUMNS[fmt]
    reader = csv.reader(_open(path))
    records = _csv_records(reader, rows)
    header = next(records, None)
    shown = ",".join(_CSV_COLUMNS[fmt]) if fmt != "burstgpt" else _BURSTGPT_HEADER
    if header is None:
        raise KvsimError(f"the trace is empty; expected a header with columns {shown}", source=rows.file)
    names = [h.strip().lstrip("\ufeff") for h in header]
    missing = [c for c in (t_col, p_col, o_col) if c not in names]
    if missing:
        raise KvsimError(
            f"wrong header for format {fmt}: expected columns {shown}, got {shorten(','.join(names), 120)}",
            source=rows.file,
        )
    twice = [c for c in (t_col, p_col, o_col) if names.count(c) > 1]
    if twice:
        raise KvsimError(f"column {twice[0]!r} appears twice in the header", source=f"{rows.file}:1")
    it, ip, io = names.index(t_col), names.index(p_col), names.index(o_col)
    width = len(names)
    clock = _AzureClock() if fmt == "azure" else None
    burst = fmt == "burstgpt"
    for row in records:
        if not row:
            continue
        n = reader.line_num
        try:
            if len(row) != width:
                raise _BadLine(f"expected {width} fields, got {len(row)}")
            raw_t = row[it]
            t = clock.seconds(raw_t) if clock is not None else _num(raw_t, t_col)
            prompt = _int(row[ip], p_col, 1)
            output = _int(row[io], o_col, 0 if burst else 1)
        except _BadLine as exc:
            rows.bad(n, str(exc))
            continue
        rows.order(n, t, raw_t)
        if output == 0:  # only BurstGPT lets 0 through: its failed requests
            rows.drop(BURSTGPT_FAILED, t)
            continue
        rows.add(n, t, prompt, output)
    if clock is not None:
        rows.epoch_offset_s = clock.epoch_offset_s()


def _prefix_unique(hash_ids: list[np.ndarray]) -> list[np.ndarray]:
    """Return the ids unchanged if each id always follows the same id (then equal id => equal prefix,
    by induction along the chain); otherwise renumber every block by (parent's new id, own id)."""
    lens = np.fromiter(map(len, hash_ids), np.int64, len(hash_ids))
    if lens.sum() == 0:
        return hash_ids
    flat = np.concatenate(hash_ids)
    parent = np.empty_like(flat)
    parent[1:] = flat[:-1]
    starts = (np.cumsum(lens) - lens)[lens > 0]
    parent[starts] = np.iinfo(np.int64).min  # "no parent": a chain's first block
    if flat.min() >= 0 and flat.max() < 4 * len(flat) + 1024:
        dense = flat  # Mooncake: ids count up from 0
    else:
        dense = np.unique(flat, return_inverse=True)[1]
    seen = np.empty(int(dense.max()) + 1, np.int64)
    seen[dense] = parent  # one of each id's parents survives; any other differs from it
    if np.array_equal(seen[dense], parent):
        return hash_ids
    table: dict[tuple[int, int], int] = {}
    out = []
    for h in hash_ids:
        prev, ids = -1, []
        for x in h.tolist():
            nid = table.setdefault((prev, x), len(table))
            ids.append(nid)
            prev = nid
        out.append(np.array(ids, np.int64))
    return out


def _read_trace(cfg: WorkloadConfig) -> tuple[_Rows, int | None]:
    path = cfg.trace
    if path is None:
        raise KvsimError(f"format {cfg.format!r} needs a trace file", source="workload.trace")
    if not path.is_file():
        raise KvsimError("trace file not found", source=str(path))
    rows = _Rows(path, cfg.skip_bad_lines)
    block: int | None = None
    if cfg.format == "mooncake":
        block = _read_mooncake(path, rows)
    elif cfg.format in ("azure", "burstgpt", "vidur"):
        _read_csv(path, rows, cfg.format)
    elif cfg.format == "generic":
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            block = _read_generic_jsonl(path, rows)
        elif suffix == ".csv":
            _read_csv(path, rows, "generic")
        else:
            raise KvsimError(
                f"generic traces must end in .jsonl or .csv, got {suffix or 'no extension'!r}",
                source=str(path),
            )
    else:
        raise KvsimError(f"unknown trace format {cfg.format!r}", source="workload.format")
    if not rows.t:
        detail = f"all {rows.skipped} data lines were malformed and skipped" if rows.skipped else "no data"
        dropped = sum(len(v) for v in rows.dropped.values())
        if dropped:
            detail = f"all {dropped} requests were dropped ({', '.join(rows.dropped)})"
        raise KvsimError(f"the trace has no requests: {detail}", source=rows.file)
    return rows, block

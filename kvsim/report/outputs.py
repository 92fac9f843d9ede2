"""Where ``kvsim run``, ``kvsim report``, ``kvsim sweep`` and ``kvsim plan`` may write: checked before any work is done.

One rule for every output path: an empty path is refused (an unset shell variable would write into
the current directory); a file the run reads (scenario, trace, model config, profile) is never
written over, ``--force`` or not; a file kvsim did not write is replaced only with ``--force``;
a folder where a file goes is an error. Left out: free disk space, permissions (the write itself
reports those).
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Iterable
from pathlib import Path

from kvsim.errors import KvsimError
from kvsim.report.html import PLOTLY_JS, is_plotly_js
from kvsim.results.io import GZ, LINK_COLUMNS, REQUEST_COLUMNS, TIER_COLUMNS
from kvsim.sweep.plan import is_plan_csv, read_plan
from kvsim.sweep.table import is_results_csv, is_results_parquet, read_manifest

_HEADERS = {
    "links.csv": ",".join(LINK_COLUMNS),
    "tiers.csv": ",".join(TIER_COLUMNS),
    "requests.csv": ",".join(REQUEST_COLUMNS),
    "timeseries.csv": "t_s,replica,kv_used_blocks,kv_cached_blocks,kv_free_blocks,running,waiting",
}
# What a run directory may hold: each CSV plain (`kvsim run`) or as NAME.csv.gz (a point's), and
# `write_run` removes the form it does not write, so both are checked.
RUN_FILES = (
    "summary.json",
    *(name + form for name in _HEADERS for form in ("", GZ)),
    "report.html",
    PLOTLY_JS,
)
_MAX_SUMMARY_BYTES = 64 << 20


def is_kvsim_output(path: Path) -> bool:
    """Whether the existing file `path` (named as one of `RUN_FILES` or a sweep's files) is one
    kvsim wrote."""
    try:
        with path.open("rb") as f:
            head = f.read(4096)
        if path.name in _HEADERS:
            return head.split(b"\n", 1)[0].rstrip(b"\r").decode("utf-8") == _HEADERS[path.name]
        if path.suffix == GZ and path.stem in _HEADERS:  # a point's CSV: its first line, unpacked
            with gzip.open(path, "rb") as gz:
                first = gz.readline(4096)
            return first.rstrip(b"\r\n").decode("utf-8") == _HEADERS[path.stem]
        if path.name == PLOTLY_JS:
            return is_plotly_js(path)
        if path.name == "report.html":
            return head.startswith(b"<!doctype html>") and b"<title>kvsim: " in head
        if path.name == "sweep.html":
            return head.startswith(b"<!doctype html>") and b"<title>kvsim sweep: " in head
        if path.name == "sweep.json":
            return path.stat().st_size <= _MAX_SUMMARY_BYTES and read_manifest(path) is not None
        if path.name == "results.csv":
            return is_results_csv(path)
        if path.name == "results.parquet":
            return is_results_parquet(path)
        if path.name == "plan.html":
            return head.startswith(b"<!doctype html>") and b"<title>kvsim plan: " in head
        if path.name == "plan.json":
            return read_plan(path) is not None
        if path.name == "plan.csv":
            return is_plan_csv(path)
        if path.suffix == ".html" and head.startswith(b"<!doctype html>"):  # a comparison, any name
            return b"<title>kvsim compare: " in head
        if path.name in ("vllm_bench.json", "against.json"):  # kvsim.interop's: marked as kvsim's own
            return b'"backend": "kvsim"' in head or b'"schema": "kvsim-against"' in head
        if path.name == "summary.json":
            if path.stat().st_size > _MAX_SUMMARY_BYTES:
                return False
            data = json.loads(path.read_text(encoding="utf-8"))
            return isinstance(data, dict) and {"requests", "config", "warnings"} <= data.keys()
    except (OSError, EOFError, zlib.error, ValueError, RecursionError):  # unreadable, not gzip/UTF-8/JSON
        return False
    return False


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_output_dir(
    out: str,
    *,
    reads: Iterable[tuple[str, Path | None]],
    force: bool,
    files: Iterable[str] = RUN_FILES,
    flag: str = "--out",
) -> Path:
    """Check that `files` may be written into directory `out`, create it, and return it.

    `reads` names the files the command reads (what, path); none of them may be written over."""
    if not out.strip():
        raise KvsimError("empty path (an unset shell variable?); give a directory", source=flag)
    root = Path(out)
    if root.exists() and not root.is_dir():
        raise KvsimError(f"{out} exists and is not a directory", source=flag)
    inputs = [(what, p) for what, p in reads if p is not None]
    for name in files:
        target = root / name
        if not (target.exists() or target.is_symlink()):
            continue
        for what, p in inputs:
            if _same(target, p):
                raise KvsimError(
                    f"{target} is the {what} this command reads; choose another {flag}", source=flag
                )
        if target.is_dir():
            raise KvsimError(f"{target} is a directory, where kvsim writes a file", source=flag)
        if not force and not is_kvsim_output(target):
            raise KvsimError(
                f"{target} exists and was not written by kvsim; use --force to replace it", source=flag
            )
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KvsimError(f"cannot create {out}: {exc.strerror or exc}", source=flag) from None
    return root


def discard_if_empty(root: Path, existed: bool) -> None:
    """After a command failed: remove `root` if this command created it and left it empty, so a
    refused run leaves nothing behind (the directory is made before the work, to fail early)."""
    if existed:
        return
    try:
        root.rmdir()  # only an empty directory
    except OSError:
        pass

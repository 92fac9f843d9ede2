"""Where ``kvsim run``, ``kvsim report``, ``kvsim sweep`` and ``kvsim plan`` may write: checked before any work is done.

One rule for every output path: an empty path is refused (an unset shell variable would write into
the current directory); a file the run reads (scenario, trace, model config, profile) is never
written over, ``--force`` or not; a file kvsim did not write is replaced only with ``--force``;
a folder, FIFO, device or socket where a file goes is an error. Left out: free disk space and
permissions (the write itself reports those, as one line).

One writer per folder: `check_output_dir` takes an exclusive ``flock`` on ``DIR/.kvsim.lock``
(the pid inside, for the message) before it looks at the files, and holds it until the command
ends (`release_output_locks`). The kernel drops the lock when its process dies, SIGKILL included,
so a lock file left behind is stale by construction and taken over. Design: docs/architecture.md.
"""

from __future__ import annotations

import atexit
import errno
import gzip
import json
import os
import re
import stat
import zlib
from collections.abc import Iterable
from pathlib import Path

from kvsim.errors import KvsimError
from kvsim.report.html import PLOTLY_JS, is_plotly_js
from kvsim.results.io import GZ, LINK_COLUMNS, REQUEST_COLUMNS, TIER_COLUMNS
from kvsim.sweep.plan import is_plan_csv, read_plan
from kvsim.sweep.table import is_results_csv, is_results_parquet, read_manifest

try:
    import fcntl
except ImportError:  # no flock (Windows): folders are not locked
    fcntl = None  # type: ignore[assignment]

LOCK_FILE = ".kvsim.lock"  # kvsim's lock in an output folder: its holder's pid; removed at the end
_LOCK_TEXT = re.compile(rb"(\d{1,10}\n)?")

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
        if path.name == LOCK_FILE:
            return len(head) <= 16 and _LOCK_TEXT.fullmatch(head) is not None
        if path.name == "summary.json":
            if path.stat().st_size > _MAX_SUMMARY_BYTES:
                return False
            data = json.loads(path.read_text(encoding="utf-8"))
            return isinstance(data, dict) and {"requests", "config", "warnings"} <= data.keys()
    except (OSError, EOFError, zlib.error, ValueError, RecursionError):  # unreadable, not gzip/UTF-8/JSON
        return False
    return False


def special_file(path: Path) -> str | None:
    """What `path` is when it exists and is neither a regular file nor a directory (a FIFO, a
    device, a socket: ``a FIFO``...), else None. A symbolic link counts as what it points to."""
    try:
        mode = path.stat().st_mode
    except OSError:  # missing, or a dangling link: nothing to read
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a socket" if stat.S_ISSOCK(mode) else "a special file"


def same_file(a: Path, b: Path) -> bool:
    """Whether `a` and `b` name one file (False when either cannot be looked at)."""
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
    lock = root / LOCK_FILE
    if lock.is_symlink():  # the lock is opened without following links: one pointing anywhere is refused
        raise KvsimError(f"{lock} is a symbolic link, where kvsim keeps its lock; remove it", source=flag)
    _check_target(lock, inputs, force, flag)
    took = lock_output_dir(root, flag=flag) if root.is_dir() else False  # before reading what a writer writes
    try:
        for name in files:
            _check_target(root / name, inputs, force, flag)
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise KvsimError(f"cannot create {out}: {exc.strerror or exc}", source=flag) from None
        took = lock_output_dir(root, flag=flag) or took
    except BaseException:
        if took:
            release_output_lock(root)
        raise
    return root


def _check_target(target: Path, inputs: list[tuple[str, Path]], force: bool, flag: str) -> None:
    """Refuse to write `target` when it is an input, a folder, a special file or (without `force`)
    a file kvsim did not write."""
    if not (target.exists() or target.is_symlink()):
        return
    for what, p in inputs:
        if same_file(target, p):
            raise KvsimError(f"{target} is the {what} this command reads; choose another {flag}", source=flag)
    if target.is_dir():
        raise KvsimError(f"{target} is a directory, where kvsim writes a file", source=flag)
    special = special_file(target)
    if special:  # reading it to tell whose it is could block (a FIFO); replacing it, lose a device
        raise KvsimError(f"{target} is {special}, where kvsim writes a file; remove it", source=flag)
    if not force and not is_kvsim_output(target):
        raise KvsimError(
            f"{target} exists and was not written by kvsim; use --force to replace it", source=flag
        )


# Locks this process holds: resolved folder -> (fd, lock path, pid of the process that took it).
_HELD: dict[Path, tuple[int, Path, int]] = {}


def lock_output_dir(root: Path, *, flag: str = "--out") -> bool:
    """Take the exclusive lock of output folder `root` (``root/.kvsim.lock``, created if missing,
    this process's pid written in it) and hold it until `release_output_lock`. Whether this call
    took it: False when this process holds it already, or where nothing can be locked (no
    ``fcntl``, a read-only folder, a file system without ``flock``: the writes report their own
    errors). Another live process holding it is one line (KvsimError)."""
    if fcntl is None:
        return False
    key = root.resolve()
    if key in _HELD and _HELD[key][2] == os.getpid():
        return False
    path = key / LOCK_FILE
    flags = (
        os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    )
    while True:
        try:
            fd = os.open(path, flags, 0o644)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EISDIR):
                raise KvsimError(
                    f"{path} is not a file, where kvsim keeps its lock; remove it", source=flag
                ) from None
            return False
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise KvsimError(f"{path} is not a file, where kvsim keeps its lock; remove it", source=flag)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    return False  # ENOLCK and the like: a file system that cannot lock
                head = os.pread(fd, 16, 0)
                pid = f" (pid {int(head)})" if _LOCK_TEXT.fullmatch(head) and head else ""
                raise KvsimError(
                    f"{root}: another kvsim{pid} is writing it; wait for it to end or choose another {flag}",
                    source=flag,
                ) from None
            try:
                now = os.lstat(path)
            except OSError:
                now = None
            if now is None or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                os.close(fd)  # its holder removed it between our open and our lock: take the new one
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            try:
                os.close(fd)
            except OSError:
                pass
            raise
        _HELD[key] = (fd, path, os.getpid())
        return True


def release_output_lock(root: Path) -> None:
    """Give up this process's lock of `root`, if held, removing its lock file (removed first, so
    that a process that opened it meanwhile finds it gone and takes a new one)."""
    held = _HELD.pop(root.resolve(), None)
    if held is None:
        return
    fd, path, pid = held
    if pid == os.getpid():
        try:
            path.unlink()
        except OSError:
            pass
    try:
        os.close(fd)
    except OSError:
        pass


def release_output_locks() -> None:
    """Give up every lock this process holds (the end of a command: `kvsim.cli.main`, and at exit)."""
    for key in list(_HELD):
        release_output_lock(key)


def _forget_locks_in_child() -> None:
    """A forked worker (a sweep's, a plan's) neither holds nor releases its parent's locks: its copy
    of each descriptor is closed (the lock stays with the parent, which holds the same one)."""
    for fd, _path, _pid in _HELD.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


atexit.register(release_output_locks)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_locks_in_child)


def discard_if_empty(root: Path, existed: bool) -> None:
    """After a command failed: remove `root` if this command created it and left it empty, so a
    refused run leaves nothing behind (the directory is made before the work, to fail early)."""
    release_output_lock(root)
    if existed:
        return
    try:
        root.rmdir()  # only an empty directory
    except OSError:
        pass

"""Progress over a number of points (``sweep``, ``plan``, ``stack``), on stderr so that stdout
(tables, ``--json``) stays clean.

On a terminal (stdout and stderr both): a rich bar with points done of the total, failed and the
time left. Piped or logged: one plain line per finished point, ``point 3/40 done (kv.format=fp8):
after 12.3 s, ETA 2 min``, the elapsed time since the first point and the time left at the mean
pace so far. A total that is only a bound (a plan's bisection stops early) is written ``<=40``.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


def _duration(s: float) -> str:
    if s < 90:
        return f"{s:.1f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


class PointProgress:
    """Call `start` once the workers exist (the bar's thread must not be forked into them), `finished`
    as each point ends, `stop` at the end (also after an error). Disabled: does nothing. The ETA is
    the mean pace so far times the points left (time between batches counts: a plan's is small)."""

    def __init__(
        self,
        total: int,
        *,
        enabled: bool = True,
        bound: bool = False,
        reused: int = 0,
        stream: TextIO | None = None,
        tty: bool | None = None,
    ) -> None:
        self.total, self.bound, self.reused = total, bound, reused
        self.enabled = enabled
        self.done = self.failed = 0
        self._stream = stream
        self._tty = tty
        self._t0: float | None = None
        self._bar: Any = None
        self._task: Any = None

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr

    def _is_tty(self) -> bool:
        if self._tty is not None:
            return self._tty
        return sys.stdout.isatty() and self.stream.isatty()

    def _of(self) -> str:
        return f"{'<=' if self.bound else ''}{self.total}"

    def start(self) -> None:
        """Start the clock (once) and, on a terminal, the bar (again after `pause`)."""
        if not self.enabled:
            return
        if self._t0 is None:
            self._t0 = time.perf_counter()
        if self._bar is not None or not self._is_tty():
            return
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        reused = f", {self.reused} reused" if self.reused else ""
        self._bar = Progress(
            TextColumn("points"),
            BarColumn(),
            TextColumn("{task.completed}/{task.fields[of]}"),
            TextColumn("done, {task.fields[failed]} failed" + reused),
            TimeRemainingColumn(),
            console=Console(file=self.stream),
            transient=True,
        )
        self._bar.start()
        self._task = self._bar.add_task(
            "points", total=self.total, completed=self.done, failed=self.failed, of=self._of()
        )

    def set_total(self, total: int, *, bound: bool) -> None:
        """A new total (a plan learns how many points its bisection still needs as it goes)."""
        self.total, self.bound = max(total, self.done), bound
        if self._bar is not None:
            self._bar.update(self._task, total=self.total, of=self._of())

    def finished(self, label: str, ok: bool) -> None:
        """One point ended; `label` names it (its overrides)."""
        if not self.enabled:
            return
        if self._t0 is None:
            self.start()
        assert self._t0 is not None
        self.done += 1
        self.failed += not ok
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, failed=self.failed)
            return
        elapsed = time.perf_counter() - self._t0
        left = max(self.total - self.done, 0)
        eta = f", ETA {'<=' if self.bound else ''}{_duration(elapsed / self.done * left)}" if left else ""
        what = f" ({label})" if label else ""
        print(
            f"point {self.done}/{self._of()} {'done' if ok else 'failed'}{what}: "
            f"after {_duration(elapsed)}{eta}",
            file=self.stream,
            flush=True,
        )

    def stop(self) -> None:
        """Remove the bar (`start` draws it again: a plan pauses it while it forks the next batch's
        workers, which must not inherit its thread)."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    pause = stop

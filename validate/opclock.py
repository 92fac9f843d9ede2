"""Per-op clocks inside the serving loop's forward, for ``kvsim validate``'s per-op table.

`OpClock` is called with an op's name around each call of the forward (``with clock("gemm:qkv"):``),
the names as the simulation's ops split a step (`kvsim.costs.profile.ProfileCostModel.op_parts`);
`take` returns the step's seconds per name, summed over layers. On a CPU a span is
``time.perf_counter`` around the call; on CUDA a pair of CUDA events (the kernels' device time, read
after the step has synchronised). `NO_CLOCK`, the forward's default, times nothing.
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import Any

import torch


class _Span:
    __slots__ = ("clock", "name", "t0")

    def __init__(self, clock: OpClock, name: str) -> None:
        self.clock, self.name = clock, name
        self.t0: Any = None

    def __enter__(self) -> None:
        if self.clock.cuda:
            self.t0 = torch.cuda.Event(enable_timing=True)
            self.t0.record()
        else:
            self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        if self.clock.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.clock.spans.append((self.name, self.t0, end))
        else:
            self.clock.spans.append((self.name, self.t0, time.perf_counter()))


class OpClock:
    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.spans: list[tuple[str, Any, Any]] = []

    def __call__(self, name: str) -> _Span:
        return _Span(self, name)

    def take(self) -> dict[str, float]:
        """Seconds per op name since the last `take` (CUDA: after a synchronisation)."""
        if self.cuda and self.spans:
            torch.cuda.synchronize()
        out: dict[str, float] = {}
        for name, t0, t1 in self.spans:
            dt = t0.elapsed_time(t1) / 1e3 if self.cuda else t1 - t0
            out[name] = out.get(name, 0.0) + dt
        self.spans.clear()
        return out


class _NoSpan:
    def __enter__(self) -> None:
        return None

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        return None


class _NoClock:
    _span = _NoSpan()

    def __call__(self, name: str) -> _NoSpan:
        return self._span


NO_CLOCK: Any = _NoClock()

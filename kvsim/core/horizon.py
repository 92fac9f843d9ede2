"""The fast-forward horizon: how many decode-only steps can run as one engine event.

Inside a window nothing may happen that stepping one by one would react to. Each mechanism that
can end a window contributes a bound, and the window is their minimum:

- ``max_steps``: a cap on the window (memory of the per-step arrays);
- ``outputs``: the first request to reach its output length finishes at that step;
- ``empty_blocks`` / ``free_blocks``: the window ends before the first step whose new blocks do
  not fit (step 0's are already allocated). While a request waits that could be admitted but for
  blocks, only empty blocks count: evicting a cached entry could shorten its prefix hits and let it
  in (or keep it out) at the next step. With nothing waiting, or the running cap reached, evicting
  cached-but-free entries inside the window is safe: a batch allocation evicts the same least-
  recently-used entries that one-block-per-step allocations would (nothing is released inside a
  window, so the LRU order is fixed), and the replica applies the steps that ended before any
  instant at which the router reads its prefix cache (`Replica.num_prefix_hits`);
- ``outside_event``: the next event from outside the replica (end of the simulation now; transfer
  completions and closed-loop turns later): only steps that end strictly before it run, and at least
  one. It needs the steps' end times, so the replica applies it after pricing (`steps_before`). Arrivals are not outside events: one routed to this replica cuts its window where it lands
  (`steps_before`), and the others do not concern it.

A new mechanism starts by contributing a bound (one step is always correct), then a sharper one.
The window returns its per-step work, the cached tokens the batch attends before each step, which
the cost model prices in one vectorised call (`CostModel.decode_step_times`).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

import numpy as np

from kvsim.core.kv_cache_manager import KVCacheManager
from kvsim.core.sched.output import SchedulerOutput


@dataclass(frozen=True)
class DecodeWindow:
    num_steps: int
    num_seqs: int
    sum_ctx: np.ndarray  # (num_steps,) int64: cached tokens of all requests before step j
    bound: str  # the mechanism that set num_steps

    @property
    def tokens_attended(self) -> np.ndarray:
        """(num_steps,) tokens each step's attention reads: the cache plus the new token, per request."""
        return self.sum_ctx + self.num_seqs


def decode_window(
    out: SchedulerOutput, kv: KVCacheManager, max_steps: int, *, may_evict: bool = False
) -> DecodeWindow:
    """The longest run of decode-only steps, the scheduled one first, that no mechanism ends early.
    `may_evict`: whether the window may evict cached-but-free entries (see the module docstring)."""
    reqs = out.reqs
    k, bound = max_steps, "max_steps"
    sum_c = 0
    for r in reqs:
        left = r.output_len - r.num_generated
        if left < k:
            k, bound = left, "outputs"
        sum_c += r.num_computed
    avail = kv.num_free_blocks if may_evict else kv.num_empty_blocks
    if kv.blocks_needed_through(reqs, k - 1) > avail:
        lo, hi = 0, k - 1  # step 0 always fits (its blocks are allocated); find the last j that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if kv.blocks_needed_through(reqs, mid) <= avail:
                lo = mid
            else:
                hi = mid - 1
        k, bound = lo + 1, "free_blocks" if may_evict else "empty_blocks"
    return DecodeWindow(k, len(reqs), sum_c + np.arange(k, dtype=np.int64) * len(reqs), bound)


def steps_before(ends: list[float], t: float, k: int | None = None) -> int:
    """How many of the first `k` steps (all by default) end strictly before time `t`."""
    return bisect_left(ends, t, 0, len(ends) if k is None else k)

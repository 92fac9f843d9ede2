"""The draft's cost in speculative decoding: seconds to propose the drafts a verify step checks.

Two kinds (``scheduler.spec_decode.draft``):

- ``model``: a smaller model (a preset or config.json) on the same GPUs, priced by its own cost
  model: ``k`` passes, pass j a decode batch of the rows that draft a (j+1)-th token, each at its
  context plus the j drafts before. The draft model's per-step overhead is not charged again (its
  passes run inside the target's step), and its weights and KV are not taken from the target's
  HBM budget (not modelled: a small draft's weights are a few per cent of the target's).
- ``mtp``: an MTP or EAGLE head, a fraction of one target layer per pass (DeepSeek-V3's MTP module
  is one transformer layer; EAGLE's draft head is one decoder layer, Li et al. 2024): pass j costs
  ``layer_fraction / num_layers`` of the target's decode batch of those rows, less its overhead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from kvsim.costs.base import CostModel, ForwardBatch, StepRun


class DraftCost:
    """Seconds of the draft passes of one step's verify rows (contexts and drafts per row)."""

    def __init__(
        self,
        cost: CostModel,
        overhead_s: float | Callable[[int], float],
        *,
        scale: float = 1.0,
        kind: str = "model",
    ) -> None:
        self.cost = cost  # the draft model's cost model, or the target's for an MTP head
        # Of `cost`, not paid again per pass: seconds, or seconds for a pass of so many rows (a
        # measured profile's `step_overhead` grows with the rows, and each pass's price holds it at
        # its own rows: subtracting one row's would leave the rest charged once per pass).
        if callable(overhead_s):
            self.overhead: Callable[[int], float] = overhead_s
        else:
            fixed = float(overhead_s)
            self.overhead = lambda _rows: fixed
        self.scale = scale  # 1 for a draft model; layer_fraction / num_layers for an MTP head
        self.kind = kind

    def seconds(self, ctx: Sequence[int], drafts: Sequence[int]) -> float:
        dmax = max(drafts, default=0)
        if not dmax:
            return 0.0
        if min(drafts) == dmax:  # every row drafts alike (the common case): the passes in one call
            n, s0 = len(ctx), sum(ctx)
            sums = np.array([s0 + j * n for j in range(dmax)], dtype=np.int64)
            times = self.cost.step_times(StepRun.decode(n, sums)).tolist()  # equal to `price`, element-wise
            rows = [n] * dmax
        else:
            batches = [
                ForwardBatch.decode(tuple(c + j for c, d in zip(ctx, drafts, strict=True) if d > j))
                for j in range(dmax)
            ]
            times = [self.cost.step_time(b) for b in batches]
            rows = [len(b.kinds) for b in batches]
        t = 0.0
        for x, r in zip(times, rows, strict=True):
            t += self.scale * max(0.0, x - self.overhead(r))
        return t

"""Slow references the engine is checked against, kept beside the tests rather than in the package.

`oracle_price` prices one batch from a cost model's parts, written out directly for that batch, the
way the engine priced a single step before it had one pricing path (`StepCostModel.step_times`,
which prices fast-forward windows and single steps alike). The engine's prices must equal it float
for float: a window of k steps costs what k batches priced one by one cost.
"""

from __future__ import annotations

import numpy as np

from kvsim.costs.base import ForwardBatch, SeqKind, StepCostModel


def oracle_price(cm: StepCostModel, batch: ForwardBatch) -> float:
    """Seconds of one step: base + GEMMs + all-reduces + writes + (the prefill launch and each
    prefill or verify row's attention, last row first), then the decode rows' attention together."""
    kinds, num_new, ctx_before = batch.kinds, batch.num_new, batch.ctx_before
    total = sum(num_new)
    dec = [c for k, c in zip(kinds, ctx_before, strict=True) if k is SeqKind.DECODE]
    others = [
        (k, n, c) for k, n, c in zip(kinds, num_new, ctx_before, strict=True) if k is not SeqKind.DECODE
    ]
    prefill = cm.prefill_launch_s if others else 0.0
    for kind, n, c in reversed(others):
        prefill += cm._verify_attn_time(n, c) if kind is SeqKind.VERIFY else cm._prefill_attn_time(n, c)
    t = (
        cm._step_base(total, len(kinds), len(dec), batch.num_sampling)
        + cm._gemm_time(total, batch.num_sampling)
        + cm._comm_time(total)
        + cm._write_part(total, batch.num_switched, len(dec))
        + prefill
    )
    if dec:
        ctx = np.array([float(sum(dec))])
        sw = np.array([float(batch.switched_ctx)]) if batch.num_switched else None
        t += float(cm._decode_part(len(dec), ctx, batch.num_switched, sw)[0])
    return t

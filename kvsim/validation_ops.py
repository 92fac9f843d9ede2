"""``kvsim validate``'s per-op table: each op's time inside the real forward against its price.

The execution's per-op run (`validate.opclock`) times every call of the forward by the names the
profile's ops split a step into (`kvsim.costs.profile.ProfileCostModel.op_parts`); the loop's own
time (``step_overhead``) is the step's measured seconds less its timed ops. Each measured step is
priced op by op for its own batch composition, and per op the loop's and the profile's seconds are
summed over the run's steps: ``error`` is profile / loop - 1 (the issue's target: within
`OP_TARGET`). A step whose per-op prices sum to more than `STEP_MARGIN` away from its measured
time is counted, and a warning names how many steps did.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvsim.core.sched.output import SeqKind
from kvsim.costs.base import ForwardBatch

OP_TARGET = 0.15  # |profile / loop - 1| per op, summed over the steps
STEP_MARGIN = 0.10  # |sum of a step's per-op prices / its measured time - 1|
ORDER = (
    "gemm:qkv",
    "gemm:o",
    "gemm:gate_up",
    "gemm:down",
    "gemm:lm_head",
    "paged_decode",
    "chunked_prefill",
    "kv_write",
    "step_rest:layer",
    "step_rest:embed",
    "step_rest:sample",
    "step_overhead",
    "other",
)


def _batch(st: list[Any]) -> ForwardBatch:
    dec_ctx, pre_new, pre_ctx, n_smp = st[2], st[3], st[4], st[5]
    m = len(dec_ctx)
    return ForwardBatch(
        (SeqKind.DECODE,) * m + (SeqKind.PREFILL,) * len(pre_new),
        (1,) * m + tuple(pre_new),
        tuple(dec_ctx) + tuple(pre_ctx),
        int(n_smp),
    )


def per_op_summary(cost: Any, run: dict[str, Any] | None) -> dict[str, Any] | None:
    """Per op: the loop's and the profile's seconds summed over `run`'s steps, and the error; the
    steps whose per-op prices stray beyond `STEP_MARGIN`. None without a per-op run or a profile
    cost model that splits its prices (`op_parts`)."""
    if not run or "op_seconds" not in run or not hasattr(cost, "op_parts"):
        return None
    loop: dict[str, float] = {}
    sim: dict[str, float] = {}
    ran: dict[str, int] = {}
    stray: list[float] = []
    for st, ops in zip(run["steps"], run["op_seconds"], strict=True):
        measured = float(st[1])
        mine = dict(ops)
        mine["step_overhead"] = measured - sum(ops.values())
        parts = cost.op_parts(_batch(st))
        for name in set(mine) | set(parts):
            loop[name] = loop.get(name, 0.0) + mine.get(name, 0.0)
            sim[name] = sim.get(name, 0.0) + parts.get(name, 0.0)
            ran[name] = ran.get(name, 0) + 1
        stray.append(sum(parts.values()) / measured - 1.0)
    steps = len(run["steps"])
    rows = []
    for name in sorted(loop, key=lambda n: ORDER.index(n) if n in ORDER else len(ORDER)):
        if name == "other" and abs(sim[name]) < 1e-9 and abs(loop[name]) < 1e-9:
            continue
        err = sim[name] / loop[name] - 1.0 if loop[name] > 0 else None
        rows.append(
            {
                "op": name,
                "steps": ran[name],
                "loop_ms_per_step": 1e3 * loop[name] / steps,
                "profile_ms_per_step": 1e3 * sim[name] / steps,
                "error": err,
                "within_target": err is not None and abs(err) <= OP_TARGET,
            }
        )
    s = np.abs(np.asarray(stray))
    return {
        "steps": steps,
        "ops": rows,
        "op_target": OP_TARGET,
        "step_margin": STEP_MARGIN,
        "step_sum_error": {
            "median": float(np.median(stray)) if stray else None,
            "p90_abs": float(np.percentile(s, 90)) if stray else None,
            "beyond_margin": int((s > STEP_MARGIN).sum()),
        },
    }


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def per_op_lines(summary: dict[str, Any] | None) -> list[str]:
    """The per-op table as text lines, then its warnings."""
    if summary is None:
        return []
    head = f"{'op (per-op run)':<18} {'steps':>6} {'loop ms/step':>13} {'profile ms/step':>16} {'error':>8}"
    lines = [head, "-" * len(head)]
    for r in summary["ops"]:
        lines.append(
            f"{r['op']:<18} {r['steps']:>6} {r['loop_ms_per_step']:>13.3f} {r['profile_ms_per_step']:>16.3f} "
            f"{_pct(r['error']):>8}"
        )
    return lines + per_op_warnings(summary)


def per_op_warnings(summary: dict[str, Any]) -> list[str]:
    out = []
    se = summary["step_sum_error"]
    if se["beyond_margin"]:
        out.append(
            f"warning: the per-op prices of {se['beyond_margin']} of {summary['steps']} steps stray from "
            f"the step's measured time by more than {100 * summary['step_margin']:.0f}% (median "
            f"{_pct(se['median'])}, p90 |error| {_pct(se['p90_abs']).lstrip('+')})"
        )
    off = [
        f"{r['op']} {_pct(r['error'])}"
        for r in summary["ops"]
        if r["op"] != "other" and not r["within_target"]
    ]
    if off:
        out.append(
            f"warning: ops beyond ±{100 * summary['op_target']:.0f}% of their in-loop time: {', '.join(off)}"
        )
    return out


def per_op_markdown(summary: dict[str, Any] | None) -> str:
    """The per-op table in Markdown (appended to ``validate.md``)."""
    if summary is None:
        return ""
    out = [
        "",
        f"Per op, one run timed op by op ({summary['steps']} steps): the loop's time inside the forward "
        "against the profile's price, summed over the steps.",
        "",
        "| op | steps | loop ms/step | profile ms/step | error |",
        "|---|---|---|---|---|",
    ]
    for r in summary["ops"]:
        out.append(
            f"| {r['op']} | {r['steps']} | {r['loop_ms_per_step']:.3f} | {r['profile_ms_per_step']:.3f} | "
            f"{_pct(r['error'])} |"
        )
    return "\n".join(out + [f"\n{w}" for w in per_op_warnings(summary)]) + "\n"

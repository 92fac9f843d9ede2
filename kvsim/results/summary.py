"""Per-request records and the run summary (pure functions over finished sequences).

Definitions (also in scenarios/README.md):
- TTFT = first token - arrival; TPOT = (finish - first token) / (output tokens - 1), per request,
  requests with one output token have none; ITL = the gap before each output token after the first,
  pooled over the tokens of completed requests (vLLM bench's ITL; its mean weighs long answers more
  than TPOT's, and a request's gaps average to its TPOT); E2E = finish - arrival; queueing = first scheduled -
  arrival. Percentiles are numpy's linear interpolation over completed requests.
- Prefix hit rate (token-weighted) = sum of prompt tokens served from the prefix cache at each
  request's first admission / sum of prompt tokens of requests admitted at least once.
- Throughput = (prompt + output tokens of completed requests) / simulated seconds.
- Goodput = completed requests per second whose TTFT <= slo.ttft and TPOT <= slo.tpot.
- Cost per million tokens = (GPUs x $/GPU-hour + the other machines' $/hour, dedicated pool nodes)
  x simulated hours / (tokens / 1e6), for all tokens and for output tokens only; autoscaled
  (``cluster.autoscale``), the GPU-hours are those of the replicas up (starting, serving, draining).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np

from kvsim.core.request import Request, RequestStatus
from kvsim.results.record import Distribution, RequestCounts, SloResult, TokenCounts

QUANTILES = {"p50": 50, "p90": 90, "p99": 99, "p999": 99.9}


def percentile_key(q: float) -> str:
    """``Distribution.by_percentile``'s key of percentile `q`: p50, p99.9."""
    return f"p{q:g}"


def dist(values: np.ndarray, percentiles: tuple[float, ...] = ()) -> Distribution:
    """The fixed p50..p99.9, and `percentiles` (a user's choice) in ``by_percentile``."""
    if values.size == 0:
        return Distribution(
            mean=None,
            p50=None,
            p90=None,
            p99=None,
            p999=None,
            by_percentile=dict.fromkeys(map(percentile_key, percentiles)),
        )
    p50, p90, p99, p999 = (float(np.percentile(values, q)) for q in QUANTILES.values())
    chosen = {percentile_key(q): float(np.percentile(values, q)) for q in percentiles}
    return Distribution(mean=float(values.mean()), p50=p50, p90=p90, p99=p99, p999=p999, by_percentile=chosen)


def weighted_percentile(v: np.ndarray, cum: np.ndarray, q: float) -> float:
    """``np.percentile(x, q)`` (linear) of the sorted values `v` each repeated as `cum`'s steps say
    (`cum`: cumulative counts), float for float, without building x: the order statistics around
    (N - 1) q / 100 found in `cum`, then numpy's interpolation (`_lerp`: from the far end when the
    fraction is >= 0.5)."""
    n = int(cum[-1])
    virtual = (n - 1) * np.true_divide(q, 100)
    if virtual >= n - 1:
        return float(v[-1])
    lo = np.floor(virtual)
    a = v[np.searchsorted(cum, int(lo), side="right")]
    b = v[np.searchsorted(cum, int(lo) + 1, side="right")]
    t = virtual - lo
    diff = b - a
    return float(b - diff * (1 - t) if t >= 0.5 else a + diff * t)


def weighted_dist(
    values: np.ndarray, counts: np.ndarray, percentiles: tuple[float, ...] = (), mean: float | None = None
) -> Distribution:
    """`dist` of each value repeated its count of times (inter-token gaps a window shares); `mean`
    given: that one (ITL's, from the requests' spans, is the same however the gaps were grouped)."""
    keep = counts > 0
    if not keep.all():
        values, counts = values[keep], counts[keep]
    del keep
    if values.size == 0:
        return dist(values, percentiles)
    if mean is None:
        mean = float(np.dot(values, counts) / counts.sum())
    # Token-weighted gaps of a long run number millions: no more arrays of their size at once than
    # the inputs, the order and the two sorted ones (the cumulative counts summed in place).
    order = np.argsort(values, kind="stable")
    v, cum = values[order], counts[order]
    del order
    np.cumsum(cum, out=cum)
    p50, p90, p99, p999 = (weighted_percentile(v, cum, q) for q in QUANTILES.values())
    return Distribution(
        mean=mean,
        p50=p50,
        p90=p90,
        p99=p99,
        p999=p999,
        by_percentile={percentile_key(q): weighted_percentile(v, cum, q) for q in percentiles},
    )


def status_of(seq: Request) -> str:
    if seq.status is RequestStatus.FINISHED:
        return "completed"
    if seq.status is RequestStatus.REJECTED:
        return "rejected"
    if seq.status is RequestStatus.FAILED:
        return "failed"
    return "unfinished"


def summarize(
    seqs: list[Request],
    *,
    simulated_s: float,
    num_gpus: int,
    gpu_hour_usd: float,
    ttft_slo_s: float,
    tpot_slo_s: float,
    percentile: float,
    not_arrived: int = 0,
    other_usd_per_hour: float = 0.0,
    percentiles: tuple[float, ...] = (),
    count_failed: bool = False,
    gpu_seconds: float | None = None,
) -> dict[str, Any]:
    """The fields of `RunSummary` that derive from the requests alone, by field name.
    `other_usd_per_hour`: what the run's machines besides its GPUs cost (dedicated pool nodes),
    in the cost figures too. `count_failed`: the run had faults, so the counts name the requests
    that failed (past ``faults.max_retries``); else they have no such key. `gpu_seconds`: the GPUs
    billed, integrated over the run (an autoscaled run's replicas up); None: `num_gpus` throughout."""
    done = [s for s in seqs if s.status is RequestStatus.FINISHED]
    rejected = [s for s in seqs if s.status is RequestStatus.REJECTED]
    failed = sum(1 for s in seqs if s.status is RequestStatus.FAILED) if count_failed else 0
    arr = np.array([s.arrival_s for s in done])
    first = np.array([s.first_token_s for s in done])
    fin = np.array([s.finish_s for s in done])
    sched = np.array([s.first_scheduled_s for s in done])
    out_tok = np.array([s.output_len for s in done], dtype=np.int64)
    in_tok = np.array([s.prompt_len for s in done], dtype=np.int64)
    ttft = first - arr
    multi = out_tok > 1
    tpot_all = np.full(len(done), np.nan)
    tpot_all[multi] = (fin[multi] - first[multi]) / (out_tok[multi] - 1)
    tpot = tpot_all[multi]
    e2e = fin - arr
    queue = sched - arr
    tokens = int(in_tok.sum() + out_tok.sum())
    out_tokens = int(out_tok.sum())
    span = max(simulated_s, 1e-12)
    good = (ttft <= ttft_slo_s) & ((tpot_all <= tpot_slo_s) | ~multi)
    admitted = [s for s in seqs if s.num_cached_tokens >= 0]
    hit_tokens = sum(s.num_cached_tokens for s in admitted)
    prompt_tokens = sum(s.prompt_len for s in admitted)
    gpu_hours = (num_gpus * simulated_s if gpu_seconds is None else gpu_seconds) / 3600.0
    cost = gpu_hours * gpu_hour_usd
    if other_usd_per_hour:
        cost += simulated_s / 3600.0 * other_usd_per_hour
    ttft_p = float(np.percentile(ttft, percentile)) if ttft.size else math.inf
    tpot_p = float(np.percentile(tpot, percentile)) if tpot.size else 0.0
    return {
        "requests": RequestCounts(
            total=len(seqs),
            completed=len(done),
            rejected=len(rejected),
            unfinished=len(seqs) - len(done) - len(rejected) - failed,
            rejected_reasons=dict(sorted(Counter(s.reason for s in rejected).items())),
            not_arrived=not_arrived,
            failed=failed if count_failed else None,
        ),
        "ttft_s": dist(ttft, percentiles),
        "tpot_s": dist(tpot, percentiles),
        "e2e_s": dist(e2e, percentiles),
        "queue_s": dist(queue, percentiles),
        "throughput_tok_s": tokens / span,
        "output_throughput_tok_s": out_tokens / span,
        "goodput_req_s": float(good.sum()) / span,
        "slo": SloResult(
            ttft_s=ttft_slo_s,
            tpot_s=tpot_slo_s,
            percentile=percentile,
            ttft_at_percentile_s=ttft_p if ttft.size else None,
            tpot_at_percentile_s=tpot_p if tpot.size else None,
            ttft_met=bool(ttft.size and ttft_p <= ttft_slo_s and len(done) == len(seqs)),
            tpot_met=bool(tpot_p <= tpot_slo_s and len(done) == len(seqs)),
            good_fraction=float(good.sum()) / max(1, len(seqs)),
        ),
        "prefix_hit_rate": hit_tokens / prompt_tokens if prompt_tokens else 0.0,
        "preemptions": int(sum(s.preemptions for s in seqs)),
        "tokens": TokenCounts(prompt=int(in_tok.sum()), output=out_tokens),
        "gpu_hours": gpu_hours,
        "cost_usd": cost,
        "cost_per_mtok_usd": cost / (tokens / 1e6) if tokens else None,
        "cost_per_output_mtok_usd": cost / (out_tokens / 1e6) if out_tokens else None,
    }

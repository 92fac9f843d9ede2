"""``kvsim stack --claims``: the design documents' concrete selection rules, each checked by runs of
the scenario's own model and trace (`kvsim.stack`'s rows as the baseline), with a verdict (holds /
does not hold / not checkable here) that follows from the runs' numbers by a pure function."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvsim.core.request import Request
from kvsim.run import run_scenario
from kvsim.spec.formats import make_format
from kvsim.spec.offload import OffloadWrite
from kvsim.spec.scenario import EvictionConfig, EvictionPolicy, PagePolicy, PrefixCacheScope, Scenario

MAX_REQUESTS = 200  # each claim's runs replay the scenario's first 200 requests, for speed
HOLDS, FAILS, UNCHECKED = "holds", "does not hold", "not checkable here"
GAIN = 0.01  # a technique "pays off" when it lowers the compared metric by more than 1%
CONCURRENCY = 32
SWITCH_TOKENS = 500_000
LONG_MEAN_TOKENS = 128 * 1024
COLD_SHARE = 0.10


@dataclass(frozen=True)
class ClaimRun:
    """One run behind a verdict: what it changed from the scenario and the numbers compared."""

    label: str
    settings: str
    metrics: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Claim:
    key: str
    rule: str  # the documents' rule, in English
    source: str  # document and section
    metric: str  # what is compared, and the threshold
    verdict: str
    why: str
    runs: list[ClaimRun] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Pure verdicts: numbers in, (verdict, why) out. Tests flip the numbers and see the verdict flip.


def h2o_verdict(points: list[tuple[int, float, float]]) -> tuple[str, str]:
    """`points`: (peak concurrent sequences, cost/Mtok without H2O, with H2O). The rule holds when
    H2O pays off (cost down by more than `GAIN`) exactly at the points above `CONCURRENCY`."""
    lo = [p for p in points if p[0] <= CONCURRENCY]
    hi = [p for p in points if p[0] > CONCURRENCY]
    if not lo or not hi:
        peaks = ", ".join(str(p[0]) for p in points)
        why = f"the runs' peak concurrency ({peaks}) is not on both sides of {CONCURRENCY}"
        return UNCHECKED, why + " (a higher workload.rate_scale, --set, may reach it)"
    bad = [p for p in points if (p[2] < p[1] * (1 - GAIN)) != (p[0] > CONCURRENCY)]
    if not bad:
        return (
            HOLDS,
            f"H2O lowers cost by more than {GAIN:.0%} above {CONCURRENCY} sequences, not at or below",
        )
    n, a, b = bad[0]
    side = "above" if n > CONCURRENCY else "at or below"
    change = f"{b / a - 1:+.1%}" if a else "n/a"
    return FAILS, f"at {n} concurrent sequences ({side} {CONCURRENCY}) H2O changes cost by {change}"


def switch_verdict(context: int, fp8_tokens: int, q4_tokens: int) -> tuple[str, str]:
    """One replica's KV pool, in tokens of one sequence, in FP8 and in 4-bit; the model's context.
    The rule holds when FP8 holds a `SWITCH_TOKENS` sequence but not the longest the model serves
    (up to 1M), and 4-bit holds that one."""
    if context <= SWITCH_TOKENS:
        return UNCHECKED, f"the model's context is {context:,} tokens: no sequence is above {SWITCH_TOKENS:,}"
    top = min(context, 2 * SWITCH_TOKENS)
    if fp8_tokens < SWITCH_TOKENS:
        return FAILS, f"FP8's pool holds {fp8_tokens:,} tokens: below {SWITCH_TOKENS:,}, FP8 is not enough"
    if fp8_tokens >= top:
        return FAILS, f"FP8's pool holds {fp8_tokens:,} tokens: a {top:,}-token sequence needs no 4-bit"
    if q4_tokens < top:
        return FAILS, f"4-bit's pool holds {q4_tokens:,} tokens: a {top:,}-token sequence fits neither"
    return HOLDS, f"FP8 holds {SWITCH_TOKENS:,} tokens, not {top:,}; 4-bit holds {top:,}"


def offload_verdict(blocks_without: float, blocks_with: float) -> tuple[str, str]:
    """KV blocks in HBM at peak without and with the host tier: the rule holds when offload moves
    at least the coldest `COLD_SHARE` of them off HBM."""
    if blocks_without <= 0:
        return UNCHECKED, "no KV blocks in HBM at peak"
    cut = 1 - blocks_with / blocks_without
    v = HOLDS if blocks_with <= blocks_without * (1 - COLD_SHARE) + 1e-9 else FAILS
    return v, f"offload cuts HBM's KV blocks at peak by {cut:.1%} (the rule moves {COLD_SHARE:.0%})"


def block_verdict(mean_tokens: float, tpot16: float | None, tpot32: float | None) -> tuple[str, str]:
    """The trace's mean sequence length; TPOT p99 at block size 16 and 32 (None: not run). The rule
    (32 above a 128K mean) holds when 32 is faster there."""
    if mean_tokens < LONG_MEAN_TOKENS or tpot16 is None or tpot32 is None:
        return (
            UNCHECKED,
            f"the trace's mean sequence is {mean_tokens:,.0f} tokens, below {LONG_MEAN_TOKENS:,}",
        )
    v = HOLDS if tpot32 < tpot16 else FAILS
    return v, f"TPOT p99 {tpot32 * 1e3:.2f} ms at 32 vs {tpot16 * 1e3:.2f} ms at 16"


# The runs.


def _capped(sc: Scenario) -> Scenario:
    wl = sc.workload
    cap = MAX_REQUESTS if wl.max_requests is None else min(wl.max_requests, MAX_REQUESTS)
    syn = wl.synthetic
    if syn is not None:
        syn = dataclasses.replace(syn, num_requests=min(syn.num_requests, cap))
    return dataclasses.replace(sc, workload=dataclasses.replace(wl, max_requests=cap, synthetic=syn))


def peak_concurrency(seqs: list[Request]) -> int:
    """Most sequences between first scheduled and finish at once, across the cluster (preemptions
    not subtracted)."""
    ev = []
    for r in seqs:
        if r.first_scheduled_s == r.first_scheduled_s and r.finish_s == r.finish_s:  # not NaN
            ev += [(r.first_scheduled_s, 1), (r.finish_s, -1)]
    n = peak = 0
    for _, d in sorted(ev, key=lambda e: (e[0], e[1])):
        n += d
        peak = max(peak, n)
    return peak


def _metrics(res: Any) -> dict[str, float]:
    s = res.summary
    return {
        "peak_concurrent_sequences": peak_concurrency(res.seqs),
        "completed": s["requests"]["completed"],
        "cost_per_mtok_usd": s["cost_per_mtok_usd"],
        "tpot_p99_s": s["tpot_s"]["p99"],
        "kv_peak_used_blocks": s["kv_peak_used_blocks"],
        "kv_tokens_per_replica": s["kv_tokens_per_replica"],
    }


def check_claims(sc: Scenario, *, progress: Callable[[str], None] | None = None) -> list[Claim]:
    """Each rule checked on `sc` capped to `MAX_REQUESTS` requests; the base is `kvsim stack`'s
    row 3 (FP8 KV, prefix cache, no eviction, no format switch) with the scenario's
    ``scheduler.max_num_seqs`` (64 where that is 32 or less, to reach above 32)."""
    fp8, _ = make_format("fp8")
    q4, _ = make_format("kvquant4")
    cap = _capped(sc)
    kv = dataclasses.replace(
        cap.kv,
        format=fp8,
        format_note=None,
        format_mix=None,
        format_switch=None,
        prefix_cache=PrefixCacheScope.LOCAL,
        eviction=EvictionConfig(),
    )
    h2o = EvictionConfig(
        policy=EvictionPolicy.H2O, heavy_ratio=0.2, recent_tokens=0, pages=PagePolicy.PHYSICAL
    )
    hi = sc.scheduler.max_num_seqs if sc.scheduler.max_num_seqs > CONCURRENCY else 2 * CONCURRENCY
    windowed = bool(sc.model.windowed_kv_layers())
    cache: dict[str, Any] = {}
    first = f"the scenario's first {MAX_REQUESTS} requests, FP8 KV, prefix cache"

    def run(label: str, settings: str, s: Scenario) -> ClaimRun:
        if label not in cache:
            if progress is not None:
                progress(label)
            cache[label] = run_scenario(s)
        return ClaimRun(label, settings, _metrics(cache[label]))

    def with_kv(s: Scenario, **kw: Any) -> Scenario:
        return dataclasses.replace(s, kv=dataclasses.replace(s.kv, **kw))

    def seqs(k: int) -> Scenario:
        s = dataclasses.replace(cap, kv=kv)
        return dataclasses.replace(s, scheduler=dataclasses.replace(s.scheduler, max_num_seqs=k))

    def plain(k: int) -> ClaimRun:
        return run(f"FP8 + cache, max_num_seqs {k}", f"{first}; scheduler.max_num_seqs {k}", seqs(k))

    def evicting(k: int) -> ClaimRun:
        s = with_kv(seqs(k), eviction=h2o)
        return run(f"+ H2O, max_num_seqs {k}", "as above, H2O heavy_ratio 0.2, physical release", s)

    claims: list[Claim] = []
    # 1. H2O only above 32 concurrent sequences (000, section 8).
    rule = "H2O pays off only above 32 concurrent sequences"
    src = "000, section 8, selection advice"
    metric = f"cost per million tokens without vs with H2O (20% kept); pays off: over {GAIN:.0%} lower"
    if windowed:
        why = f"{sc.model.name}'s sliding-window layers: H2O is not simulated with them"
        claims.append(Claim("h2o_32", rule, src, metric, UNCHECKED, why))
    else:
        rs, pts = [], []
        for k in (CONCURRENCY // 2, hi):
            a, b = plain(k), evicting(k)
            rs += [a, b]
            n = int(a.metrics["peak_concurrent_sequences"])
            pts.append((n, a.metrics["cost_per_mtok_usd"], b.metrics["cost_per_mtok_usd"]))
        claims.append(Claim("h2o_32", rule, src, metric, *h2o_verdict(pts), rs))
    # 2. FP8 below 500K tokens, 4-bit above (000, section 7.3).
    one = seqs(hi)
    wl = dataclasses.replace(one.workload, max_requests=1)
    if wl.synthetic is not None:
        wl = dataclasses.replace(wl, synthetic=dataclasses.replace(wl.synthetic, num_requests=1))
    one = dataclasses.replace(one, workload=wl)
    a = run("FP8 pool", "one request, FP8 KV: the KV pool in tokens", one)
    b = run(
        "4-bit pool",
        "one request, kvquant4 (the documents' TurboQuant, 1% outliers)",
        with_kv(one, format=q4),
    )
    pool = (int(a.metrics["kv_tokens_per_replica"]), int(b.metrics["kv_tokens_per_replica"]))
    claims.append(
        Claim(
            "fp8_4bit_500k",
            "FP8 below 500K tokens, 4-bit (1% FP16 outliers) above",
            "000, section 7.3",
            "tokens one replica's KV pool holds, FP8 vs 4-bit, against the model's context",
            *switch_verdict(sc.model.max_context, *pool),
            [a, b],
        )
    )
    # 3. Offload the coldest 10% (000, section 7.1), on stack row 4 (row 3 with windows).
    row = seqs(hi) if windowed else with_kv(seqs(hi), eviction=h2o)
    a = plain(hi) if windowed else evicting(hi)
    off = dataclasses.replace(row.kv.offload, enabled=True, hbm_ratio=2.0, write=OffloadWrite.BACK)
    b = run(
        f"+ offload, max_num_seqs {hi}",
        "as above, host DRAM 2x the HBM pool, write-back",
        with_kv(row, offload=off),
    )
    claims.append(
        Claim(
            "offload_10pct",
            "offload the coldest 10% of blocks to CPU DRAM",
            "000, section 7.1",
            (
                "KV blocks in HBM at peak without vs with the host tier; holds: at least 10% fewer "
                "(kvsim's tier takes released prefixes: a running sequence reads all its blocks each step)"
            ),
            *offload_verdict(a.metrics["kv_peak_used_blocks"], b.metrics["kv_peak_used_blocks"]),
            [a, b],
        )
    )
    # 4. Block size 32 when the mean sequence is above 128K (000, section 7.3).
    base = plain(hi)
    r0 = cache[base.label]
    tok = r0.summary["tokens"]
    mean = (tok["prompt"] + tok["output"]) / max(1, len(r0.seqs))
    rs4 = [base]
    t16 = t32 = None
    if mean >= LONG_MEAN_TOKENS:
        x = run("block 16", f"{first}; kv.block_size 16", with_kv(seqs(hi), block_size=16))
        y = run("block 32", f"{first}; kv.block_size 32", with_kv(seqs(hi), block_size=32))
        rs4, t16, t32 = [base, x, y], x.metrics["tpot_p99_s"], y.metrics["tpot_p99_s"]
    claims.append(
        Claim(
            "block_32_128k",
            "block size 32 when the mean sequence is above 128K tokens",
            "000, section 7.3",
            "TPOT p99 at block size 16 vs 32 (the mean from the base run's tokens)",
            *block_verdict(mean, t16, t32),
            rs4,
        )
    )
    # 5. The accuracy rule: kvsim cites estimates; it does not measure accuracy.
    claims.append(
        Claim(
            "h2o_ruler",
            "H2O keeping under 10% loses over 2% RULER-1M accuracy",
            "000, section 7.3",
            "accuracy",
            UNCHECKED,
            "kvsim simulates time and memory; accuracy is a cited estimate, never run",
        )
    )
    return claims

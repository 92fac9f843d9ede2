"""Terminal rendering with rich: the kv-size table and the run summary. No numbers computed here."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from kvsim.kvsize import GPUMemoryRow, KVSizeRow
from kvsim.results.record import AutoscaleRecord, FaultsRecord, RunSummary
from kvsim.spec.hardware import GPUSpec
from kvsim.spec.models import ModelSpec

MAX_REPLICA_LINES = 8  # more replicas than this: the per-replica table is in report.html only
PIPED_WIDTH = 400  # columns when stdout is not a terminal: tables whole, not cut to 80


def console() -> Console:
    """A rich console: the terminal's width on a terminal; piped, wide enough that no table is cut
    (rich would assume 80 columns and truncate cells)."""
    return Console(width=None if sys.stdout.isatty() else PIPED_WIDTH)


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB"


def print_gpu_memory(layout: str, rows: list[GPUMemoryRow]) -> None:
    """`kvsim kv-size --attention/--ep`: one GPU's weights and KV under the layout."""
    t = Table(title=f"one GPU under {layout}", title_justify="left")
    for col in ("format", "context", "weights per GPU", "KV per GPU", "weights + KV", "HBM", "fits"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            r.format,
            f"{r.context:,}",
            _gb(r.weight_bytes_per_gpu),
            _gb(r.kv_bytes_per_gpu),
            _gb(r.memory_needed_bytes_per_gpu),
            _gb(r.hbm_bytes_per_gpu),
            "[green]yes[/]" if r.fits else "[red]no[/]",
        )
    console().print(t)


def print_kv_size(
    model: ModelSpec,
    gpu: GPUSpec,
    num_gpus: int,
    rows: list[KVSizeRow],
    notes: list[str],
    accuracy: list[dict[str, Any]] | None = None,
) -> None:
    con = console()
    title = (
        f"{model.name}: {model.attention.value.upper()}, {model.num_layers} layers, "
        f"{model.num_kv_heads} KV heads x {model.kv_vector_dim}; weights {_gb(model.weight_bytes)} "
        f"({model.num_params / 1e9:.1f}B params"
        + (f", {model.num_active_params / 1e9:.1f}B active" if model.is_moe else "")
        + f"); {num_gpus} x {gpu.name} = {_gb(gpu.hbm_bytes * num_gpus)}"
    )
    t = Table(title=title, title_justify="left")
    for col in (
        "format",
        "context",
        "bytes/token",
        "KV per sequence",
        f"KV x batch {rows[0].batch}",
        "weights + KV",
        "per GPU (TP)",
        "fits",
        "vs fp16",
    ):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            r.format,
            f"{r.context:,}",
            f"{r.bytes_per_token:,}",
            _gb(r.kv_bytes_per_sequence),
            _gb(r.total_bytes),
            _gb(r.memory_needed_bytes),
            f"{_gb(r.memory_needed_per_gpu_bytes)} of {_gb(gpu.hbm_bytes)}",
            "[green]yes[/]" if r.fits else "[red]no[/]",
            f"{r.compression_vs_fp16:.2f}x",
        )
    con.print(t)
    for n in notes:
        con.print(f"note: {n}")
    if accuracy:
        con.print("accuracy of lossy formats (estimates: a simulator cannot measure model quality):")
    for a in accuracy or []:
        rms = a["kernel_rel_rms"]
        measured = (
            f"attention-output rel. RMS {rms:.3f} on synthetic K/V with outliers" if rms is not None else ""
        )
        cited = "; ".join(f"{c['claim']} ({c['source']})" for c in a["literature"])
        con.print(f"  {a['format']}: " + "; ".join(x for x in (measured, cited) if x))


def slo_lines(summary: RunSummary) -> list[str]:
    """Whether each SLO was met, one line each: the first thing the terminal summary says."""
    slo, req = summary.slo, summary.requests
    pct = f"p{slo.percentile:g}"
    short = (
        ""
        if req.completed == req.total
        else f" ({req.total - req.completed:,} of {req.total:,} requests not completed)"
    )
    out: list[str] = []
    for name, target, at, met in (
        ("TTFT", slo.ttft_s, slo.ttft_at_percentile_s, slo.ttft_met),
        ("TPOT", slo.tpot_s, slo.tpot_at_percentile_s, slo.tpot_met),
    ):
        verdict = "met" if met else "MISSED"
        out.append(f"SLO {name} {pct} <= {_ms(target)}: {verdict} ({pct} {_ms(at)}){'' if met else short}")
    out.append(f"requests meeting both SLOs: {slo.good_fraction:.1%} of those that arrived")
    return out


def print_summary(summary: RunSummary) -> None:
    con = console()
    req = summary.requests
    for line in slo_lines(summary):
        con.print(line.replace("MISSED", "[red]MISSED[/]").replace(": met", ": [green]met[/]"))
    t = Table(title=f"kvsim run: {summary.scenario}", title_justify="left")
    t.add_column("metric")
    keys = [f"p{q:g}" for q in summary.percentiles] or ["p50", "p90", "p99"]  # --percentiles
    for k in keys:
        t.add_column(k, justify="right")
    rows = [
        (summary.ttft_s, "TTFT"),
        (summary.tpot_s, "TPOT (per request)"),
        (summary.itl_s, "ITL (per token)"),
        (summary.e2e_s, "E2E"),
        (summary.queue_s, "queueing"),
    ]
    for d, label in rows:
        if d is not None:  # ITL: None in a summary written before it existed
            vals = [d.by_percentile.get(k) for k in keys] if summary.percentiles else [d.p50, d.p90, d.p99]
            t.add_row(label, *map(_ms, vals))
    con.print(t)
    con.print(
        f"requests: {req.total:,} arrived, {req.completed:,} completed, {req.rejected:,} rejected, "
        + (f"{req.failed:,} failed, " if req.failed is not None else "")
        + f"{req.unfinished:,} unfinished"
    )
    if summary.faults is not None:
        con.print(faults_line(summary.faults))
    if summary.autoscale is not None:
        con.print(autoscale_line(summary.autoscale))
    busy = summary.replica_busy_fraction
    con.print(
        f"throughput {summary.throughput_tok_s:,.0f} tok/s (output {summary.output_throughput_tok_s:,.0f}); "
        f"goodput {summary.goodput_req_s:.2f} req/s; prefix hit rate {summary.prefix_hit_rate:.1%}; "
        f"preemptions {summary.preemptions:,}"
        + (f"; replicas busy {busy.mean:.0%}" if busy is not None else "")
    )
    con.print(
        f"KV blocks per replica {summary.kv_blocks_per_replica:,}; HBM peak {summary.hbm_peak_bytes / 2**30:,.1f} GiB; "
        f"cost {_usd(summary.cost_per_mtok_usd)}/M tokens ({_usd(summary.cost_per_output_mtok_usd)}/M output)"
    )
    if 1 < len(summary.replicas) <= MAX_REPLICA_LINES:
        for r in summary.replicas:
            con.print(
                f"  replica {r.index}: {r.requests:,} req, busy {r.busy_fraction:.0%}, KV peak "
                f"{r.kv_peak_used_blocks:,} / mean {r.kv_mean_used_blocks:,.0f} blocks, {r.preemptions:,} preempted"
            )
    pd = summary.disaggregation
    if pd is not None:
        for role in pd.roles:
            con.print(
                f"{role.role} pool: {role.replicas} x {role.gpu} TP {role.tensor_parallel} at "
                f"{_usd(role.gpu_hour_usd)}/GPU-h ({_usd(role.cost_usd)}), {role.requests:,} req, busy "
                f"{role.busy_fraction.mean:.0%}, KV peak {role.kv_peak_used_blocks:,} of {role.kv_blocks_per_replica:,} blocks"
            )
        con.print(
            f"KV transfers {pd.transfers:,} ({pd.transferred_bytes / 1e9:,.1f} GB): transfer mean "
            f"{_ms(pd.transfer_s.mean)} / p99 {_ms(pd.transfer_s.p99)}; hand-off (prefill end to KV landed, "
            f"in TTFT) mean {_ms(pd.handoff_s.mean)} / p99 {_ms(pd.handoff_s.p99)}"
        )
    tiers = _tiers_line(summary)
    if tiers:
        con.print(tiers)
    ev = summary.eviction
    if ev is not None:
        con.print(
            f"eviction {ev.policy} ({ev.trigger}, {ev.pages} pages): {ev.tokens_evicted:,} tokens evicted, "
            f"{ev.trims:,} trims ({ev.trim_s * 1e3:,.1f} ms), {ev.blocks_released:,} blocks released, "
            f"{ev.cache_entries_invalidated:,} prefix entries invalidated"
        )
    win = summary.sliding_window
    if win is not None:
        con.print(
            f"sliding window {win.window_tokens:,} tokens on {win.windowed_kv_layers} of {win.kv_layers} KV "
            f"layers: {win.blocks_freed:,} blocks freed, {win.cache_entries_invalidated:,} prefix entries given up"
        )
    fs = summary.format_switch
    if fs is not None:
        con.print(
            f"format switch to {fs.format} after {fs.after_tokens:,} tokens: {fs.requests_switched:,} requests, "
            f"{fs.tokens_requantized:,} tokens re-quantized ({fs.requant_s * 1e3:,.1f} ms), "
            f"{fs.blocks_freed:,} blocks freed"
        )
    notes = [
        a
        for a in (
            summary.accuracy,
            None if ev is None else ev.accuracy,
            None if fs is None else fs.accuracy,
        )
        if a is not None
    ]
    for a in notes:
        cited = "; ".join(f"{c.claim} ({c.source})" for c in a.literature)
        rms = (
            f"kernel attention-output rel. RMS {a.kernel_rel_rms:.3f}; "
            if a.kernel_rel_rms is not None
            else ""
        )
        why = f" ({a.note})" if a.note and fs is not None and a is fs.accuracy else ""
        con.print(f"accuracy estimate (cited, not simulated) for {a.format}{why}: {rms}{cited}")
    con.print(
        f"simulated {summary.simulated_s:,.1f} s in {summary.wall_s:.2f} s wall "
        f"({summary.simulated_s / max(summary.wall_s, 1e-9):,.0f}x real time)"
    )
    for w in summary.warnings:
        con.print(f"[yellow]warning:[/] {w}")


def _tiers_line(summary: RunSummary) -> str:
    """Prefix hits per tier and waits for KV, when a tier below HBM or swap is on (else empty)."""
    off, pool, swap = summary.offload, summary.global_pool, summary.swap
    parts = []
    if off is not None or pool is not None:
        lower = (off.hit_rate_dram + off.hit_rate_ssd if off else 0.0) + (
            pool.hit_rate_global if pool else 0.0
        )
        hits = [f"HBM {summary.prefix_hit_rate - lower:.1%}"]
        if off is not None:
            hits.append(f"DRAM {off.hit_rate_dram:.1%}")
            if off.ssd_capacity_bytes:
                hits.append(f"SSD {off.hit_rate_ssd:.1%}")
        if pool is not None:
            hits.append(f"global pool {pool.hit_rate_global:.1%}")
        parts.append("prefix hits " + ", ".join(hits))
    if off is not None and off.requests_waited:
        p50 = off.kv_wait_s.p50 or 0.0
        parts.append(f"{off.requests_waited:,} requests waited for KV (p50 {p50 * 1e3:,.1f} ms)")
    if swap is not None:
        parts.append(f"{swap.swaps:,} swaps, {swap.recomputes:,} recomputes")
    return "; ".join(parts)


def _usd(v: float | None) -> str:
    return "-" if v is None else f"${v:.3f}"  # None: no token completed, no cost per token


def _ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1e3:,.1f} ms"


def print_plan(data: dict[str, Any]) -> None:
    from kvsim.accuracy import loss_text

    """The terminal summary of ``kvsim plan``: the choice or the closest miss, the nearest runners-up."""
    slos = ", ".join(s["text"] for s in data["slos"])
    loads = ", ".join(data["loads"])
    ran, reused = data.get("points_run", 0), data.get("points_reused", 0)
    n = len(data["configurations"])
    print(f"{n} configurations evaluated; {ran} points run, {reused} reused from an earlier run")
    for note in data.get("notes", []):
        print(f"note: {note}")
    for warning in data.get("warnings", []):
        print(f"warning: {warning}")
    choice = data["choice"]
    budget = data.get("max_accuracy_loss")
    within = "" if budget is None else f" within the accuracy budget {budget:.2%}"
    if data.get("budget_excluded"):
        print(f"note: {data['budget_excluded']['text']}")
    if choice is None:
        print(f"no configuration in the search meets {slos} at {loads}{within}")
        closest = data.get("closest")
        if closest is not None:
            print(
                f"closest: {closest['label']} ({closest['gpus']} GPUs, ${closest['usd_per_hour']:.2f}/h): {closest['why']}"
            )
        return
    print(
        f"choice: {choice['label']}: {choice['gpus']} GPU{'s' if choice['gpus'] != 1 else ''}, ${choice['usd_per_hour']:.2f}/h; "
        f"meets {slos} at {loads}{within}"
        + (
            f"; accuracy estimate {loss_text(choice['accuracy'])} (cited, not measured)"
            if (choice.get("accuracy") or {}).get("parts")
            else ""
        )
    )
    for e in data["runners_up"][:3]:
        print(f"  runner-up: {e['label']} (${e['usd_per_hour']:.2f}/h): {e['why']}")


def autoscale_line(a: AutoscaleRecord) -> str:
    """One line of what ``cluster.autoscale`` did: its rule, the replicas it ran, what they cost."""
    u = a.replicas_up
    return (
        f"autoscale: {a.policy} at {a.target:g}; {a.scale_ups:,} started (serving {a.scale_up_delay_s:,.1f} s later), "
        f"{a.scale_downs:,} drained; replicas up {u.min}-{u.max}, mean {u.mean:.2f} of {a.max_replicas}; "
        f"billed {a.replica_s / 3600.0:,.3f} replica-hours"
    )


def faults_line(f: FaultsRecord) -> str:
    """One line of what a run's faults cost (``faults``)."""
    r = f.random
    drawn = (
        ""
        if r is None
        else f" ({r.drawn:,} {r.kind} drawn at {r.rate_per_hour:g}/h per component, {r.expected:,.1f} expected)"
    )
    return (
        f"faults: {len(f.outages)} outages{drawn}, {f.replica_down_s:,.1f} replica-s down (reload {f.reload_s:.2f} s "
        f"each at {f.reload_bw_bytes_per_s / 1e9:,.1f} GB/s); {f.retries:,} retries, {f.failed:,} failed; "
        f"recomputed {f.recomputed_tokens:,} tokens ({f.lost_prompt_tokens:,} prompt, "
        f"{f.lost_output_tokens:,} output); {f.kv_blocks_lost:,} KV blocks lost"
    )

"""The report's text: value formatting and the HTML tables and sections built from summary.json."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

from markupsafe import Markup

from kvsim.report import html as h
from kvsim.report.data import _Csv
from kvsim.results.record import Distribution, RunSummary


def _get(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _dur(v: Any) -> str:
    """Seconds, shown as ms below one second (TTFT/TPOT live there), else as seconds."""
    if not _is_num(v):
        return "–"
    if abs(v) < 1.0:
        return f"{v * 1e3:,.1f} ms"
    return f"{v:,.2f} s"


def _int(v: Any) -> str:
    return f"{int(v):,}" if _is_num(v) else "–"


def _float(v: Any, fmt: str = ",.1f", unit: str = "") -> str:
    return f"{v:{fmt}}{unit}" if _is_num(v) else "–"


def _pct(v: Any) -> str:
    return f"{v:.1%}" if _is_num(v) else "–"


def _gib(v: Any) -> str:
    return f"{v / 2**30:,.1f} GiB" if _is_num(v) else "–"


def _usd(v: Any) -> str:
    return f"${v:,.3f}" if _is_num(v) else "–"


def _percentile_label(v: Any) -> str:
    if _is_num(v):
        return f"p{v * 100:g}" if v <= 1 else f"p{v:g}"
    return str(v) if v is not None else "–"


def _plural(n: Any, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _met(v: Any) -> Markup | str:
    if v is True:
        return h.span("met", "ok")
    if v is False:
        return h.span("missed", "bad")
    return "–"


def _plain(v: Any, depth: int = 0) -> Markup | str:
    """Any JSON value as short text (config and unknown summary fields); a dict as lines."""
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int | float):
        return _float(v, ",.6g")
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and v and depth == 0:  # one level of nesting reads better as lines
        return h.lines(h.join((str(k), ": ", _plain(x, depth + 1))) for k, x in v.items())
    if isinstance(v, list) and not v:
        return "none"
    text = json.dumps(v, sort_keys=True, separators=(",", ": "))
    if len(text) > 300:
        text = text[:297] + "..."
    return text


def _table(rows: Iterable[Iterable[Any]], header: Iterable[Any] | None = None, cls: str = "") -> Markup:
    """Cells are text (escaped) or Markup."""
    return h.table(rows, header, cls)


def _note(text: Any) -> Markup:
    return h.note(text)


# -------------------------------------------------------------------------------------- sections

_KNOWN_KEYS = frozenset(
    """scenario requests ttft_s tpot_s e2e_s queue_s throughput_tok_s output_throughput_tok_s goodput_req_s slo
    hbm_peak_bytes hbm_capacity_bytes weight_bytes_per_gpu kv_blocks_per_replica kv_block_bytes prefix_hit_rate
    preemptions cost_per_mtok_usd cost_per_output_mtok_usd gpu_hours simulated_s wall_s warnings config
    accuracy tokens cost_usd sim_speed_x schema version replicas offload swap global_pool links
    sessions eviction sliding_window format_switch""".split()
)


def _config_section(s: dict[str, Any]) -> Markup | str:
    cfg = s.get("config")
    if not isinstance(cfg, dict) or not cfg:
        return h.section("Config", _note("summary.json carries no config."))
    rows = [(str(k), _plain(v)) for k, v in cfg.items()]
    return h.section("Config", _table(rows, cls="kv"))


def _accounting(s: dict[str, Any], requests: _Csv | None) -> tuple[str, list[str]]:
    req = s.get("requests") if isinstance(s.get("requests"), dict) else {}
    total, done, rej, unf = (req.get(k) for k in ("total", "completed", "rejected", "unfinished"))
    failed = req.get("failed")  # only a run with faults counts them
    fail = failed if _is_num(failed) else 0
    notes = []
    if all(_is_num(v) for v in (total, done, rej, unf)) and total != done + rej + unf + fail:
        parts = (
            "completed + rejected + failed + unfinished"
            if failed is not None
            else "completed + rejected + unfinished"
        )
        notes.append(f"requests do not add up: total {total} != {parts} {done + rej + unf + fail}.")
    if requests is not None and _is_num(total) and requests.rows != total:
        notes.append(
            f"requests.csv has {requests.rows:,} rows but summary.json counts {int(total):,} requests."
        )
    text = f"{_int(total)} = {_int(done)} completed + {_int(rej)} rejected + "
    text += (
        f"{_int(failed)} failed + {_int(unf)} unfinished" if failed is not None else f"{_int(unf)} unfinished"
    )
    if _is_num(req.get("not_arrived")) and req["not_arrived"] > 0:
        text += f" (another {_int(req['not_arrived'])} in the trace had not arrived when the run ended)"
    return text, notes


def _hbm_parts(s: dict[str, Any]) -> str:
    """How the HBM peak adds up: weights + activation reserve + the KV blocks held at the peak,
    which counts blocks cached for prefix reuse (free to evict) as well as blocks in use; empty
    when the summary lacks a part."""
    parts: tuple[Any, ...] = (
        s.get("hbm_peak_bytes"),
        s.get("weight_bytes_per_gpu"),
        s.get("kv_block_bytes"),
        _get(s, "memory_plan", "activation_reserve_bytes"),
        s.get("kv_blocks_per_replica"),
    )
    if not all(_is_num(v) for v in parts):
        return ""
    peak, weights, block, reserve, pool = (float(v) for v in parts)
    blocks = round((peak - weights - reserve) / block) if block > 0 else -1
    if not 0 <= blocks <= pool:  # the parts do not add up: say nothing rather than something wrong
        return ""
    text = (
        f"weights {_gib(weights)} + activation reserve {_gib(reserve)} + {blocks:,} KV blocks held "
        f"({_gib(blocks * block)}). Blocks held count those cached for prefix reuse (free to evict) "
        "as well as those in use"
    )
    used = s.get("kv_peak_used_blocks")
    if _is_num(used):
        text += f", so the peak can exceed the {_int(used)} blocks ever in use at once (KV pool row)"
    return text + "."


def _headline_section(s: dict[str, Any], requests: _Csv | None) -> Markup | str:
    accounted, notes = _accounting(s, requests)
    slo = s.get("slo") if isinstance(s.get("slo"), dict) else {}
    pct = _percentile_label(slo.get("percentile"))

    lat_rows = []
    for key, label in (
        ("ttft_s", "TTFT"),
        ("tpot_s", "TPOT (per request)"),
        ("itl_s", "ITL (per token)"),
        ("e2e_s", "E2E latency"),
        ("queue_s", "queueing"),
    ):
        if key == "itl_s" and not isinstance(s.get(key), dict):
            continue  # a summary written before ITL was recorded
        d = s.get(key) if isinstance(s.get(key), dict) else {}
        lat_rows.append((label, *(_dur(d.get(q)) for q in ("mean", "p50", "p90", "p99", "p999"))))
    latency = _table(lat_rows, header=("", "mean", "p50", "p90", "p99", "p99.9"), cls="num")

    peak, cap = s.get("hbm_peak_bytes"), s.get("hbm_capacity_bytes")
    hbm = f"{_gib(peak)} of {_gib(cap)}"
    if _is_num(peak) and _is_num(cap) and cap > 0:
        hbm += f" ({peak / cap:.1%})"
    if _is_num(s.get("weight_bytes_per_gpu")):
        hbm += f"; weights {_gib(s['weight_bytes_per_gpu'])} per GPU"
    kv_pool = f"{_int(s.get('kv_blocks_per_replica'))} blocks per replica"
    if _is_num(s.get("kv_block_bytes")):
        kv_pool += f" x {s['kv_block_bytes'] / 2**20:,.2f} MiB"
    if _is_num(s.get("kv_peak_used_blocks")):
        kv_pool += f"; at most {_int(s['kv_peak_used_blocks'])} in use by requests at once"
    held = _hbm_parts(s)
    sim, wall = s.get("simulated_s"), s.get("wall_s")
    timing = f"{_float(sim, ',.1f', ' s')} simulated in {_float(wall, ',.2f', ' s')} wall"
    if _is_num(sim) and _is_num(wall) and wall > 0:
        timing += f" ({sim / wall:,.0f}x real time)"
    slo_text = h.join(
        (
            *(
                h.join(
                    (
                        f"{name} {pct}"
                        + (
                            f" {_dur(slo[f'{key}_at_percentile_s'])}"
                            if _is_num(slo.get(f"{key}_at_percentile_s"))
                            else ""
                        )
                        + f" ≤ {_dur(slo.get(f'{key}_s'))}: ",
                        _met(slo.get(f"{key}_met")),
                        "; ",
                    )
                )
                for name, key in (("TTFT", "ttft"), ("TPOT", "tpot"))
            ),
            f"{_pct(slo.get('good_fraction'))} of requests met both",
        )
    )
    gpu_hours = s.get("gpu_hours")
    tput = (
        f"{_float(s.get('throughput_tok_s'), ',.0f', ' tok/s')} "
        f"(output {_float(s.get('output_throughput_tok_s'), ',.0f', ' tok/s')})"
    )
    tokens = s.get("tokens") if isinstance(s.get("tokens"), dict) else {}
    if _is_num(tokens.get("prompt")) and _is_num(tokens.get("output")):
        tput += f"; {_int(tokens['prompt'])} prompt + {_int(tokens['output'])} output tokens completed"
    cost = (
        f"{_usd(s.get('cost_per_mtok_usd'))} ({_usd(s.get('cost_per_output_mtok_usd'))} per million output "
        f"tokens; {_float(gpu_hours, ',.2f', ' GPU-hours')}"
        + (f", {_usd(s['cost_usd'])} in all" if _is_num(s.get("cost_usd")) else "")
        + ")"
    )
    rows = [
        ("requests (total = completed + rejected + unfinished)", accounted),
        ("throughput", tput),
        ("goodput", f"{_float(s.get('goodput_req_s'), ',.2f', ' req/s')}"),
        ("SLO targets", slo_text),
        ("cost per million tokens", cost),
        ("HBM peak vs capacity (per GPU)", hbm),
        *((("HBM peak, what it holds", held),) if held else ()),
        ("KV pool", kv_pool),
        ("prefix-cache hit rate", _pct(s.get("prefix_hit_rate"))),
        ("preemptions", _int(s.get("preemptions"))),
        ("simulated vs wall time", timing),
    ]
    return h.section("Headline", _table(rows, cls="kv"), latency, *(h.para(n, "warn") for n in notes))


def _warnings_section(s: dict[str, Any]) -> Markup | str:
    warnings = s.get("warnings")
    if not isinstance(warnings, list) or not warnings:
        return h.section("Warnings", _note("None."))
    return h.section("Warnings", h.items((str(w) for w in warnings), "warn"))


def _replicas_section(rec: RunSummary) -> Markup | str:
    """One row per replica; KV use as blocks and as a share of the replica's pool."""
    if not rec.replicas:
        return ""
    pool = rec.kv_blocks_per_replica

    def blocks(n: float) -> str:
        return f"{n:,.0f} ({n / pool:.1%})" if pool > 0 else f"{n:,.0f}"

    rows = [
        (
            str(r.index),
            _int(r.requests),
            _int(r.steps),
            _pct(r.busy_fraction),
            blocks(r.kv_peak_used_blocks),
            blocks(r.kv_mean_used_blocks),
            _int(r.preemptions),
        )
        for r in rec.replicas
    ]
    header = ("replica", "requests", "steps", "busy", "KV blocks peak", "KV blocks mean", "preemptions")
    return h.section(
        "Replicas",
        _table(rows, header=header, cls="num"),
        _note("busy: share of simulated time running steps; KV mean: time-weighted blocks in use."),
    )


def _pools_section(rec: RunSummary) -> Markup | str:
    """A disaggregated cluster's prefill and decode pools, one row each, and the KV moved between
    them (``cluster.disaggregation``); nothing when aggregated."""
    d = rec.disaggregation
    if d is None:
        return ""
    rows = [
        (
            r.role,
            f"{r.replicas} x TP{r.tensor_parallel} {r.gpu}",
            _int(r.gpus),
            _int(r.requests),
            f"{_pct(r.busy_fraction.mean)} / {_pct(r.busy_fraction.max)}",
            _int(r.kv_blocks_per_replica),
            _int(r.kv_peak_used_blocks),
            _float(r.kv_mean_used_blocks, ",.0f"),
            _usd(r.cost_usd),
        )
        for r in d.roles
    ]
    header = (
        "pool",
        "replicas",
        "GPUs",
        "requests",
        "busy mean / max",
        "KV blocks per replica",
        "KV peak",
        "KV mean",
        "cost",
    )

    def dist(x: Distribution) -> str:
        return f"{_dur(x.p50)} / {_dur(x.p99)}"

    moved = [
        ("KV transfers", _int(d.transfers)),
        ("KV moved (all GPUs' shards)", _gib(d.transferred_bytes)),
        ("hand-off p50 / p99 (prefill end to KV landed: what TTFT adds)", dist(d.handoff_s)),
        ("waiting for decode blocks or seats p50 / p99", dist(d.block_wait_s)),
        ("transfer p50 / p99", dist(d.transfer_s)),
        ("links busy mean / max", f"{_pct(d.link_busy_fraction.mean)} / {_pct(d.link_busy_fraction.max)}"),
    ]
    return h.section(
        "Prefill and decode pools",
        _table(rows, header=header, cls="num"),
        _table(moved),
        _note(
            "busy: share of simulated time the pool's replicas ran steps; cost: the pool's GPUs "
            "at their hourly price over the simulated time."
        ),
    )


def _tiers_section(rec: RunSummary) -> Markup | str:
    """The memory hierarchy, when any of it is on: hit rate per tier, what moved, waits, links."""
    off, swap, pool = rec.offload, rec.swap, rec.global_pool
    if off is None and swap is None and pool is None and not rec.links:
        return ""
    parts: list[Markup] = []
    total = rec.prefix_hit_rate
    lower = (off.hit_rate_dram if off else 0.0) + (pool.hit_rate_global if pool else 0.0)
    rows: list[tuple[str, str]] = []
    if off is not None:
        rows.append(("host DRAM (this node)", _pct(off.hit_rate_dram)))
        lower += off.hit_rate_ssd
        if off.ssd_capacity_bytes:
            rows.append(("SSD (this node)", _pct(off.hit_rate_ssd)))
    if pool is not None:
        rows.append(("global pool", _pct(pool.hit_rate_global)))
    rows.insert(0, ("local HBM", _pct(total - lower)))
    rows.append(("all tiers", _pct(total)))
    parts.append(_table(rows, header=("prefix hits from", "share of prompt tokens"), cls="num"))
    kv: list[tuple[str, str]] = []
    if off is not None:
        kv += [
            ("offload", f"preset {off.preset}, write {off.write}, copy {off.copy}"),
            ("host tier per node", f"{_gib(off.host_capacity_bytes)} (peak {_gib(off.host_peak_bytes)})"),
            ("loads from DRAM", f"{_int(off.loads)} ({_int(off.loaded_tokens)} tokens)"),
            (
                "written to / dropped from DRAM (per GPU)",
                f"{_gib(off.written_bytes)} / {_gib(off.dropped_bytes)}",
            ),
            ("requests that waited for KV", _int(off.requests_waited)),
            (
                "SSD per node, demoted to / loaded from",
                f"{_gib(off.ssd_capacity_bytes)}, {_gib(off.ssd_written_bytes)} / {_gib(off.ssd_loaded_bytes)}",
            ),
            ("moved down for going cold (per GPU)", _gib(off.cold_demoted_bytes)),
            ("wait for KV p50 / p99", f"{_dur(off.kv_wait_s.p50)} / {_dur(off.kv_wait_s.p99)}"),
        ]
    if pool is not None:
        kv += [
            (
                "global pool",
                f"{_gib(pool.capacity_bytes)} (peak {_gib(pool.peak_bytes)}), fetch {pool.fetch}",
            ),
            (
                "fetched from the pool",
                f"{_int(pool.fetched_tokens)} tokens, {_gib(pool.fetched_bytes)} per GPU",
            ),
            ("of which over the network", _gib(pool.remote_bytes)),
            ("published / dropped (per GPU)", f"{_gib(pool.published_bytes)} / {_gib(pool.dropped_bytes)}"),
            ("requests that recomputed a remote prefix instead", _int(pool.declined_lookups)),
        ]
        pn = pool.pool_nodes
        if pn is not None:
            kv += [
                (
                    "dedicated pool nodes",
                    f"{_int(pn.nodes)} x {_gib(pn.capacity_bytes_per_node)}, {_int(pn.nics_per_node)} NICs "
                    f"({pn.nic_bw_bytes_per_s / 1e9:,.0f} GB/s per direction) each",
                ),
                ("pool node peak (each)", " / ".join(_gib(b) for b in pn.peak_bytes)),
                (
                    "pool nodes' cost (in the run's cost)",
                    f"${pn.cost_per_hour_usd:,.2f}/h each, ${pn.cost_usd:,.2f} over the run",
                ),
            ]
    if swap is not None:
        kv += [
            ("preemption", swap.mode),
            ("swapped / recomputed victims", f"{_int(swap.swaps)} / {_int(swap.recomputes)}"),
            ("swapped out (per GPU)", _gib(swap.swapped_bytes)),
            ("swap space per node", f"{_gib(swap.swap_space_bytes)} (peak {_gib(swap.peak_bytes)})"),
        ]
    if kv:
        parts.append(_table(kv, cls="kv"))
    if rec.links:
        rows2 = [
            (
                lk.name,
                _int(lk.transfers),
                _gib(lk.bytes),
                _dur(lk.busy_s),
                _pct(lk.utilization),
                _dur(lk.queued_s),
            )
            for lk in rec.links
        ]
        header = ("link", "transfers", "bytes", "busy", "utilisation", "queued (all transfers)")
        parts.append(_table(rows2, header=header, cls="num"))
        parts.append(
            _note(
                "Links: one direction of one PCIe group or NIC (poolN/nic_in, nic_out: a dedicated pool "
                "node's NICs together); transfers queue first come, first served."
            )
        )
    return h.section("Memory tiers and links", *parts)


def _sessions_section(rec: RunSummary) -> Markup | str:
    """Agent sessions: completion, durations, and the prompt by segment (workload.agent)."""
    ses = rec.sessions
    if ses is None:
        return ""
    d = ses.duration_s
    rows = [
        ("sessions completed", f"{ses.completed:,} of {ses.sessions:,}"),
        (
            "turns sent / completed / in workload",
            f"{ses.turns_sent:,} / {ses.turns_completed:,} / {ses.turns:,}",
        ),
        ("arrivals", "closed loop (a turn waits for the previous reply)" if ses.closed_loop else "open loop"),
        ("session duration p50 / p99", f"{_dur(d.p50)} / {_dur(d.p99)}"),
        ("pinned segments", ", ".join(ses.pinned_segments) or "none"),
        ("pinned blocks, peak per replica", _int(ses.pinned_blocks_peak)),
    ]
    if ses.segment_policies:
        pol = ", ".join(f"{k}: {v}" for k, v in ses.segment_policies.items())
        rows.append(("segment policies (kv.segments)", pol))
        rows.append(("blocks dropped at turns' ends", _int(ses.segment_dropped_blocks)))
    seg = [
        (k, _int(v), _pct(ses.prompt_share_by_segment.get(k)))
        for k, v in ses.prompt_tokens_by_segment.items()
    ]
    return h.section(
        "Agent sessions",
        _table(rows, cls="kv"),
        _table(seg, header=("prompt segment", "tokens", "share"), cls="num"),
        _note("prompt tokens of the turns sent, by segment, after the history and tool-output policies."),
    )


def _rejections_section(s: dict[str, Any]) -> Markup | str:
    reasons = _get(s, "requests", "rejected_reasons")
    if not isinstance(reasons, dict) or not reasons:
        return h.section("Rejection reasons", _note("No requests were rejected."))
    items = sorted(reasons.items(), key=lambda kv: (-(kv[1] if _is_num(kv[1]) else 0), str(kv[0])))
    rows = [(str(k), _int(v)) for k, v in items]
    return h.section("Rejection reasons", _table(rows, header=("reason", "requests"), cls="num"))


def _accuracy_section(s: dict[str, Any]) -> Markup | str:
    acc = s.get("accuracy")
    if not isinstance(acc, dict):
        return ""
    out = [
        _note(
            "The simulator does not run the model. These are cited estimates for the KV "
            "format, plus the numerical error of kvsim's own kernels for it on synthetic K/V; they say "
            "nothing about this trace's outputs."
        )
    ]
    rows = [("KV format", _plain(acc.get("format")))]
    rms = acc.get("kernel_rel_rms")
    rows.append(
        ("attention-output relative RMS error (kernels)", f"{rms:.3g}" if _is_num(rms) else "not measured")
    )
    if acc.get("kernel_method"):
        rows.append(("how it was measured", _plain(acc.get("kernel_method"))))
    if acc.get("note"):
        rows.append(("note", _plain(acc.get("note"))))
    out.append(_table(rows, cls="kv"))
    lit = acc.get("literature")
    if isinstance(lit, list) and lit:
        cited = [(_plain(_get(x, "claim")), _plain(_get(x, "source"))) for x in lit if isinstance(x, dict)]
        out.append(_table(cited, header=("claim (cited)", "source")))
    return h.section("Accuracy (estimate, not measured by the simulator)", *out)


def _eviction_section(s: dict[str, Any]) -> Markup | str:
    ev = s.get("eviction")
    if not isinstance(ev, dict):
        return ""
    keys = (
        ("policy", "policy"),
        ("trigger", "trigger"),
        ("pages", "page policy"),
        ("heavy_ratio", "heavy-hitter ratio"),
        ("keep_ratio", "share kept below the entropy threshold"),
        ("merge_ratio", "share kept after merging"),
        ("recent_tokens", "recent tokens"),
        ("sink_tokens", "sink tokens"),
        ("budget_tokens", "token budget (0: none)"),
        ("tokens_evicted", "tokens evicted"),
        ("trims", "trims"),
        ("blocks_released", "blocks released (physical)"),
        ("blocks_copied", "shared blocks copied"),
        ("cache_entries_invalidated", "prefix-cache entries invalidated"),
        ("trim_s", "seconds of trims"),
    )
    return _part_section("Token eviction", ev, keys)


def _window_section(s: dict[str, Any]) -> Markup | str:
    sw = s.get("sliding_window")
    if not isinstance(sw, dict):
        return ""
    keys = (
        ("window_tokens", "window (tokens)"),
        ("global_tokens", "global tokens"),
        ("windowed_kv_layers", "windowed KV layers"),
        ("kv_layers", "KV layers"),
        ("tokens_out_of_window", "token slots freed (layer average)"),
        ("blocks_freed", "blocks freed"),
        ("blocks_copied", "shared blocks counted as a sequence's own"),
        ("cache_entries_invalidated", "prefix-cache entries given up"),
    )
    return _part_section("Sliding-window layers", sw, keys)


def _switch_section(s: dict[str, Any]) -> Markup | str:
    fs = s.get("format_switch")
    if not isinstance(fs, dict):
        return ""
    keys = (
        ("after_tokens", "switch after (tokens)"),
        ("format", "second format"),
        ("requests_switched", "requests switched"),
        ("switches", "crossings (recomputes included)"),
        ("tokens_requantized", "tokens re-quantized"),
        ("requant_s", "seconds of re-quantization"),
        ("blocks_freed", "blocks freed"),
        ("blocks_copied", "shared blocks re-quantized into own"),
        ("cache_entries_invalidated", "prefix-cache entries invalidated"),
    )
    return _part_section("Format switch", fs, keys)


def _part_section(title: str, part: dict[str, Any], keys: tuple[tuple[str, str], ...]) -> Markup | str:
    """One optional summary part as a table, and its cited accuracy estimate if it has one."""
    rows = [(label, _plain(part.get(k))) for k, label in keys if k in part]
    out = [_table(rows, cls="kv")]
    acc = part.get("accuracy")
    if isinstance(acc, dict):
        why = (": ", _plain(acc.get("note"))) if acc.get("note") else ()
        text = h.join(
            ("Accuracy (estimate, not measured by the simulator) for ", _plain(acc.get("format")), *why)
        )
        out.append(_note(text))
        lit = acc.get("literature")
        if isinstance(lit, list) and lit:
            cited = [
                (_plain(_get(x, "claim")), _plain(_get(x, "source"))) for x in lit if isinstance(x, dict)
            ]
            out.append(_table(cited, header=("claim (cited)", "source")))
    return h.section(title, *out)


def _extras_section(s: dict[str, Any]) -> Markup | str:
    extra = [(str(k), _plain(v)) for k, v in s.items() if k not in _KNOWN_KEYS]
    if not extra:
        return ""
    return h.section("Other summary fields", _table(extra, cls="kv"))


# ---------------------------------------------------------------------------------------- charts

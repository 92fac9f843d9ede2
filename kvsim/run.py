"""One simulation run: scenario -> workload, memory plan, cost model, engines -> results on disk.

`run_scenario` returns a `RunResult` (sequences, per-replica stats, summary dict); `write_run`
writes ``summary.json``, ``requests.csv`` and ``timeseries.csv`` (`kvsim.report` builds ``report.html`` from them). Everything random
comes from the scenario's seed, so one seed gives one summary (``wall_s`` aside).
"""

from __future__ import annotations

import functools
import math
import sys
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import simpy

from kvsim.accuracy import accuracy_estimate, accuracy_note, eviction_accuracy
from kvsim.core.block_hash import block_keys, private_keys
from kvsim.core.eviction import eviction_from_config, switch_eviction, window_eviction
from kvsim.core.memory_plan import MemoryPlan, plan_memory
from kvsim.core.request import Request, RequestStatus
from kvsim.core.router import Router
from kvsim.core.sched.scheduler import Scheduler
from kvsim.core.spec_decode import SpecDecoder
from kvsim.core.tiers import GlobalPool, HostTier, PoolNodes
from kvsim.costs.analytic import AnalyticCostModel
from kvsim.costs.base import CostModel, ForwardBatch
from kvsim.costs.draft import DraftCost
from kvsim.errors import KvsimError
from kvsim.results.io import (
    csv_name,
    write_links_csv,
    write_requests_csv,
    write_tiers_csv,
    write_timeseries_csv,
)
from kvsim.results.record import (
    AccuracyEstimate,
    AccuracyNote,
    BusyFraction,
    Distribution,
    EvictionRecord,
    FormatSwitchRecord,
    GlobalPoolRecord,
    LinkRecord,
    OffloadRecord,
    PoolNodesRecord,
    ReplicaRecord,
    RequestCounts,
    RunConfig,
    RunSummary,
    SessionRecord,
    SlidingWindowRecord,
    SpecDecodeRecord,
    SwapRecord,
    WorkloadRecord,
    part_from_dict,
    write_summary,
)
from kvsim.results.summary import dist, summarize, weighted_dist
from kvsim.sim.cluster import ClosedLoopArrivals, arrival_process, make_pool_and_scheduler
from kvsim.sim.links import FairLinkQueue, LinkQueue
from kvsim.sim.offload import GlobalSide, OffloadPort, SSDSide, SwapSpace
from kvsim.sim.replica import Replica, ReplicaStats, TokenGaps
from kvsim.spec.offload import CopyMode
from kvsim.spec.scenario import POOL_NODE_SOURCES, Scenario
from kvsim.spec.topology import Link
from kvsim.spec.workload import Workload, clip_to_context, load_workload


@dataclass
class RunResult:
    scenario: Scenario
    seqs: list[Request]
    stats: list[ReplicaStats]
    plan: MemoryPlan
    record: RunSummary
    tier_samples: list[tuple[float, str, int]] = field(default_factory=list)  # (t, tier, bytes used)
    link_samples: list[tuple[float, str, float, float]] = field(
        default_factory=list
    )  # (t, link, bytes, busy s)
    # Each replica's inter-token gaps (`TokenGaps`), for per-request ITL lists (vLLM bench format).
    gaps: list[TokenGaps] = field(default_factory=list)

    @property
    def summary(self) -> dict[str, Any]:
        """The record's JSON form, as ``summary.json`` holds it."""
        return self.record.to_dict()


# Below this share of busy time priced over prefixes past the tables, no warning: on the default
# scenario it is under 0.1% (a prompt's later chunks over its earlier ones), which changes no
# decision and would put a warning on every run.
EXTRAPOLATED_WARN_SHARE = 1e-3


def _refuse_unsimulated(sc: Scenario) -> None:
    """Options the engine does not simulate together yet: one line naming the field.

    Token eviction, sliding-window layers and a format switch are simulated with the host tiers,
    the global pool and swap (`kvsim.sim.offload`, `kvsim.core.sched.scheduler`): windows and the
    switch trim through eviction's closed forms (`kvsim.core.eviction.window_eviction`,
    `switch_eviction`), so a trimmed entry leaves HBM as rewritten and a swap copies the blocks held.
    They are refused with token eviction and with each other (one policy per sequence) and with
    speculative decoding (its verify slots assume every computed token is held). Speculative
    decoding runs with the tiers, the global pool and swap (a swap copies the blocks a request
    holds, its look-ahead blocks too; verify windows end at a load's arrival and at a cold entry as
    other windows do), but not with token eviction, which assumes one token per decoding step
    throughout: the closed forms that bound and price windows (`KVCacheManager.decode_plan`,
    `first_trim`) advance a request one token a step, while a verify step advances it by its
    accepted drafts plus one; after a step, `KVCacheManager.apply_evictions` treats evicting exactly
    one token past the budget as steady (its slot reused, priced with the step), so a verify step
    would count as a trim every step; under physical or hybrid release the look-ahead blocks a
    verify step keeps for its rejected drafts lie beyond the kept tokens' blocks and would be freed
    at each step and taken again at the next; and the verify row's slots and context are counted
    from computed tokens, not resident ones. Each needs a modelling choice (what a multi-token
    steady eviction costs, whether look-ahead blocks survive a trim), not only arithmetic."""
    kv = sc.kv
    m = sc.model
    if kv.format_switch is not None:
        on = [
            name
            for name, enabled in (
                ("kv.eviction", kv.eviction.policy != "none"),
                ("sliding-window layers", m.windowed_kv_layers() > 0),
                ("scheduler.spec_decode", sc.scheduler.spec_decode is not None),
            )
            if enabled
        ]
        if on:
            raise KvsimError(
                f"a format switch is not simulated together with {' and '.join(on)} yet; turn one of them off",
                source=sc.source,
                path="kv.format_switch",
            )
    if m.windowed_kv_layers():
        others = (
            ("kv.eviction", kv.eviction.policy != "none"),
            ("scheduler.spec_decode", sc.scheduler.spec_decode is not None),
        )
        on = [name for name, enabled in others if enabled]
        if on:
            raise KvsimError(
                f"{m.name}'s sliding-window layers (window {m.sliding_window:,} tokens, out-of-window "
                f"blocks freed) are not simulated together with {' and '.join(on)} yet; turn it off, or "
                "set model.sliding_window: 0 to keep every token",
                source=sc.source,
                path="model.sliding_window",
            )
    if sc.scheduler.spec_decode is not None:
        _refuse_with(
            sc,
            "speculative decoding",
            "scheduler.spec_decode",
            (("kv.eviction", kv.eviction.policy != "none"),),
        )


def _refuse_with(sc: Scenario, what: str, path: str, others: tuple[tuple[str, bool], ...]) -> None:
    """One line naming `path` when `what` is on together with any of `others` that is on."""
    on = [name for name, enabled in others if enabled]
    if on:
        raise KvsimError(
            f"{what} is not simulated together with {' and '.join(on)} yet; turn one of them off",
            source=sc.source,
            path=path,
        )


def cost_model_key(sc: Scenario) -> Hashable:
    """Scenarios with equal keys get equal cost models (`make_cost_model` reads nothing else)."""
    c = sc.cluster
    return (
        sc.cost_model,
        sc.model,
        c.gpu,
        c.tensor_parallel,
        sc.kv.format,
        sc.kv.format_mix,
        sc.kv.eviction,
        sc.kv.format_switch,
        sc.kv.block_size,
        c.topology,
    )


def make_cost_model(sc: Scenario) -> CostModel:
    if sc.cost_model.kind == "analytic":
        c = sc.cluster
        return AnalyticCostModel(
            sc.model,
            c.gpu,
            c.tensor_parallel,
            sc.kv.format,
            c.topology,
            mix=sc.kv.format_mix,
            eviction=eviction_from_config(sc.kv.eviction),
            switch=sc.kv.format_switch,
            block_size=sc.kv.block_size,
        )
    from kvsim.costs.profile import load_profile_cost_model

    assert sc.cost_model.profile is not None
    return load_profile_cost_model(sc)


def scenario_workload(sc: Scenario) -> Workload:
    """The scenario's workload; an error of the generator (which knows no file) names the scenario."""
    try:
        return load_workload(sc.workload, seed=sc.sim.seed)
    except KvsimError as exc:
        if exc.source in ("synthetic", "agent", "random"):
            raise KvsimError(exc.message, source=sc.source, path=exc.path) from None
        raise


def run_scenario(
    sc: Scenario,
    *,
    progress: bool = False,
    workload: Workload | None = None,
    make_scheduler: Callable[..., Scheduler] = make_pool_and_scheduler,
    cost: CostModel | None = None,
    percentiles: tuple[float, ...] = (),
) -> RunResult:
    """Simulate `sc`. `make_scheduler` builds each replica's scheduler (tests pass one that checks
    invariants after every operation); `percentiles`: also these, in each latency distribution's
    ``by_percentile`` and the terminal table (``kvsim run --percentiles``)."""
    t0 = time.perf_counter()
    _refuse_unsimulated(sc)
    wl = workload if workload is not None else scenario_workload(sc)
    if sc.workload.clip_to_context:
        wl = clip_to_context(wl, sc.model.max_context)
    plan = plan_memory(sc)
    if cost is None:  # a caller running many points may pass one it built (pricing is pure)
        cost = make_cost_model(sc)
    bs = sc.kv.block_size
    caching = sc.kv.prefix_cache != "none"
    use_prefix = caching and wl.hash_ids is not None  # content ids; else each prompt's own keys
    # The answer's content ids line up with engine blocks only when blocks are the trace's size.
    out_ids = wl.output_hash_ids if use_prefix and wl.hash_block_tokens == bs else None
    if use_prefix:
        g = wl.hash_block_tokens
        if g % bs and bs % g:
            raise KvsimError(
                f"the trace's hash block of {g} tokens and block_size {bs} must divide one another",
                source=sc.source,
                path="kv.block_size",
            )
    env = simpy.Environment()
    end_s = sc.sim.max_time_s if sc.sim.max_time_s is not None else math.inf
    seqs: list[Request] = []
    span = float(wl.arrival_s[-1]) if len(wl) else 0.0
    sample_every = max(span / 2000.0, 0.05)
    replicas: list[Replica] = []
    uses_host = (
        sc.kv.offload.enabled or sc.scheduler.preemption != "recompute" or sc.kv.prefix_cache == "global"
    )
    offload = _Offload(sc, plan, env, cost) if uses_host else None
    evictor = eviction_from_config(sc.kv.eviction)
    window = window_eviction(sc.model)  # refused together with kv.eviction (_refuse_unsimulated)
    switch = switch_eviction(sc.model, sc.kv.format, sc.kv.format_switch)  # refused with both
    spec, draft = _spec_decode(sc, cost)
    for i in range(sc.cluster.num_replicas):
        sched = make_scheduler(
            plan.num_blocks,
            bs,
            sc.scheduler.max_num_seqs,
            sc.scheduler.max_batched_tokens,
            sc.scheduler.chunked_prefill,
            caching,
        )
        sched.kv.set_eviction(evictor or window or switch)
        sched.spec = spec
        replicas.append(
            Replica(
                env,
                i,
                sched,
                cost,
                fast_forward=sc.sim.fast_forward,
                next_outside_event=lambda: end_s,
                sample_every_s=sample_every,
                offload=None if offload is None else offload.port(i, sched),
                draft=draft,
            )
        )
    if sc.kv.pin_segments:
        pin = _pin_keys(sc, wl)
        for r in replicas:
            r.sched.kv.pool.pin(pin, int(sc.kv.pin_max_share * plan.num_blocks))
    router = Router(sc.cluster.router, replicas)
    if router.indexed:
        for r in replicas:
            r.on_load_change = router.touch
    max_ctx = sc.model.max_context
    max_batched = sc.scheduler.max_batched_tokens
    chunked = sc.scheduler.chunked_prefill
    prompts, outputs, arrivals = wl.prompt_tokens, wl.output_tokens, wl.arrival_s

    def stored(p: int, o: int) -> int:
        """The most token slots a request holds at once: all but its last token (never stored);
        with sliding windows, no more than its last kept tokens plus a step's new ones (a window
        frees blocks between chunks, so a request that fits alone always runs)."""
        n = p + o - 1
        return n if window is None else min(n, window.kept(n) + max_batched)

    def make_seq(i: int, t: float | None = None) -> Request:
        p, o = int(prompts[i]), int(outputs[i])
        if use_prefix:
            keys, sizes = block_keys(wl.hash_ids[i], p, wl.hash_block_tokens, bs)  # type: ignore[index]
        elif caching:
            keys, sizes = private_keys(i, p // bs)
        else:
            keys, sizes = [], []
        seq = Request(
            i,
            float(arrivals[i]) if t is None else t,
            p,
            o,
            keys,
            sizes,
            None if out_ids is None else out_ids[i].tolist(),
        )
        seqs.append(seq)
        if p + o > max_ctx:
            seq.status, seq.reason = RequestStatus.REJECTED, "longer than the model's context"
        elif -(-stored(p, o) // bs) > plan.num_blocks:
            seq.status, seq.reason = RequestStatus.REJECTED, "needs more KV blocks than a replica has"
        elif not chunked and p > max_batched:
            seq.status, seq.reason = (
                RequestStatus.REJECTED,
                "prompt exceeds max_batched_tokens without chunked prefill",
            )
        return seq

    agent = wl.agent
    if agent is not None and agent.closed_loop:
        starts = [(float(wl.arrival_s[i]), int(i)) for i in np.flatnonzero(agent.turn == 0)]
        loop = ClosedLoopArrivals(env, starts, agent.gap_s, agent.next_request, make_seq, router)
        for r in replicas:
            r.on_finish = loop.on_finish
    else:
        env.process(arrival_process(env, wl.arrival_s, make_seq, router))
    _drive(env, span, end_s, progress)
    wall = time.perf_counter() - t0
    # Run to the end: the last step's end or the last arrival. (env.now could lie later: a fast-forward
    # window cut short leaves its first timeout queued, which fires with nothing waiting on it.)
    last_arrival = float(wl.arrival_s[-1]) if len(wl) else 0.0
    if agent is not None and agent.closed_loop:  # turns were sent when replies arrived
        last_arrival = max((s.arrival_s for s in seqs), default=0.0)
    last = max([r.clock for r in replicas] + [last_arrival])
    simulated = min(env.now, end_s) if math.isfinite(end_s) else last
    stats = [r.stats for r in replicas]
    parts = summarize(
        seqs,
        simulated_s=simulated,
        num_gpus=sc.cluster.num_gpus,
        gpu_hour_usd=sc.gpu_hour_usd,
        ttft_slo_s=sc.slo.ttft_s,
        tpot_slo_s=sc.slo.tpot_s,
        percentile=sc.slo.percentile,
        not_arrived=len(wl) - len(seqs),
        other_usd_per_hour=sc.pool_nodes_usd_per_hour,
        percentiles=percentiles,
    )
    finished = [s for s in seqs if s.status is RequestStatus.FINISHED]
    finished_ids = {s.id for s in finished}
    pooled = [r.gaps.pooled(finished_ids) for r in replicas]
    # A request's gaps add up to finish - first token: the mean from those spans, which (unlike a
    # sum of the gaps) does not depend on how windows grouped them.
    multi = [s for s in finished if s.output_len > 1]
    itl_tokens = sum(s.output_len - 1 for s in multi)
    parts["itl_s"] = weighted_dist(
        np.concatenate([v for v, _ in pooled]),
        np.concatenate([c for _, c in pooled]),
        percentiles,
        mean=math.fsum(s.finish_s - s.first_token_s for s in multi) / itl_tokens if itl_tokens else None,
    )
    parts["percentiles"] = percentiles
    counts: RequestCounts = parts["requests"]
    warnings = cost.warnings(frozenset().union(*(r.off_grid for r in replicas)))  # what ran
    extrapolated = math.fsum(s.prefix_extrapolated_s for s in stats)
    share = extrapolated / max(math.fsum(s.busy_s for s in stats), extrapolated) if extrapolated > 0 else 0.0
    if share >= EXTRAPOLATED_WARN_SHARE:
        warnings.append(
            f"cost model: {share:.1%} of the replicas' busy time "
            f"({extrapolated:,.1f} s) is prefill attention over cached prefixes longer than its tables "
            f"hold, extrapolated: {cost.prefix_rule}"
        )
    stuck = counts.unfinished
    if stuck and not math.isfinite(end_s):
        warnings.append(
            f"{stuck:,} requests never finished although the simulation ran to its end (a defect)"
        )
    if len(seqs) < len(wl):
        if agent is not None and agent.closed_loop:
            warnings.append(
                f"{len(wl) - len(seqs):,} agent turns were never sent: an earlier turn of their session "
                "was rejected or unfinished, or sim.max_time came first"
            )
        else:
            warnings.append(
                f"{len(wl) - len(seqs):,} requests arrive after sim.max_time and were not replayed"
            )
    n_ctx = counts.rejected_reasons.get("longer than the model's context", 0)
    if n_ctx:
        warnings.append(
            f"{n_ctx:,} requests exceed {sc.model.name}'s context of {max_ctx:,} tokens and were rejected"
        )
    if wl.clipped_to_context:
        warnings.append(
            f"{wl.clipped_to_context:,} requests longer than {sc.model.name}'s context of {max_ctx:,} tokens "
            "were clipped to fit (workload.clip_to_context)"
        )
    if wl.skipped_lines:
        warnings.append(f"{wl.skipped_lines:,} malformed trace lines were skipped (workload.skip_bad_lines)")
    for reason, n in sorted(wl.dropped.items()):
        warnings.append(f"{n:,} trace rows dropped: {reason}")
    if wl.agent is not None and sc.workload.agent is not None:
        ag = sc.workload.agent
        if ag.history_turns or ag.tool_outputs != "keep":
            warnings.append(
                "estimate not available: the history window and the tool-output policy change what the "
                "model sees; the simulator cannot tell their effect on answers, and the design documents "
                "(003) recommend them without a figure"
            )
    sd = sc.scheduler.spec_decode
    if sd is not None and sd.draft_model is not None:
        if sd.draft_model.num_active_params >= sc.model.num_active_params:
            warnings.append(
                f"the draft model {sd.draft_model.name} is not smaller than {sc.model.name}: "
                "each draft pass costs about a decode step, so speculative decoding cannot pay off"
            )
        warnings.append(f"the draft model {sd.draft_model.name}'s weights and KV are not taken from HBM here")
    warnings.extend(sc.notes)
    warnings.extend(wl.notes)
    if sc.kv.format_note:
        warnings.append(sc.kv.format_note)
    peak_occ = max(r.sched.kv.peak_occupied_blocks for r in replicas)
    note = accuracy_note(sc.kv.format, sc.kv.format_note, sc.kv.format_mix)
    summary = RunSummary(
        **parts,
        scenario=sc.name,
        hbm_capacity_bytes=plan.hbm_bytes_per_gpu,
        weight_bytes_per_gpu=plan.weight_bytes_per_gpu,
        hbm_peak_bytes=int(
            plan.weight_bytes_per_gpu + plan.activation_reserve_bytes + peak_occ * plan.block_bytes_per_gpu
        ),
        kv_peak_used_blocks=max(r.sched.kv.peak_used_blocks for r in replicas),
        kv_blocks_per_replica=plan.num_blocks,
        kv_block_bytes=plan.block_bytes_per_gpu,
        kv_tokens_per_replica=plan.tokens_per_replica,
        memory_plan=plan,
        prefix_cache_evictions=sum(r.sched.kv.pool.evictions for r in replicas),
        steps=sum(s.steps for s in stats),
        # Share of simulated time each replica spent running steps (its GPUs busy), mean and max.
        replica_busy_fraction=BusyFraction(
            mean=sum(s.busy_s for s in stats) / len(stats) / simulated if simulated > 0 else 0.0,
            max=max(s.busy_s for s in stats) / simulated if simulated > 0 else 0.0,
        ),
        engine_events=sum(s.events for s in stats),
        simulated_s=simulated,
        wall_s=time.perf_counter() - t0,
        warnings=tuple(warnings),
        accuracy=None
        if note is None
        else part_from_dict(AccuracyNote, note, source="kvsim.accuracy", path="accuracy"),
        accuracy_estimate=part_from_dict(
            AccuracyEstimate, accuracy_estimate(sc.kv), source="kvsim.accuracy", path="accuracy_estimate"
        ),
        config=_config(sc, cost, wl),
        workload=WorkloadRecord(**wl.accounting(), clipped_to_context=wl.clipped_to_context),  # type: ignore[arg-type]
        sim_speed_x=simulated / max(wall, 1e-9),
        replicas=_replica_records(replicas, seqs, simulated),
        offload=None if offload is None or offload.tiers is None else offload.record(seqs, simulated),
        swap=None if offload is None or offload.swap is None else offload.swap_record(),
        global_pool=None if offload is None or offload.pool is None else offload.pool_record(seqs, simulated),
        links=() if offload is None else offload.link_records(simulated),
        sessions=None if agent is None else _session_record(sc, wl, seqs, replicas),
        eviction=None if evictor is None else _eviction_record(sc, replicas, plan, simulated),
        sliding_window=None if window is None else _window_record(sc, replicas),
        format_switch=None if switch is None else _switch_record(sc, replicas),
        spec_decode=None if spec is None else _spec_record(sc, spec, replicas, plan),
    )
    return RunResult(
        sc,
        seqs,
        stats,
        plan,
        summary,
        [] if offload is None else offload.tier_samples(),
        [] if offload is None else offload.link_samples(),
        [r.gaps for r in replicas],
    )


class _Offload:
    """The host tiers (one per node) and host links (per PCIe group, each direction) of a run."""

    def __init__(self, sc: Scenario, plan: MemoryPlan, env: simpy.Environment, cost: CostModel) -> None:
        c = sc.cluster
        self.sc, self.env, self.cost = sc, env, cost
        self.per_node = c.gpus_per_node // c.tensor_parallel  # replicas on a node
        self.block_bytes_per_gpu = plan.block_bytes_per_gpu
        self.block_bytes = plan.block_bytes_per_gpu * c.tensor_parallel  # a replica's block, all its GPUs
        self.capacity_bytes = 0
        self.tiers: list[HostTier] | None = None
        if sc.kv.offload.enabled and sc.kv.offload.load == "overlap" and c.topology.sharing == "fair":
            raise KvsimError(
                "load: overlap needs the load's end when it starts, which fair-shared links do not know "
                "(cluster.topology.sharing: fair); use load: stall",
                source=sc.source,
                path="kv.offload.load",
            )
        if sc.kv.offload.enabled:
            self.tiers = [
                HostTier(self._tier_blocks(plan), eviction=sc.kv.offload.eviction) for _ in range(c.nodes)
            ]
        self.ssd: list[SSDSide] | None = None
        ssd_cfg = sc.kv.offload.ssd
        if sc.kv.offload.enabled and ssd_cfg is not None:
            ssd_blocks = int(ssd_cfg.capacity_bytes // self.block_bytes)
            if ssd_blocks < 1:
                raise KvsimError(
                    f"an SSD tier of {ssd_cfg.capacity_bytes:,} bytes holds no KV block of {self.block_bytes:,.0f} bytes",
                    source=sc.source,
                    path="kv.offload.ssd.capacity",
                )
            self.ssd = [
                SSDSide(
                    HostTier(ssd_blocks, name="ssd", eviction=sc.kv.offload.eviction),
                    self._queue(
                        Link("ssd_read", ssd_cfg.read_bw, ssd_cfg.latency_s, 0.0), f"node{n}/ssd_read/0"
                    ),
                    self._queue(
                        Link("ssd_write", ssd_cfg.write_bw, ssd_cfg.latency_s, 0.0), f"node{n}/ssd_write/0"
                    ),
                    self.block_bytes,
                    {},
                )
                for n in range(c.nodes)
            ]
        self.swap: list[SwapSpace] | None = None
        if sc.scheduler.preemption != "recompute":
            room = c.host_dram_bytes - self.capacity_bytes
            need = sc.scheduler.swap_space_bytes * c.gpus_per_node
            if need > room:
                raise KvsimError(
                    f"{sc.scheduler.swap_space_bytes:,} bytes per GPU x {c.gpus_per_node} GPUs exceed the node's "
                    f"host DRAM left for it ({room:,} of cluster.host_dram)",
                    source=sc.source,
                    path="scheduler.swap_space",
                )
            self.swap = [SwapSpace(int(need // self.block_bytes)) for _ in range(c.nodes)]
        self.pool: GlobalPool | None = None
        self.pool_ready: dict[int, float] = {}
        self.watchers: list[OffloadPort] = []
        self.pool_bytes_per_node = 0
        self.pool_in: list[LinkQueue] = []
        self.pool_out: list[LinkQueue] = []
        self.pool_link: Link | None = None
        if sc.kv.prefix_cache == "global" and sc.kv.global_pool.pool_nodes:
            self._pool_nodes()
        elif sc.kv.prefix_cache == "global":
            gp = sc.kv.global_pool
            room = c.host_dram_bytes - self.capacity_bytes - (0 if self.swap is None else need)
            per_node = gp.pool_bytes or room
            if per_node > room or per_node <= 0:
                raise KvsimError(
                    f"a global pool of {per_node:,} bytes per node exceeds the host DRAM left for it "
                    f"({room:,} of cluster.host_dram, beside the offload tier and swap space)",
                    source=sc.source,
                    path="kv.prefix_cache.pool_bytes" if gp.pool_bytes else "cluster.host_dram",
                )
            blocks = int(per_node * c.nodes // self.block_bytes)
            if blocks < 1:
                raise KvsimError(
                    f"a global pool of {per_node:,} bytes per node holds no KV block of {self.block_bytes:,.0f} bytes",
                    source=sc.source,
                    path="kv.prefix_cache.pool_bytes",
                )
            self.pool = GlobalPool(blocks, eviction=gp.eviction)
            self.pool_bytes_per_node = int(blocks * self.block_bytes // c.nodes)
        self.ready: list[dict[int, float]] = [{} for _ in range(c.nodes)]
        self.links: dict[tuple[int, str, int], LinkQueue] = {}
        self.ports: list[OffloadPort] = []

    def _pool_nodes(self) -> None:
        """The global pool on dedicated pool nodes: each node's DRAM (`PoolNodes`, none of the GPU
        nodes' DRAM) and its NICs, one FIFO queue per direction for all of them together (the
        Mooncake Transfer Engine stripes a transfer's slices over every NIC of a node, so a node's
        NICs act as one link of their summed bandwidth; per-NIC queues would let one transfer use
        one NIC only), with the latency and per-call overhead of cluster.topology.network."""
        sc = self.sc
        c, gp = sc.cluster, sc.kv.global_pool
        per_node = gp.pool_node_bytes or c.host_dram_bytes
        path = "kv.prefix_cache.pool_node_bytes" if gp.pool_node_bytes else "cluster.host_dram"
        blocks = int(per_node // self.block_bytes)
        if blocks < 1:
            raise KvsimError(
                f"a pool node of {per_node:,} bytes holds no KV block of {self.block_bytes:,.0f} bytes",
                source=sc.source,
                path=path,
            )
        self.pool = PoolNodes(blocks, gp.pool_nodes, first_home=c.nodes, eviction=gp.eviction)
        net = c.topology.network
        self.pool_link = Link(
            "pool_nic", net.bw_bytes_per_s * gp.pool_node_nics, net.latency_s, net.per_call_overhead_s
        )
        self.pool_in = [LinkQueue(self.pool_link, label=f"pool{j}/nic_in/0") for j in range(gp.pool_nodes)]
        self.pool_out = [LinkQueue(self.pool_link, label=f"pool{j}/nic_out/0") for j in range(gp.pool_nodes)]

    def _tier_blocks(self, plan: MemoryPlan) -> int:
        sc = self.sc
        c, off = sc.cluster, sc.kv.offload
        block_bytes = self.block_bytes
        dram = c.host_dram_bytes
        path = "kv.offload.host_bytes"
        if off.host_bytes:
            cap_bytes = float(off.host_bytes)
        elif off.host_share:
            cap_bytes, path = off.host_share * dram, "kv.offload.host_share"
        elif off.hbm_ratio:
            cap_bytes, path = (
                off.hbm_ratio * plan.num_blocks * self.per_node * block_bytes,
                "kv.offload.hbm_ratio",
            )
        elif off.per_replica_bytes:
            cap_bytes, path = float(off.per_replica_bytes * self.per_node), "kv.offload.preset"
        else:
            cap_bytes = float(dram)
        if cap_bytes > dram:
            raise KvsimError(
                f"a host tier of {cap_bytes:,.0f} bytes exceeds the node's host DRAM (cluster.host_dram: {dram:,})",
                source=sc.source,
                path=path,
            )
        blocks = int(cap_bytes // block_bytes)
        if blocks < 1:
            raise KvsimError(
                f"a host tier of {cap_bytes:,.0f} bytes holds no KV block of {block_bytes:,.0f} bytes",
                source=sc.source,
                path=path,
            )
        self.capacity_bytes = int(blocks * block_bytes)
        return blocks

    def _queue(self, link: Link, label: str) -> LinkQueue:
        """A link direction's queue: FIFO, or fair-shared (``cluster.topology.sharing: fair``)."""
        if self.sc.cluster.topology.sharing == "fair":
            return FairLinkQueue(link, label=label, env=self.env)
        return LinkQueue(link, label=label)

    def _link(self, node: int, name: str, group: int) -> LinkQueue:
        key = (node, name, group)
        q = self.links.get(key)
        if q is None:
            # network_out: a GPU NIC's outbound direction (full duplex: its own queue), used by
            # publications to dedicated pool nodes; network is the inbound one.
            link = self.sc.cluster.topology.link("network" if name == "network_out" else name)
            q = self.links[key] = self._queue(link, f"node{node}/{name}/{group}")
        return q

    def port(self, i: int, sched: Scheduler) -> OffloadPort:
        c, off = self.sc.cluster, self.sc.kv.offload
        tp = c.tensor_parallel
        node, local = divmod(i * tp, c.gpus_per_node)
        queues = []
        for name in ("host_h2d", "host_d2h"):
            share = c.topology.link(name).shared_by
            group = local // share
            on_link = sum(1 for g in range(local, local + tp) if g // share == group)
            queues.append((self._link(node, name, group), on_link))
        (h2d, n_h2d), (d2h, n_d2h) = queues
        if self.tiers is not None or self.pool is not None:
            sched.kv.pool.record_events()  # BlockStored / BlockRemoved feed the write paths
        glob = None
        if self.pool is not None:
            net_link = c.topology.network
            share = net_link.shared_by
            group = local // share
            on_net = sum(1 for g in range(local, local + tp) if g // share == group)
            glob = GlobalSide(
                self.pool,
                self.pool_ready,
                self._link(node, "network", group),
                self.block_bytes_per_gpu * on_net,
                node,
                self._fetch_policy(net_link, on_net),
                self.watchers,
            )
            if self.pool_in:
                glob.out = self._link(node, "network_out", group)
                glob.pool_in, glob.pool_out = self.pool_in, self.pool_out
                glob.pool_block_bytes = self.block_bytes
                glob.first_pool = c.nodes
            elif c.topology.sharing != "fair":  # a fetch also holds the home node's NIC on this rail
                glob.home_out = functools.partial(self._link, name="network_out", group=group)
        swap = None
        if self.swap is not None:
            swap = (self.swap[node], self._swap_policy(h2d.link, d2h.link, n_h2d, n_d2h))
        p = OffloadPort(
            self.env,
            sched,
            None if self.tiers is None else self.tiers[node],
            h2d,
            d2h,
            h2d_block_bytes=self.block_bytes_per_gpu * n_h2d,
            d2h_block_bytes=self.block_bytes_per_gpu * n_d2h,
            write=off.write,
            copy=off.copy,
            ready=self.ready[node],
            swap=swap,
            glob=glob,
            load_weight=self._load_weight(h2d.link, n_h2d),
            remote_weight=None if glob is None else self._remote_weight(c.topology.network, on_net),
            ssd=None if self.ssd is None else self.ssd[node],
            cold_after_steps=off.cold_after_steps if self.tiers is not None else 0,
            overlap=self._prefill_time if off.load == "overlap" else None,
        )
        self.watchers.append(p)
        first_on_node = all(q.node != node for q in self.ports) if self.ports else True
        if first_on_node and p.host is not None:
            p.sampled.append((f"node{node}/dram", p.host))
        if first_on_node and self.ssd is not None:
            p.sampled.append((f"node{node}/ssd", self.ssd[node].tier))
        if not self.ports and self.pool is not None:
            p.sampled.append(("global", self.pool))
            if isinstance(self.pool, PoolNodes):
                p.sampled.extend((sh.name, sh) for sh in self.pool.shards)
        if not self.ports:
            p.links_to_sample = self._queues
        p.node = node
        for q in self.ports:
            if q.host is not None and q.host is p.host:
                q.peers.append(p)
                p.peers.append(q)
        self.ports.append(p)
        return p

    def _swap_policy(self, h2d: Link, d2h: Link, n_h2d: int, n_d2h: int) -> Callable[[Request, int], bool]:
        """``swap``: always (where swap space allows); ``auto``: when the copies out and back over
        idle links of the blocks the victim holds (`Scheduler.swap_blocks`: its resident tokens'
        with token eviction on) take less than one prefill of its computed tokens (a request that
        evicted tokens recomputes its whole context, prompt and generated, and evicts again)."""
        if self.sc.scheduler.preemption == "swap":
            return lambda req, blocks: True
        cost, bpg = self.cost, self.block_bytes_per_gpu
        per_block = self.sc.kv.offload.copy is CopyMode.PER_BLOCK

        def cheaper(req: Request, blocks: int) -> bool:
            calls = blocks if per_block else 1
            swap_s = cost.transfer_time(blocks * bpg * n_d2h, d2h, calls) + cost.transfer_time(
                blocks * bpg * n_h2d, h2d, calls
            )
            recompute_s = cost.price(ForwardBatch.prefill(req.num_computed, 0, sampling=False)).seconds
            return swap_s < recompute_s

        return cheaper

    def _prefill_time(self, tokens: int, cached: int) -> float:
        """Seconds of one prefill chunk alone (``kv.offload.load: overlap``; pricing is pure)."""
        return self.cost.price(ForwardBatch.prefill(tokens, cached, sampling=False)).seconds

    def _load_weight(self, h2d: Link, n_h2d: int) -> float:
        """Seconds to load one 32-block entry over an idle H2D link / seconds to prefill its tokens
        (the cache-aware router's price of a token loaded from a lower tier, in computed tokens)."""
        bs, blocks = self.sc.kv.block_size, 32
        load_s = self.cost.transfer_time(blocks * self.block_bytes_per_gpu * n_h2d, h2d, 1)
        return min(1.0, load_s / self._prefill_time(blocks * bs, 0))

    def _remote_weight(self, net: Link, on_net: int) -> float:
        """`_load_weight` for an entry fetched over the network (from another node's share of the
        pool, or a pool node: through its NICs too, at the slower end's rate)."""
        bs, blocks = self.sc.kv.block_size, 32
        return min(1.0, self._fetch_time(blocks, net, on_net, 1) / self._prefill_time(blocks * bs, 0))

    def _fetch_time(self, blocks: int, net: Link, on_net: int, calls: int) -> float:
        """Seconds to fetch a remote pool entry of `blocks` blocks over idle links: this replica's
        network link carrying its GPUs' shares, and a pool node's NICs (every GPU's) too, the
        slower end's time."""
        fetch_s = self.cost.transfer_time(blocks * self.block_bytes_per_gpu * on_net, net, calls)
        if self.pool_link is not None:
            fetch_s = max(fetch_s, self.cost.transfer_time(blocks * self.block_bytes, self.pool_link, calls))
        return fetch_s

    def _fetch_policy(self, net: Link, on_net: int) -> Callable[[int], bool]:
        """``fetch: always``, or (``auto``) whether fetching a remote entry of `blocks` blocks over an
        idle network link takes less than recomputing its tokens (one prefill at no context: the
        cheapest recompute, so a deep prefix is, if anything, fetched too rarely)."""
        if self.sc.kv.global_pool.fetch == "always":
            return lambda blocks: True
        bs = self.sc.kv.block_size
        per_block = self.sc.kv.offload.copy is CopyMode.PER_BLOCK
        memo: dict[int, bool] = {}

        def worth(blocks: int) -> bool:
            ok = memo.get(blocks)
            if ok is None:
                fetch_s = self._fetch_time(blocks, net, on_net, blocks if per_block else 1)
                ok = memo[blocks] = fetch_s < self._prefill_time(blocks * bs, 0)
            return ok

        return worth

    def pool_record(self, seqs: list[Request], simulated: float) -> GlobalPoolRecord:
        pool = self.pool
        assert pool is not None
        bpg = self.block_bytes_per_gpu
        admitted = [s for s in seqs if s.num_cached_tokens >= 0]
        prompt = sum(s.prompt_len for s in admitted)
        first: dict[int, int] = {}
        for p in self.ports:
            first.update(p.stats.first_admission_global)
        got = sum(first.get(s.id, 0) for s in admitted)
        waits: dict[int, float] = {}
        for p in self.ports:
            waits.update(p.stats.waits)
        return GlobalPoolRecord(
            fetch=self.sc.kv.global_pool.fetch,
            capacity_bytes=int(pool.capacity_blocks * self.block_bytes),
            peak_bytes=int(pool.stats.peak_blocks * self.block_bytes),
            hit_rate_global=got / prompt if prompt else 0.0,
            fetched_tokens=sum(p.stats.fetched_tokens for p in self.ports),
            fetched_bytes=sum(p.stats.fetched_blocks for p in self.ports) * bpg,
            remote_bytes=sum(p.stats.remote_blocks for p in self.ports) * bpg,
            published_bytes=sum(p.stats.published_blocks for p in self.ports) * bpg,
            dropped_bytes=pool.stats.dropped_blocks * bpg,
            declined_lookups=sum(p.stats.declined for p in self.ports),
            eviction=self.sc.kv.global_pool.eviction,
            pool_nodes=self._pool_nodes_record(simulated) if isinstance(pool, PoolNodes) else None,
            requests_waited=len(waits),
            kv_wait_s=dist(np.array(list(waits.values()), dtype=np.float64)),
        )

    def _pool_nodes_record(self, simulated: float) -> PoolNodesRecord:
        pool = self.pool
        assert isinstance(pool, PoolNodes) and self.pool_link is not None
        gp, bb = self.sc.kv.global_pool, self.block_bytes
        return PoolNodesRecord(
            nodes=gp.pool_nodes,
            capacity_bytes_per_node=int(pool.shards[0].capacity_blocks * bb),
            peak_bytes=tuple(int(sh.stats.peak_blocks * bb) for sh in pool.shards),
            end_bytes=tuple(int(sh.used_blocks * bb) for sh in pool.shards),
            nics_per_node=gp.pool_node_nics,
            nic_bw_bytes_per_s=self.pool_link.bw_bytes_per_s,
            cost_per_hour_usd=gp.pool_node_usd_per_hour(self.sc.cluster.host_dram_bytes),
            cost_usd=simulated / 3600.0 * self.sc.pool_nodes_usd_per_hour,
        )

    def _queues(self) -> list[LinkQueue]:
        queues = [q for _, q in sorted(self.links.items())]
        for side in self.ssd or []:
            queues += [side.read, side.write]
        for qi, qo in zip(self.pool_in, self.pool_out, strict=True):
            queues += [qi, qo]
        return queues

    def link_samples(self) -> list[tuple[float, str, float, float]]:
        """Traffic of every link over time: (t, link, bytes, busy seconds asked for by t)."""
        return [row for p in self.ports for row in p.link_samples]

    def tier_samples(self) -> list[tuple[float, str, int]]:
        """Occupancy of every tier below HBM over time, bytes (a replica's blocks, all its GPUs)."""
        bb = self.block_bytes
        return sorted((t, name, int(blocks * bb)) for p in self.ports for t, name, blocks in p.samples)

    def swap_record(self) -> SwapRecord:
        assert self.swap is not None
        bpg = self.block_bytes_per_gpu
        return SwapRecord(
            mode=self.sc.scheduler.preemption.value,
            swap_space_bytes=int(self.swap[0].capacity_blocks * self.block_bytes),
            swaps=sum(p.stats.swaps_out for p in self.ports),
            recomputes=sum(p.stats.recomputed for p in self.ports),
            swapped_bytes=sum(p.stats.swapped_blocks for p in self.ports) * bpg,
            peak_bytes=int(max(s.peak_blocks for s in self.swap) * self.block_bytes),
        )

    def link_records(self, simulated: float) -> tuple[LinkRecord, ...]:
        span = simulated if simulated > 0 else math.inf
        queues = self._queues()
        for q in queues:
            q.settle(simulated)
        return tuple(
            LinkRecord(
                name=q.label,
                transfers=q.stats.transfers,
                bytes=q.stats.bytes,
                busy_s=(busy := q.busy_within(simulated)),
                utilization=busy / span,
                queued_s=q.stats.queued_s,
                backlog_s=_backlog(q.work_asked_s(), busy),
            )
            for q in queues
            if q.stats.transfers
        )

    def _readable_at(self, t: float) -> int:
        """Blocks the nodes' DRAM tiers hold readable at `t` (space taken by writes still in flight
        left out)."""
        seen: set[int] = set()
        blocks = 0
        for p in self.ports:
            if p.host is not None and id(p.host) not in seen:
                seen.add(id(p.host))
                blocks += p.readable_blocks(p.host, p.ready, t)
        return blocks

    def record(self, seqs: list[Request], simulated: float) -> OffloadRecord:
        assert self.tiers is not None
        off = self.sc.kv.offload
        bpg = self.block_bytes_per_gpu
        admitted = [s for s in seqs if s.num_cached_tokens >= 0]
        prompt = sum(s.prompt_len for s in admitted)
        hit = sum(s.num_cached_tokens for s in admitted)
        first: dict[int, int] = {}
        waits: dict[int, float] = {}
        for p in self.ports:
            first.update(p.stats.first_admission_tokens)
            waits.update(p.stats.waits)
        dram_hit = sum(first.get(s.id, 0) for s in admitted)
        pool_first: dict[int, int] = {}
        for p in self.ports:
            pool_first.update(p.stats.first_admission_global)
        pool_hit = sum(pool_first.get(s.id, 0) for s in admitted)
        ssd_first: dict[int, int] = {}
        for p in self.ports:
            ssd_first.update(p.stats.first_admission_ssd)
        ssd_hit = sum(ssd_first.get(s.id, 0) for s in admitted)
        tp = self.sc.cluster.tensor_parallel
        return OffloadRecord(
            preset=off.preset,
            eviction=off.eviction,
            write=off.write.value,
            copy=off.copy.value,
            host_capacity_bytes=self.capacity_bytes,
            host_peak_bytes=int(max(t.stats.peak_blocks for t in self.tiers) * bpg * tp),
            host_end_bytes=int(self._readable_at(simulated) * bpg * tp),
            hit_rate_hbm=(hit - dram_hit - pool_hit - ssd_hit) / prompt if prompt else 0.0,
            hit_rate_ssd=ssd_hit / prompt if prompt else 0.0,
            ssd_capacity_bytes=0
            if self.ssd is None
            else int(self.ssd[0].tier.capacity_blocks * self.block_bytes),
            ssd_written_bytes=sum(p.arrived_by(p.ssd_write_log, simulated) for p in self.ports)
            * self.block_bytes,
            ssd_loaded_bytes=sum(p.stats.ssd_loaded_blocks for p in self.ports) * self.block_bytes,
            cold_demoted_bytes=sum(p.sched.kv.pool.demoted for p in self.ports) * bpg,
            hit_rate_dram=dram_hit / prompt if prompt else 0.0,
            loads=sum(p.stats.loads for p in self.ports),
            loaded_tokens=sum(p.stats.loaded_tokens for p in self.ports),
            loaded_bytes=sum(p.stats.loaded_blocks for p in self.ports) * bpg,
            written_bytes=(written := sum(p.arrived_by(p.write_log, simulated) for p in self.ports)) * bpg,
            write_backlog_bytes=(sum(p.stats.written_blocks for p in self.ports) - written) * bpg,
            dropped_bytes=sum(t.stats.dropped_blocks for t in self.tiers) * bpg,
            requests_waited=len(waits),
            kv_wait_s=dist(np.array(list(waits.values()), dtype=np.float64)),
        )


def _backlog(asked: float, done: float) -> float:
    """Occupancy asked for that the run left undone; 0 within float noise of the two sums."""
    left = asked - done
    return left if left > 1e-9 * max(1.0, asked) else 0.0


def _pin_keys(sc: Scenario, wl: Workload) -> frozenset[int]:
    """Entry keys of the pinned segments' blocks (the workload names them by block id)."""
    if wl.agent is None:
        raise KvsimError(
            "pinning needs a workload with marked segments (workload.agent)",
            source=sc.source,
            path="kv.prefix_cache.pin",
        )
    keys: set[int] = set()
    for seg in sc.kv.pin_segments:
        keys |= wl.agent.segment_ids[seg]
    return frozenset(keys)


def _session_record(
    sc: Scenario, wl: Workload, seqs: list[Request], replicas: list[Replica]
) -> SessionRecord:
    """Agent sessions: how many completed every turn, their durations, and the prompt by segment."""
    from kvsim.spec.agent import SEGMENTS

    agent = wl.agent
    assert agent is not None
    sent = np.zeros(len(wl), dtype=bool)
    done = np.zeros(len(wl), dtype=bool)
    arrive = np.full(len(wl), np.nan)
    finish = np.full(len(wl), np.nan)
    for s in seqs:
        sent[s.id] = True
        arrive[s.id] = s.arrival_s
        if s.status is RequestStatus.FINISHED:
            done[s.id] = True
            finish[s.id] = s.finish_s
    ns = agent.num_sessions
    turns = np.bincount(agent.session, minlength=ns)
    turns_done = np.bincount(agent.session, weights=done, minlength=ns)
    complete = turns_done == turns
    start = np.full(ns, np.nan)
    end = np.full(ns, np.nan)
    first = agent.turn == 0
    start[agent.session[first]] = arrive[first]
    last = agent.next_request < 0
    end[agent.session[last]] = finish[last]
    durations = (end - start)[complete]
    tokens = agent.segment_tokens[sent].sum(axis=0)
    total = max(int(tokens.sum()), 1)
    return SessionRecord(
        sessions=ns,
        completed=int(complete.sum()),
        turns=len(wl),
        turns_sent=int(sent.sum()),
        turns_completed=int(done.sum()),
        closed_loop=agent.closed_loop,
        duration_s=_dist(durations),
        prompt_tokens_by_segment={k: int(v) for k, v in zip(SEGMENTS, tokens.tolist(), strict=True)},
        prompt_share_by_segment={k: float(v) / total for k, v in zip(SEGMENTS, tokens.tolist(), strict=True)},
        pinned_segments=tuple(sc.kv.pin_segments),
        pinned_blocks_peak=max(r.sched.kv.pool.pinned_peak for r in replicas),
    )


def _spec_decode(sc: Scenario, cost: CostModel) -> tuple[SpecDecoder | None, DraftCost | None]:
    """Speculative decoding's acceptance model and draft cost (None, None when off)."""
    cfg = sc.scheduler.spec_decode
    if cfg is None:
        return None, None
    spec = SpecDecoder(cfg.k, mean=cfg.mean, concentration=cfg.concentration, seed=sc.sim.seed)
    c = sc.cluster
    if cfg.draft_model is not None:  # the draft model on the same GPUs, by the analytic model
        dm = AnalyticCostModel(cfg.draft_model, c.gpu, c.tensor_parallel, sc.kv.format, c.topology)
        return spec, DraftCost(dm, dm.overhead_s, kind="model")
    # A pass of so many rows does not pay the loop's time at those rows again (a measured profile's
    # `step_overhead` grows with them).
    overhead = getattr(cost, "step_overhead", None) or float(getattr(cost, "overhead_s", 0.0))
    return spec, DraftCost(cost, overhead, scale=cfg.layer_fraction / sc.model.num_layers, kind="mtp")


def _spec_record(
    sc: Scenario, spec: SpecDecoder, replicas: list[Replica], plan: MemoryPlan
) -> SpecDecodeRecord:
    cfg = sc.scheduler.spec_decode
    assert cfg is not None
    rows = spec.verify_rows
    hist = spec.accepted_hist
    return SpecDecodeRecord(
        k=cfg.k,
        acceptance="constant" if cfg.concentration is None else "beta",
        acceptance_mean=cfg.mean,
        acceptance_concentration=cfg.concentration,
        draft=cfg.draft_kind,
        draft_model=None if cfg.draft_model is None else cfg.draft_model.name,
        layer_fraction=cfg.layer_fraction if cfg.draft_model is None else None,
        verify_rows=rows,
        drafted_tokens=spec.drafted_tokens,
        accepted_tokens=spec.accepted_tokens,
        accepted_per_step_mean=spec.accepted_tokens / rows if rows else None,
        tokens_per_step_mean=(spec.accepted_tokens + rows) / rows if rows else None,
        accepted_per_step_hist=tuple(hist),
        acceptance_rate_observed=spec.accepted_tokens / spec.drafted_tokens if spec.drafted_tokens else None,
        kv_discarded_tokens=spec.discarded_tokens,
        kv_discarded_bytes=int(spec.discarded_tokens * plan.block_bytes_per_gpu / sc.kv.block_size),
        lookahead_slots_per_request=cfg.k,
        draft_s=sum(r.stats.draft_s for r in replicas),
        rollback="vllm_v1: num_computed rewound, blocks kept until the request ends",
    )


def _dist(x: np.ndarray) -> Distribution:
    if not len(x):
        return Distribution(mean=None, p50=None, p90=None, p99=None, p999=None)
    p = np.percentile(x, [50, 90, 99, 99.9])
    return Distribution(
        mean=float(x.mean()), p50=float(p[0]), p90=float(p[1]), p99=float(p[2]), p999=float(p[3])
    )


def _eviction_record(
    sc: Scenario, replicas: list[Replica], plan: MemoryPlan, simulated: float
) -> EvictionRecord:
    kvs = [r.sched.kv for r in replicas]
    ev = sc.kv.eviction
    return EvictionRecord(
        policy=ev.policy.value,
        trigger=ev.trigger.value,
        pages=ev.pages.value,
        heavy_ratio=ev.heavy_ratio if ev.policy == "h2o" else None,
        keep_ratio=ev.keep_ratio if ev.policy == "entropy" else None,
        recent_tokens=ev.recent_tokens,
        sink_tokens=ev.sink_tokens if ev.policy == "streaming" else 0,
        budget_tokens=ev.budget_tokens,
        tokens_evicted=sum(k.tokens_evicted for k in kvs),
        trims=sum(k.trims for k in kvs),
        blocks_released=sum(k.blocks_released for k in kvs),
        blocks_copied=sum(k.blocks_copied for k in kvs),
        cache_entries_invalidated=sum(k.entries_uncached for k in kvs),
        trim_s=sum(r.stats.eviction_s for r in replicas),
        accuracy=part_from_dict(
            AccuracyNote, eviction_accuracy(ev), source="kvsim.accuracy", path="eviction.accuracy"
        ),
    )


def _window_record(sc: Scenario, replicas: list[Replica]) -> SlidingWindowRecord:
    kvs = [r.sched.kv for r in replicas]
    m = sc.model
    return SlidingWindowRecord(
        window_tokens=m.sliding_window,
        global_tokens=m.global_tokens,
        windowed_kv_layers=m.windowed_kv_layers(),
        kv_layers=m.kv_layers,
        tokens_out_of_window=sum(k.tokens_evicted for k in kvs),
        blocks_freed=sum(k.blocks_released for k in kvs),
        blocks_copied=sum(k.blocks_copied for k in kvs),
        cache_entries_invalidated=sum(k.entries_uncached for k in kvs),
    )


def _switch_record(sc: Scenario, replicas: list[Replica]) -> FormatSwitchRecord:
    kvs = [r.sched.kv for r in replicas]
    sw = sc.kv.format_switch
    assert sw is not None
    note = accuracy_note(
        sw.format,
        f"applies to the tokens of sequences past {sw.after_tokens:,} tokens (re-quantized there); "
        f"below it the cache is {sc.kv.format.name}",
    )
    return FormatSwitchRecord(
        after_tokens=sw.after_tokens,
        format=sw.format.name,
        requests_switched=len(set().union(*(k.switched_ids for k in kvs))),
        switches=sum(k.trims for k in kvs),
        tokens_requantized=sum(k.tokens_requantized for k in kvs),
        requant_s=sum(r.stats.eviction_s for r in replicas),
        blocks_freed=sum(k.blocks_released for k in kvs),
        blocks_copied=sum(k.blocks_copied for k in kvs),
        cache_entries_invalidated=sum(k.entries_uncached for k in kvs),
        accuracy=None
        if note is None
        else part_from_dict(AccuracyNote, note, source="kvsim.accuracy", path="format_switch.accuracy"),
    )


def _drive(env: simpy.Environment, span: float, end_s: float, progress: bool) -> None:
    if not progress or span <= 0:
        env.run(until=end_s if math.isfinite(end_s) else None)
        return
    horizon = min(span, end_s)
    if not sys.stdout.isatty():  # piped or logged: a plain line at each quarter (on stderr), no bar
        t0 = time.perf_counter()
        for k in range(1, 5):
            env.run(until=horizon * k / 4)
            print(
                f"simulated {env.now:,.0f}/{horizon:,.0f} s of arrivals ({25 * k}%) "
                f"in {time.perf_counter() - t0:,.1f} s",
                file=sys.stderr,
                flush=True,
            )
        if not math.isfinite(end_s):
            env.run()
        elif env.now < end_s:
            env.run(until=end_s)
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(
        TextColumn("simulating"),
        BarColumn(),
        TextColumn("{task.completed:,.0f}/{task.total:,.0f} s"),
        TimeRemainingColumn(),
        transient=True,
    ) as bar:
        task = bar.add_task("sim", total=horizon)
        steps = 50
        for k in range(1, steps + 1):
            env.run(until=horizon * k / steps)
            bar.update(task, completed=env.now)
    if not math.isfinite(end_s):
        env.run()
    elif env.now < end_s:
        env.run(until=end_s)


def _pool_node_sources(sc: Scenario) -> tuple[tuple[str, str], ...]:
    """The sources of the dedicated pool nodes' defaults the run uses (with pool nodes on, whatever
    they cost): their DRAM unless ``pool_node_bytes`` is given, their price unless
    ``pool_node_cost_per_hour`` is, their NICs always (a count given equal to the default is not
    told apart)."""
    gp = sc.kv.global_pool
    if sc.kv.prefix_cache != "global" or not gp.pool_nodes:
        return ()
    given = {
        "pool node dram": bool(gp.pool_node_bytes),
        "pool node price": gp.pool_node_cost_per_hour is not None,
    }
    return tuple((k, v) for k, v in POOL_NODE_SOURCES if not given.get(k, False))


def _config(sc: Scenario, cost: CostModel, wl: Workload) -> RunConfig:
    return RunConfig(
        model=sc.model.name,
        attention=sc.model.attention.value,
        gpu=sc.cluster.gpu.name,
        num_gpus=sc.cluster.num_gpus,
        tensor_parallel=sc.cluster.tensor_parallel,
        replicas=sc.cluster.num_replicas,
        router=sc.cluster.router,
        kv_format=sc.kv.format.name,
        kv_format_mix="" if sc.kv.format_mix is None else sc.kv.format_mix.name,
        kv_format_switch="" if sc.kv.format_switch is None else sc.kv.format_switch.name,
        block_size=sc.kv.block_size,
        prefix_cache=sc.kv.prefix_cache,
        max_num_seqs=sc.scheduler.max_num_seqs,
        max_batched_tokens=sc.scheduler.max_batched_tokens,
        chunked_prefill=sc.scheduler.chunked_prefill,
        cost_model=cost.name,
        gpu_hour_usd=sc.gpu_hour_usd,
        trace=str(wl.source),
        trace_format=sc.workload.format,
        rate_scale=sc.workload.rate_scale,
        seed=sc.sim.seed,
        fast_forward=sc.sim.fast_forward,
        overrides=tuple(sc.overrides),
        sources=dict(
            [
                *sc.cluster.gpu.sources,
                ("price", sc.gpu_price.source_line),
                *sc.cluster.topology.sources,
                *_pool_node_sources(sc),
            ]
        ),
        clip_to_context=sc.workload.clip_to_context,
        scenario_path=sc.source,
        profile="" if sc.cost_model.profile is None else str(sc.cost_model.profile),
    )


def _replica_records(
    replicas: list[Replica], seqs: list[Request], simulated: float
) -> tuple[ReplicaRecord, ...]:
    routed = np.zeros(len(replicas), np.int64)
    preempted = np.zeros(len(replicas), np.int64)
    for s in seqs:
        if s.replica >= 0:
            routed[s.replica] += 1
            preempted[s.replica] += s.preemptions
    span = simulated if simulated > 0 else math.inf
    return tuple(
        ReplicaRecord(
            index=r.index,
            requests=int(routed[r.index]),
            steps=r.stats.steps,
            busy_fraction=r.stats.busy_s / span,
            kv_peak_used_blocks=r.sched.kv.peak_used_blocks,
            kv_mean_used_blocks=r.stats.kv_block_s / span,
            preemptions=int(preempted[r.index]),
        )
        for r in replicas
    )


def write_run(result: RunResult, out: Path | str, *, compress: bool = False) -> None:
    """``summary.json``, ``requests.csv`` and ``timeseries.csv`` (the report is built from them),
    and ``tiers.csv`` and ``links.csv`` when the run has samples for them. `compress`: each CSV as
    ``NAME.csv.gz`` (a sweep's or plan's points). What an earlier run left under a CSV's other
    form, or under one this run has no rows for, is removed (the CLI has checked it is kvsim's)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_summary(out / "summary.json", result.record)
    written = {"requests.csv", "timeseries.csv"}
    write_requests_csv(out / csv_name("requests.csv", compress), result.seqs)
    samples = [row for s in result.stats for row in s.samples]
    write_timeseries_csv(out / csv_name("timeseries.csv", compress), samples)
    if result.tier_samples:
        write_tiers_csv(out / csv_name("tiers.csv", compress), result.tier_samples)
        written.add("tiers.csv")
    if result.link_samples:
        write_links_csv(out / csv_name("links.csv", compress), result.link_samples)
        written.add("links.csv")
    for name in ("requests.csv", "timeseries.csv", "tiers.csv", "links.csv"):
        for form in (not compress,) if name in written else (compress, not compress):
            stale = out / csv_name(name, form)
            if stale.exists():
                stale.unlink()

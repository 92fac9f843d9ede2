"""The run's summary: the `RunSummary` record built from an assembled run's parts after it ran
(requests, replicas, the tiers below HBM and their links, eviction, sessions, speculative
decoding) and the warnings the run gives. Reads the parts, changes nothing but the link queues'
settled busy time (`LinkQueue.settle`). Design: docs/architecture.md ("The run, assembled").
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from kvsim.accuracy import accuracy_estimate, accuracy_note, eviction_accuracy
from kvsim.core.memory_plan import MemoryPlan
from kvsim.core.request import Request, RequestStatus
from kvsim.core.spec_decode import SpecDecoder
from kvsim.core.tiers import PoolNodes
from kvsim.costs.base import CostModel
from kvsim.results.record import (
    AccuracyEstimate,
    AccuracyNote,
    AutoscaleRecord,
    BusyFraction,
    DisaggregationRecord,
    Distribution,
    DrawnFaultRecord,
    EvictionRecord,
    FaultsRecord,
    FormatSwitchRecord,
    GlobalPoolRecord,
    LinkRecord,
    OffloadRecord,
    OutageRecord,
    PoolNodesRecord,
    RandomFaultsRecord,
    ReplicaRecord,
    ReplicasUp,
    RequestCounts,
    RoleRecord,
    RunConfig,
    RunSummary,
    SessionRecord,
    SlidingWindowRecord,
    SpecDecodeRecord,
    SwapRecord,
    WorkloadRecord,
    part_from_dict,
)
from kvsim.results.summary import dist, summarize, weighted_dist
from kvsim.sim.assembly import AssembledRun
from kvsim.sim.autoscale import Autoscaler
from kvsim.sim.faults import Faults
from kvsim.sim.links import LinkQueue
from kvsim.sim.offload_wiring import OffloadWiring
from kvsim.sim.replica import Replica
from kvsim.spec.scenario import POOL_NODE_SOURCES, Scenario
from kvsim.spec.workload import Workload

# Below this share of busy time priced over prefixes past the tables, no warning: on the default
# scenario it is under 0.1% (a prompt's later chunks over its earlier ones), which changes no
# decision and would put a warning on every run.
EXTRAPOLATED_WARN_SHARE = 1e-3


def typical_shape(finished: list[Request], busy_s: float) -> tuple[int, float] | None:
    """The run's typical decode step, from its finished requests (the same with fast-forward and
    stepping): the sequences decoding at once on average over the replicas' busy time (each request
    decodes from its first token to its finish), and their context weighted by that time (a request's
    prompt plus half its answer); None without a request that decoded."""
    spans = [
        (s.finish_s - s.first_token_s, s.prompt_len + s.output_len / 2)
        for s in finished
        if s.output_len > 1 and s.finish_s > s.first_token_s
    ]
    decoding = math.fsum(d for d, _ in spans)
    if decoding <= 0.0 or busy_s <= 0.0:
        return None
    return max(1, round(decoding / busy_s)), math.fsum(d * c for d, c in spans) / decoding


def run_summary(
    sc: Scenario,
    run: AssembledRun,
    plan: MemoryPlan,
    cost: CostModel,
    *,
    simulated: float,
    wall: float,
    t0: float,
    percentiles: tuple[float, ...] = (),
    role_plans: tuple[MemoryPlan, MemoryPlan] | None = None,
) -> RunSummary:
    """`run`'s summary after it ran to `simulated` s (`wall` s of CPU wall time for the drive, `t0`
    the `time.perf_counter` at the run's start); `percentiles` also in each latency distribution.
    `role_plans`: a disaggregated run's prefill and decode memory plans (`plan` is the decode
    pool's, which the memory fields describe)."""
    wl, seqs, replicas, offload = run.wl, run.seqs, run.replicas, run.offload
    evictor, window, switch, spec = run.evictor, run.window, run.switch, run.spec
    end_s, agent, max_ctx = run.end_s, wl.agent, sc.model.max_context
    stats = [r.stats for r in replicas]
    scaler = run.autoscaler
    gpu_seconds = None
    if scaler is not None:  # billed: the replicas up, each of its GPUs
        scaler.settle_drains(simulated)
        gpu_seconds = scaler.replica_seconds(simulated) * sc.cluster.replica_gpus
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
        count_failed=run.faults is not None,
        gpu_seconds=gpu_seconds,
    )
    finished = [s for s in seqs if s.status is RequestStatus.FINISHED]
    finished_ids = {s.id for s in finished}
    pooled = [r.gaps.pooled(finished_ids) for r in replicas]
    # A request's gaps add up to finish - first token: the mean from those spans, which (unlike a
    # sum of the gaps) does not depend on how windows grouped them.
    multi = [s for s in finished if s.output_len > 1]
    itl_tokens = sum(s.output_len - 1 for s in multi)
    gap_values = np.concatenate([v for v, _ in pooled])
    gap_counts = np.concatenate([c for _, c in pooled])
    del pooled  # the replicas' copies: a long run's gaps are millions
    parts["itl_s"] = weighted_dist(
        gap_values,
        gap_counts,
        percentiles,
        mean=math.fsum(s.finish_s - s.first_token_s for s in multi) / itl_tokens if itl_tokens else None,
    )
    del gap_values, gap_counts
    parts["percentiles"] = percentiles
    counts: RequestCounts = parts["requests"]
    warnings = cost.warnings(frozenset().union(*(r.off_grid for r in replicas)))  # what ran
    shape = typical_shape(finished, math.fsum(s.busy_s for s in stats))
    if shape is not None:  # a profile and the fitted model on the format's direction, once per run
        warnings.extend(cost.format_sign_warnings(*shape))
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
    if sc.cluster.parallel is not None:
        warnings.append(_layout_note(sc, plan))
    if sc.kv.format_note:
        warnings.append(sc.kv.format_note)
    peak_occ = max(r.sched.kv.peak_occupied_blocks for r in replicas)
    note = accuracy_note(sc.kv.format, sc.kv.format_note, sc.kv.format_mix)
    return RunSummary(
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
        replicas=_replica_records(
            replicas, seqs, simulated, None if run.handoff is None else run.handoff.prefilled
        ),
        offload=None
        if offload is None or offload.tiers is None
        else _offload_record(offload, seqs, simulated),
        swap=None if offload is None or offload.swap is None else _swap_record(offload),
        global_pool=None
        if offload is None or offload.pool is None
        else _pool_record(offload, seqs, simulated),
        links=_queue_records(run.handoff.queues(), simulated)
        if run.handoff is not None
        else (() if offload is None else _link_records(offload, simulated)),
        sessions=None if agent is None else _session_record(sc, wl, seqs, replicas),
        eviction=None if evictor is None else _eviction_record(sc, replicas, plan, simulated),
        sliding_window=None if window is None else _window_record(sc, replicas),
        format_switch=None if switch is None else _switch_record(sc, replicas),
        spec_decode=None if spec is None else _spec_record(sc, spec, replicas, plan),
        disaggregation=None
        if run.handoff is None or role_plans is None
        else _disagg_record(sc, run, role_plans, simulated),
        faults=None if run.faults is None else _faults_record(run.faults, simulated),
        autoscale=None if scaler is None else _autoscale_record(scaler, simulated),
    )


def _autoscale_record(a: Autoscaler, simulated: float) -> AutoscaleRecord:
    """What the autoscaler did over [0, simulated]: its counts, the capacity timeline and the
    replica-seconds the GPU-hours come from."""
    ts, ns = a.timeline(simulated)
    rs = a.replica_seconds(simulated)
    c = a.cfg
    return AutoscaleRecord(
        policy=str(c.policy),
        target=c.target,
        min_replicas=c.min_replicas,
        max_replicas=c.max_replicas,
        initial_replicas=c.initial_replicas,
        interval_s=c.interval_s,
        cool_down_s=c.cool_down_s,
        scale_up_delay_s=a.delay_s,
        scale_up_delay_source=a.delay_source,
        scale_ups=a.scale_ups,
        scale_downs=a.scale_downs,
        replica_s=rs,
        replicas_up=ReplicasUp(
            min=min(ns), max=max(ns), mean=rs / simulated if simulated > 0 else float(ns[0])
        ),
        timeline_t_s=tuple(ts),
        timeline_replicas=tuple(ns),
    )


def _faults_record(f: Faults, simulated: float) -> FaultsRecord:
    """The outages (those that began within the run) and what they cost; down time clipped to
    the simulated time."""
    outages = tuple(
        OutageRecord(
            replica=o.replica,
            down_s=o.down_s,
            up_s=o.up_s,
            reload_s=o.reload_s,
            requests_dropped=o.requests_dropped,
            kv_blocks_lost=o.kv_blocks_lost,
        )
        for o in f.outages
        if o.down_s <= simulated
    )
    return FaultsRecord(
        outages=outages,
        retries=f.requeued,
        failed=f.failed,
        max_retries=f.cfg.max_retries,
        lost_prompt_tokens=f.lost_prompt_tokens,
        lost_output_tokens=f.lost_output_tokens,
        recomputed_tokens=f.lost_prompt_tokens + f.lost_output_tokens,
        kv_blocks_lost=sum(o.kv_blocks_lost for o in outages),
        replica_down_s=math.fsum(min(o.up_s, simulated) - o.down_s for o in outages),
        reload_s=f.outages[0].reload_s if f.outages else 0.0,
        reload_bw_bytes_per_s=f.cfg.reload_bw_bytes_per_s,
        reload_source=f.cfg.reload_source,
        router_queue_peak=f.queue.peak,
        random=_random_faults_record(f),
    )


def _random_faults_record(f: Faults) -> RandomFaultsRecord | None:
    r = f.cfg.random
    if r is None:
        return None
    n = f.num_components
    return RandomFaultsRecord(
        kind=str(r.kind),
        rate_per_hour=r.rate_per_hour,
        mean_down_s=r.mean_down_s,
        seed=r.seed,
        components=n,
        span_s=f.drawn_span_s,
        expected=r.rate_per_hour * f.drawn_span_s / 3600.0 * n,
        drawn=len(f.drawn),
        down_s=math.fsum(e.duration_s for e in f.drawn),
        events=tuple(
            DrawnFaultRecord(at_s=e.at_s, target=e.target, duration_s=e.duration_s) for e in f.drawn
        ),
    )


def _disagg_record(
    sc: Scenario, run: AssembledRun, plans: tuple[MemoryPlan, MemoryPlan], simulated: float
) -> DisaggregationRecord:
    cfg, h = sc.cluster.disaggregation, run.handoff
    assert cfg is not None and h is not None
    span = simulated if simulated > 0 else math.inf
    n_p = cfg.prefill.replicas
    pools = (run.replicas[:n_p], run.replicas[n_p:])
    # every request admitted but those prefilled on the decode pool (conditional disaggregation)
    routed_p = sum(1 for s in run.seqs if s.status is not RequestStatus.REJECTED) - h.local_prefills
    routed = (routed_p, sum(1 for s in run.seqs if s.replica >= n_p))
    roles = []
    for pool, reps, plan, n in zip(cfg.pools, pools, plans, routed, strict=True):
        busy = [r.stats.busy_s / span for r in reps]
        roles.append(
            RoleRecord(
                role=pool.role,
                gpu=pool.gpu.name,
                tensor_parallel=pool.tensor_parallel,
                replicas=pool.replicas,
                gpus=pool.num_gpus,
                gpu_hour_usd=pool.price.usd_per_hour,
                cost_usd=pool.num_gpus * pool.price.usd_per_hour * simulated / 3600.0,
                requests=n,
                busy_fraction=BusyFraction(mean=sum(busy) / len(busy), max=max(busy)),
                kv_blocks_per_replica=plan.num_blocks,
                kv_peak_used_blocks=max(r.sched.kv.peak_used_blocks for r in reps),
                kv_mean_used_blocks=sum(r.stats.kv_block_s for r in reps) / len(reps) / span,
            )
        )
    tr = h.transfers
    landed = np.array([x.landed_s for x in tr], dtype=np.float64)
    reserved = np.array([x.reserved_s for x in tr], dtype=np.float64)
    ended = np.array([x.prefill_end_s for x in tr], dtype=np.float64)
    links = [q.busy_within(simulated) / span for q in h.queues()]
    return DisaggregationRecord(
        roles=tuple(roles),
        transfers=len(tr),
        transferred_bytes=math.fsum(x.bytes for x in tr),
        transfer_s=dist(landed - reserved),
        block_wait_s=dist(reserved - ended),
        handoff_s=dist(landed - ended),
        link_busy_fraction=BusyFraction(
            mean=sum(links) / len(links) if links else 0.0, max=max(links, default=0.0)
        ),
        local_prefills=h.local_prefills,
    )


def _merged(off: OffloadWiring, stat: str) -> dict[int, Any]:
    """One per-request statistic of every replica's offload port (`OffloadStats.<stat>`), merged:
    request id -> value (a request is admitted by one replica)."""
    out: dict[int, Any] = {}
    for p in off.ports:
        out.update(getattr(p.stats, stat))
    return out


def _pool_record(off: OffloadWiring, seqs: list[Request], simulated: float) -> GlobalPoolRecord:
    pool = off.pool
    assert pool is not None
    bpg = off.block_bytes_per_gpu
    admitted = [s for s in seqs if s.num_cached_tokens >= 0]
    prompt = sum(s.prompt_len for s in admitted)
    first = _merged(off, "first_admission_global")
    got = sum(first.get(s.id, 0) for s in admitted)
    waits = _merged(off, "waits")
    return GlobalPoolRecord(
        fetch=off.sc.kv.global_pool.fetch,
        capacity_bytes=int(pool.capacity_blocks * off.block_bytes),
        peak_bytes=int(pool.stats.peak_blocks * off.block_bytes),
        hit_rate_global=got / prompt if prompt else 0.0,
        fetched_tokens=sum(p.stats.fetched_tokens for p in off.ports),
        fetched_bytes=sum(p.stats.fetched_blocks for p in off.ports) * bpg,
        remote_bytes=sum(p.stats.remote_blocks for p in off.ports) * bpg,
        published_bytes=sum(p.stats.published_blocks for p in off.ports) * bpg,
        dropped_bytes=pool.stats.dropped_blocks * bpg,
        declined_lookups=sum(p.stats.declined for p in off.ports),
        eviction=off.sc.kv.global_pool.eviction,
        pool_nodes=_pool_nodes_record(off, simulated) if isinstance(pool, PoolNodes) else None,
        requests_waited=len(waits),
        kv_wait_s=dist(np.array(list(waits.values()), dtype=np.float64)),
    )


def _pool_nodes_record(off: OffloadWiring, simulated: float) -> PoolNodesRecord:
    pool = off.pool
    assert isinstance(pool, PoolNodes) and off.pool_link is not None
    gp, bb = off.sc.kv.global_pool, off.block_bytes
    return PoolNodesRecord(
        nodes=gp.pool_nodes,
        capacity_bytes_per_node=int(pool.shards[0].capacity_blocks * bb),
        peak_bytes=tuple(int(sh.stats.peak_blocks * bb) for sh in pool.shards),
        end_bytes=tuple(int(sh.used_blocks * bb) for sh in pool.shards),
        nics_per_node=gp.pool_node_nics,
        nic_bw_bytes_per_s=off.pool_link.bw_bytes_per_s,
        cost_per_hour_usd=gp.pool_node_usd_per_hour(off.sc.cluster.host_dram_bytes),
        cost_usd=simulated / 3600.0 * off.sc.pool_nodes_usd_per_hour,
    )


def _swap_record(off: OffloadWiring) -> SwapRecord:
    assert off.swap is not None
    bpg = off.block_bytes_per_gpu
    return SwapRecord(
        mode=off.sc.scheduler.preemption.value,
        swap_space_bytes=int(off.swap[0].capacity_blocks * off.block_bytes),
        swaps=sum(p.stats.swaps_out for p in off.ports),
        recomputes=sum(p.stats.recomputed for p in off.ports),
        swapped_bytes=sum(p.stats.swapped_blocks for p in off.ports) * bpg,
        peak_bytes=int(max(s.peak_blocks for s in off.swap) * off.block_bytes),
    )


def _link_records(off: OffloadWiring, simulated: float) -> tuple[LinkRecord, ...]:
    return _queue_records(off.queues(), simulated)


def _queue_records(queues: list[LinkQueue], simulated: float) -> tuple[LinkRecord, ...]:
    span = simulated if simulated > 0 else math.inf
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


def _offload_record(w: OffloadWiring, seqs: list[Request], simulated: float) -> OffloadRecord:
    assert w.tiers is not None
    off = w.sc.kv.offload
    bpg = w.block_bytes_per_gpu
    admitted = [s for s in seqs if s.num_cached_tokens >= 0]
    prompt = sum(s.prompt_len for s in admitted)
    hit = sum(s.num_cached_tokens for s in admitted)
    waits = _merged(w, "waits")
    first, pool_first, ssd_first = (
        _merged(w, f"first_admission_{tier}") for tier in ("tokens", "global", "ssd")
    )
    dram_hit = sum(first.get(s.id, 0) for s in admitted)
    pool_hit = sum(pool_first.get(s.id, 0) for s in admitted)
    ssd_hit = sum(ssd_first.get(s.id, 0) for s in admitted)
    tp = w.sc.cluster.tensor_parallel
    return OffloadRecord(
        preset=off.preset,
        eviction=off.eviction,
        write=off.write.value,
        copy=off.copy.value,
        host_capacity_bytes=w.capacity_bytes,
        host_peak_bytes=int(max(t.stats.peak_blocks for t in w.tiers) * bpg * tp),
        host_end_bytes=int(w.readable_at(simulated) * bpg * tp),
        hit_rate_hbm=(hit - dram_hit - pool_hit - ssd_hit) / prompt if prompt else 0.0,
        hit_rate_ssd=ssd_hit / prompt if prompt else 0.0,
        ssd_capacity_bytes=0 if w.ssd is None else int(w.ssd[0].tier.capacity_blocks * w.block_bytes),
        ssd_written_bytes=sum(p.arrived_by(p.ssd_write_log, simulated) for p in w.ports) * w.block_bytes,
        ssd_loaded_bytes=sum(p.stats.ssd_loaded_blocks for p in w.ports) * w.block_bytes,
        cold_demoted_bytes=sum(p.sched.kv.pool.demoted for p in w.ports) * bpg,
        hit_rate_dram=dram_hit / prompt if prompt else 0.0,
        loads=sum(p.stats.loads for p in w.ports),
        loaded_tokens=sum(p.stats.loaded_tokens for p in w.ports),
        loaded_bytes=sum(p.stats.loaded_blocks for p in w.ports) * bpg,
        written_bytes=(written := sum(p.arrived_by(p.write_log, simulated) for p in w.ports)) * bpg,
        write_backlog_bytes=(sum(p.stats.written_blocks for p in w.ports) - written) * bpg,
        dropped_bytes=sum(t.stats.dropped_blocks for t in w.tiers) * bpg,
        requests_waited=len(waits),
        kv_wait_s=dist(np.array(list(waits.values()), dtype=np.float64)),
    )


def _backlog(asked: float, done: float) -> float:
    """Occupancy asked for that the run left undone; 0 within float noise of the two sums."""
    left = asked - done
    return left if left > 1e-9 * max(1.0, asked) else 0.0


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
        segment_policies={} if sc.kv.segments is None else sc.kv.segments.describe(),
        segment_dropped_blocks=sum(r.sched.kv.pool.dropped for r in replicas),
    )


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
        merge_ratio=ev.merge_ratio if ev.policy == "merge" else None,
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


def _layout_note(sc: Scenario, plan: MemoryPlan) -> str:
    """The run's layout (MoE, PP, CP), its weights per GPU and the estimate it was priced with."""
    lay = sc.cluster.parallel
    assert lay is not None
    gib = plan.weight_bytes_per_gpu / 2**30
    note = f"cluster.parallel: {lay.describe(sc.cluster.tensor_parallel)}, weights {gib:.1f} GiB per GPU"
    if lay.expert_parallel > 1:
        note += f"; expert imbalance {lay.expert_imbalance:g} (an estimate unless measured)"
    if lay.stages_or_ranks > 1:
        return note + "; priced by the analytic model, no pipeline or ring-attention measurement on file"
    return note + "; priced by the analytic model, no MoE or all-to-all tables on file"


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
    replicas: list[Replica], seqs: list[Request], simulated: float, prefilled: list[int] | None = None
) -> tuple[ReplicaRecord, ...]:
    """`prefilled`: a disaggregated run's prefills per prefill replica (the first replicas), which
    count as their requests (a request's `replica` is where it finished)."""
    routed = np.zeros(len(replicas), np.int64)
    preempted = np.zeros(len(replicas), np.int64)
    for s in seqs:
        if s.replica >= 0:
            routed[s.replica] += 1
            preempted[s.replica] += s.preemptions
    if prefilled is not None:
        routed[: len(prefilled)] = prefilled
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

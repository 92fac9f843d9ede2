"""One simulation run: scenario -> workload, memory plan, cost model, engines -> results on disk.

`run_scenario` returns a `RunResult` (sequences, per-replica stats, summary dict); `write_run`
writes ``summary.json``, ``requests.csv`` and ``timeseries.csv`` (`kvsim.report` builds ``report.html`` from them). Everything random
comes from the scenario's seed, so one seed gives one summary (``wall_s`` aside).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import simpy

from kvsim.accuracy import accuracy_note, eviction_accuracy
from kvsim.core.block_hash import block_keys, private_keys
from kvsim.core.eviction import eviction_from_config
from kvsim.core.memory_plan import MemoryPlan, plan_memory
from kvsim.core.request import Request, RequestStatus
from kvsim.core.router import Router
from kvsim.core.sched.scheduler import Scheduler
from kvsim.costs.analytic import AnalyticCostModel
from kvsim.costs.base import CostModel
from kvsim.errors import KvsimError
from kvsim.results.io import write_requests_csv, write_timeseries_csv
from kvsim.results.record import (
    AccuracyNote,
    BusyFraction,
    EvictionRecord,
    ReplicaRecord,
    RequestCounts,
    RunConfig,
    RunSummary,
    WorkloadRecord,
    part_from_dict,
    write_summary,
)
from kvsim.results.summary import summarize
from kvsim.sim.cluster import arrival_process, make_pool_and_scheduler
from kvsim.sim.replica import Replica, ReplicaStats
from kvsim.spec.scenario import Scenario
from kvsim.spec.workload import Workload, clip_to_context, load_workload


@dataclass
class RunResult:
    scenario: Scenario
    seqs: list[Request]
    stats: list[ReplicaStats]
    plan: MemoryPlan
    record: RunSummary

    @property
    def summary(self) -> dict[str, Any]:
        """The record's JSON form, as ``summary.json`` holds it."""
        return self.record.to_dict()


def _refuse_unsimulated(sc: Scenario) -> None:
    kv = sc.kv
    if kv.offload.enabled:
        raise KvsimError(
            "CPU offload is not simulated yet; set enabled: false",
            source=sc.source,
            path="kv.offload.enabled",
        )
    if kv.prefix_cache == "global":
        raise KvsimError(
            "a cluster-wide prefix pool is not simulated yet; use local or none",
            source=sc.source,
            path="kv.prefix_cache.scope",
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
        )
    from kvsim.costs.profile import load_profile_cost_model

    assert sc.cost_model.profile is not None
    return load_profile_cost_model(sc)


def scenario_workload(sc: Scenario) -> Workload:
    """The scenario's workload; an error of the generator (which knows no file) names the scenario."""
    try:
        return load_workload(sc.workload, seed=sc.sim.seed)
    except KvsimError as exc:
        if exc.source == "synthetic":
            raise KvsimError(exc.message, source=sc.source, path=exc.path) from None
        raise


def run_scenario(
    sc: Scenario,
    *,
    progress: bool = False,
    workload: Workload | None = None,
    make_scheduler: Callable[..., Scheduler] = make_pool_and_scheduler,
    cost: CostModel | None = None,
) -> RunResult:
    """Simulate `sc`. `make_scheduler` builds each replica's scheduler (tests pass one that checks
    invariants after every operation)."""
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
    evictor = eviction_from_config(sc.kv.eviction)
    for i in range(sc.cluster.num_replicas):
        sched = make_scheduler(
            plan.num_blocks,
            bs,
            sc.scheduler.max_num_seqs,
            sc.scheduler.max_batched_tokens,
            sc.scheduler.chunked_prefill,
            caching,
        )
        sched.kv.set_eviction(evictor)
        replicas.append(
            Replica(
                env,
                i,
                sched,
                cost,
                fast_forward=sc.sim.fast_forward,
                next_outside_event=lambda: end_s,
                sample_every_s=sample_every,
            )
        )
    router = Router(sc.cluster.router, replicas)
    max_ctx = sc.model.max_context
    max_batched = sc.scheduler.max_batched_tokens
    chunked = sc.scheduler.chunked_prefill
    prompts, outputs, arrivals = wl.prompt_tokens, wl.output_tokens, wl.arrival_s

    def make_seq(i: int) -> Request:
        p, o = int(prompts[i]), int(outputs[i])
        if use_prefix:
            keys, sizes = block_keys(wl.hash_ids[i], p, wl.hash_block_tokens, bs)  # type: ignore[index]
        elif caching:
            keys, sizes = private_keys(i, p // bs)
        else:
            keys, sizes = [], []
        seq = Request(
            i, float(arrivals[i]), p, o, keys, sizes, None if out_ids is None else out_ids[i].tolist()
        )
        seqs.append(seq)
        if p + o > max_ctx:
            seq.status, seq.reason = RequestStatus.REJECTED, "longer than the model's context"
        elif -(-(p + o - 1) // bs) > plan.num_blocks:  # the last token is never stored
            seq.status, seq.reason = RequestStatus.REJECTED, "needs more KV blocks than a replica has"
        elif not chunked and p > max_batched:
            seq.status, seq.reason = (
                RequestStatus.REJECTED,
                "prompt exceeds max_batched_tokens without chunked prefill",
            )
        return seq

    env.process(arrival_process(env, wl.arrival_s, make_seq, router))
    _drive(env, span, end_s, progress)
    wall = time.perf_counter() - t0
    # Run to the end: the last step's end or the last arrival. (env.now could lie later: a fast-forward
    # window cut short leaves its first timeout queued, which fires with nothing waiting on it.)
    last = max([r.clock for r in replicas] + [float(wl.arrival_s[-1]) if len(wl) else 0.0])
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
    )
    counts: RequestCounts = parts["requests"]
    warnings = cost.warnings(frozenset().union(*(r.off_grid for r in replicas)))  # what ran
    stuck = counts.unfinished
    if stuck and not math.isfinite(end_s):
        warnings.append(
            f"{stuck:,} requests never finished although the simulation ran to its end (a defect)"
        )
    if len(seqs) < len(wl):
        warnings.append(f"{len(wl) - len(seqs):,} requests arrive after sim.max_time and were not replayed")
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
    warnings.extend(sc.notes)
    if sc.kv.format_note:
        warnings.append(sc.kv.format_note)
    if sc.model.sliding_window:
        warnings.append(
            "sliding-window layers hold full KV in the block pool here (vLLM v1 frees out-of-window blocks)"
        )
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
        config=_config(sc, cost, wl),
        workload=WorkloadRecord(**wl.accounting(), clipped_to_context=wl.clipped_to_context),  # type: ignore[arg-type]
        sim_speed_x=simulated / max(wall, 1e-9),
        replicas=_replica_records(replicas, seqs, simulated),
        eviction=None if evictor is None else _eviction_record(sc, replicas, plan, simulated),
    )
    return RunResult(sc, seqs, stats, plan, summary)


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


def _drive(env: simpy.Environment, span: float, end_s: float, progress: bool) -> None:
    if not progress or span <= 0:
        env.run(until=end_s if math.isfinite(end_s) else None)
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    horizon = min(span, end_s)
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
        sources=dict(sc.cluster.gpu.sources + sc.cluster.topology.sources),
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


def write_run(result: RunResult, out: Path) -> None:
    """``summary.json``, ``requests.csv`` and ``timeseries.csv`` (the report is built from them)."""
    out.mkdir(parents=True, exist_ok=True)
    write_summary(out / "summary.json", result.record)
    write_requests_csv(out / "requests.csv", result.seqs)
    write_timeseries_csv(out / "timeseries.csv", [row for s in result.stats for row in s.samples])

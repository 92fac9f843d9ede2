"""One simulation run: scenario -> workload, memory plan, cost model -> the run's parts
(`kvsim.sim.assembly`), driven on the clock -> the summary (`kvsim.results.summarize`).

`run_scenario` returns a `RunResult` (sequences, per-replica stats, summary dict); `write_run`
writes ``summary.json``, ``requests.csv`` and ``timeseries.csv`` (`kvsim.report` builds ``report.html`` from them). Everything random
comes from the scenario's seed, so one seed gives one summary (``wall_s`` aside). The run's flow:
docs/architecture.md ("The run, assembled").
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import simpy

from kvsim.core.eviction import eviction_from_config
from kvsim.core.memory_plan import MemoryPlan, plan_memory
from kvsim.core.request import Request
from kvsim.core.sched.scheduler import Scheduler
from kvsim.costs.analytic import AnalyticCostModel
from kvsim.costs.base import CostModel
from kvsim.errors import KvsimError
from kvsim.results.io import (
    csv_name,
    write_links_csv,
    write_requests_csv,
    write_tiers_csv,
    write_timeseries_csv,
)
from kvsim.results.record import RunSummary, write_summary
from kvsim.results.summarize import run_summary
from kvsim.sim.assembly import assemble, assemble_disaggregated
from kvsim.sim.cluster import make_pool_and_scheduler
from kvsim.sim.replica import ReplicaStats, TokenGaps
from kvsim.spec.scenario import Scenario
from kvsim.spec.workload import Workload, clip_to_context, load_workload

if TYPE_CHECKING:
    from kvsim.sim.kv_events import KVEventLog


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
        c.parallel,
        c.gpus_per_node if c.parallel is not None and c.parallel.stages_or_ranks > 1 else None,
    )


def make_cost_model(sc: Scenario) -> CostModel:
    if sc.cost_model.kind == "analytic":
        c = sc.cluster
        kv, evict = sc.kv, eviction_from_config(sc.kv.eviction)
        args = (sc.model, c.gpu, c.tensor_parallel, kv.format, c.topology)
        if c.parallel is not None and c.parallel.stages_or_ranks > 1:  # PP / CP: built only then
            return _layout_cost_model(sc)
        if c.parallel is not None and c.parallel.expert_parallel > 1:  # EP: the all-to-all priced too
            from kvsim.costs.moe import MoECostModel

            return MoECostModel(
                *args,
                c.parallel,
                mix=kv.format_mix,
                eviction=evict,
                switch=kv.format_switch,
                block_size=kv.block_size,
            )
        return AnalyticCostModel(
            *args,
            mix=kv.format_mix,
            eviction=evict,
            switch=kv.format_switch,
            block_size=kv.block_size,
            layout=c.parallel,
        )
    from kvsim.costs.profile import load_profile_cost_model

    assert sc.cost_model.profile is not None
    return load_profile_cost_model(sc)


def _layout_cost_model(sc: Scenario) -> CostModel:
    """The analytic model of a pipeline- or context-parallel replica (`kvsim.costs.pipeline`,
    `kvsim.costs.context_parallel`)."""
    from kvsim.costs.context_parallel import ContextParallelCostModel
    from kvsim.costs.pipeline import PipelineCostModel

    c, kv = sc.cluster, sc.kv
    lay = c.parallel
    assert lay is not None
    kind = PipelineCostModel if lay.pipeline_parallel > 1 else ContextParallelCostModel
    return kind(
        sc.model,
        c.gpu,
        c.tensor_parallel,
        kv.format,
        c.topology,
        lay,
        c.gpus_per_node,
        mix=kv.format_mix,
        block_size=kv.block_size,
    )


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
    kv_events: KVEventLog | None = None,
) -> RunResult:
    """Simulate `sc`. `make_scheduler` builds each replica's scheduler (tests pass one that checks
    invariants after every operation); `percentiles`: also these, in each latency distribution's
    ``by_percentile`` and the terminal table (``kvsim run --percentiles``); `kv_events`: the log
    the replicas' KV events go to (``kvsim run --kv-events``; `kvsim.sim.kv_events`)."""
    t0 = time.perf_counter()
    _refuse_unsimulated(sc)
    wl = workload if workload is not None else scenario_workload(sc)
    if sc.workload.clip_to_context:
        wl = clip_to_context(wl, sc.model.max_context)
    disagg = sc.cluster.disaggregation
    role_plans = None
    if disagg is not None:  # each pool its own memory plan and cost model, built as for one cluster
        if kv_events is not None:
            raise KvsimError(
                "--kv-events is not written for a disaggregated run yet",
                source=sc.source,
                path="cluster.disaggregation",
            )
        roles = [sc.role(p) for p in disagg.pools]
        role_plans = (_role_plan(roles[0], "prefill"), _role_plan(roles[1], "decode"))
        costs = (make_cost_model(roles[0]), make_cost_model(roles[1]))
        plan, cost = role_plans[1], costs[1]
        run = assemble_disaggregated(sc, wl, role_plans, costs, make_scheduler=make_scheduler)
    else:
        if kv_events is not None and sc.faults is not None:
            raise KvsimError(
                "--kv-events is not written for a run with faults yet", source=sc.source, path="faults"
            )
        if kv_events is not None and sc.cluster.autoscale is not None:
            raise KvsimError(
                "--kv-events is not written for an autoscaled run yet",
                source=sc.source,
                path="cluster.autoscale",
            )
        plan = plan_memory(sc)
        if cost is None:  # a caller running many points may pass one it built (pricing is pure)
            cost = make_cost_model(sc)
        run = assemble(sc, wl, plan, cost, make_scheduler=make_scheduler, kv_events=kv_events)
    _drive(run.env, run.span, run.end_s, progress)
    wall = time.perf_counter() - t0
    summary = run_summary(
        sc,
        run,
        plan,
        cost,
        simulated=run.simulated_s(),
        wall=wall,
        t0=t0,
        percentiles=percentiles,
        role_plans=role_plans,
    )
    offload, replicas = run.offload, run.replicas
    return RunResult(
        sc,
        run.seqs,
        [r.stats for r in replicas],
        plan,
        summary,
        [] if offload is None else offload.tier_samples(),
        [] if offload is None else offload.link_samples(),
        [r.gaps for r in replicas],
    )


def _role_plan(role: Scenario, name: str) -> MemoryPlan:
    """A pool's memory plan; where its HBM holds no KV, the error names its pool."""
    try:
        return plan_memory(role)
    except KvsimError as exc:
        raise KvsimError(
            f"the {name} pool: {exc.message}", source=role.source, path=f"cluster.disaggregation.{name}"
        ) from None


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


def write_run(result: RunResult, out: Path | str, *, compress: bool = False) -> None:
    """``summary.json``, ``requests.csv`` and ``timeseries.csv`` (the report is built from them),
    and ``tiers.csv`` and ``links.csv`` when the run has samples for them. `compress`: each CSV as
    ``NAME.csv.gz`` (a sweep's or plan's points). What an earlier run left under a CSV's other
    form, or under one this run has no rows for, is removed (the CLI has checked it is kvsim's)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
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
    # Last, so that a value summary.json cannot hold loses none of the CSVs: one line naming the
    # field and what was written, and no summary or report of an earlier run left beside them.
    try:
        write_summary(out / "summary.json", result.record)
    except KvsimError as exc:
        for name in ("summary.json", "report.html"):
            (out / name).unlink(missing_ok=True)
        kept = ", ".join(
            csv_name(n, compress)
            for n in ("requests.csv", "timeseries.csv", "tiers.csv", "links.csv")
            if n in written
        )
        raise KvsimError(
            f"{exc.message}; wrote {kept} in {out}, not summary.json or the report", source=exc.source
        ) from None

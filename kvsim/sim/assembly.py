"""A run's parts, built once from the scenario, each given its collaborators when it is built
(nothing is set on a part afterwards): the clock, the tiers below HBM and their links
(`OffloadWiring`), token eviction, speculative decoding; each replica, with the parts it builds
given itself (`replica_parts`: its side of the tiers, scheduler and KV cache manager, KV events
sink, offload port); the router and the arrival processes.

`kvsim.run.run_scenario` assembles (`assemble`), drives the clock and hands the parts to
`kvsim.results.summarize`. Design: docs/architecture.md ("The run, assembled").
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import simpy

from kvsim.core.block_hash import block_keys, private_keys
from kvsim.core.eviction import Eviction, eviction_from_config, switch_eviction, window_eviction
from kvsim.core.memory_plan import MemoryPlan
from kvsim.core.request import Request, RequestStatus
from kvsim.core.router import Router
from kvsim.core.sched.scheduler import Scheduler
from kvsim.core.spec_decode import SpecDecoder
from kvsim.costs.analytic import AnalyticCostModel
from kvsim.costs.base import CostModel
from kvsim.costs.draft import DraftCost
from kvsim.errors import KvsimError
from kvsim.sim.autoscale import Autoscaler
from kvsim.sim.cluster import ClosedLoopArrivals, NextArrival, arrival_process
from kvsim.sim.disagg import HandOff, SplitRouter
from kvsim.sim.faults import FaultRouter, Faults, draw_faults, plan_outages
from kvsim.sim.kv_events import KVEventLog
from kvsim.sim.offload_wiring import OffloadWiring
from kvsim.sim.replica import Replica, ReplicaParts
from kvsim.spec.autoscale import ENGINE_START_S, START_SOURCE
from kvsim.spec.faults import DEFAULT_RELOAD_BW, FaultKind
from kvsim.spec.scenario import PrefixCacheScope, Scenario
from kvsim.spec.workload import Workload


@dataclass
class AssembledRun:
    """What `assemble` built: the parts the run drives and the summary reads (None: off)."""

    env: simpy.Environment
    wl: Workload
    replicas: list[Replica]
    router: Router
    seqs: list[Request]  # every request that arrived, in arrival order (filled as they arrive)
    offload: OffloadWiring | None  # host tiers, SSD, swap space, global pool and their links
    evictor: Eviction | None  # kv.eviction
    window: Eviction | None  # the model's sliding-window layers
    switch: Eviction | None  # kv.format_switch
    spec: SpecDecoder | None  # scheduler.spec_decode
    end_s: float  # sim.max_time, or inf
    span: float  # the last arrival of the trace, s
    # cluster.disaggregation: the hand-off to the decode pool, whose replicas follow the prefill
    # pool's in `replicas` (None: aggregated)
    handoff: HandOff | None = None
    faults: Faults | None = None  # the fault schedule (None: no faults section)
    autoscaler: Autoscaler | None = None  # cluster.autoscale (None: every replica up throughout)

    @property
    def closed_loop(self) -> bool:
        """Agent turns sent when the previous reply arrives (not at the trace's times)."""
        return self.wl.agent is not None and self.wl.agent.closed_loop

    def simulated_s(self) -> float:
        """Simulated time after the run: to sim.max_time, else to the last step's end or the last
        arrival. (env.now could lie later: a fast-forward window cut short leaves its first timeout
        queued, which fires with nothing waiting on it.)"""
        last_arrival = float(self.wl.arrival_s[-1]) if len(self.wl) else 0.0
        if self.closed_loop:  # turns were sent when replies arrived
            last_arrival = max((s.arrival_s for s in self.seqs), default=0.0)
        last = max([r.clock for r in self.replicas] + [last_arrival])
        return min(self.env.now, self.end_s) if math.isfinite(self.end_s) else last


def assemble(
    sc: Scenario,
    wl: Workload,
    plan: MemoryPlan,
    cost: CostModel,
    *,
    make_scheduler: Callable[..., Scheduler],
    kv_events: KVEventLog | None = None,
) -> AssembledRun:
    """Build `sc`'s run over workload `wl`: `make_scheduler` builds each replica's scheduler (called
    as `kvsim.sim.cluster.make_pool_and_scheduler`: the plan's blocks and the scheduler's limits,
    then the keywords ``eviction``, ``spec``, ``host`` and ``swap_decider``); `kv_events`: the log
    the replicas' KV events go to (None: none kept).

    Each part is given its collaborators when it is built: the tiers below HBM and the mechanisms
    the schedulers share first; then each replica, which builds its parts given itself
    (`replica_parts`); then the router over the replicas and the arrivals through it. What a
    replica calls exists before it: the router's `touched` set, and the closed-loop sessions,
    started once the router is built."""
    check_hash_blocks(sc, wl)
    check_context_parallel(sc, wl)
    env = simpy.Environment()
    end_s = sc.sim.max_time_s if sc.sim.max_time_s is not None else math.inf
    seqs: list[Request] = []
    span = float(wl.arrival_s[-1]) if len(wl) else 0.0
    uses_tiers = (
        sc.kv.offload.enabled or sc.scheduler.preemption != "recompute" or sc.kv.prefix_cache == "global"
    )
    offload = OffloadWiring(sc, plan, env, cost) if uses_tiers else None
    evictor = eviction_from_config(sc.kv.eviction)
    window = window_eviction(sc.model)  # refused together with kv.eviction (kvsim.run)
    switch = switch_eviction(sc.model, sc.kv.format, sc.kv.format_switch)  # refused with both
    spec, draft = spec_decode(sc, cost)
    make_seq = request_maker(sc, wl, plan, window, seqs)
    n = sc.cluster.num_replicas
    touched: set[int] | None = set() if Router.indexes(sc.cluster.router, n) else None
    agent = wl.agent
    loop = None  # the closed-loop sessions (None: open loop, at the trace's times)
    if agent is not None and agent.closed_loop:
        loop = ClosedLoopArrivals(env, agent.gap_s, agent.next_request, make_seq)
    # Open loop, the arrivals are known in advance: a replica runs ahead of the clock to the next.
    next_arrival = None if loop is not None else NextArrival(float(wl.arrival_s[0]) if len(wl) else math.inf)
    pin = pin_keys(sc, wl) if sc.kv.pin_segments else None
    cuts = segment_cuts_of(sc, wl) if sc.kv.segments is not None and sc.kv.segments.drops else None
    faults = make_faults(sc, plan, env, min(span, end_s))
    scaler = make_autoscaler(sc, plan, env, next_arrival)
    gate = faults if faults is not None else scaler  # what closes replicas to arrivals (None: nothing)
    outside: Callable[[], float] = (
        (lambda: end_s) if gate is None else _next_outside(end_s, gate.next_instant)
    )
    parts = functools.partial(
        replica_parts,
        sc,
        plan,
        make_scheduler,
        evictor or window or switch,
        spec,
        offload,
        kv_events,
        pin,
        cuts=cuts,
    )
    replicas = [
        Replica(
            env,
            i,
            cost,
            functools.partial(parts, i),
            fast_forward=sc.sim.fast_forward,
            next_outside_event=outside,
            sample_every_s=max(span / 2000.0, 0.05),
            draft=draft,
            on_load_change=None if touched is None else touched.add,
            on_finish=None if loop is None else loop.on_finish,
            next_arrival=next_arrival,
            faults=faults,
        )
        for i in range(n)
    ]
    router = Router(sc.cluster.router, replicas, touched, _balance(sc))
    chooser: Router | FaultRouter = router
    if faults is not None:  # arrivals skip the replicas that are down
        chooser = FaultRouter(router, faults)
        faults.start(replicas, chooser)
    elif scaler is not None:  # arrivals go to the replicas serving only
        chooser = FaultRouter(router, scaler)
        scaler.start(replicas, chooser)
    if agent is not None and loop is not None:
        loop.start([(float(wl.arrival_s[i]), int(i)) for i in np.flatnonzero(agent.turn == 0)], chooser)
    else:
        env.process(arrival_process(env, wl.arrival_s, make_seq, chooser, next_arrival))
    return AssembledRun(
        env,
        wl,
        replicas,
        router,
        seqs,
        offload,
        evictor,
        window,
        switch,
        spec,
        end_s,
        span,
        faults=faults,
        autoscaler=scaler,
    )


def make_faults(sc: Scenario, plan: MemoryPlan, env: simpy.Environment, span_s: float) -> Faults | None:
    """The run's fault schedule (None without a ``faults`` section): each replica's outages, with
    the weights' reload (the plan's weight bytes per GPU at ``faults.reload_bandwidth``; a
    replica's GPUs load their shards at once, each over its own path). ``faults.random``'s
    failures are drawn over [0, span_s) (the trace's last arrival, or sim.max_time if earlier)
    and planned with the explicit events."""
    cfg = sc.faults
    if cfg is None:
        return None
    reload_s = plan.weight_bytes_per_gpu / cfg.reload_bw_bytes_per_s
    per_node = sc.cluster.gpus_per_node // sc.cluster.tensor_parallel
    r = cfg.random
    if r is None:
        outages = plan_outages(cfg.events, per_node, reload_s)
        return Faults(env, cfg, sc.cluster.num_replicas, outages)
    n = sc.cluster.num_replicas if r.kind is FaultKind.REPLICA_DOWN else sc.cluster.nodes
    drawn = draw_faults(r, span_s, n)
    outages = plan_outages(cfg.events + drawn, per_node, reload_s)
    return Faults(env, cfg, sc.cluster.num_replicas, outages, drawn, span_s, n)


def make_autoscaler(
    sc: Scenario, plan: MemoryPlan, env: simpy.Environment, next_arrival: NextArrival | None
) -> Autoscaler | None:
    """The run's autoscaler (None without ``cluster.autoscale``): a started replica serves after
    ``scale_up_delay``, by default an engine start (an estimate) plus its weights (the plan's bytes
    per GPU, each GPU over its own path) at faults' default reload bandwidth."""
    cfg = sc.cluster.autoscale
    if cfg is None:
        return None
    assert next_arrival is not None  # open loop only (closed-loop sessions are refused)
    if cfg.scale_up_delay_s is not None:
        delay, source = cfg.scale_up_delay_s, f"cluster.autoscale.scale_up_delay ({sc.source})"
    else:
        delay, source = ENGINE_START_S + plan.weight_bytes_per_gpu / DEFAULT_RELOAD_BW, START_SOURCE
    return Autoscaler(env, cfg, sc.cluster.num_replicas, delay, source, next_arrival)


def _next_outside(end_s: float, nxt: Callable[[], float]) -> Callable[[], float]:
    """A replica's next outside event with faults or an autoscaler: the end of the run or the next
    fault instant (a replica down or back) or tick, so that no window or running ahead spans one."""

    def outside() -> float:
        return min(end_s, nxt())

    return outside


def assemble_disaggregated(
    sc: Scenario,
    wl: Workload,
    plans: tuple[MemoryPlan, MemoryPlan],
    costs: tuple[CostModel, CostModel],
    *,
    make_scheduler: Callable[..., Scheduler],
) -> AssembledRun:
    """Build `sc`'s disaggregated run (`kvsim.sim.disagg`): the prefill pool's replicas (indices
    0..P-1, routed by the scenario's router, each request prefilled as a stand-in asking for one
    token), then the decode pool's (P..P+D-1, least outstanding tokens, no prefix cache), each with
    its role's memory plan and cost model (`plans`, `costs`: prefill's, decode's). Replicas do not
    run ahead of the clock here: hand-offs are not known in advance."""
    cfg = sc.cluster.disaggregation
    assert cfg is not None
    check_hash_blocks(sc, wl)
    env = simpy.Environment()
    end_s = sc.sim.max_time_s if sc.sim.max_time_s is not None else math.inf
    seqs: list[Request] = []
    span = float(wl.arrival_s[-1]) if len(wl) else 0.0
    originals: dict[int, Request] = {}
    make_seq = _prefill_request_maker(sc, wl, plans, seqs, originals)
    bs = sc.kv.block_size
    handoff = HandOff(
        env, cfg, sc.cluster.topology, sc.cluster.gpus_per_node, plans, bs, sc.model.num_layers, originals
    )
    n_p, n_d = cfg.prefill.replicas, cfg.decode.replicas
    policy = sc.cluster.router
    touched_p: set[int] | None = set() if Router.indexes(policy, n_p) else None
    decode_policy = "least_outstanding_tokens"
    touched_d: set[int] | None = set() if Router.indexes(decode_policy, n_d) else None
    sample_every = max(span / 2000.0, 0.05)
    prefill = [
        Replica(
            env,
            i,
            costs[0],
            functools.partial(replica_parts, sc, plans[0], make_scheduler, None, None, None, None, None, i),
            fast_forward=sc.sim.fast_forward,
            next_outside_event=lambda: end_s,
            sample_every_s=sample_every,
            on_load_change=None if touched_p is None else touched_p.add,
            on_finish=handoff.on_prefill_done,
            before_schedule=handoff.release_sent(i),
        )
        for i in range(n_p)
    ]
    sc_d = dataclasses.replace(sc, kv=dataclasses.replace(sc.kv, prefix_cache=PrefixCacheScope.NONE))
    decode = [
        Replica(
            env,
            n_p + j,
            costs[1],
            functools.partial(
                replica_parts, sc_d, plans[1], make_scheduler, None, None, None, None, None, n_p + j
            ),
            fast_forward=sc.sim.fast_forward,
            next_outside_event=lambda: end_s,
            sample_every_s=sample_every,
            on_load_change=None if touched_d is None else _adder(touched_d, j),
            before_schedule=handoff.before_schedule(j),
        )
        for j in range(n_d)
    ]
    handoff.prefill, handoff.decode = prefill, decode
    handoff.router = Router(decode_policy, decode, touched_d)
    router = Router(policy, prefill, touched_p, _balance(sc))
    # A request not in `originals` (conditional disaggregation) is prefilled on the decode pool.
    arrivals = SplitRouter(router, handoff) if cfg.max_local_prefill_tokens else router
    env.process(arrival_process(env, wl.arrival_s, make_seq, arrivals))
    return AssembledRun(
        env, wl, prefill + decode, router, seqs, None, None, None, None, None, end_s, span, handoff
    )


def _prefill_request_maker(
    sc: Scenario,
    wl: Workload,
    plans: tuple[MemoryPlan, MemoryPlan],
    seqs: list[Request],
    originals: dict[int, Request],
) -> Callable[[int], Request]:
    """A disaggregated run's `request_maker`: the request as the decode pool takes it (kept in
    `originals`, rejected where a decode replica cannot hold it), and its stand-in for the prefill
    pool, asking for one token (rejected where a prefill replica cannot hold its prompt); with
    ``max_local_prefill_tokens``, a prompt that short is returned itself, for the decode pool."""
    make_original = request_maker(sc, wl, plans[1], None, seqs, "a decode replica")
    bs = sc.kv.block_size
    assert sc.cluster.disaggregation is not None
    local = sc.cluster.disaggregation.max_local_prefill_tokens
    prefill_blocks = plans[0].num_blocks

    def make_seq(i: int, t: float | None = None) -> Request:
        seq = make_original(i, t)
        if seq.status is RequestStatus.REJECTED:
            return seq
        if -(-seq.prompt_len // bs) > prefill_blocks:
            seq.status, seq.reason = (
                RequestStatus.REJECTED,
                "prompt needs more KV blocks than a prefill replica has",
            )
            return seq
        if seq.prompt_len <= local:  # conditional disaggregation: prefilled where it decodes
            return seq
        originals[seq.id] = seq
        cum = seq.key_cum
        sizes = [b - a for a, b in itertools.pairwise(cum)]
        return Request(seq.id, seq.arrival_s, seq.prompt_len, 1, seq.keys, sizes)

    return make_seq


def _balance(sc: Scenario) -> tuple[int, float] | None:
    """``cluster.router_balance`` as the router takes it: (abs, rel) thresholds, or None."""
    b = sc.cluster.router_balance
    return None if b is None else (b.abs_threshold, b.rel_threshold)


def _adder(touched: set[int], j: int) -> Callable[[int], None]:
    """A decode replica's `on_load_change`: its position in the decode pool's router."""

    def add(_index: int) -> None:
        touched.add(j)

    return add


def replica_parts(
    sc: Scenario,
    plan: MemoryPlan,
    make_scheduler: Callable[..., Scheduler],
    eviction: Eviction | None,
    spec: SpecDecoder | None,
    offload: OffloadWiring | None,
    kv_events: KVEventLog | None,
    pin: frozenset[int] | None,
    i: int,
    replica: Replica,
    *,
    cuts: list[int] | None = None,
) -> ReplicaParts:
    """Replica `i`'s parts, given the replica (they read its clock and poke it): its side of the
    tiers below HBM, its scheduler (with that side's lookup and swap decision; its pool keeping
    the `pin` keys' entries, its KV cache manager dropping finished turns' blocks from `cuts` on), its
    pool's KV events sink and its offload port over the scheduler."""
    side = None if offload is None else offload.side(i, replica)
    sched = make_scheduler(
        plan.num_blocks,
        sc.kv.block_size,
        sc.scheduler.max_num_seqs,
        sc.scheduler.max_batched_tokens,
        sc.scheduler.chunked_prefill,
        sc.kv.prefix_cache != "none",
        eviction=eviction,
        spec=spec,
        host=None if side is None else side.lookup,
        swap_decider=None if side is None else side.swap,
    )
    if pin is not None:
        sched.kv.pool.pin(pin, int(sc.kv.pin_max_share * plan.num_blocks))
    if cuts is not None:
        sched.kv.set_segment_cuts(cuts)
    sink = None if kv_events is None else kv_events.pool_sink(i, replica)
    if sink is not None:
        sched.kv.pool.listen(sink)
    port = None if offload is None or side is None else offload.port(side, sched, sink)
    return ReplicaParts(sched, port, sink)


def request_maker(
    sc: Scenario,
    wl: Workload,
    plan: MemoryPlan,
    window: Eviction | None,
    seqs: list[Request],
    replica: str = "a replica",
) -> Callable[..., Request]:
    """``make_seq(i, t=None)``: the workload's request `i` (arriving at `t`, else at the trace's
    time), appended to `seqs`, with its prefix-cache keys, or rejected with the reason (`replica`:
    whose blocks `plan` counts, in that reason)."""
    too_big = f"needs more KV blocks than {replica} has"
    bs = sc.kv.block_size
    caching = sc.kv.prefix_cache != "none"
    use_prefix = caching and wl.hash_ids is not None  # content ids; else each prompt's own keys
    # The answer's content ids line up with engine blocks only when blocks are the trace's size.
    out_ids = wl.output_hash_ids if use_prefix and wl.hash_block_tokens == bs else None
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
            seq.status, seq.reason = RequestStatus.REJECTED, too_big
        elif not chunked and p > max_batched:
            seq.status, seq.reason = (
                RequestStatus.REJECTED,
                "prompt exceeds max_batched_tokens without chunked prefill",
            )
        return seq

    return make_seq


def check_hash_blocks(sc: Scenario, wl: Workload) -> None:
    """A trace's content ids key the prefix cache only where its hash block and the engine block
    divide one another."""
    g, bs = wl.hash_block_tokens, sc.kv.block_size
    if sc.kv.prefix_cache != "none" and wl.hash_ids is not None and g % bs and bs % g:
        raise KvsimError(
            f"the trace's hash block of {g} tokens and block_size {bs} must divide one another",
            source=sc.source,
            path="kv.block_size",
        )


def check_context_parallel(sc: Scenario, wl: Workload) -> None:
    """Under context parallelism every prompt must give each CP rank at least one block: the
    replica's pool counts a sequence's blocks striped over the ranks (`kvsim.core.memory_plan`)."""
    lay = sc.cluster.parallel
    if lay is None or lay.context_parallel == 1 or not len(wl):
        return
    need = lay.context_parallel * sc.kv.block_size
    shortest = int(wl.prompt_tokens.min())
    if shortest < need:
        raise KvsimError(
            f"{lay.context_parallel} ranks x block_size {sc.kv.block_size} = {need} tokens exceed the "
            f"workload's shortest prompt ({shortest} tokens): each CP rank needs a block of every "
            "sequence; lower context_parallel or the block size",
            source=sc.source,
            path="cluster.parallel.context_parallel",
        )


def pin_keys(sc: Scenario, wl: Workload) -> frozenset[int]:
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


def segment_cuts_of(sc: Scenario, wl: Workload) -> list[int]:
    """Per request, where ``kv.segments`` cuts its finished turn (`kvsim.spec.agent.segment_cuts`)."""
    from kvsim.spec.agent import segment_cuts

    assert wl.agent is not None and sc.kv.segments is not None  # checked when the scenario is read
    return segment_cuts(sc.kv.segments, wl.agent)


def spec_decode(sc: Scenario, cost: CostModel) -> tuple[SpecDecoder | None, DraftCost | None]:
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

"""The run summary as a typed, versioned record (``summary.json``) and its one reader.

`RunSummary` is what `kvsim.run` builds, ``write_run`` writes, and the report, the terminal
summary, sweeps and the planner read. ``summary.json`` is ``RunSummary.to_dict()`` as JSON: the
record's fields are the file's keys, in the same nesting (so a file written before the record
existed reads unchanged), plus ``schema: "kvsim-summary"`` and ``version`` first.

Versioning: adding a field (with a default, so older files still read) keeps the version; renaming,
removing or changing the meaning of one raises it. `read_summary` refuses a foreign file, a newer
version or a field of the wrong type with one `KvsimError` line naming the file and the field; a
file written before the version field existed reads as version 1, with a note in ``read_notes``.
Keys the record does not know (written by a later kvsim of the same version) are kept in ``extra``
and written back unchanged.

Deliberately left out: per-request rows (``requests.csv``) and the occupancy time series
(``timeseries.csv``); the record holds numbers the simulator computed, never recomputes them.
"""

from __future__ import annotations

import json
import math
import types
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, TypeVar, get_args, get_origin, get_type_hints

from kvsim.core.memory_plan import MemoryPlan
from kvsim.errors import KvsimError

SCHEMA = "kvsim-summary"
VERSION = 1  # raise on a rename, removal or change of meaning; adding a defaulted field keeps it

T = TypeVar("T")

_NO_JSON = {"json": False}  # field metadata: kept in memory, never written


# ---------------------------------------------------------------------------------------- parts


@dataclass(frozen=True, kw_only=True)
class RequestCounts:
    """Request accounting: total = completed + rejected + failed + unfinished (requests that
    arrived; failed only in a run with faults)."""

    total: int
    completed: int
    rejected: int
    unfinished: int
    rejected_reasons: dict[str, int]
    not_arrived: int = 0  # in the workload but after sim.max_time: never replayed
    # dropped by a replica going down more often than faults.max_retries; absent without faults
    failed: int | None = field(default=None, metadata={"omit_none": True})
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Distribution:
    """Seconds over completed requests (numpy's linear percentiles); None when there are none."""

    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    p999: float | None
    # The percentiles a user chose (``kvsim run --percentiles``), keyed p50, p99.9; empty by default.
    by_percentile: dict[str, float | None] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class SloResult:
    """The SLO targets, the latency at the SLO percentile, and whether they were met."""

    ttft_s: float
    tpot_s: float
    percentile: float
    ttft_at_percentile_s: float | None
    tpot_at_percentile_s: float | None
    ttft_met: bool
    tpot_met: bool
    good_fraction: float  # requests meeting both targets / requests that arrived
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class TokenCounts:
    """Tokens of completed requests."""

    prompt: int
    output: int
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class BusyFraction:
    """Share of simulated time the replicas spent running steps, over replicas."""

    mean: float
    max: float
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class ReplicaRecord:
    """One replica over the run (an instance of the model: one tensor-parallel group of GPUs)."""

    index: int
    requests: int  # routed to this replica (rejected requests are never routed)
    steps: int
    busy_fraction: float  # simulated seconds running steps / simulated seconds
    kv_peak_used_blocks: int  # blocks referenced by some request, at the fullest
    kv_mean_used_blocks: float  # the same, time-weighted over the simulated seconds
    preemptions: int  # of requests routed here
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class LinkRecord:
    """One direction of one link over the run (`kvsim.sim.links`)."""

    name: str  # node/link/index, e.g. "node0/host_h2d/0" (index: the PCIe group of shared_by GPUs)
    transfers: int
    bytes: float
    busy_s: float  # simulated seconds the link was occupied within the run (<= simulated seconds)
    utilization: float  # busy_s / simulated seconds (<= 1)
    queued_s: float  # seconds transfers waited for the link, all together
    backlog_s: float = 0.0  # occupancy asked for that the run's end left undone (an overloaded link)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class OffloadRecord:
    """Host-DRAM offload (`kv.offload`); absent from the summary when it is off."""

    preset: str
    write: str  # back | through
    copy: str  # batched | per_block
    host_capacity_bytes: int  # per node
    host_peak_bytes: int  # the fullest node at its fullest
    host_end_bytes: int  # all nodes together at the end, readable (writes still in flight left out)
    hit_rate_hbm: float  # prompt tokens skipped at first admission thanks to HBM / prompt tokens admitted
    hit_rate_dram: float  # the same, loaded from DRAM (+ hit_rate_hbm + the pool's = prefix_hit_rate)
    loads: int  # DRAM -> HBM transfers (one per admission that loads)
    loaded_tokens: int  # tokens those loads let requests skip, every admission
    loaded_bytes: float  # DRAM -> HBM, per GPU (each GPU of a replica moves its share)
    written_bytes: float  # HBM -> DRAM, per GPU, arrived by the end
    dropped_bytes: float  # dropped from DRAM to make room (LRU or LFU), per GPU
    requests_waited: int  # requests that waited for a load at least once
    kv_wait_s: Distribution  # per request that waited: seconds waiting for KV (loads and swap-ins)
    hit_rate_ssd: float = 0.0  # the same, loaded from the node's SSD (kv.offload.ssd)
    ssd_capacity_bytes: int = 0  # per node (0: no SSD tier)
    ssd_written_bytes: float = 0.0  # demoted DRAM -> SSD, whole replica blocks, arrived by the end
    ssd_loaded_bytes: float = 0.0  # SSD -> HBM, whole replica blocks
    cold_demoted_bytes: float = 0.0  # HBM entries moved down for going cold (cold_after_steps), per GPU
    eviction: str = "lru"  # lru | lfu, in DRAM and the SSD (kv.offload.eviction)
    write_backlog_bytes: float = 0.0  # HBM -> DRAM asked for, still in flight at the end, per GPU
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class GlobalPoolRecord:
    """The cluster-wide prefix pool (``kv.prefix_cache.scope: global``); absent otherwise."""

    fetch: str  # auto | always
    capacity_bytes: int  # all nodes together, per GPU of a replica x its GPUs
    peak_bytes: int
    hit_rate_global: (
        float  # prompt tokens skipped at first admission thanks to the pool / prompt tokens admitted
    )
    fetched_tokens: int  # tokens fetched from the pool, every admission
    fetched_bytes: float  # per GPU
    remote_bytes: float  # of those, from another node over the network, per GPU
    published_bytes: float  # HBM -> the pool, per GPU
    dropped_bytes: float  # dropped to make room (LRU or LFU), per GPU
    declined_lookups: int  # requests whose lookup stopped at a remote entry cheaper to recompute, each once
    eviction: str = "lru"  # lru | lfu (kv.prefix_cache.pool_eviction)
    pool_nodes: PoolNodesRecord | None = None  # kv.prefix_cache.pool_nodes; None: in the GPU nodes' DRAM
    # Requests that waited for KV (fetches from the pool, and loads from other tiers) and how long:
    # as `OffloadRecord`'s, here too when no offload tier is on (None in files written before).
    requests_waited: int | None = None
    kv_wait_s: Distribution | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class PoolNodesRecord:
    """The global pool's dedicated pool nodes: their DRAM, NICs and price (in the run's cost)."""

    nodes: int
    capacity_bytes_per_node: int  # whole replica blocks that fit in kv.prefix_cache.pool_node_bytes
    peak_bytes: tuple[int, ...]  # per pool node, its fullest
    end_bytes: tuple[int, ...]  # per pool node, at the end of the run
    nics_per_node: int
    nic_bw_bytes_per_s: float  # one pool node's NICs together (its queues' bandwidth per direction)
    cost_per_hour_usd: float  # per pool node
    cost_usd: float  # all pool nodes over the simulated time (included in the run's cost_usd)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class SwapRecord:
    """Swap preemption (``scheduler.preemption: swap | auto``); absent with ``recompute``."""

    mode: str  # swap | auto
    swap_space_bytes: int  # per node
    swaps: int  # preemptions that swapped the victim out (and back in)
    recomputes: int  # preemptions sent to recompute (auto found it cheaper, or no swap space)
    swapped_bytes: float  # copied out (and as many back in), per GPU
    peak_bytes: int  # the fullest node's swap space at its fullest
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class OutageRecord:
    """One replica down (``faults``): from `down_s` until it takes requests again at `up_s`."""

    replica: int
    down_s: float
    up_s: float  # down_s + the fault's duration + reload_s (overlapping faults merged)
    reload_s: float  # the weights reloaded: weight bytes per GPU / faults.reload_bandwidth
    requests_dropped: int  # running and waiting in it when it went down
    kv_blocks_lost: int  # blocks holding KV then (referenced, or cached and free)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class DrawnFaultRecord:
    """One failure drawn by ``faults.random``: `target` (a replica, or a node) down at `at_s`."""

    at_s: float
    target: int
    duration_s: float  # the exponential draw; the weights' reload comes after it
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class RandomFaultsRecord:
    """The failures ``faults.random`` drew (planned into `FaultsRecord.outages` with the events)."""

    kind: str  # replica_down | node_down
    rate_per_hour: float  # per component
    mean_down_s: float
    seed: int
    components: int  # replicas, or nodes, each failing at the rate
    span_s: float  # drawn over [0, span_s): the trace's last arrival, or sim.max_time if earlier
    expected: float  # rate_per_hour * span_s / 3600 * components: the Poisson mean of `drawn`
    drawn: int
    down_s: float  # their durations summed, before merging and without the reloads
    events: tuple[DrawnFaultRecord, ...]  # by target, then time
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class FaultsRecord:
    """What the run's faults cost (``faults``); absent from the summary without them."""

    outages: tuple[OutageRecord, ...]  # by replica, then time
    retries: int  # drops that sent a request back through the router
    failed: int  # requests dropped more often than max_retries
    max_retries: int
    lost_prompt_tokens: int  # prompt tokens whose KV was lost: prefilled again unless hit elsewhere
    lost_output_tokens: int  # generated tokens lost: decoded again
    recomputed_tokens: int  # the two together
    kv_blocks_lost: int  # over all outages
    replica_down_s: float  # replica-seconds down, reloads included, within the simulated time
    reload_s: float  # one replica's weight reload
    reload_bw_bytes_per_s: float
    reload_source: str
    router_queue_peak: int  # most requests waiting at the router with every replica down
    random: RandomFaultsRecord | None = field(default=None, metadata={"omit_none": True})
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class ReplicasUp:
    """Replicas up (starting, serving or draining: billed) over the run: the fewest, the most and
    the time-weighted mean."""

    min: int
    max: int
    mean: float
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class AutoscaleRecord:
    """What ``cluster.autoscale`` did; absent from the summary without it. The run's GPU-hours
    are `replica_s` x GPUs per replica / 3,600."""

    policy: str  # kv_usage | queue
    target: float
    min_replicas: int
    max_replicas: int
    initial_replicas: int
    interval_s: float
    cool_down_s: float
    scale_up_delay_s: float  # from a start to taking requests (billed from the start)
    scale_up_delay_source: str
    scale_ups: int  # replicas started
    scale_downs: int  # replicas drained (each off once its last request finished)
    replica_s: float  # integral of replicas up over the simulated time
    replicas_up: ReplicasUp
    # the capacity timeline: replicas up from each instant on (the first at 0), within the run
    timeline_t_s: tuple[float, ...]
    timeline_replicas: tuple[int, ...]
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class RoleRecord:
    """One pool of a disaggregated cluster (``cluster.disaggregation``) over the run."""

    role: str  # prefill | decode
    gpu: str
    tensor_parallel: int
    replicas: int
    gpus: int
    gpu_hour_usd: float
    cost_usd: float  # its GPUs at its price over the simulated time
    requests: int  # routed to this pool
    busy_fraction: BusyFraction  # share of simulated time its replicas ran steps
    kv_blocks_per_replica: int  # its memory plan
    kv_peak_used_blocks: int  # the fullest of its replicas
    kv_mean_used_blocks: float  # mean over its replicas and the run
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class DisaggregationRecord:
    """Prefill and decode on separate pools: each pool, and the KV moved between them."""

    roles: tuple[RoleRecord, ...]
    transfers: int  # requests whose KV moved to a decode replica
    transferred_bytes: float  # all GPUs' shards together
    transfer_s: Distribution  # from the decode replica's reservation to the KV's arrival
    block_wait_s: Distribution  # from the prefill's end to the reservation (blocks or seats full)
    handoff_s: Distribution  # from the prefill's end to the KV's arrival (what TTFT adds)
    link_busy_fraction: BusyFraction  # over the replicas' link queues that moved bytes
    # cluster.disaggregation.max_local_prefill_tokens: requests prefilled on the decode pool
    local_prefills: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Citation:
    claim: str
    source: str
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class AccuracyNote:
    """Cited accuracy estimates of a lossy KV format (kvsim.accuracy); never measured by the run."""

    format: str
    note: str | None
    estimate_only: bool
    kernel_rel_rms: float | None
    kernel_method: str | None
    literature: tuple[Citation, ...]
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class LossPartRecord:
    """One lossy technique's estimated accuracy loss (`kvsim.accuracy.LossPart`)."""

    technique: str
    loss: float  # a fraction: 0.005 is 0.5 points
    basis: str  # cited | assumption
    source: str
    lower_bound: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class AccuracyEstimate:
    """The run's combined accuracy-loss estimate (`kvsim.accuracy.accuracy_estimate`): cited, never
    measured; ``loss`` 0 with no parts when nothing in the cache is lossy."""

    loss: float
    lower_bound: bool
    parts: tuple[LossPartRecord, ...]
    rule: str
    basis: str
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class EvictionRecord:
    """What token eviction (``kv.eviction``) did, all replicas together; absent when it is off."""

    policy: str
    trigger: str
    pages: str
    heavy_ratio: float | None
    keep_ratio: float | None = None  # entropy: share kept below the threshold (an input, estimate)
    merge_ratio: float | None = None  # merge: tokens kept after merging / length (an input, estimate)
    recent_tokens: int
    sink_tokens: int
    budget_tokens: int
    tokens_evicted: int
    trims: int  # evictions beyond the steady one-out-per-token-in (after a prompt, when pressure starts)
    blocks_released: int  # freed by physical release (compaction)
    blocks_copied: int  # shared prefix blocks a trimmed sequence copied before rewriting them
    cache_entries_invalidated: int  # prefix-cache entries rewritten in place: no longer hits
    trim_s: float  # simulated seconds of trims (top-k, compaction, block tables) between steps
    accuracy: AccuracyNote | None = None  # the cited accuracy estimate of the policy
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class SlidingWindowRecord:
    """What the model's sliding-window layers freed (`kvsim.core.eviction.window_eviction`), all
    replicas together; absent for a model without them."""

    window_tokens: int
    global_tokens: int
    windowed_kv_layers: int
    kv_layers: int
    tokens_out_of_window: int  # token slots given up by windowed sequences (layer average)
    blocks_freed: int  # returned to the pool as they fell out of the window
    blocks_copied: int  # blocks of shared prefix entries still in a window, counted as its own
    cache_entries_invalidated: int  # prefix-cache entries given up by a windowed sequence: no hits
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class FormatSwitchRecord:
    """What ``kv.format_switch`` did, all replicas together; absent when it is off."""

    after_tokens: int
    format: str  # the second format's name
    requests_switched: int  # requests whose length passed after_tokens
    switches: int  # crossings (a request recomputed after a preemption crosses again)
    tokens_requantized: int  # read in kv.format and written in the second format at the crossings
    requant_s: float  # simulated seconds of those re-quantizations, between steps
    blocks_freed: int  # returned to the pool by the smaller format
    blocks_copied: int  # shared prefix blocks a switching sequence re-quantized into its own
    cache_entries_invalidated: int  # prefix-cache entries re-quantized in place: no longer hits
    accuracy: AccuracyNote | None = None  # the second format's cited estimate, for tokens past the switch
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class SpecDecodeRecord:
    """What speculative decoding (``scheduler.spec_decode``) did, all replicas together; absent when
    it is off. Its effect on TPOT is the summary's ``tpot_s`` against a run without it; on memory,
    ``kv_peak_used_blocks`` (each running request holds up to k look-ahead slots)."""

    k: int
    acceptance: str  # constant | beta
    acceptance_mean: float
    acceptance_concentration: float | None
    draft: str  # model | mtp
    draft_model: str | None
    layer_fraction: float | None
    verify_rows: int  # requests' verify steps (a step verifies many requests)
    drafted_tokens: int
    accepted_tokens: int
    accepted_per_step_mean: float | None
    tokens_per_step_mean: float | None  # emitted per verify step: accepted + 1
    accepted_per_step_hist: tuple[int, ...]  # verify steps by accepted drafts, 0..k
    acceptance_rate_observed: float | None  # accepted / drafted
    kv_discarded_tokens: int  # KV slots written for rejected drafts, then rolled back
    kv_discarded_bytes: int  # their bytes, per GPU
    lookahead_slots_per_request: int
    draft_s: float  # simulated seconds of draft passes (inside the steps' time)
    rollback: str
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """What was simulated, as the summary shows it (the scenario file is the full statement)."""

    model: str
    attention: str
    gpu: str
    num_gpus: int
    tensor_parallel: int
    replicas: int
    router: str
    kv_format: str
    block_size: int
    prefix_cache: str
    max_num_seqs: int
    max_batched_tokens: int
    chunked_prefill: bool
    cost_model: str
    gpu_hour_usd: float
    trace: str
    trace_format: str
    rate_scale: float
    seed: int
    fast_forward: bool
    overrides: tuple[str, ...]
    sources: dict[str, str]
    clip_to_context: bool = False
    scenario_path: str = ""  # the scenario file the run was loaded from ("" before it was recorded)
    profile: str = ""  # the measured profile priced with ("" for the analytic model)
    kv_format_mix: str = ""  # kv.format_mix: "H/N heads FORMAT" ("" without a mix)
    kv_format_switch: str = ""  # kv.format_switch: "FORMAT after N tokens" ("" without a switch)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class WorkloadRecord:
    """What the workload reader left out or changed, on purpose."""

    skipped_lines: int
    dropped: dict[str, int]  # reason -> trace rows dropped within the window
    clipped_to_context: int = 0  # requests shortened to the model's context (workload.clip_to_context)
    origin_s: float = 0.0  # the first request's time in the trace's own clock, before rebasing
    before_window: int = 0  # requests read but earlier than workload.start
    after_window: int = 0  # requests read but at or after workload.start + duration
    over_max_requests: int = 0  # requests in the window beyond workload.max_requests
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class SessionRecord:
    """Agent sessions (``workload.agent``): completion, durations and the prompt by segment."""

    sessions: int
    completed: int  # sessions whose every turn completed
    turns: int  # in the workload
    turns_sent: int  # arrived (closed loop: sent after the previous reply)
    turns_completed: int
    closed_loop: bool
    duration_s: Distribution  # first turn's arrival to last reply, completed sessions
    prompt_tokens_by_segment: dict[str, int]  # over the turns sent
    prompt_share_by_segment: dict[str, float]
    pinned_segments: tuple[str, ...] = ()
    pinned_blocks_peak: int = 0  # per replica, the most
    segment_policies: dict[str, str] = field(default_factory=dict)  # kv.segments, as given
    segment_dropped_blocks: int = 0  # cached blocks kv.segments dropped at turns' ends, all replicas
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------- record


@dataclass(frozen=True, kw_only=True)
class RunSummary:
    """One run's summary. Field order is the file's key order; groups as commented."""

    schema: str = SCHEMA
    version: int = VERSION
    # requests and latency
    requests: RequestCounts
    ttft_s: Distribution
    tpot_s: Distribution
    e2e_s: Distribution
    queue_s: Distribution
    itl_s: Distribution | None = None  # inter-token gaps, per token (None in files written before it)
    percentiles: tuple[float, ...] = ()  # chosen with --percentiles (the table's columns); () default
    # throughput and goodput (tokens or requests per simulated second)
    throughput_tok_s: float
    output_throughput_tok_s: float
    goodput_req_s: float
    slo: SloResult
    # prefix cache and preemption
    prefix_hit_rate: float
    preemptions: int
    tokens: TokenCounts
    # cost
    gpu_hours: float
    cost_usd: float
    cost_per_mtok_usd: float | None
    cost_per_output_mtok_usd: float | None
    scenario: str
    # memory (per GPU unless named per replica)
    hbm_capacity_bytes: int
    weight_bytes_per_gpu: int
    hbm_peak_bytes: int
    kv_peak_used_blocks: int
    kv_blocks_per_replica: int
    kv_block_bytes: float
    kv_tokens_per_replica: int
    memory_plan: MemoryPlan
    prefix_cache_evictions: int
    # engine
    steps: int
    replica_busy_fraction: BusyFraction | None = None  # None in files written before it existed
    engine_events: int
    simulated_s: float
    wall_s: float
    warnings: tuple[str, ...] = ()
    accuracy: AccuracyNote | None = None
    accuracy_estimate: AccuracyEstimate | None = None  # None in files written before it existed
    config: RunConfig
    workload: WorkloadRecord = field(default_factory=lambda: WorkloadRecord(skipped_lines=0, dropped={}))
    sim_speed_x: float
    replicas: tuple[ReplicaRecord, ...] = ()  # one per replica, by index
    offload: OffloadRecord | None = None  # kv.offload on
    swap: SwapRecord | None = None  # scheduler.preemption swap or auto
    global_pool: GlobalPoolRecord | None = None  # kv.prefix_cache.scope global
    links: tuple[LinkRecord, ...] = ()  # every link that moved bytes (offload, swap)
    sessions: SessionRecord | None = None  # agent workloads only
    eviction: EvictionRecord | None = None  # kv.eviction's effect (None when off)
    spec_decode: SpecDecodeRecord | None = None  # scheduler.spec_decode's effect (None when off)
    sliding_window: SlidingWindowRecord | None = None  # the model's windowed layers (None without)
    format_switch: FormatSwitchRecord | None = None  # kv.format_switch's effect (None when off)
    # cluster.disaggregation; absent from the file when aggregated (its summary.json unchanged)
    disaggregation: DisaggregationRecord | None = field(default=None, metadata={"omit_none": True})
    # faults: what replicas and nodes going down cost; absent from the file without them
    faults: FaultsRecord | None = field(default=None, metadata={"omit_none": True})
    # cluster.autoscale: replicas started and drained, the capacity timeline; absent without it
    autoscale: AutoscaleRecord | None = field(default=None, metadata={"omit_none": True})
    extra: dict[str, Any] = field(default_factory=dict)
    read_notes: tuple[str, ...] = field(default=(), compare=False, metadata=_NO_JSON)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``summary.json``): plain dicts, lists and scalars."""
        out = _encode(self)
        assert isinstance(out, dict)
        return out

    def to_json(self) -> str:
        """``summary.json``'s text; a `KvsimError` naming the fields that strict JSON cannot hold
        (an infinity or NaN: a defect, since the bounds refuse the inputs that make them)."""
        data = self.to_dict()
        bad = non_finite(data)
        if bad:
            shown = ", ".join(f"{where} is {v}" for where, v in bad[:3])
            more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
            raise KvsimError(
                f"{shown}{more}, which strict JSON cannot hold (a defect; please report it)",
                source="summary.json",
            )
        return json.dumps(data, indent=2, allow_nan=False) + "\n"

    @classmethod
    def from_dict(cls, data: object, *, source: str = "summary") -> RunSummary:
        """Validate and build; `KvsimError` naming ``source`` and the field on any mismatch."""
        if not isinstance(data, dict):
            raise KvsimError(f"expected a JSON object, got {type(data).__name__}", source=source)
        notes: list[str] = []
        if "schema" not in data and "version" not in data:
            if not isinstance(data.get("requests"), dict):
                raise KvsimError(
                    f"not a kvsim summary: no 'schema' field (expected {SCHEMA!r})", source=source
                )
            notes.append(f"written before summaries carried a schema version; read as version {VERSION}")
            data = {**data, "schema": SCHEMA, "version": VERSION}
        if data.get("schema") != SCHEMA:
            raise KvsimError(
                f"not a kvsim summary: expected {SCHEMA!r}, got {data.get('schema')!r}",
                source=source,
                path="schema",
            )
        version = data.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise KvsimError(f"expected a positive integer, got {version!r}", source=source, path="version")
        if version > VERSION:
            raise KvsimError(
                f"summary version {version} is newer than this kvsim reads ({VERSION}); upgrade kvsim",
                source=source,
                path="version",
            )
        record = _decode(cls, data, "", source)
        assert isinstance(record, cls)
        if notes:
            record = _replace_notes(record, tuple(notes))
        return record

    @classmethod
    def from_json(cls, text: str, *, source: str = "summary") -> RunSummary:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise KvsimError(f"not valid JSON: {exc.msg}", source=source, path=f"line {exc.lineno}") from None
        except (ValueError, RecursionError):
            raise KvsimError(
                "cannot read: JSON nested too deeply or a number out of range", source=source
            ) from None
        return cls.from_dict(data, source=source)


def read_summary(path: Path | str) -> RunSummary:
    """Read and validate ``summary.json`` (or a run directory holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "summary.json"
    if not path.is_file():
        raise KvsimError("summary.json not found; is this a kvsim run directory?", source=str(path))
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KvsimError(f"cannot read: {exc}", source=str(path)) from None
    return RunSummary.from_json(text, source=str(path))


def write_summary(path: Path, summary: RunSummary) -> None:
    """Write ``summary.json``; a value it cannot hold is a `KvsimError` naming `path` and the
    field (`RunSummary.to_json`), before anything is written."""
    try:
        text = summary.to_json()
    except KvsimError as exc:
        raise KvsimError(exc.message, source=str(path)) from None
    path.write_text(text)


def non_finite(data: object, where: str = "") -> list[tuple[str, float]]:
    """The dotted paths (``links.0.utilization``) and values of the infinities and NaNs in the
    JSON form `data`."""
    if isinstance(data, float):
        return [] if math.isfinite(data) else [(where, data)]
    if isinstance(data, dict):
        items: Any = data.items()
    elif isinstance(data, list | tuple):
        items = enumerate(data)
    else:
        return []
    return [bad for k, v in items for bad in non_finite(v, f"{where}.{k}" if where else str(k))]


def part_from_dict(cls: type[T], data: object, *, source: str, path: str = "") -> T:
    """One part of the record (e.g. `AccuracyNote`) from its dict form, validated like the file."""
    out = _decode(cls, data, path, source)
    assert isinstance(out, cls)
    return out


# ------------------------------------------------------------------------ generic (de)serialising


def _replace_notes(record: RunSummary, notes: tuple[str, ...]) -> RunSummary:
    from dataclasses import replace

    return replace(record, read_notes=notes)


def _json_fields(cls: type) -> list[Any]:
    return [f for f in fields(cls) if f.metadata.get("json", True) and f.name != "extra"]


def _encode(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        out = {
            f.name: _encode(getattr(value, f.name))
            for f in _json_fields(type(value))
            if not (f.metadata.get("omit_none") and getattr(value, f.name) is None)
        }
        for k, v in getattr(value, "extra", {}).items():
            out.setdefault(k, v)
        return out
    if isinstance(value, tuple | list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    return value


def _fail(source: str, where: str, message: str) -> KvsimError:
    return KvsimError(message, source=source, path=where or None)


def _show(v: object) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _decode(tp: Any, value: Any, where: str, source: str) -> Any:
    """``value`` (parsed JSON) checked against the annotation ``tp``."""
    if tp is Any:
        return value
    origin = get_origin(tp)
    if origin is types.UnionType or origin is typing.Union:
        args = [a for a in get_args(tp) if a is not type(None)]
        if value is None and len(args) < len(get_args(tp)):
            return None
        assert len(args) == 1, tp
        return _decode(args[0], value, where, source)
    if tp is bool:
        if not isinstance(value, bool):
            raise _fail(source, where, f"expected true or false, got {_show(value)}")
        return value
    if tp is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise _fail(source, where, f"expected an integer, got {_show(value)}")
        return value
    if tp is float:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise _fail(source, where, f"expected a number, got {_show(value)}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise _fail(source, where, f"expected a string, got {_show(value)}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise _fail(source, where, f"expected a mapping, got {_show(value)}")
        _, vt = get_args(tp)
        return {k: _decode(vt, v, f"{where}.{k}" if where else k, source) for k, v in value.items()}
    if origin is tuple:
        if not isinstance(value, list):
            raise _fail(source, where, f"expected a list, got {_show(value)}")
        (et, _) = get_args(tp)
        return tuple(_decode(et, v, f"{where}[{i}]", source) for i, v in enumerate(value))
    if isinstance(tp, type) and is_dataclass(tp):
        if not isinstance(value, dict):
            raise _fail(source, where, f"expected a mapping, got {_show(value)}")
        hints = get_type_hints(tp)
        known = _json_fields(tp)
        kwargs: dict[str, Any] = {}
        for f in known:
            sub = f"{where}.{f.name}" if where else f.name
            if f.name in value:
                kwargs[f.name] = _decode(hints[f.name], value[f.name], sub, source)
            elif f.default is MISSING and f.default_factory is MISSING:
                raise _fail(source, sub, "missing")
        names = {f.name for f in known}
        unknown = {k: v for k, v in value.items() if k not in names}
        if unknown:
            if "extra" not in {f.name for f in fields(tp)}:
                k = next(iter(unknown))
                raise _fail(source, f"{where}.{k}" if where else k, "unknown field")
            kwargs["extra"] = unknown
        return tp(**kwargs)
    raise AssertionError(f"no decoder for {tp!r}")

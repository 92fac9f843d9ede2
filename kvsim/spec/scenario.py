"""The scenario: YAML validated once into frozen, typed objects (SI units inside).

``load_scenario(path, overrides)`` reads the file with `kvsim.spec.yaml_loader` (YAML 1.2 numbers), applies ``--set a.b=v``
overrides (values parsed as YAML scalars, same paths, same validation) and returns a `Scenario`.
Paths in the file are relative to the file's folder; paths given in ``--set`` are relative to the
working directory (`OVERRIDE_PATHS`), as every path on the command line is.
Every field is documented in ``scenarios/README.md``; defaults name their source.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Collection
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

from kvsim.errors import KvsimError
from kvsim.spec import bounds as B
from kvsim.spec.autoscale import AutoscaleConfig, read_autoscale
from kvsim.spec.bench import BenchConfig, RandomConfig
from kvsim.spec.bounds import bounded
from kvsim.spec.faults import FaultsConfig, read_faults
from kvsim.spec.formats import FormatMix, FormatSwitch, KVFormat, make_format
from kvsim.spec.hardware import GPUSpec, load_gpu
from kvsim.spec.models import Attention, ModelSpec, load_model, names_a_file, with_weight_dtype
from kvsim.spec.offload import EVICTIONS, CopyMode, OffloadConfig, OffloadWrite, SSDConfig
from kvsim.spec.offload import PRESETS as OFFLOAD_PRESETS
from kvsim.spec.parallel import AttentionParallel, ParallelLayout, check_placement, read_parallel
from kvsim.spec.schema import Section, shorten, show
from kvsim.spec.segments import SegmentPolicies, check_segments_workload, read_segments
from kvsim.spec.topology import DEFAULT_HOST_DRAM, Topology, read_topology
from kvsim.spec.topology import PRESETS as TOPOLOGIES
from kvsim.spec.yaml_loader import read_yaml, yaml_scalar
from kvsim.units import (
    parse_bandwidth,
    parse_duration,
    parse_flops,
    parse_price_per_hour,
    parse_size,
)

TRACE_FORMATS = ("mooncake", "azure", "burstgpt", "vidur", "generic", "sharegpt")


class Choice(str, Enum):
    """A policy named in the scenario: compares equal to its name and prints as it."""

    def __str__(self) -> str:
        return str(self.value)


class RouterPolicy(Choice):
    ROUND_ROBIN = "round_robin"
    LEAST_OUTSTANDING_TOKENS = "least_outstanding_tokens"  # fewest tokens still to compute
    LEAST_OUTSTANDING_REQUESTS = "least_outstanding_requests"  # fewest requests in flight
    PREFIX_AFFINITY = "prefix_affinity"  # longest cached prefix, else least outstanding tokens
    CACHE_AWARE = "cache_aware"  # least load + prefill left after hits in any tier (Mooncake's conductor)


class PrefixCacheScope(Choice):
    NONE = "none"
    LOCAL = "local"  # each replica caches its own prefixes
    GLOBAL = "global"  # local HBM caches plus one cluster-wide pool in the nodes' DRAM (Mooncake)


class EvictionPolicy(Choice):
    NONE = "none"
    H2O = "h2o"
    STREAMING = "streaming"
    ENTROPY = "entropy"  # attention entropy below a threshold (documents 000, section 4.2)
    MERGE = "merge"  # token merging: similar tokens' KV merged (documents 003, token合并与压缩)


class PreemptionMode(Choice):
    RECOMPUTE = "recompute"  # release the victim's blocks; it recomputes (vLLM v1)
    SWAP = "swap"  # copy its KV to host memory and back (vLLM v0's swap), where swap space allows
    AUTO = "auto"  # per victim, the cheaper of the two by the cost model


class EvictionTrigger(Choice):
    ALWAYS = "always"
    PRESSURE = "pressure"  # only while referenced blocks reach pressure_threshold of the pool


class PagePolicy(Choice):
    SOFT_MARK = "soft_mark"  # evicted slots reused, blocks kept
    PHYSICAL = "physical"  # kept tokens compacted, blocks freed
    HYBRID = "hybrid"  # soft-mark, physical under pressure (vLLM, TensorRT-LLM: documents 000, 4.3)


class CostModelKind(Choice):
    ANALYTIC = "analytic"
    PROFILE = "profile"


_C = TypeVar("_C", bound=Choice)


def _choice(s: Section, key: str, kind: type[_C], default: _C) -> _C:
    """``s.key`` as a member of ``kind``; anything else: one line naming the field and the values."""
    return kind(s.choice(key, [m.value for m in kind], default.value))


@dataclass(frozen=True)
class RouterBalance:
    """``cluster.router_balance``: prefix affinity's load guard, as SGLang's router (now SMG) runs
    its cache-aware policy: when the busiest replica holds more than `abs_threshold` requests more
    than the idlest and more than `rel_threshold` times as many, the request goes to the replica
    with the fewest requests instead of the one with the longest cached prefix. Defaults: that
    router's ``--balance-abs-threshold 64`` and ``--balance-rel-threshold 1.5``."""

    abs_threshold: int = 64
    rel_threshold: float = 1.5


@dataclass(frozen=True)
class ClusterConfig:
    gpu: GPUSpec
    nodes: int
    gpus_per_node: int
    tensor_parallel: int
    topology: Topology  # links (host PCIe, NVLink, network) and the node (host DRAM)
    gpu_memory_utilization: float  # vLLM's knob: share of HBM the engine may plan with
    activation_reserve_bytes: int | None  # None = estimated from the model and scheduler
    router: RouterPolicy
    # cluster.disaggregation: a prefill pool and a decode pool (None: aggregated, every replica
    # runs both phases). With it, the pools' replicas are the cluster; nodes is not read.
    disaggregation: DisaggregationConfig | None = None
    # cluster.parallel: a MoE replica's attention TP or DP and expert parallelism (None: every
    # weight split by TP, as before the section existed; `kvsim.spec.parallel`).
    parallel: ParallelLayout | None = None
    # cluster.router_balance: prefix affinity's load guard (None: prefix hits decide alone)
    router_balance: RouterBalance | None = None
    # cluster.autoscale: replicas added and removed by load within this cluster's (None: all up
    # throughout; `kvsim.spec.autoscale`).
    autoscale: AutoscaleConfig | None = None

    @property
    def host_dram_bytes(self) -> int:  # per node
        return self.topology.node.host_dram_bytes

    @property
    def num_gpus(self) -> int:
        if self.disaggregation is not None:
            return self.disaggregation.num_gpus
        return self.nodes * self.gpus_per_node

    @property
    def replica_gpus(self) -> int:
        """GPUs of one (aggregated) replica: TP, times PP x CP under `parallel`."""
        if self.parallel is None:
            return self.tensor_parallel
        return self.parallel.replica_gpus(self.tensor_parallel)

    @property
    def num_replicas(self) -> int:
        if self.disaggregation is not None:
            return self.disaggregation.prefill.replicas + self.disaggregation.decode.replicas
        return self.num_gpus // self.replica_gpus


ROLES = ("prefill", "decode")
TRANSFER_LINKS = ("auto", "nvlink", "network")


@dataclass(frozen=True)
class PoolConfig:
    """One role's pool (``cluster.disaggregation.prefill`` or ``.decode``): its replicas, each of
    `tensor_parallel` GPUs of type `gpu`, at `price` per GPU-hour."""

    role: str  # "prefill" or "decode"
    gpu: GPUSpec
    tensor_parallel: int
    replicas: int
    price: GpuPrice

    @property
    def num_gpus(self) -> int:
        return self.replicas * self.tensor_parallel


@dataclass(frozen=True)
class DisaggregationConfig:
    """``cluster.disaggregation``: prefill and decode on separate pools, each request's KV moved from
    the prefill replica that computed it to a decode replica over `link` (``auto``: NVLink where both
    replicas sit in one node, the GPUs' NICs otherwise). Design: docs/architecture.md
    ("Disaggregated prefill and decode")."""

    prefill: PoolConfig
    decode: PoolConfig
    link: str  # auto, nvlink or network
    # Conditional disaggregation (Dynamo's disaggregated router, ``max_local_prefill_length``):
    # a request whose prompt is at most this many tokens is prefilled on the decode pool itself,
    # its KV never moved; 0 (the default): every request is prefilled remotely.
    max_local_prefill_tokens: int = 0

    @property
    def pools(self) -> tuple[PoolConfig, PoolConfig]:
        return self.prefill, self.decode

    @property
    def num_gpus(self) -> int:
        return self.prefill.num_gpus + self.decode.num_gpus

    @property
    def usd_per_hour(self) -> float:
        """Both pools' GPUs at their prices, per hour."""
        return sum(p.num_gpus * p.price.usd_per_hour for p in self.pools)


@dataclass(frozen=True)
class EvictionConfig:
    """``kv.eviction``; the policies themselves are `kvsim.core.eviction`."""

    policy: EvictionPolicy = EvictionPolicy.NONE
    budget_tokens: int = 0  # h2o, entropy: a cap on tokens kept (0: none); streaming: >= sinks + recent
    sink_tokens: int = 4  # streaming: attention sinks (StreamingLLM keeps 4)
    recent_tokens: int = 0  # the recent window kept
    heavy_ratio: float = 0.2  # h2o: heavy hitters / sequence length (documents 000, 7.3: start at 20%)
    trigger: EvictionTrigger = EvictionTrigger.ALWAYS
    pressure_threshold: float = 0.9  # share of the pool referenced that counts as pressure (estimate)
    pages: PagePolicy = PagePolicy.HYBRID
    # entropy: the share of a sequence whose attention entropy is below the threshold (kept).
    # Estimate: a simulator cannot measure which tokens pass it; documents 000, section 4.1: 70-80%
    # of a long sequence's tokens get near-zero attention ("dead tokens"), so about 25% stay.
    keep_ratio: float = 0.25
    # merge: tokens kept after merging / sequence length, in (0, 1]. Estimate: 0.5, pairs merged
    # (a kvsim choice; CaM, Zhang et al., ICML 2024, evaluates down to 20% kept).
    merge_ratio: float = 0.5


@dataclass(frozen=True)
class GlobalPoolConfig:
    """``kv.prefix_cache`` with ``scope: global``: a cluster-wide store of prefix-cache entries in the
    nodes' DRAM (Mooncake Store), fed with every entry an HBM pool registers."""

    pool_bytes: int = 0  # per node (0: the host DRAM left beside the offload tier and swap space)
    fetch: str = "auto"  # auto: fetch an entry only where it beats recomputing it; always
    eviction: str = "lru"  # pool_eviction: lru | lfu (`kvsim.core.tiers`)
    # Dedicated pool nodes (Mooncake Store on memory servers of its own): 0 keeps the pool in the
    # GPU nodes' DRAM. With N > 0 each pool node gives `pool_node_bytes` of DRAM (0: cluster.host_dram)
    # and has `pool_node_nics` NICs of cluster.topology.network's bandwidth; its price is added to
    # the run's cost. The defaults' sources: `POOL_NODE_SOURCES`.
    pool_nodes: int = 0
    pool_node_bytes: int = 0
    pool_node_nics: int = 2
    pool_node_cost_per_hour: float | None = None  # None: by its DRAM at `POOL_NODE_USD_PER_GIB_HOUR`

    def pool_node_usd_per_hour(self, host_dram_bytes: int) -> float:
        """One pool node's price: as given, or its DRAM's at the x2idn family's rate."""
        if self.pool_node_cost_per_hour is not None:  # as given (0: hardware already paid for)
            return self.pool_node_cost_per_hour
        return (self.pool_node_bytes or host_dram_bytes) / 2**30 * POOL_NODE_USD_PER_GIB_HOUR


# AWS EC2 x2idn (memory-optimized, on-demand Linux list prices, us-east-1): 16xlarge 1,024 GiB
# $6.669/h, 24xlarge 1,536 GiB $10.003/h, 32xlarge 2,048 GiB $13.338/h: linear in DRAM, $6.513 per
# TiB-hour; a pool node's default price is its DRAM at that rate (extrapolated outside 1-2 TiB).
POOL_NODE_USD_PER_GIB_HOUR = 13.338 / 2048


# Where the pool nodes' defaults come from (shown with the run's sources).
POOL_NODE_SOURCES = (
    ("pool node dram", "cluster.host_dram: 2 TiB, as a DGX H100 node's system memory"),
    (
        "pool node nics",
        "2 NICs of cluster.topology.network's bandwidth each (estimate: a CPU memory server's 1-2 "
        "ConnectX-7 400 Gb/s NICs; Mooncake's own nodes carry 8 x 400 Gb/s RoCE, striped by its "
        "Transfer Engine to 190 GB/s measured, Mooncake doc/en/transfer-engine.md)",
    ),
    (
        "pool node price",
        "its DRAM at $13.338 per 2,048 GiB-hour: AWS EC2 x2idn on-demand Linux list prices, us-east-1 "
        "(16/24/32xlarge: 1,024/1,536/2,048 GiB at $6.669/10.003/13.338 an hour, linear in DRAM)",
    ),
)


@dataclass(frozen=True)
class KVConfig:
    block_size: int
    format: KVFormat
    format_note: str | None
    prefix_cache: PrefixCacheScope
    eviction: EvictionConfig
    offload: OffloadConfig
    global_pool: GlobalPoolConfig = field(default_factory=GlobalPoolConfig)
    # Prompt segments whose cached blocks are evicted last (agent workloads: system, tools), and
    # the share of a replica's blocks they may hold at most.
    pin_segments: tuple[str, ...] = ()
    pin_max_share: float = 0.25
    format_mix: FormatMix | None = None  # some KV heads in a second format (None: all in `format`)
    format_switch: FormatSwitch | None = None  # re-quantized past a length (None: `format` throughout)
    # kv.segments (`kvsim.spec.segments`): a cache policy per agent prompt segment; its keep
    # segments are also `pin_segments`. None: the plain prefix cache.
    segments: SegmentPolicies | None = None


MAX_DRAFT_TOKENS = 32  # k's bound: vLLM's examples use 1-10, EAGLE trees up to ~60 nodes but
# chains of <= 8; at any acceptance below 0.9 a 33rd draft is kept less than 3% of the time


@dataclass(frozen=True)
class SpecDecodeConfig:
    """``scheduler.spec_decode``: speculative decoding (`kvsim.core.spec_decode`)."""

    k: int  # draft tokens per verify step
    mean: float  # acceptance rate per draft token (the Beta's mean when `concentration` is set)
    concentration: float | None  # Beta(mean*c, (1-mean)*c) per request; None: a constant rate
    draft_kind: str  # model | mtp
    draft_model: ModelSpec | None  # kind model: the draft model, priced by the same cost model
    layer_fraction: float  # kind mtp: the head's cost as a share of one target layer


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_batched_tokens: int
    chunked_prefill: bool
    preemption: PreemptionMode = field(default_factory=lambda: PreemptionMode.RECOMPUTE)
    # Host memory per GPU for swapped-out KV: vLLM v0's --swap-space default, 4 GiB per GPU.
    swap_space_bytes: int = 4 * 2**30
    spec_decode: SpecDecodeConfig | None = None  # None: off


@dataclass(frozen=True)
class LengthDist:
    kind: str  # constant | uniform | lognormal | exponential
    mean: float
    stdev: float = 0.0
    lo: int = 1
    hi: int = 1 << 30


@dataclass(frozen=True)
class SyntheticConfig:
    num_requests: int
    rate_per_s: float
    arrival: str  # poisson | gamma
    cv: float  # coefficient of variation of inter-arrival gaps (gamma)
    input: LengthDist
    output: LengthDist
    shared_prefix_tokens: int = 0
    shared_prefix_count: int = 1  # distinct system prompts
    session_turns: int = 1  # multi-turn sessions: each turn's prompt extends the previous one
    think_time_s: float = 0.0


class ToolOutputPolicy(Choice):
    """What an agent does with a tool's output once the reply that used it is written."""

    KEEP = "keep"  # stays in the history verbatim
    DROP = "drop"  # removed from later prompts
    COMPRESS = "compress"  # replaced by a summary of compress_ratio of its tokens


@dataclass(frozen=True)
class AgentConfig:
    """Closed-loop agent sessions (`kvsim.spec.agent`): each turn is sent when the previous reply
    arrives plus a think time (a user message) or a tool time (a tool's output)."""

    sessions: int
    rate_per_s: float  # session starts per second (Poisson)
    turns: LengthDist  # turns per session
    system_prompt_tokens: int
    system_prompts: int  # distinct system prompts, one per session drawn uniformly
    tool_tokens: int  # tool definitions after the system prompt, shared by every session
    user: LengthDist  # tokens of a user message
    tool_output: LengthDist  # tokens of a tool's output
    tool_call_share: float  # share of replies that call a tool (the next turn's input is its output)
    output: LengthDist  # tokens of a reply
    think_time_s: float  # before a user message
    tool_time_s: float  # before a tool output (the tool runs)
    history_turns: int  # earlier turns kept in the prompt (0: all)
    tool_outputs: ToolOutputPolicy
    compress_ratio: float  # summary tokens / tool output tokens (tool_outputs: compress)
    closed_loop: bool = True  # False: turns at fixed times (start + gaps), as the synthetic sessions
    head_share: float | None = None  # given: tool_tokens was sized from it (`_head_tokens`)


@dataclass(frozen=True)
class WorkloadConfig:
    trace: Path | None
    format: str
    synthetic: SyntheticConfig | None
    rate_scale: float
    start_s: float
    duration_s: float | None
    max_requests: int | None
    skip_bad_lines: bool
    clip_to_context: bool = False  # shorten over-long requests to the model's context, not reject them
    agent: AgentConfig | None = None  # format "agent": closed-loop agent sessions
    bench: BenchConfig | None = None  # vLLM bench serve's traffic (formats sharegpt and random)
    random: RandomConfig | None = None  # format "random": vLLM bench's random dataset


@dataclass(frozen=True)
class SLOConfig:
    ttft_s: float
    tpot_s: float
    percentile: float


@dataclass(frozen=True)
class CostModelConfig:
    kind: CostModelKind
    profile: Path | None
    force: bool


@dataclass(frozen=True)
class SimConfig:
    seed: int
    max_time_s: float | None
    fast_forward: bool


class PriceBasis(Choice):
    """Where a run's $/GPU-hour comes from, in order of precedence."""

    GPU_MAP = "gpu_map"  # pricing.gpu_hour_by_gpu: the scenario's price for this GPU type
    SCENARIO = "scenario"  # pricing.gpu_hour: one price for whatever GPU the scenario runs on
    PRESET = "preset"  # the GPU preset's price (kvsim/spec/hardware.py, with its source)


@dataclass(frozen=True)
class GpuPrice:
    """A run's $/GPU-hour and where it comes from (`resolve_gpu_price`)."""

    usd_per_hour: float
    basis: PriceBasis
    origin: str  # "h100-sxm preset", "pricing.gpu_hour (plan.yaml)", "pricing.gpu_hour_by_gpu.b200 (--set)"
    note: str = ""  # the preset's price_source (its basis), "" for a scenario's own price
    warning: str = ""  # a scenario-wide price applied to a GPU type other than the file's own

    @property
    def source(self) -> str:
        """Where the price comes from, in words (the plan's rows and page)."""
        return f"{self.origin}: {self.note}" if self.note else self.origin

    @property
    def source_line(self) -> str:
        """The summary's ``config.sources.price``: the price, then its source."""
        return f"${self.usd_per_hour:.2f}/GPU-h: {self.note or self.origin}"


@dataclass(frozen=True)
class Scenario:
    name: str
    source: str
    model: ModelSpec
    cluster: ClusterConfig
    kv: KVConfig
    scheduler: SchedulerConfig
    workload: WorkloadConfig
    slo: SLOConfig
    gpu_price: GpuPrice  # pricing (resolve_gpu_price)
    cost_model: CostModelConfig
    sim: SimConfig
    overrides: tuple[str, ...] = field(default=())
    notes: tuple[str, ...] = field(default=())  # for the run's warnings (old section names)
    faults: FaultsConfig | None = None  # replicas and nodes down mid-run (None: none)

    @property
    def gpu_hour_usd(self) -> float:
        """$/GPU-hour; with cluster.disaggregation, the mean over both pools' GPUs at their prices
        (so GPUs x hours x this is what the run's GPUs cost)."""
        d = self.cluster.disaggregation
        if d is not None:
            return d.usd_per_hour / d.num_gpus
        return self.gpu_price.usd_per_hour

    def role(self, pool: PoolConfig) -> Scenario:
        """This scenario as one pool of its disaggregated cluster sees it: that pool's GPU, TP and
        price alone (its memory plan and cost model are built from it as from any scenario)."""
        c = dataclasses.replace(
            self.cluster,
            gpu=pool.gpu,
            tensor_parallel=pool.tensor_parallel,
            nodes=1,
            gpus_per_node=pool.num_gpus,
            disaggregation=None,
        )
        return dataclasses.replace(self, cluster=c, gpu_price=pool.price)

    @property
    def pool_nodes_usd_per_hour(self) -> float:
        """What the dedicated pool nodes cost per hour, all together (0 without them): the
        machines the run pays for besides its GPUs."""
        gp = self.kv.global_pool
        if self.kv.prefix_cache != "global" or not gp.pool_nodes:
            return 0.0
        return gp.pool_nodes * gp.pool_node_usd_per_hour(self.cluster.host_dram_bytes)


def _pow2(v: int) -> bool:
    return v > 0 and (v & (v - 1)) == 0


def _read_gpu(root: Section) -> tuple[GPUSpec, str, dict[str, float]]:
    """The GPU, its preset's name (the topology preset follows it) and the link bandwidths given
    under ``cluster.gpu`` (``host_h2d``, ``host_d2h``, ``nvlink``: older spellings of
    ``cluster.topology``'s, still read)."""
    raw = root.raw("gpu")
    if isinstance(raw, str):
        gpu = root.parsed("gpu", lambda v: load_gpu(v))
        return gpu, gpu.name, {}
    s = Section(raw, source=root.source, path=root._p("gpu"))
    base = s.parsed("preset", load_gpu)
    changes: dict[str, Any] = {}
    if s.has("hbm"):
        changes["hbm_bytes"] = s.parsed("hbm", bounded(parse_size, B.HBM_SIZE))
    if s.has("hbm_bw"):
        changes["hbm_bw_bytes_per_s"] = s.parsed("hbm_bw", bounded(parse_bandwidth, B.HBM_BW))
    if s.has("bf16_flops"):
        changes["bf16_flops"] = s.parsed("bf16_flops", bounded(parse_flops, B.FLOPS))
    if s.has("fp8_flops"):
        changes["fp8_flops"] = s.parsed("fp8_flops", bounded(parse_flops, B.FLOPS))
    links = {
        k: s.parsed(k, bounded(parse_bandwidth, B.LINK_BW))
        for k in ("host_h2d", "host_d2h", "nvlink")
        if s.has(k)
    }
    for k in ("hbm", "hbm_bw", "bf16_flops", "fp8_flops", "host_h2d", "host_d2h", "nvlink"):
        s.raw(k, None)
    s.done()
    if changes:
        src = tuple(base.sources) + tuple((k, "scenario override") for k in changes)
        return dataclasses.replace(base, name=f"{base.name}*", sources=src, **changes), base.name, links
    return base, base.name, links


def _read_cluster(root: Section) -> ClusterConfig:
    s = root.section("cluster", required=True)
    gpu, preset, legacy_links = _read_gpu(s)
    nodes = s.int("nodes", 1, lo=1, hi=100_000)
    gpn = s.int("gpus_per_node", 8, lo=1, hi=64)
    tp = s.int("tensor_parallel", 1, lo=1, hi=64)
    if gpn % tp:
        raise s.err("tensor_parallel", f"must divide gpus_per_node ({gpn}), got {tp}")
    dram = s.parsed(
        "host_dram", bounded(lambda v: parse_size(v, allow_zero=True), B.HOST_SIZE), DEFAULT_HOST_DRAM
    )
    topology = read_topology(
        s, TOPOLOGIES[preset], gpus_per_node=gpn, host_dram_bytes=dram, legacy=legacy_links
    )
    util = s.float("gpu_memory_utilization", 0.9, lo=0.0, hi=1.0, lo_open=True)
    reserve_raw = s.raw("activation_reserve", "auto")
    reserve = None
    if reserve_raw != "auto":
        reserve = s.parsed("activation_reserve", lambda v: parse_size(v, allow_zero=True))
    router = _choice(s, "router", RouterPolicy, RouterPolicy.LEAST_OUTSTANDING_TOKENS)
    balance = _read_router_balance(s, router)
    s.raw("disaggregation", None)  # read with the pricing (`_read_disaggregation`)
    s.raw("parallel", None)  # read with the model (`read_parallel`)
    s.raw("autoscale", None)  # read once the replicas are known (`read_autoscale`)
    s.done()
    return ClusterConfig(gpu, nodes, gpn, tp, topology, util, reserve, router, router_balance=balance)


def _read_router_balance(s: Section, router: RouterPolicy) -> RouterBalance | None:
    """``cluster.router_balance`` (None when absent): prefix affinity's load guard."""
    if not s.has("router_balance"):
        return None
    if router is not RouterPolicy.PREFIX_AFFINITY:
        raise s.err(
            "router_balance", f"guards the prefix_affinity router's choice; the router is {router.value}"
        )
    b = s.section("router_balance")
    out = RouterBalance(
        abs_threshold=b.int("abs_threshold", RouterBalance.abs_threshold, lo=0, hi=1_000_000),
        rel_threshold=b.float("rel_threshold", RouterBalance.rel_threshold, lo=1.0, hi=1000.0),
    )
    b.done()
    return out


def _read_disaggregation(
    root: Section,
    cluster: ClusterConfig,
    model: ModelSpec,
    pricing: Section,
    overrides: tuple[str, ...],
    file_gpu: str | None,
) -> DisaggregationConfig | None:
    """``cluster.disaggregation`` (None when absent): each role's ``replicas`` (required, at least
    one), ``gpu`` (a preset name; default cluster.gpu) and ``tensor_parallel`` (default the
    cluster's), priced as `resolve_gpu_price` prices the cluster's GPU unless the role gives its own
    ``gpu_hour``; and the ``transfer.link``. ``enabled: false`` makes the cluster aggregated (the
    section's keys are checked by name only)."""
    c = root.section("cluster", required=True)
    if not c.has("disaggregation"):
        return None
    d = c.section("disaggregation")
    if not d.bool("enabled", True):  # aggregated after all (a plan's or sweep's axis): the rest unread
        for key in ("prefill", "decode", "transfer", "max_local_prefill_tokens"):
            d.raw(key, None)
        d.done()
        return None
    if c.has("nodes"):
        raise c.err(
            "nodes", "the pools of cluster.disaggregation set the GPUs: give each role's replicas instead"
        )
    pools = []
    for role in ROLES:
        r = d.section(role, required=True)
        gpu = cluster.gpu if not r.has("gpu") else r.parsed("gpu", lambda v: load_gpu(v))
        tp = r.int("tensor_parallel", cluster.tensor_parallel, lo=1, hi=64)
        if cluster.gpus_per_node % tp:
            raise r.err(
                "tensor_parallel", f"must divide cluster.gpus_per_node ({cluster.gpus_per_node}), got {tp}"
            )
        if model.num_heads % tp and model.num_kv_heads % tp:
            raise r.err(
                "tensor_parallel",
                f"{tp} divides neither the model's {model.num_heads} query heads nor its {model.num_kv_heads} KV heads",
            )
        n = r.int("replicas", lo=1, hi=100_000)
        if r.has("gpu_hour"):
            usd = r.parsed("gpu_hour", bounded(parse_price_per_hour, B.PRICE))
            price = GpuPrice(usd, PriceBasis.SCENARIO, f"{r._p('gpu_hour')} ({Path(r.source).name})")
        else:
            price = resolve_gpu_price(pricing, gpu, file_gpu=file_gpu, overrides=overrides)
        r.done()
        pools.append(PoolConfig(role, gpu, tp, n, price))
    t = d.section("transfer")
    link = t.choice("link", TRANSFER_LINKS, "auto")
    t.done()
    local = d.int("max_local_prefill_tokens", 0, lo=0, hi=1 << 24)
    d.done()
    return DisaggregationConfig(pools[0], pools[1], link, local)


def _read_format_mix(s: Section, model: ModelSpec, main: KVFormat) -> FormatMix | None:
    """``kv.format_mix``: {format, share, and the format's own group_size / scale / outlier_fraction}."""
    if s.raw("format_mix", None) is None:
        return None
    x = s.section("format_mix")
    fmt = _read_second_format(x, main)
    share = x.float("share", lo=0.0, hi=1.0)
    x.done()
    if model.attention is Attention.MLA:
        raise x.err("format", f"{model.name} caches one MLA latent per token: there are no KV heads to split")
    return FormatMix(fmt, share, round(share * model.num_kv_heads), model.num_kv_heads)


def _read_second_format(x: Section, main: KVFormat) -> KVFormat:
    """A second KV format's fields in section `x` (``kv.format_mix``, ``kv.format_switch``): its name
    and its own group_size / scale / outlier_fraction, defaulting to ``kv.format``'s."""
    name = x.raw("format", None)
    if not isinstance(name, str):
        raise x.err("format", f"expected a format name, got {show(name)}")
    group = x.int("group_size", main.group_size or 64, lo=1, hi=4096)
    scale = x.choice("scale", ("per_tensor", "per_head"), main.scale.value)
    out_frac = x.float("outlier_fraction", main.outlier_fraction or 0.01, lo=0.0, hi=0.5)
    try:
        fmt, _ = make_format(name, group_size=group, scale=scale, outlier_fraction=out_frac)
    except KvsimError as exc:
        raise x.err("format", shorten(exc.message, 200)) from None
    return fmt


def _read_format_switch(
    s: Section, model: ModelSpec, main: KVFormat, mix: FormatMix | None
) -> FormatSwitch | None:
    """``kv.format_switch``: {after_tokens, format, and the format's own group_size / scale /
    outlier_fraction}: a second format that stores fewer bytes per token than ``kv.format``."""
    if s.raw("format_switch", None) is None:
        return None
    x = s.section("format_switch")
    after = x.int("after_tokens", lo=1, hi=1 << 40)
    if after >= model.max_context:
        raise x.err(
            "after_tokens",
            f"{after:,} is not below {model.name}'s context ({model.max_context:,} tokens): no sequence "
            "would switch",
        )
    fmt = _read_second_format(x, main)
    x.done()
    b1, b2 = model.kv_bytes_per_token(main), model.kv_bytes_per_token(fmt)
    if b2 >= b1:
        raise x.err(
            "format",
            f"{fmt.name} stores {b2:,} bytes per token, not fewer than kv.format {main.name} ({b1:,}): "
            "a switch must shrink the cache",
        )
    if mix is not None:
        raise x.err("format", "a switch of kv.format_mix's two formats is not simulated; drop one of them")
    return FormatSwitch(after, fmt)


def _read_kv(root: Section, model: ModelSpec) -> KVConfig:
    s = root.section("kv")
    bs = s.int("block_size", 16, lo=1, hi=4096)
    if not _pow2(bs):
        raise s.err("block_size", f"must be a power of two, got {bs}")
    fmt_raw = s.raw("format", "bf16")
    group = s.int("group_size", 64, lo=1, hi=4096)
    scale = s.choice("scale", ("per_tensor", "per_head"), "per_tensor")
    out_frac = s.float("outlier_fraction", 0.01, lo=0.0, hi=0.5)
    if not isinstance(fmt_raw, str):
        raise s.err("format", f"expected a format name, got {show(fmt_raw)}")
    try:
        fmt, note = make_format(fmt_raw, group_size=group, scale=scale, outlier_fraction=out_frac)
    except KvsimError as exc:
        raise s.err("format", shorten(exc.message, 200)) from None
    for key, value, default, owners, label in (
        ("group_size", group, 64, ("int8", "int4"), "int8 and int4"),
        ("scale", scale, "per_tensor", ("fp8_e4m3",), "fp8"),
        ("outlier_fraction", out_frac, 0.01, ("kvquant4",), "kvquant4 (turboquant)"),
    ):
        why = f"applies to kv.format {label} only, not {fmt_raw}"
        _refuse_unused(s, key, value, default, fmt.kind.value not in owners, why)
    segments = read_segments(s)
    kept = () if segments is None else segments.kept
    pc_raw = s.raw("prefix_cache", {"scope": "local"})
    gpool = GlobalPoolConfig()
    pin: tuple[str, ...] = ()
    pin_share = 0.25
    if isinstance(pc_raw, bool):
        scope = PrefixCacheScope.LOCAL if pc_raw else PrefixCacheScope.NONE
    else:
        pc = Section(pc_raw, source=s.source, path=s._p("prefix_cache"))
        scope = _choice(pc, "scope", PrefixCacheScope, PrefixCacheScope.LOCAL)
        n_pool = pc.int("pool_nodes", 0, lo=0, hi=10_000)
        if n_pool and pc.raw("pool_bytes", None) is not None:
            raise pc.err(
                "pool_bytes",
                "is the pool's share of each GPU node's DRAM, unused with pool_nodes; size the pool "
                "nodes with pool_node_bytes",
            )
        dflt = GlobalPoolConfig()
        gpool = GlobalPoolConfig(
            pool_bytes=pc.parsed("pool_bytes", bounded(parse_size, B.HOST_SIZE), 0)
            if pc.raw("pool_bytes", None) is not None
            else 0,
            fetch=pc.choice("fetch", ("auto", "always"), "auto"),
            eviction=pc.choice("pool_eviction", EVICTIONS, "lru"),
            pool_nodes=n_pool,
            pool_node_bytes=pc.parsed("pool_node_bytes", bounded(parse_size, B.HOST_SIZE))
            if pc.raw("pool_node_bytes", None) is not None
            else 0,
            pool_node_nics=pc.int("pool_node_nics", dflt.pool_node_nics, lo=1, hi=64),
            pool_node_cost_per_hour=pc.parsed(
                "pool_node_cost_per_hour", bounded(parse_price_per_hour, B.PRICE)
            )
            if pc.raw("pool_node_cost_per_hour", None) is not None
            else dflt.pool_node_cost_per_hour,
        )
        pin = pc.parsed("pin", _read_pin, ())
        pin_share = pc.float("pin_max_share", 0.25, lo=0.0, hi=1.0, lo_open=True)
        if pin and scope == "none":
            raise pc.err("pin", "pinning needs a prefix cache; set scope: local")
        if pin and kept:
            raise pc.err("pin", "give the pinned segments once: as pin or as kv.segments' keep, not both")
        for key, value, default in (
            ("pool_bytes", gpool.pool_bytes, dflt.pool_bytes),
            ("fetch", gpool.fetch, dflt.fetch),
            ("pool_eviction", gpool.eviction, dflt.eviction),
            ("pool_nodes", n_pool, 0),
        ):
            _refuse_unused(pc, key, value, default, scope != "global", "only with scope: global")
        for key, value, default in (
            ("pool_node_bytes", gpool.pool_node_bytes, dflt.pool_node_bytes),
            ("pool_node_nics", gpool.pool_node_nics, dflt.pool_node_nics),
            ("pool_node_cost_per_hour", gpool.pool_node_cost_per_hour, dflt.pool_node_cost_per_hour),
        ):
            _refuse_unused(pc, key, value, default, not n_pool, "only with pool_nodes (dedicated pool nodes)")
        why = "only with pin or a kv.segments keep (the segments pinned)"
        _refuse_unused(pc, "pin_max_share", pin_share, 0.25, not (pin or kept), why)
        pc.done()
    if segments is not None:
        if scope == "none":
            raise s.err(
                "segments", "segment policies act on the prefix cache; set kv.prefix_cache.scope: local"
            )
        pin = pin or kept
    ev = s.section("eviction")
    policy = _choice(ev, "policy", EvictionPolicy, EvictionPolicy.NONE)
    budget = ev.int("budget_tokens", 0, lo=0, hi=1 << 30)
    sinks = ev.int("sink_tokens", 4, lo=0, hi=1 << 20)
    recent = ev.int("recent_tokens", 0, lo=0, hi=1 << 30)
    ratio = ev.float("heavy_ratio", 0.2, lo=0.0, hi=1.0, lo_open=True)
    keep = ev.float("keep_ratio", 0.25, lo=0.0, hi=1.0, lo_open=True)
    merge = ev.float("merge_ratio", 0.5, lo=0.0, hi=1.0, lo_open=True)
    trigger = _choice(ev, "trigger", EvictionTrigger, EvictionTrigger.ALWAYS)
    threshold = ev.float("pressure_threshold", 0.9, lo=0.0, hi=1.0, lo_open=True)
    pages = _choice(ev, "pages", PagePolicy, PagePolicy.HYBRID)
    # A field the chosen policy does not read would be silently ignored: refused at any value but
    # its default (a default written out, as in a dumped config, changes nothing and is accepted).
    d = EvictionConfig()
    fields = (
        ("budget_tokens", budget, d.budget_tokens, None),
        ("sink_tokens", sinks, d.sink_tokens, "streaming"),
        ("recent_tokens", recent, d.recent_tokens, None),
        ("heavy_ratio", ratio, d.heavy_ratio, "h2o"),
        ("keep_ratio", keep, d.keep_ratio, "entropy"),
        ("merge_ratio", merge, d.merge_ratio, "merge"),
        ("trigger", trigger, d.trigger, None),
        ("pressure_threshold", threshold, d.pressure_threshold, None),
        ("pages", pages, d.pages, None),
    )
    for field_name, value, default, owner in fields:
        if policy == "none":
            why = "policy none evicts nothing; set kv.eviction.policy (h2o, streaming, entropy, merge) or leave it out"
            _refuse_unused(ev, field_name, value, default, True, why)
        elif owner is not None:
            _refuse_unused(
                ev,
                field_name,
                value,
                default,
                policy != owner,
                f"applies to policy {owner} only, not {policy}",
            )
    if policy != "none":  # the threshold is read by the pressure trigger and by hybrid pages only
        why = "only with trigger: pressure or pages: hybrid"
        unread = trigger != "pressure" and pages != "hybrid"
        _refuse_unused(ev, "pressure_threshold", threshold, d.pressure_threshold, unread, why)
    if policy in ("h2o", "entropy", "merge") and budget and recent > budget:
        raise ev.err("recent_tokens", f"the recent window ({recent}) is longer than budget_tokens ({budget})")
    if policy == "streaming":
        if recent < 1:
            raise ev.err(
                "recent_tokens", "streaming keeps sinks plus a recent window: give recent_tokens >= 1"
            )
        if budget and sinks + recent > budget:
            raise ev.err(
                "budget_tokens",
                f"sink_tokens + recent_tokens ({sinks} + {recent}) exceed budget_tokens ({budget})",
            )
    ev.done()
    offload = _read_offload(s.section("offload"))
    mix = _read_format_mix(s, model, fmt)
    switch = _read_format_switch(s, model, fmt, mix)
    s.done()
    return KVConfig(
        bs,
        fmt,
        note,
        scope,
        EvictionConfig(policy, budget, sinks, recent, ratio, trigger, threshold, pages, keep, merge),
        offload,
        gpool,
        pin_segments=pin,
        pin_max_share=pin_share,
        format_mix=mix,
        format_switch=switch,
        segments=segments,
    )


SSD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SSDConfig) if f.name != "capacity_bytes"}


def _read_offload(off: Section) -> OffloadConfig:
    """``kv.offload`` (`kvsim.spec.offload`): a preset's values for the fields not given."""
    preset = off.choice("preset", ("none", *OFFLOAD_PRESETS), "none")
    base: dict[str, Any] = OFFLOAD_PRESETS[preset]() if preset != "none" else {}
    given = [k for k in ("host_bytes", "host_share", "hbm_ratio") if off.raw(k, None) is not None]
    if len(given) > 1:
        raise off.err(given[1], f"give one of host_bytes, host_share, hbm_ratio (also given: {given[0]})")
    cap: dict[str, Any] = {}
    if given:
        base.pop("hbm_ratio", None)
        base.pop("per_replica_bytes", None)
    if "host_bytes" in given:
        cap["host_bytes"] = off.parsed("host_bytes", bounded(parse_size, B.HOST_SIZE))
    if "host_share" in given:
        cap["host_share"] = off.float("host_share", lo=0.0, hi=1.0, lo_open=True)
    if "hbm_ratio" in given:
        cap["hbm_ratio"] = off.float("hbm_ratio", lo=0.0, hi=1e4, lo_open=True)
    for k in ("host_bytes", "host_share", "hbm_ratio"):
        off.raw(k, None)
    write = OffloadWrite(
        off.choice("write", [m.value for m in OffloadWrite], base.pop("write", OffloadWrite.BACK).value)
    )
    copy = CopyMode(off.choice("copy", [m.value for m in CopyMode], base.pop("copy", CopyMode.BATCHED).value))
    ssd = None
    if off.raw("ssd", None) is not None:
        d = Section(off.raw("ssd"), source=off.source, path=off._p("ssd"))
        if d.raw("capacity", None) is None:
            raise d.err("capacity", "an SSD tier needs a capacity (bytes per node)")
        ssd = SSDConfig(
            capacity_bytes=d.parsed("capacity", bounded(parse_size, B.HOST_SIZE)),
            read_bw=d.parsed("read_bw", bounded(parse_bandwidth, B.LINK_BW), SSD_DEFAULTS["read_bw"]),
            write_bw=d.parsed("write_bw", bounded(parse_bandwidth, B.LINK_BW), SSD_DEFAULTS["write_bw"]),
            latency_s=d.parsed(
                "latency",
                bounded(lambda v: parse_duration(v, allow_zero=True), B.LATENCY),
                SSD_DEFAULTS["latency_s"],
            ),
        )
        d.done()
    cold = 0
    if off.raw("cold_after_steps", None) is not None:
        cold = off.int("cold_after_steps", lo=1, hi=1 << 40)
    cfg = OffloadConfig(
        enabled=off.bool("enabled", False),
        write=write,
        copy=copy,
        preset=preset,
        **base,
        **cap,
        ssd=ssd,
        cold_after_steps=cold,
        load=off.choice("load", ("stall", "overlap"), "stall"),
        eviction=off.choice("eviction", EVICTIONS, "lru"),
    )
    off.done()
    if not cfg.enabled:  # a tier that is off reads none of its fields: a non-default one is refused
        d = OffloadConfig()
        for key, value, default in (
            ("preset", preset, d.preset),
            ("write", write, d.write),
            ("copy", copy, d.copy),
            *((k, cap[k], None) for k in ("host_bytes", "host_share", "hbm_ratio") if k in cap),
            ("ssd", ssd, None),
            ("cold_after_steps", cold, d.cold_after_steps),
            ("load", cfg.load, d.load),
            ("eviction", cfg.eviction, d.eviction),
        ):
            _refuse_unused(off, key, value, default, True, "needs kv.offload.enabled: true")
    return cfg


def _refuse_unused(section: Section, key: str, value: Any, default: Any, unused: bool, why: str) -> None:
    """Refuse `key` when what it sets is not read (`unused`) and it was given at a value other than
    its default: nothing is silently ignored, while a default written out (as in a dumped full
    config) changes nothing and is accepted."""
    if unused and section.raw(key, None) is not None and value != default:
        raise section.err(key, why)


PIN_SEGMENTS = ("system", "tools")  # the agent prompt's segments that can be pinned


def _read_pin(raw: object) -> tuple[str, ...]:
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
        raise KvsimError(f"expected a list of segments ({', '.join(PIN_SEGMENTS)}), got {show(raw)}")
    for v in items:
        if v not in PIN_SEGMENTS:
            raise KvsimError(f"unknown segment {show(v)}; pinnable: {', '.join(PIN_SEGMENTS)}")
    if len(set(items)) != len(items):
        raise KvsimError(f"a segment is named twice: {show(raw)}")
    return tuple(items)


def _read_scheduler(root: Section, base_dir: Path) -> SchedulerConfig:
    # Defaults: vLLM EngineArgs (max_num_seqs 256; max_num_batched_tokens 8192 for the V1 server).
    s = root.section("scheduler")
    max_batched = s.int("max_batched_tokens", 8192, lo=1, hi=1 << 24)
    cfg = SchedulerConfig(
        max_num_seqs=s.int("max_num_seqs", 256, lo=1, hi=1 << 20),
        max_batched_tokens=max_batched,
        chunked_prefill=s.bool("chunked_prefill", True),
        preemption=_choice(s, "preemption", PreemptionMode, PreemptionMode.RECOMPUTE),
        swap_space_bytes=s.parsed("swap_space", bounded(parse_size, B.HOST_SIZE), 4 * 2**30),
        spec_decode=_read_spec_decode(s, base_dir, max_batched),
    )
    recompute = cfg.preemption == "recompute"
    _refuse_unused(
        s, "swap_space", cfg.swap_space_bytes, 4 * 2**30, recompute, "only with preemption: swap or auto"
    )
    s.done()
    return cfg


def _read_spec_decode(s: Section, base_dir: Path, max_batched: int) -> SpecDecodeConfig | None:
    raw = s.raw("spec_decode", None)
    if raw is None:
        return None
    sd = Section(raw, source=s.source, path=s._p("spec_decode"))
    k = sd.int("k", lo=1, hi=MAX_DRAFT_TOKENS)
    if k + 1 > max_batched:
        raise sd.err(
            "k", f"a verify step of k + 1 = {k + 1} tokens exceeds max_batched_tokens ({max_batched})"
        )
    acc = sd.section("acceptance", required=True)
    dist = acc.choice("dist", ("constant", "beta"), "constant")
    mean = acc.float("mean", lo=0.0, hi=1.0)
    conc: float | None = None
    if dist == "beta":
        conc = acc.float("concentration", lo=0.0, lo_open=True)
        if not 0.0 < mean < 1.0:
            raise acc.err("mean", f"a Beta's mean must lie in (0, 1), got {mean}")
    elif acc.raw("concentration", None) is not None:
        raise acc.err("concentration", "only with dist: beta")
    acc.done()
    dr = sd.section("draft", required=True)
    kind = dr.choice("kind", ("model", "mtp"))
    draft_model: ModelSpec | None = None
    frac = 1.0
    if kind == "model":
        draft_model = dr.parsed("model", lambda v: load_model(v, base_dir=base_dir))
        unread = dr.float("layer_fraction", 1.0, lo=0.0, hi=4.0, lo_open=True)
        _refuse_unused(dr, "layer_fraction", unread, 1.0, True, "only with kind: mtp")
    else:
        # One layer by default: DeepSeek-V3's MTP module and EAGLE's draft head are one layer each.
        frac = dr.float("layer_fraction", 1.0, lo=0.0, hi=4.0, lo_open=True)
        if dr.raw("model", None) is not None:
            raise dr.err("model", "only with kind: model")
    dr.done()
    sd.done()
    return SpecDecodeConfig(k, mean, conc, kind, draft_model, frac)


def _read_length(parent: Section, key: str, default: dict[str, Any]) -> LengthDist:
    s = Section(parent.raw(key, default), source=parent.source, path=parent._p(key))
    kind = s.choice("dist", ("constant", "uniform", "lognormal", "exponential"), "lognormal")
    mean = s.float("mean", lo=1.0, hi=1e8)
    stdev = s.float("stdev", 0.0, lo=0.0, hi=1e8)
    lo = s.int("min", 1, lo=1, hi=1 << 30)
    hi = s.int("max", 1 << 30, lo=1, hi=1 << 30)
    if hi < lo:
        raise s.err("max", f"must be >= min ({lo}), got {hi}")
    s.done()
    return LengthDist(kind, mean, stdev, lo, hi)


def _read_workload(root: Section, base_dir: Path) -> WorkloadConfig:
    s = root.section("workload", required=True)
    trace = s.raw("trace", None)
    syn_raw = s.raw("synthetic", None)
    agent_raw = s.raw("agent", None)
    random_raw = s.raw("random", None)
    if sum(x is not None for x in (trace, syn_raw, agent_raw, random_raw)) != 1:
        raise s.err(
            "trace",
            "give exactly one of workload.trace (a file), workload.synthetic, workload.agent or "
            "workload.random",
        )
    synthetic = None
    agent = None
    rand = None
    path = None
    fmt = s.choice("format", TRACE_FORMATS, "generic") if trace is not None else "synthetic"
    if random_raw is not None:
        fmt = "random"
        if s.raw("format", "random") != "random":
            raise s.err("format", "the random dataset is generated, not read: remove format")
    if s.has("bench") and fmt not in ("sharegpt", "random"):
        raise s.err(
            "bench", "only with format sharegpt or workload.random (a trace has its own arrival times)"
        )
    bench = _read_bench(s.section("bench"), fmt) if fmt in ("sharegpt", "random") else None
    if random_raw is not None:
        rand = _read_random(Section(random_raw, source=s.source, path=s._p("random")))
    elif agent_raw is not None:
        fmt = "agent"
        if s.raw("format", "agent") != "agent":
            raise s.err("format", "agent sessions are generated, not read: remove format or set agent")
        agent = _read_agent(Section(agent_raw, source=s.source, path=s._p("agent")))
        for key in ("rate_scale", "start", "duration", "max_requests"):
            if s.has(key):
                raise s.err(key, "not supported with workload.agent: set agent.sessions and agent.rate")
    elif trace is not None:
        if not isinstance(trace, str) or not trace.strip():
            raise s.err("trace", f"expected a file path, got {show(trace)}")
        path = Path(trace)
        if not path.is_absolute():
            path = base_dir / path
        if not path.is_file():
            raise s.err("trace", f"trace file not found: {path}")
    else:
        y = Section(syn_raw, source=s.source, path=s._p("synthetic"))
        synthetic = SyntheticConfig(
            num_requests=y.int("num_requests", lo=1, hi=10_000_000),
            rate_per_s=y.float("rate", lo=0.0, hi=1e6, lo_open=True),
            arrival=y.choice("arrival", ("poisson", "gamma"), "poisson"),
            cv=y.float("cv", 1.0, lo=0.0, hi=100.0, lo_open=True),
            input=_read_length(y, "input", {"dist": "lognormal", "mean": 1024, "stdev": 512}),
            output=_read_length(y, "output", {"dist": "lognormal", "mean": 256, "stdev": 128}),
            shared_prefix_tokens=y.int("shared_prefix_tokens", 0, lo=0, hi=1 << 24),
            shared_prefix_count=y.int("shared_prefix_count", 1, lo=1, hi=1 << 20),
            session_turns=y.int("session_turns", 1, lo=1, hi=1000),
            think_time_s=y.parsed("think_time", lambda v: parse_duration(v, allow_zero=True), 0.0),
        )
        y.done()
    duration = s.raw("duration", None)
    cfg = WorkloadConfig(
        trace=path,
        format=fmt,
        synthetic=synthetic,
        rate_scale=s.float("rate_scale", 1.0, lo=0.0, hi=1e4, lo_open=True),
        start_s=s.parsed("start", lambda v: parse_duration(v, allow_zero=True), 0.0),
        duration_s=None if duration is None else s.parsed("duration", parse_duration),
        max_requests=None if s.raw("max_requests", None) is None else s.int("max_requests", lo=1, hi=1 << 40),
        skip_bad_lines=s.bool("skip_bad_lines", False),
        clip_to_context=s.bool("clip_to_context", False),
        agent=agent,
        bench=bench,
        random=rand,
    )
    s.done()
    return cfg


def _rate(v: Any) -> float:
    """``request_rate``: requests per second > 0, or ``inf`` (vLLM's default: all at once)."""
    if v == "inf" or (isinstance(v, float) and v == math.inf):
        return math.inf
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1e6:
        raise KvsimError(f"expected requests per second in (0, 1e6] or inf, got {show(v)}")
    return float(v)


def _read_bench(b: Section, fmt: str) -> BenchConfig:
    """``workload.bench``: vLLM bench serve's --num-prompts, --request-rate, --burstiness, --seed
    (and, for ShareGPT, --sharegpt-output-len and kvsim's chars_per_token)."""
    burst = b.raw("burstiness", 1.0)
    if burst == "inf" or burst == math.inf:
        burstiness = math.inf
    else:
        burstiness = b.float("burstiness", 1.0, lo=0.0, hi=1e6, lo_open=True)
    seed = b.raw("seed", None)
    for key in ("sharegpt_output_len", "chars_per_token"):
        if fmt != "sharegpt" and b.has(key):
            raise b.err(key, "only with format sharegpt")
    out_len = b.raw("sharegpt_output_len", None)
    cfg = BenchConfig(
        num_prompts=b.int("num_prompts", 1000, lo=1, hi=10_000_000),
        request_rate=b.parsed("request_rate", _rate, math.inf),
        burstiness=burstiness,
        seed=None if seed is None else b.int("seed", lo=0, hi=2**32 - 1),
        sharegpt_output_len=None if out_len is None else b.int("sharegpt_output_len", lo=1, hi=1 << 24),
        chars_per_token=b.float("chars_per_token", 4.0, lo=0.0, hi=100.0, lo_open=True),
    )
    b.done()
    return cfg


def _read_random(y: Section) -> RandomConfig:
    """``workload.random``: vLLM bench serve's --random-input-len, -output-len, -range-ratio, -prefix-len."""
    cfg = RandomConfig(
        input_len=y.int("input_len", 1024, lo=0, hi=1 << 24),
        output_len=y.int("output_len", 128, lo=1, hi=1 << 24),
        range_ratio=y.float("range_ratio", 0.0, lo=0.0, hi=1.0),
        prefix_len=y.int("prefix_len", 0, lo=0, hi=1 << 24),
    )
    if cfg.range_ratio >= 1.0:
        raise y.err("range_ratio", f"must be in [0, 1) as vLLM's, got {cfg.range_ratio}")
    if cfg.input_len + cfg.prefix_len < 1:
        raise y.err("input_len", "input_len + prefix_len must be at least 1")
    y.done()
    return cfg


def _read_agent(y: Section) -> AgentConfig:
    """``workload.agent``. Defaults describe a coding/tool-use agent; they are placeholders for the
    user's own figures, not measurements: the design documents (003, 'Agent场景的特殊优化') say
    system prompt and tool definitions average 40-60% of an agent's context, which the defaults
    (2,000 + 3,000 of about 9,000 tokens at the fourth turn) follow."""

    def dur(key: str, default: float) -> float:
        return y.parsed(key, lambda v: parse_duration(v, allow_zero=True), default)

    cfg = AgentConfig(
        sessions=y.int("sessions", lo=1, hi=1_000_000),
        rate_per_s=y.float("rate", lo=0.0, hi=1e6, lo_open=True),
        turns=_read_length(y, "turns", {"dist": "constant", "mean": 8}),
        system_prompt_tokens=y.int("system_prompt_tokens", 2000, lo=0, hi=1 << 24),
        system_prompts=y.int("system_prompts", 1, lo=1, hi=1 << 20),
        tool_tokens=y.int("tool_tokens", 3000, lo=0, hi=1 << 24),
        user=_read_length(y, "user", {"dist": "lognormal", "mean": 200, "stdev": 150}),
        tool_output=_read_length(y, "tool_output", {"dist": "lognormal", "mean": 1000, "stdev": 800}),
        tool_call_share=y.float("tool_call_share", 0.5, lo=0.0, hi=1.0),
        output=_read_length(y, "output", {"dist": "lognormal", "mean": 300, "stdev": 200}),
        think_time_s=dur("think_time", 5.0),
        tool_time_s=dur("tool_time", 1.0),
        history_turns=y.int("history_turns", 0, lo=0, hi=1_000_000),
        tool_outputs=_choice(y, "tool_outputs", ToolOutputPolicy, ToolOutputPolicy.KEEP),
        compress_ratio=y.float("compress_ratio", 0.2, lo=0.0, hi=1.0, lo_open=True),
        closed_loop=y.bool("closed_loop", True),
    )
    if cfg.turns.mean > 1000 or cfg.turns.lo > 1000:
        raise y.err("turns", "at most 1000 turns per session")
    if cfg.turns.hi > 1000:  # the default max: sampled turns stop at 1000
        cfg = dataclasses.replace(cfg, turns=dataclasses.replace(cfg.turns, hi=1000))
    share = y.raw("head_share", None)
    if share is not None:
        share = y.float("head_share", lo=0.0, hi=1.0, lo_open=True)
        if share >= 1.0:
            raise y.err("head_share", "system prompt and tools as a share of the prompt, < 1; got 1")
        if y.has("tool_tokens"):
            raise y.err("head_share", "sizes tool_tokens: give head_share or tool_tokens, not both")
        tools = _head_tokens(cfg, share) - cfg.system_prompt_tokens
        if tools < 0:
            raise y.err(
                "head_share",
                f"system_prompt_tokens ({cfg.system_prompt_tokens:,}) alone exceed a head of {share} of the prompt",
            )
        cfg = dataclasses.replace(cfg, tool_tokens=tools, head_share=share)
    if cfg.system_prompt_tokens + cfg.tool_tokens + cfg.user.lo < 1:
        raise y.err("user", "a prompt needs at least one token")
    y.done()
    return cfg


def _head_tokens(cfg: AgentConfig, share: float) -> int:
    """System prompt + tools such that they are `share` of the workload's prompt tokens with the
    full history (``head_share``; the design documents, 003, claim 40-60% on agent platforms, so
    0.5 is their midpoint: their figure, not a measurement). From the distributions' means, before
    clipping and rounding: turn 0's input is a user message (u), a later turn's a tool output with
    probability tool_call_share (mean a over both kinds), and turn t's prompt carries t earlier
    inputs and replies (o); a session of T turns then sends, past its heads,
    T u + (T - 1) a + a (T^2 - 3T + 2) / 2 + o (T^2 - T) / 2 tokens, taken at E[T] and
    E[T^2] = mean^2 + stdev^2, per turn."""
    u, o = cfg.user.mean, cfg.output.mean
    a = cfg.tool_call_share * cfg.tool_output.mean + (1.0 - cfg.tool_call_share) * u
    t1 = cfg.turns.mean
    t2 = t1 * t1 + (0.0 if cfg.turns.kind == "constant" else cfg.turns.stdev**2)
    rest = (t1 * u + (t1 - 1.0) * a + a * (t2 - 3.0 * t1 + 2.0) / 2.0 + o * (t2 - t1) / 2.0) / t1
    return round(share / (1.0 - share) * rest)


def _read_slo(root: Section) -> SLOConfig:
    s = root.section("slo")
    cfg = SLOConfig(
        ttft_s=s.parsed("ttft", parse_duration, 2.0),
        tpot_s=s.parsed("tpot", parse_duration, 0.1),
        percentile=s.float("percentile", 99.0, lo=0.0, hi=100.0, lo_open=True),
    )
    s.done()
    return cfg


# Sections renamed so that money and time cannot be confused: new name -> old name, still read.
RENAMED_SECTIONS = {"pricing": "cost", "cost_model": "costs"}


def resolve_gpu_price(
    s: Section, gpu: GPUSpec, *, file_gpu: str | None = None, overrides: tuple[str, ...] = ()
) -> GpuPrice:
    """The $/GPU-hour of `gpu` from the ``pricing`` section `s`, the one rule ``run``, ``sweep`` and
    ``plan`` share: ``gpu_hour_by_gpu[preset]`` > ``gpu_hour`` > the preset's own (sourced) price.
    `file_gpu` is the GPU the scenario file names (before ``--set``/``--search``): ``gpu_hour`` applied
    to another GPU type carries a warning. A GPU whose figures the scenario changes keeps its preset's
    name for the lookup."""
    preset = gpu.name.removesuffix("*")
    set_keys = {o.partition("=")[0].strip() for o in overrides}

    def where(path: str) -> str:
        cli = any(k == path or path.startswith(k + ".") for k in set_keys)
        return f"{path} ({'--set' if cli else Path(s.source).name})"

    by_gpu: dict[str, tuple[str, float]] = {}  # preset -> (the key as written, $/GPU-h)
    raw = s.raw("gpu_hour_by_gpu", None)
    if raw is not None:
        m = Section(raw, source=s.source, path=s._p("gpu_hour_by_gpu"))
        if not m.data:
            raise s.err("gpu_hour_by_gpu", "expected GPU preset names with prices, such as {h100-sxm: 2.5}")
        for key in list(m.data):
            try:
                name = load_gpu(key).name  # the key names the GPU
            except KvsimError as exc:
                raise m.err(shorten(str(key)), exc.message) from None
            if name in by_gpu:
                raise m.err(shorten(str(key)), f"the same GPU as {by_gpu[name][0]!r}: give its price once")
            by_gpu[name] = (str(key), m.parsed(key, bounded(parse_price_per_hour, B.PRICE)))
    wide = s.parsed("gpu_hour", bounded(parse_price_per_hour, B.PRICE), None)
    if preset in by_gpu:
        key, usd = by_gpu[preset]
        return GpuPrice(usd, PriceBasis.GPU_MAP, where(f"{s._p('gpu_hour_by_gpu')}.{key}"))
    if wide is not None:
        path = s._p("gpu_hour")
        warning = ""
        if file_gpu is not None and file_gpu != preset:
            warning = (
                f"{path} (${wide:.2f}/GPU-h), given for the scenario's {file_gpu}, also prices {preset}; "
                f"give {s._p('gpu_hour_by_gpu')}.{preset} to price it at its own rate"
            )
        return GpuPrice(wide, PriceBasis.SCENARIO, where(path), warning=warning)
    return GpuPrice(gpu.usd_per_hour, PriceBasis.PRESET, f"{preset} preset", note=gpu.price_source)


def _file_gpu(data: dict[str, Any]) -> str | None:
    """The GPU preset a scenario file names (None when it names none a preset reads)."""
    cluster = data.get("cluster")
    gpu = cluster.get("gpu") if isinstance(cluster, dict) else None
    if isinstance(gpu, dict):
        gpu = gpu.get("preset")
    try:
        return load_gpu(gpu).name
    except KvsimError:
        return None


def _renamed_section(root: Section, new: str, notes: list[str]) -> Section:
    """Section ``new``, or its old name with a note; both at once is an error."""
    old = RENAMED_SECTIONS[new]
    if not root.has(old):
        return root.section(new)
    if root.has(new):
        raise root.err(old, f"the old name of {new}: give the section once, as {new}")
    notes.append(f"section {old!r} is now called {new!r}; the old name still reads, rename it")
    return root.section(old)


def _read_cost_model(s: Section, base_dir: Path) -> CostModelConfig:
    kind = _choice(s, "kind", CostModelKind, CostModelKind.ANALYTIC)
    prof = s.raw("profile", None)
    path = None
    if kind == "profile":
        if not isinstance(prof, str):
            raise s.err("profile", "a profile file is required when kind is profile")
        path = Path(prof) if Path(prof).is_absolute() else base_dir / prof
        if not path.is_file():
            raise s.err("profile", f"profile file not found: {path}")
    elif prof is not None:
        raise s.err("profile", "only allowed with kind: profile")
    cfg = CostModelConfig(kind, path, s.bool("force", False))
    s.done()
    return cfg


def set_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``a.b.c`` in nested dicts, creating mappings; a scalar in the way is replaced."""
    keys = dotted.split(".")
    cur = data
    for k in keys[:-1]:
        nxt = cur.get(k)
        if not isinstance(nxt, dict):
            nxt = {} if nxt is None or not isinstance(nxt, str) else {"preset" if k == "gpu" else "name": nxt}
            cur[k] = nxt
        cur = nxt
    cur[keys[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise KvsimError(f"expected PATH=VALUE, got {shorten(repr(text))}", source="--set")
    key, _, val = text.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise KvsimError(f"expected PATH=VALUE with a dotted path, got {shorten(repr(text))}", source="--set")
    value = yaml_scalar(val, source=f"--set {shorten(key)}") if val.strip() else ""
    return key, value


def scenario_from_dict(
    data: Any,
    *,
    source: str,
    base_dir: Path,
    overrides: tuple[str, ...] = (),
    file_gpu: str | None = None,
    quiet: Collection[str] = (),
) -> Scenario:
    """`file_gpu`: the GPU preset the file names before overrides (for `resolve_gpu_price`'s warning).
    A value legal but far from any real device is a warning in `Scenario.notes` (`bounds.far`),
    except at the field paths in `quiet` (those its caller set itself: validate's CPU peaks)."""
    with B.collect() as far:
        sc = _scenario_from_dict(
            data, source=source, base_dir=base_dir, overrides=overrides, file_gpu=file_gpu
        )
    unusual = tuple(dict.fromkeys(line for path, line in far if path not in quiet))
    return dataclasses.replace(sc, notes=unusual + sc.notes) if unusual else sc


def _scenario_from_dict(
    data: Any,
    *,
    source: str,
    base_dir: Path,
    overrides: tuple[str, ...],
    file_gpu: str | None,
) -> Scenario:
    root = Section(data, source=source, path="")
    name = root.str("name", Path(source).stem)
    model_raw = root.raw("model")
    if isinstance(model_raw, dict):
        m = Section(model_raw, source=source, path="model")
        model = m.parsed("name", lambda v: load_model(v, base_dir=base_dir))
        if m.raw("weight_dtype", None) is not None:
            model = m.parsed("weight_dtype", lambda v: with_weight_dtype(model, v))
        # Attention-design overrides: cross-layer KV sharing and sliding windows with sinks.
        changes = {}
        for key in ("kv_layer_group", "sliding_window", "sliding_window_layers", "global_tokens"):
            if m.raw(key, None) is not None:
                changes[key] = m.int(key, lo=1 if key == "kv_layer_group" else 0, hi=1 << 30)
        if (
            changes.get("sliding_window")
            and "sliding_window_layers" not in changes
            and not model.sliding_window
        ):
            changes["sliding_window_layers"] = model.num_layers
        if changes.get("sliding_window", 0) > model.max_context:
            raise m.err("sliding_window", f"exceeds the model's context ({model.max_context:,} tokens)")
        if changes.get("sliding_window_layers", 0) > model.num_layers:
            raise m.err("sliding_window_layers", f"exceeds the model's {model.num_layers} layers")
        if changes:
            model = dataclasses.replace(model, **changes)
        m.done()
    else:
        model = root.parsed("model", lambda v: load_model(v, base_dir=base_dir))
    cluster = _read_cluster(root)
    layout = read_parallel(root.section("cluster", required=True), model, cluster.tensor_parallel)
    if layout is not None:
        cluster = dataclasses.replace(cluster, parallel=layout)
    kv = _read_kv(root, model)
    scheduler = _read_scheduler(root, base_dir)
    workload = _read_workload(root, base_dir)
    slo = _read_slo(root)
    notes: list[str] = []
    pricing = _renamed_section(root, "pricing", notes)
    gpu_price = resolve_gpu_price(pricing, cluster.gpu, file_gpu=file_gpu, overrides=overrides)
    disagg = _read_disaggregation(root, cluster, model, pricing, overrides, file_gpu)
    if disagg is not None:
        cluster = dataclasses.replace(cluster, disaggregation=disagg)
        notes.extend(p.price.warning for p in disagg.pools if p.price.warning)
    elif layout is not None and layout.stages_or_ranks > 1:
        check_placement(source, layout, cluster.tensor_parallel, cluster.nodes, cluster.gpus_per_node)
    pricing.done()
    if gpu_price.warning:
        notes.append(gpu_price.warning)
    cost_model = _read_cost_model(_renamed_section(root, "cost_model", notes), base_dir)
    sm = root.section("sim")
    max_time = sm.raw("max_time", None)
    sim = SimConfig(
        seed=sm.int("seed", 1, lo=0, hi=2**63 - 1),
        max_time_s=None if max_time is None else sm.parsed("max_time", parse_duration),
        fast_forward=sm.bool("fast_forward", True),
    )
    sm.done()
    autoscale = read_autoscale(root.section("cluster", required=True), num_replicas=cluster.num_replicas)
    if autoscale is not None:
        cluster = dataclasses.replace(cluster, autoscale=autoscale)
    faults = read_faults(
        root,
        num_replicas=cluster.num_replicas,
        num_nodes=cluster.nodes,
        max_time_s=sim.max_time_s,
        sim_seed=sim.seed,
    )
    root.done()
    if model.num_heads % cluster.tensor_parallel and model.num_kv_heads % cluster.tensor_parallel:
        raise KvsimError(
            f"tensor_parallel {cluster.tensor_parallel} divides neither the model's "
            f"{model.num_heads} query heads nor its {model.num_kv_heads} KV heads",
            source=source,
            path="cluster.tensor_parallel",
        )
    if kv.segments is not None:
        check_segments_workload(source, kv.segments, workload.agent)
        if kv.segments.drops:  # dropped blocks must not be written down or published
            on = (
                ("kv.offload", kv.offload.enabled),
                ("kv.prefix_cache.scope: global", kv.prefix_cache == "global"),
                ("kv.eviction", kv.eviction.policy != "none"),
                # a prefill replica releases a turn before it finishes: its drops would never run
                ("cluster.disaggregation", cluster.disaggregation is not None),
            )
            _refuse_first(on, "window and evict_after_use are", source, "kv.segments")
    off = kv.offload
    if off.enabled and kv.prefix_cache == "none":
        raise KvsimError(
            "the host tier holds prefix-cache entries: offload needs kv.prefix_cache local or global",
            source=source,
            path="kv.offload.enabled",
        )
    if off.enabled and cluster.host_dram_bytes == 0:
        raise KvsimError(
            "offload needs host DRAM, but cluster.host_dram is 0", source=source, path="kv.offload.enabled"
        )
    if off.host_bytes > cluster.host_dram_bytes:
        raise KvsimError(
            f"{off.host_bytes:,} bytes exceed the node's host DRAM (cluster.host_dram: {cluster.host_dram_bytes:,})",
            source=source,
            path="kv.offload.host_bytes",
        )
    if kv.global_pool.pool_nodes and cluster.topology.sharing == "fair":
        # A transfer through two fair-shared links (the pool node's NIC and the GPU's) has a rate
        # set by both links' shares at once, which `FairLinkQueue` (one link) does not model.
        raise KvsimError(
            "dedicated pool nodes are simulated with FIFO links only, not cluster.topology.sharing: fair",
            source=source,
            path="kv.prefix_cache.pool_nodes",
        )
    if disagg is not None:
        _refuse_with_disaggregation(source, model, cluster, kv, scheduler, workload, cost_model)
    if layout is not None:
        refuse_with_layout(
            source,
            layout,
            kv,
            scheduler,
            cost_model,
            disaggregated=disagg is not None,
            model=model,
            faults=faults is not None,
        )
    if faults is not None:  # a dropped replica's loads and swaps in flight are not unwound yet
        refuse_with_faults(source, cluster, kv, scheduler)
    if autoscale is not None:
        refuse_with_autoscale(source, cluster, kv, scheduler, workload, faults is not None)
    if not scheduler.chunked_prefill and scheduler.max_batched_tokens < model.max_context:
        # As vLLM requires: without chunking, a recomputed (preempted) sequence of up to the
        # model's context must fit one step, or it would block the queue forever.
        raise KvsimError(
            f"must be >= the model's context ({model.max_context:,}) when chunked_prefill is false",
            source=source,
            path="scheduler.max_batched_tokens",
        )
    return Scenario(
        name,
        source,
        model,
        cluster,
        kv,
        scheduler,
        workload,
        slo,
        gpu_price,
        cost_model,
        sim,
        overrides,
        tuple(notes),
        faults,
    )


def refuse_with_faults(source: str, cluster: ClusterConfig, kv: KVConfig, scheduler: SchedulerConfig) -> None:
    """The options faults do not run with yet, refused in one line naming ``faults``: a dropped
    replica's KV loads, swaps and pool publications in flight are not unwound, and disaggregated
    pools are not taken down."""
    on = (
        ("cluster.disaggregation", cluster.disaggregation is not None),
        ("kv.offload", kv.offload.enabled),
        ("kv.prefix_cache.scope: global", kv.prefix_cache == "global"),
        ("scheduler.preemption: swap or auto", scheduler.preemption != "recompute"),
    )
    _refuse_first(on, "faults are", source, "faults", advice="turn one of them off")


def refuse_with_autoscale(
    source: str,
    cluster: ClusterConfig,
    kv: KVConfig,
    scheduler: SchedulerConfig,
    workload: WorkloadConfig,
    faults: bool,
) -> None:
    """The options cluster.autoscale does not run with yet, refused in one line naming
    ``cluster.autoscale``: disaggregated pools (one policy per pool, as Dynamo's planner scales
    prefill and decode apart, is not built), faults (a replica down and a replica off are two
    states of one router gate, not combined yet), the tiers below HBM, the global pool and swap
    (a replica turned off would leave their transfers and shares behind) and closed-loop sessions
    (the autoscaler stops ticking once the trace's arrivals are over, which they do not announce)."""
    on = (
        ("cluster.disaggregation", cluster.disaggregation is not None),
        ("faults", faults),
        ("kv.offload", kv.offload.enabled),
        ("kv.prefix_cache.scope: global", kv.prefix_cache == "global"),
        ("scheduler.preemption: swap or auto", scheduler.preemption != "recompute"),
        ("closed-loop agent sessions", workload.agent is not None and workload.agent.closed_loop),
    )
    _refuse_first(on, "autoscaling is", source, "cluster.autoscale", advice="turn one of them off")


def _refuse_with_disaggregation(
    source: str,
    model: ModelSpec,
    cluster: ClusterConfig,
    kv: KVConfig,
    scheduler: SchedulerConfig,
    workload: WorkloadConfig,
    cost_model: CostModelConfig,
) -> None:
    """The options cluster.disaggregation does not run with yet, refused in one line naming the
    first: the tiers below HBM and the global pool (Mooncake's store between the pools is issue 21's
    next step), swap, token eviction, sliding windows and format switches (the decode side would
    receive trimmed KV), speculative decoding, pinned segments, closed-loop sessions (a reply's end
    on the decode pool sends the next turn), fair-shared links and measured profiles (one GPU and
    TP each)."""
    on = (
        ("kv.prefix_cache.scope: global", kv.prefix_cache == "global"),
        ("kv.offload", kv.offload.enabled),
        ("scheduler.preemption: swap or auto", scheduler.preemption != "recompute"),
        ("kv.eviction", kv.eviction.policy != "none"),
        ("kv.format_switch", kv.format_switch is not None),
        ("sliding-window layers (model.sliding_window)", model.windowed_kv_layers() > 0),
        ("scheduler.spec_decode", scheduler.spec_decode is not None),
        ("kv.prefix_cache.pin or a kv.segments keep", bool(kv.pin_segments)),
        ("closed-loop agent sessions", workload.agent is not None and workload.agent.closed_loop),
        ("cluster.topology.sharing: fair", cluster.topology.sharing == "fair"),
        ("a measured cost_model.profile", cost_model.kind != "analytic"),
    )
    _refuse_first(on, "disaggregated prefill and decode is", source, "cluster.disaggregation")


def refuse_with_layout(
    source: str,
    layout: ParallelLayout,
    kv: KVConfig,
    scheduler: SchedulerConfig,
    cost_model: CostModelConfig,
    *,
    disaggregated: bool,
    model: ModelSpec | None = None,
    faults: bool = False,
) -> None:
    """The options cluster.parallel does not run with yet, refused in one line naming the first:
    disaggregation and measured profiles (one TP group each, no all-to-all tables yet) for any
    layout; under DP attention, the options that move or rewrite a block on one GPU (the tiers
    below HBM, swap, the global pool, token eviction, format switches and mixes, kvquant4's
    outliers), whose bytes per GPU assume every GPU holds a share of every block. Under pipeline or
    context parallelism (a replica of TP x PP x CP GPUs, maybe over nodes), the same tiers and
    trims, speculative decoding, sliding-window layers (their KV per stage differs) and faults
    (which place replicas by TP)."""
    dp = layout.attention is AttentionParallel.DP
    ppcp = layout.stages_or_ranks > 1
    windowed = model is not None and model.windowed_kv_layers() > 0
    on = (
        ("cluster.disaggregation", disaggregated),
        ("a measured cost_model.profile", cost_model.kind != "analytic"),
        ("kv.prefix_cache.scope: global", dp and kv.prefix_cache == "global"),
        ("kv.offload", dp and kv.offload.enabled),
        ("scheduler.preemption: swap or auto", dp and scheduler.preemption != "recompute"),
        ("kv.eviction", dp and kv.eviction.policy != "none"),
        ("kv.format_switch", dp and kv.format_switch is not None),
        ("kv.format_mix", dp and kv.format_mix is not None),
        ("kv.format: kvquant4", dp and kv.format.kind.value == "kvquant4"),
        ("kv.prefix_cache.scope: global", ppcp and kv.prefix_cache == "global"),
        ("kv.offload", ppcp and kv.offload.enabled),
        ("scheduler.preemption: swap or auto", ppcp and scheduler.preemption != "recompute"),
        ("kv.eviction", ppcp and kv.eviction.policy != "none"),
        ("kv.format_switch", ppcp and kv.format_switch is not None),
        ("scheduler.spec_decode", ppcp and scheduler.spec_decode is not None),
        ("sliding-window layers (model.sliding_window)", ppcp and windowed),
        ("faults", ppcp and faults),
    )
    _refuse_first(on, "cluster.parallel is", source, "cluster.parallel")


def _refuse_first(
    on: tuple[tuple[str, bool], ...], subject: str, source: str, path: str, *, advice: str = "turn one off"
) -> None:
    """One line naming the first option of `on` ((name, whether the run uses it)) that `subject`
    (the feature refusing it, with its verb) is not simulated together with; nothing when none."""
    name = next((n for n, used in on if used), None)
    if name is not None:
        raise KvsimError(
            f"{subject} not simulated together with {name} yet; {advice}", source=source, path=path
        )


# The fields that name a file, and whether they may name a model preset instead.
OVERRIDE_PATHS = {
    "model": True,
    "model.name": True,
    "scheduler.spec_decode.draft.model": True,
    "workload.trace": False,
    "cost_model.profile": False,
    "costs.profile": False,  # cost_model's old name
}


def cwd_paths(key: str, value: Any, scenario_dir: Path, cwd: Path) -> Any:
    """An override's value with the files it names made absolute against the working directory
    `cwd` (a mapping value is walked: ``--set workload={trace: t.csv}``). A file that is missing
    there but exists beside the scenario is refused with a hint, never silently read from there."""
    if isinstance(value, dict):
        return {k: cwd_paths(f"{key}.{k}", v, scenario_dir, cwd) for k, v in value.items()}
    model = OVERRIDE_PATHS.get(key)
    if model is None or not isinstance(value, str) or not value.strip():
        return value
    if model and not names_a_file(value):
        return value
    p = Path(value)
    if p.is_absolute():
        return value
    here = cwd / p
    beside = scenario_dir / p
    if not here.exists() and beside.exists():
        hint = os.path.normpath(beside)
        raise KvsimError(
            f"{shorten(value, 100)} is not in the working directory (paths on the command line "
            f"are relative to it, not to the scenario); did you mean {shorten(hint, 120)}?",
            source=f"--set {key}",
        )
    return str(here)


def load_scenario(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Scenario:
    """Read, override and validate a scenario file. Raises `KvsimError` on any mistake.

    Paths inside the file are relative to its folder; paths in `overrides` (``a.b=v``) to the
    working directory."""
    p = Path(path)
    data = read_yaml(p)
    if data is None:
        raise KvsimError("the file is empty", source=str(p))
    if not isinstance(data, dict):
        raise KvsimError("expected a mapping at the top level", source=str(p))
    file_gpu = _file_gpu(data)
    touched = []
    cwd = Path.cwd()
    for text in overrides:
        key, value = parse_override(text)
        set_path(data, key, cwd_paths(key, value, p.parent, cwd))
        touched.append(key)
    try:
        return scenario_from_dict(
            data, source=str(p), base_dir=p.parent, overrides=tuple(overrides), file_gpu=file_gpu
        )
    except KvsimError as exc:
        if exc.path and any(
            exc.path == t or exc.path.startswith(t + ".") or t.startswith(exc.path + ".") for t in touched
        ):
            raise KvsimError(exc.message, source=f"{p} (--set)", path=exc.path) from None
        raise

"""Property tests for the engine: random small workloads under memory pressure, checked after every
scheduler operation, and fast-forward compared with stepping one by one."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvsim.run as krun
from kvsim.core.kv_cache_manager import KVCacheManager
from kvsim.core.memory_plan import plan_memory
from kvsim.core.request import RequestStatus
from kvsim.core.sched.scheduler import Scheduler
from kvsim.spec.models import PRESETS
from kvsim.spec.parallel import (
    AttentionParallel,
    ParallelLayout,
    stage_weight_bytes_per_gpu,
    weight_bytes_per_gpu,
)
from kvsim.spec.scenario import scenario_from_dict
from tests.helpers import ROOT, make_workload, records, small_scenario


class CheckedScheduler(Scheduler):
    """Asserts the block-accounting invariants after each operation."""

    checks = 0

    def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.swapped_state: dict[int, tuple[int, int, int]] = {}  # swapped out: (computed, evicted, blocks)

    def check(self) -> None:
        self.checks += 1
        kv = self.kv
        pool = kv.pool
        pool.check()
        private = 0
        refs: dict[int, int] = {}
        loading = [r for r, _ in self.loading]
        for seq, n in self.loading:
            assert seq.status is RequestStatus.WAITING_FOR_KV_TRANSFER
            assert seq.num_computed == 0 or n < 0  # a swap-in keeps its computed tokens
        for seq in self.swapped:  # swapped out: KV in host memory, no blocks here
            assert seq.num_blocks == 0 and seq.num_computed > 0 and not seq.held_keys
        if self.host is not None:
            self.host.check()  # within capacity, every entry counted once
        assert len(self.running) + len(loading) <= self.max_num_seqs
        for seq in [*self.running, *loading]:
            n_held = len(seq.held_keys)
            assert seq.held_keys == seq.keys[:n_held]
            assert seq.num_blocks == seq.key_cum[n_held] + seq.num_private
            assert 0 <= seq.evicted < max(1, seq.num_computed)
            assert seq.num_blocks * self.block_size >= seq.num_computed - seq.evicted
            if seq.evicted:  # a request that evicted tokens holds no shared prefix entry
                assert not seq.held_keys
            table = kv.block_table(seq)
            assert sum(run.num_blocks for run in table) == seq.num_blocks
            assert [run.key for run in table if run.key is not None] == seq.held_keys
            private += seq.num_private
            for k in seq.held_keys:
                refs[k] = refs.get(k, 0) + 1
        for seq in self.swapped:  # its kept tokens come back as they left
            assert 0 <= seq.evicted < seq.num_computed
        for seq in self.waiting:
            assert seq.num_blocks == 0 and seq.num_computed == 0 and not seq.held_keys and not seq.evicted
        remaining = sum(
            s.prompt_len + s.output_len - 1 - s.num_computed
            for s in [*self.running, *self.waiting, *loading, *self.swapped]
        )
        outside = getattr(self, "outside", None)  # a disaggregated run's (`_register_outside`)
        if outside is not None:
            extra_private, extra_keys, extra_tokens = outside()
            private += extra_private
            remaining += extra_tokens
            for k in extra_keys:
                refs[k] = refs.get(k, 0) + 1
        assert private == pool.private
        assert all(r == refs.get(k, 0) for k, r in pool.refs.items())
        assert remaining == self.outstanding_tokens

    def _preempt(self, req):  # type: ignore[no-untyped-def]
        state = (req.num_computed, req.evicted, self.swap_blocks(req))
        super()._preempt(req)
        if req in self.swapped:
            self.swapped_state[req.id] = state

    def finish_load(self, req):  # type: ignore[no-untyped-def]
        # (a disaggregated decode replica's hand-offs join through it too; swap is off there)
        swap_in = any(r is req and n < 0 for r, n in self.loading) and getattr(self, "outside", None) is None
        out = super().finish_load(req)
        if swap_in:  # it resumes as it left: the same computed and evicted tokens, the same blocks
            assert self.swapped_state.pop(req.id) == (req.num_computed, req.evicted, req.num_blocks)
        return out

    def schedule(self):  # type: ignore[no-untyped-def]
        plan = super().schedule()
        self.check()
        return plan

    def advance(self, plan, k=1):  # type: ignore[no-untyped-def]
        out = super().advance(plan, k)
        self.check()
        return out


made: list[CheckedScheduler] = []


def _checked(
    num_blocks,
    block_size,
    max_num_seqs,
    max_batched_tokens,
    chunked_prefill,
    enable_caching=True,
    *,
    eviction=None,
    spec=None,
    host=None,
    swap_decider=None,
):  # type: ignore[no-untyped-def]
    made.append(
        sched := CheckedScheduler(
            KVCacheManager(num_blocks, block_size, enable_caching=enable_caching, eviction=eviction),
            max_num_seqs=max_num_seqs,
            max_batched_tokens=max_batched_tokens,
            chunked_prefill=chunked_prefill,
            spec=spec,
            host=host,
            swap_decider=swap_decider,
        )
    )
    return sched


def _register_outside(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Give each scheduler of a disaggregated run what it counts but holds in none of its queues:
    a prefill replica's blocks held for sends (`HandOff.held`), a decode replica's decode tokens of
    the hand-offs waiting there for blocks."""
    real = krun.assemble_disaggregated

    def assemble(*args, **kwargs):  # type: ignore[no-untyped-def]
        run = real(*args, **kwargs)
        h = run.handoff
        n_p = len(h.prefill)
        for i, rep in enumerate(h.prefill):

            def held(i=i):  # type: ignore[no-untyped-def]
                items = h.held[i].values()
                return sum(p for _, p in items), [k for keys, _ in items for k in keys], 0

            rep.sched.outside = held
        for j, rep in enumerate(run.replicas[n_p:]):

            def pending(j=j):  # type: ignore[no-untyped-def]
                return 0, [], sum(seq.output_len - 1 for _, _, seq in h.sides[j].pending)

            rep.sched.outside = pending
        return run

    monkeypatch.setattr(krun, "assemble_disaggregated", assemble)


@st.composite
def disaggregated_cases(draw):  # type: ignore[no-untyped-def]
    """`cases`' workloads on a disaggregated cluster: 1-2 prefill and 1-2 decode replicas, in one
    node (NVLink) or one to a node (NICs), HBM as tight as `cases` draws it, with or without
    prefilling short prompts on the decode pool (``max_local_prefill_tokens``)."""
    sc, wl = draw(cases())
    pd = {"prefill": {"replicas": draw(st.integers(1, 2))}, "decode": {"replicas": draw(st.integers(1, 2))}}
    # conditional disaggregation: none, some or every prompt prefilled on the decode pool
    pd["max_local_prefill_tokens"] = draw(st.sampled_from([0, int(wl.prompt_tokens.min()), 1 << 24]))
    c = sc.cluster
    data = {
        "model": "llama-3.1-8b",
        "cluster": {
            "gpu": {"preset": "h100-sxm", "hbm": c.gpu.hbm_bytes},
            "gpus_per_node": draw(st.sampled_from([1, 8])),
            "gpu_memory_utilization": 1.0,
            "activation_reserve": 0,
            "router": str(c.router),
            "disaggregation": pd,
        },
        "kv": {"block_size": sc.kv.block_size, "prefix_cache": {"scope": str(sc.kv.prefix_cache)}},
        "scheduler": {
            "max_num_seqs": sc.scheduler.max_num_seqs,
            "max_batched_tokens": sc.scheduler.max_batched_tokens,
            "chunked_prefill": sc.scheduler.chunked_prefill,
        },
        "workload": {"synthetic": {"num_requests": 1, "rate": 1}},
        "sim": {"seed": 1},
    }
    return scenario_from_dict(data, source="pd.yaml", base_dir=ROOT), wl


@st.composite
def moe_cases(draw):  # type: ignore[no-untyped-def]
    """`cases`' workloads on DeepSeek-V3 (MLA + MoE) in a drawn layout (`cluster.parallel`): TP 2
    or 4, attention TP or DP, EP 1, 2 or the replica's GPUs, the all-to-all overlapped or not, one
    or two replicas; HBM sized so a replica gets about the blocks `cases` drew (DP: whole-token
    blocks per rank, dp times), without the options a layout refuses."""
    sc, wl = draw(cases())
    tp = draw(st.sampled_from([2, 4]))
    attention = draw(st.sampled_from(["tp", "dp"]))
    ep = draw(st.sampled_from([1, 2, tp]))
    layout = {"attention": attention, "expert_parallel": ep, "overlap_a2a": draw(st.booleans())}
    v3 = PRESETS["deepseek-v3"]
    weights = weight_bytes_per_gpu(v3, tp, ParallelLayout(AttentionParallel(attention), ep))
    dp = tp if attention == "dp" else 1
    rank_block = 70_272 * sc.kv.block_size  # MLA's bf16 latent, whole tokens (all of it on a TP rank)
    per_rank = -(-plan_memory(sc).num_blocks // dp)
    scope = "local" if sc.kv.prefix_cache == "global" else str(sc.kv.prefix_cache)
    data = {
        "model": "deepseek-v3",
        "cluster": {
            "gpu": {"preset": "h200-sxm", "hbm": weights + per_rank * rank_block + rank_block // 2},
            "gpus_per_node": tp * draw(st.sampled_from([1, 2])),
            "tensor_parallel": tp,
            "gpu_memory_utilization": 1.0,
            "activation_reserve": 0,
            "router": str(sc.cluster.router),
            "parallel": layout,
        },
        "kv": {"block_size": sc.kv.block_size, "prefix_cache": {"scope": scope}},
        "scheduler": {
            "max_num_seqs": sc.scheduler.max_num_seqs,
            "max_batched_tokens": sc.scheduler.max_batched_tokens,
            "chunked_prefill": True,
        },
        "workload": {"synthetic": {"num_requests": 1, "rate": 1}},
        "sim": {"seed": 1},
    }
    return scenario_from_dict(data, source="moe.yaml", base_dir=ROOT), wl


def _lengthened(wl, tokens: int):  # type: ignore[no-untyped-def]
    """`wl` with every prompt at least `tokens` long, each lengthened one given fresh block ids."""
    prompts = np.maximum(wl.prompt_tokens, tokens)
    g = wl.hash_block_tokens
    fresh = 10**8
    ids = []
    for h, p in zip(wl.hash_ids, prompts, strict=True):
        h = list(h)
        while len(h) < -(-int(p) // g):
            h.append(fresh)
            fresh += 1
        ids.append(h)
    return make_workload(wl.arrival_s, prompts, wl.output_tokens, hash_ids=ids, block_tokens=g)


@st.composite
def layout_cases(draw):  # type: ignore[no-untyped-def]
    """`cases`' workloads on Llama-3.1-8B replicas of TP 1 or 2 x PP 1, 2 or 4 x CP 1 or 2 (not both
    1; CP only where every prompt gives each rank a block), one or two replicas, in one node or over
    nodes of 1 to 8 GPUs (boundaries and rings over NVLink or the network), ring attention
    overlapped or not, a prompt's chunks pipelined or
    not; HBM sized so a replica gets about the blocks `cases` drew, without the
    options pipeline and context parallelism refuse."""
    sc, wl = draw(cases())
    bs = sc.kv.block_size
    tp = draw(st.sampled_from([1, 2]))
    pp = draw(st.sampled_from([1, 2, 4]))
    cp = draw(st.sampled_from([1, 2, 2, 4]))
    if pp * cp == 1:
        pp = 2
    if cp > 1:  # every prompt gives each CP rank a block: shorter ones lengthened, fresh ids added
        wl = _lengthened(wl, cp * bs)
    gpus = tp * pp * cp
    gpn = draw(st.sampled_from([g for g in (1, 2, 4, 8) if g % tp == 0 and (g % gpus == 0 or gpus % g == 0)]))
    nodes = draw(st.integers(1, 2)) * gpus // gpn if gpus >= gpn else 1
    fmt = draw(st.sampled_from(["bf16", "int8"]))
    per_token = 131_072 // tp // pp  # Llama-3.1-8B's bf16 KV a token, one GPU of a stage
    if fmt == "int8":
        per_token = (
            plan_memory(
                small_scenario(kv={"format": "int8"}, cluster={"gpus_per_node": 8, "tensor_parallel": tp})
            ).kv_bytes_per_token_per_gpu
            / pp
        )
    block = int(per_token * bs)
    longest = int((wl.prompt_tokens + wl.output_tokens).max())
    per_rank = -(-max(plan_memory(sc).num_blocks, -(-longest // 16)) // cp)
    scope = "local" if sc.kv.prefix_cache == "global" else str(sc.kv.prefix_cache)
    weights = stage_weight_bytes_per_gpu(PRESETS["llama-3.1-8b"], tp, pp)
    data = {
        "model": "llama-3.1-8b",
        "cluster": {
            "gpu": {"preset": "h100-sxm", "hbm": weights + per_rank * block + block // 2},
            "nodes": nodes,
            "gpus_per_node": gpn,
            "tensor_parallel": tp,
            "gpu_memory_utilization": 1.0,
            "activation_reserve": 0,
            "router": str(sc.cluster.router),
            "parallel": {
                "pipeline_parallel": pp,
                "context_parallel": cp,
                "overlap_ring": draw(st.booleans()),
                "pipeline_chunks": pp > 1 and draw(st.booleans()),
            },
        },
        "kv": {"block_size": bs, "format": fmt, "prefix_cache": {"scope": scope}},
        "scheduler": {
            "max_num_seqs": sc.scheduler.max_num_seqs,
            "max_batched_tokens": sc.scheduler.max_batched_tokens,
            "chunked_prefill": True,
        },
        "workload": {"synthetic": {"num_requests": 1, "rate": 1}},
        "sim": {"seed": 1},
    }
    return scenario_from_dict(data, source="layout.yaml", base_dir=ROOT), wl


@st.composite
def cases_or_moe(draw):  # type: ignore[no-untyped-def]
    """`cases`; one draw in four `moe_cases` instead, one in four `layout_cases` (PP and CP)."""
    pick = draw(st.integers(0, 3))
    return draw(moe_cases() if pick == 0 else layout_cases() if pick == 1 else cases())


@st.composite
def cases(  # type: ignore[no-untyped-def]
    draw,
    offload: bool = False,
    spec: bool = False,
    window: bool = False,
    switch: bool = False,
    evict: bool = False,
    tight: bool = False,
):
    """`evict`: token eviction always on, and HBM tight (preemptions, swaps of requests that
    evicted, write-backs of what the trims' copies push out). `tight`: HBM as tight without token
    eviction (with `window` or `switch`: swaps of requests that trimmed); with `offload` and `spec`
    HBM is as tight too (swaps of requests holding look-ahead blocks)."""
    tight = tight or evict or (offload and spec)
    g = draw(st.sampled_from([16, 64]))
    n = draw(st.integers(2, 14))
    bases = 3
    arrivals, prompts, outputs, ids = [], [], [], []
    t = 0.0
    fresh = 10**6
    for _ in range(n):
        t += draw(st.sampled_from([0.0, 0.01] if tight else [0.0, 0.01, 0.2, 1.0]))  # tight: bursts
        if ids and draw(st.integers(0, 9)) == 0:  # an exact copy of an earlier prompt
            j = draw(st.integers(0, len(ids) - 1))
            p, h = prompts[j], list(ids[j])
        else:
            p = draw(st.integers(1, 700))
            nb = -(-p // g)
            shared = draw(st.integers(0, nb)) if draw(st.booleans()) else 0
            base = draw(st.integers(0, bases - 1))
            full = p // g
            # Shared ids only on full blocks: block j of base chain b has id b * 1000 + j.
            h = [base * 1000 + j for j in range(min(shared, full))]
            while len(h) < nb:
                h.append(fresh)
                fresh += 1
        arrivals.append(t)
        prompts.append(p)
        outputs.append(draw(st.integers(1, 300 if tight else 90)))  # tight: decoders outgrow HBM
        ids.append(h)
    need = max(-(-(p + o) // 16) for p, o in zip(prompts, outputs, strict=True))
    num_blocks = draw(st.integers(need, need + 4) if tight else st.integers(need, 3 * need))
    scheduler = {
        "max_num_seqs": draw(st.sampled_from([4, 64] if tight else [1, 2, 4, 64])),
        "max_batched_tokens": draw(st.sampled_from([16, 64, 256, 2048])),
    }
    cluster = {
        "gpus_per_node": draw(st.sampled_from([1, 1, 2])),
        "router": draw(
            st.sampled_from(["round_robin", "least_outstanding_tokens", "prefix_affinity", "cache_aware"])
        ),
    }
    kv: dict = {"prefix_cache": True if offload else draw(st.sampled_from([True, True, False]))}
    if offload:  # swap preemption, and a host tier of a few entries: write-backs, loads, drops
        scheduler["preemption"] = draw(st.sampled_from(["recompute", "swap", "auto"]))
        swap = draw(st.sampled_from(["32MiB", "4GiB"] if tight else ["8MiB", "4GiB"]))
        if scheduler["preemption"] != "recompute":  # recompute reads no swap space (refused if given)
            scheduler["swap_space"] = swap
    if offload and (scheduler["preemption"] == "recompute" or draw(st.booleans())):
        kv["offload"] = {
            "enabled": True,
            "write": draw(st.sampled_from(["back", "through"])),
            "copy": draw(st.sampled_from(["batched", "per_block"])),
            "load": draw(st.sampled_from(["stall", "overlap"])),
            "host_bytes": draw(st.sampled_from([2, 8, 64])) * 16 * 131072,  # blocks of 2 MiB
            "eviction": draw(st.sampled_from(["lru", "lfu"])),  # in DRAM and the SSD
        }
        if draw(st.booleans()):  # an SSD of a few blocks below DRAM: demotions, loads from it
            kv["offload"]["ssd"] = {
                "capacity": draw(st.sampled_from([2, 16])) * 16 * 131072,
                "read_bw": "2GB/s",
            }
        cold = draw(st.sampled_from([0, 1, 5, 40]))
        if cold:
            kv["offload"]["cold_after_steps"] = cold
    if offload:
        cluster["topology"] = {"pcie": {"bw": draw(st.sampled_from(["1GB/s", "35GB/s"]))}}
        # Fair-shared links (processor sharing; `load: overlap` is refused with them).
        cluster["topology"]["sharing"] = draw(st.sampled_from(["fifo", "fair"]))
        if cluster["topology"]["sharing"] == "fair" and "offload" in kv:
            kv["offload"]["load"] = "stall"
        if draw(st.booleans()):  # a global pool of a few entries per node, over one or two nodes
            cluster["nodes"] = draw(st.sampled_from([1, 2]))
            kv["prefix_cache"] = {
                "scope": "global",
                "fetch": draw(st.sampled_from(["auto", "always"])),
                "pool_bytes": draw(st.sampled_from([2, 8, 64])) * 16 * 131072,
                "pool_eviction": draw(st.sampled_from(["lru", "lfu"])),
            }
            cluster["topology"]["network"] = {"bw": draw(st.sampled_from(["1GB/s", "50GB/s"]))}
            if cluster["topology"]["sharing"] == "fifo" and draw(st.booleans()):
                # Dedicated pool nodes of a few entries each, with one NIC or two (FIFO links only:
                # fair sharing is refused with them): publications and fetches through two NICs.
                pc = kv["prefix_cache"]
                pc["pool_node_bytes"] = pc.pop("pool_bytes")
                pc["pool_nodes"] = draw(st.sampled_from([1, 2, 3]))
                pc["pool_node_nics"] = draw(st.sampled_from([1, 2]))
    # Quantized caches (quantize-on-write priced every step) and a mix of formats per head.
    fmt = draw(
        st.sampled_from(
            ["bf16", "bf16", "int8", "kvquant4"] if switch else ["bf16", "bf16", "int8", "kvquant4", "mix"]
        )
    )
    kv.update(
        {"format": "int8", "format_mix": {"format": "int4", "share": 0.75}}
        if fmt == "mix"
        else {"format": fmt}
    )
    # Token eviction: H2O, StreamingLLM, attention entropy and token merging, every trigger and page policy, with the host tiers,
    # the global pool and swap too (not with speculative decoding, sliding windows or a format
    # switch: `kvsim run` refuses those).
    policy = (
        "none"
        if spec or window or switch
        else draw(
            st.sampled_from(
                ["h2o", "h2o", "streaming", "entropy", "merge"]
                if evict
                else ["none", "none", "h2o", "streaming", "entropy", "merge"]
            )
        )
    )
    if policy != "none":
        ev = {
            "policy": policy,
            "recent_tokens": draw(st.sampled_from([1, 16, 40])),
            "pages": draw(st.sampled_from(["soft_mark", "physical", "hybrid"])),
            "trigger": draw(st.sampled_from(["always", "pressure"])),
            "pressure_threshold": draw(st.sampled_from([0.3, 0.8])),
        }
        if policy == "h2o":
            ev.update(
                # (evict: sequences that still grow at their budget, so decoders that evicted are
                # preempted and swapped)
                heavy_ratio=draw(st.sampled_from([0.5, 0.7] if evict else [0.1, 0.5, 1.0])),
                budget_tokens=draw(st.sampled_from([0, 120])),
            )
        elif policy == "entropy":
            ev.update(
                keep_ratio=draw(st.sampled_from([0.5, 0.7] if evict else [0.1, 0.25, 1.0])),
                budget_tokens=draw(st.sampled_from([0, 120])),
            )
        elif policy == "merge":
            ev.update(
                merge_ratio=draw(st.sampled_from([0.5, 0.7] if evict else [0.1, 0.5, 1.0])),
                budget_tokens=draw(st.sampled_from([0, 120])),
            )
        else:
            ev["sink_tokens"] = draw(st.sampled_from([0, 4]))
        if ev["trigger"] == "always" and ev["pages"] != "hybrid":  # nothing reads it (refused if given)
            del ev["pressure_threshold"]
        kv["eviction"] = ev
    # Sliding-window layers (every layer, half, or one windowed; with global tokens or not) free
    # their out-of-window blocks, with the host tiers, the global pool and swap too (not with
    # eviction or speculative decoding).
    model: dict | None = None
    if policy == "none" and not spec and not switch and (window or draw(st.integers(0, 3)) == 0):
        model = {
            "name": "llama-3.1-8b",
            "sliding_window": draw(st.sampled_from([20, 64, 200])),
            "sliding_window_layers": draw(st.sampled_from([32, 16, 1])),
            "global_tokens": draw(st.sampled_from([0, 4])),
        }
    # A format switch to a smaller format past a length, with the host tiers, the global pool and
    # swap too (not with eviction, windows, speculative decoding or a format mix).
    smaller = {"bf16": ["fp8", "int4", "kvquant4"], "int8": ["int4", "kvquant4"], "kvquant4": ["int4"]}
    if (
        policy == "none"
        and model is None
        and not spec
        and fmt != "mix"
        and (switch or draw(st.integers(0, 3)) == 0)
    ):
        kv["format_switch"] = {
            "after_tokens": draw(st.sampled_from([1, 30, 100, 400])),
            "format": draw(st.sampled_from(smaller[fmt])),
        }
    # Speculative decoding, with the host tiers, the global pool and swap too (not with eviction,
    # sliding windows or a format switch: `kvsim run` refuses those).
    if (
        policy == "none"
        and model is None
        and "format_switch" not in kv
        and (spec or draw(st.integers(0, 3)) == 0)
    ):
        acc: dict = {"mean": draw(st.sampled_from([0.0, 0.4, 0.8, 1.0]))}
        if draw(st.booleans()):
            acc = {"dist": "beta", "mean": draw(st.sampled_from([0.3, 0.7])), "concentration": 2.0}
        scheduler["spec_decode"] = {
            "k": draw(st.sampled_from([1, 2, 4, 7])),
            "acceptance": acc,
            "draft": draw(st.sampled_from([{"kind": "mtp"}, {"kind": "model", "model": "qwen2.5-7b"}])),
        }
    extra = {} if model is None else {"model": model}
    sc = small_scenario(num_blocks=num_blocks, scheduler=scheduler, cluster=cluster, kv=kv, **extra)
    return sc, make_workload(arrivals, prompts, outputs, hash_ids=ids, block_tokens=g)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases_or_moe())
def test_invariants_completion_and_fast_forward_equality(case):
    _check_invariants_and_fast_forward(case)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(offload=True))
def test_invariants_and_fast_forward_equality_with_host_dram_offload(case):
    """As above with `kv.offload` on: loading requests hold their blocks, the host tier stays within
    its capacity, and fast-forward equals stepping (loads end windows; tier changes cut them)."""
    a, b = _check_invariants_and_fast_forward(case)
    assert a.summary["offload"] == b.summary["offload"]
    assert a.summary["swap"] == b.summary["swap"]
    assert a.summary["links"] == b.summary["links"]
    assert a.summary["global_pool"] == b.summary["global_pool"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(offload=True, evict=True))
def test_invariants_and_fast_forward_equality_with_eviction_and_tiers(case):
    """Token eviction under tight HBM with the tiers below it: a swapped request comes back with its
    computed and evicted tokens and blocks, the tiers stay consistent, and fast-forward equals
    stepping."""
    a, b = _check_invariants_and_fast_forward(case)
    for key in ("offload", "swap", "links", "global_pool", "eviction"):
        assert a.summary[key] == b.summary[key]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(offload=True, tight=True, window=True))
def test_invariants_and_fast_forward_equality_with_sliding_windows_and_tiers(case):
    """A sliding-window model under tight HBM with the tiers below it: its trimmed prompt entries
    leave HBM as rewritten (no write-back copies them), a swapped request comes back with its kept
    tokens and blocks, and fast-forward equals stepping."""
    a, b = _check_invariants_and_fast_forward(case)
    for key in ("offload", "swap", "links", "global_pool", "sliding_window"):
        assert a.summary[key] == b.summary[key]
    assert a.summary["sliding_window"] is not None


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(offload=True, tight=True, switch=True))
def test_invariants_and_fast_forward_equality_with_a_format_switch_and_tiers(case):
    """A format switch under tight HBM with the tiers below it: re-quantized entries leave HBM as
    rewritten, a swapped request that crossed comes back in the second format's blocks, and
    fast-forward equals stepping."""
    a, b = _check_invariants_and_fast_forward(case)
    for key in ("offload", "swap", "links", "global_pool", "format_switch"):
        assert a.summary[key] == b.summary[key]
    assert a.summary["format_switch"] is not None


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(spec=True))
def test_invariants_and_fast_forward_equality_with_spec_decode(case):
    """As above with `scheduler.spec_decode` on: blocks cover the verify slots, every request emits
    exactly its output, and fast-forward equals stepping (acceptance drawn per (request, step))."""
    a, b = _check_invariants_and_fast_forward(case)
    sa, sb = a.summary["spec_decode"], b.summary["spec_decode"]
    assert sa == sb
    assert sa["kv_discarded_tokens"] == sa["drafted_tokens"] - sa["accepted_tokens"]
    assert sum(sa["accepted_per_step_hist"]) == sa["verify_rows"]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(offload=True, spec=True))
def test_invariants_and_fast_forward_equality_with_spec_decode_and_tiers(case):
    """Speculative decoding with the tiers: swap copies the blocks a request holds (its look-ahead
    blocks too) and it resumes with the same computed tokens and blocks; verify windows end at a
    load's arrival and at a cold entry; fast-forward equals stepping."""
    a, b = _check_invariants_and_fast_forward(case)
    for key in ("offload", "swap", "links", "global_pool", "spec_decode"):
        assert a.summary[key] == b.summary[key]
    sa = a.summary["spec_decode"]
    assert sa["kv_discarded_tokens"] == sa["drafted_tokens"] - sa["accepted_tokens"]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(window=True))
def test_invariants_and_fast_forward_equality_with_sliding_windows(case):
    """As above with a sliding-window model: its out-of-window blocks are freed in closed form inside
    fast-forward windows, and fast-forward equals stepping."""
    a, b = _check_invariants_and_fast_forward(case)
    assert a.summary["sliding_window"] == b.summary["sliding_window"]
    assert a.summary["sliding_window"] is not None


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(switch=True))
def test_invariants_and_fast_forward_equality_with_a_format_switch(case):
    """As above with `kv.format_switch`: sequences re-quantized past the switch length hold fewer
    blocks in closed form inside fast-forward windows, and fast-forward equals stepping."""
    a, b = _check_invariants_and_fast_forward(case)
    assert a.summary["format_switch"] == b.summary["format_switch"]
    assert a.summary["format_switch"] is not None


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(case=disaggregated_cases())
def test_invariants_and_fast_forward_equality_disaggregated(case, monkeypatch):
    """Prefill and decode pools: each scheduler's blocks and tokens add up with the blocks a prefill
    replica holds for its sends and the hand-offs waiting at a decode replica, every request
    completes or is rejected, and fast-forward equals stepping (hand-offs and landings cut
    windows as arrivals)."""
    _register_outside(monkeypatch)
    a, b = _check_invariants_and_fast_forward(case)
    assert a.summary["disaggregation"] == b.summary["disaggregation"]
    assert a.summary["links"] == b.summary["links"]


def _check_invariants_and_fast_forward(case):  # type: ignore[no-untyped-def]
    sc, wl = case
    runs = []
    made.clear()
    for ff in (True, False):
        res = krun.run_scenario(
            dataclasses.replace(sc, sim=dataclasses.replace(sc.sim, fast_forward=ff)),
            workload=wl,
            make_scheduler=_checked,
        )
        assert sum(s.checks for s in made) > 0  # the injected checks really ran
        r = res.summary["requests"]
        assert r["unfinished"] == 0  # nothing is lost: every request completes or is rejected
        for s in res.seqs:
            assert s.status in (RequestStatus.FINISHED, RequestStatus.REJECTED)
            if s.status is RequestStatus.FINISHED:
                assert s.num_generated == s.output_len
                assert s.arrival_s <= s.first_scheduled_s <= s.first_token_s <= s.finish_s
        runs.append(res)
    a, b = runs
    assert records(a) == records(b)
    assert a.summary["kv_peak_used_blocks"] == b.summary["kv_peak_used_blocks"]
    assert a.summary["hbm_peak_bytes"] == b.summary["hbm_peak_bytes"]
    return a, b

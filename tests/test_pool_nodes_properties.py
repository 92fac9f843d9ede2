"""Random checks of the global pool on dedicated pool nodes (``kv.prefix_cache.pool_nodes``; one case in
four in the GPU nodes' DRAM, fetches through the home node's NIC), drawn densely where
`tests/test_engine_properties.py` draws them rarely: several GPU nodes and replicas
(tensor parallel too), pool nodes of a few blocks each (drops), every router, FIFO links (fair
sharing is refused with pool nodes), the host tier and swap on or off. Invariants after every
scheduler operation, every request accounted for, and fast-forward equal to stepping."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import draw_requests, make_workload, small_scenario
from tests.test_engine_properties import _check_invariants_and_fast_forward


@st.composite
def pool_node_cases(draw):  # type: ignore[no-untyped-def]
    g = 16
    n = draw(st.integers(2, 16))
    arrivals, prompts, outputs, ids = draw_requests(draw, n, [0.0, 0.005, 0.05, 0.5], 600, 120)
    need = max(-(-(p + o) // 16) for p, o in zip(prompts, outputs, strict=True))
    num_blocks = draw(st.integers(need, 2 * need))
    tp = draw(st.sampled_from([1, 1, 2]))
    cluster = {
        "nodes": draw(st.sampled_from([1, 2, 3])),
        "gpus_per_node": draw(st.sampled_from([2, 4])),
        "tensor_parallel": tp,
        "router": draw(
            st.sampled_from(
                [
                    "round_robin",
                    "least_outstanding_tokens",
                    "least_outstanding_requests",
                    "prefix_affinity",
                    "cache_aware",
                ]
            )
        ),
        "topology": {
            "pcie": {"bw": draw(st.sampled_from(["1GB/s", "35GB/s"]))},
            "network": {
                "bw": draw(st.sampled_from(["200MB/s", "1GB/s", "50GB/s"])),
                "shared_by": draw(st.sampled_from([1, 2])),
            },
        },
    }
    block = 16 * 131072 * tp  # a replica's block (all its GPUs' shares)
    pc: dict = {
        "scope": "global",
        "fetch": draw(st.sampled_from(["auto", "always"])),
        "pool_eviction": draw(st.sampled_from(["lru", "lfu"])),
    }
    if draw(st.integers(0, 3)):  # dedicated pool nodes
        pc["pool_nodes"] = draw(st.sampled_from([1, 2, 3]))
        pc["pool_node_bytes"] = draw(st.sampled_from([1, 3, 8, 64])) * block
        pc["pool_node_nics"] = draw(st.sampled_from([1, 2]))
    else:  # the pool in the GPU nodes' DRAM: a remote fetch holds the home node's NIC egress too
        pc["pool_bytes"] = draw(st.sampled_from([1, 3, 8, 64])) * block
    kv: dict = {"prefix_cache": pc}
    scheduler: dict = {
        "max_num_seqs": draw(st.sampled_from([2, 4, 64])),
        "max_batched_tokens": draw(st.sampled_from([16, 64, 256, 2048])),
    }
    if draw(st.booleans()):
        kv["offload"] = {
            "enabled": True,
            "write": draw(st.sampled_from(["back", "through"])),
            "copy": draw(st.sampled_from(["batched", "per_block"])),
            "load": draw(st.sampled_from(["stall", "overlap"])),
            "host_bytes": draw(st.sampled_from([2, 8])) * block,
        }
    if draw(st.booleans()):
        scheduler["preemption"] = draw(st.sampled_from(["swap", "auto"]))
        scheduler["swap_space"] = "64MiB"
    if draw(st.booleans()):
        kv["format"] = draw(st.sampled_from(["int8", "kvquant4"]))
    sc = small_scenario(num_blocks=num_blocks, scheduler=scheduler, cluster=cluster, kv=kv)
    return sc, make_workload(arrivals, prompts, outputs, hash_ids=ids, block_tokens=g)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=pool_node_cases())
def test_pool_nodes_invariants_and_fast_forward_equal_stepping(case):  # type: ignore[no-untyped-def]
    a, b = _check_invariants_and_fast_forward(case)
    for key in ("offload", "swap", "links", "global_pool", "warnings", "cost_usd"):
        assert a.summary[key] == b.summary[key]
    # Per replica too; the time-weighted mean of blocks in use is summed in another order by a
    # window than by its steps (as tests/test_eviction.py compares it).
    for ra, rb in zip(a.summary["replicas"], b.summary["replicas"], strict=True):
        ma, mb = ra.pop("kv_mean_used_blocks"), rb.pop("kv_mean_used_blocks")
        assert ra == rb and ma == pytest.approx(mb, rel=1e-12)
    gp = a.summary["global_pool"]
    assert gp["peak_bytes"] <= gp["capacity_bytes"]
    if gp["pool_nodes"] is not None:
        cap = gp["pool_nodes"]["capacity_bytes_per_node"]
        assert all(p <= cap for p in gp["pool_nodes"]["peak_bytes"])

"""Tests that catch wrong numbers (issue 30, item 8): each cost-based decision at a case where its
two sides are close, link utilisation against hand-computed busy time, accounting counted row by
row from ``requests.csv`` against the workload, and cost against independent arithmetic.

The decisions (``kvsim.run``, `kvsim.sim.offload`) are tested through whole runs: the close case is
built from the transfer arithmetic written out here (latency + calls x per-call overhead + bytes /
bandwidth, with the scenario's own link numbers) against the cost model's prefill price, with a
margin of 25% on each side, so that an error of a factor of two in either side moves the outcome.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvsim.run as krun
from kvsim.costs.base import ForwardBatch
from tests.helpers import make_workload, small_scenario, spy_preemptions

BLOCK = 16 * 131072  # Llama-3.1-8B bf16: 128 KiB of KV per token (32 layers x 8 KV heads x 128 x 2 x 2 B)
IDS_A = list(range(20))  # 20 blocks of 16 tokens: a 320-token prompt


def _prefill_s(sc: Any, tokens: int) -> float:
    """The cost model's price of one prefill of `tokens` at no context (what recomputing costs)."""
    return krun.make_cost_model(sc).price(ForwardBatch.prefill(tokens, 0, sampling=False)).seconds


def _bw(nbytes: float, seconds: float) -> str:
    """A bandwidth that moves `nbytes` in `seconds` (the scenario's way of writing it)."""
    return f"{nbytes / seconds:.0f}B/s"


# ---- preemption: auto, at one copy < recompute < a round trip ---------------------------------------
SWAP = make_workload([0.0, 0.05], [160, 160], [300, 300])  # two decoders outgrow 30 blocks
LAT, CALL = 20e-6, 3e-6  # the PCIe latency and per-call overhead these tests set


def _pcie(bw: str) -> dict[str, Any]:
    return {"topology": {"pcie": {"bw": bw, "latency": "20us", "per_call_overhead": "3us"}}}


def _victim(monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """The one victim of SWAP under recompute (its computed tokens, and the blocks a swap copies:
    those of its computed tokens): the links play no part before the first preemption."""
    seen, _ = spy_preemptions(monkeypatch)
    krun.run_scenario(small_scenario(num_blocks=30), workload=SWAP)
    ((_, computed, _, _, _),) = seen
    return computed, -(-computed // 16)


@pytest.mark.parametrize(
    ("copy_share", "swaps"),
    [
        (0.75, 0),  # one copy 0.75 x the prefill, the round trip 1.5 x: recompute
        (0.375, 1),  # one copy 0.375 x, the round trip 0.75 x: swap
    ],
)
def test_auto_weighs_the_copy_out_and_back_against_one_prefill(monkeypatch, copy_share, swaps):
    """``preemption: auto`` swaps a victim only if copying its blocks out (D2H) AND back (H2D) over
    idle links beats recomputing its computed tokens in one prefill. At a PCIe rate where one copy
    beats the prefill but the round trip does not, it recomputes: a rule that counted only one of
    the two copies would swap there."""
    computed, blocks = _victim(monkeypatch)
    recompute = _prefill_s(small_scenario(num_blocks=30), computed)
    nbytes = blocks * BLOCK
    one_copy = copy_share * recompute
    sc = small_scenario(
        num_blocks=30, scheduler={"preemption": "auto"}, cluster=_pcie(_bw(nbytes, one_copy - LAT - CALL))
    )
    t = sc.cluster.topology
    by_hand = LAT + CALL + nbytes / t.host_d2h.bw_bytes_per_s
    assert by_hand == pytest.approx(one_copy, rel=1e-6)  # the rate rounded to 1 B/s
    assert (by_hand < recompute) and ((2 * by_hand < recompute) == bool(swaps))
    seen, _ = spy_preemptions(monkeypatch)
    res = krun.run_scenario(sc, workload=SWAP)
    assert [s[1] for s in seen][:1] == [computed]  # the same victim at the same point
    sw = res.summary["swap"]
    assert (sw["swaps"], sw["recomputes"]) == (swaps, 1 - swaps)
    assert sw["swapped_bytes"] == swaps * nbytes
    assert res.summary["requests"]["completed"] == 2


def test_auto_with_a_slow_return_link_recomputes_though_the_copy_out_is_fast(monkeypatch):
    """Each direction priced at its own link: one copy at 0.2 x the prefill and the other at 0.9 x;
    out and back exceed the prefill, so auto recomputes, either way round. Pricing both copies at
    one direction's rate, or leaving one out, swaps in one of the two cases."""
    computed, blocks = _victim(monkeypatch)
    recompute = _prefill_s(small_scenario(num_blocks=30), computed)
    nbytes = blocks * BLOCK
    fast, slow = _bw(nbytes, 0.2 * recompute), _bw(nbytes, 0.9 * recompute)
    for d2h, h2d in ((fast, slow), (slow, fast)):
        pcie = {"d2h": d2h, "h2d": h2d, "latency": "0s", "per_call_overhead": "0s"}
        sc = small_scenario(
            num_blocks=30, scheduler={"preemption": "auto"}, cluster={"topology": {"pcie": pcie}}
        )
        res = krun.run_scenario(sc, workload=SWAP)
        assert (res.summary["swap"]["swaps"], res.summary["swap"]["recomputes"]) == (0, 1), (d2h, h2d)


# ---- fetch: auto, at a fetch 0.8 x or 1.25 x the recompute of its tokens ----------------------------
POOLED = make_workload([0.0, 1.0], [320, 320], [1, 1], hash_ids=[IDS_A, IDS_A], block_tokens=16)
NET_LAT, NET_CALL = 5e-6, 2e-6


def _network(bw: str) -> dict[str, Any]:
    return {"network": {"bw": bw, "latency": "5us", "per_call_overhead": "2us"}}


@pytest.mark.parametrize(("share", "cached"), [(0.8, 304), (1.25, 0)])
def test_fetch_auto_takes_a_remote_entry_only_when_its_fetch_beats_its_recompute(share, cached):
    """Two nodes of one GPU, round robin: A's 20 entries (one block each) are published, homed on
    node 0; B, A's prompt on node 1, fetches each over its NIC only if that takes less than
    prefilling the entry's 16 tokens at no context. At 0.8 x it fetches 19 entries (304 tokens);
    at 1.25 x it declines the first and recomputes the prompt."""
    base = small_scenario(num_blocks=40, cluster={"nodes": 2, "router": "round_robin"})
    fetch_s = share * _prefill_s(base, 16)
    cluster = {
        "nodes": 2,
        "router": "round_robin",
        "topology": _network(_bw(BLOCK, fetch_s - NET_LAT - NET_CALL)),
    }
    sc = small_scenario(
        num_blocks=40, cluster=cluster, kv={"prefix_cache": {"scope": "global", "fetch": "auto"}}
    )
    net = sc.cluster.topology.network
    assert NET_LAT + NET_CALL + BLOCK / net.bw_bytes_per_s == pytest.approx(
        fetch_s, rel=1e-6
    )  # the rate rounded to 1 B/s
    res = krun.run_scenario(sc, workload=POOLED)
    a, b = res.seqs
    assert (a.replica, b.replica) == (0, 1)
    assert b.num_cached_tokens == cached
    gp = res.summary["global_pool"]
    assert gp["fetched_bytes"] == cached // 16 * BLOCK
    assert (gp["declined_lookups"] > 0) == (cached == 0)


def _pool_node_cluster(network: dict[str, Any], router: str) -> dict[str, Any]:
    """Two GPU nodes of 2 x H100, one TP-2 replica each, each GPU its own NIC; one pool node with
    one NIC of the same rate: a whole block crosses the pool node's NIC, half a block each GPU's."""
    return {"nodes": 2, "gpus_per_node": 2, "tensor_parallel": 2, "router": router, "topology": network}


POOL_NODE_KV = {
    "prefix_cache": {"scope": "global", "pool_nodes": 1, "pool_node_bytes": "64GiB", "pool_node_nics": 1}
}


@pytest.mark.parametrize(("share", "cached"), [(0.8, 304), (1.25, 0)])
def test_fetch_auto_from_a_pool_node_prices_the_pool_nodes_nic(share, cached):
    """As above through a pool node: the pool node's one NIC carries each whole block (2 MiB), each
    GPU's NIC its half, so the pool node's NIC is the slower end. At 1.25 x the recompute through
    it, B declines, though its own NIC alone (about 0.63 x) would have been worth it."""
    base = small_scenario(cluster=_pool_node_cluster({}, "round_robin"), kv=POOL_NODE_KV)
    recompute = _prefill_s(base, 16)
    fetch_s = share * recompute
    bw = _bw(BLOCK, fetch_s - NET_LAT - NET_CALL)
    kv = {"prefix_cache": {**POOL_NODE_KV["prefix_cache"], "fetch": "auto"}}
    sc = small_scenario(cluster=_pool_node_cluster(_network(bw), "round_robin"), kv=kv)
    bw_s = sc.cluster.topology.network.bw_bytes_per_s
    through_pool_nic = NET_LAT + NET_CALL + BLOCK / bw_s
    own_nic_only = NET_LAT + NET_CALL + BLOCK / 2 / bw_s
    assert through_pool_nic == pytest.approx(fetch_s, rel=1e-6)  # the rate rounded to 1 B/s
    assert own_nic_only < recompute  # leaving the pool node's NIC out would fetch at both rates
    res = krun.run_scenario(sc, workload=POOLED)
    b = res.seqs[1]
    assert b.replica == 1 and b.num_cached_tokens == cached


# ---- the cache-aware router's price of a pool-node hit ----------------------------------------------
@pytest.mark.parametrize(("decode", "replica"), [(183, 0), (300, 1)])
def test_cache_aware_router_prices_a_pool_node_hit_through_the_pool_nodes_nic(monkeypatch, decode, replica):
    """The `_pool_node_cluster` at 10 GB/s per NIC, cache-aware routing. A (20 blocks) runs on
    replica 0 and is published to the pool node; D (16 tokens, `decode` output) arrives on replica
    0 just before B, A's prompt. B costs replica 0 its outstanding tokens (D's 16 + decode - 1)
    and replica 1 its 20 pool blocks at the router's network weight w: seconds to fetch a 32-block
    entry through the slower end, the pool node's NIC (7 us + 64 MiB / 10 GB/s), over seconds to
    prefill its 512 tokens. Replica 1's price is pinned by hand, and D's decode sits between that
    price and the one without the pool node's NIC (half the bytes), so leaving it out moves B."""
    from kvsim.sim.replica import Replica

    costs: list[tuple[int, int, float]] = []
    orig = Replica.prefill_cost_tokens

    def spy(self, req):  # type: ignore[no-untyped-def]
        v = orig(self, req)
        costs.append((self.index, req.id, v))
        return v

    monkeypatch.setattr(Replica, "prefill_cost_tokens", spy)
    net = {"network": {"bw": "10GB/s", "latency": "5us", "per_call_overhead": "2us"}}
    kv = {"prefix_cache": {**POOL_NODE_KV["prefix_cache"], "fetch": "always"}}
    sc = small_scenario(cluster=_pool_node_cluster(net, "cache_aware"), kv=kv)
    r512 = _prefill_s(sc, 512)
    w = min(1.0, (NET_LAT + NET_CALL + 32 * BLOCK / 10e9) / r512)
    w_own_nic = min(1.0, (NET_LAT + NET_CALL + 32 * BLOCK / 2 / 10e9) / r512)
    outstanding0 = 16 + decode - 1
    assert 320 * w_own_nic < 16 + 183 - 1 < 320 * w < 16 + 300 - 1  # the case is close on both sides
    wl = make_workload(
        [0.0, 1.0 - 1e-6, 1.0],
        [320, 16, 320],
        [1, decode, 1],
        hash_ids=[IDS_A, [500], IDS_A],
        block_tokens=16,
    )
    res = krun.run_scenario(sc, workload=wl)
    at_b = {i: v for i, rid, v in costs if rid == 2}
    assert at_b[0] == 0.0  # all 20 blocks in replica 0's HBM
    assert at_b[1] == pytest.approx(320 - 320 * (1 - w), rel=1e-9)
    b = res.seqs[2]
    assert b.replica == replica and b.num_cached_tokens == 304
    assert (outstanding0 > at_b[1]) == (replica == 1)


# ---- link utilisation against busy time computed by hand --------------------------------------------
N_WRITES = 5
WRITES = make_workload(
    [1.0 * i for i in range(N_WRITES)],
    [320] * N_WRITES,
    [1] * N_WRITES,
    hash_ids=[list(range(100 * i, 100 * i + 20)) for i in range(N_WRITES)],
    block_tokens=16,
)


@pytest.mark.parametrize("bw", [10e9, 50e6])
def test_link_utilisation_is_busy_time_over_simulated_time_by_hand(bw, tmp_path):
    """Write-through offload, five requests 1 s apart, each a distinct 320-token prompt (20 full
    blocks) with one output token: each prefill's schedule (at its arrival, the replica idle) copies
    its 20 new entries to DRAM as one D2H transfer of 40 MiB. A transfer holds the link for the
    per-call overhead plus bytes / bandwidth (the latency is in flight, not occupancy). At 10 GB/s
    the five are apart: busy = 5 x (3 us + 40 MiB / 10 GB/s). At 50 MB/s each takes 0.84 s, still
    apart, but the last one runs past the run's end (its last request's finish, the steps do not
    wait for the copy): only the part before the end counts, the rest is backlog. Simulated time is
    taken from requests.csv (the last finish)."""
    mbps = f"{bw / 1e6:.0f}MB/s"
    sc = small_scenario(
        cluster={"topology": {"pcie": {"bw": mbps, "latency": "20us", "per_call_overhead": "3us"}}},
        kv={
            "prefix_cache": {"scope": "local"},
            "offload": {"enabled": True, "host_bytes": "1GiB", "write": "through"},
        },
    )
    res = krun.run_scenario(sc, workload=WRITES)
    krun.write_run(res, tmp_path)
    rows = _rows(tmp_path)
    end = max(float(r["finish_s"]) for r in rows)
    hold = CALL + 20 * BLOCK / bw
    starts = [1.0 * i for i in range(N_WRITES)]
    busy = sum(min(s + hold, end) - s for s in starts)
    (link,) = res.summary["links"]
    assert link["name"] == "node0/host_d2h/0"
    assert (link["transfers"], link["bytes"]) == (N_WRITES, N_WRITES * 20 * BLOCK)
    # requests.csv writes times to the nanosecond: the hand values hold to about 1e-9 s.
    assert res.summary["simulated_s"] == pytest.approx(end, abs=1e-9)
    assert link["busy_s"] == pytest.approx(busy, rel=1e-8)
    assert link["utilization"] == pytest.approx(busy / end, rel=1e-8)
    assert link["backlog_s"] == pytest.approx(N_WRITES * hold - busy, rel=1e-8, abs=2e-9)


# ---- accounting counted from requests.csv -----------------------------------------------------------
def _rows(out: Path) -> list[dict[str, str]]:
    with (out / "requests.csv").open() as f:
        return list(csv.DictReader(f))


def test_every_arrived_request_is_one_row_of_requests_csv_and_the_counts_add_up(tmp_path):
    """A workload built to end every way: requests that complete, one longer than the model's
    context and one needing more KV blocks than a replica has (rejected), long decodes still running
    at ``sim.max_time`` (unfinished) and two arriving after it (never arrived). Counted row by row
    from requests.csv against the workload's own arrays: one row per arrived request, with its
    arrival, prompt and output; completed + rejected + unfinished = arrived; the summary's counts
    equal the rows' counts."""
    arrivals = [0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 5.0, 6.0]
    prompts = [100, 200, 140_000, 7000, 300, 150, 120, 80, 100, 100]
    outputs = [5, 10, 10, 10, 2000, 2000, 20, 3, 5, 5]
    wl = make_workload(arrivals, prompts, outputs)
    sc = small_scenario(num_blocks=400, sim={"seed": 1, "max_time": "2s"})
    res = krun.run_scenario(sc, workload=wl)
    krun.write_run(res, tmp_path)
    rows = _rows(tmp_path)
    arrived = [i for i, t in enumerate(arrivals) if t <= 2.0]
    assert sorted(int(r["id"]) for r in rows) == arrived
    status: dict[int, str] = {}
    for r in rows:
        i = int(r["id"])
        assert float(r["arrival_s"]) == arrivals[i]
        assert int(r["prompt_tokens"]) == prompts[i]
        status[i] = r["status"]
        if r["status"] == "completed":
            assert int(r["output_tokens"]) == outputs[i]
            assert float(r["finish_s"]) <= 2.0
    assert status[2] == "rejected" and status[3] == "rejected"  # context; KV blocks
    assert status[4] == status[5] == "unfinished"  # 2,000 decode steps do not fit in 2 s
    completed = sum(s == "completed" for s in status.values())
    rejected = sum(s == "rejected" for s in status.values())
    unfinished = sum(s == "unfinished" for s in status.values())
    assert (completed, rejected, unfinished) == (4, 2, 2)
    assert completed + rejected + unfinished == len(arrived) == 8
    req = res.summary["requests"]
    assert (req["completed"], req["rejected"], req["unfinished"]) == (completed, rejected, unfinished)
    assert req["total"] == len(arrived) and req["not_arrived"] == len(arrivals) - len(arrived)


# ---- cost against independent arithmetic ------------------------------------------------------------
@pytest.mark.parametrize("pool_node", [False, True])
def test_cost_per_million_tokens_is_gpus_times_price_times_hours_over_tokens(pool_node, tmp_path):
    """Cost per million tokens = (GPUs x $/GPU-hour [+ pool nodes x $/node-hour]) x simulated hours
    / (prompt + output tokens of the completed requests) x 1e6, every term from the scenario's
    stated prices and from requests.csv, none from the cost model."""
    rng = np.random.default_rng(3)
    n = 40
    wl = make_workload(np.sort(rng.uniform(0, 4, n)), rng.integers(50, 800, n), rng.integers(5, 200, n))
    kv: dict[str, Any] = {}
    cluster: dict[str, Any] = {"gpus_per_node": 2, "nodes": 1}
    if pool_node:
        kv = {
            "prefix_cache": {
                "scope": "global",
                "pool_nodes": 1,
                "pool_node_bytes": "64GiB",
                "pool_node_cost_per_hour": "$1.20/h",
            }
        }
        cluster["nodes"] = 2
    sc = small_scenario(cluster=cluster, kv=kv, pricing={"gpu_hour": "$2.50/h"})
    res = krun.run_scenario(sc, workload=wl)
    krun.write_run(res, tmp_path)
    rows = [r for r in _rows(tmp_path) if r["status"] == "completed"]
    assert len(rows) == n
    tokens = sum(int(r["prompt_tokens"]) + int(r["output_tokens"]) for r in rows)
    hours = max(float(r["finish_s"]) for r in rows) / 3600
    gpus = 2 * cluster["nodes"]
    usd_per_hour = gpus * 2.50 + (1.20 if pool_node else 0.0)
    s = res.summary
    # requests.csv writes times to the nanosecond: a relative error of at most about 1e-9.
    assert s["cost_usd"] == pytest.approx(usd_per_hour * hours, rel=1e-8)
    assert s["cost_per_mtok_usd"] == pytest.approx(usd_per_hour * hours / tokens * 1e6, rel=1e-8)
    out_tokens = sum(int(r["output_tokens"]) for r in rows)
    assert s["cost_per_output_mtok_usd"] == pytest.approx(usd_per_hour * hours / out_tokens * 1e6, rel=1e-8)
    assert math.isclose(s["gpu_hours"], gpus * hours, rel_tol=1e-8)

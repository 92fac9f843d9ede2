"""The global prefix pool on dedicated pool nodes (``kv.prefix_cache.pool_nodes``): placement and
capacity per pool node, transfers through two NICs at once, and the run's cost. Exact numbers."""

from __future__ import annotations

import pytest

import kvsim.run as krun
from kvsim.core.tiers import PoolNodes, spread
from kvsim.costs.base import ForwardBatch, transfer_time
from kvsim.sim.links import LinkQueue, reserve_through
from kvsim.spec.topology import Link
from tests.helpers import make_workload, small_scenario

BLOCK = 16 * 131072  # Llama-3.1-8B bf16, 16-token block, per GPU (tests.helpers)
IDS_A = list(range(20))
POOLED = make_workload([0.0, 1.0], [320, 320], [1, 1], hash_ids=[IDS_A, IDS_A], block_tokens=16)


# ---- one transfer through two links (cut-through) ----------------------------------------------------
def _pool_and_gpu() -> tuple[LinkQueue, LinkQueue]:
    pool = LinkQueue(Link("pool_nic", 100e9, 5e-6, 2.3e-6), label="pool0/nic_out/0")
    gpu = LinkQueue(Link("network", 50e9, 5e-6, 2.3e-6), label="node1/network/0")
    return pool, gpu


def test_through_two_idle_links_a_transfer_takes_latency_calls_overhead_and_bytes_over_the_slower():
    pool, gpu = _pool_and_gpu()
    nbytes = 19 * BLOCK
    start, end = reserve_through(pool, gpu, 2.0, nbytes, 3)
    assert start == 2.0
    assert end == 2.0 + (3 * 2.3e-6 + nbytes / 50e9) + 5e-6  # min(100, 50) GB/s
    assert pool.busy_until == gpu.busy_until == 2.0 + (3 * 2.3e-6 + nbytes / 50e9)
    for q in (pool, gpu):
        assert (q.stats.transfers, q.stats.bytes, q.stats.queued_s) == (1, nbytes, 0.0)
        assert q.stats.busy_s == 3 * 2.3e-6 + nbytes / 50e9
    # Different bytes on the two ends: the slower end's time sets the hold.
    pool2, gpu2 = _pool_and_gpu()
    _, end2 = reserve_through(pool2, gpu2, 0.0, 8 * BLOCK, 1, BLOCK)
    assert end2 == (2.3e-6 + 8 * BLOCK / 100e9) + 5e-6
    assert (pool2.stats.bytes, gpu2.stats.bytes) == (8 * BLOCK, BLOCK)


def test_two_fetches_from_one_pool_node_at_once_queue_on_its_egress():
    """Requesters on two nodes fetch B bytes each from one pool node at the same instant: the second
    starts when the first frees the pool node's egress, and ends a whole transfer later."""
    link = Link("network", 50e9, 5e-6, 2.3e-6)
    pool = LinkQueue(link, label="pool0/nic_out/0")
    gpu0, gpu1 = LinkQueue(link, label="node0/network/0"), LinkQueue(link, label="node1/network/0")
    nbytes = 1e6
    hold = 2.3e-6 + nbytes / 50e9
    (s1, e1), (s2, e2) = reserve_through(pool, gpu0, 0.0, nbytes), reserve_through(pool, gpu1, 0.0, nbytes)
    assert (s1, e1) == (0.0, hold + 5e-6)
    assert (s2, e2) == (hold, 2 * hold + 5e-6)
    assert pool.stats.queued_s == hold and gpu1.stats.queued_s == hold and gpu0.stats.queued_s == 0.0
    assert gpu0.busy_until == hold and gpu1.busy_until == 2 * hold and pool.busy_until == 2 * hold
    # A transfer through a busy GPU link waits for it even when the pool node's link is free.
    other = LinkQueue(link, label="pool1/nic_out/0")
    s3, e3 = reserve_through(other, gpu1, 0.0, nbytes)
    assert (s3, e3) == (2 * hold, 3 * hold + 5e-6)


# ---- placement and capacity -------------------------------------------------------------------------
def test_pool_nodes_place_each_entry_by_its_key_and_evict_within_each_node():
    pool = PoolNodes(3, 2, first_home=4)
    keys = list(range(12))
    homes = {k: spread(k) % 2 for k in keys}
    assert set(homes.values()) == {0, 1}  # consecutive trace ids spread over both nodes
    new = pool.publish(keys[:4], [1] * 4, node=0)
    assert [k for k, _ in new] == sorted(keys[:4], key=lambda k: homes[k])  # grouped by pool node
    assert all(pool.home[k] == 4 + homes[k] for k in keys[:4])
    pool.check()
    pool.publish(keys[4:], [1] * 8, node=1)  # 12 entries into 2 x 3 blocks: each node keeps its 3 newest
    pool.check()
    for j in (0, 1):
        mine = [k for k in keys if homes[k] == j]
        assert list(pool.shards[j].entries) == mine[-3:]
        assert pool.shards[j].used_blocks == 3
    assert pool.used_blocks == 6 == pool.stats.peak_blocks
    assert pool.stats.dropped_blocks == 6
    # The same keys give the same placement (no state but the key).
    again = PoolNodes(3, 2, first_home=4)
    again.publish(keys, [1] * 12, node=3)
    assert again.entries.keys() == pool.entries.keys()
    # A batch that drops an entry and inserts it again leaves the union equal to the shards'.
    j0 = [k for k in keys if homes[k] == 0]
    small = PoolNodes(1, 2, first_home=0)
    small.publish([j0[0], j0[1], j0[0]], [1, 1, 1], node=0)
    small.check()
    assert list(small.entries) == [j0[0]]


def test_private_keys_spread_over_pool_nodes_too():
    from kvsim.core.block_hash import private_keys

    keys = [k for i in range(40) for k in private_keys(i, 64)[0]]
    assert {spread(k) % 4 for k in keys} == {0, 1, 2, 3}  # their low bits are all zero


# ---- runs -------------------------------------------------------------------------------------------
def _pool_scenario(ff: bool = True, **pc: object):  # type: ignore[no-untyped-def]
    return small_scenario(
        num_blocks=40,
        cluster={"nodes": 2, "router": "round_robin"},
        kv={"prefix_cache": {"scope": "global", "pool_nodes": 1, "pool_node_nics": 1, **pc}},
        sim={"seed": 1, "fast_forward": ff},
    )


@pytest.mark.parametrize("ff", [True, False])
@pytest.mark.parametrize("fetch", ["auto", "always"])
def test_a_prefix_only_on_a_pool_node_is_fetched_through_both_nics_and_only_the_rest_prefilled(ff, fetch):
    """Two GPU nodes of one GPU and one pool node with one 50 GB/s NIC: A computes its 20 blocks
    on node 0, which writes them to the pool node (node 0's NIC egress and the pool node's
    ingress); B, the same prompt on node 1, fetches 19 blocks from the pool node's egress into its
    own NIC, both idle (5 us + 2.3 us + bytes / 50 GB/s), and prefills 16 tokens. No GPU node's
    DRAM or PCIe is used."""
    sc = _pool_scenario(ff, fetch=fetch)
    res = krun.run_scenario(sc, workload=POOLED)
    a, b = res.seqs
    assert (a.replica, b.replica) == (0, 1)
    fetch_s = transfer_time(19 * BLOCK, sc.cluster.topology.network)
    assert fetch_s == 5e-6 + 2.3e-6 + 19 * BLOCK / 50e9
    prefill = krun.make_cost_model(sc).price(ForwardBatch.prefill(16, 304)).seconds
    assert b.num_cached_tokens == 304
    assert b.first_token_s == pytest.approx(1.0 + fetch_s + prefill, rel=1e-12)
    gp = res.summary["global_pool"]
    assert gp["hit_rate_global"] == 304 / 640
    assert gp["remote_bytes"] == gp["fetched_bytes"] == 19 * BLOCK
    assert gp["published_bytes"] == 20 * BLOCK
    links = {r["name"]: r for r in res.summary["links"]}
    assert set(links) == {"node0/network_out/0", "pool0/nic_in/0", "pool0/nic_out/0", "node1/network/0"}
    assert links["node0/network_out/0"]["bytes"] == links["pool0/nic_in/0"]["bytes"] == 20 * BLOCK
    assert links["pool0/nic_out/0"]["bytes"] == links["node1/network/0"]["bytes"] == 19 * BLOCK
    pn = gp["pool_nodes"]
    assert pn["nodes"] == 1 and pn["nics_per_node"] == 1 and pn["nic_bw_bytes_per_s"] == 50e9
    assert pn["capacity_bytes_per_node"] == (2 * 2**40 // BLOCK) * BLOCK  # cluster.host_dram
    assert pn["peak_bytes"] == [20 * BLOCK] and pn["end_bytes"] == [20 * BLOCK]
    # The pool node's price is in the run's cost: GPU-hours at $3.00 plus the node at $13.338/h.
    sim_h = res.summary["simulated_s"] / 3600
    assert pn["cost_usd"] == sim_h * 13.338
    assert res.summary["cost_usd"] == res.summary["gpu_hours"] * 3.00 + sim_h * 13.338
    r = res.summary["requests"]
    assert (r["completed"], r["rejected"], r["unfinished"], r["total"]) == (2, 0, 0, 2)
    tiers = {name for _, name, _ in res.tier_samples}
    assert tiers == {"global", "pool0"}


def test_publications_of_two_nodes_at_once_queue_on_the_pool_nodes_ingress():
    """A and C (different prompts) computed at once on two nodes: their writes reach the single pool
    node's ingress together, and the second waits for the first there."""
    ids_c = list(range(100, 120))
    wl = make_workload([0.0, 0.0], [320, 320], [1, 1], hash_ids=[IDS_A, ids_c], block_tokens=16)
    res = krun.run_scenario(_pool_scenario(), workload=wl)
    links = {r["name"]: r for r in res.summary["links"]}
    hold = 2.3e-6 + 20 * BLOCK / 50e9
    assert links["pool0/nic_in/0"]["transfers"] == 2
    assert links["pool0/nic_in/0"]["queued_s"] == pytest.approx(hold, rel=1e-9)
    assert links["pool0/nic_in/0"]["busy_s"] == 2 * hold


def test_auto_recomputes_a_pool_node_prefix_over_a_slow_network():
    slow = {"nodes": 2, "router": "round_robin", "topology": {"network": {"bw": "100MB/s"}}}
    kv = {"prefix_cache": {"scope": "global", "pool_nodes": 2}}
    res = krun.run_scenario(small_scenario(num_blocks=40, cluster=slow, kv=kv), workload=POOLED)
    assert res.seqs[1].num_cached_tokens == 0  # 2 MiB at 100 MB/s loses to recomputing 16 tokens
    assert res.summary["global_pool"]["declined_lookups"] > 0


def test_a_request_on_the_publishing_node_also_fetches_from_the_pool_node():
    """With dedicated pool nodes no entry is local: the publisher's own node fetches over its NIC."""
    sc = small_scenario(
        num_blocks=21,  # A's 20 blocks leave HBM to make room for D; B then finds them on the pool node
        cluster={"nodes": 1},
        kv={"prefix_cache": {"scope": "global", "pool_nodes": 1, "fetch": "always"}},
    )
    wl = make_workload(
        [0.0, 0.5, 1.0],
        [320, 320, 320],
        [1, 1, 1],
        hash_ids=[IDS_A, list(range(200, 220)), IDS_A],
        block_tokens=16,
    )
    res = krun.run_scenario(sc, workload=wl)
    b = res.seqs[2]
    assert b.num_cached_tokens == 304
    links = {r["name"]: r for r in res.summary["links"]}
    # One of A's blocks is still in HBM (D took 20 of 21); the other 18 come in over the NIC, not PCIe.
    assert res.summary["global_pool"]["remote_bytes"] == 18 * BLOCK
    assert links["node0/network/0"]["bytes"] == 18 * BLOCK
    assert not any(name.startswith("node0/host") for name in links)


def test_pool_nodes_off_leaves_no_pool_node_keys():
    sc = small_scenario(num_blocks=40, cluster={"nodes": 2}, kv={"prefix_cache": {"scope": "global"}})
    res = krun.run_scenario(sc, workload=POOLED)
    assert res.summary["global_pool"]["pool_nodes"] is None
    assert "pool node price" not in res.summary["config"]["sources"]


def test_a_pool_nodes_default_price_follows_its_dram():
    """x2idn's list prices are linear in DRAM: 1 TiB pool nodes cost half the 2 TiB default's $13.338/h,
    and a price given is taken as it is."""
    kv = {"prefix_cache": {"scope": "global", "pool_nodes": 2, "pool_node_bytes": "1TiB"}}
    res = krun.run_scenario(small_scenario(num_blocks=40, cluster={"nodes": 2}, kv=kv), workload=POOLED)
    pn = res.summary["global_pool"]["pool_nodes"]
    assert pn["cost_per_hour_usd"] == 1024 * (13.338 / 2048) == 6.669
    assert "pool node price" in res.summary["config"]["sources"]
    kv["prefix_cache"]["pool_node_cost_per_hour"] = "$2.50/h"
    res = krun.run_scenario(small_scenario(num_blocks=40, cluster={"nodes": 2}, kv=kv), workload=POOLED)
    assert res.summary["global_pool"]["pool_nodes"]["cost_per_hour_usd"] == 2.5
    # A price given is not the x2idn rate's, nor a DRAM size given the DGX default's: the sources
    # name only the defaults used (the x2idn price was listed beside a given $2.50/h, and a $0
    # price dropped the NICs' source though the default 2 NICs were used).
    assert "pool node nics" in res.summary["config"]["sources"]
    assert not {"pool node price", "pool node dram"} & set(res.summary["config"]["sources"])
    free = {"prefix_cache": {"scope": "global", "pool_nodes": 1, "pool_node_cost_per_hour": 0}}
    src = krun.run_scenario(small_scenario(num_blocks=40, kv=free), workload=POOLED).summary["config"][
        "sources"
    ]
    assert {"pool node dram", "pool node nics"} <= set(src) and "pool node price" not in src
    assert (
        res.summary["cost_usd"] == res.summary["gpu_hours"] * 3.00 + res.summary["simulated_s"] / 3600 * 5.0
    )


def test_the_report_and_csvs_show_the_pool_nodes(tmp_path):
    from kvsim.report import write_report

    res = krun.run_scenario(_pool_scenario(), workload=POOLED)
    krun.write_run(res, tmp_path)
    page = write_report(tmp_path).read_text()
    assert "dedicated pool nodes" in page and "pool0/nic_out/0" in page
    assert "$13.34/h each" in page
    links = {ln.split(",")[1] for ln in (tmp_path / "links.csv").read_text().splitlines()[1:]}
    assert {"pool0/nic_in/0", "pool0/nic_out/0", "node0/network_out/0"} <= links
    tiers = {ln.split(",")[1] for ln in (tmp_path / "tiers.csv").read_text().splitlines()[1:]}
    assert tiers == {"global", "pool0"}


def test_kvsim_plan_prices_the_pool_nodes_beside_the_gpus(tmp_path):
    from kvsim.sweep.plan import parse_search, parse_slo, prepare_plan

    p = tmp_path / "s.yaml"
    p.write_text(
        "model: llama-3.1-8b\ncluster: {gpu: h100-sxm, gpus_per_node: 1}\n"
        "kv: {prefix_cache: {scope: global, pool_nodes: 2}}\n"
        "workload: {synthetic: {num_requests: 4, rate: 4}}\n"
    )
    planner = prepare_plan(
        str(p), [parse_slo("ttft_p99=1s")], [parse_search("cluster.nodes=1..3")], (1.0,), 0.0
    )
    got = sorted((n, price.usd_per_hour, other) for n, price, other in planner.cost.values())
    assert got == [(n, 3.0, 2 * 13.338) for n in (1, 2, 3)]


def test_the_plan_page_shows_the_pool_nodes_in_a_configurations_price():
    """The page's equation adds up: 4 GPUs x $3.00 + $26.68 of pool nodes = $38.68/h (it read
    "4 GPUs x $3.00/GPU-h = $38.68/h"); a plan without pool nodes (or written before them) as before."""
    from kvsim.report.plan import _config_line

    e = {"label": "cluster.nodes=4", "gpus": 4, "gpu_hour_usd": 3.0, "usd_per_hour": 4 * 3.0 + 2 * 13.338}
    assert _config_line({**e, "pool_nodes_usd_per_hour": 2 * 13.338}) == (
        "<b>cluster.nodes=4</b>: 4 GPUs x $3.00/GPU-h + $26.68/h of pool nodes = <b>$38.68/h</b>"
    )
    plain = {**e, "usd_per_hour": 12.0}
    want = "<b>cluster.nodes=4</b>: 4 GPUs x $3.00/GPU-h = <b>$12.00/h</b>"
    assert _config_line(plain) == _config_line({**plain, "pool_nodes_usd_per_hour": 0.0}) == want

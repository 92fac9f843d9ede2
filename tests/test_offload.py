"""Links with queueing, the host-DRAM tier and loads back to HBM: story tests with exact numbers."""

from __future__ import annotations

import dataclasses

import pytest

import kvsim.run as krun
from kvsim.core.tiers import GlobalPool, HostTier
from kvsim.costs.base import ForwardBatch, transfer_time
from kvsim.errors import KvsimError
from kvsim.sim.links import LinkQueue
from kvsim.spec.topology import Link
from tests.helpers import make_workload, records, small_scenario

BLOCK = 16 * 131072  # Llama-3.1-8B bf16, 16-token block, per GPU (tests.helpers)


# ---- links ------------------------------------------------------------------------------------------
def test_idle_link_takes_exactly_latency_plus_bytes_over_bandwidth():
    link = Link("network", 50e9, 5e-6, 0.0)
    q = LinkQueue(link, label="l")
    nbytes = 2 * BLOCK
    start, end = q.reserve(3.0, nbytes)
    assert start == 3.0
    assert end - 3.0 == pytest.approx(5e-6 + nbytes / 50e9, rel=1e-12)
    assert q.reserve(10.0, nbytes)[1] == 10.0 + nbytes / 50e9 + 5e-6  # idle again: the same
    assert transfer_time(nbytes, link) == 5e-6 + nbytes / 50e9


def test_second_of_two_simultaneous_transfers_ends_at_twice_the_bytes_time_plus_one_latency():
    """Latency is a pipeline delay that does not hold the link; the bytes queue FIFO."""
    q = LinkQueue(Link("network", 50e9, 5e-6, 0.0), label="l")
    nbytes = 1e6
    (s1, e1), (s2, e2) = q.reserve(0.0, nbytes), q.reserve(0.0, nbytes)
    assert (s1, s2) == (0.0, nbytes / 50e9)
    assert e1 == nbytes / 50e9 + 5e-6
    assert e2 == 2 * nbytes / 50e9 + 5e-6
    assert q.stats.transfers == 2 and q.stats.bytes == 2e6
    assert q.stats.busy_s == 2 * nbytes / 50e9
    assert q.stats.queued_s == nbytes / 50e9


def test_a_link_is_busy_no_longer_than_the_time_it_had():
    """Three 1 GB transfers asked for at once on a 1 GB/s link, and one at 5 s: by 1.5 s the link
    was busy 1.5 s (not the 3 s asked for); it idles from 3 s to 5 s."""
    q = LinkQueue(Link("pcie", 1e9, 1e-3, 0.0), label="l")
    for _ in range(3):
        q.reserve(0.0, 1e9)
    assert q.work_asked_s() == q.stats.busy_s == 3.0
    assert (q.busy_within(0.0), q.busy_within(1.5), q.busy_within(3.0), q.busy_within(4.0)) == (0, 1.5, 3, 3)
    q.reserve(5.0, 1e9)
    assert (q.busy_within(5.5), q.busy_within(100.0)) == (3.5, 4.0)


def test_a_fair_link_is_busy_no_longer_than_the_time_it_had():
    """Two 1 GB transfers share a 1 GB/s link from 0: both end at 2 s; the link was busy 1 s by 1 s,
    and with the run stopped at 1 s the second second of work is still asked for."""
    import simpy

    from kvsim.sim.links import FairLinkQueue

    env = simpy.Environment()
    q = FairLinkQueue(Link("pcie", 1e9, 0.0, 0.0), label="l", env=env)
    q.submit(0.0, 1e9)
    q.submit(0.0, 1e9)
    env.run(until=1.0)
    assert q.busy_within(1.0) == 0.0 and q.work_asked_s() == 2.0  # nothing ended yet: no interval
    q.settle(1.0)  # as the run's records do at its end
    assert (q.busy_within(1.0), q.work_asked_s()) == (1.0, 2.0)
    env.run()
    assert (q.busy_within(1.0), q.busy_within(5.0), q.work_asked_s()) == (1.0, 2.0, 2.0)


def _fair_run(starts):  # type: ignore[no-untyped-def]
    """Transfers of (start instant, bytes) on one fair-shared 50 GB/s link with 5 us latency and
    2 us per call: their arrival instants."""
    import simpy

    from kvsim.sim.links import FairLinkQueue

    env = simpy.Environment()
    q = FairLinkQueue(Link("network", 50e9, 5e-6, 2e-6), label="l", env=env)
    arrivals = []

    def start(t, nbytes):  # type: ignore[no-untyped-def]
        yield env.timeout(t)
        arrivals.append(q.submit(t, nbytes))

    for t, nbytes in starts:
        env.process(start(t, nbytes))
    env.run()
    return q, [a.t for a in arrivals]


def test_two_simultaneous_equal_transfers_on_a_fair_link_both_end_at_twice_the_single_time():
    """Processor sharing: each gets half the link, so both arrive at latency + 2 x (overhead + B/bw),
    where FIFO ends one at latency + overhead + B/bw and the other at latency + 2 x that."""
    w = 2e-6 + 1e6 / 50e9
    _, [alone] = _fair_run([(0.0, 1e6)])
    assert alone == w + 5e-6  # idle: as FIFO's
    q, [a, b] = _fair_run([(0.0, 1e6), (0.0, 1e6)])
    assert a == b == 2 * w + 5e-6
    assert q.stats.transfers == 2 and q.stats.bytes == 2e6 and q.stats.busy_s == 2 * w
    fifo = LinkQueue(Link("network", 50e9, 5e-6, 2e-6), label="l")
    assert [fifo.reserve(0.0, 1e6)[1], fifo.reserve(0.0, 1e6)[1]] == [w + 5e-6, 2 * w + 5e-6]


def test_a_fair_link_recomputes_a_transfer_end_when_another_starts_and_ends():
    """A (work 2w) alone from 0; B (work w) starts at w/2: both at half speed until B ends at
    w/2 + 2w (A has 2w - w/2 - w = w/2 left), then A alone: it ends at 3w."""
    w = 2e-6 + 1e6 / 50e9
    nb_a = 2 * 1e6 + 2e-6 * 50e9  # A's work, calls included, is exactly 2w
    _, [a, b] = _fair_run([(0.0, nb_a), (w / 2, 1e6)])
    assert b == pytest.approx(w / 2 + 2 * w + 5e-6, rel=1e-12)
    assert a == pytest.approx(3 * w + 5e-6, rel=1e-12)


FAIR_STORY = make_workload(
    [0.0, 1.0, 10.0, 10.0],
    [320] * 4,
    [1] * 4,
    hash_ids=[list(range(20)), list(range(500, 520)), list(range(500, 520)), list(range(20))],
    block_tokens=16,
)


@pytest.mark.parametrize("ff", [True, False])
@pytest.mark.parametrize("sharing", ["fifo", "fair"])
def test_two_loads_at_once_on_a_shared_pcie_switch_share_it_fairly(ff, sharing):
    """Two replicas of one GPU under one PCIe switch (shared_by 2), write-through: A's prompt on
    replica 0 and G's on replica 1 are written to the node's DRAM; at t=10 G's prompt again on
    replica 0 and A's on replica 1, each loading 19 entries from DRAM at the same instant over the
    one H2D link. FIFO: the first load takes latency + w, the second latency + 2w; fair: both 2w."""
    sc = small_scenario(
        num_blocks=40,
        cluster={
            "gpus_per_node": 2,
            "router": "round_robin",
            "topology": {"sharing": sharing, "pcie": {"shared_by": 2}},
        },
        kv={"offload": {"enabled": True, "write": "through"}},
        sim={"seed": 1, "fast_forward": ff},
    )
    res = krun.run_scenario(sc, workload=FAIR_STORY)
    h2d = sc.cluster.topology.host_h2d
    w = transfer_time(19 * BLOCK, h2d) - h2d.latency_s  # the bytes' and the call's time
    prefill = krun.make_cost_model(sc).price(ForwardBatch.prefill(16, 304)).seconds
    g, a = res.seqs[2], res.seqs[3]
    assert (g.replica, a.replica) == (0, 1) and g.num_cached_tokens == a.num_cached_tokens == 304
    loads = [1, 2] if sharing == "fifo" else [2, 2]
    for seq, k in zip((g, a), loads, strict=True):
        assert seq.first_token_s == pytest.approx(10.0 + h2d.latency_s + k * w + prefill, rel=1e-12)
    links = {r["name"]: r for r in res.summary["links"]}
    assert links["node0/host_h2d/0"]["bytes"] == 38 * BLOCK
    assert links["node0/host_h2d/0"]["transfers"] == 2


def test_per_block_copies_pay_the_per_call_overhead_per_block():
    link = Link("host_h2d", 35.2e9, 0.0, 2.3e-6)
    per_block, batched = LinkQueue(link, label="a"), LinkQueue(link, label="b")
    _, e_pb = per_block.reserve(0.0, 32 * BLOCK, 32)
    _, e_b = batched.reserve(0.0, 32 * BLOCK, 1)
    assert e_pb - e_b == pytest.approx(31 * 2.3e-6, rel=1e-9)
    assert e_b == transfer_time(32 * BLOCK, link, 1)


# ---- the host tier ------------------------------------------------------------------------------------
def test_host_tier_is_lru_within_capacity():
    t = HostTier(5)
    assert t.insert([1, 2], [2, 2]) == [(1, 2), (2, 2)]
    assert t.insert([1], [2]) == []  # present: only touched (now 2 is the oldest)
    assert t.insert([3], [2]) == [(3, 2)]  # 2 dropped to make room
    assert list(t.entries) == [1, 3] and t.used_blocks == 4
    assert t.stats.dropped_blocks == 2
    assert t.insert([4], [6]) == []  # larger than the tier: skipped
    assert t.num_prefix_hits([1, 3, 9, 1], 0, 4) == 2
    t.check()


def test_lfu_drops_the_least_used_entry_where_lru_drops_the_least_recent():
    """1 and 2 in, 1 used twice more (3 uses), then 2 once (2 uses, the most recent): LRU drops 1,
    the least recent; LFU drops 2, the least used."""
    for eviction, dropped, kept in (("lru", 1, [2, 3]), ("lfu", 2, [1, 3])):
        t = HostTier(4, eviction=eviction)
        t.insert([1, 2], [2, 2])
        assert t.touch([1]) == 2 and t.touch([1]) == 2
        t.insert([2], [2])  # present: a use, as a touch
        assert t.insert([3], [2]) == [(3, 2)]
        assert t.last_dropped == [dropped] and sorted(t.entries) == kept
        t.check()


def test_lfu_breaks_ties_by_recency_and_counts_restart_after_a_drop():
    t = HostTier(3, eviction="lfu")
    t.insert([1, 2, 3], [1, 1, 1])  # one use each: 1 is the least recent
    t.touch([1])  # 1: 2 uses
    assert t.insert([4], [1]) == [(4, 1)] and t.last_dropped == [2]  # 2 and 3 tie at one use: 2 older
    assert t.uses == {1: 2, 3: 1, 4: 1}
    t.insert([5, 6], [1, 1])  # 3 then 4 go (one use each, oldest first)
    assert t.last_dropped == [3, 4] and sorted(t.entries) == [1, 5, 6]
    assert t.insert([3], [1]) == [(3, 1)] and t.last_dropped == [5]  # 3 back with one use, not two
    assert t.uses == {1: 2, 6: 1, 3: 1}
    assert t.insert([7], [2]) == [(7, 2)] and t.last_dropped == [6, 3]  # a 2-block entry drops two
    assert t.uses == {1: 2, 7: 1} and t.used_blocks == 3
    t.check()


def test_the_global_pool_evicts_lfu_too():
    pool = GlobalPool(2, eviction="lfu")
    pool.publish([1, 2], [1, 1], node=0)
    pool.touch([1])
    assert pool.publish([3], [1], node=1) == [(3, 1)] and pool.last_dropped == [2]
    assert pool.home[3] == 1 and sorted(pool.entries) == [1, 3]
    pool.check()


def test_lfu_matches_a_brute_force_lfu_on_random_operations():
    """The O(1) buckets against a reference that scans for (fewest uses, least recent use)."""
    import random

    rng = random.Random(7)
    t = HostTier(12, eviction="lfu")
    ref: dict[int, list[int]] = {}  # key -> [uses, last use, blocks]
    clock = 0
    for _ in range(3000):
        clock += 1
        if ref and rng.random() < 0.4:
            k = rng.choice(sorted(ref))
            t.touch([k])
            ref[k][0] += 1
            ref[k][1] = clock
        else:
            k, size = rng.randrange(40), rng.randrange(1, 5)
            t.insert([k], [size])
            if k in ref:
                ref[k][0] += 1
                ref[k][1] = clock
            else:
                expect = []
                while sum(v[2] for v in ref.values()) + size > 12:
                    victim = min(ref, key=lambda x: (ref[x][0], ref[x][1]))
                    expect.append(victim)
                    del ref[victim]
                ref[k] = [1, clock, size]
                assert t.last_dropped == expect
        assert {k: v[0] for k, v in ref.items()} == t.uses
        t.check()


H_PREFIX, COLD_1, COLD_2 = list(range(20)), list(range(100, 120)), list(range(200, 220))
HOT_THEN_SCAN = make_workload(
    [0.0, 1.0, 2.0, 3.0, 4.0],
    [320] * 5,
    [1] * 5,
    hash_ids=[H_PREFIX, H_PREFIX, COLD_1, COLD_2, H_PREFIX],
    block_tokens=16,
)


@pytest.mark.parametrize("ff", [True, False])
def test_an_lfu_pool_keeps_a_hot_prefix_through_a_scan_that_lru_loses_it_to(ff):
    """Two nodes of one GPU (22 HBM blocks each: a request's 20 blocks evict the one before), a pool
    of 40 blocks, round robin. The hot prefix H is computed on node 0 (20 entries published, one use
    each), fetched by node 1 (19 entries touched, then all 20 published again: 2-3 uses); the cold
    prompts C1 (node 0) and C2 (node 1) fill the pool, and C2's 20 entries must drop 20. LRU drops
    H's, touched before C1 came in; LFU drops C1's, used once. H again on node 0 (2 of its blocks
    left in HBM): with LFU the other 17 come from the pool (304 tokens cached); with LRU they are
    recomputed, and republishing them drops 18 of C1's entries."""
    got = {}
    for eviction in ("lru", "lfu"):
        sc = small_scenario(
            num_blocks=22,
            cluster={"nodes": 2, "router": "round_robin"},
            kv={
                "prefix_cache": {
                    "scope": "global",
                    "fetch": "always",
                    "pool_bytes": 20 * BLOCK,
                    "pool_eviction": eviction,
                }
            },
            sim={"seed": 1, "fast_forward": ff},
        )
        res = krun.run_scenario(sc, workload=HOT_THEN_SCAN)
        assert [s.replica for s in res.seqs] == [0, 1, 0, 1, 0]
        gp = res.summary["global_pool"]
        assert gp["eviction"] == eviction
        got[eviction] = ([s.num_cached_tokens for s in res.seqs], gp["dropped_bytes"], gp["hit_rate_global"])
    assert got["lru"] == ([0, 304, 0, 0, 32], 38 * BLOCK, 304 / 1600)
    assert got["lfu"] == ([0, 304, 0, 0, 304], 20 * BLOCK, (304 + 272) / 1600)


@pytest.mark.parametrize("ff", [True, False])
def test_an_lfu_host_tier_keeps_a_hot_prefix_through_a_scan_that_lru_loses_it_to(ff):
    """The same story in one node's DRAM (write-through, 40 blocks), shared by its two replicas (one
    GPU each, 22 HBM blocks), round robin: H written by replica 0, loaded whole by replica 1 (its 19
    entries touched, the 20th written again: two uses each), C1 and C2 written; C2's 20 blocks
    drop H under LRU (last used before C1 came in), C1 under LFU (one use). H again on replica 0:
    LFU loads 17 entries (2 still in HBM), LRU recomputes and writes 18 again (dropping C1's)."""
    got = {}
    for eviction in ("lru", "lfu"):
        sc = small_scenario(
            num_blocks=22,
            cluster={"gpus_per_node": 2, "router": "round_robin"},
            kv={
                "offload": {
                    "enabled": True,
                    "write": "through",
                    "host_bytes": 40 * BLOCK,
                    "eviction": eviction,
                }
            },
            sim={"seed": 1, "fast_forward": ff},
        )
        res = krun.run_scenario(sc, workload=HOT_THEN_SCAN)
        assert [s.replica for s in res.seqs] == [0, 1, 0, 1, 0]
        off = res.summary["offload"]
        assert off["eviction"] == eviction
        got[eviction] = (
            [s.num_cached_tokens for s in res.seqs],
            off["loads"],
            off["loaded_tokens"],
            off["written_bytes"],
            off["dropped_bytes"],
        )
    assert got["lru"] == ([0, 304, 0, 0, 32], 1, 304, (20 + 20 + 20 + 18) * BLOCK, (20 + 18) * BLOCK)
    assert got["lfu"] == ([0, 304, 0, 0, 304], 2, 304 + 272, (20 + 20 + 20) * BLOCK, 20 * BLOCK)


# ---- DRAM as a second-level prefix cache --------------------------------------------------------------
IDS_A = list(range(20))
STORY = make_workload(
    [0.0, 1.0, 10.0],
    [320, 624, 320],
    [1, 1, 1],
    hash_ids=[IDS_A, list(range(1000, 1039)), IDS_A],
    block_tokens=16,
)


def _story(ff: bool = True, **offload):  # type: ignore[no-untyped-def]
    sc = small_scenario(
        num_blocks=40, kv={"offload": {"enabled": True, **offload}}, sim={"seed": 1, "fast_forward": ff}
    )
    return sc, krun.run_scenario(sc, workload=STORY)


@pytest.mark.parametrize("ff", [True, False])
def test_blocks_written_back_to_dram_and_evicted_from_hbm_are_loaded_before_the_prefill(ff):
    """A (20 blocks) finishes and is cached; B (39 blocks) evicts A's entries 19..1 from HBM (tail
    first), which are written back to DRAM; C, A's prompt again, hits entry 0 in HBM and 1..18 in
    DRAM (at least one token is computed: 19 of its 20 blocks count), waits for the 18 blocks over
    the idle H2D link, then prefills its last 16 tokens on 304 cached ones."""
    sc, res = _story(ff)
    c = res.seqs[2]
    h2d = sc.cluster.topology.host_h2d
    load = transfer_time(18 * BLOCK, h2d)
    prefill = krun.make_cost_model(sc).price(ForwardBatch.prefill(16, 304)).seconds
    assert c.num_cached_tokens == 304
    assert c.first_scheduled_s == 10.0
    assert c.first_token_s == pytest.approx(10.0 + load + prefill, rel=1e-12)
    off = res.summary["offload"]
    assert off["loads"] == 1 and off["loaded_tokens"] == 18 * 16
    assert off["loaded_bytes"] == 18 * BLOCK
    prompts = 320 + 624 + 320
    assert off["hit_rate_dram"] == 18 * 16 / prompts
    assert off["hit_rate_hbm"] == pytest.approx(16 / prompts, rel=1e-12)
    assert off["hit_rate_hbm"] + off["hit_rate_dram"] == pytest.approx(res.summary["prefix_hit_rate"])
    assert off["requests_waited"] == 1
    assert off["kv_wait_s"]["p50"] == pytest.approx(load, rel=1e-9)
    # Write-back: B's admission evicted A's 19 entries; C's admission 18 of B's, its prefill one more.
    assert off["written_bytes"] == (19 + 18 + 1) * BLOCK
    links = {r["name"]: r for r in res.summary["links"]}
    assert links["node0/host_h2d/0"]["bytes"] == 18 * BLOCK
    assert links["node0/host_d2h/0"]["transfers"] == 3


def test_without_offload_the_same_request_recomputes_and_the_summary_has_no_offload_part():
    sc = small_scenario(num_blocks=40)
    res = krun.run_scenario(sc, workload=STORY)
    assert res.seqs[2].num_cached_tokens == 16  # only entry 0 is left in HBM
    assert res.summary["offload"] is None


def test_write_through_copies_every_new_entry_and_per_block_copies_cost_more():
    _, back = _story()
    _, through = _story(write="through")
    _, per_block = _story(write="through", copy="per_block")
    # Through: A's 20 entries at registration and B's 39; C's are all in DRAM already.
    assert through.summary["offload"]["written_bytes"] == (20 + 39) * BLOCK
    t = [r.seqs[2].first_token_s for r in (back, through, per_block)]
    assert t[0] == t[1]  # the same load: A's entries were in DRAM either way
    assert t[2] - t[1] == pytest.approx(17 * 2.3e-6, rel=1e-6)  # 18 copy calls instead of 1


@pytest.mark.parametrize("ff", [True, False])
def test_a_write_back_in_flight_is_a_miss_and_a_hit_once_it_lands(ff: bool):
    """C arrives right after B's admission wrote A's entries back over a slow D2H link: admitted
    when B finishes, before the write has landed, it finds nothing in DRAM (a store in flight is no
    hit, as in vLLM's OffloadingConnector, LMCache and Mooncake) and prefills; arriving just after
    the write lands, it loads A's entries."""
    sc = small_scenario(
        num_blocks=40,
        kv={"offload": {"enabled": True}},
        cluster={"topology": {"pcie": {"d2h": "1GB/s"}}},
        sim={"seed": 1, "fast_forward": ff},
    )
    write_end = 1.0 + transfer_time(19 * BLOCK, sc.cluster.topology.host_d2h)
    early = dataclasses.replace(STORY, arrival_s=STORY.arrival_s.copy())
    early.arrival_s[2] = 1.0 + 1e-9  # B is admitted at 1.0 and its write-back takes 19 x 2 MiB at 1 GB/s
    res = krun.run_scenario(sc, workload=early)
    c = res.seqs[2]
    assert c.first_scheduled_s == res.seqs[1].finish_s < write_end  # admitted once B's blocks are free
    off = res.summary["offload"]
    assert (off["loads"], off["hit_rate_dram"], c.num_cached_tokens) == (0, 0.0, 16)  # 1 block in HBM
    late = dataclasses.replace(STORY, arrival_s=STORY.arrival_s.copy())
    late.arrival_s[2] = write_end + 1e-6
    res = krun.run_scenario(sc, workload=late)
    c = res.seqs[2]
    off = res.summary["offload"]
    assert off["loads"] == 1 and c.num_cached_tokens == 19 * 16  # the HBM block and 18 loaded
    assert off["kv_wait_s"]["p50"] == pytest.approx(
        transfer_time(18 * BLOCK, sc.cluster.topology.host_h2d), rel=1e-9
    )


def _mooncake(n: int):  # type: ignore[no-untyped-def]
    from kvsim.spec.scenario import scenario_from_dict
    from kvsim.spec.workload import load_workload
    from tests.helpers import ROOT

    trace = {
        "trace": "scenarios/traces/mooncake/conversation_trace.jsonl",
        "format": "mooncake",
        "max_requests": n,
    }
    wsc = scenario_from_dict(
        {"model": "llama-3.1-8b", "cluster": {"gpu": "h100"}, "workload": trace},
        source="t.yaml",
        base_dir=ROOT,
    )
    return load_workload(wsc.workload, seed=1)


@pytest.mark.parametrize("write", ["back", "through"])
def test_fast_forward_equals_stepping_with_offload_on_under_memory_pressure(write):
    """400 Mooncake requests on 4,000 blocks: evictions, write-backs, loads, preemptions."""
    wl = _mooncake(400)
    runs = []
    for ff in (True, False):
        sc = small_scenario(
            num_blocks=4000,
            scheduler={"max_batched_tokens": 2048},
            kv={"offload": {"enabled": True, "write": write, "host_bytes": "20GiB"}},
            sim={"seed": 1, "fast_forward": ff},
        )
        runs.append(krun.run_scenario(sc, workload=wl))
    a, b = runs
    assert records(a) == records(b)
    assert a.summary["offload"] == b.summary["offload"]
    assert a.summary["offload"]["loads"] > 10 and a.summary["preemptions"] > 0
    assert a.summary["offload"]["dropped_bytes"] > 0  # the tier filled: LRU dropped entries
    assert a.summary["engine_events"] < b.summary["engine_events"]


def test_host_tier_larger_than_the_node_dram_is_refused():
    sc = small_scenario(
        num_blocks=40, kv={"offload": {"enabled": True, "hbm_ratio": 1e4}}, cluster={"host_dram": "1GiB"}
    )
    with pytest.raises(KvsimError, match="exceeds the node's host DRAM"):
        krun.run_scenario(sc, workload=STORY)


# ---- swap preemption ----------------------------------------------------------------------------------
SWAP = make_workload([0.0, 0.05], [160, 160], [300, 300])


@pytest.mark.parametrize("ff", [True, False])
def test_a_swapped_out_request_resumes_with_its_kv_intact(ff, monkeypatch):
    """Two decoders outgrow 30 blocks: B (the newest) is swapped out, its computed blocks copied to
    host memory; when A finishes, B is swapped back in over the idle H2D link and decodes on from
    where it stopped: no prefill again, its finish exactly load + its remaining decode steps."""
    import numpy as np

    from kvsim.core.sched.scheduler import Scheduler

    seen: list[tuple[int, int, int]] = []
    orig = Scheduler._preempt

    def spy(self, req):  # type: ignore[no-untyped-def]
        seen.append((req.id, req.num_computed, req.num_generated))
        orig(self, req)

    monkeypatch.setattr(Scheduler, "_preempt", spy)
    sc = small_scenario(num_blocks=30, scheduler={"preemption": "swap"}, sim={"seed": 1, "fast_forward": ff})
    res = krun.run_scenario(sc, workload=SWAP)
    a, b = res.seqs
    ((vid, c, g),) = seen
    assert vid == 1 and b.preemptions == 1 and b.status.value == "completed"
    blocks = -(-c // 16)
    load_end = a.finish_s + transfer_time(blocks * BLOCK, sc.cluster.topology.host_h2d)
    steps = krun.make_cost_model(sc).decode_step_times(1, np.arange(c, c + 300 - g, dtype=np.int64))
    assert b.finish_s == pytest.approx(load_end + float(steps.sum()), rel=1e-12)
    sw = res.summary["swap"]
    assert (sw["swaps"], sw["recomputes"], sw["swapped_bytes"]) == (1, 0, blocks * BLOCK)
    assert res.summary["offload"] is None


def test_swap_and_recompute_agree_on_everything_but_the_resumed_request():
    rec = krun.run_scenario(small_scenario(num_blocks=30), workload=SWAP)
    swp = krun.run_scenario(small_scenario(num_blocks=30, scheduler={"preemption": "swap"}), workload=SWAP)
    assert rec.seqs[0].finish_s == swp.seqs[0].finish_s
    assert rec.summary["swap"] is None and rec.summary["links"] == []
    assert swp.seqs[1].finish_s != rec.seqs[1].finish_s


def test_auto_recomputes_when_the_host_link_is_slower_than_the_prefill():
    slow = {"topology": {"pcie": {"bw": "10MB/s"}}}
    res = krun.run_scenario(
        small_scenario(num_blocks=30, scheduler={"preemption": "auto"}, cluster=slow), workload=SWAP
    )
    assert (res.summary["swap"]["swaps"], res.summary["swap"]["recomputes"]) == (0, 1)
    fast = krun.run_scenario(small_scenario(num_blocks=30, scheduler={"preemption": "auto"}), workload=SWAP)
    assert fast.summary["swap"]["swaps"] == 1


def test_a_victim_that_does_not_fit_the_swap_space_is_recomputed():
    res = krun.run_scenario(
        small_scenario(num_blocks=30, scheduler={"preemption": "swap", "swap_space": "4MiB"}), workload=SWAP
    )
    assert (res.summary["swap"]["swaps"], res.summary["swap"]["recomputes"]) == (0, 1)


@pytest.mark.parametrize("ff", [True, False])
def test_a_swapped_request_that_needs_the_whole_pool_swaps_back_in_once_it_is_alone(ff):
    """Two requests share a 12-block prompt in a 13-block pool: the second, swapped out, needs all 13
    blocks to resume. The swap-in watermark (1% and at least one block) is waived once nothing else
    runs or loads, else it would wait forever (found by the engine property test)."""
    import numpy as np

    ids = [np.arange(1_000_000, 1_000_012)] * 2
    wl = make_workload([0.0, 0.0], [192, 192], [4, 2], hash_ids=ids, block_tokens=16)
    sc = small_scenario(
        num_blocks=13,
        scheduler={"preemption": "swap", "max_num_seqs": 2, "max_batched_tokens": 16},
        sim={"fast_forward": ff},
    )
    res = krun.run_scenario(sc, workload=wl)
    assert res.summary["requests"]["unfinished"] == 0
    assert res.summary["requests"]["completed"] == 2
    assert res.summary["swap"]["swaps"] == 1


# ---- the global prefix pool ---------------------------------------------------------------------------
POOLED = make_workload([0.0, 1.0], [320, 320], [1, 1], hash_ids=[IDS_A, IDS_A], block_tokens=16)


@pytest.mark.parametrize("ff", [True, False])
@pytest.mark.parametrize("fetch", ["auto", "always"])
def test_a_prefix_only_in_the_global_pool_is_fetched_over_the_network_and_only_the_rest_prefilled(ff, fetch):
    """Two nodes of one GPU, round robin: A computes its 20 blocks on node 0, which publishes them to
    the pool (homed on node 0); B, the same prompt on node 1, finds nothing in its HBM, fetches 19
    blocks from node 0 over its idle NIC (5 us + 2.3 us + bytes / 50 GB/s) and prefills 16 tokens."""
    sc = small_scenario(
        num_blocks=40,
        cluster={"nodes": 2, "router": "round_robin"},
        kv={"prefix_cache": {"scope": "global", "fetch": fetch}},
        sim={"seed": 1, "fast_forward": ff},
    )
    res = krun.run_scenario(sc, workload=POOLED)
    a, b = res.seqs
    assert (a.replica, b.replica) == (0, 1)
    net = sc.cluster.topology.network
    fetch_s = transfer_time(19 * BLOCK, net)
    assert fetch_s == 5e-6 + 2.3e-6 + 19 * BLOCK / 50e9
    prefill = krun.make_cost_model(sc).price(ForwardBatch.prefill(16, 304)).seconds
    assert b.num_cached_tokens == 304
    assert b.first_token_s == pytest.approx(1.0 + fetch_s + prefill, rel=1e-12)
    gp = res.summary["global_pool"]
    assert gp["hit_rate_global"] == 304 / 640
    assert gp["remote_bytes"] == gp["fetched_bytes"] == 19 * BLOCK
    assert gp["published_bytes"] == 20 * BLOCK  # A's 20 entries; B's last one was in the pool
    links = {r["name"]: r for r in res.summary["links"]}
    assert links["node1/network/0"]["bytes"] == 19 * BLOCK
    assert links["node0/network_out/0"]["bytes"] == 19 * BLOCK  # the home node's NIC sends them
    assert res.summary["offload"] is None


def test_two_nodes_fetching_from_one_home_at_once_queue_on_its_nic_egress():
    """Three nodes: A computes on node 0 (the home); B and C, A's prompt, arrive together on nodes 1
    and 2 and fetch 19 blocks each: both reads leave through node 0's NIC, so the second starts
    when the first ends there, a whole transfer later."""
    wl = make_workload([0.0, 1.0, 1.0], [320] * 3, [1] * 3, hash_ids=[IDS_A] * 3, block_tokens=16)
    sc = small_scenario(
        num_blocks=40,
        cluster={"nodes": 3, "router": "round_robin"},
        kv={"prefix_cache": {"scope": "global", "fetch": "always"}},
    )
    res = krun.run_scenario(sc, workload=wl)
    a, b, c = res.seqs
    assert (a.replica, b.replica, c.replica) == (0, 1, 2)
    hold = 2.3e-6 + 19 * BLOCK / 50e9
    prefill = krun.make_cost_model(sc).price(ForwardBatch.prefill(16, 304)).seconds
    assert b.first_token_s == pytest.approx(1.0 + hold + 5e-6 + prefill, rel=1e-12)
    assert c.first_token_s == pytest.approx(1.0 + 2 * hold + 5e-6 + prefill, rel=1e-12)
    links = {r["name"]: r for r in res.summary["links"]}
    assert links["node0/network_out/0"]["transfers"] == 2
    assert links["node0/network_out/0"]["queued_s"] == pytest.approx(hold, rel=1e-12)
    assert links["node2/network/0"]["queued_s"] == pytest.approx(hold, rel=1e-12)


def test_auto_recomputes_a_remote_prefix_over_a_slow_network():
    slow = {"nodes": 2, "router": "round_robin", "topology": {"network": {"bw": "100MB/s"}}}
    sc = small_scenario(num_blocks=40, cluster=slow, kv={"prefix_cache": {"scope": "global"}})
    res = krun.run_scenario(sc, workload=POOLED)
    assert res.seqs[1].num_cached_tokens == 0  # fetching 2 MiB at 100 MB/s loses to recomputing 16 tokens
    assert res.summary["global_pool"]["declined_lookups"] > 0
    always = small_scenario(
        num_blocks=40, cluster=slow, kv={"prefix_cache": {"scope": "global", "fetch": "always"}}
    )
    assert krun.run_scenario(always, workload=POOLED).seqs[1].num_cached_tokens == 304


def test_without_the_global_pool_the_other_node_recomputes():
    sc = small_scenario(num_blocks=40, cluster={"nodes": 2, "router": "round_robin"})
    res = krun.run_scenario(sc, workload=POOLED)
    assert res.seqs[1].num_cached_tokens == 0 and res.summary["global_pool"] is None


# ---- the cache-aware router ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("decode", "expected"),
    [
        (180, {"cache_aware": 0, "least_outstanding_tokens": 1, "prefix_affinity": 0}),
        (4000, {"cache_aware": 1, "least_outstanding_tokens": 1, "prefix_affinity": 0}),
    ],
)
def test_cache_aware_router_weighs_prefix_hits_against_load(decode, expected):
    """Replica 0 caches A's 20 blocks, then decodes D (a short decode, or a long one). B, A's prompt,
    costs 16 tokens on replica 0 against 320 on replica 1: the cache-aware router sends it to 0
    while 0's outstanding tokens are below the 304 it saves (unlike least outstanding tokens), and
    to 1 once they are not (unlike prefix affinity)."""
    wl = make_workload(
        [0.0, 0.5, 1.0], [320, 16, 320], [1, decode, 1], hash_ids=[IDS_A, [500], IDS_A], block_tokens=16
    )
    for router, replica in expected.items():
        sc = small_scenario(num_blocks=400, cluster={"gpus_per_node": 2, "router": router})
        b = krun.run_scenario(sc, workload=wl).seqs[2]
        assert b.replica == replica, router
        assert b.num_cached_tokens == (304 if replica == 0 else 0)


def test_cache_aware_router_counts_a_global_pool_hit_at_its_load_price():
    """Two nodes: A computed on node 0 and published. A request for A's prompt scores its lookups
    on node 1 at the pool's fetch price, below a cold replica's full prefill."""
    sc = small_scenario(
        num_blocks=40, cluster={"nodes": 2, "router": "cache_aware"}, kv={"prefix_cache": {"scope": "global"}}
    )
    env_res = krun.run_scenario(sc, workload=POOLED)
    b = env_res.seqs[1]
    assert b.replica == 0 and b.num_cached_tokens == 304  # HBM hits beat the pool's fetch


@pytest.mark.parametrize(("network", "replica"), [("50GB/s", 1), ("200MB/s", 0)])
def test_cache_aware_router_prices_a_remote_pool_hit_at_the_networks_rate(network, replica):
    """Two nodes: A computed on node 0 and published (homed on node 0), then D decodes 180 tokens
    on node 0. B, A's prompt, costs 16 tokens plus D's outstanding ones on node 0, or a fetch of A's
    19 blocks from node 0 over node 1's NIC: cheap at 50 GB/s (B goes to node 1), slower than
    recomputing at 200 MB/s (`fetch: always`, so the fetch is still taken where B goes): B stays
    on node 0. A remote hit was weighed at the host link's rate before, and went to node 1 both times."""
    wl = make_workload(
        [0.0, 0.5, 1.0], [320, 16, 320], [1, 180, 1], hash_ids=[IDS_A, [500], IDS_A], block_tokens=16
    )
    cluster = {"nodes": 2, "router": "cache_aware", "topology": {"network": {"bw": network}}}
    sc = small_scenario(
        num_blocks=400, cluster=cluster, kv={"prefix_cache": {"scope": "global", "fetch": "always"}}
    )
    b = krun.run_scenario(sc, workload=wl).seqs[2]
    assert b.replica == replica and b.num_cached_tokens == 304  # from HBM on node 0, the pool on node 1


# ---- scenarios and the report -------------------------------------------------------------------------
def test_the_comparison_scenarios_validate():
    from kvsim.spec.scenario import load_scenario
    from tests.helpers import ROOT

    paths = sorted((ROOT / "scenarios/tiers").glob("*.yaml"))
    assert len(paths) >= 12
    for p in paths:
        load_scenario(p)


def test_the_report_shows_the_memory_tiers_only_when_they_are_on(tmp_path):
    from kvsim.report import write_report

    _, res = _story()
    krun.write_run(res, tmp_path / "on")
    page = write_report(tmp_path / "on").read_text()
    assert "Memory tiers and links" in page and "node0/host_h2d/0" in page and "host DRAM (this node)" in page
    assert 'id="kvsim-tiers"' in page and 'id="kvsim-links"' in page  # from tiers.csv and links.csv
    links = (tmp_path / "on" / "links.csv").read_text().splitlines()
    assert links[0] == "t_s,link,bytes,busy_s"
    last = {ln.split(",")[1]: float(ln.split(",")[2]) for ln in links[1:]}
    assert last["node0/host_h2d/0"] == 18 * BLOCK  # sampled once C was admitted: its load asked for
    assert last["node0/host_d2h/0"] == (19 + 18) * BLOCK
    rows = (tmp_path / "on" / "tiers.csv").read_text().splitlines()
    assert (
        rows[0] == "t_s,tier,used_bytes" and rows[-1] == f"10.0,node0/dram,{(19 + 18) * BLOCK}"
    )  # sampled after C was admitted to load
    for out in (tmp_path / "off", tmp_path / "on"):  # a run without tiers leaves no tiers.csv behind
        krun.write_run(krun.run_scenario(small_scenario(num_blocks=40), workload=STORY), out)
        assert not (out / "tiers.csv").exists() and not (out / "links.csv").exists()
        assert "Memory tiers and links" not in write_report(out).read_text()


# ---- the SSD tier and the cold threshold ---------------------------------------------------------------
@pytest.mark.parametrize("ff", [True, False])
def test_entries_dram_drops_are_demoted_to_ssd_and_loaded_back_through_dram(ff):
    """A DRAM tier of 5 blocks: of A's 19 entries written back at B's admission (19 first, 1 last),
    DRAM keeps 5..1 and demotes 19..6 to the SSD. C loads 1..5 from DRAM over H2D and 6..18 from the
    SSD (a read at 13 GB/s + 100 us, then H2D behind the first transfer), then prefills 16 tokens."""
    sc = small_scenario(
        num_blocks=40,
        kv={"offload": {"enabled": True, "host_bytes": 5 * BLOCK, "ssd": {"capacity": "1GiB"}}},
        sim={"seed": 1, "fast_forward": ff},
    )
    res = krun.run_scenario(sc, workload=STORY)
    c = res.seqs[2]
    h2d = sc.cluster.topology.host_h2d
    dram_end = 10.0 + (h2d.per_call_overhead_s + 5 * BLOCK / h2d.bw_bytes_per_s)
    read_end = 10.0 + 13 * BLOCK / 13e9 + 100e-6
    start = max(read_end, dram_end)
    end = max(dram_end, start + h2d.per_call_overhead_s + 13 * BLOCK / h2d.bw_bytes_per_s)
    prefill = krun.make_cost_model(sc).price(ForwardBatch.prefill(16, 304)).seconds
    assert c.num_cached_tokens == 304
    assert c.first_token_s == pytest.approx(end + prefill, rel=1e-12)
    off = res.summary["offload"]
    prompts = 320 + 624 + 320
    assert off["hit_rate_ssd"] == 13 * 16 / prompts and off["hit_rate_dram"] == 5 * 16 / prompts
    assert off["ssd_loaded_bytes"] == 13 * BLOCK
    links = {r["name"]: r for r in res.summary["links"]}
    assert links["node0/ssd_read/0"]["bytes"] == 13 * BLOCK


@pytest.mark.parametrize("ff", [True, False])
def test_a_cached_entry_untouched_for_cold_after_steps_moves_down_to_dram(ff):
    """A's 20 entries are released at step 1; D decodes for 200 steps, so at the schedule of step
    52 they have gone 50 steps untouched and move to DRAM (write-back). C, A's prompt again, finds
    none in HBM and loads 19 from DRAM."""
    wl = make_workload(
        [0.0, 0.5, 10.0], [320, 16, 320], [1, 200, 1], hash_ids=[IDS_A, [500], IDS_A], block_tokens=16
    )
    sc = small_scenario(
        num_blocks=400,
        kv={"offload": {"enabled": True, "cold_after_steps": 50}},
        sim={"seed": 1, "fast_forward": ff},
    )
    res = krun.run_scenario(sc, workload=wl)
    c = res.seqs[2]
    load = transfer_time(19 * BLOCK, sc.cluster.topology.host_h2d)
    prefill = krun.make_cost_model(sc).price(ForwardBatch.prefill(16, 304)).seconds
    assert c.num_cached_tokens == 304
    assert c.first_token_s == pytest.approx(10.0 + load + prefill, rel=1e-12)
    off = res.summary["offload"]
    assert off["cold_demoted_bytes"] == 20 * BLOCK
    assert off["hit_rate_hbm"] == 0.0
    warm = krun.run_scenario(small_scenario(num_blocks=400, kv={"offload": {"enabled": True}}), workload=wl)
    assert warm.summary["offload"]["loads"] == 0  # without the threshold A's entries stay in HBM


@pytest.mark.parametrize("ff", [True, False])
def test_an_overlapped_load_costs_only_what_exceeds_the_prefill(ff):
    """``load: overlap``: C's 18-block load hides behind its 16-token prefill, so its first token
    comes at the later of the two, not after both; over a slow link the load's excess shows."""
    for bw, pcie in ((35.2e9, {}), (1e9, {"topology": {"pcie": {"h2d": "1GB/s"}}})):
        sc = small_scenario(
            num_blocks=40,
            cluster=pcie,
            kv={"offload": {"enabled": True, "load": "overlap"}},
            sim={"seed": 1, "fast_forward": ff},
        )
        res = krun.run_scenario(sc, workload=STORY)
        c = res.seqs[2]
        assert sc.cluster.topology.host_h2d.bw_bytes_per_s == bw
        load = transfer_time(18 * BLOCK, sc.cluster.topology.host_h2d)
        cost = krun.make_cost_model(sc)
        hidden = cost.price(ForwardBatch.prefill(16, 304, sampling=False)).seconds
        prefill = cost.price(ForwardBatch.prefill(16, 304)).seconds
        start = max(10.0, 10.0 + load - hidden)
        assert c.first_token_s == pytest.approx(start + prefill, rel=1e-12)
        assert c.num_cached_tokens == 304


def test_fast_forward_equals_stepping_with_every_tier_on_across_nodes():
    """400 Mooncake requests on 2 nodes x 2 replicas of 2,000 blocks, cache-aware routing: write-back
    DRAM with an SSD below, a cold threshold, overlapped loads, swap preemption and the global pool.
    64 GiB of DRAM a node (4 GiB held no more than a replica's HBM: loads, only of entries whose write
    had landed, fell to 0-1 as step prices moved; 64 GiB gives about 30)."""
    wl = _mooncake(400)
    runs = []
    for ff in (True, False):
        sc = small_scenario(
            num_blocks=2000,
            scheduler={"max_batched_tokens": 2048, "preemption": "auto"},
            cluster={"nodes": 2, "gpus_per_node": 2, "router": "cache_aware"},
            kv={
                "prefix_cache": {"scope": "global", "pool_bytes": "8GiB"},
                "offload": {
                    "enabled": True,
                    "host_bytes": "64GiB",
                    "load": "overlap",
                    "cold_after_steps": 200,
                    "ssd": {"capacity": "16GiB"},
                },
            },
            sim={"seed": 1, "fast_forward": ff},
        )
        runs.append(krun.run_scenario(sc, workload=wl))
    a, b = runs
    assert records(a) == records(b)
    for part in ("offload", "swap", "global_pool", "links"):
        assert a.summary[part] == b.summary[part], part
    off, gp = a.summary["offload"], a.summary["global_pool"]
    assert off["loads"] > 0 and off["ssd_written_bytes"] > 0 and off["cold_demoted_bytes"] > 0
    # The pool's few hits on this trace come right after their publication, still in flight: misses
    # (a store in flight is no hit); the pool tests fetch landed entries.
    assert gp["published_bytes"] > 0 and gp["fetched_tokens"] == 0
    r = a.summary["requests"]
    assert r["unfinished"] == 0 and r["completed"] + r["rejected"] == 400  # every request accounted for
    assert set(r["rejected_reasons"]) <= {"needs more KV blocks than a replica has"}
    assert a.summary["engine_events"] < b.summary["engine_events"]


def test_the_terminal_summary_has_a_tier_line_only_when_a_tier_is_on():
    from kvsim.render import _tiers_line

    _, res = _story()
    prompts = 320 + 624 + 320
    line = _tiers_line(res.record)
    assert line == (
        f"prefix hits HBM {16 / prompts:.1%}, DRAM {288 / prompts:.1%}; "
        f"1 requests waited for KV (p50 {transfer_time(18 * BLOCK, res.scenario.cluster.topology.host_h2d) * 1e3:,.1f} ms)"
    )
    assert _tiers_line(krun.run_scenario(small_scenario(num_blocks=40), workload=STORY).record) == ""

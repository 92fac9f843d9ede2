"""KV events (``kvsim run --kv-events``): vLLM's schema, exact stories, the cache rebuilt from them."""

from __future__ import annotations

import json

import pytest

from kvsim.core.block_hash import private_key
from kvsim.core.block_pool import BlockPool
from kvsim.run import run_scenario
from kvsim.sim.cluster import make_pool_and_scheduler
from kvsim.sim.kv_events import KVEventLog, cache_state, read_kv_events
from tests.helpers import make_workload, records, small_scenario
from tests.test_engine import _comparable
from tests.test_offload import _mooncake


def _stored(hashes, parent, block_size):  # type: ignore[no-untyped-def]
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": [],
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
    }


def test_two_requests_sharing_a_prefix_give_exact_events(tmp_path):
    """A (1100 tokens, trace blocks 1 2 3 of 512) caches its 68 full blocks as entries 1, 2 (32
    blocks each) and 3 (4) when scheduled, and at its finish its one full answer block under a key
    of its own; B (1 2 4) hits 1 and 2 and caches entry 4 (17 blocks) after 2."""
    sc = small_scenario()
    wl = make_workload([0.0, 10.0], [1100, 1300], [5, 5], hash_ids=[[1, 2, 3], [1, 2, 4]], block_tokens=512)
    log = KVEventLog(sc.kv.block_size)
    res = run_scenario(sc, workload=wl, kv_events=log)
    a = res.seqs[0]
    path = tmp_path / "ev.jsonl"
    assert log.write(path) == 3
    assert list(read_kv_events(path)) == [
        {"ts": 0.0, "events": [_stored([1, 2], None, 512), _stored([3], 2, 64)], "data_parallel_rank": 0},
        {"ts": a.finish_s, "events": [_stored([private_key(0, 68)], 3, 16)], "data_parallel_rank": 0},
        {"ts": 10.0, "events": [_stored([4], 2, 272)], "data_parallel_rank": 0},
    ]


def test_a_registration_that_skips_a_cached_key_names_each_run_with_its_parent():
    pool = BlockPool(8)
    got = []
    pool.listen(got.append)
    pool.allocate(1)
    pool.register([2])
    pool.allocate(2)
    pool.register([1, 2, 3], None, 9)
    assert [(e.keys, e.parent) for e in got] == [((2,), None), ((1,), 9), ((3,), 2)]


def _final_state(scheds):  # type: ignore[no-untyped-def]
    """(rank, medium) -> what the simulator holds at the end: each HBM pool's cached entries, each
    node's DRAM and SSD entries (under the node's index)."""
    out = {}
    for i, s in enumerate(scheds):
        out[(i, "GPU")] = set(s.kv.pool.refs)
        port = s.host
        if port is not None and port.host is not None:
            out[(port.node, "CPU")] = set(port.host.entries)
            if port.ssd is not None:
                out[(port.node, "DISK")] = set(port.ssd.tier.entries)
    return {k: v for k, v in out.items() if v}


def _run(ff, tmp_path, **kv):  # type: ignore[no-untyped-def]
    scheds = []

    def make(*args, **kw):  # type: ignore[no-untyped-def]
        scheds.append(make_pool_and_scheduler(*args, **kw))
        return scheds[-1]

    sc = small_scenario(
        num_blocks=4000,
        cluster={"gpus_per_node": 2},
        scheduler={"max_batched_tokens": 2048},
        kv=kv,
        sim={"seed": 1, "fast_forward": ff},
    )
    log = KVEventLog(sc.kv.block_size)
    res = run_scenario(sc, workload=_mooncake(300), make_scheduler=make, kv_events=log)
    path = tmp_path / f"ev{int(ff)}.jsonl"
    log.write(path)
    return res, scheds, path


OFFLOAD = {"offload": {"enabled": True, "host_bytes": "3GiB", "ssd": {"capacity": "6GiB"}}}


@pytest.mark.parametrize("kv", [{}, OFFLOAD], ids=["hbm", "dram+ssd"])
def test_events_rebuild_every_cache_and_fast_forward_writes_the_same_file(tmp_path, kv):
    """300 Mooncake requests on two replicas of 4,000 blocks (evictions, preemptions, shared
    prefixes; with offload a node DRAM tier and SSD both replicas write): replaying the events
    gives what every pool and tier holds at the end, and both modes write the same lines."""
    ff, ff_scheds, ff_path = _run(True, tmp_path, **kv)
    st, st_scheds, st_path = _run(False, tmp_path, **kv)
    assert records(ff) == records(st)
    assert ff_path.read_bytes() == st_path.read_bytes()
    assert ff.summary["engine_events"] < st.summary["engine_events"]  # windows still ran
    assert ff.summary["prefix_cache_evictions"] > 0
    for scheds, path in ((ff_scheds, ff_path), (st_scheds, st_path)):
        state = {k: v for k, v in cache_state(read_kv_events(path), node_of=lambda r: 0).items() if v}
        assert state == _final_state(scheds)
    lines = [json.loads(x) for x in ff_path.read_text().splitlines()]
    kinds = {(e["type"], e["medium"]) for b in lines for e in b["events"]}
    want = {("BlockStored", "GPU"), ("BlockRemoved", "GPU")}
    if kv:
        want |= {("BlockStored", "CPU"), ("BlockRemoved", "CPU"), ("BlockStored", "DISK")}
    assert want <= kinds
    assert {b["data_parallel_rank"] for b in lines} == {0, 1}
    ts = [b["ts"] for b in lines]
    assert ts == sorted(ts)


def test_a_run_without_events_gives_the_same_results():
    sc = small_scenario(num_blocks=4000, scheduler={"max_batched_tokens": 2048})
    wl = _mooncake(200)
    plain = run_scenario(sc, workload=wl)
    logged = run_scenario(sc, workload=wl, kv_events=KVEventLog(16))
    assert records(plain) == records(logged)
    assert _comparable(plain.summary) == _comparable(logged.summary)  # (engine events, wall time aside)

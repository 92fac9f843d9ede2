"""Random checks of the link and tier invariants (`kvsim.sim.links`, `kvsim.sim.offload`): over
random topologies with links down to 1 MB/s, write-back and write-through DRAM, an SSD with a slow
write link, cold offload, the global pool (in the GPU nodes' DRAM or on pool nodes), swap and fair
sharing, in fast-forward and stepping: no link is busy longer than the run (utilisation <= 1), every
load reads only entries whose write has arrived, and the two modes agree."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvsim.run as krun
from kvsim.sim import offload as koff
from tests.helpers import draw_requests, make_workload, small_scenario
from tests.test_engine_properties import _check_invariants_and_fast_forward

SLOW = ["1MB/s", "100MB/s", "1GB/s", "35GB/s"]


@st.composite
def link_cases(draw):  # type: ignore[no-untyped-def]
    g = 16
    n = draw(st.integers(2, 14))
    arrivals, prompts, outputs, ids = draw_requests(draw, n, [0.0, 0.005, 0.05, 0.5], 500, 80)
    need = max(-(-(p + o) // g) for p, o in zip(prompts, outputs, strict=True))
    num_blocks = draw(st.integers(need, 2 * need))
    block = 16 * 131072  # a replica's block (tensor parallel 1)
    pool = draw(st.sampled_from(["none", "gpu_dram", "pool_nodes"]))
    fair = pool != "pool_nodes" and draw(st.booleans())
    topo: dict = {
        "pcie": {"h2d": draw(st.sampled_from(SLOW)), "d2h": draw(st.sampled_from(SLOW))},
        "network": {"bw": draw(st.sampled_from(SLOW))},
    }
    if fair:
        topo["sharing"] = "fair"
    cluster = {
        "nodes": draw(st.sampled_from([1, 2])),
        "gpus_per_node": draw(st.sampled_from([1, 2])),
        "router": draw(st.sampled_from(["round_robin", "prefix_affinity", "cache_aware"])),
        "topology": topo,
    }
    pc: dict = {"scope": "local"}
    if pool == "gpu_dram":
        pc = {"scope": "global", "pool_bytes": draw(st.sampled_from([2, 8, 64])) * block}
    elif pool == "pool_nodes":
        pc = {"scope": "global", "pool_nodes": 1, "pool_node_bytes": draw(st.sampled_from([2, 64])) * block}
    kv: dict = {"prefix_cache": pc}
    scheduler: dict = {
        "max_num_seqs": draw(st.sampled_from([2, 8, 64])),
        "max_batched_tokens": draw(st.sampled_from([64, 256, 2048])),
    }
    if pool == "none" or draw(st.booleans()):
        off: dict = {
            "enabled": True,
            "write": draw(st.sampled_from(["back", "through"])),
            "copy": draw(st.sampled_from(["batched", "per_block"])),
            "host_bytes": draw(st.sampled_from([2, 8, 64])) * block,
        }
        if not fair:
            off["load"] = draw(st.sampled_from(["stall", "overlap"]))
        if draw(st.booleans()):
            off["ssd"] = {
                "capacity": draw(st.sampled_from([4, 64])) * block,
                "write_bw": draw(st.sampled_from(SLOW)),
                "read_bw": draw(st.sampled_from(SLOW)),
            }
        if draw(st.booleans()):
            off["cold_after_steps"] = draw(st.sampled_from([1, 5, 50]))
        kv["offload"] = off
    if draw(st.booleans()):
        scheduler["preemption"] = draw(st.sampled_from(["swap", "auto"]))
        scheduler["swap_space"] = "64MiB"
    sc = small_scenario(num_blocks=num_blocks, scheduler=scheduler, cluster=cluster, kv=kv)
    return sc, make_workload(arrivals, prompts, outputs, hash_ids=ids, block_tokens=g)


def _readable_somewhere(port: koff.OffloadPort, k: int, now: float) -> bool:
    """A tier of `port` holds `k` and its write there has arrived by `now` (independent of
    `OffloadPort._source`: each tier and its ready map looked at directly)."""
    tiers = []
    if port.host is not None:
        tiers.append((port.host.entries, port.ready))
    if port.ssd is not None:
        tiers.append((port.ssd.tier.entries, port.ssd.ready))
    if port.glob is not None:
        tiers.append((port.glob.pool.entries, port.glob.ready))
    for entries, ready in tiers:
        if k in entries:
            a = ready.get(k)
            t = a if isinstance(a, float) or a is None else a.t
            if t is None and a is not None:
                continue  # a fair write not arrived yet
            if t is None or t <= now:
                return True
    return False


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=link_cases())
def test_links_busy_within_the_run_and_loads_read_only_arrived_entries(case):  # type: ignore[no-untyped-def]
    orig = koff.OffloadPort._load

    def checked_load(self, now, req, hits, n):  # type: ignore[no-untyped-def]
        for k in req.keys[hits : hits + n]:
            assert _readable_somewhere(self, k, now), f"entry {k} loaded at {now} before its write arrived"
        orig(self, now, req, hits, n)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(koff.OffloadPort, "_load", checked_load)
        a, b = _check_invariants_and_fast_forward(case)
    for key in ("offload", "swap", "links", "global_pool", "warnings"):
        assert a.summary[key] == b.summary[key], key
    for res in (a, b):
        span = res.summary["simulated_s"]
        for lk in res.summary["links"] or []:
            assert 0.0 <= lk["busy_s"] <= span * (1 + 1e-12), lk
            assert lk["utilization"] <= 1.0 + 1e-12, lk
            assert lk["backlog_s"] >= 0.0
        off = res.summary["offload"]
        if off is not None:
            assert off["written_bytes"] >= 0 and off["write_backlog_bytes"] >= 0


def test_an_overloaded_write_link_reports_its_backlog_not_a_utilisation_over_one():
    """Write-through of four 64-block prompts over a 100 MB/s D2H link: 512 MiB asked for in a run
    of well under 5 s; the link is busy at most the run, the rest is backlog."""
    wl = make_workload(
        [0.0, 0.01, 0.02, 0.03],
        [1024] * 4,
        [4] * 4,
        hash_ids=[list(range(i * 100, i * 100 + 64)) for i in range(4)],
        block_tokens=16,
    )
    for ff in (True, False):
        sc = small_scenario(
            num_blocks=600,
            kv={"offload": {"enabled": True, "write": "through"}},
            cluster={"topology": {"pcie": {"d2h": "100MB/s"}}},
            sim={"seed": 1, "fast_forward": ff},
        )
        res = krun.run_scenario(sc, workload=wl)
        (lk,) = [x for x in res.summary["links"] if "d2h" in x["name"]]
        span = res.summary["simulated_s"]
        # seconds of work asked for: the bytes, and 2.3 us per copy call (one per batched transfer)
        asked = 4 * 64 * 16 * 131072 / 100e6 + lk["transfers"] * 2.3e-6
        assert span < asked
        assert 0.5 * span < lk["busy_s"] <= span  # busy from the first prefill's end to the run's
        assert lk["busy_s"] + lk["backlog_s"] == pytest.approx(asked, rel=1e-6)
        off = res.summary["offload"]
        assert off["written_bytes"] + off["write_backlog_bytes"] == 4 * 64 * 16 * 131072
        assert off["written_bytes"] < 4 * 64 * 16 * 131072

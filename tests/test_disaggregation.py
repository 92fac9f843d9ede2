"""Disaggregated prefill and decode (``cluster.disaggregation``, `kvsim.sim.disagg`): the hand-off,
the KV transfer, the per-role summary, and fast-forward equal to stepping one by one."""

from __future__ import annotations

import dataclasses

import pytest

from kvsim.errors import KvsimError
from kvsim.run import run_scenario
from kvsim.spec.scenario import scenario_from_dict
from kvsim.spec.workload import load_workload
from tests.helpers import ROOT, make_workload, records

MOONCAKE = {
    "trace": "scenarios/traces/mooncake/conversation_trace.jsonl",
    "format": "mooncake",
    "max_requests": 300,
}


def _scenario(prefill: int = 1, decode: int = 1, **cluster):  # type: ignore[no-untyped-def]
    pd = {"prefill": {"replicas": prefill}, "decode": {"replicas": decode}}
    data = {
        "model": "llama-3.1-8b",
        "cluster": {"gpu": "h100-sxm", "gpus_per_node": 8, "disaggregation": pd, **cluster},
        "workload": MOONCAKE,
        "sim": {"seed": 1},
    }
    return scenario_from_dict(data, source="pd.yaml", base_dir=ROOT)


def _comparable(summary):  # type: ignore[no-untyped-def]
    drop = {"wall_s", "sim_speed_x", "engine_events", "config"}
    return {k: v for k, v in summary.items() if k not in drop}


@pytest.mark.parametrize(("prefill", "decode", "blocks"), [(1, 1, None), (2, 1, 600), (1, 2, 300)])
def test_fast_forward_equals_stepping_disaggregated(prefill, decode, blocks):
    sc = _scenario(prefill, decode)
    if blocks is not None:  # a small decode pool: requests wait there for blocks, and preempt
        hbm = 8_030_261_248 * 2 + blocks * 16 * 131072 + 1
        pool = dataclasses.replace(sc.cluster.disaggregation.decode)
        sc = scenario_from_dict(
            {
                "model": "llama-3.1-8b",
                "cluster": {
                    "gpu": {"preset": "h100-sxm", "hbm": hbm},
                    "gpus_per_node": 8,
                    "gpu_memory_utilization": 1.0,
                    "activation_reserve": 0,
                    "disaggregation": {
                        "prefill": {"replicas": prefill},
                        "decode": {"replicas": pool.replicas},
                    },
                },
                "workload": MOONCAKE,
                "sim": {"seed": 1},
            },
            source="pd.yaml",
            base_dir=ROOT,
        )
    wl = load_workload(sc.workload, seed=1)
    a = run_scenario(sc, workload=wl)
    b = run_scenario(
        dataclasses.replace(sc, sim=dataclasses.replace(sc.sim, fast_forward=False)), workload=wl
    )
    assert a.summary["engine_events"] < b.summary["engine_events"]  # fast-forward engaged
    assert records(a) == records(b)
    assert _comparable(a.summary) == _comparable(b.summary)
    r = a.summary["requests"]
    assert r["completed"] + r["rejected"] + r["unfinished"] == r["total"]
    d = a.summary["disaggregation"]
    assert d["transfers"] == sum(1 for s in a.seqs if s.output_len > 1 and s.finish_s == s.finish_s)
    if blocks is not None:
        assert d["block_wait_s"]["p99"] > 0 or a.summary["preemptions"] > 0
        assert r["rejected_reasons"]["needs more KV blocks than a decode replica has"] > 0


def test_ttft_includes_the_transfer_and_decode_runs_on_the_decode_pool():
    sc = _scenario()
    wl = make_workload([0.0], [1024], [4])
    res = run_scenario(sc, workload=wl)
    (seq,) = res.seqs
    d = res.summary["disaggregation"]
    assert seq.replica == 1 and d["transfers"] == 1
    # 64 blocks of 16 tokens x 128 KiB per token (Llama-3.1-8B, bf16, TP 1)
    assert d["transferred_bytes"] == 64 * 16 * 131072
    # Same node (2 GPUs of 8): over NVLink, 450 GB/s, plus 32 layers' calls of 2.3 us
    assert d["transfer_s"]["mean"] == pytest.approx(32 * 2.3e-6 + 64 * 16 * 131072 / 450e9)
    ttft = res.summary["ttft_s"]["mean"]
    assert ttft > d["handoff_s"]["mean"] > 0
    roles = {r["role"]: r for r in d["roles"]}
    assert roles["prefill"]["requests"] == 1 and roles["decode"]["requests"] == 1
    # The prefill replica holds the prompt's 64 blocks from its schedule until the KV has landed.
    assert roles["prefill"]["kv_mean_used_blocks"] * res.summary["simulated_s"] == pytest.approx(64 * ttft)
    assert res.summary["replicas"][0]["requests"] == 1
    assert [x["name"] for x in res.summary["links"]] == ["decode0/nvlink/rx", "prefill0/nvlink/tx"]
    assert res.summary["cost_usd"] == pytest.approx(
        roles["prefill"]["cost_usd"] + roles["decode"]["cost_usd"]
    )


def test_across_nodes_the_transfer_goes_over_the_nics():
    sc = _scenario(gpus_per_node=1)
    res = run_scenario(sc, workload=make_workload([0.0], [1024], [4]))
    d = res.summary["disaggregation"]
    assert d["transfer_s"]["mean"] == pytest.approx(5e-6 + 32 * 2.3e-6 + 64 * 16 * 131072 / 50e9)


def test_a_nic_shared_by_a_replicas_gpus_carries_their_shards_one_after_another():
    # TP 2 a pool, 2 GPUs a node: each replica its own node; one NIC for both GPUs (shared_by 2)
    # moves the two 64 KiB-a-token shards in turn: twice one shard's time over 50 GB/s.
    pools = {
        "prefill": {"replicas": 1, "tensor_parallel": 2},
        "decode": {"replicas": 1, "tensor_parallel": 2},
    }
    nic = {"network": {"shared_by": 2}}
    for shared, factor in ((None, 1), (nic, 2)):
        cluster = {"gpus_per_node": 2, "disaggregation": pools, **({"topology": shared} if shared else {})}
        data = {"model": "llama-3.1-8b", "cluster": {"gpu": "h100-sxm", **cluster}, "workload": MOONCAKE}
        sc = scenario_from_dict(data, source="pd.yaml", base_dir=ROOT)
        d = run_scenario(sc, workload=make_workload([0.0], [1024], [4])).summary["disaggregation"]
        shard = 64 * 16 * 131072 / 2
        assert d["transfer_s"]["mean"] == pytest.approx(5e-6 + 32 * 2.3e-6 + factor * shard / 50e9)


def test_replicas_in_one_nic_group_queue_on_the_groups_link():
    # TP 1, 4 GPUs a node, decode on a fresh node (its GPU type differs): the two decode replicas
    # share one NIC (shared_by 2), so two prompts' KV landing at once queue on one link.
    pools = {
        "prefill": {"replicas": 2},
        "decode": {"replicas": 2, "gpu": "h200-sxm", "gpu_hour": "$3.80/h"},
    }
    data = {
        "model": "llama-3.1-8b",
        "cluster": {
            "gpu": "h100-sxm",
            "gpus_per_node": 4,
            "disaggregation": pools,
            "topology": {"network": {"shared_by": 2}},
        },
        "workload": MOONCAKE,
    }
    res = run_scenario(
        scenario_from_dict(data, source="pd.yaml", base_dir=ROOT),
        workload=make_workload([0.0, 0.0], [1024, 1024], [4, 4]),
    )
    names = sorted(x["name"] for x in res.summary["links"])
    assert names == ["node0/network/0/tx", "node1/network/0/rx"]
    t = res.summary["disaggregation"]["transfer_s"]  # the second waits for the first
    one = 5e-6 + 32 * 2.3e-6 + 64 * 16 * 131072 / 50e9
    assert t["mean"] > 1.4 * one


def test_one_token_answers_come_from_the_prefill_pool():
    res = run_scenario(_scenario(), workload=make_workload([0.0], [64], [1]))
    (seq,) = res.seqs
    assert seq.replica == 0 and seq.first_token_s == seq.finish_s
    assert res.summary["disaggregation"]["transfers"] == 0


def test_aggregated_options_it_cannot_run_with_are_refused():
    data = {
        "model": "llama-3.1-8b",
        "cluster": {
            "gpu": "h100-sxm",
            "disaggregation": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}},
        },
        "kv": {"offload": {"enabled": True}},
        "workload": MOONCAKE,
    }
    with pytest.raises(KvsimError, match="cluster.disaggregation"):
        scenario_from_dict(data, source="pd.yaml", base_dir=ROOT)


def test_heterogeneous_pools_on_separate_nodes_priced_each():
    """Splitwise's mix: H100 prefill, H200 decode at TP 2 on a node of its own (NICs between)."""
    data = {
        "model": "llama-3.1-8b",
        "cluster": {
            "gpu": "h100-sxm",
            "gpus_per_node": 8,
            "disaggregation": {
                "prefill": {"replicas": 2},
                "decode": {"replicas": 1, "gpu": "h200", "tensor_parallel": 2, "gpu_hour": 4.5},
            },
        },
        "workload": MOONCAKE,
        "pricing": {"gpu_hour": 3.0},
        "sim": {"seed": 1, "max_time": 30},
    }
    sc = scenario_from_dict(data, source="pd.yaml", base_dir=ROOT)
    assert sc.cluster.num_gpus == 4 and sc.cluster.num_replicas == 3
    assert sc.gpu_hour_usd == pytest.approx((2 * 3.0 + 2 * 4.5) / 4)
    res = run_scenario(sc)
    s = res.summary
    r = s["requests"]
    assert r["completed"] + r["rejected"] + r["unfinished"] == r["total"] and r["unfinished"] > 0
    d = s["disaggregation"]
    roles = {x["role"]: x for x in d["roles"]}
    assert roles["decode"]["gpu"] == "h200-sxm" and roles["decode"]["gpus"] == 2
    assert roles["decode"]["cost_usd"] == pytest.approx(2 * 4.5 * s["simulated_s"] / 3600)
    assert s["cost_usd"] == pytest.approx(roles["prefill"]["cost_usd"] + roles["decode"]["cost_usd"])
    assert {x["name"].split("/")[1] for x in s["links"]} == {"network"}
    # Each decode GPU receives half of what each prefill GPU sends (TP 2 against TP 1).
    rx = next(x for x in s["links"] if x["name"] == "decode0/network/rx")
    tx = sum(x["bytes"] for x in s["links"] if x["name"].endswith("/tx"))
    assert rx["bytes"] == pytest.approx(tx / 2)


def test_a_pool_priced_by_a_scenario_wide_price_for_another_gpu_warns():
    data = {
        "model": "llama-3.1-8b",
        "cluster": {
            "gpu": "h100-sxm",
            "disaggregation": {"prefill": {"replicas": 1}, "decode": {"replicas": 1, "gpu": "h200"}},
        },
        "workload": MOONCAKE,
        "pricing": {"gpu_hour": 3.0},
    }
    sc = scenario_from_dict(data, source="pd.yaml", base_dir=ROOT, file_gpu="h100-sxm")
    assert any("also prices h200-sxm" in n for n in sc.notes)


def test_report_shows_both_pools_and_the_kv_moved(tmp_path):
    """The HTML report's pools section carries each pool's figures and the hand-off from the
    summary; an aggregated run's report has no such section."""
    from kvsim.report import write_report
    from kvsim.results.record import read_summary
    from kvsim.run import write_run

    sc = _scenario(1, 2)
    out = tmp_path / "pd"
    write_run(run_scenario(sc), out)
    page = write_report(out).read_text(encoding="utf-8")
    s = read_summary(out / "summary.json")
    d = s.disaggregation
    assert d is not None
    section = page[page.index("Prefill and decode pools") : page.index("<h2>Replicas")]
    for r in d.roles:
        assert f"{r.replicas} x TP{r.tensor_parallel} {r.gpu}" in section
        assert f"{r.requests:,}" in section and f"{r.kv_blocks_per_replica:,}" in section
    assert f"{d.transfers:,}" in section
    assert f"{d.handoff_s.p99 * 1e3:,.1f} ms" in section
    agg = tmp_path / "agg"
    write_run(run_scenario(_scenario_aggregated()), agg)
    assert "Prefill and decode pools" not in write_report(agg).read_text(encoding="utf-8")


def _scenario_aggregated():  # type: ignore[no-untyped-def]
    data = {"model": "llama-3.1-8b", "cluster": {"gpu": "h100-sxm", "gpus_per_node": 1}, "workload": MOONCAKE}
    return scenario_from_dict(data, source="agg.yaml", base_dir=ROOT)


def test_conditional_disaggregation_prefills_short_prompts_on_the_decode_pool():
    """``max_local_prefill_tokens`` (Dynamo's disaggregated router): the prompts at most that long
    are prefilled where they decode, their KV never moved; the rest go through the prefill pool.
    Every request is accounted for, and fast-forward equals stepping."""
    base = _scenario(1, 2)
    wl = load_workload(base.workload, seed=1)
    cut = int(sorted(wl.prompt_tokens.tolist())[len(wl) // 2])  # about half the prompts
    cfg = dataclasses.replace(base.cluster.disaggregation, max_local_prefill_tokens=cut)
    sc = dataclasses.replace(base, cluster=dataclasses.replace(base.cluster, disaggregation=cfg))
    a = run_scenario(sc, workload=wl)
    r, d = a.summary["requests"], a.summary["disaggregation"]
    assert r["completed"] + r["rejected"] + r["unfinished"] == r["total"]
    admitted = [s for s in a.seqs if s.reason == ""]
    short = [s for s in admitted if s.prompt_len <= cut]
    assert 0 < len(short) < len(admitted)
    assert d["local_prefills"] == len(short)
    # the long ones' KV moved (an answer of one token is done at the prefill: nothing to move)
    assert d["transfers"] == sum(1 for s in admitted if s.prompt_len > cut and s.output_len > 1)
    assert {s.replica for s in short} <= {1, 2}  # the decode pool: replicas P + j, P = 1
    roles = {x["role"]: x for x in d["roles"]}
    assert roles["prefill"]["requests"] == len(admitted) - len(short)
    b = run_scenario(
        dataclasses.replace(sc, sim=dataclasses.replace(sc.sim, fast_forward=False)), workload=wl
    )
    assert records(a) == records(b)
    assert _comparable(a.summary) == _comparable(b.summary)
    off = run_scenario(base, workload=wl).summary["disaggregation"]
    assert off["local_prefills"] == 0 and off["transfers"] > d["transfers"]

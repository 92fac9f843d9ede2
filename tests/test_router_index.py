"""The router's heaps choose what a scan of every replica chooses (the scan lives here, as the
oracle): every arrival of randomized runs is checked, stepping and fast-forward, with host offload
(loads that end between the replica's own events) and speculative decoding (windows of varying
tokens per step) in some of them."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsim.core.request import Request
from kvsim.core.router import ReplicaView, Router
from kvsim.run import run_scenario
from tests.helpers import draw_requests, make_workload, small_scenario


def scan(router: Router, req: Request, now: float) -> ReplicaView:
    """Today's linear scan over every replica: the oracle."""
    reps = router.replicas
    if router.policy == "least_outstanding_requests":
        return min(reps, key=lambda r: (r.num_requests, r.index))
    if router.policy == "prefix_affinity" and req.keys:
        hits = [r.num_prefix_hits(req.keys) for r in reps]
        most = max(hits)
        if most > 0:
            tied = [i for i, h in enumerate(hits) if h == most]
            loads = [reps[i].outstanding_tokens_at(now) for i in tied]
            return reps[tied[loads.index(min(loads))]]
    load = [r.outstanding_tokens_at(now) for r in reps]
    return reps[load.index(min(load))]


@st.composite
def runs(draw):  # type: ignore[no-untyped-def]
    n = draw(st.integers(4, 40))
    arrivals, prompts, outputs, ids = draw_requests(draw, n, [0.0, 0.002, 0.02, 0.3], 600, 120)
    policy = draw(
        st.sampled_from(["least_outstanding_tokens", "least_outstanding_requests", "prefix_affinity"])
    )
    sections: dict = {
        "cluster": {"gpus_per_node": draw(st.sampled_from([2, 3, 8])), "router": policy},
        "sim": {"seed": 1, "fast_forward": draw(st.booleans())},
        "scheduler": {"max_num_seqs": draw(st.sampled_from([2, 64])), "max_batched_tokens": 256},
    }
    extra = draw(st.sampled_from(["none", "offload", "spec"]))
    if extra == "offload":
        sections["kv"] = {
            "prefix_cache": True,
            "offload": {"enabled": True, "host_bytes": 64 * 16 * 131072, "load": "stall"},
        }
        sections["cluster"]["topology"] = {"pcie": {"bw": "1GB/s"}}
    elif extra == "spec":
        sections["scheduler"]["spec_decode"] = {"k": 3, "acceptance": {"mean": 0.6}, "draft": {"kind": "mtp"}}
    wl = make_workload(arrivals, prompts, outputs, hash_ids=ids)
    return small_scenario(num_blocks=draw(st.sampled_from([80, 400])), **sections), wl


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(runs())
def test_the_router_chooses_what_a_scan_chooses(case):  # type: ignore[no-untyped-def]
    sc, wl = case
    checked = []
    choose = Router.choose

    def checked_choose(self: Router, req: Request, now: float) -> ReplicaView:
        want = scan(self, req, now) if len(self.replicas) > 1 else self.replicas[0]
        got = choose(self, req, now)
        assert got.index == want.index, (self.policy, now)
        checked.append(got.index)
        return got

    Router.choose = checked_choose  # type: ignore[method-assign]
    try:
        res = run_scenario(sc, workload=wl)
    finally:
        Router.choose = choose  # type: ignore[method-assign]
    assert len(checked) == len(wl.arrival_s)
    assert len(res.seqs) == len(wl.arrival_s)

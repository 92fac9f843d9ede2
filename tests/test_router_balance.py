"""Prefix affinity's load guard (``cluster.router_balance``, `Router._imbalanced`): SGLang's router
test on requests, and what it does to a cluster whose recovered node comes back cold."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvsim.core.request import Request
from kvsim.core.router import Router
from kvsim.run import run_scenario
from kvsim.spec.scenario import load_scenario
from tests.helpers import ROOT


@dataclass
class Fake:
    index: int
    requests: int
    hits: int
    load: int = 0
    seen: list[int] = field(default_factory=list)

    def outstanding_tokens_at(self, t: float) -> int:
        return self.load

    def outstanding_tokens_until(self, t: float) -> tuple[int, float, int]:
        return self.load, float("inf"), self.load

    @property
    def num_requests(self) -> int:
        return self.requests

    def num_prefix_hits(self, keys: list[int]) -> int:
        return self.hits

    def prefill_cost_tokens(self, req: Request) -> float:
        return 0.0


def _req() -> Request:
    return Request(
        id=0, arrival_s=0.0, prompt_len=64, output_len=4, keys=[1, 2, 3, 4], key_sizes=[1, 1, 1, 1]
    )


def _choose(counts: list[int], hits: list[int], balance: tuple[int, float] | None) -> tuple[int, int]:
    reps = [Fake(i, c, h) for i, (c, h) in enumerate(zip(counts, hits, strict=True))]
    router = Router("prefix_affinity", reps, balance=balance)
    return router.choose(_req(), 0.0).index, router.balanced


def test_an_imbalanced_cluster_goes_to_the_fewest_requests_else_the_most_hits() -> None:
    hits = [4, 0, 1]
    # 100 against 20: more than 64 apart and more than 1.5x: the fewest requests win.
    assert _choose([100, 20, 30], hits, (64, 1.5)) == (1, 1)
    # 60 apart only (not more than 64): the cached prefix decides.
    assert _choose([80, 20, 30], hits, (64, 1.5)) == (0, 0)
    # 100 apart but 1.4x (250 against 180): not imbalanced by the relative test.
    assert _choose([250, 180, 200], hits, (64, 1.5)) == (0, 0)
    # Ties among the fewest go to the lowest index; without the guard, the hits alone.
    assert _choose([100, 5, 5], hits, (64, 1.5)) == (1, 1)
    assert _choose([100, 5, 5], hits, None) == (0, 0)


def test_the_guard_sends_traffic_back_to_a_recovered_cold_node() -> None:
    # faults_node_down: node 1 (replicas 2 and 3) is down 30-90 s; it comes back with an empty
    # cache, so prefix affinity sends the sessions it had elsewhere and keeps them there.
    path = ROOT / "scenarios" / "faults_node_down.yaml"
    runs = {}
    for name, over in (("plain", []), ("guard", ["cluster.router_balance.abs_threshold=8"])):
        s = run_scenario(load_scenario(path, over)).summary
        runs[name] = (
            [r["requests"] for r in s["replicas"]],
            s["ttft_s"]["p99"],
            s["preemptions"],
            s["requests"],
        )
    plain, guard = runs["plain"], runs["guard"]
    assert plain[0] == [297, 262, 19, 22] and guard[0] == [198, 183, 109, 110]
    assert guard[1] < plain[1] / 2 and guard[2] < plain[2] / 4  # TTFT p99 and preemptions
    stepped = run_scenario(
        load_scenario(path, ["cluster.router_balance.abs_threshold=8", "sim.fast_forward=false"])
    ).summary
    assert [r["requests"] for r in stepped["replicas"]] == guard[0]  # fast-forward = stepping
    for _per, _p99, _pre, req in (plain, guard):  # every request accounted for
        assert req["completed"] + req["rejected"] + req["unfinished"] + req["failed"] == req["total"] == 600

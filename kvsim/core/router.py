"""Which replica an arriving request goes to.

Policies: ``round_robin``; ``least_outstanding_tokens`` (fewest tokens still to compute, queued
prompts included: vLLM's router and Dynamo's KV router weigh load this way); ``least_outstanding_requests``
(fewest requests running or waiting, as Vidur's and llm-d's simplest load balancers do);
``prefix_affinity`` (the replica whose prefix cache holds the longest leading run of the request's
blocks; ties and no hit anywhere go to the least outstanding tokens); ``cache_aware`` (Mooncake's
conductor: the least outstanding tokens plus the tokens the request would still cost there, its
prompt less its HBM hits, with the tokens it would load from a lower tier, local DRAM or the global
pool, weighed at what loading costs against computing them, `ReplicaView.prefill_cost_tokens`).
Ties go to the lowest index.

The router reads each replica's state at the arrival instant through `ReplicaView`, which a replica
in the middle of a fast-forward window answers in closed form.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

from kvsim.core.request import Request
from kvsim.spec.scenario import RouterPolicy

POLICIES = tuple(p.value for p in RouterPolicy)


class ReplicaView(Protocol):
    index: int

    def outstanding_tokens_at(self, t: float) -> int: ...

    @property
    def num_requests(self) -> int: ...

    def num_prefix_hits(self, keys: list[int]) -> int: ...

    def prefill_cost_tokens(self, req: Request) -> float: ...


R = TypeVar("R", bound=ReplicaView)


class Router:
    """Chooses a replica for each arriving request."""

    def __init__(self, policy: str, replicas: list[R]) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown router policy {policy!r}; expected one of {', '.join(POLICIES)}")
        self.policy = policy
        self.replicas: list[ReplicaView] = list(replicas)
        self._rr = 0

    def choose(self, req: Request, now: float) -> ReplicaView:
        reps = self.replicas
        if len(reps) == 1:
            return reps[0]
        policy = self.policy
        if policy == "round_robin":
            r = reps[self._rr % len(reps)]
            self._rr += 1
            return r
        if policy == "least_outstanding_requests":
            return min(reps, key=lambda r: (r.num_requests, r.index))
        if policy == "prefix_affinity" and req.keys:
            # The most hits; among equals the least loaded, then the lowest index (loads are read
            # only where they decide: a single best needs none).
            hits = [r.num_prefix_hits(req.keys) for r in reps]
            most = max(hits)
            if most > 0:
                tied = [i for i, h in enumerate(hits) if h == most]
                if len(tied) == 1:
                    return reps[tied[0]]
                loads = [reps[i].outstanding_tokens_at(now) for i in tied]
                return reps[tied[loads.index(min(loads))]]
        load = [r.outstanding_tokens_at(now) for r in reps]
        if policy == "cache_aware":
            score = [load[i] + reps[i].prefill_cost_tokens(req) for i in range(len(reps))]
            return reps[score.index(min(score))]  # the lowest index among equals
        return reps[load.index(min(load))]  # the least loaded, the lowest index among equals

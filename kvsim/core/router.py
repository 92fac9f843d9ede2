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

Loads are kept in heaps, so an arrival costs O(log replicas), not a scan: a replica tells the
router (`touch`) whenever its load may have changed, and the router re-reads only those at the next
arrival. ``least_outstanding_requests`` keeps the exact counts; ``least_outstanding_tokens`` (and
prefix affinity's choice by load) keeps each replica's load at a horizon a few arrivals ahead, a
floor until then (between touches a load only falls: a window's steps computing tokens), and reads
the load at the instant only of replicas whose floor could win. Choices equal a scan's, ties to the
lowest index.
"""

from __future__ import annotations

from heapq import heapify, heappop, heappush
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


_BY_LOAD = ("least_outstanding_tokens", "prefix_affinity")


class Router:
    """Chooses a replica for each arriving request."""

    def __init__(self, policy: str, replicas: list[R]) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown router policy {policy!r}; expected one of {', '.join(POLICIES)}")
        self.policy = policy
        self.replicas: list[ReplicaView] = list(replicas)
        self._rr = 0
        n = len(self.replicas)
        # The heap of (key, index, stamp): a floor of the load (by tokens), or the request count;
        # an entry whose stamp is not its replica's latest is stale and skipped.
        self.indexed = n > 1 and (policy in _BY_LOAD or policy == "least_outstanding_requests")
        self._heap: list[tuple[int, int, int]] = []
        self._stamp = [0] * n
        self._dirty: set[int] = set(range(n)) if self.indexed else set()
        # By tokens, a key is the load at `_horizon` (a floor until then: between touches a load
        # only falls); past it every key is read again, the horizon set to span about
        # `_per_horizon` arrivals at the rate seen since the last.
        self._horizon = -1.0
        self._span = 0.0
        self._t_refresh = 0.0
        self._arrivals = 0
        self._per_horizon = max(4, n // 2)

    def touch(self, index: int) -> None:
        """Replica `index`'s load may have changed (a schedule, a step's end, an arrival, a load):
        the next arrival re-reads it. Wired only where `indexed`."""
        self._dirty.add(index)

    def _refresh(self, now: float = 0.0) -> list[tuple[int, int, int]]:
        heap, stamp, reps = self._heap, self._stamp, self.replicas
        if self.policy == "least_outstanding_requests":
            for i in self._dirty:
                stamp[i] += 1
                heappush(heap, (reps[i].num_requests, i, stamp[i]))
            self._dirty.clear()
            return heap
        if now > self._horizon:  # every floor again, to a new horizon about `_per_horizon` arrivals on
            if self._arrivals and now > self._t_refresh:
                self._span = self._per_horizon * (now - self._t_refresh) / self._arrivals
            self._t_refresh, self._arrivals = now, 0
            self._horizon = h = now + self._span
            heap[:] = [(r.outstanding_tokens_at(h), i, stamp[i]) for i, r in enumerate(reps)]
            heapify(heap)
            self._dirty.clear()
        self._arrivals += 1
        h = self._horizon
        for i in self._dirty:
            stamp[i] += 1
            heappush(heap, (reps[i].outstanding_tokens_at(h), i, stamp[i]))
        self._dirty.clear()
        if len(heap) > 4 * len(reps) + 64:  # drop the stale entries
            heap[:] = [e for e in heap if e[2] == stamp[e[1]]]
            heapify(heap)
        return heap

    def _least_requests(self) -> ReplicaView:
        heap, stamp = self._refresh(), self._stamp
        while heap[0][2] != stamp[heap[0][1]]:  # the latest entries are never popped: one per replica
            heappop(heap)
        return self.replicas[heap[0][1]]

    def _least_tokens(self, now: float) -> ReplicaView:
        """The least load at `now`, the lowest index among equals: the heap's tree walked from its
        root, reading the load only of replicas whose floor is below the best so far (a subtree
        whose root's key exceeds the best cannot hold a better one)."""
        heap, stamp, reps = self._refresh(now), self._stamp, self.replicas
        best, best_i = -1, -1
        stack = [0]
        size = len(heap)
        while stack:
            j = stack.pop()
            floor, i, st = heap[j]
            if best_i >= 0 and (floor > best or (floor == best and i > best_i)):
                continue
            if st == stamp[i]:
                load = reps[i].outstanding_tokens_at(now)
                if best_i < 0 or load < best or (load == best and i < best_i):
                    best, best_i = load, i
            c = 2 * j + 1
            if c + 1 < size:
                stack.append(c + 1)
            if c < size:
                stack.append(c)
        return reps[best_i]

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
            return self._least_requests()
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
        if policy == "cache_aware":
            load = [r.outstanding_tokens_at(now) for r in reps]
            score = [load[i] + reps[i].prefill_cost_tokens(req) for i in range(len(reps))]
            return reps[score.index(min(score))]  # the lowest index among equals
        return self._least_tokens(now)  # the least loaded, the lowest index among equals

"""Which replica an arriving request goes to.

Policies: ``round_robin``; ``least_outstanding_tokens`` (fewest tokens still to compute, queued
prompts included: vLLM's router and Dynamo's KV router weigh load this way); ``least_outstanding_requests``
(fewest requests running or waiting, as Vidur's and llm-d's simplest load balancers do);
``prefix_affinity`` (the replica whose prefix cache holds the longest leading run of the request's
blocks; ties and no hit anywhere go to the least outstanding tokens; with a load guard,
``cluster.router_balance``, an imbalanced cluster sends it to the fewest requests instead); ``cache_aware`` (Mooncake's
conductor: the least outstanding tokens plus the tokens the request would still cost there, its
prompt less its HBM hits, with the tokens it would load from a lower tier, local DRAM or the global
pool, weighed at what loading costs against computing them, `ReplicaView.prefill_cost_tokens`).
Ties go to the lowest index.

The router reads each replica's state at the arrival instant through `ReplicaView`, which a replica
in the middle of a fast-forward window answers in closed form.

Loads are kept in heaps, so an arrival costs O(log replicas) per replica it reads, not a scan: a
replica tells the router whenever its load may have changed (it adds its index to the router's
`touched` set, given to both when the run is built: `Router.indexes` says whether one is kept), and
the next arrival reads
again those, and, of those whose reading has expired (`ReplicaView.outstanding_tokens_until`:
inside a fast-forward window the load falls after each step's end), only those whose floor (the
load after the window's last step) could beat the best. Choices equal a scan's, ties to the lowest
index (tests/test_router_index.py checks every arrival against one).
"""

from __future__ import annotations

import math
from heapq import heapify, heappop, heappush
from typing import Protocol, TypeVar

from kvsim.core.request import Request
from kvsim.spec.scenario import RouterPolicy

POLICIES = tuple(p.value for p in RouterPolicy)


class ReplicaView(Protocol):
    index: int

    def outstanding_tokens_at(self, t: float) -> int: ...

    def outstanding_tokens_until(self, t: float) -> tuple[int, float, int]:
        """`outstanding_tokens_at(t)`, the last instant that reading holds (inf: until the replica
        next touches the router), and the least the load falls to before that."""
        ...

    @property
    def num_requests(self) -> int: ...

    def num_prefix_hits(self, keys: list[int]) -> int: ...

    def prefill_cost_tokens(self, req: Request) -> float: ...


R = TypeVar("R", bound=ReplicaView)


_BY_LOAD = ("least_outstanding_tokens", "prefix_affinity")


class Router:
    """Chooses a replica for each arriving request."""

    def __init__(
        self,
        policy: str,
        replicas: list[R],
        touched: set[int] | None = None,
        balance: tuple[int, float] | None = None,
    ) -> None:
        """`touched`: the indices of the replicas whose load may have changed since the router last
        read them, which the replicas add to where `indexes` (None: a set of its own). `balance`:
        prefix affinity's load guard, (abs, rel) thresholds on requests (`cluster.router_balance`)."""
        if policy not in POLICIES:
            raise ValueError(f"unknown router policy {policy!r}; expected one of {', '.join(POLICIES)}")
        self.policy = policy
        self.balance = balance if policy == "prefix_affinity" else None
        self.balanced = 0  # arrivals the guard sent to the fewest requests instead
        self.replicas: list[ReplicaView] = list(replicas)
        self._rr = 0
        n = len(self.replicas)
        # The heap of (key, index, stamp): the load (by tokens) or the request count at the last read;
        # an entry whose stamp is not its replica's latest is stale and skipped.
        self.indexed = self.indexes(policy, n)
        self._heap: list[tuple[int, int, int]] = []
        self._stamp = [0] * n
        self._dirty: set[int] = set() if touched is None else touched
        if self.indexed:
            self._dirty.update(range(n))
        # By tokens, the load read at an arrival holds until the instant the replica's view says
        # (its window's next step end); a heap of those instants says whom to read again.
        self._until: list[tuple[float, int, int]] = []
        self._last = -math.inf  # the latest arrival instant the keys were read at
        # A reading expired (a step ended since) stays in the heap as an upper bound, its floor
        # (the load after the window's last step) in `_floors`: read again only where it could win.
        self._expired = [False] * n
        self._floor = [0] * n
        self._floors: list[tuple[int, int, int]] = []
        self._reads = [r.outstanding_tokens_until for r in self.replicas] if policy in _BY_LOAD else None

    @staticmethod
    def indexes(policy: str, num_replicas: int) -> bool:
        """Whether a router of `policy` over so many replicas keeps their loads in heaps (then the
        replicas add themselves to its `touched` set where their load may have changed)."""
        return num_replicas > 1 and (policy in _BY_LOAD or policy == "least_outstanding_requests")

    def touch(self, index: int) -> None:
        """Replica `index`'s load may have changed (a schedule, a step's end, an arrival, a load):
        the next arrival re-reads it (what adding it to `touched` does)."""
        self._dirty.add(index)

    def _push(self, i: int, now: float) -> None:
        """Read replica `i` again at `now`: its key, and (by tokens) how long it holds."""
        self._stamp[i] = st = self._stamp[i] + 1
        if self._reads is None:
            heappush(self._heap, (self.replicas[i].num_requests, i, st))
            return
        load, until, floor = self._reads[i](now)
        heappush(self._heap, (load, i, st))
        self._expired[i] = False
        if until != math.inf:
            heappush(self._until, (until, i, st))
            self._floor[i] = floor

    def _refresh(self, now: float = 0.0) -> list[tuple[int, int, int]]:
        """The heap of keys as of `now`: the touched replicas read again; those whose reading
        expired before `now` (a window's step ended: the load falls just after it) marked, with
        their floor in `_floors`, to be read again only where they could win (`_least_tokens`)."""
        heap, stamp, until = self._heap, self._stamp, self._until
        for i in self._dirty:
            self._push(i, now)
        self._dirty.clear()
        while until and until[0][0] < now:
            _, i, st = heappop(until)
            if st == stamp[i]:
                self._expired[i] = True
                heappush(self._floors, (self._floor[i], i, st))
        self._last = now
        if len(heap) > 4 * len(self.replicas) + 64:  # drop the stale entries
            heap[:] = [e for e in heap if e[2] == stamp[e[1]]]
            until[:] = [e for e in until if e[2] == stamp[e[1]]]
            self._floors[:] = [e for e in self._floors if e[2] == stamp[e[1]]]
            heapify(heap)
            heapify(until)
            heapify(self._floors)
        return heap

    def _least_requests(self) -> ReplicaView:
        heap, stamp = self._refresh(), self._stamp
        while heap[0][2] != stamp[heap[0][1]]:  # the latest entries are never popped: one per replica
            heappop(heap)
        return self.replicas[heap[0][1]]

    def _least_tokens(self, now: float) -> ReplicaView:
        """The least load at `now`, the lowest index among equals: the heap's top, every key read
        at or after the replica's last change and holding through `now`."""
        reps = self.replicas
        if now < self._last:  # an arrival earlier than the last read (rounding of a sum): a scan
            load = [r.outstanding_tokens_at(now) for r in reps]
            return reps[load.index(min(load))]
        heap, stamp = self._refresh(now), self._stamp
        floors, expired = self._floors, self._expired
        while True:
            while heap[0][2] != stamp[heap[0][1]]:
                heappop(heap)
            key, i, _ = heap[0]
            if expired[i]:  # its reading is older than a step's end: read it again
                self._push(i, now)
                continue
            while floors and floors[0][2] != stamp[floors[0][1]]:  # read again since
                heappop(floors)
            if floors and (floors[0][0], floors[0][1]) < (key, i):  # an expired one may be lower
                self._push(heappop(floors)[1], now)
                continue
            return reps[i]

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
            if self.balance is not None:
                fewest = self._imbalanced(list(range(len(reps))))
                if fewest is not None:
                    return reps[fewest]
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

    def _imbalanced(self, among: list[int]) -> int | None:
        """The load guard (`balance`): the replica of `among` with the fewest requests (the lowest
        index among equals) when the busiest has more than `abs` requests more and more than `rel`
        times as many (SGLang's router's test); None when balanced."""
        assert self.balance is not None
        abs_t, rel_t = self.balance
        reps = self.replicas
        counts = [reps[i].num_requests for i in among]
        hi, lo = max(counts), min(counts)
        if hi - lo > abs_t and hi > rel_t * lo:
            self.balanced += 1
            return among[counts.index(lo)]
        return None

    def choose_among(self, req: Request, now: float, up: list[int]) -> ReplicaView:
        """`choose` over the replicas in `up` only (the others are down, `kvsim.sim.faults`): a scan
        of each policy's key, ties to the lowest index, as `choose` decides over all of them.
        Round robin takes the next replica in turn that is up. The heaps are left as they are: the
        replicas keep adding themselves to `touched`, read again once all are up."""
        reps = self.replicas
        if self.policy == "round_robin":
            n = len(reps)
            while self._rr % n not in up:
                self._rr += 1
            r = reps[self._rr % n]
            self._rr += 1
            return r
        if self.policy == "least_outstanding_requests":
            return reps[min(up, key=lambda i: (reps[i].num_requests, i))]
        if self.policy == "prefix_affinity" and req.keys:
            if self.balance is not None:
                fewest = self._imbalanced(up)
                if fewest is not None:
                    return reps[fewest]
            hits = {i: reps[i].num_prefix_hits(req.keys) for i in up}
            most = max(hits.values())
            if most > 0:
                up = [i for i in up if hits[i] == most]
        if self.policy == "cache_aware":
            return reps[
                min(
                    up,
                    key=lambda i: (reps[i].outstanding_tokens_at(now) + reps[i].prefill_cost_tokens(req), i),
                )
            ]
        return reps[min(up, key=lambda i: (reps[i].outstanding_tokens_at(now), i))]

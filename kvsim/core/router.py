"""Which replica an arriving request goes to: round robin, least outstanding tokens, prefix affinity."""

from __future__ import annotations

from typing import Any

from kvsim.core.request import Request


class Router:
    """Chooses a replica for each arriving request."""

    def __init__(self, policy: str, replicas: list[Any]) -> None:
        self.policy = policy
        self.replicas = replicas
        self._rr = 0

    def choose(self, seq: Request) -> Any:
        reps = self.replicas
        if len(reps) == 1:
            return reps[0]
        if self.policy == "round_robin":
            r = reps[self._rr % len(reps)]
            self._rr += 1
            return r
        if self.policy == "prefix_affinity" and seq.keys:
            # Longest cached prefix wins; ties (and no hit anywhere) go to the least loaded.
            best = max(
                range(len(reps)),
                key=lambda i: (
                    reps[i].sched.kv.num_prefix_hits(seq.keys),
                    -reps[i].sched.outstanding_tokens,
                    -i,
                ),
            )
            if reps[best].sched.kv.num_prefix_hits(seq.keys) > 0:
                return reps[best]
        return min(reps, key=lambda r: (r.sched.outstanding_tokens, r.index))

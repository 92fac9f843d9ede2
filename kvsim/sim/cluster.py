"""The cluster around the replicas: the arrival process that routes each request at its arrival
instant, and the factory of a replica's pool and scheduler."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import simpy

from kvsim.core.kv_cache_manager import KVCacheManager
from kvsim.core.request import Request, RequestStatus
from kvsim.core.router import Router
from kvsim.core.sched.scheduler import Scheduler


class _ArrivalTimeout(simpy.events.Event):
    """A timeout at URGENT priority: an arrival at the same instant as a step's end is seen first,
    so that "the steps that ended strictly before an arrival" is one rule whether the replica
    steps one by one or fast-forwards (`kvsim.core.horizon.steps_before`)."""

    def __init__(self, env: simpy.Environment, delay: float) -> None:
        super().__init__(env)
        self._ok = True
        self._value = None
        env.schedule(self, simpy.core.URGENT, delay)


def arrival_process(
    env: simpy.Environment,
    times: np.ndarray,
    make_seq: Callable[[int], Request],
    router: Router,
):  # type: ignore[no-untyped-def]
    """Route request i at ``times[i]`` (s, non-decreasing); rejected ones are recorded only."""
    for i, t in enumerate(times.tolist()):
        if t > env.now:
            yield _ArrivalTimeout(env, t - env.now)
        seq = make_seq(i)
        if seq.status is not RequestStatus.REJECTED:  # rejected ones stay in the run's records
            router.choose(seq, t).submit(seq)  # type: ignore[attr-defined]


def make_pool_and_scheduler(
    num_blocks: int,
    block_size: int,
    max_num_seqs: int,
    max_batched_tokens: int,
    chunked_prefill: bool,
    enable_caching: bool = True,
) -> Scheduler:
    return Scheduler(
        KVCacheManager(num_blocks, block_size, enable_caching=enable_caching),
        max_num_seqs=max_num_seqs,
        max_batched_tokens=max_batched_tokens,
        chunked_prefill=chunked_prefill,
    )

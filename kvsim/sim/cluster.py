"""The cluster around the replicas: the arrival process that routes each request at its arrival
instant, and the factory of a replica's pool and scheduler."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import simpy

from kvsim.core.kv_cache_manager import KVCacheManager
from kvsim.core.request import Request, RequestStatus
from kvsim.core.router import Router
from kvsim.core.sched.scheduler import Scheduler


@dataclass
class ArrivalFeed:
    """Arrival times and the process that routes each request at its arrival instant."""

    times: np.ndarray
    end_s: float
    cursor: int = 0

    def next_time(self) -> float:
        return float(self.times[self.cursor]) if self.cursor < len(self.times) else self.end_s


def arrival_process(
    env: simpy.Environment,
    feed: ArrivalFeed,
    make_seq: Callable[[int], Request],
    router: Router,
):  # type: ignore[no-untyped-def]
    n = len(feed.times)
    while feed.cursor < n:
        t = float(feed.times[feed.cursor])
        if t > env.now:
            yield env.timeout(t - env.now)
        i = feed.cursor
        feed.cursor += 1
        seq = make_seq(i)
        if seq.status is not RequestStatus.REJECTED:  # rejected ones stay in the run's records
            router.choose(seq, env.now).submit(seq)  # type: ignore[attr-defined]


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

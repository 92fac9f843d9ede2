"""A request inside one engine: its lengths, progress, held KV and the times the shell fills in.

`RequestStatus` follows vLLM v1's ``RequestStatus``: a request waits, runs, is preempted (back in the
queue, to recompute), may wait for a KV transfer (memory-tier work), and ends finished, rejected or failed (its replica went down too often).
Token accounting: ``num_tokens`` is prompt + generated so far; ``num_computed_tokens`` of them have
KV in the cache.
"""

from __future__ import annotations

from enum import Enum


class RequestStatus(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue after losing its blocks (recompute)
    WAITING_FOR_KV_TRANSFER = "waiting_for_kv_transfer"
    FINISHED = "completed"
    REJECTED = "rejected"
    FAILED = "failed"  # its replica went down more often than the retries allow (`kvsim.sim.faults`)

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.REJECTED, RequestStatus.FAILED)


class Request:
    """One request inside an engine. Times are filled in by the time shell."""

    __slots__ = (
        "arrival_s",
        "evicted",
        "finish_s",
        "first_scheduled_s",
        "first_token_s",
        "held_keys",
        "id",
        "key_cum",
        "keys",
        "num_blocks",
        "num_cached_tokens",
        "num_computed",
        "num_generated",
        "num_private",
        "num_tokens",
        "out_keys",
        "output_len",
        "preemptions",
        "prompt_len",
        "reason",
        "replica",
        "spec_steps",
        "status",
    )

    def __init__(
        self,
        id: int,
        arrival_s: float,
        prompt_len: int,
        output_len: int,
        keys: list[int],
        key_sizes: list[int],
        out_keys: list[int] | None = None,
    ) -> None:
        self.id = id
        self.arrival_s = arrival_s
        self.prompt_len = prompt_len
        self.output_len = output_len
        self.keys = keys  # prefix-cache entries of the prompt's full blocks, in order
        cum = [0]
        for size in key_sizes:
            cum.append(cum[-1] + size)
        self.key_cum = cum  # blocks covered by the first i entries
        # Content keys of the one-block entries the answer completes after the prompt's full blocks
        # (synthetic sessions), cached when the request releases them.
        self.out_keys = out_keys or []
        self.num_blocks = 0  # blocks held: the entries' blocks plus private ones
        self.num_tokens = prompt_len  # prompt + generated so far
        self.num_computed = 0  # tokens whose KV is in the cache (positions; evicted ones included)
        self.evicted = 0  # of them, tokens evicted (kvsim.core.eviction): resident = computed - evicted
        self.num_generated = 0
        self.held_keys: list[int] = []  # cached entries referenced, in block order (a prefix)
        self.num_private = 0  # unhashed blocks after them
        self.num_cached_tokens = -1  # prefix-hit tokens at first admission (-1: never admitted)
        self.preemptions = 0
        self.status = RequestStatus.WAITING
        self.reason = ""
        self.replica = -1
        self.spec_steps = 0  # verify steps run (speculative decoding): the acceptance draw's counter
        self.first_scheduled_s = float("nan")
        self.first_token_s = float("nan")
        self.finish_s = float("nan")

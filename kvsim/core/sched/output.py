"""What one scheduler step decided: vLLM v1's ``SchedulerOutput``, for a replica that keeps counts.

Rows come in two groups, because a batch under load is mostly decodes and the engine handles them
in bulk: decode rows (a request one token past its first sample computes exactly one token on top of
``decode_ctx[i]`` cached ones, and samples) and prefill rows (``prefill_new[i]`` tokens of a prompt,
or of a recompute, on top of ``prefill_ctx[i]``; ``prefill_sampling[i]``: it samples when the step
ends, its computed tokens reaching its token count). The engine prices the step and applies it from
this record; it re-derives nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from kvsim.core.request import Request


class SeqKind(str, Enum):
    """What one sequence computes in a forward pass."""

    DECODE = "decode"  # one token past its first sample, attending to its whole cache
    PREFILL = "prefill"  # a chunk of its prompt (or of a recompute), of any length, one token included
    VERIFY = "verify"  # speculative decoding: its last token plus draft tokens, checked at once


@dataclass
class SchedulerOutput:
    decode_reqs: list[Request] = field(default_factory=list)
    decode_ctx: list[int] = field(default_factory=list)
    # Of the decode rows, those in a format switch's second format (`kvsim.core.eviction`): how
    # many, and their ``decode_ctx`` summed (first-format token slots), priced in that format.
    decode_switched: int = 0
    decode_switched_ctx: int = 0
    # Verify rows (speculative decoding, `kvsim.core.spec_decode`): the last sampled token plus
    # ``verify_drafts[i]`` draft tokens on top of ``verify_ctx[i]`` cached ones; they sample at
    # every position.
    verify_reqs: list[Request] = field(default_factory=list)
    verify_drafts: list[int] = field(default_factory=list)
    verify_ctx: list[int] = field(default_factory=list)
    prefill_reqs: list[Request] = field(default_factory=list)
    prefill_new: list[int] = field(default_factory=list)
    prefill_ctx: list[int] = field(default_factory=list)
    prefill_sampling: list[bool] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    last_is_prefill: bool = False  # the last request scheduled (in running order) is a prefill row

    @property
    def empty(self) -> bool:
        return not self.decode_reqs and not self.prefill_reqs and not self.verify_reqs

    @property
    def decode_only(self) -> bool:
        """Every scheduled request is decoding one token and nothing joined or left."""
        return not self.prefill_reqs and not self.verify_reqs and not self.admitted and not self.preempted

    @property
    def num_sampling(self) -> int:
        return (
            len(self.decode_reqs)
            + sum(self.prefill_sampling)
            + len(self.verify_reqs)
            + sum(self.verify_drafts)
        )

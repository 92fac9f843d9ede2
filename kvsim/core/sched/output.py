"""What one scheduler step decided: vLLM v1's ``SchedulerOutput``, for a replica that keeps counts.

Row i describes ``reqs[i]``: ``num_new[i]`` tokens computed on top of ``ctx_before[i]`` cached ones;
``kinds[i]``: it decodes (one token past its first sampled one) or prefills; ``sampling[i]``: it samples a
token when the step ends (its computed tokens reach its token count). The engine prices the step
and applies it from this record; it re-derives nothing.
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
    reqs: list[Request] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    ctx_before: list[int] = field(default_factory=list)
    kinds: list[SeqKind] = field(default_factory=list)
    sampling: list[bool] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    all_decoding: bool = True  # every scheduled request decodes one token past its first

    @property
    def empty(self) -> bool:
        return not self.reqs

    @property
    def decode_only(self) -> bool:
        """Every scheduled request is decoding one token and nothing joined or left."""
        return self.all_decoding and not self.admitted and not self.preempted

    @property
    def num_sampling(self) -> int:
        return sum(self.sampling)

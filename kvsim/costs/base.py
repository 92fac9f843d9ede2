"""The cost seam's interface: the batch a step computes, the protocol the engine asks, and the one
decomposition of a step that the analytic and the profile models share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

LINKS = ("host_h2d", "host_d2h", "nvlink", "internode")


@dataclass(frozen=True)
class StepBatch:
    """The composition of one scheduler step on one replica.

    ``num_new[i]`` tokens of sequence i are computed on top of ``ctx_before[i]`` cached ones.
    ``num_sampling`` sequences produce a token this step (LM head rows).
    """

    num_new: tuple[int, ...]
    ctx_before: tuple[int, ...]
    num_sampling: int


class CostModel(Protocol):
    name: str

    def step_time(self, batch: StepBatch) -> float:
        """Seconds one step takes."""
        ...

    def decode_step_times(self, num_seqs: int, sum_ctx: np.ndarray) -> np.ndarray:
        """Seconds of decode-only steps: `num_seqs` sequences, one token each, whose cached
        contexts sum to ``sum_ctx[j]`` at step j. Must agree exactly with `step_time`'s decode path,
        element by element, so multi-step fast-forward equals stepping one by one."""
        ...

    def observe_decode(self, num_seqs: int, sum_ctx: np.ndarray) -> None:
        """The decode-only steps the engine actually ran (``sum_ctx`` as above), for bookkeeping such
        as warnings; fast-forward prices candidate steps past the next event that it never runs."""
        ...

    def transfer_time(self, nbytes: float, link: str) -> float: ...

    def warnings(self) -> list[str]: ...


class StepCostModel:
    """A step as parts run one after another: overhead + GEMMs + all-reduces + prefill attention
    (per prefilling sequence) + decode attention (all decoding sequences together). Subclasses price
    the parts; `step_time` and `decode_step_times` share this one decomposition, so a decode-only
    step costs the same whichever is asked (fast-forward relies on it)."""

    name = "steps"
    overhead_s: float

    def _gemm_time(self, num_tokens: int, num_sampling: int) -> float:
        raise NotImplementedError

    def _comm_time(self, num_tokens: int) -> float:
        raise NotImplementedError

    def _prefill_attn_time(self, n: int, ctx: int) -> float:
        raise NotImplementedError

    def _decode_attn_time(self, num_seqs: int, sum_ctx: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def observe_decode(self, num_seqs: int, sum_ctx: np.ndarray) -> None:
        pass

    def step_time(self, batch: StepBatch) -> float:
        total = sum(batch.num_new)
        dec_n = 0
        dec_ctx = 0
        prefill = 0.0
        for n, c in zip(batch.num_new, batch.ctx_before, strict=True):
            if n == 1:
                dec_n += 1
                dec_ctx += c
            else:
                prefill += self._prefill_attn_time(n, c)
        t = self.overhead_s + self._gemm_time(total, batch.num_sampling) + self._comm_time(total) + prefill
        if dec_n:
            ctx = np.array([dec_ctx], dtype=np.float64)
            t += float(self._decode_attn_time(dec_n, ctx)[0])
            self.observe_decode(dec_n, ctx)  # the engine observes only its decode-only runs
        return t

    def decode_step_times(self, num_seqs: int, sum_ctx: np.ndarray) -> np.ndarray:
        fixed = self.overhead_s + self._gemm_time(num_seqs, num_seqs) + self._comm_time(num_seqs)
        return fixed + self._decode_attn_time(num_seqs, sum_ctx.astype(np.float64))

    def warnings(self) -> list[str]:
        return []

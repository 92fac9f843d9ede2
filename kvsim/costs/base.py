"""The cost seam's interface: the batch a forward pass computes, the price of a step, the protocol
the engine asks, and the one decomposition of a step that the analytic and the profile models share.

Pricing is pure: asking the price of a step (or of a run of fast-forward candidates) changes
nothing, so a planner may price as many candidates as it likes. A price carries the ops that fell
outside what the model knows (`StepPrice.off_grid`, e.g. a profile's measured grid); the engine
records the flags of the steps it actually ran and hands them back to `CostModel.warnings`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvsim.core.eviction import EvictionWork
from kvsim.core.sched.output import SeqKind  # re-exported: the batch is the scheduler's
from kvsim.spec.topology import Link

Flags = frozenset[str]  # names of ops priced outside what a model knows
Chunks = list[tuple[int, int]]  # (new tokens, cached tokens) of each prefill or verify sequence
NO_FLAGS: Flags = frozenset()
_NO_DECODE = np.zeros(0)  # the decode part of a step without decoding sequences (read only)


@dataclass(frozen=True)
class ForwardBatch:
    """The composition of one forward pass (one scheduler step) on one replica.

    Sequence i is of kind ``kinds[i]`` and computes ``num_new[i]`` tokens on top of
    ``ctx_before[i]`` cached ones (a decode computes exactly one; a verify one plus its drafts).
    ``num_sampling`` rows go through the LM head (sequences that produce a token; a verify samples
    at every position). Verify rows come from speculative decoding (`kvsim.core.spec_decode`).
    A format switch's switched decode rows are ``num_switched`` and ``switched_ctx``.
    """

    kinds: tuple[SeqKind, ...]
    num_new: tuple[int, ...]
    ctx_before: tuple[int, ...]
    num_sampling: int
    # Format switch (`kv.format_switch`): of the decode rows, how many are in the second format and
    # their ``ctx_before`` summed (first-format token slots); their attention and writes in it.
    num_switched: int = 0
    switched_ctx: int = 0

    def __post_init__(self) -> None:
        assert len(self.kinds) == len(self.num_new) == len(self.ctx_before)

    @staticmethod
    def decode(ctx_before: Iterable[int]) -> ForwardBatch:
        """A decode-only batch: every sequence computes and samples one token."""
        ctx = tuple(ctx_before)
        return ForwardBatch((SeqKind.DECODE,) * len(ctx), (1,) * len(ctx), ctx, len(ctx))

    @staticmethod
    def prefill(num_new: int, ctx_before: int = 0, *, sampling: bool = True) -> ForwardBatch:
        """One prefill chunk alone (``sampling``: it is the prompt's last chunk)."""
        return ForwardBatch((SeqKind.PREFILL,), (num_new,), (ctx_before,), int(sampling))

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)


@dataclass(frozen=True)
class StepPrice:
    """Seconds a step takes, and the ops priced outside what the model knows (flag names)."""

    seconds: float
    off_grid: frozenset[str] = NO_FLAGS


@dataclass(slots=True)
class StepRun:
    """The engine's one pricing question: `num_steps` steps of one composition, a single step being a
    run of one. Each step runs `num_decode` decode rows whose cached contexts sum to
    ``dec_sum_ctx[j]`` (``num_switched`` of them in a format switch's second format, their part
    ``switched_ctx[j]``) and the same prefill or verify `rows` ((kind, new tokens), in batch order)
    on ``rows_ctx[i][j]`` cached tokens; ``num_sampling`` LM-head rows (one count for every step, or
    one per step). Fast-forward windows and single steps build it alike (`kvsim.sim.replica`)."""

    num_decode: int
    dec_sum_ctx: np.ndarray  # (num_steps,)
    num_sampling: int | Sequence[int]
    num_steps: int
    rows: tuple[tuple[SeqKind, int], ...] = ()
    rows_ctx: tuple[Sequence[int], ...] = ()  # one sequence of num_steps contexts per row
    num_switched: int = 0
    switched_ctx: np.ndarray | None = None

    @property
    def row_tokens(self) -> int:
        return sum(n for _, n in self.rows)

    @staticmethod
    def of(batch: ForwardBatch) -> StepRun:
        """One step: the batch's composition."""
        kinds, num_new, ctx_before = batch.kinds, batch.num_new, batch.ctx_before
        dec_n = kinds.count(SeqKind.DECODE)
        dec_ctx = sum(ctx_before)
        rows: list[tuple[SeqKind, int]] = []
        ctxs: list[tuple[int]] = []
        if dec_n < len(kinds):
            for kind, n, c in zip(kinds, num_new, ctx_before, strict=True):
                if kind is not SeqKind.DECODE:
                    rows.append((kind, n))
                    ctxs.append((c,))
                    dec_ctx -= c
        assert batch.num_tokens - sum(n for _, n in rows) == dec_n, "a decode computes one token"
        sw = np.array([batch.switched_ctx], dtype=np.float64) if batch.num_switched else None
        dec = np.array([dec_ctx], dtype=np.float64) if dec_n else _NO_DECODE
        return StepRun(dec_n, dec, batch.num_sampling, 1, tuple(rows), tuple(ctxs), batch.num_switched, sw)

    @staticmethod
    def decode(
        num_seqs: int, sum_ctx: np.ndarray, num_switched: int = 0, switched_ctx: np.ndarray | None = None
    ) -> StepRun:
        """Decode-only steps: `num_seqs` rows, one token each, sampling each."""
        return StepRun(num_seqs, sum_ctx, num_seqs, len(sum_ctx), (), (), num_switched, switched_ctx)

    @staticmethod
    def mixed(
        num_decode: int,
        dec_sum_ctx: np.ndarray,
        chunk: int,
        prefill_ctx: np.ndarray,
        num_sampling: np.ndarray,
        num_switched: int = 0,
        dec_switched_ctx: np.ndarray | None = None,
    ) -> StepRun:
        """Decodes plus one prefill chunk of `chunk` tokens per step (a mixed window)."""
        ctx = prefill_ctx.tolist()
        return StepRun(
            num_decode,
            dec_sum_ctx,
            num_sampling.tolist(),
            len(ctx),
            ((SeqKind.PREFILL, chunk),),
            (ctx,),
            num_switched,
            dec_switched_ctx,
        )


class CostModel(Protocol):
    name: str
    prefix_rule: str  # how a prefill chunk's attention over a prefix beyond the measured is priced

    def price(self, batch: ForwardBatch) -> StepPrice:
        """Seconds one step takes and its off-grid flags; no side effects."""
        ...

    def step_time(self, batch: ForwardBatch) -> float:
        """``price(batch).seconds``."""
        ...

    def step_times(self, run: StepRun) -> np.ndarray:
        """Seconds of each of `run`'s steps (a single step is a run of one): fast-forward windows and
        single steps are priced by this one path, so a window of k steps costs what k single steps
        do, float for float. No side effects: fast-forward prices candidate steps past the next
        event too."""
        ...

    def step_seconds(self, run: StepRun) -> float:
        """``step_times(run)[0]`` of a single step, float for float."""
        ...

    def step_off_grid(self, run: StepRun, k: int | None = None) -> frozenset[str]:
        """The off-grid flags of `run`'s first `k` steps (all: None), together."""
        ...

    def transfer_time(self, nbytes: float, link: Link, num_calls: int = 1) -> float:
        """Seconds to move ``nbytes`` over ``link`` in ``num_calls`` copies."""
        ...

    def eviction_time(self, work: EvictionWork) -> float:
        """Seconds of the token-eviction trims after a step (top-k, compaction, block tables)."""
        ...

    def eviction_price(self, work: EvictionWork) -> StepPrice:
        """`eviction_time` and the off-grid flags of the trim ops it priced (a measured profile's)."""
        ...

    def warnings(self, ran: frozenset[str] = NO_FLAGS) -> list[str]:
        """The model's notes, and one line per off-grid flag in ``ran`` (what the engine ran)."""
        ...

    def format_sign_warnings(self, num_seqs: int, ctx_per_seq: float) -> list[str]:
        """One line where this model and the fitted analytic model disagree on the direction of the
        KV format's change to a decode step of `num_seqs` sequences over `ctx_per_seq` tokens each
        (the format's step over bf16's: one faster, the other slower); none otherwise, and none for
        a model that is the analytic one. Asked once per run, after it, at its typical shape."""
        ...

    def prefix_extrapolated_s(self, n: int, ctx: int) -> float:
        """Seconds of a prefill chunk's attention (``n`` new tokens over ``ctx`` cached ones) that
        its data did not measure: the part over a cached prefix longer than its tables' longest
        (`prefix_rule` says how that part is priced); 0 for a model without tables. The engine
        sums it over the steps that ran, for the run's warning of its share."""
        ...


def transfer_time(nbytes: float, link: Link, num_calls: int = 1) -> float:
    """Seconds to move ``nbytes`` over ``link`` in ``num_calls`` copies, uncontended:
    latency + num_calls x per-call overhead + nbytes / bandwidth. Many small copies pay the
    per-call overhead each (``cudaMemcpyAsync`` per block); one batched gather pays it once."""
    if nbytes < 0 or num_calls < 1:
        raise ValueError(f"transfer of {nbytes} bytes in {num_calls} calls")
    return link.latency_s + num_calls * link.per_call_overhead_s + nbytes / link.bw_bytes_per_s


class StepCostModel:
    """A step as parts run one after another: overhead (and a measured profile's rest of the step,
    `_step_base`) + GEMMs + all-reduces + quantize-on-write of the new tokens + prefill attention
    (per prefilling or verifying sequence) + decode attention (all decoding sequences together).
    Subclasses price the parts; `step_times` is the one path that sums them, for a single step and
    for a window's steps alike (`price` and `decode_step_times` ask it for one batch, a decode run)."""

    name = "steps"
    overhead_s: float
    prefill_launch_s = 0.0  # paid once by a step with prefill (or verify) rows: one kernel call for all

    def _gemm_time(self, num_tokens: int, num_sampling: int) -> float:
        raise NotImplementedError

    def _comm_time(self, num_tokens: int) -> float:
        raise NotImplementedError

    def _prefill_attn_time(self, n: int, ctx: int) -> float:
        raise NotImplementedError

    def _decode_attn_time(self, num_seqs: int, sum_ctx: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _verify_attn_time(self, n: int, ctx: int) -> float:
        """Attention of a speculative-decoding verify row: `n` queries (its last token and drafts)
        over `ctx` cached keys. By default a prefill chunk's (a measured profile's prefill table)."""
        return self._prefill_attn_time(n, ctx)

    def _write_time(self, num_tokens: int) -> float:
        """Quantize-on-write of the step's new tokens (0 for a bf16/fp16 cache)."""
        return 0.0

    def _step_base(self, num_tokens: int, num_rows: int, num_decode: int, num_sampling: int) -> float:
        """The step's fixed overhead plus its work besides GEMMs, all-reduces, writes and attention
        (a measured profile's `step_rest`, `step_overhead` and decode-row KV writes), for a step of
        `num_tokens` tokens in `num_rows` sequences, `num_decode` of them decoding, `num_sampling`
        LM-head rows. By default the fixed ``overhead_s`` alone."""
        return self.overhead_s

    def step_overhead(self, num_rows: int) -> float:
        """The fixed part of `_step_base` for a step of `num_rows` sequences: the serving loop's own
        time (a measured profile's `step_overhead` at that many rows; else ``overhead_s``), which a
        draft pass inside the step does not pay again (`kvsim.costs.draft`)."""
        return self.overhead_s

    def _switched_write_time(self, num_tokens: int) -> float:
        """Quantize-on-write of new tokens in a format switch's second format."""
        raise NotImplementedError

    def _switched_decode_attn_time(
        self, num_seqs: int, sum_ctx: np.ndarray, num_switched: int, switched_ctx: np.ndarray
    ) -> np.ndarray:
        """Decode attention of `num_seqs` sequences, `num_switched` of them (their contexts
        ``switched_ctx`` of ``sum_ctx``, in first-format token slots) in the second format."""
        raise NotImplementedError

    def _write_part(self, num_tokens: int, num_switched: int, num_decode: int) -> float:
        """Quantize-on-write of a step's `num_tokens` new tokens (`num_decode` of them decode rows'),
        `num_switched` of them in a format switch's second format."""
        if not num_switched:
            return self._write_time(num_tokens)
        return self._write_time(num_tokens - num_switched) + self._switched_write_time(num_switched)

    def _decode_part(
        self, num_seqs: int, sum_ctx: np.ndarray, num_switched: int, switched_ctx: np.ndarray | None
    ) -> np.ndarray:
        if not num_switched or switched_ctx is None:
            return self._decode_attn_time(num_seqs, sum_ctx)
        return self._switched_decode_attn_time(
            num_seqs, sum_ctx, num_switched, switched_ctx.astype(np.float64)
        )

    def _off_grid(
        self, tokens: int, rows: int, chunks: Chunks, n_dec: int, dec: np.ndarray, seqs: int | None = None
    ) -> Flags:
        """Flags of a step's parts: GEMMs over ``tokens`` with ``rows`` sampled, attention of the
        ``chunks`` ((n, ctx) of each prefill/verify sequence) and of ``n_dec`` decoding sequences
        whose contexts sum to ``dec[j]`` over a run of steps j. `seqs`: the step's sequences
        (None: ``n_dec + len(chunks)``; a run of mixed steps passes one chunk per step, each
        step's alternative, and its steps' own count)."""
        return NO_FLAGS

    def step_times(self, run: StepRun) -> np.ndarray:
        """Seconds of each of `run`'s steps: the one pricing path (a single step is a run of one).
        Parts in one order: base + GEMMs + all-reduces + writes + (prefill launch + the prefill and
        verify rows' attention, last row first), then + the decode rows' attention together."""
        nd, rows = run.num_decode, run.rows
        total = nd + run.row_tokens
        nrows = nd + len(rows)
        comm = self._comm_time(total)
        write = self._write_part(total, run.num_switched, nd)
        samp = run.num_sampling
        t: np.ndarray | float
        if isinstance(samp, int):
            fixed = self._step_base(total, nrows, nd, samp) + self._gemm_time(total, samp) + comm + write
            if rows:
                t = np.array([fixed + p for p in self._rows_attn(run)], dtype=np.float64)
            else:
                t = fixed
        else:
            head = {s: self._step_base(total, nrows, nd, s) + self._gemm_time(total, s) for s in set(samp)}
            if rows:
                pre = self._rows_attn(run)
                t = np.array([head[s] + comm + write + p for s, p in zip(samp, pre, strict=True)])
            else:
                t = np.array([head[s] + comm + write for s in samp], dtype=np.float64)
        if nd:
            sw = run.switched_ctx
            return t + self._decode_part(nd, run.dec_sum_ctx.astype(np.float64), run.num_switched, sw)
        if isinstance(t, float):
            return np.full(run.num_steps, t)
        return t

    def step_seconds(self, run: StepRun) -> float:
        """``step_times(run)[0]`` of a single step, in Python floats: the same parts summed in the
        same order (the engine's hot path prices most steps alone)."""
        nd = run.num_decode
        total = nd + run.row_tokens
        samp = run.num_sampling if isinstance(run.num_sampling, int) else run.num_sampling[0]
        t = (
            self._step_base(total, nd + len(run.rows), nd, samp)
            + self._gemm_time(total, samp)
            + self._comm_time(total)
            + self._write_part(total, run.num_switched, nd)
        )
        if run.rows:
            t = t + self._rows_attn(run)[0]
        if nd:
            sw = run.switched_ctx
            t += self._decode_seconds(
                nd, float(run.dec_sum_ctx[0]), run.num_switched, None if sw is None else float(sw[0])
            )
        return t

    def _decode_seconds(
        self, num_seqs: int, sum_ctx: float, num_switched: int, switched_ctx: float | None
    ) -> float:
        """`_decode_part` of one step, as a float. A model whose decode formulas take floats as
        they take arrays (the analytic one) overrides it to skip the one-element arrays."""
        sw = None if switched_ctx is None else np.array([switched_ctx])
        return float(self._decode_part(num_seqs, np.array([sum_ctx]), num_switched, sw)[0])

    def _rows_attn(self, run: StepRun) -> list[float]:
        """Per step: the prefill launch plus the attention of the prefill and verify rows, summed
        last row first (where the scheduler puts them)."""
        launch = self.prefill_launch_s
        rows = run.rows
        if len(rows) == 1:
            ((kind, n),) = rows
            attn = self._verify_attn_time if kind is SeqKind.VERIFY else self._prefill_attn_time
            return [launch + attn(n, c) for c in run.rows_ctx[0]]
        out = []
        for j in range(run.num_steps):
            p = launch
            for (kind, n), ctx in zip(reversed(rows), reversed(run.rows_ctx), strict=True):
                if kind is SeqKind.VERIFY:
                    p += self._verify_attn_time(n, ctx[j])
                else:
                    p += self._prefill_attn_time(n, ctx[j])
            out.append(p)
        return out

    def step_off_grid(self, run: StepRun, k: int | None = None) -> Flags:
        """The off-grid flags of `run`'s first `k` steps (all of them: None), together."""
        if type(self)._off_grid is StepCostModel._off_grid:  # a model without a grid: nothing to flag
            return NO_FLAGS
        k = run.num_steps if k is None else k
        nd, rows = run.num_decode, run.rows
        total = nd + run.row_tokens
        chunks = [
            (n, int(ctx[j]))
            for j in range(k)
            for (_, n), ctx in zip(reversed(rows), reversed(run.rows_ctx), strict=True)
        ]
        dec = run.dec_sum_ctx[:k].astype(np.float64) if nd else _NO_DECODE
        samp = run.num_sampling
        flags: frozenset[str] = NO_FLAGS
        for s in (samp,) if isinstance(samp, int) else sorted(set(samp[:k])):
            flags = flags | self._off_grid(total, s, chunks, nd, dec, nd + len(rows))
        return flags

    def price(self, batch: ForwardBatch) -> StepPrice:
        run = StepRun.of(batch)
        return StepPrice(self.step_seconds(run), self.step_off_grid(run))

    def step_time(self, batch: ForwardBatch) -> float:
        return self.step_seconds(StepRun.of(batch))

    def decode_step_times(
        self,
        num_seqs: int,
        sum_ctx: np.ndarray,
        num_switched: int = 0,
        switched_ctx: np.ndarray | None = None,
    ) -> np.ndarray:
        return self.step_times(StepRun.decode(num_seqs, sum_ctx, num_switched, switched_ctx))

    def eviction_time(self, work: EvictionWork) -> float:
        raise NotImplementedError

    def eviction_price(self, work: EvictionWork) -> StepPrice:
        return StepPrice(self.eviction_time(work))

    def warnings(self, ran: frozenset[str] = NO_FLAGS) -> list[str]:
        return []

    def format_sign_warnings(self, num_seqs: int, ctx_per_seq: float) -> list[str]:
        return []

    prefix_rule = ""  # how the attention over a cached prefix beyond the measured ones is priced

    def prefix_extrapolated_s(self, n: int, ctx: int) -> float:
        return 0.0

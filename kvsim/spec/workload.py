"""The workload: request arrivals and lengths, read from a trace or generated, as numpy arrays.

A `Workload` holds, per request, its arrival time, prompt and output lengths and, when the source has
prefix information, the prefix-unique block ids of its prompt. ``load_workload(cfg, seed=...)`` reads
a trace (`kvsim.spec.traces`) or runs the generator (`kvsim.spec.synthetic`), rebases a trace to its
first request, then applies the window, the rate scale and the request cap, in that order. Nothing
is dropped without a count: `Workload.accounting()` (``summary.json`` ``workload``) says where the
trace started and how many requests fell before the window, after it, or beyond the cap. ``clip_to_context`` (``workload.clip_to_context``,
as Vidur's ``max_tokens``) shortens requests longer than the model's context instead of leaving
them to be rejected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from kvsim.errors import KvsimError
from kvsim.spec.bench import BENCH_BLOCK_TOKENS, BenchConfig, bench_arrivals, random_dataset, read_sharegpt
from kvsim.spec.scenario import WorkloadConfig
from kvsim.spec.synthetic import synthetic_workload
from kvsim.spec.traces import GENERIC_BLOCK_TOKENS, MAX_TIME_S, _prefix_unique, _read_trace

if TYPE_CHECKING:
    from kvsim.spec.agent import AgentWorkload


@dataclass(frozen=True)
class Workload:
    """Requests in arrival order; row i of every array is request i."""

    arrival_s: np.ndarray  # (n,) float64, non-decreasing, s from the start of the window
    prompt_tokens: np.ndarray  # (n,) int64 >= 1
    output_tokens: np.ndarray  # (n,) int64 >= 1
    hash_ids: list[np.ndarray] | None  # n arrays of ceil(prompt / G) int64 prefix-unique ids
    hash_block_tokens: int  # G
    source: str  # trace path or "synthetic"
    line_numbers: np.ndarray | None  # (n,) int64 source line of each request; None for synthetic
    skipped_lines: int  # malformed lines skipped (skip_bad_lines)
    dropped: dict[str, int]  # reason -> requests dropped on purpose within the window
    origin_s: float = 0.0  # the first request's time in the trace's own clock (s), before rebasing
    before_window: int = 0  # requests read but earlier than workload.start
    after_window: int = 0  # requests read but at or after workload.start + duration
    over_max_requests: int = 0  # requests in the window beyond workload.max_requests
    clipped_to_context: int = 0  # requests shortened by `clip_to_context`
    # Ids (as hash_ids) of the full blocks each request's answer completes, where a later request's
    # prompt holds them (synthetic sessions); None where no source says what an answer contains.
    output_hash_ids: list[np.ndarray] | None = None
    # Agent sessions (`kvsim.spec.agent`): sessions, turns, gaps, segments; None for other sources.
    agent: AgentWorkload | None = None
    # What the run's warnings must say about how the workload was built (ShareGPT's estimated lengths).
    notes: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.arrival_s)

    def accounting(self) -> dict[str, object]:
        """Where every request of the source went, for ``summary.json`` ``workload``."""
        return {
            "skipped_lines": self.skipped_lines,
            "dropped": dict(sorted(self.dropped.items())),
            "origin_s": self.origin_s,
            "before_window": self.before_window,
            "after_window": self.after_window,
            "over_max_requests": self.over_max_requests,
        }


def load_workload(cfg: WorkloadConfig, *, seed: int) -> Workload:
    """Read or generate the workload, rebase a trace to its first request, then window, rebase,
    rate-scale and cap it.

    Raises `KvsimError` (one line, ``FILE:LINE: what is wrong`` for a bad line) on any bad input.
    """
    lines: np.ndarray | None = None
    out_hashes: list[np.ndarray] | None = None
    skipped = 0
    dropped_t: dict[str, list[float]] = {}
    origin = 0.0  # subtracted from every time: the first request's trace time
    origin_s = 0.0  # the same instant in the trace's own clock (Azure: since the Unix epoch)
    agent = None
    if cfg.format == "agent":
        from kvsim.spec.agent import agent_workload

        assert cfg.agent is not None
        t, prompt, output, hashes, block, out_hashes, agent = agent_workload(cfg.agent, seed=seed)
        if t[-1] >= MAX_TIME_S:
            raise KvsimError(
                f"the last session starts at {t[-1]:.3g} s (at most {MAX_TIME_S:.3g} s); raise it",
                source="agent",
                path="workload.agent.rate",
            )
        return Workload(
            arrival_s=t,
            prompt_tokens=prompt,
            output_tokens=output,
            hash_ids=hashes,
            hash_block_tokens=block,
            source="agent",
            line_numbers=None,
            skipped_lines=0,
            dropped={},
            output_hash_ids=out_hashes,
            agent=agent,
        )
    notes: tuple[str, ...] = ()
    hash_ids: list[np.ndarray] | None
    if cfg.format in ("sharegpt", "random"):
        t, prompt, output, hash_ids, notes = _bench_workload(cfg, seed)
        block = BENCH_BLOCK_TOKENS
        source = str(cfg.trace) if cfg.format == "sharegpt" else "random"
    elif cfg.format == "synthetic":
        if cfg.synthetic is None:
            raise KvsimError("format synthetic needs workload.synthetic", source="workload")
        t, prompt, output, hashes, block, out_hashes = synthetic_workload(cfg.synthetic, seed=seed)
        hash_ids = hashes
        source = "synthetic"
    else:
        rows, g = _read_trace(cfg)
        assert rows.first_t is not None  # _read_trace refuses a trace without requests
        origin = rows.first_t
        origin_s = origin + rows.epoch_offset_s
        t = np.array(rows.t, np.float64) - origin
        prompt = np.array(rows.prompt, np.int64)
        output = np.array(rows.output, np.int64)
        lines = np.array(rows.lines, np.int64)
        hash_ids = _prefix_unique(rows.hashes) if g is not None else None
        block = g if g is not None else GENERIC_BLOCK_TOKENS
        source, skipped, dropped_t = rows.file, rows.skipped, rows.dropped

    start = cfg.start_s
    end = math.inf if cfg.duration_s is None else start + cfg.duration_s
    lo, end_i = (int(i) for i in np.searchsorted(t, [start, end], side="left"))
    hi = end_i if cfg.max_requests is None else min(end_i, lo + cfg.max_requests)
    if hi <= lo:
        window = f"[{start:g}, {end:g}) s" if cfg.duration_s is not None else f"[{start:g} s, end)"
        raise KvsimError(
            f"no requests in the window {window}; the trace spans {t[0]:g} .. {t[-1]:g} s", source=source
        )
    arrival = (t[lo:hi] - start) / cfg.rate_scale
    if arrival[-1] >= MAX_TIME_S:  # the same bound as a trace's own times: 1 us still resolved
        field = {"synthetic": "workload.synthetic.rate", "random": "workload.bench.request_rate"}.get(
            source, "workload.rate_scale"
        )
        raise KvsimError(
            f"the last arrival lands at {arrival[-1]:.3g} s (at most {MAX_TIME_S:.3g} s); raise it",
            source=source,
            path=field,
        )
    dropped = {}
    for reason, times in dropped_t.items():
        dt = np.asarray(times) - origin
        dropped[reason] = int(np.count_nonzero((dt >= start) & (dt < end)))
    return Workload(
        arrival_s=arrival,
        prompt_tokens=prompt[lo:hi],
        output_tokens=output[lo:hi],
        hash_ids=None if hash_ids is None else hash_ids[lo:hi],
        hash_block_tokens=block,
        source=source,
        line_numbers=None if lines is None else lines[lo:hi],
        output_hash_ids=None if out_hashes is None else out_hashes[lo:hi],
        skipped_lines=skipped,
        dropped=dropped,
        origin_s=origin_s,
        before_window=lo,
        after_window=len(t) - end_i,
        over_max_requests=end_i - hi,
        notes=notes,
    )


def _bench_workload(
    cfg: WorkloadConfig, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray] | None, tuple[str, ...]]:
    """vLLM bench serve's ShareGPT or random dataset and its arrivals (`kvsim.spec.bench`)."""
    bench = cfg.bench or BenchConfig()
    s = seed if bench.seed is None else bench.seed
    n = bench.num_prompts
    notes: list[str] = []
    hashes = None
    if cfg.format == "sharegpt":
        if cfg.trace is None or not cfg.trace.is_file():
            raise KvsimError("dataset file not found", source=str(cfg.trace))
        prompt, output, estimated, _ = read_sharegpt(cfg.trace, bench, s)
        if estimated:
            notes.append(
                f"ShareGPT lengths of {estimated:,} of {n:,} requests are estimates at "
                f"{bench.chars_per_token:g} characters a token (vLLM tokenizes with the model's "
                "tokenizer; give each turn a 'tokens' count for exact lengths)"
            )
    else:
        assert cfg.random is not None
        prompt, output, hashes = random_dataset(cfg.random, n, s)
    t = bench_arrivals(n, bench.request_rate, bench.burstiness, s)
    return t, prompt, output, hashes, tuple(notes)


def clip_to_context(wl: Workload, max_context: int) -> Workload:
    """Requests whose prompt + output exceed `max_context` tokens, shortened to fit exactly.

    The prompt is clipped first (to max_context - output, at least one token); the output only
    when it alone leaves no room for a one-token prompt, so at least one output token stays. A
    clipped prompt keeps the prefix ids of the blocks it still covers (ids name prefixes, so the
    first ones stay valid). Counts the requests changed in ``clipped_to_context``.
    """
    assert max_context >= 2, max_context
    p, o = wl.prompt_tokens, wl.output_tokens
    over = p + o > max_context
    if not over.any():
        return wl
    prompt = np.where(over, np.minimum(p, np.maximum(1, max_context - o)), p)
    output = np.where(over, np.minimum(o, max_context - prompt), o)
    hash_ids = wl.hash_ids
    if hash_ids is not None:
        g = wl.hash_block_tokens
        hash_ids = [
            h[: -(-int(n) // g)] if clip else h for h, n, clip in zip(hash_ids, prompt, over, strict=True)
        ]
    out_ids = wl.output_hash_ids
    if out_ids is not None:  # a clipped answer no longer completes the blocks its session expects
        out_ids = [h[:0] if clip else h for h, clip in zip(out_ids, over, strict=True)]
    return replace(
        wl,
        prompt_tokens=prompt,
        output_tokens=output,
        hash_ids=hash_ids,
        output_hash_ids=out_ids,
        clipped_to_context=wl.clipped_to_context + int(over.sum()),
    )

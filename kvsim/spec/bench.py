"""The workloads of vLLM's ``bench serve``: the ShareGPT and ``random`` datasets, and its arrivals.

- **Arrivals** (``workload.bench``: ``num_prompts``, ``request_rate``, ``burstiness``, ``seed``), as
  vLLM's ``get_request``: gaps drawn from Gamma(shape = burstiness, scale = 1 / (rate * burstiness))
  (burstiness 1: Poisson) by numpy's legacy global generator seeded with ``seed``, summed, then
  scaled so that the last request arrives at ``num_prompts / request_rate``; ``request_rate: inf``
  sends everything at 0. Neither dataset draws from that generator, so the draws are vLLM's own.
- **ShareGPT** (``format: sharegpt``): a JSON list of ``{"id", "conversations": [{"from", "value"},
  ...]}``. As vLLM: entries with fewer than two turns are dropped, the rest shuffled by Python's
  ``random`` seeded with ``seed``; each entry's first turn is the prompt, its second the answer;
  pairs with a prompt or answer under 4 tokens, a prompt over 1,024 or both over 2,048 are skipped
  (the answer's check is off with a fixed ``sharegpt_output_len``); too few pairs are topped up by
  ``random.choices`` (reseeded). Lengths: a turn's ``"tokens"`` (a count made with the model's tokenizer) where
  both turns have one, else an *estimate* of ``chars_per_token`` characters a token (default 4),
  said in the run's warnings: vLLM tokenizes with the model's tokenizer, which kvsim cannot load.
- **random** (``workload.random``: ``input_len``, ``output_len``, ``range_ratio``, ``prefix_len``):
  lengths uniform on the integers [floor(L (1 - r)), ceil(L (1 + r))] from
  ``numpy.random.default_rng(seed)`` as vLLM's ``RandomDataset``; every prompt starts with the same
  ``prefix_len`` tokens (its full blocks are shared, so a prefix cache sees them). kvsim counts no
  special tokens (vLLM subtracts the tokenizer's, often one, from ``input_len``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvsim.errors import KvsimError
from kvsim.spec.jsonfile import JsonError
from kvsim.spec.jsonfile import loads as json_loads
from kvsim.spec.schema import shorten

# vLLM's is_valid_sequence defaults (vllm/benchmarks/datasets/utils.py)
MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048
BENCH_BLOCK_TOKENS = 16


@dataclass(frozen=True)
class BenchConfig:
    """``workload.bench``: vLLM ``bench serve``'s traffic flags (and ShareGPT's length ones)."""

    num_prompts: int = 1000
    request_rate: float = math.inf  # requests per second; inf: all at 0
    burstiness: float = 1.0  # Gamma shape of the gaps; 1: Poisson
    seed: int | None = None  # None: sim.seed
    sharegpt_output_len: int | None = None  # a fixed answer length instead of the second turn's
    chars_per_token: float = 4.0  # ShareGPT turns without "tokens": estimated lengths


@dataclass(frozen=True)
class RandomConfig:
    """``workload.random``: vLLM's ``--random-*`` flags."""

    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 0


def bench_arrivals(n: int, request_rate: float, burstiness: float, seed: int) -> np.ndarray:
    """(n,) arrival times in s, as vLLM's ``get_request`` schedules them (see the module docstring)."""
    if math.isinf(request_rate):
        return np.zeros(n)
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / request_rate)
    else:
        rs = np.random.RandomState(seed)  # vLLM: np.random.seed(args.seed), then np.random.gamma
        gaps = rs.gamma(burstiness, 1.0 / (request_rate * burstiness), n)
    t = np.cumsum(gaps)
    if t[-1] > 0:
        t = t * ((n / request_rate) / t[-1])
    return t.astype(np.float64)


def random_dataset(
    cfg: RandomConfig, n: int, seed: int
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray] | None]:
    """(prompt_tokens, output_tokens, hash_ids or None) of vLLM's random dataset; ids name the
    shared prefix's full blocks 0.. and give every other block an id of its own."""
    r = cfg.range_ratio
    in_lo, in_hi = math.floor(cfg.input_len * (1 - r)), math.ceil(cfg.input_len * (1 + r))
    out_lo = max(math.floor(cfg.output_len * (1 - r)), 1)
    out_hi = max(math.ceil(cfg.output_len * (1 + r)), 1)
    rng = np.random.default_rng(seed)
    inner = rng.integers(in_lo, in_hi + 1, size=n)
    output = rng.integers(out_lo, out_hi + 1, size=n).astype(np.int64)
    prompt = (cfg.prefix_len + inner).astype(np.int64)
    if prompt.min() < 1:
        raise KvsimError(
            f"a prompt can have 0 tokens (prefix_len {cfg.prefix_len} + input_len {cfg.input_len} * "
            f"(1 - range_ratio {r})); raise input_len or prefix_len",
            source="random",
            path="workload.random.range_ratio",
        )
    g = BENCH_BLOCK_TOKENS
    shared = cfg.prefix_len // g
    if shared == 0:
        return prompt, output, None
    blocks = -(-prompt // g)
    own = blocks - shared
    starts = shared + np.cumsum(own) - own
    base = np.arange(shared, dtype=np.int64)
    ids = [
        np.concatenate([base, np.arange(s, s + k, dtype=np.int64)]) for s, k in zip(starts, own, strict=True)
    ]
    return prompt, output, ids


def _turn_len(turn: Any, cpt: float) -> tuple[int, bool]:
    """(tokens, whether estimated) of one turn: its ``tokens`` where given, else its characters / cpt."""
    tok = turn.get("tokens")
    if tok is not None:
        if type(tok) is not int or tok < 0:
            raise ValueError(f"'tokens' must be an integer >= 0, got {shorten(repr(tok))}")
        return tok, False
    value = turn.get("value")
    if not isinstance(value, str):
        raise ValueError(f"a turn's 'value' must be a string, got {type(value).__name__}")
    return round(len(value) / cpt), True


def read_sharegpt(path: Path, cfg: BenchConfig, seed: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(prompt_tokens, output_tokens, estimated, skipped) of `cfg.num_prompts` ShareGPT pairs, picked
    as vLLM's ShareGPTDataset does (module docstring); `estimated`: requests with a length estimated."""
    where = str(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise KvsimError(f"cannot read the dataset: {shorten(str(exc), 120)}", source=where) from None
    try:
        data = json_loads(text)
    except JsonError as exc:
        hint = (
            " (one JSON object a line is a JSONL trace, not ShareGPT's one list)"
            if text.lstrip()[:1] == "{"
            else ""
        )
        raise KvsimError(f"not a ShareGPT file: {exc.message}{hint}", source=where) from None
    if not isinstance(data, list):
        raise KvsimError(
            f"not a ShareGPT file: expected a JSON list of conversations, got a {type(data).__name__}",
            source=where,
        )
    entries = []
    for i, e in enumerate(data):
        if not isinstance(e, dict) or not isinstance(e.get("conversations"), list):
            raise KvsimError(
                f"not a ShareGPT file: entry {i} has no 'conversations' list"
                + (f" (keys: {', '.join(map(str, list(e)[:5]))})" if isinstance(e, dict) else ""),
                source=where,
            )
        if len(e["conversations"]) >= 2:
            entries.append((i, e["conversations"]))
    if not entries:
        raise KvsimError("no conversation with two turns (a prompt and an answer)", source=where)
    rnd = random.Random(seed)
    rnd.shuffle(entries)
    fixed = cfg.sharegpt_output_len
    picked: list[tuple[int, int, bool]] = []
    skipped = 0
    for i, conv in entries:
        if len(picked) >= cfg.num_prompts:
            break
        try:
            if not all(isinstance(t, dict) for t in conv[:2]):
                raise ValueError("a turn must be an object {'from', 'value'}")
            p, est_p = _turn_len(conv[0], cfg.chars_per_token)
            if fixed is None:
                o, est_o = _turn_len(conv[1], cfg.chars_per_token)
            else:
                o, est_o = fixed, False
        except ValueError as exc:
            raise KvsimError(f"entry {i}: {exc}", source=where) from None
        if p < MIN_LEN or (fixed is None and o < MIN_LEN) or p > MAX_PROMPT_LEN or p + o > MAX_TOTAL_LEN:
            skipped += 1
            continue
        picked.append((p, o, est_p or est_o))
    if not picked:
        raise KvsimError(
            f"none of {len(entries)} conversations passes vLLM's length filter (prompt and answer >= "
            f"{MIN_LEN} tokens, prompt <= {MAX_PROMPT_LEN}, both <= {MAX_TOTAL_LEN})",
            source=where,
        )
    if len(picked) < cfg.num_prompts:  # vLLM's maybe_oversample_requests: reseeded, then choices
        picked += random.Random(seed).choices(picked, k=cfg.num_prompts - len(picked))
    prompt = np.array([p for p, _, _ in picked], np.int64)
    output = np.array([o for _, o, _ in picked], np.int64)
    return prompt, output, sum(1 for *_, e in picked if e), skipped

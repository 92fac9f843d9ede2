"""The synthetic generator: sessions of requests with shared system prompts.

Synthetic (``format == "synthetic"``): Poisson or gamma arrivals of sessions; a session's turn t arrives
at its start + t * think_time (no wait for the previous reply, which the generator cannot know). The
session arrival rate is ``rate / session_turns``, so the request rate is ``rate`` in the long run. Turn
t's prompt is the previous prompt + the previous output + new sampled input tokens; with shared system
prompts, each session starts with one of ``shared_prefix_count`` system prompts. ``input``/``output``
distributions apply to each turn's new tokens, clipped to ``[min, max]``. Block ids are 16 tokens and
follow content: full blocks of a system prompt are shared by every session using it, full blocks of a
session's token stream by all its later turns; a prompt's partial last block gets an id of its own.
"""

from __future__ import annotations

import math

import numpy as np

from kvsim.errors import KvsimError
from kvsim.spec.scenario import LengthDist, SyntheticConfig

SYNTHETIC_BLOCK_TOKENS = 16  # vLLM's default KV block size


def _lengths(rng: np.random.Generator, dist: LengthDist, n: int) -> np.ndarray:
    """n lengths (tokens, int64) with the given arithmetic mean and stdev, rounded and clipped."""
    mean, sd = dist.mean, dist.stdev
    if dist.kind == "constant" or (sd == 0.0 and dist.kind in ("uniform", "lognormal")):
        x = np.full(n, mean)
    elif dist.kind == "uniform":
        half = math.sqrt(3.0) * sd  # U(a, b) has stdev (b - a) / sqrt(12)
        x = rng.uniform(mean - half, mean + half, n)
    elif dist.kind == "lognormal":
        sigma2 = math.log1p((sd / mean) ** 2)
        x = rng.lognormal(math.log(mean) - sigma2 / 2.0, math.sqrt(sigma2), n)
    elif dist.kind == "exponential":
        x = rng.exponential(mean, n)
    else:
        raise KvsimError(f"unknown length distribution {dist.kind!r}", source="workload.synthetic")
    return np.clip(np.rint(x), max(dist.lo, 1), max(dist.hi, 1)).astype(np.int64)


def synthetic_workload(
    syn: SyntheticConfig, *, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray] | None, int, list[np.ndarray] | None]:
    """Generate (arrival_s, prompt_tokens, output_tokens, hash_ids, G, output_hash_ids), sorted by
    arrival. ``output_hash_ids[i]``: the ids of the full blocks request i's answer completes (the
    blocks after its prompt's full ones, up to its last stored token) that a later turn of its
    session holds in its prompt; None without multi-turn sessions. ``hash_ids`` is None when no two
    prompts can share a block (no shared prefix, one turn per session): every prompt is then its
    own, as in a trace without hash ids (the engine names its blocks in entries of its own,
    `kvsim.core.block_hash.private_keys`), which saves one id and one cache entry per block."""
    rng = np.random.Generator(np.random.PCG64(seed))
    n, turns, g = syn.num_requests, syn.session_turns, SYNTHETIC_BLOCK_TOKENS
    num_sessions = -(-n // turns)
    rate = syn.rate_per_s / turns  # sessions per second, so requests arrive at rate_per_s
    if syn.arrival == "poisson":
        gaps = rng.exponential(1.0 / rate, num_sessions)
    elif syn.arrival == "gamma":
        gaps = rng.gamma(1.0 / syn.cv**2, syn.cv**2 / rate, num_sessions)
    else:
        raise KvsimError(f"unknown arrival process {syn.arrival!r}", source="workload.synthetic")
    session_start = np.cumsum(gaps) - gaps[0]  # the first session arrives at 0
    new_input = _lengths(rng, syn.input, n)
    output = _lengths(rng, syn.output, n)
    shared = syn.shared_prefix_tokens
    system = rng.integers(syn.shared_prefix_count, size=num_sessions) if shared else np.zeros(num_sessions)

    req = np.arange(n)
    session, turn = req // turns, req % turns
    arrival = session_start[session] + syn.think_time_s * turn
    # Turn t's prompt = shared + sum over earlier turns of (input + output) + its own input.
    grown = np.cumsum(new_input + output) - (new_input + output)
    prompt = shared + grown - grown[session * turns] + new_input

    # Block ids by content. A session's token stream (system prompt, in_0, out_0, in_1, ...) is fixed,
    # and every turn's prompt is a prefix of it, so a full block is named by (session, block index), or
    # (system prompt, block index) while it lies inside the system prompt; a partial last block differs
    # from every other block (the next turn fills it further), so it gets a fresh id.
    sys_blocks = shared // g
    full = prompt // g
    last_full = full[np.minimum((np.arange(num_sessions) + 1) * turns, n) - 1]  # prompts grow per turn
    span = last_full - sys_blocks
    session_base = syn.shared_prefix_count * sys_blocks + np.cumsum(span) - span - sys_blocks
    partial_base = syn.shared_prefix_count * sys_blocks + int(span.sum())

    if not shared and turns == 1:  # nothing to share: no content ids (see the docstring)
        order = np.argsort(arrival, kind="stable")
        return (
            arrival[order].astype(np.float64),
            prompt[order].astype(np.int64),
            output[order].astype(np.int64),
            None,
            g,
            None,
        )
    order = np.argsort(arrival, kind="stable")
    arrival, prompt, output, full, session = (
        arrival[order],
        prompt[order],
        output[order],
        full[order],
        session[order],
    )
    num_blocks = -(-prompt // g)
    first = np.cumsum(num_blocks) - num_blocks
    ids = np.empty(int(num_blocks.sum()), dtype=np.int64)
    system64 = system.astype(np.int64)
    # In slices of requests: the temporaries of one slice stay small (100,000 requests of 1,200
    # tokens are 7.5M blocks; done at once, the temporaries below would peak at about 400 MB).
    step = 4096
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        a, b = int(first[lo]), int(first[hi - 1] + num_blocks[hi - 1])
        owner = np.repeat(req[lo:hi], num_blocks[lo:hi])  # request (in arrival order) of each block
        pos = np.arange(a, b) - first[owner]
        sess = session[owner]
        ids[a:b] = np.where(
            pos < sys_blocks,
            system64[sess] * sys_blocks + pos,
            np.where(pos < full[owner], session_base[sess] + pos, partial_base + owner),
        )
    hash_ids = np.split(ids, first[1:])
    out_ids: list[np.ndarray] | None = None
    if turns > 1:
        # The answer's blocks are the session stream's blocks full[r] .. (prompt + output - 1) // g
        # (the last sampled token is never stored), as far as the session's last prompt reaches.
        stop = np.minimum((prompt + output - 1) // g, last_full[session])
        base = session_base[session]
        out_ids = [
            np.arange(b + f, b + e, dtype=np.int64) if e > f else _EMPTY
            for b, f, e in zip(base.tolist(), full.tolist(), stop.tolist(), strict=True)
        ]
    return (
        arrival.astype(np.float64),
        prompt.astype(np.int64),
        output.astype(np.int64),
        hash_ids,
        g,
        out_ids,
    )


_EMPTY = np.zeros(0, dtype=np.int64)

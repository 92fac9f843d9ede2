"""Speculative decoding's acceptance: how many draft tokens a verify step keeps, and its tallies.

With ``scheduler.spec_decode`` on, a decoding request's step is a verify step: it computes its last
sampled token plus ``d`` draft tokens (``d = min(k, output left - 1, token budget left - 1)``; with
``d = 0`` the row is a plain decode) and keeps the leading run of accepted drafts plus one token the
target samples itself (the bonus or the correction), so a step emits ``accepted + 1`` tokens.

Acceptance: each request has a rate ``alpha`` (a constant, or drawn once per request from a Beta of
the given mean and concentration ``alpha + beta``), and draft position j is accepted independently
with probability ``alpha`` (the model of Leviathan et al. 2023, "Fast Inference from Transformers
via Speculative Decoding", section 3.1). The accepted count is then geometric capped at ``d``:
P(accepted >= j) = alpha^j, drawn from one uniform u as the number of j in 1..d with u < alpha^j.
The uniform is a counter-based hash (SplitMix64) of (seed, request id, the request's verify-step
index), and the Beta draw a generator seeded by (seed, request id), so the numbers do not depend on
which replica, window or order asks: fast-forward and stepping draw the same ones.

KV rollback, as vLLM v1 models it (``Scheduler.update_from_output``: ``num_computed_tokens`` is
decreased by the rejected drafts): the step's blocks for ``c + 1 + d`` slots are allocated before
it; after it ``num_computed`` stands at ``c + 1 + accepted`` and the slots of the ``d - accepted``
rejected drafts are written and discarded. Their blocks stay allocated to the request (not freed,
even when one holds only rejected slots) and the next step writes over them; they are released
with the request. So peak memory includes up to ``k`` look-ahead slots per running request.
"""

from __future__ import annotations

import numpy as np

_MASK = (1 << 64) - 1
_BETA_SALT = 0x5EC0DE  # keeps the Beta stream apart from other users of (seed, request id)


def _mix(x: int) -> int:
    """SplitMix64's finaliser (Steele, Lea and Flood 2014): a bijection of 64-bit ints."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def uniform(seed: int, req_id: int, step: int) -> float:
    """A uniform in [0, 1) that depends only on (seed, request id, step index)."""
    return (_mix(_mix(_mix(seed & _MASK) ^ (req_id & _MASK)) ^ (step & _MASK)) >> 11) / float(1 << 53)


def accepted_drafts(rate: float, u: float, d: int) -> int:
    """Leading accepted drafts among `d`, each accepted with probability `rate`, from uniform `u`."""
    a, p = 0, rate
    while a < d and u < p:
        a += 1
        p *= rate
    return a


class SpecDecoder:
    """The acceptance model of one run (all replicas share it) and its tallies."""

    def __init__(self, k: int, *, mean: float, concentration: float | None, seed: int) -> None:
        if k < 1:
            raise ValueError(f"draft length k must be >= 1, got {k}")
        if not 0.0 <= mean <= 1.0:
            raise ValueError(f"acceptance mean must lie in [0, 1], got {mean}")
        if concentration is not None and (concentration <= 0 or not 0.0 < mean < 1.0):
            raise ValueError("a Beta acceptance needs concentration > 0 and mean in (0, 1)")
        self.k = k
        self.mean = mean
        self.concentration = concentration  # None: every request's rate is `mean`
        self.seed = seed
        self._rates: dict[int, float] = {}
        # Tallies, every replica together (verify rows, not steps: one step verifies many rows).
        self.verify_rows = 0
        self.accepted_hist = [0] * (k + 1)  # rows by accepted drafts
        self.drafted_tokens = 0
        self.accepted_tokens = 0
        self.discarded_tokens = 0  # KV slots written for rejected drafts, then rolled back

    def rate(self, req_id: int) -> float:
        """The request's acceptance rate: the mean, or its own draw from the Beta."""
        if self.concentration is None:
            return self.mean
        r = self._rates.get(req_id)
        if r is None:
            rng = np.random.default_rng(np.random.SeedSequence([self.seed, _BETA_SALT, req_id]))
            c = self.concentration
            r = self._rates[req_id] = float(rng.beta(self.mean * c, (1.0 - self.mean) * c))
        return r

    def draw(self, req_id: int, step: int, d: int) -> int:
        """Accepted drafts of the request's verify step number `step` with `d` drafts (no tally)."""
        return accepted_drafts(self.rate(req_id), uniform(self.seed, req_id, step), d)

    def verify(self, req_id: int, step: int, d: int) -> int:
        """`draw`, tallied: the step ran."""
        a = self.draw(req_id, step, d)
        self.tally(d, a)
        return a

    def tally(self, d: int, a: int) -> None:
        """Count a verify row that ran: `d` drafts, `a` of them accepted."""
        self.verify_rows += 1
        self.accepted_hist[a] += 1
        self.drafted_tokens += d
        self.accepted_tokens += a
        self.discarded_tokens += d - a

"""Prefix identity: cache entries from a trace's per-block hash ids.

Traces identify prompt content by one id per G-token block (Mooncake: G = 512), and the ids are
prefix-unique: an id fixes the whole prompt up to the end of its block, so no hash chaining is
needed. The engine caches B-token blocks; a cache entry groups the engine blocks of one prompt
that share a trace block:

- G a multiple of B: one entry per trace block, keyed by its id, covering the full engine blocks
  inside it (G/B, fewer for a partial last trace block).
- B a multiple of G: one entry per engine block, keyed by the id of the last trace block inside
  it (which fixes the whole prefix).

Only blocks entirely inside the prompt are cached (vLLM caches full blocks only). Generated tokens
are not: no trace says what a response contains.
"""

from __future__ import annotations

import numpy as np


def block_keys(
    hash_ids: np.ndarray, prompt_tokens: int, hash_block_tokens: int, block_size: int
) -> tuple[list[int], list[int]]:
    """(entry keys, engine blocks per entry) of one prompt, as Python ints for fast dict work."""
    n_full = prompt_tokens // block_size
    if n_full == 0:
        return [], []
    g, b = hash_block_tokens, block_size
    if g % b == 0:
        r = g // b
        n_groups = -(-n_full // r)
        sizes = [r] * n_groups
        sizes[-1] = n_full - r * (n_groups - 1)
        return hash_ids[:n_groups].tolist(), sizes
    if b % g == 0:
        r = b // g
        j = np.arange(n_full, dtype=np.int64)
        return hash_ids[(j + 1) * r - 1].tolist(), [1] * n_full
    raise ValueError(f"block size {b} and trace block {g} must divide one another")

"""Prefix identity: cache entries from a trace's per-block hash ids.

Traces identify prompt content by one id per G-token block (Mooncake: G = 512), and the ids are
prefix-unique: an id fixes the whole prompt up to the end of its block, so no hash chaining is
needed. The engine caches B-token blocks; a cache entry groups the engine blocks of one prompt
that share a trace block:

- G a multiple of B: one entry per trace block, keyed by its id, covering the full engine blocks
  inside it (G/B, fewer for a partial last trace block).
- B a multiple of G: one entry per engine block, keyed by the id of the last trace block inside
  it (which fixes the whole prefix).

Only full blocks are cached (vLLM caches full blocks only). Where no source names the content:

- a trace without hash ids: each prompt's full blocks get keys of their own (`private_keys`), in
  entries of `PRIVATE_ENTRY_BLOCKS` blocks, so a request preempted and recomputed hits its own
  prompt, as in vLLM, while no two requests share;
- generated tokens: when a request releases its blocks (finish or preemption), its full blocks
  past the prompt's are cached under keys of their own (one entry), so its recompute hits them;
  where the workload names an answer's blocks (synthetic sessions, whose next turn's prompt holds
  the previous answer) they are cached under those ids instead, and the next turn hits them.
  vLLM caches generated blocks as they fill; here they are cached when released, so a turn that
  arrives while the previous one is still generating (open-loop sessions) does not hit its answer.

Private keys lie above every int64 id a trace can carry (`PRIVATE_KEY_BASE`), so they never
collide with trace ids.
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


PRIVATE_KEY_BASE = 1 << 64  # above any int64 trace id
PRIVATE_ENTRY_BLOCKS = 32  # blocks per private prompt entry: 512 tokens at 16, as Mooncake's trace blocks


def private_key(request_id: int, first_block: int) -> int:
    """The key of request `request_id`'s own entry that starts at engine block `first_block`."""
    return PRIVATE_KEY_BASE + (request_id << 32) + first_block


def private_keys(request_id: int, num_full_blocks: int) -> tuple[list[int], list[int]]:
    """(entry keys, blocks per entry) naming one prompt's full blocks as its own."""
    r = PRIVATE_ENTRY_BLOCKS
    starts = range(0, num_full_blocks, r)
    return [private_key(request_id, b) for b in starts], [min(r, num_full_blocks - b) for b in starts]

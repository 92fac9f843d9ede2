"""Timing-free LRU replay of a Mooncake trace: the prefix hit ratio of one cluster-wide cache.

An independent check of kvsim's global prefix pool (it imports nothing from kvsim): requests in
arrival order; each looks up the longest run of its prompt's cache entries in one LRU of a given
capacity (engine blocks), hits that run (at least one token is computed, as vLLM and kvsim do),
then inserts all its full entries. An entry is one trace block (512 tokens) of full 16-token engine
blocks, the last one partial, as kvsim's `block_keys`. No timing: a request sees every earlier
request's blocks, however close their arrivals; generated tokens are not cached (the Mooncake
trace names none).

    python bench/lru_replay.py [--trace scenarios/traces/mooncake/conversation_trace.jsonl]
        [--capacity-blocks N ...] [--block-bytes B] [--json out.json]

Prints the hit ratio (hit prompt tokens / prompt tokens) per capacity, infinite first.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import OrderedDict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRACE_BLOCK = 512  # Mooncake's hash block (FAST25-README.md)
BLOCK = 16  # kvsim's default engine block


def load(path: Path) -> list[tuple[int, list[int]]]:
    out = []
    with path.open() as f:
        for line in f:
            r = json.loads(line)
            out.append((int(r["input_length"]), [int(h) for h in r["hash_ids"]]))
    return out


def entries(prompt: int, ids: list[int]) -> list[tuple[int, int]]:
    """(key, engine blocks) of the prompt's full engine blocks, one entry per trace block."""
    full = prompt // BLOCK
    per = TRACE_BLOCK // BLOCK
    out = []
    for i, h in enumerate(ids):
        n = min(per, full - i * per)
        if n <= 0:
            break
        out.append((h, n))
    return out


def replay(reqs: list[tuple[int, list[int]]], capacity: float) -> dict[str, float]:
    lru: OrderedDict[int, int] = OrderedDict()
    used = 0
    hit_tokens = prompt_tokens = 0
    for prompt, ids in reqs:
        es = entries(prompt, ids)
        covered = 0
        for k, n in es:
            if k not in lru:
                break
            covered += n
        hit_tokens += min(covered, (prompt - 1) // BLOCK) * BLOCK
        prompt_tokens += prompt
        for k, n in es:
            if k in lru:
                lru.move_to_end(k)
                continue
            if n > capacity:
                continue
            while used + n > capacity:
                _, dropped = lru.popitem(last=False)
                used -= dropped
            lru[k] = n
            used += n
    return {
        "capacity_blocks": capacity,
        "hit_ratio": hit_tokens / prompt_tokens,
        "prompt_tokens": prompt_tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=ROOT / "scenarios/traces/mooncake/conversation_trace.jsonl")
    ap.add_argument("--capacity-blocks", type=float, nargs="*", default=[])
    ap.add_argument("--block-bytes", type=float, default=0.0, help="print capacities in GB of this block")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    reqs = load(args.trace)
    rows = [replay(reqs, c) for c in [math.inf, *args.capacity_blocks]]
    for r in rows:
        cap = r["capacity_blocks"]
        size = f" ({cap * args.block_bytes / 1e9:,.1f} GB)" if args.block_bytes and math.isfinite(cap) else ""
        print(f"capacity {cap:>14,.0f} blocks{size}: hit ratio {r['hit_ratio']:.4f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()

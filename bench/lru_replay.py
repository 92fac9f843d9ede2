"""Timing-free LRU replay of a Mooncake trace: the prefix hit ratio of one cluster-wide cache.

An independent check of kvsim's global prefix pool (it imports nothing from kvsim): requests in
arrival order; each looks up the longest run of its prompt's cache entries in one LRU of a given
capacity (engine blocks), hits that run (at least one token is computed, as vLLM and kvsim do),
then inserts all its full entries. An entry is one trace block (512 tokens) of full 16-token engine
blocks, the last one partial, as kvsim's `block_keys`. No timing: a request sees every earlier
request's blocks, however close their arrivals; generated tokens are not cached (the Mooncake
trace names none).

    python bench/lru_replay.py [--trace scenarios/traces/mooncake/conversation_trace.jsonl]
        [--capacity-blocks N ...] [--capacity-tokens T ...] [--local-nodes K] [--json out.json]
        [--eviction lru|lfu] [--chunk-tokens C]

``--chunk-tokens C`` (a multiple of 16 dividing 512) stores and hits entries in whole C-token chunks,
as LMCache does with its 256-token chunks: an entry keeps only its whole chunks (the partial chunk
at a prompt's end is not stored) and a hit on an entry cut that way ends the prefix there. It
measures what kvsim's host tier, keyed by whole trace blocks, leaves out of the ``lmcache`` preset.

``--eviction lfu`` replays an LFU instead (fewest uses first, the least recently used of those; a
use is an insert, of a new entry or of one present; a dropped entry's count is forgotten), kept with
a lazy heap here, independently of the O(1) buckets of kvsim's `kvsim.core.tiers`.

Prints the hit ratio (hit prompt tokens / prompt tokens) per capacity, infinite first. With
``--local-nodes K`` it also replays K separate caches of each capacity (the Mooncake paper's
local-cache setup, section 5.3.2: each request goes to the node with the longest prefix match
beyond one trace block, ties and the rest to the next node in turn), beside one global cache of K times that capacity.
"""

from __future__ import annotations

import argparse
import heapq
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


def entries(prompt: int, ids: list[int], chunk_blocks: int = 1) -> list[tuple[int, int]]:
    """(key, engine blocks) of the prompt's full engine blocks, one entry per trace block; with
    `chunk_blocks`, each cut to its whole chunks and the entries after a cut one dropped."""
    full = prompt // BLOCK
    per = TRACE_BLOCK // BLOCK
    out = []
    for i, h in enumerate(ids):
        n = min(per, full - i * per)
        if n <= 0:
            break
        whole = n // chunk_blocks * chunk_blocks
        if whole:
            out.append((h, whole))
        if whole < n:
            break
    return out


class Cache:
    """One LRU of entries, capacity in engine blocks."""

    def __init__(self, capacity: float) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[int, int] = OrderedDict()
        self.used = 0

    def covered(self, es: list[tuple[int, int]]) -> int:
        n_blocks = 0
        for k, n in es:
            if k not in self.lru:
                break
            n_blocks += n
        return n_blocks

    def insert(self, es: list[tuple[int, int]]) -> None:
        lru = self.lru
        for k, n in es:
            if k in lru:
                lru.move_to_end(k)
                continue
            if n > self.capacity:
                continue
            while self.used + n > self.capacity:
                _, dropped = lru.popitem(last=False)
                self.used -= dropped
            lru[k] = n
            self.used += n


class LFUCache(Cache):
    """One LFU of entries: a heap of (uses, last use, key), stale items skipped when popped."""

    def __init__(self, capacity: float) -> None:
        super().__init__(capacity)
        self.uses: dict[int, tuple[int, int]] = {}  # key -> (uses, last use)
        self.heap: list[tuple[int, int, int]] = []
        self.clock = 0

    def insert(self, es: list[tuple[int, int]]) -> None:
        lru, uses, heap = self.lru, self.uses, self.heap
        for k, n in es:
            self.clock += 1
            if k in lru:
                u = (uses[k][0] + 1, self.clock)
                uses[k] = u
                heapq.heappush(heap, (*u, k))
                continue
            if n > self.capacity:
                continue
            while self.used + n > self.capacity:
                u0, t0, old = heapq.heappop(heap)
                if uses.get(old) != (u0, t0):
                    continue  # stale: the entry was used since, or dropped
                del uses[old]
                self.used -= lru.pop(old)
            lru[k] = n
            uses[k] = (1, self.clock)
            heapq.heappush(heap, (1, self.clock, k))
            self.used += n


def replay(
    reqs: list[tuple[int, list[int]]],
    capacity: float,
    nodes: int = 1,
    eviction: str = "lru",
    chunk_blocks: int = 1,
) -> dict[str, float]:
    kind = LFUCache if eviction == "lfu" else Cache
    caches = [kind(capacity) for _ in range(nodes)]
    turn = 0
    hit_tokens = prompt_tokens = 0
    for prompt, ids in reqs:
        es = entries(prompt, ids, chunk_blocks)
        cover = [c.covered(es) for c in caches]
        best = max(cover)
        # Longest match wins, but a match of one trace block or less (the conversation trace's
        # first block is one system prompt shared by nearly all requests) counts as none: those go
        # round robin, else every request would pile onto the first node (load is not modelled).
        pick = (
            [i for i, v in enumerate(cover) if v == best]
            if best > TRACE_BLOCK // BLOCK
            else list(range(nodes))
        )
        i = pick[turn % len(pick)]
        turn += 1
        hit_tokens += min(best, (prompt - 1) // BLOCK) * BLOCK
        prompt_tokens += prompt
        caches[i].insert(es)
    return {
        "capacity_blocks": capacity,
        "nodes": nodes,
        "hit_ratio": hit_tokens / prompt_tokens,
        "prompt_tokens": prompt_tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=ROOT / "scenarios/traces/mooncake/conversation_trace.jsonl")
    ap.add_argument("--capacity-blocks", type=float, nargs="*", default=[])
    ap.add_argument("--capacity-tokens", type=float, nargs="*", default=[], help="capacities in tokens")
    ap.add_argument("--local-nodes", type=int, default=0)
    ap.add_argument("--block-bytes", type=float, default=0.0, help="print capacities in GB of this block")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--eviction", choices=("lru", "lfu"), default="lru")
    ap.add_argument("--chunk-tokens", type=int, default=BLOCK)
    args = ap.parse_args()
    if args.chunk_tokens % BLOCK or TRACE_BLOCK % args.chunk_tokens:
        ap.error(f"--chunk-tokens must be a multiple of {BLOCK} dividing {TRACE_BLOCK}")
    cb = args.chunk_tokens // BLOCK
    reqs = load(args.trace)
    caps = [math.inf, *args.capacity_blocks, *(t / BLOCK for t in args.capacity_tokens)]
    ev = args.eviction
    rows = [replay(reqs, c, eviction=ev, chunk_blocks=cb) for c in caps]
    if args.local_nodes:
        k = args.local_nodes
        for c in caps[1:]:
            rows.append(replay(reqs, c, k, eviction=ev, chunk_blocks=cb))
            rows.append(replay(reqs, c * k, eviction=ev, chunk_blocks=cb))
    for r in rows:
        cap = r["capacity_blocks"]
        size = f" ({cap * args.block_bytes / 1e9:,.1f} GB)" if args.block_bytes and math.isfinite(cap) else ""
        where = f"{r['nodes']} local caches of" if r["nodes"] > 1 else "one cache of"
        print(
            f"{where} {cap:>14,.0f} blocks ({cap * BLOCK / 1e6:,.1f}M tokens){size}: hit ratio {r['hit_ratio']:.4f}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()

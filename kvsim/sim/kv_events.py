"""The replicas' KV events in vLLM's schema (``kvsim run --kv-events FILE.jsonl``), and a reader.

vLLM (``vllm/distributed/kv_events.py``) publishes ``KVEventBatch{ts, events, data_parallel_rank}``
with ``BlockStored{block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium}``,
``BlockRemoved{block_hashes, medium}`` and ``AllBlocksCleared``. Here one batch is one JSON line,
an object with those field names (each event tagged by ``"type"``, msgspec's default tag field),
holding a replica's events of one simulated instant: ``ts`` is simulated seconds since the run's
start (vLLM: wall-clock epoch seconds), ``data_parallel_rank`` the replica's index. Lines are in
``ts`` order; at one instant, in the order the simulation made them.

What kvsim knows of a block (docs/architecture.md, "KV events"): a block hash is a cache entry's key
(`kvsim.core.block_hash`: a trace's hash id, or a key of the request's own above 2**64 for prompts
without hash ids and for generated blocks), and an entry covers one or more engine blocks, so a
``BlockStored`` names entries of one size, ``block_size`` their tokens (entries x engine block
tokens). ``token_ids`` is always ``[]`` (a trace carries no tokens), ``lora_id`` null. ``medium``:
``GPU`` for a replica's HBM pool, ``CPU`` for its node's host-DRAM tier (``kv.offload``; shared by
the node's replicas: a batch's rank is the replica whose write changed it), ``DISK`` for the node's
SSD; the global pool's entries are not reported. kvsim never clears a cache, so ``AllBlocksCleared``
never appears.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvsim.core.block_pool import BlockStored, PoolEvent
from kvsim.errors import KvsimError

if TYPE_CHECKING:
    from kvsim.sim.offload import ReplicaClock

GPU, CPU, DISK = "GPU", "CPU", "DISK"


class KVEventLog:
    """The events of a run, as they happen: (ts, rank, vLLM event dict)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size  # engine block tokens
        self.records: list[tuple[float, int, dict[str, Any]]] = []

    def pool_sink(self, rank: int, replica: ReplicaClock) -> ReplicaSink:
        """The listener of replica `rank`'s HBM pool (`BlockPool.listen`), stamping by its clock."""
        return ReplicaSink(self, rank, replica)

    def stored(
        self,
        ts: float,
        rank: int,
        keys: tuple[int, ...],
        sizes: tuple[int, ...],
        parent: int | None,
        medium: str,
    ) -> None:
        """Entries stored: one `BlockStored` per run of equal-size entries (its ``block_size``)."""
        i = 0
        while i < len(keys):
            j = i + 1
            while j < len(keys) and sizes[j] == sizes[i]:
                j += 1
            self.records.append(
                (
                    ts,
                    rank,
                    {
                        "type": "BlockStored",
                        "block_hashes": list(keys[i:j]),
                        "parent_block_hash": parent if i == 0 else keys[i - 1],
                        "token_ids": [],
                        "block_size": sizes[i] * self.block_size,
                        "lora_id": None,
                        "medium": medium,
                    },
                )
            )
            i = j

    def removed(self, ts: float, rank: int, keys: list[int] | tuple[int, ...], medium: str) -> None:
        if keys:
            self.records.append(
                (ts, rank, {"type": "BlockRemoved", "block_hashes": list(keys), "medium": medium})
            )

    def batches(self) -> Iterator[dict[str, Any]]:
        """`KVEventBatch` objects: a replica's consecutive events of one instant each, in ts order
        (stable: at one instant, the simulation's order, which a node's shared tiers need)."""
        recs = sorted(self.records, key=lambda r: r[0])
        i = 0
        while i < len(recs):
            ts, rank = recs[i][0], recs[i][1]
            j = i
            while j < len(recs) and recs[j][0] == ts and recs[j][1] == rank:
                j += 1
            yield {"ts": ts, "events": [r[2] for r in recs[i:j]], "data_parallel_rank": rank}
            i = j

    def write(self, path: Path) -> int:
        """Write the batches as JSON lines; returns the number of batches."""
        n = 0
        with path.open("w", encoding="utf-8") as f:
            for batch in self.batches():
                f.write(json.dumps(batch, allow_nan=False, separators=(",", ":")) + "\n")
                n += 1
        return n


class ReplicaSink:
    """A replica pool's listener: its events at the replica's clock, or at `at` where set (a load
    that arrives mid-step caches its entries at its arrival)."""

    def __init__(self, log: KVEventLog, rank: int, replica: ReplicaClock) -> None:
        self.log = log
        self.rank = rank
        self.replica = replica
        self.at: float | None = None

    def __call__(self, ev: PoolEvent) -> None:
        ts = self.replica.clock if self.at is None else self.at
        if isinstance(ev, BlockStored):
            self.log.stored(ts, self.rank, ev.keys, ev.sizes, ev.parent, GPU)
        else:  # BlockRemoved, or BlockRewritten: the entry left the index (no prefix hit any more)
            self.log.removed(ts, self.rank, ev.keys, GPU)


def read_kv_events(path: Path | str) -> Iterator[dict[str, Any]]:
    """The batches of a KV events file, one per line."""
    with Path(path).open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def cache_state(
    batches: Iterator[dict[str, Any]], node_of: Callable[[int], int] | None = None
) -> dict[tuple[int, str], set[int]]:
    """Replay batches: (rank, medium) -> the block hashes cached there at the end. A node's CPU and
    DISK tiers are shared by its replicas: with `node_of` (rank -> node) they are replayed as one,
    keyed (node, medium)."""
    state: dict[tuple[int, str], set[int]] = {}
    for batch in batches:
        rank = batch["data_parallel_rank"]
        for ev in batch["events"]:
            kind = ev["type"]
            if kind == "AllBlocksCleared":
                for (r, _), held in state.items():
                    if r == rank:
                        held.clear()
                continue
            medium = ev["medium"]
            where = rank if medium == GPU or node_of is None else node_of(rank)
            held = state.setdefault((where, medium), set())
            if kind == "BlockStored":
                held.update(ev["block_hashes"])
            else:
                held.difference_update(ev["block_hashes"])
    return state


def check_events_path(
    path: str, *, reads: tuple[tuple[str, Path | None], ...], out: Path, writes: tuple[str, ...], force: bool
) -> Path:
    """Check before the run that the events file may be written (nothing is written here): not
    empty, not a folder, none of the files the command reads, none of the files it writes into
    `out`, in a folder that exists and is writable; an existing file only when kvsim wrote it (its
    first line a batch) or with `force`."""
    flag = "--kv-events"
    if not path.strip():
        raise KvsimError("empty path (an unset shell variable?); give a file", source=flag)
    p = Path(path)
    if p.is_dir():
        raise KvsimError(f"{path} is a directory; give a file", source=flag)
    for what, q in reads:
        if q is not None and (_same(p, q) or p.resolve() == q.resolve()):
            raise KvsimError(f"{path} is the {what} this command reads; choose another file", source=flag)
    if p.resolve().parent == out.resolve() and p.name in writes:
        raise KvsimError(f"{path} is a file kvsim writes into --out; choose another name", source=flag)
    folder = p.parent
    if not folder.is_dir():
        raise KvsimError(f"folder {folder} does not exist", source=flag)
    if not os.access(folder, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise KvsimError(f"cannot write {path}: permission denied", source=flag)
    if p.exists() and not force and not _is_events_file(p):
        raise KvsimError(
            f"{path} exists and was not written by kvsim; use --force to replace it", source=flag
        )
    return p


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _is_events_file(p: Path) -> bool:
    """Empty, or its first line is a `KVEventBatch` object."""
    try:
        with p.open(encoding="utf-8") as f:
            line = f.readline()
        if not line:
            return True
        first = json.loads(line)
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(first, dict) and {"ts", "events", "data_parallel_rank"} <= first.keys()

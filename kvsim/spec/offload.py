"""Host-DRAM offload settings (``kv.offload``) and the presets that reproduce real systems' defaults.

``kv.offload`` turns on a second-level prefix cache in each node's host DRAM (`kvsim.core.tiers`):

- ``write``: ``back`` copies a cached entry to DRAM when HBM evicts it (SGLang HiCache's
  ``write_back``); ``through`` copies every new cache entry as it is registered (vLLM's
  offloading connector, LMCache, SGLang HiCache's default ``write_through``);
- ``copy``: ``batched`` moves a transfer's blocks in one gather/scatter call (a copy kernel:
  SGLang's ``--hicache-io-backend kernel``, LMCache's GPU connector); ``per_block`` makes one
  ``cudaMemcpyAsync`` per engine block (vLLM's ``swap_blocks``), paying the link's per-call
  overhead each time (../shared/REFERENCE.md: about 2.3 us; 6-15 GB/s for 32 KB blocks);
- capacity per node: ``host_bytes``, or ``host_share`` of ``cluster.host_dram``, or
  ``hbm_ratio`` times the KV pools of the node's replicas (SGLang's ``--hicache-ratio``); none
  given: all of ``cluster.host_dram``;
- ``ssd``: a third tier per node, a local NVMe (``{capacity, read_bw, write_bw, latency}``): what
  LRU drops from DRAM is demoted to it over the SSD's write link, and a lookup continues into it;
  a load from it reads over the SSD's read link, then crosses PCIe (SGLang HiCache's and LMCache's
  disk tiers);
- ``load``: ``stall`` (default: the request waits for its whole load, then prefills) or
  ``overlap`` (the load is hidden layer by layer behind the prefill, as LMCache's and SGLang
  HiCache's layer-wise loading do: the request starts its prefill so that it ends no earlier than
  the load, waiting only for what the load takes beyond the prefill; the prefill's time is the cost
  model's price of its first chunk alone, an estimate: in a batch with others it runs longer);
- ``cold_after_steps``: a cached HBM entry no request has touched for that many steps moves down to
  DRAM (the design documents' cold threshold; running requests touch their blocks every step, so
  only cached-but-free entries go cold). Off unless given; 0 is an error;
- ``eviction``: ``lru`` (default, what every preset's system does) or ``lfu`` (fewest uses first,
  the least recently used of those; `kvsim.core.tiers`), in the node's DRAM tier and its SSD tier.
  The global pool has its own, ``kv.prefix_cache.pool_eviction``.

A preset (``preset: vllm | sglang_hicache | lmcache``) supplies defaults for the fields the scenario
does not give; each preset's function says where its numbers come from. What the presets cannot
reproduce: LMCache's 256-token chunks (kvsim's entries are the trace's hash blocks: see `lmcache`
for what that changes and by how much), vLLM's
"prompt blocks only" (kvsim also writes through a finished request's answer blocks, as the HBM
prefix cache keeps them), and the asynchronous store that lets vLLM skip a write the link is too
busy for (kvsim queues every write).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

EVICTIONS = ("lru", "lfu")  # a lower tier's eviction policies (`kvsim.core.tiers`)


class OffloadWrite(str, Enum):
    BACK = "back"  # copy on eviction from HBM
    THROUGH = "through"  # copy every new entry when it is registered

    def __str__(self) -> str:
        return str(self.value)


class CopyMode(str, Enum):
    BATCHED = "batched"  # one gather/scatter call per transfer
    PER_BLOCK = "per_block"  # one copy call per engine block

    def __str__(self) -> str:
        return str(self.value)


@dataclass(frozen=True)
class OffloadConfig:
    enabled: bool = False
    host_bytes: int = 0  # host DRAM per node given to KV (0: see host_share, hbm_ratio)
    host_share: float = 0.0  # share of cluster.host_dram per node (0: not given)
    hbm_ratio: float = 0.0  # capacity = ratio x the KV pools of the node's replicas (0: not given)
    per_replica_bytes: int = 0  # capacity = this x the node's replicas (presets only; 0: not given)
    write: OffloadWrite = OffloadWrite.BACK
    copy: CopyMode = CopyMode.BATCHED
    preset: str = "none"
    ssd: SSDConfig | None = None
    cold_after_steps: int = 0  # 0: off
    load: str = "stall"  # stall | overlap
    eviction: str = "lru"  # lru | lfu, in the node's DRAM and SSD tiers (`kvsim.core.tiers`)


# A PCIe Gen5 NVMe data-centre SSD: Samsung PM1743, sequential read 13,000 MB/s and write
# 6,600 MB/s (Samsung datasheet). Latency: 100 us, an estimate of one NVMe read's service time
# (published 4 KB random-read latencies are 70-100 us); no measurement on file.
SSD_READ_BW = 13.0e9
SSD_WRITE_BW = 6.6e9
SSD_LATENCY_S = 100e-6


@dataclass(frozen=True)
class SSDConfig:
    capacity_bytes: int  # per node
    read_bw: float = SSD_READ_BW
    write_bw: float = SSD_WRITE_BW
    latency_s: float = SSD_LATENCY_S


def vllm() -> dict[str, Any]:
    """vLLM v1's ``OffloadingConnector`` with its CPU backend (``vllm/v1/kv_offload/``): every
    computed block is stored to CPU asynchronously, skipping blocks already there (write-through,
    missing only); loads are asynchronous; the CPU side evicts LRU; the CPU<->GPU copies go
    through ``swap_blocks``, one ``cudaMemcpyAsync`` per block (../shared/REFERENCE.md, FlexKV PR
    #193/#203). The CPU capacity is the user's (``num_cpu_blocks``): no default, so the scenario's
    capacity (all of ``cluster.host_dram`` unless given) applies."""
    return {"write": OffloadWrite.THROUGH, "copy": CopyMode.PER_BLOCK}


def sglang_hicache() -> dict[str, Any]:
    """SGLang HiCache (``mem_cache/hiradix_cache.py``, ``managers/cache_controller.py``) as its best-
    practice guide configures it (docs/advanced_features/hicache_best_practices.md):
    ``--hicache-ratio 2`` (host pool twice the device pool), ``--hicache-io-backend kernel``
    (batched gather/scatter kernels), ``--hicache-write-policy write_through``."""
    return {"write": OffloadWrite.THROUGH, "copy": CopyMode.BATCHED, "hbm_ratio": 2.0}


def lmcache() -> dict[str, Any]:
    """LMCache's local CPU backend: every prefill's KV is stored (write-through), with its GPU
    connector's gather kernel (batched), LRU, and ``max_local_cpu_size`` 5 GB per serving instance
    (LMCache's configuration default; the disk tier behind it is not simulated).

    Its 256-token chunks are not reproduced: kvsim's host tier stores, looks up and moves the HBM
    pool's entries, one per trace hash block (512 tokens on the Mooncake traces: two whole chunks)
    of full 16-token engine blocks. What is the same: every full entry, hence every chunk of a
    Mooncake trace block, is stored and loaded whole, and a prefix hit ends at an entry boundary,
    which is a chunk boundary there. What differs: (1) the partial chunk at a prompt's end (its full
    engine blocks past the last 256-token boundary) is stored and loaded by kvsim, not by LMCache
    (which keeps whole chunks only); (2) with a trace of hash blocks shorter than 256 tokens kvsim
    hits to the entry, LMCache only to a whole chunk (up to 255 tokens fewer per hit); (3) the
    bytes of a transfer are the entries' blocks, not rounded to chunks. Measured with a timing-free
    replay (`bench/lru_replay.py --chunk-tokens 256`, BENCHMARKS.md): (1) is 1.0% of the
    conversation trace's cacheable prompt tokens and moves its hit ratio by 0.01 points unbounded
    and 0.1 points with a 3M-token cache (the synthetic trace: 0.04 and 0.17 points)."""
    return {"write": OffloadWrite.THROUGH, "copy": CopyMode.BATCHED, "per_replica_bytes": 5 * 10**9}


PRESETS = {"vllm": vllm, "sglang_hicache": sglang_hicache, "lmcache": lmcache}

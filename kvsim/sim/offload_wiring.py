"""The SimPy wiring of the tiers below HBM for one run: the host tiers (one per node), the SSD
tiers, the swap space, the global pool or its pool nodes, the link queues (per PCIe group and NIC
group, each direction), and per replica its side of them (`side`: its lanes, its lookup and swap
decision, which its scheduler is built with) and then its `OffloadPort` (`kvsim.sim.offload`)
over that side and the scheduler (`port`).

Built once by `kvsim.sim.assembly` from the scenario; the summary's records of it are built in
`kvsim.results.summarize`. Design: docs/architecture.md ("The run, assembled").
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import simpy

from kvsim.core.memory_plan import MemoryPlan
from kvsim.core.request import Request
from kvsim.core.sched.scheduler import Scheduler
from kvsim.core.tiers import GlobalPool, HostTier, PoolNodes
from kvsim.costs.base import CostModel, ForwardBatch
from kvsim.errors import KvsimError
from kvsim.sim.kv_events import ReplicaSink
from kvsim.sim.links import FairLinkQueue, LinkQueue
from kvsim.sim.offload import (
    GlobalSide,
    OffloadPort,
    OffloadStats,
    ReplicaClock,
    ReplicaTiers,
    SSDSide,
    SwapPolicy,
    SwapSpace,
    TierView,
)
from kvsim.spec.offload import CopyMode
from kvsim.spec.scenario import Scenario
from kvsim.spec.topology import Link


class OffloadWiring:
    """The host tiers (one per node) and host links (per PCIe group, each direction) of a run."""

    def __init__(self, sc: Scenario, plan: MemoryPlan, env: simpy.Environment, cost: CostModel) -> None:
        c = sc.cluster
        self.sc, self.env, self.cost = sc, env, cost
        self.per_node = c.gpus_per_node // c.tensor_parallel  # replicas on a node
        self.block_bytes_per_gpu = plan.block_bytes_per_gpu
        self.block_bytes = plan.block_bytes_per_gpu * c.tensor_parallel  # a replica's block, all its GPUs
        self.capacity_bytes = 0
        if sc.kv.offload.enabled and sc.kv.offload.load == "overlap" and c.topology.sharing == "fair":
            raise KvsimError(
                "load: overlap needs the load's end when it starts, which fair-shared links do not know "
                "(cluster.topology.sharing: fair); use load: stall",
                source=sc.source,
                path="kv.offload.load",
            )
        self.tiers: list[HostTier] | None = None
        if sc.kv.offload.enabled:
            self.tiers = [
                HostTier(self._tier_blocks(plan), eviction=sc.kv.offload.eviction) for _ in range(c.nodes)
            ]
        self.ssd = self._ssd_tiers() if sc.kv.offload.enabled and sc.kv.offload.ssd is not None else None
        self.swap = self._swap_spaces() if sc.scheduler.preemption != "recompute" else None
        self.pool: GlobalPool | None = None
        self.pool_ready: dict[int, float] = {}
        self.watchers: list[OffloadPort] = []
        self.pool_bytes_per_node = 0
        self.pool_in: list[LinkQueue] = []
        self.pool_out: list[LinkQueue] = []
        self.pool_link: Link | None = None
        if sc.kv.prefix_cache == "global" and sc.kv.global_pool.pool_nodes:
            self._pool_nodes()
        elif sc.kv.prefix_cache == "global":
            self._pool_in_dram()
        self.ready: list[dict[int, float]] = [{} for _ in range(c.nodes)]
        self.links: dict[tuple[int, str, int], LinkQueue] = {}
        self.ports: list[OffloadPort] = []
        self.node_ports: list[list[OffloadPort]] = [[] for _ in range(c.nodes)]

    def _ssd_tiers(self) -> list[SSDSide]:
        """Each node's SSD tier below its DRAM tier, and the SSD's read and write links."""
        sc = self.sc
        ssd_cfg = sc.kv.offload.ssd
        assert ssd_cfg is not None
        ssd_blocks = int(ssd_cfg.capacity_bytes // self.block_bytes)
        if ssd_blocks < 1:
            raise KvsimError(
                f"an SSD tier of {ssd_cfg.capacity_bytes:,} bytes holds no KV block of {self.block_bytes:,.0f} bytes",
                source=sc.source,
                path="kv.offload.ssd.capacity",
            )
        read = Link("ssd_read", ssd_cfg.read_bw, ssd_cfg.latency_s, 0.0)
        write = Link("ssd_write", ssd_cfg.write_bw, ssd_cfg.latency_s, 0.0)
        return [
            SSDSide(
                HostTier(ssd_blocks, name="ssd", eviction=sc.kv.offload.eviction),
                self._queue(read, f"node{n}/ssd_read/0"),
                self._queue(write, f"node{n}/ssd_write/0"),
                self.block_bytes,
                {},
            )
            for n in range(sc.cluster.nodes)
        ]

    def _swap_room(self) -> int:
        """Bytes of a node's swap space (``scheduler.swap_space`` per GPU; 0: no swapping)."""
        if self.sc.scheduler.preemption == "recompute":
            return 0
        return self.sc.scheduler.swap_space_bytes * self.sc.cluster.gpus_per_node

    def _swap_spaces(self) -> list[SwapSpace]:
        """Each node's host memory for swapped-out KV, beside its offload tier."""
        sc, c = self.sc, self.sc.cluster
        room = c.host_dram_bytes - self.capacity_bytes
        need = self._swap_room()
        if need > room:
            raise KvsimError(
                f"{sc.scheduler.swap_space_bytes:,} bytes per GPU x {c.gpus_per_node} GPUs exceed the node's "
                f"host DRAM left for it ({room:,} of cluster.host_dram)",
                source=sc.source,
                path="scheduler.swap_space",
            )
        return [SwapSpace(int(need // self.block_bytes)) for _ in range(c.nodes)]

    def _pool_in_dram(self) -> None:
        """The global pool in the GPU nodes' DRAM, beside their offload tiers and swap spaces."""
        sc, c, gp = self.sc, self.sc.cluster, self.sc.kv.global_pool
        room = c.host_dram_bytes - self.capacity_bytes - self._swap_room()
        per_node = gp.pool_bytes or room
        if per_node > room or per_node <= 0:
            raise KvsimError(
                f"a global pool of {per_node:,} bytes per node exceeds the host DRAM left for it "
                f"({room:,} of cluster.host_dram, beside the offload tier and swap space)",
                source=sc.source,
                path="kv.prefix_cache.pool_bytes" if gp.pool_bytes else "cluster.host_dram",
            )
        blocks = int(per_node * c.nodes // self.block_bytes)
        if blocks < 1:
            raise KvsimError(
                f"a global pool of {per_node:,} bytes per node holds no KV block of {self.block_bytes:,.0f} bytes",
                source=sc.source,
                path="kv.prefix_cache.pool_bytes",
            )
        self.pool = GlobalPool(blocks, eviction=gp.eviction)
        self.pool_bytes_per_node = int(blocks * self.block_bytes // c.nodes)

    def _pool_nodes(self) -> None:
        """The global pool on dedicated pool nodes: each node's DRAM (`PoolNodes`, none of the GPU
        nodes' DRAM) and its NICs, one FIFO queue per direction for all of them together (the
        Mooncake Transfer Engine stripes a transfer's slices over every NIC of a node, so a node's
        NICs act as one link of their summed bandwidth; per-NIC queues would let one transfer use
        one NIC only), with the latency and per-call overhead of cluster.topology.network."""
        sc = self.sc
        c, gp = sc.cluster, sc.kv.global_pool
        per_node = gp.pool_node_bytes or c.host_dram_bytes
        path = "kv.prefix_cache.pool_node_bytes" if gp.pool_node_bytes else "cluster.host_dram"
        blocks = int(per_node // self.block_bytes)
        if blocks < 1:
            raise KvsimError(
                f"a pool node of {per_node:,} bytes holds no KV block of {self.block_bytes:,.0f} bytes",
                source=sc.source,
                path=path,
            )
        self.pool = PoolNodes(blocks, gp.pool_nodes, first_home=c.nodes, eviction=gp.eviction)
        net = c.topology.network
        self.pool_link = Link(
            "pool_nic", net.bw_bytes_per_s * gp.pool_node_nics, net.latency_s, net.per_call_overhead_s
        )
        self.pool_in = [LinkQueue(self.pool_link, label=f"pool{j}/nic_in/0") for j in range(gp.pool_nodes)]
        self.pool_out = [LinkQueue(self.pool_link, label=f"pool{j}/nic_out/0") for j in range(gp.pool_nodes)]

    def _tier_blocks(self, plan: MemoryPlan) -> int:
        sc = self.sc
        c, off = sc.cluster, sc.kv.offload
        block_bytes = self.block_bytes
        dram = c.host_dram_bytes
        path = "kv.offload.host_bytes"
        if off.host_bytes:
            cap_bytes = float(off.host_bytes)
        elif off.host_share:
            cap_bytes, path = off.host_share * dram, "kv.offload.host_share"
        elif off.hbm_ratio:
            cap_bytes, path = (
                off.hbm_ratio * plan.num_blocks * self.per_node * block_bytes,
                "kv.offload.hbm_ratio",
            )
        elif off.per_replica_bytes:
            cap_bytes, path = float(off.per_replica_bytes * self.per_node), "kv.offload.preset"
        else:
            cap_bytes = float(dram)
        if cap_bytes > dram:
            raise KvsimError(
                f"a host tier of {cap_bytes:,.0f} bytes exceeds the node's host DRAM (cluster.host_dram: {dram:,})",
                source=sc.source,
                path=path,
            )
        blocks = int(cap_bytes // block_bytes)
        if blocks < 1:
            raise KvsimError(
                f"a host tier of {cap_bytes:,.0f} bytes holds no KV block of {block_bytes:,.0f} bytes",
                source=sc.source,
                path=path,
            )
        self.capacity_bytes = int(blocks * block_bytes)
        return blocks

    def _queue(self, link: Link, label: str) -> LinkQueue:
        """A link direction's queue: FIFO, or fair-shared (``cluster.topology.sharing: fair``)."""
        if self.sc.cluster.topology.sharing == "fair":
            return FairLinkQueue(link, label=label, env=self.env)
        return LinkQueue(link, label=label)

    def _link(self, node: int, name: str, group: int) -> LinkQueue:
        key = (node, name, group)
        q = self.links.get(key)
        if q is None:
            # network_out: a GPU NIC's outbound direction (full duplex: its own queue), used by
            # publications to dedicated pool nodes; network is the inbound one.
            link = self.sc.cluster.topology.link("network" if name == "network_out" else name)
            q = self.links[key] = self._queue(link, f"node{node}/{name}/{group}")
        return q

    def side(self, i: int, replica: ReplicaClock) -> ReplicaTiers:
        """Replica `i`'s side of the tiers, built before its scheduler (which is given its lookup
        and swap decision): its node, its PCIe lanes, its access to the global pool."""
        c = self.sc.cluster
        tp = c.tensor_parallel
        node, local = divmod(i * tp, c.gpus_per_node)
        (h2d, n_h2d), (d2h, n_d2h) = (self._lane(node, name, local) for name in ("host_h2d", "host_d2h"))
        glob, on_net = None, 0
        if self.pool is not None:
            net, on_net = self._lane(node, "network", local)
            glob = self._global_side(node, local, net, on_net)
        stats = OffloadStats()
        host = None if self.tiers is None else self.tiers[node]
        ssd = None if self.ssd is None else self.ssd[node]
        view = TierView(self.env, replica, host, self.ready[node], ssd=ssd, glob=glob, node=node, stats=stats)
        swap = None
        if self.swap is not None:
            swap = SwapPolicy(self.swap[node], self._swap_policy(h2d.link, d2h.link, n_h2d, n_d2h), stats)
        bpg = self.block_bytes_per_gpu
        return ReplicaTiers(
            node,
            h2d,
            d2h,
            bpg * n_h2d,
            bpg * n_d2h,
            glob,
            view,
            swap,
            stats,
            load_weight=self._load_weight(h2d.link, n_h2d),
            remote_weight=None if glob is None else self._remote_weight(c.topology.network, on_net),
        )

    def _lane(self, node: int, name: str, local: int) -> tuple[LinkQueue, int]:
        """The queue of the link `name` (a PCIe or network direction) of the group holding a
        replica's first GPU (`local` on its node), and how many of the replica's GPUs share it."""
        share = self.sc.cluster.topology.link("network" if name == "network_out" else name).shared_by
        group = local // share
        tp = self.sc.cluster.tensor_parallel
        return self._link(node, name, group), sum(1 for g in range(local, local + tp) if g // share == group)

    def _global_side(self, node: int, local: int, net: LinkQueue, on_net: int) -> GlobalSide:
        """A replica's access to the global pool over `net`, its first GPU's NIC group's inbound
        link carrying `on_net` of its GPUs (to pool nodes the outbound one too; with FIFO links,
        from another GPU node's share, that node's NIC egress on this rail too)."""
        c = self.sc.cluster
        assert self.pool is not None
        group = local // c.topology.network.shared_by
        args = (self.pool, self.pool_ready, net, self.block_bytes_per_gpu * on_net, node)
        worth = self._fetch_policy(c.topology.network, on_net)
        if self.pool_in:  # to and from pool nodes: this replica's NIC egress and theirs
            return GlobalSide(
                *args,
                worth,
                self.watchers,
                out=self._link(node, "network_out", group),
                pool_in=self.pool_in,
                pool_out=self.pool_out,
                pool_block_bytes=self.block_bytes,
                first_pool=c.nodes,
            )
        home_out = None
        if c.topology.sharing != "fair":  # a fetch also holds the home node's NIC on this rail
            home_out = functools.partial(self._link, name="network_out", group=group)
        return GlobalSide(*args, worth, self.watchers, home_out=home_out)

    def port(self, side: ReplicaTiers, sched: Scheduler, kv_events: ReplicaSink | None = None) -> OffloadPort:
        """A replica's port over its side of the tiers and its scheduler (built with that side)."""
        off, node = self.sc.kv.offload, side.node
        if self.tiers is not None or self.pool is not None:
            sched.kv.pool.record_events()  # BlockStored / BlockRemoved feed the write paths
        p = OffloadPort(
            self.env,
            sched,
            side,
            write=off.write,
            copy=off.copy,
            cold_after_steps=off.cold_after_steps if self.tiers is not None else 0,
            overlap=self._prefill_time if off.load == "overlap" else None,
            kv_events=kv_events,
            node_ports=self.node_ports[node],
            sampled=self._sampled(node),
            links_to_sample=None if self.ports else self.queues,
        )
        self.watchers.append(p)
        self.node_ports[node].append(p)
        self.ports.append(p)
        return p

    def _sampled(self, node: int) -> list[tuple[str, HostTier]]:
        """The tiers the next port samples: its node's, if it is the node's first; the pool's (and
        its pool nodes'), if it is the run's first."""
        out: list[tuple[str, HostTier]] = []
        if not self.node_ports[node]:
            if self.tiers is not None:
                out.append((f"node{node}/dram", self.tiers[node]))
            if self.ssd is not None:
                out.append((f"node{node}/ssd", self.ssd[node].tier))
        if not self.ports and self.pool is not None:
            out.append(("global", self.pool))
            if isinstance(self.pool, PoolNodes):
                out.extend((sh.name, sh) for sh in self.pool.shards)
        return out

    def _swap_policy(self, h2d: Link, d2h: Link, n_h2d: int, n_d2h: int) -> Callable[[Request, int], bool]:
        """``swap``: always (where swap space allows); ``auto``: when the copies out and back over
        idle links of the blocks the victim holds (`Scheduler.swap_blocks`: its resident tokens'
        with token eviction on) take less than one prefill of its computed tokens (a request that
        evicted tokens recomputes its whole context, prompt and generated, and evicts again)."""
        if self.sc.scheduler.preemption == "swap":
            return lambda req, blocks: True
        cost, bpg = self.cost, self.block_bytes_per_gpu
        per_block = self.sc.kv.offload.copy is CopyMode.PER_BLOCK

        def cheaper(req: Request, blocks: int) -> bool:
            calls = blocks if per_block else 1
            swap_s = cost.transfer_time(blocks * bpg * n_d2h, d2h, calls) + cost.transfer_time(
                blocks * bpg * n_h2d, h2d, calls
            )
            recompute_s = cost.price(ForwardBatch.prefill(req.num_computed, 0, sampling=False)).seconds
            return swap_s < recompute_s

        return cheaper

    def _prefill_time(self, tokens: int, cached: int) -> float:
        """Seconds of one prefill chunk alone (``kv.offload.load: overlap``; pricing is pure)."""
        return self.cost.price(ForwardBatch.prefill(tokens, cached, sampling=False)).seconds

    def _load_weight(self, h2d: Link, n_h2d: int) -> float:
        """Seconds to load one 32-block entry over an idle H2D link / seconds to prefill its tokens
        (the cache-aware router's price of a token loaded from a lower tier, in computed tokens)."""
        bs, blocks = self.sc.kv.block_size, 32
        load_s = self.cost.transfer_time(blocks * self.block_bytes_per_gpu * n_h2d, h2d, 1)
        return min(1.0, load_s / self._prefill_time(blocks * bs, 0))

    def _remote_weight(self, net: Link, on_net: int) -> float:
        """`_load_weight` for an entry fetched over the network (from another node's share of the
        pool, or a pool node: through its NICs too, at the slower end's rate)."""
        bs, blocks = self.sc.kv.block_size, 32
        return min(1.0, self._fetch_time(blocks, net, on_net, 1) / self._prefill_time(blocks * bs, 0))

    def _fetch_time(self, blocks: int, net: Link, on_net: int, calls: int) -> float:
        """Seconds to fetch a remote pool entry of `blocks` blocks over idle links: this replica's
        network link carrying its GPUs' shares, and a pool node's NICs (every GPU's) too, the
        slower end's time."""
        fetch_s = self.cost.transfer_time(blocks * self.block_bytes_per_gpu * on_net, net, calls)
        if self.pool_link is not None:
            fetch_s = max(fetch_s, self.cost.transfer_time(blocks * self.block_bytes, self.pool_link, calls))
        return fetch_s

    def _fetch_policy(self, net: Link, on_net: int) -> Callable[[int], bool]:
        """``fetch: always``, or (``auto``) whether fetching a remote entry of `blocks` blocks over an
        idle network link takes less than recomputing its tokens (one prefill at no context: the
        cheapest recompute, so a deep prefix is, if anything, fetched too rarely)."""
        if self.sc.kv.global_pool.fetch == "always":
            return lambda blocks: True
        bs = self.sc.kv.block_size
        per_block = self.sc.kv.offload.copy is CopyMode.PER_BLOCK
        memo: dict[int, bool] = {}

        def worth(blocks: int) -> bool:
            ok = memo.get(blocks)
            if ok is None:
                fetch_s = self._fetch_time(blocks, net, on_net, blocks if per_block else 1)
                ok = memo[blocks] = fetch_s < self._prefill_time(blocks * bs, 0)
            return ok

        return worth

    def queues(self) -> list[LinkQueue]:
        queues = [q for _, q in sorted(self.links.items())]
        for side in self.ssd or []:
            queues += [side.read, side.write]
        for qi, qo in zip(self.pool_in, self.pool_out, strict=True):
            queues += [qi, qo]
        return queues

    def link_samples(self) -> list[tuple[float, str, float, float]]:
        """Traffic of every link over time: (t, link, bytes, busy seconds asked for by t)."""
        return [row for p in self.ports for row in p.link_samples]

    def tier_samples(self) -> list[tuple[float, str, int]]:
        """Occupancy of every tier below HBM over time, bytes (a replica's blocks, all its GPUs)."""
        bb = self.block_bytes
        return sorted((t, name, int(blocks * bb)) for p in self.ports for t, name, blocks in p.samples)

    def readable_at(self, t: float) -> int:
        """Blocks the nodes' DRAM tiers hold readable at `t` (space taken by writes still in flight
        left out)."""
        seen: set[int] = set()
        blocks = 0
        for p in self.ports:
            if p.host is not None and id(p.host) not in seen:
                seen.add(id(p.host))
                blocks += p.readable_blocks(p.host, p.ready, t)
        return blocks

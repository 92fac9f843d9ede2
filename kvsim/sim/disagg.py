"""Disaggregated prefill and decode (``cluster.disaggregation``): the hand-off of a request from the
prefill pool to the decode pool, and the KV transfer between them.

A request is prefilled on a prefill replica as a stand-in asking for one output token (it finishes
when its prefill samples its first token, its blocks freed or cached there). Its KV, the prompt's
blocks in the cache's format per GPU, then moves to a decode replica (least outstanding tokens):
the decode replica reserves the blocks at its next schedule (FIFO, waiting there while they do not
fit; then in its scheduler's `loading` list, as a swap-in), the transfer is queued on the two replicas' links (`kvsim.sim.links.reserve_through`:
NVLink inside a node, the NICs between nodes), and at its arrival the request joins the decode
replica's running requests with its prompt computed and its first token sampled, which the user
sees then (TTFT includes the transfer). Both hand-off and arrival poke the decode replica as an
arrival does (a window is cut after the step in flight), so fast-forward stays exact; replicas do
not run ahead of the clock in these runs. Design: docs/architecture.md ("Disaggregated prefill
and decode").
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import simpy

from kvsim.core.memory_plan import MemoryPlan
from kvsim.core.request import Request, RequestStatus
from kvsim.core.router import ReplicaView, Router
from kvsim.sim.links import LinkQueue, reserve_through, urgent_at
from kvsim.sim.replica import Replica
from kvsim.spec.scenario import DisaggregationConfig
from kvsim.spec.topology import Topology


@dataclass
class Transfer:
    """One request's KV moved from prefill to decode (s of simulated time)."""

    id: int
    prefill_end_s: float  # its prefill sampled its first token
    reserved_s: float  # the decode replica reserved its blocks (the transfer was asked for)
    landed_s: float  # its KV arrived
    bytes: float  # all GPUs' shards together


@dataclass
class DecodeSide:
    """What one decode replica has from the prefill pool: requests waiting for blocks (FIFO, in
    hand-off order), and those whose KV has landed, to join its running requests."""

    pending: list[tuple[float, int, Request]] = field(default_factory=list)
    landed: list[Request] = field(default_factory=list)


class HandOff:
    """The prefill pool's finished prefills sent on to the decode pool (`on_prefill_done`, each
    prefill replica's ``on_finish``); the decode replicas' side (`before_schedule`)."""

    def __init__(
        self,
        env: simpy.Environment,
        cfg: DisaggregationConfig,
        topology: Topology,
        gpus_per_node: int,
        plans: tuple[MemoryPlan, MemoryPlan],
        block_size: int,
        num_layers: int,
        originals: dict[int, Request],
    ) -> None:
        self.env = env
        self.cfg = cfg
        self.block_size = block_size
        self.num_layers = num_layers
        self.originals = originals  # request id -> the run's request (its stand-in prefills)
        self.block_bytes = (plans[0].block_bytes_per_gpu, plans[1].block_bytes_per_gpu)
        self.prefill: list[Replica] = []
        self.decode: list[Replica] = []
        # Per prefill replica: the requests whose KV has arrived, their held blocks released at
        # its next schedule.
        self.sent: list[list[int]] = [[] for _ in range(cfg.prefill.replicas)]
        self.prefilled = [0] * cfg.prefill.replicas  # prefills each prefill replica completed
        # Per prefill replica: request id -> the blocks it holds for that request's send.
        self.held: list[dict[int, tuple[list[int], int]]] = [{} for _ in range(cfg.prefill.replicas)]
        self.router: Router | None = None
        self.local_prefills = 0  # conditional disaggregation: prefilled on the decode pool
        self.sides: list[DecodeSide] = [DecodeSide() for _ in range(cfg.decode.replicas)]
        self.transfers: list[Transfer] = []
        # request id -> (its prefill replica, the prefill's end)
        self._prefill_of: dict[int, tuple[int, float]] = {}
        # Placement: prefill replicas on the first GPUs, decode after them (on a fresh node where
        # the GPU types differ); a replica's tensor-parallel group sits in one node.
        p, d = cfg.prefill, cfg.decode
        self.node_p = [i * p.tensor_parallel // gpus_per_node for i in range(p.replicas)]
        first = p.num_gpus
        if p.gpu.name != d.gpu.name:
            first = -(-first // gpus_per_node) * gpus_per_node
        self.node_d = [(first + j * d.tensor_parallel) // gpus_per_node for j in range(d.replicas)]
        self.first_gpu = {"prefill": (0, p.tensor_parallel), "decode": (first, d.tensor_parallel)}
        self.gpus_per_node = gpus_per_node
        # One queue per replica per direction: its GPUs' links in lockstep (each GPU moves its shard
        # over its own NIC or NVLink port).
        self.links: dict[str, LinkQueue] = {}
        self.topology = topology

    def _link(self, role: str, i: int, kind: str, way: str) -> LinkQueue:
        """Replica `i` of `role`'s queue on `kind` in direction `way`. A link that ``shared_by``
        GPUs share (one NIC for several GPUs) carries min(tp, shared_by) of the replica's shards at
        once, so a lockstep transfer takes that many times one shard's time; where a group holds
        GPUs of more than one replica (tp < shared_by) its queue is the group's, shared by them."""
        link = self.topology.link(kind)
        first, tp = self.first_gpu[role]
        label = f"{role}{i}/{kind}/{way}"
        if tp < link.shared_by:
            gpu = first + i * tp
            node, group = gpu // self.gpus_per_node, (gpu % self.gpus_per_node) // link.shared_by
            label = f"node{node}/{kind}/{group}/{way}"
        q = self.links.get(label)
        if q is None:  # built once per queue: the link's rate for min(tp, shared_by) shards at once
            if link.shared_by > 1:
                link = dataclasses.replace(link, bw_bytes_per_s=link.bw_bytes_per_s / min(tp, link.shared_by))
            q = self.links[label] = LinkQueue(link, label=label)
        return q

    def link_kind(self, i: int, j: int) -> str:
        if self.cfg.link != "auto":
            return self.cfg.link
        return "nvlink" if self.node_p[i] == self.node_d[j] else "network"

    # ---- the prefill side --------------------------------------------------------------------------
    def on_prefill_done(self, done: list[Request]) -> None:
        """Prefill replicas' finished stand-ins, at their step's end: each request's KV is sent on
        (or, asking for one token only, it is answered)."""
        for stand_in in done:
            self.prefilled[stand_in.replica] += 1
            seq = self.originals[stand_in.id]
            t = stand_in.finish_s
            seq.first_scheduled_s = stand_in.first_scheduled_s
            seq.num_cached_tokens = stand_in.num_cached_tokens
            seq.preemptions += stand_in.preemptions
            if seq.output_len <= 1:  # answered by its prefill
                seq.replica = stand_in.replica
                seq.num_computed, seq.num_generated = seq.prompt_len, 1
                seq.first_token_s = seq.finish_s = t
                seq.status = RequestStatus.FINISHED
                continue
            self._hold(stand_in.replica, seq)
            # Through an URGENT event at t, as closed-loop turns are sent: never from inside the
            # prefill replica's step end.
            ev = urgent_at(self.env, t)
            ev.callbacks.append(functools.partial(self._hand_off, seq, stand_in.replica, t))

    def _hold(self, i: int, seq: Request) -> None:
        """Prefill replica `i` keeps the blocks of `seq`'s prompt until its KV has been sent (as
        vLLM's NIXL connector delays the free, and Mooncake's prefill keeps them until the decode
        side has read them): the stand-in's blocks, released (its entries cached) at its finish,
        taken again at once, before the replica's next schedule (`held`: entries, private blocks)."""
        pool = self.prefill[i].sched.kv.pool
        refs, sizes = pool.refs, pool.sizes
        keys = [k for k in seq.keys if k in refs]  # its prompt's entries, cached at its finish
        private = -(-seq.prompt_len // self.block_size) - sum(sizes.get(k, 1) for k in keys)
        pool.acquire_cached(keys)
        pool.allocate(private)
        self.held[i][seq.id] = (keys, private)

    def _hand_off(self, seq: Request, prefill: int, t: float, _ev: simpy.events.Event) -> None:
        assert self.router is not None
        rep = self.router.choose(seq, t)
        j = rep.index - self.cfg.prefill.replicas
        r = self.decode[j]
        seq.replica = r.index
        seq.num_generated = 1
        seq.num_tokens = seq.prompt_len + 1
        seq.keys, seq.key_cum, seq.out_keys = [], [0], []  # the decode pool keeps no prefix cache
        seq.status = RequestStatus.WAITING_FOR_KV_TRANSFER
        # Its decode tokens count as this replica's load from now (the router's reading).
        r.sched.outstanding_tokens += seq.output_len - 1
        bisect.insort(self.sides[j].pending, (t, seq.id, seq), key=lambda x: (x[0], x[1]))
        self._prefill_of[seq.id] = (prefill, t)
        r.poke(t)

    # ---- the decode side ---------------------------------------------------------------------------
    def before_schedule(self, j: int) -> Callable[[], None]:
        """Decode replica `j`'s step before each schedule: landed requests join its running ones;
        waiting ones reserve their blocks in order and their transfers start."""
        side = self.sides[j]

        def step() -> None:
            if not side.landed and not side.pending:
                return
            r = self.decode[j]
            sched = r.sched
            for seq in side.landed:
                sched.finish_load(seq)  # it resumes where its prefill stopped, as a swap-in does
                r.gaps.last[seq.id] = seq.first_token_s  # its next token's gap from the first
            side.landed.clear()
            kv = sched.kv
            while side.pending and len(sched.running) + len(sched.loading) < sched.max_num_seqs:
                _t, _i, seq = side.pending[0]
                need = -(-seq.prompt_len // self.block_size)
                if not kv.allocate_slots(seq, need):
                    break
                side.pending.pop(0)
                # Waiting for its KV with its blocks reserved and a seat taken (`Scheduler.loading`,
                # entries -1: it joins as it is, `finish_load`).
                seq.num_computed = seq.prompt_len
                sched.loading.append((seq, -1))
                self._send(seq, j, need, r.clock)

        return step

    def release_sent(self, i: int) -> Callable[[], None]:
        """Prefill replica `i`'s step before each schedule: the blocks of its arrived sends freed
        (their entries left cached)."""
        sent = self.sent[i]

        held = self.held[i]

        def step() -> None:
            if sent:
                pool = self.prefill[i].sched.kv.pool
                for rid in sent:
                    keys, private = held.pop(rid)
                    pool.release(private, keys)
                sent.clear()

        return step

    def _send(self, seq: Request, j: int, blocks: int, now: float) -> None:
        i, t_end = self._prefill_of.pop(seq.id)
        kind = self.link_kind(i, j)
        src = self._link("prefill", i, kind, "tx")
        dst = self._link("decode", j, kind, "rx")
        b_p, b_d = blocks * self.block_bytes[0], blocks * self.block_bytes[1]
        # One call per layer: an estimate (vLLM's NIXL connector registers each layer's KV as a
        # region and posts a batched read over them; no measurement on file), each at the link's
        # per-call overhead (`kvsim.spec.topology`: 2.3 us, FlexKV PR #193/#203).
        _start, land = reserve_through(src, dst, now, b_p, self.num_layers, b_d)
        total = b_p * self.cfg.prefill.tensor_parallel
        self.transfers.append(Transfer(seq.id, t_end, now, land, total))
        ev = urgent_at(self.env, land)
        ev.callbacks.append(lambda _e: self._land(seq, i, j, land))

    def _land(self, seq: Request, i: int, j: int, t: float) -> None:
        seq.first_token_s = t  # the user sees the first token once the decode replica has its KV
        self.sides[j].landed.append(seq)
        self.decode[j].poke(t)
        self.sent[i].append(seq.id)
        self.prefill[i].poke(t)

    def queues(self) -> list[LinkQueue]:
        """The replicas' link queues that carried a transfer, by name."""
        return [q for _name, q in sorted(self.links.items())]


class SplitRouter:
    """Conditional disaggregation's arrival router (``max_local_prefill_tokens``, after Dynamo's
    disaggregated router): a request with a stand-in in the hand-off's ``originals`` goes to the
    prefill pool's router; one without (its prompt short enough) to the decode pool's, which
    prefills it there (counted in ``HandOff.local_prefills``)."""

    def __init__(self, prefill: Router, handoff: HandOff) -> None:
        assert handoff.router is not None
        self.prefill, self.decode, self.handoff = prefill, handoff.router, handoff

    def choose(self, req: Request, now: float) -> ReplicaView:
        if req.id in self.handoff.originals:
            return self.prefill.choose(req, now)
        self.handoff.local_prefills += 1
        return self.decode.choose(req, now)

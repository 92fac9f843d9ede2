"""Links with queueing: the SimPy side of `kvsim.spec.topology.Link`.

A `LinkQueue` is one direction of one physical link (a GPU's PCIe host-to-device lanes, or the
PCIe of a switch that `Link.shared_by` GPUs share). Transfers on it are served first come, first
served, one at a time:

- a transfer of ``nbytes`` in ``num_calls`` copies occupies the link for
  ``num_calls x per_call_overhead + nbytes / bandwidth`` (the copy engine and the driver calls are
  serialised), starting when it is asked for or when the transfer before it frees the link;
- its data arrive ``latency`` after its occupancy ends: latency is a pipeline delay that does not
  hold the link (the next transfer's bytes follow the previous one's on the wire).

So on an idle link a transfer takes exactly ``transfer_time`` (`kvsim.costs.base`): latency +
calls x overhead + bytes / bandwidth; two transfers of B bytes asked for at once end at
``latency + overhead + B/bw`` and ``latency + 2 x (overhead + B/bw)``: the second at twice the
bytes' time, plus one latency.

The service time of every transfer is known when it is asked for, so a FIFO queue on a
capacity-one resource reduces to one number, the instant the link next frees (``busy_until``):
`reserve` returns a transfer's start and end without any engine event. The engine schedules one
event at the end of a transfer whose completion someone waits for (a load back to HBM,
`kvsim.sim.offload`), and none for the blocks inside it: a transfer is one event at most, never
one per block. Per-block copies (a ``cudaMemcpyAsync`` per block) and one batched gather differ
only in ``num_calls``.

``cluster.topology.sharing: fair`` shares each link's bandwidth between its concurrent transfers
instead (`FairLinkQueue`: processor sharing, as a real link interleaves DMA streams; FIFO gives the
same completion time for the last of a burst of equal transfers and earlier ones for the others).
A transfer through two links at once (the global pool on dedicated pool nodes: a pool node's NIC
and a GPU's, RDMA end to end) is `reserve_through`: cut-through, both links held together.
Left out: priorities
between loads and write-backs (separate directions here: host-to-device and device-to-host are
two links), NUMA.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import simpy
from simpy.events import URGENT

from kvsim.spec.topology import Link


@dataclass
class LinkStats:
    transfers: int = 0
    bytes: float = 0.0
    busy_s: float = 0.0  # seconds of occupancy asked for (latency excluded: it does not hold the link)
    queued_s: float = 0.0  # seconds transfers waited for the link before starting


class LinkQueue:
    """One direction of one link, shared FIFO by the GPUs under it."""

    def __init__(self, link: Link, *, label: str) -> None:
        if link.bw_bytes_per_s <= 0:
            raise ValueError(f"link {label} needs a positive bandwidth")
        self.link = link
        self.label = label  # e.g. "node0/host_h2d/0"
        self.busy_until = 0.0
        self.stats = LinkStats()
        # The link's occupied intervals, disjoint and in order (touching ones merged): starts, ends,
        # and the occupancy before each (`busy_within`).
        self._iv_s: list[float] = []
        self._iv_e: list[float] = []
        self._iv_cum: list[float] = []

    def _occupy(self, a: float, b: float) -> None:
        """The link is occupied over [a, b] (never before the end of what it held already)."""
        ends = self._iv_e
        if ends:
            a = max(a, ends[-1])
        if b <= a:
            return
        if ends and a == ends[-1]:
            ends[-1] = b
        else:
            self._iv_cum.append(self._iv_cum[-1] + ends[-1] - self._iv_s[-1] if ends else 0.0)
            self._iv_s.append(a)
            ends.append(b)

    def work_asked_s(self) -> float:
        """Seconds of occupancy every transfer asked for needs, done or not."""
        return self.stats.busy_s

    def settle(self, t: float) -> None:
        """Bring the occupancy to `t` (the run's end), for `busy_within`: FIFO links know it already."""

    def busy_within(self, t: float) -> float:
        """Seconds the link was occupied in [0, t]: at most `t` by construction (its intervals are
        disjoint), where `stats.busy_s` counts work asked for that may end past `t` (a link asked
        for more than it can carry by the end of a run)."""
        i = bisect.bisect_right(self._iv_s, t) - 1
        if i < 0:
            return 0.0
        return self._iv_cum[i] + min(self._iv_e[i], t) - self._iv_s[i]

    def occupancy(self, nbytes: float, num_calls: int = 1) -> float:
        """Seconds a transfer holds the link."""
        link = self.link
        return num_calls * link.per_call_overhead_s + nbytes / link.bw_bytes_per_s

    def reserve(self, now: float, nbytes: float, num_calls: int = 1) -> tuple[float, float]:
        """Queue a transfer asked for at `now`: returns (its start, the instant its data have
        arrived). Asks must come in non-decreasing `now` (the engine's clock) for FIFO order."""
        start = max(now, self.busy_until)
        hold = self.occupancy(nbytes, num_calls)
        self._hold(now, start, hold, nbytes)
        return start, start + hold + self.link.latency_s

    def _hold(self, now: float, start: float, hold: float, nbytes: float) -> None:
        """The link is occupied from `start` for `hold` seconds by a transfer of `nbytes` asked for
        at `now`: it next frees then, and its statistics count the transfer."""
        self.busy_until = start + hold
        self._occupy(start, start + hold)
        s = self.stats
        s.transfers += 1
        s.bytes += nbytes
        s.busy_s += hold
        s.queued_s += start - now


def reserve_through(
    first: LinkQueue,
    second: LinkQueue,
    now: float,
    first_bytes: float,
    num_calls: int = 1,
    second_bytes: float | None = None,
) -> tuple[float, float]:
    """Queue one RDMA transfer that crosses two links at once (a pool node's NIC and a GPU's),
    FIFO on both: returns (its start, the instant its data have arrived).

    Cut-through, not store-and-forward: the bytes stream through both links together, so the
    transfer starts when both are free (``max(now, first.busy_until, second.busy_until)``), holds
    both for ``calls x overhead + max(first_bytes / first bw, second_bytes / second bw)`` (the
    slower end sets the rate; with the same bytes on both ends, ``bytes / min(bandwidths)``), and
    its data arrive one latency after (the larger of the two links' overheads and latencies:
    one call and one wire across the path). The two ends' bytes differ where the receiving
    replica's other GPUs take their shares through NICs of their own in parallel (`second_bytes`;
    None: the same as `first_bytes`). Neither link is backfilled: a link left idle while the
    transfer waits for the other stays so (each link's FIFO stays one number)."""
    nb2 = first_bytes if second_bytes is None else second_bytes
    a, b = first.link, second.link
    start = max(now, first.busy_until, second.busy_until)
    hold = num_calls * max(a.per_call_overhead_s, b.per_call_overhead_s) + max(
        first_bytes / a.bw_bytes_per_s, nb2 / b.bw_bytes_per_s
    )
    first._hold(now, start, hold, first_bytes)
    second._hold(now, start, hold, nb2)
    return start, start + hold + max(a.latency_s, b.latency_s)


class Arrival:
    """The arrival of a fair-shared transfer's data: `t` is None until its link has computed it;
    `waiters` are called (with no argument) at that instant. An arrival nobody waits for when its
    transfer ends gets its instant then (possibly a latency ahead of the clock) and no event: a
    reader that needs it later waits on the instant itself."""

    __slots__ = ("t", "waiters")

    def __init__(self) -> None:
        self.t: float | None = None
        self.waiters: list[Callable[[], None]] = []

    def _arrive(self, t: float) -> None:
        self.t = t
        waiters, self.waiters = self.waiters, []
        for w in waiters:
            w()


class _Share:
    __slots__ = ("arrival", "left")

    def __init__(self, work: float, arrival: Arrival) -> None:
        self.left = work  # seconds of the whole link still to serve
        self.arrival = arrival


class FairLinkQueue(LinkQueue):
    """One direction of one link whose concurrent transfers share its bandwidth equally
    (``cluster.topology.sharing: fair``; processor sharing, as concurrent DMA streams interleave):
    with n transfers in service each progresses at 1/n of the link, so a transfer's end moves when
    another starts or ends. A transfer's work is `occupancy` (its calls' overheads and bytes over
    the whole bandwidth); its data arrive ``latency`` after its work is done. Two transfers of B
    bytes started at once both arrive at ``latency + 2 x (overhead + B/bw)`` (FIFO: one at
    ``latency + overhead + B/bw``, the other at that plus ``overhead + B/bw``).

    Events only at starts and ends: one pending SimPy event per link, at its next completion
    (replaced when a start changes it), and one at each transfer's arrival. The arithmetic is the
    link's own floats (the instants it is given and the completions it computes), never
    ``env.now``, so it is the same whether the replicas step or fast-forward. `submit` replaces
    `reserve`: the end is not known when a transfer starts."""

    def __init__(self, link: Link, *, label: str, env: simpy.Environment) -> None:
        super().__init__(link, label=label)
        self.env = env
        self.active: list[_Share] = []
        self.last = 0.0  # the instant the shares' `left` are as of
        self.next_t = math.inf  # the next completion
        self.version = 0  # of the pending completion event (older ones are void)

    def work_asked_s(self) -> float:
        return self.stats.busy_s + sum(sh.left for sh in self.active)

    def settle(self, t: float) -> None:
        """Account the shares' progress up to `t` (the run's end; completions due by then first)."""
        while self.active and self.next_t <= t:
            self._finish()
        self._advance(t)

    def reserve(self, now: float, nbytes: float, num_calls: int = 1) -> tuple[float, float]:
        raise TypeError("a fair-shared link has no end known at the start: use submit")

    def _advance(self, t: float) -> None:
        if t > self.last:
            if self.active:
                d = (t - self.last) / len(self.active)
                for sh in self.active:
                    sh.left -= d
                self.stats.busy_s += t - self.last
                self._occupy(self.last, t)
            self.last = t

    def _schedule(self) -> None:
        self.version += 1
        if not self.active:
            self.next_t = math.inf
            return
        m = min(sh.left for sh in self.active)
        self.next_t = self.last + m * len(self.active)
        v = self.version
        ev = urgent_at(self.env, self.next_t)
        ev.callbacks.append(lambda _e: self._finish() if v == self.version else None)

    def _finish(self) -> None:
        """The completion at `next_t`: the shares with the least work left end (ties together)."""
        t = self.next_t
        m = min(sh.left for sh in self.active)
        self.stats.busy_s += t - self.last
        self._occupy(self.last, t)
        self.last = t
        done = [sh for sh in self.active if sh.left == m]
        rest = [sh for sh in self.active if sh.left != m]
        for sh in rest:
            sh.left -= m
        self.active = rest
        self._schedule()
        at = t + self.link.latency_s
        for sh in done:
            arrival = sh.arrival
            if not arrival.waiters:  # nobody waits (a write): its instant is known, no event needed
                arrival.t = at
                continue
            ev = urgent_at(self.env, at)
            ev.callbacks.append(functools.partial(_arrive_event, arrival, at))

    def submit(self, now: float, nbytes: float, num_calls: int = 1) -> Arrival:
        """Start a transfer at `now` (not before the link's last event); returns its arrival."""
        while self.active and self.next_t <= now:  # completions due first, in the link's order
            self._finish()
        now = max(now, self.last)
        self._advance(now)
        arrival = Arrival()
        self.active.append(_Share(self.occupancy(nbytes, num_calls), arrival))
        s = self.stats
        s.transfers += 1
        s.bytes += nbytes
        self._schedule()
        return arrival


def _arrive_event(arrival: Arrival, t: float, _ev: simpy.events.Event) -> None:
    arrival._arrive(t)


def urgent_at(env: simpy.Environment, t: float) -> simpy.events.Event:
    """An event at URGENT priority at `t` (now, if `t` has passed)."""
    ev = simpy.events.Event(env)
    ev._ok = True
    ev._value = None
    env.schedule(ev, URGENT, max(0.0, t - env.now))
    return ev

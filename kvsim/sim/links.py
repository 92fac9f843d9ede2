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

Left out: sharing the bandwidth of concurrent transfers (a real link interleaves them; FIFO gives
the same completion time for the last of a burst and earlier ones for the others), priorities
between loads and write-backs (separate directions here: host-to-device and device-to-host are
two links), NUMA.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsim.spec.topology import Link


@dataclass
class LinkStats:
    transfers: int = 0
    bytes: float = 0.0
    busy_s: float = 0.0  # seconds the link was occupied (latency excluded: it does not hold the link)
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

    def occupancy(self, nbytes: float, num_calls: int = 1) -> float:
        """Seconds a transfer holds the link."""
        link = self.link
        return num_calls * link.per_call_overhead_s + nbytes / link.bw_bytes_per_s

    def reserve(self, now: float, nbytes: float, num_calls: int = 1) -> tuple[float, float]:
        """Queue a transfer asked for at `now`: returns (its start, the instant its data have
        arrived). Asks must come in non-decreasing `now` (the engine's clock) for FIFO order."""
        start = max(now, self.busy_until)
        hold = self.occupancy(nbytes, num_calls)
        self.busy_until = start + hold
        s = self.stats
        s.transfers += 1
        s.bytes += nbytes
        s.busy_s += hold
        s.queued_s += start - now
        return start, start + hold + self.link.latency_s

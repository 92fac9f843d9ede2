"""The ``faults`` section: replicas and nodes that go down at stated times, or at a seeded failure
rate, and come back cold.

Read once into frozen objects (`FaultsConfig`, `FaultEvent`, `RandomFaults`) and checked against
the cluster (a target that exists, a time inside the run); the shell that draws the random ones
and injects them all is `kvsim.sim.faults`. Left out for now: degraded links, lost pool nodes
(issue 25). Design: docs/architecture.md ("Faults").
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvsim.spec.offload import SSD_READ_BW
from kvsim.spec.schema import Section
from kvsim.units import parse_bandwidth

# Retries of a request whose replica went down before it counts as failed: the OpenAI Python
# client's default (``DEFAULT_MAX_RETRIES = 2`` in openai-python's ``_constants.py``), the client
# most users put in front of vLLM's and SGLang's OpenAI-compatible servers.
DEFAULT_MAX_RETRIES = 2
# Weights reloaded from the node's NVMe (a node that went down comes back with a cold page cache):
# a PCIe Gen5 data-centre SSD's sequential read, Samsung PM1743, 13,000 MB/s (datasheet; the same
# number as kv.offload's SSD tier, `kvsim.spec.offload.SSD_READ_BW`).
DEFAULT_RELOAD_BW = SSD_READ_BW
RELOAD_SOURCE = "NVMe sequential read, Samsung PM1743 13,000 MB/s (datasheet)"
# The most failures per component-hour ``faults.random.rate_per_hour`` takes: one a minute. Past it
# a component is down more than it is up (an outage is a restart plus the weights' reload, tens of
# seconds at least in practice), so the schedule no longer describes faults but a missing cluster;
# it also keeps the draws to one per component-minute of trace. A measured rate is some 10^-5 per
# GPU-hour (Llama 3: 419 interruptions in 54 days on 16,384 H100s, docs/architecture.md "Faults").
MAX_RATE_PER_HOUR = 60.0


class FaultKind(str, Enum):
    REPLICA_DOWN = "replica_down"  # one replica (a tensor-parallel group of GPUs)
    NODE_DOWN = "node_down"  # every replica on one node

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class FaultEvent:
    at_s: float  # when it goes down, s from the run's start
    kind: FaultKind
    target: int  # replica index or node index
    duration_s: float  # down for this long, then the weights reload


@dataclass(frozen=True)
class RandomFaults:
    """Each component (replica, or node for ``node_down``) fails as a Poisson process at
    `rate_per_hour` over the trace's span; each outage lasts an exponential draw of mean
    `mean_down_s` (then the weights reload); drawn by `kvsim.sim.faults.draw_faults`."""

    rate_per_hour: float  # failures per component per hour, in [0, MAX_RATE_PER_HOUR]
    mean_down_s: float  # > 0
    seed: int  # default: sim.seed
    kind: FaultKind = FaultKind.REPLICA_DOWN


@dataclass(frozen=True)
class FaultsConfig:
    events: tuple[FaultEvent, ...]  # in the file's order (empty with `random` alone)
    max_retries: int  # a dropped request is re-queued at most this many times, then fails
    reload_bw_bytes_per_s: float  # model weights per GPU reloaded at this rate after a fault
    reload_source: str  # where that rate comes from
    random: RandomFaults | None = None  # faults.random: drawn at a rate, merged with `events`


def read_faults(
    root: Section, *, num_replicas: int, num_nodes: int, max_time_s: float | None, sim_seed: int
) -> FaultsConfig | None:
    """The ``faults`` section (None when absent or null): ``events`` (a list of ``{at, kind, target,
    duration}``) and/or ``random`` (``{rate_per_hour, mean_down_s, seed, kind}``), ``max_retries``
    and ``reload_bandwidth``; each target must exist in the cluster and each fault start before
    ``sim.max_time``."""
    if root.raw("faults", None) is None:  # absent, or null (``--set faults=null``: a run without them)
        return None
    f = root.section("faults")
    random = None if f.raw("random", None) is None else _read_random(f.section("random"), sim_seed)
    raw = f.raw("events", None)
    if (raw is None and random is None) or (raw is not None and (not isinstance(raw, list) or not raw)):
        raise f.err("events", "expected a non-empty list of {at, kind, target, duration} (or faults.random)")
    events = tuple(
        _read_event(
            Section(item, source=f.source, path=f"faults.events.{i}"), num_replicas, num_nodes, max_time_s
        )
        for i, item in enumerate(raw or ())
    )
    max_retries = f.int("max_retries", DEFAULT_MAX_RETRIES, lo=0, hi=1000)
    given = f.has("reload_bandwidth")
    bw = f.parsed("reload_bandwidth", parse_bandwidth, DEFAULT_RELOAD_BW)
    f.done()
    source = f"faults.reload_bandwidth ({f.source})" if given else RELOAD_SOURCE
    return FaultsConfig(events, max_retries, bw, source, random)


def _read_random(r: Section, sim_seed: int) -> RandomFaults:
    rate = r.float("rate_per_hour", lo=0.0)
    if rate > MAX_RATE_PER_HOUR:
        raise r.err(
            "rate_per_hour",
            f"{rate:g} failures per component-hour is more than one a minute ({MAX_RATE_PER_HOUR:g}): "
            "each component would be down more than up",
        )
    mean = r.float("mean_down_s", lo=0.0, lo_open=True)
    seed = r.int("seed", sim_seed, lo=0, hi=2**63 - 1)
    kind = FaultKind(r.choice("kind", [k.value for k in FaultKind], FaultKind.REPLICA_DOWN.value))
    r.done()
    return RandomFaults(rate, mean, seed, kind)


def _read_event(e: Section, num_replicas: int, num_nodes: int, max_time_s: float | None) -> FaultEvent:
    at = e.float("at", lo=0.0)
    kind = FaultKind(e.choice("kind", [k.value for k in FaultKind]))
    target = e.int("target", lo=0)
    count, what = (num_replicas, "replicas") if kind is FaultKind.REPLICA_DOWN else (num_nodes, "nodes")
    if target >= count:
        raise e.err(
            "target", f"{kind} {target} does not exist: the cluster has {count} {what} (0-{count - 1})"
        )
    duration = e.float("duration", lo=0.0, lo_open=True)
    if max_time_s is not None and at >= max_time_s:
        raise e.err("at", f"{at:g} s is not before sim.max_time ({max_time_s:g} s): the fault never happens")
    e.done()
    return FaultEvent(at, kind, target, duration)

"""The ``cluster.autoscale`` section: replicas added and removed during the run by a policy that
reads their load every interval (issue 25's elasticity).

Read once into a frozen `AutoscaleConfig` and checked against the cluster (its replicas are the
most the autoscaler may run); the shell that drives it is `kvsim.sim.autoscale`. The rule is
Kubernetes' HPA: desired = ceil(active x metric / target), no change within a 10% tolerance,
scale-down to the largest recommendation of the last ``cool_down`` seconds (its stabilization
window). Design: docs/architecture.md ("Autoscaling").
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvsim.spec.schema import Section
from kvsim.units import parse_duration


class AutoscalePolicy(str, Enum):
    # KV cache usage (vLLM's kv_cache_usage: blocks requests reference over the pool), mean over
    # the replicas serving: the signal Dynamo's load planner scales decode/aggregated workers on
    KV_USAGE = "kv_usage"
    QUEUE = "queue"  # requests in a replica (running + waiting), per active replica

    def __str__(self) -> str:
        return self.value


# Kubernetes' HPA controller syncs every 15 s (kube-controller-manager
# --horizontal-pod-autoscaler-sync-period, default 15s).
DEFAULT_INTERVAL_S = 15.0
# HPA's scale-down stabilization window (behavior.scaleDown.stabilizationWindowSeconds, default
# 300; scale-up: 0, no window).
DEFAULT_COOL_DOWN_S = 300.0
# HPA's tolerance (--horizontal-pod-autoscaler-tolerance, default 0.1): a metric within 10% of
# its target changes nothing.
TOLERANCE = 0.1
# A started replica's engine start before its weights load: process and CUDA context, the
# engine's profiling run and CUDA-graph capture. An estimate, no measurement on file: a scale-up
# waits this plus the weights' load at faults' reload bandwidth (`kvsim.spec.faults.DEFAULT_RELOAD_BW`).
ENGINE_START_S = 30.0
START_SOURCE = "30 s engine start (an estimate) + the weights at 13 GB/s NVMe read (Samsung PM1743)"
MAX_QUEUE_TARGET = 100_000.0


@dataclass(frozen=True)
class AutoscaleConfig:
    policy: AutoscalePolicy
    target: float  # kv_usage: a share in (0, 1]; queue: requests per replica, > 0
    min_replicas: int  # >= 1: no scale to zero
    max_replicas: int  # <= the cluster's replicas (the pool it scales within)
    initial_replicas: int  # up at the start, in [min, max]
    interval_s: float  # the policy reads the replicas every so often
    cool_down_s: float  # scale-down stabilization window
    scale_up_delay_s: float | None  # start to taking traffic; None: ENGINE_START_S + weights' load


def read_autoscale(c: Section, *, num_replicas: int) -> AutoscaleConfig | None:
    """``cluster.autoscale`` (None when absent or null), within the cluster's `num_replicas`."""
    if c.raw("autoscale", None) is None:
        return None
    a = c.section("autoscale")
    policy = AutoscalePolicy(a.choice("policy", [p.value for p in AutoscalePolicy]))
    # No default target: what a replica should hold depends on its batch limits and the SLO.
    if policy is AutoscalePolicy.KV_USAGE:
        target = a.float("target", lo=0.0, hi=1.0, lo_open=True)
    else:
        target = a.float("target", lo=0.0, hi=MAX_QUEUE_TARGET, lo_open=True)
    mx = a.int("max_replicas", num_replicas, lo=1, hi=1 << 20)
    if mx > num_replicas:
        raise a.err(
            "max_replicas",
            f"{mx} exceeds the cluster's {num_replicas} replicas (its GPUs are the pool it scales within)",
        )
    mn = a.int("min_replicas", 1, lo=0, hi=1 << 20)
    if mn < 1:
        raise a.err(
            "min_replicas", "must be at least 1: scaling to zero is not simulated (no replica to queue at)"
        )
    if mn > mx:
        raise a.err("min_replicas", f"{mn} is above max_replicas ({mx})")
    initial = a.int("initial_replicas", mn, lo=0, hi=1 << 20)
    if not mn <= initial <= mx:
        raise a.err("initial_replicas", f"{initial} is outside [min_replicas, max_replicas] = [{mn}, {mx}]")
    interval = a.parsed("interval", parse_duration, DEFAULT_INTERVAL_S)
    if interval > 3600.0:
        raise a.err("interval", f"{interval:g} s is over an hour: the policy would never react")
    cool = a.parsed("cool_down", lambda v: parse_duration(v, allow_zero=True), DEFAULT_COOL_DOWN_S)
    if cool > 3600.0:  # HPA's stabilizationWindowSeconds is at most 3600
        raise a.err("cool_down", f"{cool:g} s is over an hour (HPA's stabilization window is at most 3600 s)")
    delay = None
    if a.raw("scale_up_delay", None) is not None:
        delay = a.parsed("scale_up_delay", lambda v: parse_duration(v, allow_zero=True))
    a.done()
    return AutoscaleConfig(policy, target, mn, mx, initial, interval, cool, delay)

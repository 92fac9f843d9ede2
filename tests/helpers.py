"""Shared test helpers: small scenarios built in code, and hand-made workloads."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvsim.spec.scenario import Scenario, scenario_from_dict
from kvsim.spec.workload import Workload

ROOT = Path(__file__).resolve().parent.parent
# A guard against hangs, not a speed check: no test asserts how long anything takes, and a loaded
# machine (a CI runner, a CPU shared with other test runs) must never trip it, so it is generous.
# KVSIM_HANG_GUARD_S sets it (lower, to find a hang sooner).
HANG_GUARD_S = float(os.environ.get("KVSIM_HANG_GUARD_S", "1800"))


def hang_message(what: str) -> str:
    return (
        f"hang guard: {what} still running after {HANG_GUARD_S:g} s (a guard against hangs, not a "
        "speed check; KVSIM_HANG_GUARD_S sets it)"
    )


def run_guarded(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
    """`subprocess.run` under the hang guard: past `HANG_GUARD_S` the test fails, saying it hung."""
    try:
        return subprocess.run(cmd, timeout=HANG_GUARD_S, **kwargs)
    except subprocess.TimeoutExpired:
        pass  # failed outside the handler: the message, not Python's traceback of the timeout
    pytest.fail(hang_message(" ".join(" ".join(str(c) for c in cmd).split())[:200]))


def make_workload(arrivals, prompts, outputs, hash_ids=None, block_tokens: int = 16) -> Workload:
    return Workload(
        arrival_s=np.asarray(arrivals, dtype=np.float64),
        prompt_tokens=np.asarray(prompts, dtype=np.int64),
        output_tokens=np.asarray(outputs, dtype=np.int64),
        hash_ids=None if hash_ids is None else [np.asarray(h, dtype=np.int64) for h in hash_ids],
        hash_block_tokens=block_tokens,
        source="test",
        line_numbers=None,
        skipped_lines=0,
        dropped={},
    )


def small_scenario(num_blocks: int | None = None, **sections: Any) -> Scenario:
    """Llama-3.1-8B on one H100; `num_blocks` sizes HBM so the pool has exactly that many blocks."""
    data: dict[str, Any] = {
        "model": "llama-3.1-8b",
        "cluster": {"gpu": "h100-sxm", "gpus_per_node": 1},
        "workload": {"synthetic": {"num_requests": 1, "rate": 1}},
        "sim": {"seed": 1},
    }
    for k, v in sections.items():
        base = data.get(k, {})
        data[k] = {**base, **v} if isinstance(v, dict) and isinstance(base, dict) else v
    if num_blocks is not None:
        block_bytes = 16 * 131072 * (data.get("kv", {}).get("block_size", 16) // 16)
        weights = 8_030_261_248 * 2
        data["cluster"] = {
            **data["cluster"],
            "gpu": {"preset": "h100-sxm", "hbm": weights + num_blocks * block_bytes + block_bytes // 2},
            "gpu_memory_utilization": 1.0,
            "activation_reserve": 0,
        }
    return scenario_from_dict(data, source="test.yaml", base_dir=ROOT)


def records(res) -> list[tuple]:  # type: ignore[no-untyped-def]
    """Per-request outcomes of a run, comparable across runs (NaN, never reached, becomes None)."""

    def t(x: float) -> float | None:
        return None if x != x else x

    return [
        (
            s.id,
            s.replica,
            t(s.first_scheduled_s),
            t(s.first_token_s),
            t(s.finish_s),
            s.num_cached_tokens,
            s.preemptions,
            s.status,
            s.num_generated,
        )
        for s in res.seqs
    ]


CHROMIUM = Path("/usr/bin/chromium")  # Debian's; .ci/run installs it, tests skip without it


def chromium_args(profile: Path, *extra: str) -> list[str]:
    """Headless Chromium as the workplace runs it: offline, no sandbox (root), a fresh profile."""
    return [
        str(CHROMIUM),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        *extra,
    ]


def spy_preemptions(
    monkeypatch: Any,
) -> tuple[list[tuple[int, int, int, int, int]], list[tuple[int, int, int]]]:
    """Record every preemption (id, computed, generated, evicted, blocks) and every load or swap-in
    that finishes (computed, evicted, blocks), through `monkeypatch` on the scheduler."""
    from kvsim.core.sched.scheduler import Scheduler

    out: list[tuple[int, int, int, int, int]] = []
    resumed: list[tuple[int, int, int]] = []
    pre, fin = Scheduler._preempt, Scheduler.finish_load

    def preempt(self, req):  # type: ignore[no-untyped-def]
        out.append((req.id, req.num_computed, req.num_generated, req.evicted, req.num_blocks))
        pre(self, req)

    def finish(self, req):  # type: ignore[no-untyped-def]
        n = fin(self, req)
        resumed.append((req.num_computed, req.evicted, req.num_blocks))
        return n

    monkeypatch.setattr(Scheduler, "_preempt", preempt)
    monkeypatch.setattr(Scheduler, "finish_load", finish)
    return out, resumed


def assert_auto_swapped_its_held_blocks(
    sc: Scenario, res: Any, computed: int, held: int, block_bytes: int
) -> None:
    """`preemption: auto` swapped the victim (`computed` tokens, `held` blocks) because copying its
    held blocks out and back beats recomputing it, while copying blocks for all its computed tokens
    would not."""
    import kvsim.run as krun
    from kvsim.costs.base import ForwardBatch, transfer_time

    t = sc.cluster.topology
    recompute = krun.make_cost_model(sc).price(ForwardBatch.prefill(computed, 0, sampling=False)).seconds

    def round_trip(blocks: int) -> float:
        return transfer_time(blocks * block_bytes, t.host_d2h) + transfer_time(
            blocks * block_bytes, t.host_h2d
        )

    assert round_trip(held) < recompute < round_trip(-(-computed // 16))
    assert (res.summary["swap"]["swaps"], res.summary["swap"]["recomputes"]) == (1, 0)


def draw_requests(
    draw: Any, n: int, gaps: list[float], max_prompt: int, max_output: int
) -> tuple[list[float], list[int], list[int], list[list[int]]]:
    """`n` requests for a property test, drawn with hypothesis's `draw`: arrival gaps from `gaps`,
    prompts of 1..`max_prompt` tokens whose leading 16-token blocks share one of three prefixes
    (trace hash ids, one per block; fresh ids after the shared part), outputs of 1..`max_output`.
    Returns (arrivals, prompts, outputs, hash ids). The same draws, in the same order, as the
    strategies that wrote this loop out before it was shared."""
    from hypothesis import strategies as st

    g = 16
    arrivals: list[float] = []
    prompts: list[int] = []
    outputs: list[int] = []
    ids: list[list[int]] = []
    t, fresh = 0.0, 10**6
    for _ in range(n):
        t += draw(st.sampled_from(gaps))
        p = draw(st.integers(1, max_prompt))
        nb = -(-p // g)
        shared = min(draw(st.integers(0, nb)), p // g)
        base = draw(st.integers(0, 2))
        h = [base * 1000 + j for j in range(shared)]
        while len(h) < nb:
            h.append(fresh)
            fresh += 1
        arrivals.append(t)
        prompts.append(p)
        outputs.append(draw(st.integers(1, max_output)))
        ids.append(h)
    return arrivals, prompts, outputs, ids

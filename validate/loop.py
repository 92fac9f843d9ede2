"""The serving loop: kvsim's pure scheduler and KV cache manager drive a real model on a device.

``python -m validate --config CFG.json --out RECORDS.json`` (written by ``kvsim validate``, which
runs this in a child process so that kvsim never imports torch). Per step, as a real engine:
requests that have arrived by the wall clock join the scheduler (`Scheduler.add`); `schedule()`
decides the batch; the block tables follow the pool's counts (`validate.blocks`); input ids,
positions, slot mappings and block tables are built from the `SchedulerOutput`; the model runs one
forward and samples; `complete()` applies the step (`step`: the part the calibrator's
``step_overhead`` also times, forward left out, by `empty_step`). With nothing to run, the loop
sleeps until the next arrival. The same code (`kvsim.core`) decides the simulator's steps, so only
costs can differ.

Recorded per run: each request's arrival, first scheduling, first token, finish and every token's
time; each step's composition (decode contexts, prefill chunks and their contexts, rows sampling),
start, measured duration and KV blocks in use; the pool's occupancy at every step. With
``op_timing`` in the config, one more run times each op of the forward (`validate.opclock`). Times are
seconds from the run's start, by ``time.perf_counter`` (CUDA: the sampled ids are read back every
step, which synchronises). A warm-up run is executed and discarded first (a burst of the trace
on a CPU; on CUDA the trace itself, as Triton compiles each kernel variant on first use); ``repeats`` runs follow, each on a fresh scheduler.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from kvsim.core.kv_cache_manager import KVCacheManager
from kvsim.core.request import Request, RequestStatus
from kvsim.core.sched.output import SchedulerOutput
from kvsim.core.sched.scheduler import Scheduler
from kvsim.spec.models import load_model
from validate.blocks import BlockTables
from validate.model import StepInputs, TinyLlama
from validate.opclock import NO_CLOCK, OpClock


class UsageError(Exception):
    pass


def _build(
    out: SchedulerOutput, tables: BlockTables, tokens: dict[int, list[int]], bs: int, device: str
) -> StepInputs:
    ids: list[int] = []
    pos: list[int] = []
    nd = len(out.decode_reqs)
    dec_slots, dec_lens, dec_rows = [], [], []
    for r, c in zip(out.decode_reqs, out.decode_ctx, strict=True):
        t = tables.tables[r.id]
        ids.append(tokens[r.id][c])
        pos.append(c)
        dec_slots.append(t[c // bs] * bs + c % bs)
        dec_lens.append(c + 1)
        dec_rows.append(t)
    qsl: list[int] = [0]
    pre_lens: list[int] = []
    pre_rows: list[list[int]] = []
    pre_slots: list[int] = []
    sample = list(range(nd))
    for r, n, c, smp in zip(
        out.prefill_reqs, out.prefill_new, out.prefill_ctx, out.prefill_sampling, strict=True
    ):
        t = tables.tables[r.id]
        ids.extend(tokens[r.id][c : c + n])
        pos.extend(range(c, c + n))
        pre_slots.extend(t[p // bs] * bs + p % bs for p in range(c, c + n))
        qsl.append(qsl[-1] + n)
        pre_lens.append(c + n)
        pre_rows.append(t)
        if smp:
            sample.append(nd + qsl[-1] - 1)

    def table(rows: list[list[int]]) -> torch.Tensor:
        width = max((len(t) for t in rows), default=1)
        return torch.tensor([t + [0] * (width - len(t)) for t in rows] or [[0]], dtype=torch.int32)[
            : len(rows)
        ]

    i32, i64 = torch.int32, torch.int64
    return StepInputs(
        input_ids=torch.tensor(ids, dtype=i64).to(device),
        positions=torch.tensor(pos, dtype=i64).to(device),
        num_decode=nd,
        dec_slots=torch.tensor(dec_slots, dtype=i64).to(device),
        dec_tables=table(dec_rows).to(device),
        dec_lens=torch.tensor(dec_lens, dtype=i32).to(device),
        pre_qsl=torch.tensor(qsl, dtype=i32).to(device),
        pre_tables=table(pre_rows).to(device),
        pre_lens=torch.tensor(pre_lens, dtype=i32).to(device),
        pre_slots=torch.tensor(pre_slots, dtype=i64).to(device),
        max_query_len=max(out.prefill_new, default=0),
        sample_idx=torch.tensor(sample, dtype=i64).to(device),
    )


def step(
    sched: Scheduler,
    out: SchedulerOutput,
    tables: BlockTables,
    tokens: dict[int, list[int]],
    bs: int,
    device: str,
    forward: Callable[[StepInputs], torch.Tensor],
) -> tuple[list[Request], list[Request], list[Request]]:
    """One scheduled step on the device: the block tables brought to the scheduler's counts, the
    inputs built, the forward run and its tokens read back (which synchronises a GPU), the step
    applied (`Scheduler.complete`); the execution's and the calibrator's `empty_step`. Returns the rows that sampled a token, the requests that got
    their first token and those that finished."""
    tables.release(out.preempted)
    tables.sync([*out.decode_reqs, *out.prefill_reqs])
    sampled = forward(_build(out, tables, tokens, bs, device)).tolist()
    rows = [
        *out.decode_reqs,
        *(r for r, s in zip(out.prefill_reqs, out.prefill_sampling, strict=True) if s),
    ]
    first, done = sched.advance(out)
    for r, tok in zip(rows, sampled, strict=True):
        tokens[r.id].append(int(tok))
    return rows, first, done


def empty_step(
    rows: int, *, block_size: int = 16, prompt: int = 16, device: str = "cpu"
) -> Callable[[], object]:
    """The calibrator's ``step_overhead``: a call runs one decode step of `rows` requests through
    the loop's own code (`step`: scheduling, block tables, inputs, `complete`, then the finished
    requests' tables released) with the forward left out (it returns zeros; on CUDA the inputs
    still go to the device and the ids come back). The requests are prefilled before the first
    call, and decode for up to 4,096 calls."""
    steps = 4096
    kv = KVCacheManager(rows * (-(-(prompt + steps) // block_size) + 1), block_size, enable_caching=False)
    sched = Scheduler(
        kv, max_num_seqs=rows, max_batched_tokens=max(rows * prompt, rows), chunked_prefill=True
    )
    tables = BlockTables(kv)
    tokens = {i: [0] * prompt for i in range(rows)}
    for i in range(rows):
        sched.add(Request(i, 0.0, prompt, steps + 1, [], []))

    def forward(inputs: StepInputs) -> torch.Tensor:
        return torch.zeros(inputs.sample_idx.shape[0], dtype=torch.int64, device=device)

    def one() -> object:
        out = sched.schedule()
        _, _, done = step(sched, out, tables, tokens, block_size, device, forward)
        tables.release(done)
        tables.check()
        return out

    one()  # the prefill: every timed call is a decode step
    return one


def run_once(
    cfg: dict[str, Any],
    model: TinyLlama,
    max_context: int,
    *,
    burst: bool = False,
    clock: OpClock | None = None,
) -> dict[str, Any]:
    """One run of the trace (`burst`: every request at time 0, for the warm-up; `clock`: each op of
    the forward timed, its seconds per step in ``op_seconds``)."""
    bs, nb = int(cfg["block_size"]), int(cfg["num_blocks"])
    kv = KVCacheManager(nb, bs, enable_caching=False)
    sched = Scheduler(
        kv,
        max_num_seqs=int(cfg["max_num_seqs"]),
        max_batched_tokens=int(cfg["max_batched_tokens"]),
        chunked_prefill=bool(cfg["chunked_prefill"]),
    )
    tables = BlockTables(kv)
    rq = cfg["requests"]
    arrivals = [0.0 if burst else float(a) for a in rq["arrival_s"]]
    gen = torch.Generator().manual_seed(int(cfg["seed"]))
    vocab = model.embed.shape[0]
    reqs: list[Request] = []
    tokens: dict[int, list[int]] = {}
    times: dict[int, list[float]] = {}
    for i, (a, p, o) in enumerate(zip(arrivals, rq["prompt"], rq["output"], strict=True)):
        r = Request(i, a, int(p), int(o), [], [])
        if p + o > max_context:  # the simulator's rules (kvsim.run), so both reject the same requests
            r.status, r.reason = RequestStatus.REJECTED, "longer than the model's context"
        elif -(-(p + o - 1) // bs) > nb:
            r.status, r.reason = RequestStatus.REJECTED, "needs more KV blocks than a replica has"
        elif not cfg["chunked_prefill"] and p > cfg["max_batched_tokens"]:
            r.status, r.reason = (
                RequestStatus.REJECTED,
                "prompt exceeds max_batched_tokens without chunked prefill",
            )
        reqs.append(r)
        tokens[i] = torch.randint(0, vocab, (int(p),), generator=gen).tolist()
        times[i] = []
    live = [r for r in reqs if r.status is not RequestStatus.REJECTED]
    steps: list[list[Any]] = []
    op_seconds: list[dict[str, float]] = []
    samples: list[list[Any]] = []
    nxt, finished = 0, 0
    order = sorted(range(len(live)), key=lambda j: live[j].arrival_s)
    t0 = time.perf_counter()
    while finished < len(live):
        t_start = time.perf_counter() - t0
        while nxt < len(order) and live[order[nxt]].arrival_s <= t_start:
            sched.add(live[order[nxt]])
            nxt += 1
        out = sched.schedule()
        if out.empty:
            samples.append([t_start, 0, kv.pool.num_used, kv.pool.num_cached_free, kv.pool.free,
                            len(sched.running), len(sched.waiting)])  # fmt: skip
            if nxt >= len(order):
                raise RuntimeError("the scheduler ran nothing with no arrival left (a defect)")
            time.sleep(max(0.0, live[order[nxt]].arrival_s - (time.perf_counter() - t0)))
            continue
        for r in out.admitted:
            if math.isnan(r.first_scheduled_s):
                r.first_scheduled_s = t_start
        used = kv.pool.num_used  # the scheduler's counts: the tables follow them in `step`
        samples.append([t_start, 0, used, kv.pool.num_cached_free, kv.pool.free,
                        len(sched.running), len(sched.waiting)])  # fmt: skip
        rows, first, done = step(sched, out, tables, tokens, bs, model.device, model.forward)
        t_end = time.perf_counter() - t0
        if clock is not None:
            op_seconds.append(clock.take())
        for r in rows:
            times[r.id].append(t_end)
        for r in first:
            r.first_token_s = t_end
        for r in done:
            r.finish_s = t_end
        finished += len(done)
        tables.release(done)
        tables.check()
        steps.append(
            [t_start, t_end - t_start, list(out.decode_ctx), list(out.prefill_new), list(out.prefill_ctx),
             out.num_sampling, used, len(out.preempted)]
        )  # fmt: skip
    wall = time.perf_counter() - t0
    return {
        "wall_s": wall,
        "peak_used_blocks": kv.peak_used_blocks,
        "requests": [
            {
                "id": r.id,
                "arrival_s": r.arrival_s,
                "first_scheduled_s": r.first_scheduled_s,
                "first_token_s": r.first_token_s,
                "finish_s": r.finish_s,
                "preemptions": r.preemptions,
                "status": r.status.value,
                "reason": r.reason,
                "token_times": times[r.id],
            }
            for r in reqs
        ],
        "steps": steps,
        "step_columns": [
            "t_start_s",
            "seconds",
            "decode_ctx",
            "prefill_new",
            "prefill_ctx",
            "num_sampling",
            "kv_used_blocks",
            "preempted",
        ],
        "samples": samples,
        **({"op_seconds": op_seconds} if clock is not None else {}),
    }


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_json_safe(v) for v in x]
    return x


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="validate", description="Execute a trace on a device (kvsim validate's child)."
    )
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    try:
        cfg = json.loads(Path(args.config).read_text())
        device = cfg["device"]
        if device == "cuda" and not torch.cuda.is_available():
            raise UsageError("--device: CUDA is not available on this machine")
        if device not in ("cpu", "cuda"):
            raise UsageError(f"--device: unknown device {device!r}; expected cpu or cuda")
        torch.manual_seed(int(cfg["seed"]))
        spec = load_model(cfg["model_config"], source="model")
        model = TinyLlama(
            spec,
            device=device,
            kv_format=cfg["kv_format"],
            num_blocks=int(cfg["num_blocks"]),
            block_size=int(cfg["block_size"]),
            seed=int(cfg["seed"]),
        )
        from calibrate.harness import device_info

        runs = []
        for k in range(int(cfg["warmup_runs"]) + int(cfg["repeats"])):
            # The warm-up: on a CPU a burst (quick; it only warms allocators and caches); on CUDA
            # the trace itself, so Triton compiles every kernel variant the recorded runs will meet.
            res = run_once(
                cfg, model, spec.max_context, burst=k < int(cfg["warmup_runs"]) and device == "cpu"
            )
            if k >= int(cfg["warmup_runs"]):
                runs.append(res)
            if cfg.get("progress"):
                kind = "warm-up run" if k < int(cfg["warmup_runs"]) else f"run {len(runs)}/{cfg['repeats']}"
                print(f"validate: {kind}: {len(res['steps'])} steps in {res['wall_s']:.1f} s", flush=True)
        info = device_info(device)
        data: dict[str, Any] = {"device": info, "torch": torch.__version__, "runs": runs}
        if cfg.get("op_timing"):
            # One more run, not recorded with the others: a clock around each op of the forward
            # (`kvsim validate`'s per-op table), its steps' seconds per op in ``op_seconds``.
            model.clock = OpClock(model.cuda)
            data["op_run"] = run_once(cfg, model, spec.max_context, clock=model.clock)
            model.clock = NO_CLOCK
            if cfg.get("progress"):
                print(f"validate: per-op run: {len(data['op_run']['steps'])} steps", flush=True)
        Path(args.out).write_text(json.dumps(_json_safe(data)) + "\n")
    except UsageError as exc:
        print(f"validate: error: {exc}", file=sys.stderr)
        return 2
    return 0

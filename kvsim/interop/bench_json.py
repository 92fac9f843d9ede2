"""A run's result in vLLM ``bench serve``'s words (``kvsim run --format vllm-bench``).

``vllm_bench.json`` holds the keys ``vllm bench serve --save-result`` writes (vllm/benchmarks/
serve.py), computed as it computes them from the simulated requests: ``duration`` (s: the simulated
span, from 0 to the last token), ``completed``, ``failed`` (rejected or unfinished),
``total_input_tokens`` / ``total_output_tokens`` (completed requests), ``request_throughput``,
``request_goodput`` (the scenario's TTFT and TPOT SLOs, as ``--goodput ttft:.. tpot:..``),
``output_throughput``, ``total_token_throughput`` (per s), ``max_output_tokens_per_s`` and
``max_concurrent_requests`` (vLLM's one-second buckets), and for ttft, tpot, itl and e2el the
``mean_``, ``median_``, ``std_`` and ``pNN_`` values in ms (numpy's linear percentiles; NN from
``--percentiles``, default 99 as vLLM's ``--metric-percentiles``). With ``--save-detailed``, vLLM's
per-request lists in its units: ``input_lens``, ``output_lens`` (0 for a failed request),
``ttfts`` and ``itls`` (s; one gap per token, where vLLM's are per streamed chunk) and ``errors``;
``generated_texts`` are empty strings (kvsim has no text). kvsim's own keys say what ran:
``backend: "kvsim"``, ``model_id`` (the scenario's model), ``kvsim_scenario``.
"""

from __future__ import annotations

import json
import math
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from kvsim.core.request import RequestStatus
from kvsim.run import RunResult

FILE = "vllm_bench.json"


def _stats(name: str, x: np.ndarray, percentiles: tuple[float, ...]) -> dict[str, float]:
    """vLLM's mean/median/std/pNN of one metric (s in, ms out)."""
    v = x if x.size else np.zeros(1)  # vLLM: np.mean(xs or 0)
    out = {
        f"mean_{name}_ms": float(np.mean(v)) * 1000,
        f"median_{name}_ms": float(np.median(v)) * 1000,
        f"std_{name}_ms": float(np.std(v)) * 1000,
    }
    for p in percentiles:
        out[f"p{_pword(p)}_{name}_ms"] = float(np.percentile(v, p)) * 1000
    return out


def _pword(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def bench_result(
    result: RunResult, *, detailed: bool = False, percentiles: tuple[float, ...] = ()
) -> dict[str, Any]:
    """The vLLM bench serve result dict of a run (module docstring)."""
    sc = result.scenario
    rec = result.record
    pcts = percentiles or (99.0,)
    seqs = sorted(result.seqs, key=lambda s: s.id)
    done = [s for s in seqs if s.status is RequestStatus.FINISHED]
    keep = {s.id for s in done}
    per_req: dict[int, list[float]] = {}
    for g in result.gaps:
        per_req.update(g.per_request(keep))
    ttft = np.array([s.first_token_s - s.arrival_s for s in done])
    e2e = np.array([s.finish_s - s.arrival_s for s in done])
    multi = [s for s in done if s.output_len > 1]
    tpot = np.array([(s.finish_s - s.first_token_s) / (s.output_len - 1) for s in multi])
    itl = np.array([g for s in done for g in per_req.get(s.id, [])])
    dur = max(rec.simulated_s, 1e-12)
    total_in = sum(s.prompt_len for s in done)
    total_out = sum(s.output_len for s in done)
    peak_tok, peak_conc = _peaks(done, per_req)
    bench = sc.workload.bench
    rate = bench.request_rate if bench is not None else None
    out: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": "kvsim",
        "backend": "kvsim",
        "label": None,
        "model_id": sc.model.name,
        "tokenizer_id": None,
        "num_prompts": len(result.seqs),
        "request_rate": ("inf" if math.isinf(rate) else rate) if rate is not None else None,
        "burstiness": bench.burstiness if bench is not None else None,
        "max_concurrency": None,
        "kvsim_scenario": sc.name,
        "duration": dur,
        "completed": len(done),
        "failed": len(seqs) - len(done),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / dur,
        "request_goodput": rec.goodput_req_s,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
    }
    if detailed:
        out["input_lens"] = [s.prompt_len for s in seqs]
        out["output_lens"] = [s.output_len if s.id in keep else 0 for s in seqs]
        out["ttfts"] = [s.first_token_s - s.arrival_s if s.id in keep else 0.0 for s in seqs]
        out["itls"] = [per_req.get(s.id, []) for s in seqs]
        out["generated_texts"] = ["" for _ in seqs]
        out["errors"] = ["" if s.id in keep else f"kvsim: {s.status.name.lower()}" for s in seqs]
    out["max_output_tokens_per_s"] = peak_tok
    out["max_concurrent_requests"] = peak_conc
    for name, x in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2e)):
        out.update(_stats(name, x, pcts))
    return out


def _peaks(done: list[Any], per_req: dict[int, list[float]]) -> tuple[float, int]:
    """vLLM's max_output_tokens_per_s and max_concurrent_requests: tokens emitted and requests
    active in each whole second since the first request started."""
    if not done:
        return 0.0, 0
    t0 = min(s.arrival_s for s in done)
    t1 = max(s.finish_s for s in done)
    n = math.ceil(t1 - t0) + 1
    tokens = np.zeros(n)
    conc = np.zeros(n)
    for s in done:
        times = s.first_token_s + np.concatenate([[0.0], np.cumsum(per_req.get(s.id, []))])
        b = (times - t0).astype(np.int64)
        b = b[(b >= 0) & (b < n)]
        np.add.at(tokens, b, 1)
        conc[int(s.arrival_s - t0) : int(s.finish_s - t0) + 1] += 1
    return float(tokens.max()), int(conc.max())


def write_bench_json(result: RunResult, out: Path, *, detailed: bool, percentiles: tuple[float, ...]) -> Path:
    path = out / FILE
    data = bench_result(result, detailed=detailed, percentiles=percentiles)
    path.write_text(json.dumps(data, allow_nan=False) + "\n", encoding="utf-8")
    return path

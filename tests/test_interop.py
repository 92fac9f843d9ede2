"""vLLM bench serve's workloads and result schema, and validate --against (kvsim/interop)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest

from kvsim.cli import main
from kvsim.interop.against import against, read_bench_result, rebuilt_workload
from kvsim.interop.bench_json import bench_result
from kvsim.run import run_scenario
from kvsim.spec.bench import BenchConfig, RandomConfig, bench_arrivals, random_dataset, read_sharegpt
from kvsim.spec.scenario import load_scenario

DATA = Path(__file__).parent / "data" / "interop"
SHAREGPT = DATA / "sharegpt_made_up.json"


def _scenario(tmp_path: Path, workload: str) -> Path:
    p = tmp_path / "s.yaml"
    p.write_text(
        "name: t\nmodel: llama-3.1-8b\ncluster: {gpu: h100-sxm, nodes: 1, gpus_per_node: 1, tensor_parallel: 1}\n"
        f"workload: {workload}\n"
    )
    return p


def test_arrivals_are_vllm_get_request_draws() -> None:
    # vLLM: np.random.seed(seed); one np.random.gamma(shape=b, scale=1/(rate*b)) per request, summed,
    # scaled so that the last lands at n / rate.
    np.random.seed(3)
    gaps = [np.random.gamma(shape=0.5, scale=1.0 / (4.0 * 0.5)) for _ in range(50)]
    want = np.cumsum(gaps)
    want *= (50 / 4.0) / want[-1]
    assert np.allclose(bench_arrivals(50, 4.0, 0.5, 3), want, rtol=0, atol=1e-12)
    assert bench_arrivals(5, math.inf, 1.0, 0).tolist() == [0.0] * 5
    assert np.allclose(np.diff(bench_arrivals(4, 2.0, math.inf, 0)), 0.5)


def test_random_dataset_ranges_and_shared_prefix() -> None:
    cfg = RandomConfig(input_len=100, output_len=10, range_ratio=0.5, prefix_len=40)
    prompt, output, ids = random_dataset(cfg, 200, seed=0)
    inner = prompt - 40
    assert inner.min() >= 50 and inner.max() <= 150 and output.min() >= 5 and output.max() <= 15
    rng = np.random.default_rng(0)  # vLLM's RandomDataset: input lens, then output lens
    assert (inner == rng.integers(50, 151, 200)).all() and (output == rng.integers(5, 16, 200)).all()
    assert ids is not None and all(len(h) == -(-p // 16) for h, p in zip(ids, prompt, strict=True))
    assert {tuple(h[:2]) for h in ids} == {(0, 1)}  # 40 tokens: two full shared blocks
    assert len({int(h[2]) for h in ids}) == 200  # then every block its own


def test_sharegpt_picks_as_vllm() -> None:
    cfg = BenchConfig(num_prompts=12, chars_per_token=4.0)
    prompt, output, estimated, skipped = read_sharegpt(SHAREGPT, cfg, seed=0)
    data = [e for e in json.loads(SHAREGPT.read_text()) if len(e["conversations"]) >= 2]
    random.Random(0).shuffle(data)

    def n(t: dict[str, object]) -> int:
        tok = t.get("tokens")
        return tok if isinstance(tok, int) else round(len(str(t["value"])) / 4.0)

    first = [(n(e["conversations"][0]), n(e["conversations"][1])) for e in data]
    assert list(zip(prompt.tolist(), output.tolist(), strict=True))[: len(first)] == first
    assert len(prompt) == 12 and skipped == 0  # 9 pairs topped up by random.choices
    assert estimated == sum(1 for p, o in zip(prompt, output, strict=True) if (p, o) != (300, 120))


def test_sharegpt_run_warns_of_estimates(tmp_path: Path) -> None:
    wl = f"{{trace: {SHAREGPT}, format: sharegpt, bench: {{num_prompts: 9, request_rate: 20}}}}"
    res = run_scenario(load_scenario(str(_scenario(tmp_path, wl)), []))
    assert res.record.requests.completed == 9
    assert any("estimates at 4 characters a token" in w for w in res.record.warnings)
    counted = tmp_path / "counted.json"
    turns = [{"from": "human", "value": "x", "tokens": 30}, {"from": "gpt", "value": "y", "tokens": 7}]
    counted.write_text(json.dumps([{"id": "0", "conversations": turns}]))
    exact = f"{{trace: {counted}, format: sharegpt, bench: {{num_prompts: 3}}}}"
    res = run_scenario(load_scenario(str(_scenario(tmp_path, exact)), []))
    assert not any("estimates" in w for w in res.record.warnings)
    assert (res.record.tokens.prompt, res.record.tokens.output) == (90, 21)  # oversampled x3


def test_vllm_bench_json_matches_the_summary(tmp_path: Path) -> None:
    wl = "{random: {input_len: 200, output_len: 40, range_ratio: 0.5}, bench: {num_prompts: 30, request_rate: 6}}"
    res = run_scenario(load_scenario(str(_scenario(tmp_path, wl)), []), percentiles=(50.0, 99.0))
    d = bench_result(res, detailed=True, percentiles=(50.0, 99.0))
    rec = res.record
    assert d["completed"] == rec.requests.completed == 30
    assert d["total_output_tokens"] == rec.tokens.output
    assert d["p99_ttft_ms"] == pytest.approx(rec.ttft_s.p99 * 1000)
    assert d["median_tpot_ms"] == pytest.approx(rec.tpot_s.p50 * 1000)
    assert d["p99_e2el_ms"] == pytest.approx(rec.e2e_s.p99 * 1000)
    assert rec.itl_s is not None
    assert d["mean_itl_ms"] == pytest.approx(rec.itl_s.mean * 1000)
    assert d["p50_itl_ms"] == pytest.approx(rec.itl_s.p50 * 1000)
    assert d["output_throughput"] == pytest.approx(rec.output_throughput_tok_s)
    seqs = sorted(res.seqs, key=lambda s: s.id)
    for s, itls, o, ttft in zip(seqs, d["itls"], d["output_lens"], d["ttfts"], strict=True):
        assert len(itls) == o - 1  # one gap per token after the first
        assert sum(itls) == pytest.approx(s.finish_s - s.first_token_s)
        assert ttft == pytest.approx(s.first_token_s - s.arrival_s)


def test_against_own_result_has_no_error(tmp_path: Path) -> None:
    sc = _scenario(
        tmp_path,
        "{random: {input_len: 300, output_len: 30}, bench: {num_prompts: 25, request_rate: 5, seed: 0}}",
    )
    assert (
        main(
            [
                "run",
                str(sc),
                "--out",
                str(tmp_path / "o"),
                "--no-progress",
                "--format",
                "vllm-bench",
                "--save-detailed",
            ]
        )
        == 0
    )
    run = read_bench_result(tmp_path / "o" / "vllm_bench.json")
    data, _ = against(run, load_scenario(str(sc), []), seed=0)
    names = [r["metric"] for r in data["metrics"]]
    assert {"p99_ttft_ms", "mean_itl_ms", "median_e2el_ms", "request_throughput"} <= set(names)
    assert all(abs(r["error"]) < 1e-9 for r in data["metrics"]), data["metrics"]
    data2, _ = against(run, load_scenario(str(sc), []), seed=1)  # other arrivals: other numbers
    assert any(abs(r["error"]) > 1e-3 for r in data2["metrics"])


def test_against_made_up_results_print_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    for name, tool in (("vllm_bench_made_up.json", "vllm"), ("sglang_bench_made_up.jsonl", "sglang")):
        run = read_bench_result(DATA / name)
        assert run.tool == tool
        wl, failed = rebuilt_workload(run, 0)
        assert (len(wl), failed) == (11, 1)
        assert main(["validate", "--against", str(DATA / name), "--no-progress"]) == 0
        out = capsys.readouterr().out
        assert "p99_ttft_ms" in out and "measured" in out and "1 failed requests" in out

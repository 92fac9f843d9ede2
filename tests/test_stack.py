"""`kvsim stack`: the documents' stacking table recomputed by simulation, row by row."""

from __future__ import annotations

import json
import math

from kvsim.cli import main
from kvsim.stack import ONE_M, stack_rows
from tests.helpers import small_scenario

WL = {
    "synthetic": {
        "num_requests": 40,
        "rate": 4,
        "input": {"dist": "constant", "mean": 3000},
        "output": {"dist": "constant", "mean": 50},
        "shared_prefix_tokens": 1024,
    }
}


def test_rows_shrink_the_sequence_as_each_technique_is_added():
    rows = stack_rows(small_scenario(workload=WL))
    assert [r.simulated for r in rows] == [True] * 6
    kv = [r.kv_bytes_1m for r in rows]
    # Llama-3.1-8B, 32 layers x 128 dims: MHA 32 KV heads, GQA 8, both fp16; then fp8 halves it.
    assert kv[0] == 2 * 32 * 32 * 128 * 2 * ONE_M
    assert kv[1] == 2 * 32 * 8 * 128 * 2 * ONE_M == kv[0] // 4
    assert kv[2] == kv[1] // 2 == kv[3]  # paging + sharing: the same bytes for one sequence
    assert kv[4] == kv[3] * math.ceil(0.2 * ONE_M) // ONE_M  # H2O keeps 20%
    # Offload is simulated on the H2O row, H2O on: the same bytes for one sequence as row 4. With
    # HBM to spare nothing goes down a tier (and trimmed prefixes never would): row 4's numbers.
    assert kv[5] == kv[4] and "H2O on" in rows[5].note
    assert (rows[5].hbm_peak_bytes, rows[5].ttft_p99_s) == (rows[4].hbm_peak_bytes, rows[4].ttft_p99_s)
    assert all(r.completed == 40 for r in rows)
    # Sharing the 1,024-token prefix cuts time to first token; H2O cuts per-token time.
    assert rows[3].ttft_p99_s < rows[2].ttft_p99_s
    assert rows[0].tpot_p99_s > rows[1].tpot_p99_s
    # FP8 on an H100 with the factors fitted to NVIDIA's tables (decode attention 1.26x faster,
    # prefill attention 1.18x slower; kvsim/data/analytic_fit.json): at this prefill-heavy load its
    # per-token time moves by under 5% either way (it was 1.6x faster by assumption before the fit).
    assert abs(rows[2].tpot_p99_s / rows[1].tpot_p99_s - 1) < 0.05
    assert rows[0].claimed_memory == "~435 GB" and rows[4].claimed_cost == "~$5"


def test_a_sliding_window_model_leaves_the_eviction_row_unsimulated_and_offloads_row_3():
    rows = stack_rows(small_scenario(model="mistral-7b", workload=WL))
    assert [r.simulated for r in rows] == [True] * 4 + [False, True]
    # Mistral-7B keeps its 4,096-token window on every layer: a 1M-token sequence holds 4,096
    # tokens of 32 layers x 8 KV heads x 128 dims in fp16 (MHA: 32 heads, four times that).
    assert rows[1].kv_bytes_1m == 2 * 32 * 8 * 128 * 2 * 4096 == rows[0].kv_bytes_1m // 4
    assert "sliding-window" in rows[4].note and "token eviction" in rows[4].note
    # Offload on row 3: the same bytes for one sequence; the 3,000-token prompts fit the window,
    # nothing goes cold, and HBM has room: row 3's numbers.
    assert "row 3" in rows[5].note and rows[5].kv_bytes_1m == rows[3].kv_bytes_1m
    assert (rows[5].hbm_peak_bytes, rows[5].ttft_p99_s) == (rows[3].hbm_peak_bytes, rows[3].ttft_p99_s)
    assert all(r.completed == 40 for r in rows if r.simulated)


def test_a_format_switch_in_the_scenario_is_left_out_of_the_rows():
    kv = {"format": "fp8", "format_switch": {"after_tokens": 1000, "format": "kvquant4"}}
    rows = stack_rows(small_scenario(workload=WL, kv=kv))
    assert [r.simulated for r in rows] == [True] * 6  # H2O and offload rows run (no refusal)
    assert rows[2].kv_bytes_1m == 2 * 32 * 8 * 128 * ONE_M  # fp8 throughout, as without the switch


def test_cli_writes_json_and_html(tmp_path, capsys):
    sc = tmp_path / "s.yaml"
    sc.write_text(
        "model: llama-3.1-8b\ncluster: {gpu: h100-sxm, gpus_per_node: 1}\n"
        "workload: {synthetic: {num_requests: 5, rate: 1, input: {dist: constant, mean: 500}, "
        "output: {dist: constant, mean: 20}}}\n"
    )
    assert main(["stack", str(sc), "--out", str(tmp_path / "out"), "--json"]) == 0
    captured = capsys.readouterr()
    printed = json.loads(captured.out)  # progress goes to stderr: stdout is the JSON alone
    # Piped (capsys is not a terminal): one line per simulated row, each naming it.
    lines = captured.err.splitlines()
    assert [ln.split(" (")[0] for ln in lines] == [f"point {k}/6 done" for k in range(1, 7)]
    assert "(+ FP8 KV)" in lines[2] and "ETA" in lines[0]
    saved = json.loads((tmp_path / "out" / "stack.json").read_text())
    assert printed == saved and saved["schema"] == "kvsim-stack" and len(saved["rows"]) == 6
    assert "rate_scale" in saved["cost_basis"]
    page = (tmp_path / "out" / "stack.html").read_text()
    assert "kvsim stack" in page and "~4 GB (GPU) + 2 GB (DRAM)" in page and "+ H2O (20% kept)" in page


def test_stack_no_progress_prints_nothing_on_stderr(tmp_path, capsys):
    sc = tmp_path / "s.yaml"
    sc.write_text(
        "model: llama-3.1-8b\ncluster: {gpu: h100-sxm, gpus_per_node: 1}\n"
        "workload: {synthetic: {num_requests: 2, rate: 1, input: {dist: constant, mean: 100}, "
        "output: {dist: constant, mean: 4}}}\n"
    )
    assert main(["stack", str(sc), "--json", "--no-progress"]) == 0
    assert capsys.readouterr().err == ""


def test_gpu_memory_counts_weights_reserve_and_referenced_blocks():
    from kvsim.run import run_scenario

    sc = small_scenario(workload=WL)
    rows = stack_rows(sc)
    import dataclasses

    from kvsim.spec.formats import make_format
    from kvsim.spec.scenario import PrefixCacheScope

    fp16 = dataclasses.replace(sc.kv, format=make_format("fp16")[0], prefix_cache=PrefixCacheScope.NONE)
    s = run_scenario(dataclasses.replace(sc, kv=fp16)).summary
    want = s["weight_bytes_per_gpu"] + s["memory_plan"]["activation_reserve_bytes"]
    assert rows[1].hbm_peak_bytes == want + s["kv_peak_used_blocks"] * s["kv_block_bytes"]
    assert rows[4].hbm_peak_bytes < rows[3].hbm_peak_bytes  # H2O frees what fp8 + sharing held


BURST = {
    "synthetic": {
        "num_requests": 80,
        "rate": 400,
        "input": {"dist": "constant", "mean": 600},
        "output": {"dist": "constant", "mean": 100},
    }
}


def test_each_claim_gets_a_verdict_that_follows_from_its_runs():
    import dataclasses

    from kvsim.claims import (
        FAILS,
        HOLDS,
        UNCHECKED,
        block_verdict,
        check_claims,
        h2o_verdict,
        offload_verdict,
        switch_verdict,
    )

    sc = small_scenario(workload=BURST)
    sc = dataclasses.replace(sc, model=dataclasses.replace(sc.model, max_context=1 << 20))  # reach 500K
    claims = {c.key: c for c in check_claims(sc)}
    assert list(claims) == ["h2o_32", "fp8_4bit_500k", "offload_10pct", "block_32_128k", "h2o_ruler"]
    runs = [r for c in claims.values() for r in c.runs]
    assert all(r.settings and r.metrics["completed"] >= 1 for r in runs)
    # H2O: the burst runs 16 at a time under the cap and all 80 at once without it: both sides of 32.
    h = claims["h2o_32"]
    peaks = [int(r.metrics["peak_concurrent_sequences"]) for r in h.runs]
    assert len(h.runs) == 4 and peaks[0] <= 16 < 32 < peaks[2]
    pts = [
        (peaks[i], h.runs[i].metrics["cost_per_mtok_usd"], h.runs[i + 1].metrics["cost_per_mtok_usd"])
        for i in (0, 2)
    ]
    assert h.verdict in (HOLDS, FAILS) and (h.verdict, h.why) == h2o_verdict(pts)
    # FP8's pool on one H100 holds about 900K tokens of Llama-3.1-8B, 4-bit about 1.56M: FP8 serves
    # 500K but not 1M, 4-bit does. The documents' switch point holds for this model and GPU.
    f = claims["fp8_4bit_500k"]
    pool = [int(r.metrics["kv_tokens_per_replica"]) for r in f.runs]
    assert (
        500_000 <= pool[0] < 1_000_000 <= pool[1] and f.verdict == HOLDS == switch_verdict(1 << 20, *pool)[0]
    )
    o = claims["offload_10pct"]
    blocks = [r.metrics["kv_peak_used_blocks"] for r in o.runs]
    assert (o.verdict, o.why) == offload_verdict(*blocks) and o.runs[0].label.startswith("+ H2O")
    b = claims["block_32_128k"]  # 700-token sequences: the rule speaks of a 128K mean
    assert b.verdict == UNCHECKED and "700 tokens" in b.why and len(b.runs) == 1
    assert b.why == block_verdict(700, None, None)[1]
    assert claims["h2o_ruler"].verdict == UNCHECKED and claims["h2o_ruler"].runs == []


def test_verdicts_flip_when_the_compared_numbers_flip():
    from kvsim.claims import (
        FAILS,
        HOLDS,
        UNCHECKED,
        block_verdict,
        h2o_verdict,
        offload_verdict,
        switch_verdict,
    )

    assert h2o_verdict([(16, 1.0, 1.0), (80, 1.0, 0.9)])[0] == HOLDS
    assert h2o_verdict([(16, 1.0, 0.9), (80, 1.0, 1.0)])[0] == FAILS  # pays off below, not above
    assert h2o_verdict([(16, 1.0, 0.9), (80, 1.0, 0.9)])[0] == FAILS  # pays off below too
    assert h2o_verdict([(10, 1.0, 1.0), (20, 1.0, 0.9)])[0] == UNCHECKED  # never above 32
    assert switch_verdict(1 << 20, 900_000, 1_560_000)[0] == HOLDS
    assert switch_verdict(1 << 20, 400_000, 1_560_000)[0] == FAILS  # FP8 not enough below 500K
    assert switch_verdict(1 << 20, 1_100_000, 1_560_000)[0] == FAILS  # FP8 enough above it too
    assert switch_verdict(1 << 20, 900_000, 950_000)[0] == FAILS  # 4-bit does not reach 1M either
    assert switch_verdict(131_072, 900_000, 1_560_000)[0] == UNCHECKED
    assert offload_verdict(100, 90)[0] == HOLDS and offload_verdict(100, 91)[0] == FAILS
    assert offload_verdict(0, 0)[0] == UNCHECKED
    assert block_verdict(200_000, 0.020, 0.019)[0] == HOLDS
    assert block_verdict(200_000, 0.019, 0.020)[0] == FAILS
    assert block_verdict(4_000, 0.020, 0.019)[0] == UNCHECKED


def test_cli_claims_go_to_the_terminal_json_and_page(tmp_path, capsys):
    sc = tmp_path / "s.yaml"
    sc.write_text(
        "model: llama-3.1-8b\ncluster: {gpu: h100-sxm, gpus_per_node: 1}\n"
        "workload: {synthetic: {num_requests: 5, rate: 1, input: {dist: constant, mean: 500}, "
        "output: {dist: constant, mean: 20}}}\n"
    )
    assert main(["stack", str(sc), "--out", str(tmp_path / "out"), "--claims", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "the documents' rules, checked" in printed and "not checkable here" in printed
    saved = json.loads((tmp_path / "out" / "stack.json").read_text())
    assert saved["claims"][0]["key"] == "h2o_32" and saved["claims"][0]["runs"]
    page = (tmp_path / "out" / "stack.html").read_text()
    assert "H2O pays off only above 32 concurrent sequences" in page and "max_num_seqs 16" in page
    # Without --claims: no claims key, no section.
    assert main(["stack", str(sc), "--json", "--no-progress"]) == 0
    assert "claims" not in json.loads(capsys.readouterr().out)

"""workload.clip_to_context: an over-long request is shortened to the model's context, not rejected."""

from __future__ import annotations

import numpy as np
import pytest

from kvsim.run import run_scenario
from kvsim.spec.workload import clip_to_context
from tests.helpers import make_workload, small_scenario

CTX = 131072  # llama-3.1-8b's context


def _run(clip: bool, wl):  # type: ignore[no-untyped-def]
    sc = small_scenario(workload={"synthetic": {"num_requests": 1, "rate": 1}, "clip_to_context": clip})
    assert sc.workload.clip_to_context is clip
    return run_scenario(sc, workload=wl)


def _accounted(rec) -> bool:  # type: ignore[no-untyped-def]
    r = rec.requests
    return r.completed + r.rejected + r.unfinished == r.total


def test_an_over_long_request_is_rejected_without_the_flag():
    res = _run(False, make_workload([0.0, 1.0], [131000, 500], [500, 20]))
    rec = res.record
    assert (rec.requests.completed, rec.requests.rejected) == (1, 1)
    assert rec.requests.rejected_reasons == {"longer than the model's context": 1}
    assert rec.workload.clipped_to_context == 0 and not rec.config.clip_to_context
    assert _accounted(rec)


def test_with_the_flag_it_is_clipped_and_completes():
    res = _run(True, make_workload([0.0, 1.0], [131000, 500], [500, 20]))
    rec = res.record
    long, short = res.seqs
    assert (long.prompt_len, long.output_len) == (CTX - 500, 500)  # the prompt gives way, the output stays
    assert long.num_generated == 500 and long.finish_s > long.first_token_s
    assert (short.prompt_len, short.output_len) == (500, 20)  # within the context: untouched
    assert (rec.requests.completed, rec.requests.rejected) == (2, 0) and _accounted(rec)
    assert rec.workload.clipped_to_context == 1 and rec.config.clip_to_context
    assert any("1 requests longer than llama-3.1-8b's context" in w and "clipped" in w for w in rec.warnings)
    assert res.summary["workload"]["clipped_to_context"] == 1


def test_an_output_longer_than_the_context_keeps_one_prompt_token():
    wl = clip_to_context(make_workload([0.0, 0.0, 0.0], [10, 200, 50], [300, 60, 50]), 100)
    assert wl.prompt_tokens.tolist() == [1, 40, 50]
    assert wl.output_tokens.tolist() == [99, 60, 50]
    assert wl.clipped_to_context == 2
    assert ((wl.prompt_tokens >= 1) & (wl.output_tokens >= 1)).all()
    assert (wl.prompt_tokens + wl.output_tokens <= 100).all()


def test_a_clipped_prompt_keeps_the_prefix_ids_of_the_blocks_it_still_covers():
    wl = make_workload([0.0, 1.0], [64, 40], [8, 8], hash_ids=[[1, 2, 3, 4], [1, 2, 5]], block_tokens=16)
    out = clip_to_context(wl, 44)  # request 0: prompt 64 -> 36 tokens, 3 blocks of 16
    assert out.prompt_tokens.tolist() == [36, 36]
    assert out.hash_ids is not None
    assert [h.tolist() for h in out.hash_ids] == [[1, 2, 3], [1, 2, 5]]
    assert clip_to_context(out, 44) is out  # nothing left to clip: the same workload


@pytest.mark.parametrize("seed", [0, 1])
def test_accounting_holds_on_a_mixed_workload(seed: int):
    rng = np.random.default_rng(seed)
    n = 30
    prompts = rng.integers(100, 200_000, n)
    outputs = rng.integers(1, 4000, n)
    res = _run(True, make_workload(np.sort(rng.uniform(0, 5, n)), prompts, outputs))
    rec = res.record
    assert rec.workload.clipped_to_context == int((prompts + outputs > CTX).sum()) > 0
    assert "longer than the model's context" not in rec.requests.rejected_reasons
    assert _accounted(rec) and rec.requests.total == n

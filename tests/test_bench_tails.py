"""`bench/bench_tails.py`'s robust mode (issue 29): which loads a case runs at, and the median and
range of its errors over them, on made-up numbers (the runs themselves are the benchmark's)."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.helpers import ROOT

_spec = importlib.util.spec_from_file_location("bench_tails", ROOT / "bench/bench_tails.py")
assert _spec is not None and _spec.loader is not None
tails = importlib.util.module_from_spec(_spec)
sys.modules["bench_tails"] = tails
_spec.loader.exec_module(tails)


def test_loads_are_the_8b_cases_rate_scale_and_the_same_fractions_elsewhere():
    assert tails.case_loads("default-8b-h200-8x", [6, 7, 9]) == [6.0, 7.0, 8.0, 9.0]  # its own 8x added
    assert tails.case_loads("vidur-a100-llama2-7b-half", [6, 8, 10]) == [0.375, 0.5, 0.625]
    assert tails.case_loads("mooncake-70b-h100", [8]) == [1.0]  # the scenario file's own rate
    assert tails.at_load(("workload.rate_scale=8", "x=1"), 6.5) == ("x=1", "workload.rate_scale=6.5")


def test_spread_is_median_min_max_and_targets_are_judged_on_the_median():
    def err(ttft99: float, tpot50: float) -> dict[str, dict[str, float]]:
        e = {m: dict.fromkeys(tails.PCTS, 0.0) for m in tails.METRICS}
        e["ttft_s"]["p99"], e["tpot_s"]["p50"] = ttft99, tpot50
        return e

    sp = tails.spread([err(-0.30, 0.04), err(-0.05, 0.06), err(-0.08, 0.05)])
    assert sp["ttft_s"]["p99"] == (-0.08, -0.30, -0.05)
    assert sp["tpot_s"]["p50"] == pytest.approx((0.05, 0.04, 0.06))
    held = {name: ok for name, _, ok in tails.targets(sp)}
    assert held == {
        "TTFT p99 within 10%": True,  # one run at -30% does not decide it
        "TPOT p99 within 10%": True,
        "TTFT p50 within 5%": True,
        "TPOT p50 within 5%": True,  # 5.0% is within
    }

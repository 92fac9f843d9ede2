import math
from pathlib import Path

import numpy as np
import pytest

from kvsim.errors import KvsimError
from kvsim.spec.scenario import LengthDist, SyntheticConfig, WorkloadConfig
from kvsim.spec.traces import BURSTGPT_FAILED
from kvsim.spec.workload import Workload, load_workload

DATA = Path(__file__).parent / "data" / "traces"
BUNDLED = Path(__file__).parent.parent / "scenarios" / "traces"


def trace_cfg(path: Path, fmt: str, **kw) -> WorkloadConfig:
    base = dict(rate_scale=1.0, start_s=0.0, duration_s=None, max_requests=None, skip_bad_lines=False)
    base.update(kw)
    return WorkloadConfig(trace=path, format=fmt, synthetic=None, **base)


def syn_cfg(**kw) -> WorkloadConfig:
    base = dict(
        num_requests=200,
        rate_per_s=10.0,
        arrival="poisson",
        cv=1.0,
        input=LengthDist("lognormal", 300.0, 100.0),
        output=LengthDist("constant", 20.0),
    )
    base.update(kw)
    return WorkloadConfig(None, "synthetic", SyntheticConfig(**base), 1.0, 0.0, None, None, False)


def ids(w: Workload) -> list[list[int]]:
    assert w.hash_ids is not None
    return [h.tolist() for h in w.hash_ids]


def assert_prefix_unique(hash_ids: list[np.ndarray]) -> None:
    """Every id always follows the same id (None first): then equal ids mean equal prefixes."""
    parent: dict[int, int | None] = {}
    for h in hash_ids:
        prev = None
        for x in h.tolist():
            assert parent.setdefault(x, prev) == prev, f"id {x} follows both {parent[x]} and {prev}"
            prev = x


def assert_well_formed(w: Workload) -> None:
    n = len(w)
    assert w.arrival_s.dtype == np.float64 and w.prompt_tokens.dtype == np.int64
    assert w.output_tokens.dtype == np.int64
    assert w.prompt_tokens.shape == w.output_tokens.shape == (n,)
    assert np.all(np.diff(w.arrival_s) >= 0)
    assert w.prompt_tokens.min() >= 1 and w.output_tokens.min() >= 1
    if w.hash_ids is not None:
        assert len(w.hash_ids) == n
        g = w.hash_block_tokens
        for h, p in zip(w.hash_ids, w.prompt_tokens.tolist(), strict=True):
            assert h.dtype == np.int64 and len(h) == -(-p // g)
        assert_prefix_unique(w.hash_ids)


# --- readers on small fixtures ---------------------------------------------------------------------


def test_mooncake_fixture():
    w = load_workload(trace_cfg(DATA / "mooncake_small.jsonl", "mooncake"), seed=0)
    assert_well_formed(w)
    assert len(w) == 5
    assert w.arrival_s.tolist() == [0.0, 0.0, 1.5, 2.25, 4.0]
    assert w.prompt_tokens.tolist() == [1000, 512, 1100, 10, 2048]
    assert w.output_tokens.tolist() == [20, 5, 7, 1, 300]
    assert ids(w) == [[0, 1], [0], [0, 1, 2], [3], [4, 5, 6, 7]]
    assert w.hash_block_tokens == 512
    assert w.line_numbers is not None and w.line_numbers.tolist() == [1, 2, 4, 5, 6]  # line 3 is blank
    assert w.source == str(DATA / "mooncake_small.jsonl")
    assert w.skipped_lines == 0 and w.dropped == {}


def test_azure_fixture_relative_to_first_row_across_midnight():
    w = load_workload(trace_cfg(DATA / "azure_small.csv", "azure"), seed=0)
    assert_well_formed(w)
    assert w.arrival_s == pytest.approx([0.0, 1.25, 2.5, 2.75, 4.5])
    assert w.prompt_tokens.tolist() == [374, 396, 10, 20, 30]
    assert w.output_tokens.tolist() == [44, 109, 1, 2, 3]
    assert w.hash_ids is None
    assert w.line_numbers is not None and w.line_numbers.tolist() == [2, 3, 4, 5, 6]


def test_azure_timezone_offset(tmp_path):
    f = tmp_path / "tz.csv"
    f.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2024-05-10 00:00:00.000000+00:00,5,5\n"
        "2024-05-10 02:00:10.5+02:00,5,5\n"
        "2024-05-10 00:00:20.5,5,5\n"
    )
    w = load_workload(trace_cfg(f, "azure"), seed=0)
    assert w.arrival_s == pytest.approx([0.0, 10.5, 20.5])


def test_burstgpt_drops_failed_requests():
    w = load_workload(trace_cfg(DATA / "burstgpt_small.csv", "burstgpt"), seed=0)
    assert_well_formed(w)
    # Rebased to the first row (5 s in the file; a trace is timed from its first request).
    assert w.arrival_s.tolist() == [0.0, 113.0, 146.0]
    assert w.origin_s == 5.0
    assert w.prompt_tokens.tolist() == [472, 417, 20]
    assert w.output_tokens.tolist() == [18, 276, 5]
    assert w.dropped == {BURSTGPT_FAILED: 2}
    assert BURSTGPT_FAILED == "burstgpt_failed_zero_response"
    # Dropped requests are counted within the window only; the rows before it are counted too.
    w = load_workload(trace_cfg(DATA / "burstgpt_small.csv", "burstgpt", start_s=100.0), seed=0)
    assert w.dropped == {BURSTGPT_FAILED: 1}
    assert w.arrival_s.tolist() == [13.0, 46.0]
    assert w.before_window == 1 and w.after_window == 0


def test_vidur_fixture():
    w = load_workload(trace_cfg(DATA / "vidur_small.csv", "vidur"), seed=0)
    assert_well_formed(w)
    assert w.arrival_s.tolist() == [0.0, 0.25, 1.5]
    assert w.prompt_tokens.tolist() == [100, 200, 300]
    assert w.output_tokens.tolist() == [10, 20, 30]


def test_generic_csv():
    w = load_workload(trace_cfg(DATA / "generic_small.csv", "generic"), seed=0)
    assert_well_formed(w)
    assert w.arrival_s.tolist() == [0.0, 0.5, 2.0]
    assert w.prompt_tokens.tolist() == [64, 128, 32]
    assert w.hash_ids is None


def test_generic_jsonl_renumbers_ids_into_chains():
    w = load_workload(trace_cfg(DATA / "generic_small.jsonl", "generic"), seed=0)
    assert_well_formed(w)
    assert w.hash_block_tokens == 16
    # Id 11 follows 10, nothing and 99 in the file: three different prefixes, three ids.
    assert ids(w) == [[0, 1, 2], [0, 1, 3], [4], [5, 6]]


def test_generic_jsonl_without_ids(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"arrival_s": 1, "prompt_tokens": 3, "output_tokens": 2}\n')
    w = load_workload(trace_cfg(f, "generic"), seed=0)
    assert w.hash_ids is None and w.arrival_s.tolist() == [0.0] and w.origin_s == 1.0


def test_integral_floats_are_accepted(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.5,100.0,7\n")
    w = load_workload(trace_cfg(f, "vidur"), seed=0)
    assert w.prompt_tokens.tolist() == [100]


# --- the bundled real traces -----------------------------------------------------------------------


def test_bundled_mooncake_conversation():
    w = load_workload(trace_cfg(BUNDLED / "mooncake" / "conversation_trace.jsonl", "mooncake"), seed=0)
    assert len(w) == 12_031
    assert w.arrival_s[-1] == pytest.approx(3537.0, abs=1.0)
    assert w.prompt_tokens.mean() == pytest.approx(12_035, abs=1)
    assert w.output_tokens.mean() == pytest.approx(343, abs=1)
    assert w.hash_block_tokens == 512
    assert_well_formed(w)


def test_bundled_mooncake_synthetic():
    w = load_workload(trace_cfg(BUNDLED / "mooncake" / "synthetic_trace.jsonl", "mooncake"), seed=0)
    assert len(w) == 3_993
    assert w.arrival_s[-1] == pytest.approx(1022.0, abs=1.0)
    assert_well_formed(w)


def test_bundled_azure():
    conv = load_workload(
        trace_cfg(BUNDLED / "azure2023" / "AzureLLMInferenceTrace_conv.csv", "azure"), seed=0
    )
    assert len(conv) == 19_366
    assert conv.arrival_s[0] == 0.0
    assert conv.arrival_s[-1] == pytest.approx(3502.0, abs=1.0)
    assert np.median(conv.prompt_tokens) == 1020 and np.median(conv.output_tokens) == 129
    assert_well_formed(conv)
    code = load_workload(
        trace_cfg(BUNDLED / "azure2023" / "AzureLLMInferenceTrace_code.csv", "azure"), seed=0
    )
    assert len(code) == 8_819
    assert code.arrival_s[-1] == pytest.approx(3436.0, abs=1.0)


# --- windowing and scaling -------------------------------------------------------------------------


def test_window_rebases_then_scales_then_caps():
    f = DATA / "mooncake_small.jsonl"  # arrivals 0, 0, 1.5, 2.25, 4.0 s
    w = load_workload(trace_cfg(f, "mooncake", start_s=1.0, duration_s=3.0), seed=0)
    assert w.arrival_s.tolist() == [0.5, 1.25]  # [1, 4): 4.0 is out
    assert w.line_numbers is not None and w.line_numbers.tolist() == [4, 5]
    assert ids(w) == [[0, 1, 2], [3]]
    w = load_workload(trace_cfg(f, "mooncake", start_s=1.0, rate_scale=2.0), seed=0)
    assert w.arrival_s.tolist() == [0.25, 0.625, 1.5]
    w = load_workload(trace_cfg(f, "mooncake", start_s=1.0, rate_scale=2.0, max_requests=2), seed=0)
    assert w.arrival_s.tolist() == [0.25, 0.625]
    assert w.prompt_tokens.tolist() == [1100, 10]
    w = load_workload(trace_cfg(f, "mooncake", max_requests=100), seed=0)
    assert len(w) == 5


def test_empty_window_is_an_error():
    f = DATA / "mooncake_small.jsonl"
    with pytest.raises(KvsimError) as e:
        load_workload(trace_cfg(f, "mooncake", start_s=10.0, duration_s=5.0), seed=0)
    assert str(e.value) == f"{f}: no requests in the window [10, 15) s; the trace spans 0 .. 4 s"
    with pytest.raises(KvsimError, match=r"no requests in the window \[4.5 s, end\)"):
        load_workload(trace_cfg(f, "mooncake", start_s=4.5), seed=0)


# --- bad input -------------------------------------------------------------------------------------

MOON_OK = '{"timestamp": 10, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}\n'

BAD_LINES = [
    ("mooncake", "t.jsonl", MOON_OK + '{"timestamp": 20, "input_length": 5,\n', 2, "invalid JSON ("),
    ("mooncake", "t.jsonl", MOON_OK + "[1, 2]\n", 2, "expected a JSON object, got list"),
    (
        "mooncake",
        "t.jsonl",
        MOON_OK + '{"timestamp": 20, "input_length": 5, "output_length": 3}\n',
        2,
        "missing field 'hash_ids'",
    ),
    (
        "mooncake",
        "t.jsonl",
        MOON_OK + '{"timestamp": 20, "input_length": 5.5, "output_length": 3, "hash_ids": [1]}\n',
        2,
        "input_length must be an integer >= 1, got 5.5",
    ),
    (
        "mooncake",
        "t.jsonl",
        MOON_OK + '{"timestamp": 20, "input_length": "lots", "output_length": 3, "hash_ids": [1]}\n',
        2,
        "input_length must be an integer >= 1, got 'lots'",
    ),
    (
        "mooncake",
        "t.jsonl",
        MOON_OK + '{"timestamp": 20, "input_length": 0, "output_length": 3, "hash_ids": []}\n',
        2,
        "input_length must be an integer >= 1, got 0",
    ),
    (
        "mooncake",
        "t.jsonl",
        MOON_OK + '{"timestamp": 20, "input_length": -4, "output_length": 3, "hash_ids": []}\n',
        2,
        "input_length must be an integer >= 1, got -4",
    ),
    (
        "mooncake",
        "t.jsonl",
        MOON_OK + '{"timestamp": 20, "input_length": 5, "output_length": -1, "hash_ids": [1]}\n',
        2,
        "output_length must be an integer >= 1, got -1",
    ),
    (
        "mooncake",
        "t.jsonl",
        MOON_OK + '{"timestamp": 20, "input_length": 5, "output_length": 0, "hash_ids": [1]}\n',
        2,
        "output_length must be an integer >= 1, got 0",
    ),
    (
        "mooncake",
        "t.jsonl",
        MOON_OK + '{"timestamp": "soon", "input_length": 5, "output_length": 1, "hash_ids": [1]}\n',
        2,
        "unparseable timestamp 'soon'",
    ),
    (
        "mooncake",
        "t.jsonl",
        MOON_OK + '{"timestamp": 20, "input_length": 1000, "output_length": 1, "hash_ids": [1]}\n',
        2,
        "hash_ids has 1 ids, expected ceil(1000 / 512) = 2",
    ),
    (
        "mooncake",
        "t.jsonl",
        MOON_OK + '{"timestamp": 20, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}\n',
        2,
        "hash_ids must be a list of integers",
    ),
    (
        "azure",
        "t.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
        "2023-13-16 18:15:47.0,374,44\n",
        3,
        "unparseable timestamp '2023-13-16 18:15:47.0'",
    ),
    (
        "azure",
        "t.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n18:15:46,374,44\n",
        2,
        "unparseable timestamp '18:15:46'",
    ),
    (
        "azure",
        "t.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,x,44\n",
        2,
        "ContextTokens must be an integer >= 1, got 'x'",
    ),
    (
        "azure",
        "t.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,0\n",
        2,
        "GeneratedTokens must be an integer >= 1, got '0'",
    ),
    (
        "azure",
        "t.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374\n",
        2,
        "expected 3 fields, got 2",
    ),
    (
        "burstgpt",
        "t.csv",
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n5,ChatGPT,10,-2,8,API log\n",
        2,
        "Response tokens must be an integer >= 0, got '-2'",
    ),
    (
        "burstgpt",
        "t.csv",
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\nx,ChatGPT,10,2,12,API log\n",
        2,
        "unparseable timestamp 'x'",
    ),
    (
        "vidur",
        "t.csv",
        "arrived_at,num_prefill_tokens,num_decode_tokens\n0,10,1\n1,10,0\n",
        3,
        "num_decode_tokens must be an integer >= 1, got '0'",
    ),
    (
        "generic",
        "t.csv",
        "arrival_s,prompt_tokens,output_tokens\nnan,10,1\n",
        2,
        "unparseable timestamp 'nan' in arrival_s",
    ),
    (
        "generic",
        "t.jsonl",
        '{"arrival_s": 0, "prompt_tokens": 20, "output_tokens": 1, "hash_ids": [1, 2]}\n'
        '{"arrival_s": 1, "prompt_tokens": 20, "output_tokens": 1}\n',
        2,
        "give hash_ids on every line or on none (missing here)",
    ),
    (
        "generic",
        "t.jsonl",
        '{"arrival_s": 0, "prompt_tokens": 20, "output_tokens": 1, "hash_ids": [1, 2]}\n'
        '{"arrival_s": 1, "prompt_tokens": 20, "output_tokens": 1, "hash_ids": [1], "hash_block_tokens": 32}\n',
        2,
        "hash_block_tokens 32 differs from the first line's 16",
    ),
]


@pytest.mark.parametrize("fmt,name,text,line,message", BAD_LINES)
def test_bad_line_is_located(tmp_path, fmt, name, text, line, message):
    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(KvsimError) as e:
        load_workload(trace_cfg(f, fmt), seed=0)
    assert str(e.value).startswith(f"{f}:{line}: {message}")
    if not message.endswith("("):
        assert str(e.value) == f"{f}:{line}: {message}"
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("fmt,name,text,line,message", BAD_LINES)
def test_bad_line_is_skipped_and_counted(tmp_path, fmt, name, text, line, message):
    f = tmp_path / name
    f.write_text(text)
    try:
        w = load_workload(trace_cfg(f, fmt, skip_bad_lines=True), seed=0)
    except KvsimError as e:  # the bad line was the only data line
        assert str(e) == (f"{f}: the trace has no requests: all 1 data lines were malformed and skipped")
        return
    assert w.skipped_lines == 1 and len(w) == 1
    assert w.line_numbers is not None and line not in w.line_numbers.tolist()


def test_skip_counts_several_lines(tmp_path):
    f = tmp_path / "t.jsonl"
    good = '{"timestamp": %d, "input_length": 5, "output_length": 1, "hash_ids": [%d]}\n'
    f.write_text(good % (0, 1) + "oops\n" + good % (5, 2) + "{}\n" + good % (9, 3) + "[]\n")
    w = load_workload(trace_cfg(f, "mooncake", skip_bad_lines=True), seed=0)
    assert w.skipped_lines == 3
    assert w.line_numbers is not None and w.line_numbers.tolist() == [1, 3, 5]
    assert w.arrival_s.tolist() == [0.0, 0.005, 0.009]


@pytest.mark.parametrize("skip", [False, True])
def test_timestamp_going_backwards_is_never_skipped(tmp_path, skip):
    f = tmp_path / "t.jsonl"
    f.write_text(MOON_OK + '{"timestamp": 5, "input_length": 5, "output_length": 1, "hash_ids": [3]}\n')
    with pytest.raises(KvsimError) as e:
        load_workload(trace_cfg(f, "mooncake", skip_bad_lines=skip), seed=0)
    assert str(e.value) == f"{f}:2: timestamp goes backwards (5 < previous 10)"
    g = tmp_path / "t.csv"
    g.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,1,1\n"
        "2023-11-16 18:15:46.6,1,1\n"
    )
    with pytest.raises(KvsimError) as e:
        load_workload(trace_cfg(g, "azure", skip_bad_lines=skip), seed=0)
    assert str(e.value) == (
        f"{g}:3: timestamp goes backwards (2023-11-16 18:15:46.6 < previous 2023-11-16 18:15:46.6805900)"
    )


@pytest.mark.parametrize(
    "fmt,name,text,message",
    [
        ("mooncake", "t.jsonl", "", "the trace has no requests: no data"),
        ("mooncake", "t.jsonl", "\n\n", "the trace has no requests: no data"),
        ("generic", "t.csv", "arrival_s,prompt_tokens,output_tokens\n", "the trace has no requests: no data"),
        (
            "azure",
            "t.csv",
            "",
            "the trace is empty; expected a header with columns TIMESTAMP,ContextTokens,GeneratedTokens",
        ),
        (
            "azure",
            "t.csv",
            "time,in,out\n1,2,3\n",
            "wrong header for format azure: expected columns TIMESTAMP,ContextTokens,GeneratedTokens, "
            "got time,in,out",
        ),
        (
            "burstgpt",
            "t.csv",
            "Timestamp,Model,Request tokens\n",
            "wrong header for format burstgpt: expected columns "
            "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type, "
            "got Timestamp,Model,Request tokens",
        ),
        (
            "vidur",
            "t.csv",
            "arrival_s,prompt_tokens,output_tokens\n0,1,1\n",
            "wrong header for format vidur: expected columns arrived_at,num_prefill_tokens,num_decode_tokens, "
            "got arrival_s,prompt_tokens,output_tokens",
        ),
        (
            "burstgpt",
            "t.csv",
            "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n1,M,5,0,5,API log\n",
            f"the trace has no requests: all 1 requests were dropped ({BURSTGPT_FAILED})",
        ),
        (
            "generic",
            "t.txt",
            "arrival_s,prompt_tokens,output_tokens\n",
            "generic traces must end in .jsonl or .csv",
        ),
    ],
)
def test_bad_files(tmp_path, fmt, name, text, message):
    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(KvsimError) as e:
        load_workload(trace_cfg(f, fmt), seed=0)
    assert str(e.value).startswith(f"{f}: {message}")


def test_missing_file(tmp_path):
    f = tmp_path / "nope.jsonl"
    with pytest.raises(KvsimError) as e:
        load_workload(trace_cfg(f, "mooncake"), seed=0)
    assert str(e.value) == f"{f}: trace file not found"


# --- synthetic -------------------------------------------------------------------------------------


def test_synthetic_is_deterministic_per_seed():
    cfg = syn_cfg(shared_prefix_tokens=64, shared_prefix_count=3, session_turns=2, think_time_s=1.0)
    a, b, c = (load_workload(cfg, seed=s) for s in (7, 7, 8))
    for x, y in (
        (a.arrival_s, b.arrival_s),
        (a.prompt_tokens, b.prompt_tokens),
        (a.output_tokens, b.output_tokens),
    ):
        assert np.array_equal(x, y)
    assert ids(a) == ids(b)
    assert not np.array_equal(a.arrival_s, c.arrival_s)
    assert not np.array_equal(a.prompt_tokens, c.prompt_tokens)
    assert a.source == "synthetic" and a.line_numbers is None and a.hash_block_tokens == 16
    assert_well_formed(a)


def test_synthetic_poisson_rate_and_lengths():
    cfg = syn_cfg(
        num_requests=20_000,
        rate_per_s=50.0,
        input=LengthDist("lognormal", 1000.0, 500.0),
        output=LengthDist("exponential", 200.0),
    )
    w = load_workload(cfg, seed=1)
    assert len(w) == 20_000 and w.arrival_s[0] == 0.0
    gaps = np.diff(w.arrival_s)
    assert len(w) / w.arrival_s[-1] == pytest.approx(50.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)
    assert w.prompt_tokens.mean() == pytest.approx(1000.0, rel=0.02)
    assert w.prompt_tokens.std() == pytest.approx(500.0, rel=0.06)
    assert w.output_tokens.mean() == pytest.approx(200.0, rel=0.03)


@pytest.mark.parametrize("cv", [0.5, 2.0])
def test_synthetic_gamma_cv(cv):
    w = load_workload(syn_cfg(num_requests=20_000, rate_per_s=5.0, arrival="gamma", cv=cv), seed=3)
    gaps = np.diff(w.arrival_s)
    assert gaps.mean() == pytest.approx(0.2, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.06)


def test_synthetic_length_kinds():
    n = 20_000
    uni = load_workload(syn_cfg(num_requests=n, input=LengthDist("uniform", 500.0, 100.0)), seed=2)
    assert uni.prompt_tokens.mean() == pytest.approx(500.0, rel=0.01)
    assert uni.prompt_tokens.std() == pytest.approx(100.0, rel=0.03)
    assert uni.prompt_tokens.max() <= 500 + math.sqrt(3) * 100 + 1
    const = load_workload(syn_cfg(num_requests=50, input=LengthDist("constant", 123.4)), seed=2)
    assert set(const.prompt_tokens.tolist()) == {123}
    flat = load_workload(syn_cfg(num_requests=50, input=LengthDist("lognormal", 77.0, 0.0)), seed=2)
    assert set(flat.prompt_tokens.tolist()) == {77}
    clipped = load_workload(
        syn_cfg(num_requests=2000, input=LengthDist("exponential", 100.0, 0.0, 50, 120)), seed=2
    )
    assert clipped.prompt_tokens.min() == 50 and clipped.prompt_tokens.max() == 120


def test_shared_system_prompts_share_leading_blocks():
    cfg = syn_cfg(num_requests=300, shared_prefix_tokens=100, shared_prefix_count=2)  # 6 full blocks
    w = load_workload(cfg, seed=4)
    assert_well_formed(w)
    heads = {tuple(h[:6]) for h in ids(w)}
    assert len(heads) == 2  # both system prompts used, each a fixed run of 6 ids
    assert all(len(set(h)) == 6 for h in heads)
    seventh = [h[6] for h in ids(w)]  # mixes system and own tokens: never shared
    assert len(set(seventh)) == len(seventh)
    assert np.all(w.prompt_tokens >= 101)
    short = load_workload(syn_cfg(num_requests=50, shared_prefix_tokens=15), seed=4)  # < one block
    all_ids = np.concatenate(short.hash_ids or [])
    assert len(np.unique(all_ids)) == len(all_ids)


def test_one_session_extends_its_prompt_each_turn():
    cfg = syn_cfg(
        num_requests=4,
        session_turns=4,
        think_time_s=2.0,
        input=LengthDist("uniform", 100.0, 40.0),
        output=LengthDist("uniform", 50.0, 20.0),
    )
    w = load_workload(cfg, seed=5)
    assert_well_formed(w)
    assert w.arrival_s.tolist() == [0.0, 2.0, 4.0, 6.0]
    p, o, h, g = w.prompt_tokens.tolist(), w.output_tokens.tolist(), ids(w), 16
    for t in range(3):
        assert p[t + 1] > p[t] + o[t]
        # The previous prompt's and its output's full blocks reappear in the next turn.
        shared = (p[t] + o[t]) // g
        assert h[t + 1][: p[t] // g] == h[t][: p[t] // g]
        if t + 2 < 4:
            assert h[t + 2][:shared] == h[t + 1][:shared]
        if p[t] % g:  # its partial last block is not the next turn's (fuller) block
            assert h[t][-1] != h[t + 1][len(h[t]) - 1]


def test_sessions_at_scale_keep_ids_prefix_unique():
    cfg = syn_cfg(
        num_requests=1_001,
        rate_per_s=20.0,
        session_turns=5,
        think_time_s=3.0,
        shared_prefix_tokens=200,
        shared_prefix_count=4,
    )
    w = load_workload(cfg, seed=6)
    assert len(w) == 1_001
    assert_well_formed(w)  # includes the prefix-uniqueness property
    # Requests arrive at rate_per_s on average (sessions at rate / turns).
    assert len(w) / w.arrival_s[-1] == pytest.approx(20.0, rel=0.2)
    h, g = ids(w), w.hash_block_tokens
    count: dict[int, int] = {}
    for x in np.concatenate(w.hash_ids or []).tolist():
        count[x] = count.get(x, 0) + 1
    for row, p in zip(h, w.prompt_tokens.tolist(), strict=True):
        if p % g:  # a partial last block belongs to this request alone
            assert count[row[-1]] == 1
    # Later turns reuse earlier full blocks: far fewer distinct ids than blocks.
    assert len(count) < 0.5 * sum(count.values())


def test_synthetic_without_anything_to_share_has_no_content_ids():
    """No shared prefix and one turn per session: no two prompts share a block, so the workload
    names none (the engine keys each prompt as its own, as for a trace without hash ids)."""
    w = load_workload(syn_cfg(num_requests=50), seed=9)
    assert w.hash_ids is None and w.output_hash_ids is None
    shared = load_workload(syn_cfg(num_requests=50, shared_prefix_tokens=64), seed=9)
    assert shared.hash_ids is not None
    assert np.array_equal(w.arrival_s, shared.arrival_s)  # the same draws either way
    assert np.array_equal(w.output_tokens, shared.output_tokens)
    assert np.array_equal(w.prompt_tokens + 64, shared.prompt_tokens)


def test_synthetic_window_and_scale_apply_too():
    base = load_workload(syn_cfg(num_requests=100, shared_prefix_tokens=64), seed=9)
    w = load_workload(
        WorkloadConfig(
            None,
            "synthetic",
            syn_cfg(num_requests=100, shared_prefix_tokens=64).synthetic,
            2.0,
            1.0,
            3.0,
            10,
            False,
        ),
        seed=9,
    )
    sel = (base.arrival_s >= 1.0) & (base.arrival_s < 4.0)
    expect = (base.arrival_s[sel] - 1.0) / 2.0
    assert np.allclose(w.arrival_s, expect[:10])
    assert ids(w) == [h.tolist() for h, s in zip(base.hash_ids or [], sel, strict=True) if s][:10]


def test_nested_hash_ids_rejected(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [[1], [2]]}\n')
    with pytest.raises(KvsimError, match=r"t.jsonl:1: hash_ids must be a list of integers$"):
        load_workload(trace_cfg(f, "mooncake"), seed=0)


# --- one time rule for every format ------------------------------------------------------------------

TIME_RULE = [
    ("generic", "t.csv", "arrival_s,prompt_tokens,output_tokens\n{t0},5,5\n{t1},5,5\n", 1.0),
    (
        "generic",
        "t.jsonl",
        '{{"arrival_s": {t0}, "prompt_tokens": 5, "output_tokens": 5}}\n'
        '{{"arrival_s": {t1}, "prompt_tokens": 5, "output_tokens": 5}}\n',
        1.0,
    ),
    ("vidur", "t.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n{t0},5,5\n{t1},5,5\n", 1.0),
    (
        "burstgpt",
        "t.csv",
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "{t0},m,5,5,10,x\n{t1},m,5,5,10,x\n",
        1.0,
    ),
    (
        "mooncake",
        "t.jsonl",
        '{{"timestamp": {t0}, "input_length": 5, "output_length": 5, "hash_ids": [1]}}\n'
        '{{"timestamp": {t1}, "input_length": 5, "output_length": 5, "hash_ids": [1]}}\n',
        1000.0,
    ),
]


@pytest.mark.parametrize("fmt,name,text,per_s", TIME_RULE, ids=lambda x: str(x)[:12])
def test_every_format_rebases_to_its_first_request(tmp_path, fmt, name, text, per_s):
    f = tmp_path / name
    epoch = 1_700_000_000.25  # Unix-epoch seconds: 2^-22 s resolution, well under 1 us
    f.write_text(text.format(t0=repr(epoch * per_s), t1=repr((epoch + 2.5) * per_s)))
    w = load_workload(trace_cfg(f, fmt), seed=0)
    assert w.arrival_s.tolist() == pytest.approx([0.0, 2.5], abs=1e-6)
    assert w.origin_s == pytest.approx(epoch)
    f.write_text(text.format(t0=repr(-1.0 * per_s), t1="0"))
    with pytest.raises(KvsimError, match=":[12]: negative timestamp"):
        load_workload(trace_cfg(f, fmt), seed=0)
    f.write_text(text.format(t0=repr(1.7e18 * per_s), t1=repr(1.8e18 * per_s)))  # epoch ns read as s
    with pytest.raises(KvsimError, match=":[12]: timestamp .* is too large"):
        load_workload(trace_cfg(f, fmt), seed=0)


def test_azure_origin_is_unix_epoch_seconds():
    w = load_workload(trace_cfg(DATA / "azure_small.csv", "azure"), seed=0)
    assert w.origin_s == pytest.approx(1700179198.5)  # 2023-11-16 23:59:58.5 UTC


def test_requests_outside_the_window_are_counted():
    f = DATA / "mooncake_small.jsonl"  # arrivals 0, 0, 1.5, 2.25, 4.0 s
    w = load_workload(trace_cfg(f, "mooncake", start_s=1.0, duration_s=3.0, max_requests=1), seed=0)
    assert len(w) == 1
    assert (w.before_window, w.after_window, w.over_max_requests) == (2, 1, 1)
    assert w.accounting()["before_window"] == 2

"""The one pricing path (`StepCostModel.step_times`) against the slow oracle (`tests/oracle.py`):
single batches of every kind, decode and mixed runs element by element, and every price a whole run
asks, under the analytic model, a measured profile and the formats that price in parts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.costs.base import ForwardBatch, SeqKind, StepCostModel, StepRun
from kvsim.run import make_cost_model, run_scenario
from tests.helpers import make_workload, small_scenario
from tests.oracle import oracle_price

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "scenarios" / "profiles" / "aiconfigurator-h200_sxm-vllm-llama-3.1-8b-tp1.json"


def _models() -> list[StepCostModel]:
    models = [
        make_cost_model(small_scenario()),  # H100, fitted
        make_cost_model(small_scenario(kv={"format": "fp8"})),
        make_cost_model(small_scenario(kv={"format": "int4"}, cluster={"gpu": "a100-80gb"})),
        make_cost_model(
            small_scenario(
                cluster={"gpu": "h200-sxm"}, cost_model={"kind": "profile", "profile": str(PROFILE)}
            )
        ),
    ]
    assert all(isinstance(m, StepCostModel) for m in models)
    return models  # type: ignore[return-value]


MODELS = _models()


@st.composite
def batches(draw):  # type: ignore[no-untyped-def]
    n_dec = draw(st.integers(0, 40))
    dec = draw(st.lists(st.integers(1, 60_000), min_size=n_dec, max_size=n_dec))
    n_ver = draw(st.integers(0, 3))
    ver = [(draw(st.integers(2, 6)), draw(st.integers(1, 20_000))) for _ in range(n_ver)]
    n_pre = draw(st.integers(0 if (n_dec or n_ver) else 1, 3))
    pre = [(draw(st.integers(1, 4096)), draw(st.integers(0, 40_000))) for _ in range(n_pre)]
    sampling = n_dec + sum(n for n, _ in ver) + draw(st.integers(0, n_pre))
    kinds = (SeqKind.DECODE,) * n_dec + (SeqKind.VERIFY,) * n_ver + (SeqKind.PREFILL,) * n_pre
    num_new = (1,) * n_dec + tuple(n for n, _ in ver) + tuple(n for n, _ in pre)
    ctx = tuple(dec) + tuple(c for _, c in ver) + tuple(c for _, c in pre)
    return ForwardBatch(kinds, num_new, ctx, sampling)


@settings(max_examples=150, deadline=None)
@given(batch=batches(), which=st.integers(0, len(MODELS) - 1))
def test_a_single_step_costs_what_the_oracle_says(batch, which):  # type: ignore[no-untyped-def]
    cm = MODELS[which]
    assert cm.step_times(StepRun.of(batch))[0] == oracle_price(cm, batch)
    assert cm.step_seconds(StepRun.of(batch)) == oracle_price(cm, batch)  # the hot path's one step
    assert cm.price(batch).seconds == oracle_price(cm, batch)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 64),
    c0=st.integers(64, 30_000),
    k=st.integers(1, 40),
    chunk=st.integers(0, 2048),
    which=st.integers(0, len(MODELS) - 1),
)
def test_a_run_of_steps_costs_what_each_step_does(n, c0, k, chunk, which):  # type: ignore[no-untyped-def]
    """Decode windows and mixed windows (decodes plus one prefill chunk) element by element."""
    cm = MODELS[which]
    ctx = [c0 + 17 * i for i in range(n)]
    sums = np.array([sum(ctx) + j * n for j in range(k)], dtype=np.int64)
    if not chunk:
        times = cm.step_times(StepRun.decode(n, sums))
        for j in range(k):
            batch = ForwardBatch.decode(tuple(c + j for c in ctx))
            assert times[j] == oracle_price(cm, batch)
        return
    pre_ctx = np.array([j * chunk for j in range(k)], dtype=np.int64)
    smp = np.array([n + (j == k - 1) for j in range(k)], dtype=np.int64)
    times = cm.step_times(StepRun.mixed(n, sums, chunk, pre_ctx, smp))
    for j in range(k):
        batch = ForwardBatch(
            (SeqKind.DECODE,) * n + (SeqKind.PREFILL,),
            (1,) * n + (chunk,),
            (*(c + j for c in ctx), j * chunk),
            int(smp[j]),
        )
        assert times[j] == oracle_price(cm, batch)


class _Checked:
    """A cost model whose every `step_times` answer is checked against the oracle, step by step."""

    def __init__(self, cm: StepCostModel) -> None:
        self.cm = cm
        self.steps = 0

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self.cm, name)

    def step_seconds(self, run: StepRun) -> float:
        t = self.cm.step_seconds(run)
        assert run.num_steps == 1 and t == oracle_price(self.cm, _batch(run, 0)), run
        self.steps += 1
        return t

    def step_times(self, run: StepRun) -> np.ndarray:
        times = self.cm.step_times(run)
        assert len(times) == run.num_steps
        for j in range(run.num_steps):
            assert times[j] == oracle_price(self.cm, _batch(run, j)), (run, j)
        self.steps += run.num_steps
        return times


def _batch(run: StepRun, j: int) -> ForwardBatch:
    """Step j of a run as a batch (its decode rows' contexts summed into the first row)."""
    n = run.num_decode
    dec = int(run.dec_sum_ctx[j]) if n else 0
    dec_ctx = (dec - (n - 1),) + (1,) * (n - 1) if n else ()
    samp = run.num_sampling if isinstance(run.num_sampling, int) else run.num_sampling[j]
    sw = int(run.switched_ctx[j]) if run.switched_ctx is not None else 0
    return ForwardBatch(
        (SeqKind.DECODE,) * n + tuple(k for k, _ in run.rows),
        (1,) * n + tuple(m for _, m in run.rows),
        dec_ctx + tuple(int(c[j]) for c in run.rows_ctx),
        int(samp),
        run.num_switched,
        sw,
    )


def test_every_price_a_run_asks_is_the_oracles():  # type: ignore[no-untyped-def]
    """A loaded replica with chunked prefill, a shared prefix and fast-forward: single steps, decode
    windows and mixed windows all priced by the one path, each step equal to the oracle's."""
    sc = small_scenario(
        num_blocks=400,
        scheduler={"max_num_seqs": 8, "max_batched_tokens": 256, "chunked_prefill": True},
    )
    cm = _Checked(make_cost_model(sc))  # type: ignore[arg-type]
    wl = make_workload([0.01 * i for i in range(30)], [300 + 37 * (i % 5) for i in range(30)], [40] * 30)
    res = run_scenario(sc, workload=wl, cost=cm)  # type: ignore[arg-type]
    assert all(s.finish_s == s.finish_s for s in res.seqs)  # all finished
    assert cm.steps > 173  # the run took 173 steps; fast-forward prices candidates past a window too

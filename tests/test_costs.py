"""The cost seam: forward batches with explicit kinds, pure pricing, transfers over typed links."""

from __future__ import annotations

import numpy as np
import pytest

from kvsim.costs.analytic import AnalyticCostModel
from kvsim.costs.base import ForwardBatch, SeqKind, StepPrice, transfer_time
from kvsim.run import make_cost_model, run_scenario
from kvsim.spec.topology import Link
from tests.helpers import make_workload, small_scenario
from tests.test_profile import _model


def test_a_one_token_prefill_chunk_is_priced_as_prefill_not_decode():
    # fp8 KV: decode attention is priced from bf16 bytes over a measured 1.6x speed-up, a prefill
    # chunk from its own bytes, so the two prices of one token over 4096 cached ones differ.
    cm = make_cost_model(small_scenario(kv={"format": "fp8"}))
    one = ForwardBatch.prefill(1, 4096)
    dec = ForwardBatch.decode((4096,))
    assert one.kinds == (SeqKind.PREFILL,) and dec.kinds == (SeqKind.DECODE,)
    # (The prefill attention launch is paid once per step with prefill rows, beside the chunks' own.)
    prefill = cm.prefill_launch_s + cm._prefill_attn_time(1, 4096)
    assert cm.step_time(one) == cm.overhead_s + cm._gemm_time(1, 1) + cm._write_time(1) + prefill
    assert cm.step_time(one) != cm.step_time(dec)
    # A verify step (speculative decoding: the last token plus 3 drafts) prices its GEMMs over 4
    # tokens with 4 sampling rows, and its 4 queries' attention reading the cache once, as a decode
    # does. Both cost more than the decode of one token over the same cache.
    verify = ForwardBatch((SeqKind.VERIFY,), (4,), (4096,), 4)
    verify_attn = cm.prefill_launch_s + cm._verify_attn_time(4, 4096)
    assert cm.step_time(verify) == cm.overhead_s + cm._gemm_time(4, 4) + cm._write_time(4) + verify_attn
    assert cm.step_time(dec) < cm.step_time(verify) and cm.step_time(dec) < cm.step_time(one)


def test_a_short_chunk_over_a_long_prefix_pays_the_ramp_on_its_own_tokens():
    """The fitted prefill ramp (short chunks run below e_max) is charged on the chunk's own causal
    pairs: over a 32K cached prefix a 16-token chunk costs its pairs with the prefix at e_max plus
    the ramp of a 16-token chunk alone, not n_half queries over the whole prefix."""
    cm = make_cost_model(small_scenario())  # H100: fitted
    assert isinstance(cm, AnalyticCostModel)
    p, w = cm.ops.prefill_attn, cm.work
    assert p.n_half > 100  # the fit's ramp is long
    work = w.prefill_attn_flops(16, 32768) + w.prefill_attn_flops(16, 0) * p.n_half / 16
    compute = work / (cm.gpu.bf16_flops * p.e_max)
    expect = max(compute, w.prefill_kv_bytes(16, 32768) / (cm.bw * p.e_kv))
    assert cm._prefill_attn_time(16, 32768) == pytest.approx(expect, rel=1e-12)
    # At prefix 0 (the tables' points) the form is the fitted F (1 + n_half / n).
    f0 = w.prefill_attn_flops(512, 0)
    at0 = max(
        f0 * (1 + p.n_half / 512) / (cm.gpu.bf16_flops * p.e_max),
        w.prefill_kv_bytes(512, 0) / (cm.bw * p.e_kv),
    )
    assert cm._prefill_attn_time(512, 0) == pytest.approx(at0, rel=1e-12)


def test_the_analytic_model_counts_a_cached_prefix_as_extrapolated_only_with_tables():
    cm = make_cost_model(small_scenario())  # H100: fitted to tables of prefix 0 only
    assert cm.prefix_extrapolated_s(512, 0) == 0.0
    extra = cm.prefix_extrapolated_s(512, 32768)
    assert extra == pytest.approx(cm._prefill_attn_time(512, 32768) - cm._prefill_attn_time(512, 0))
    assert extra > 0
    published = make_cost_model(small_scenario(cluster={"gpu": "h100-pcie"}))  # no tables
    assert published.prefix_extrapolated_s(512, 32768) == 0.0


def test_a_decode_computes_exactly_one_token():
    with pytest.raises(AssertionError):  # checked where the batch is priced (the hot path reads it once)
        make_cost_model(small_scenario()).price(ForwardBatch((SeqKind.DECODE,), (2,), (10,), 1))


def test_decode_step_times_equal_the_price_of_decode_only_batches():
    cm = make_cost_model(
        small_scenario(cluster={"gpu": "h100-sxm", "gpus_per_node": 2, "tensor_parallel": 2})
    )
    ctxs = [(100, 300, 700), (128, 128, 128), (5000, 1, 20)]
    vec = cm.decode_step_times(3, np.array([sum(c) for c in ctxs], dtype=np.int64))
    for j, c in enumerate(ctxs):
        assert vec[j] == cm.price(ForwardBatch.decode(c)).seconds


def test_pricing_twice_leaves_no_trace(tmp_path):
    cm = _model(tmp_path)  # a profile measured up to 1024 tokens of context and 256-token GEMMs
    off = ForwardBatch((SeqKind.DECODE, SeqKind.PREFILL), (1, 900), (8000, 0), 2)
    first = cm.price(off)
    assert first.off_grid == {"paged_decode", "chunked_prefill", "gemm"}
    assert cm.price(off) == first
    cm.decode_step_times(8, np.array([8 * 5000.0]))
    assert cm.warnings() == []  # nothing priced was run
    assert len(cm.warnings(first.off_grid)) == 3


def test_the_profile_warns_only_about_steps_the_engine_ran(tmp_path):
    """One request whose decode would leave the profile's 1024-token context grid after 124 tokens.
    Stopped at 2 s it has run about 70 steps, all on the grid, though fast-forward priced candidate
    steps up to its last token, off the grid: no paged_decode warning. Run to the end: the warning."""
    cm = _model(tmp_path)
    sc = small_scenario(cost_model={"kind": "profile", "profile": cm.source})
    wl = make_workload([0.0], [900], [400])
    early = run_scenario(
        small_scenario(cost_model={"kind": "profile", "profile": cm.source}, sim={"max_time": "2s"}),
        workload=wl,
    )
    (s,) = early.seqs
    assert 0 < s.num_generated < 1024 - 900
    assert not any("paged_decode" in w for w in early.summary["warnings"])
    assert any("chunked_prefill" in w for w in early.summary["warnings"])  # the 900-token chunk ran
    full = run_scenario(sc, workload=wl)
    assert full.seqs[0].num_generated == 400
    assert any("paged_decode extrapolated" in w for w in full.summary["warnings"])


def test_the_engine_prices_a_prompts_one_token_last_chunk_as_prefill():
    # 513 prompt tokens under a 512-token budget: the second step computes one prompt token.
    sc = small_scenario(scheduler={"max_batched_tokens": 512}, kv={"format": "fp8"})
    (s,) = run_scenario(sc, workload=make_workload([0.0], [513], [2])).seqs
    cm = make_cost_model(sc)
    expected = cm.step_time(ForwardBatch.prefill(512, 0, sampling=False)) + cm.step_time(
        ForwardBatch.prefill(1, 512)
    )
    assert s.first_token_s == pytest.approx(expected, rel=1e-12)
    as_decode = cm.step_time(ForwardBatch.prefill(512, 0, sampling=False)) + cm.step_time(
        ForwardBatch.decode((512,))
    )
    assert s.first_token_s != pytest.approx(as_decode, rel=1e-9)


def test_transfer_time_is_latency_plus_calls_plus_bytes():
    link = Link("pcie", bw_bytes_per_s=50e9, latency_s=5e-6, per_call_overhead_s=8e-6, shared_by=2)
    assert transfer_time(0, link) == 5e-6 + 8e-6
    assert transfer_time(50e9, link) == pytest.approx(1.0 + 13e-6, rel=1e-15)
    assert transfer_time(1e6, link, num_calls=10) == pytest.approx(5e-6 + 80e-6 + 1e6 / 50e9, rel=1e-15)
    with pytest.raises(ValueError):
        transfer_time(1.0, link, num_calls=0)


def test_many_small_copies_cost_more_than_one_batched_copy():
    h2d = small_scenario().cluster.topology.host_h2d  # H100: 35.2 GB/s pinned, 2.3 us per call
    nbytes = 4096 * 32 * 1024  # 4096 KV blocks of 32 KiB
    batched = transfer_time(nbytes, h2d)
    per_block = transfer_time(nbytes, h2d, num_calls=4096)
    assert per_block > batched
    assert per_block - batched == pytest.approx(4095 * h2d.per_call_overhead_s, rel=1e-9)
    # One copy per 32 KiB block reaches only 6-15 GB/s (../shared/REFERENCE.md): here about 10.
    assert 6e9 < nbytes / per_block < 15e9
    assert nbytes / batched > 0.99 * h2d.bw_bytes_per_s


def test_analytic_transfers_use_the_topology_links():
    sc = small_scenario(
        cluster={"gpu": "h100-sxm", "gpus_per_node": 1, "topology": {"pcie": {"h2d": "10GB/s"}}}
    )
    cm = make_cost_model(sc)
    h2d = sc.cluster.topology.host_h2d
    assert h2d.bw_bytes_per_s == 10e9
    assert cm.transfer_time(1e9, h2d) == pytest.approx(0.1 + h2d.per_call_overhead_s, rel=1e-12)
    assert cm.transfer_time(1e9, sc.cluster.topology.host_d2h) < cm.transfer_time(1e9, h2d)


def test_step_price_defaults_to_no_flags():
    assert StepPrice(1.0).off_grid == frozenset()


def _decode_s(cm: object, ctx: int, seqs: int = 64) -> float:
    return float(cm._decode_attn_time(seqs, np.array([float(seqs * ctx)]))[0])  # type: ignore[attr-defined]


def test_block_size_costs_decode_time_with_an_optimum_that_grows_with_context():
    """A per-block term (block-table reads, gather setup) and the partial last block: the reference
    block size (16) prices as before, smaller blocks cost more, very large ones too (wasted slots),
    and the cheapest block size grows with the context, near sqrt(2 x 3.2 x context)."""
    from kvsim.costs.work import BLOCK_OVERHEAD_TOKENS, REFERENCE_BLOCK_SIZE, block_extra_tokens

    assert REFERENCE_BLOCK_SIZE == 16 and BLOCK_OVERHEAD_TOKENS == 3.2
    assert block_extra_tokens(8, 4000.0, 16) == 0.0
    sizes = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
    models = {bs: make_cost_model(small_scenario(kv={"block_size": bs})) for bs in sizes}
    base = make_cost_model(small_scenario())
    assert _decode_s(models[16], 2000) == _decode_s(base, 2000)  # the default's price is unchanged
    for ctx, best in ((80, 32), (500, 64), (2000, 128)):
        times = {bs: _decode_s(m, ctx) for bs, m in models.items()}
        assert min(times, key=times.__getitem__) == best, (ctx, times)
        assert times[1] > times[16] and times[1024] > times[best]
    # Prefill reads its prefix through the block table too: per-block term only.
    assert models[4]._prefill_attn_time(8, 60000) > models[64]._prefill_attn_time(8, 60000)  # type: ignore[attr-defined]


def test_a_profiles_decode_pays_the_block_term_beyond_its_block_size(tmp_path):
    cm16 = _model(tmp_path)
    (tmp_path / "b").mkdir()
    from kvsim.costs.profile import load_profile_cost_model
    from tests.test_profile import _synthetic, _write

    p = _write(tmp_path / "b", _synthetic())
    cm4 = load_profile_cost_model(
        small_scenario(kv={"block_size": 4}, cost_model={"kind": "profile", "profile": str(p)})
    )
    assert _decode_s(cm4, 500, 8) > _decode_s(cm16, 500, 8)

"""Measured-profile costs: the analytic model's decomposition, with each part looked up in a profile.

A profile (``python -m calibrate``, schema ``kvsim-profile`` v1.2) holds timed grid points per op:
``gemm`` (per layer type: qkv, o, gate_up, down, lm_head; over token count ``m``), ``paged_decode``
(one layer, over batch x context per sequence x KV format), ``chunked_prefill`` (one layer, one
sequence, over chunk x prefix x format) and ``copy`` (over bytes, per link); since 1.1, optionally,
the token-eviction and quantize-on-write ops of ``kernels/`` (one layer each): ``h2o_accumulate``
(H2O's score accumulation after a decode step, over batch x context x format; never used for
attention entropy's statistics, another kernel's work, which stay analytic with a note),
``h2o_select`` (a trim's top-k, over tokens scored; H2O's and entropy's), ``compact_kv`` (a trim's compaction with its block-table update,
over tokens moved x format) and ``kv_write`` (quantize-on-write, over new tokens x format). `ProfileCostModel`
splits a step exactly as `AnalyticCostModel` does (overhead + GEMMs + all-reduce + prefill attention
+ decode attention) and prices each part as ``work / rate``: the rate (work per second achieved at
the measured point: FLOP/s for GEMM and prefill, bytes/s for decode and copies) is interpolated
linearly in log(rate) over log(size), so time is exact on grid points and a power law, hence
monotone, between neighbours. Outside the grid the nearest measured rate is held (the time scales
with the work) and the price flags the op; but a prefill chunk over a cached prefix longer than the
grid's longest (imported tables hold prefix 0 only) is priced at that prefix, plus the further
prefix tokens' pairs at the table's best measured rate or their KV bytes at the decode table's rate
at batch 1, whichever is longer (`prefix_rule`; holding the short chunk's rate priced a 16-token
chunk over a 60K prefix like 16,000 queries), and the run warns of that part's share of busy time; `warnings(ran)` names the flagged ops of the steps the engine
ran (pricing itself records nothing). Because work is computed for the scenario's own shapes,
a profile forced onto another model scales by FLOPs or bytes.

The 1.1 ops price, at their bytes per token (`kvsim.costs.work`) times the layers holding KV: H2O's
per-step score cost (plus its steady one-token selection, the scores re-read at the analytic decode
rate: not timed), a trim's top-k and compaction (one call per op over all sequences a step trims;
other block-table writes as the analytic model's kernel), and the write of a lossy cache's new
tokens (none for a bf16/fp16 cache, as in the analytic model; its decode rows' plain write is priced
below), a format switch's second format included. An op the profile lacks, or lacks for a format of
the cache, is priced by the analytic model, with a note in `warnings` naming it; a profile with none
of them prices exactly as the analytic model does. kvquant4's outlier merge is inside a measured
kvquant4 table; where ``paged_decode`` or ``chunked_prefill`` rates are another format's (forced:
scaled by bytes, which hold the outliers' bytes but not their merge) the analytic estimate of the
merge is added (between two outlier fractions, the difference), with a note.

The 1.2 ops price the rest of a step (`_step_base`), per layer x step: ``step_rest``'s ``layer``
part (one layer's RMSNorms, rotary, residual adds, SiLU-and-mul) over the step's tokens times the
layers, its ``embed`` part (embedding lookup, rotary tables) over the tokens and ``sample`` part
(final norm, greedy pick) over the LM-head rows, each at its bytes per token
(`kvsim.costs.work.step_rest_bytes_per_token`); ``step_overhead``, the serving loop's own time per
step (scheduling, block tables, inputs), over the step's rows, its time held at the grid's edges,
replaces the analytic 1 ms; and a bf16/fp16 cache's decode rows pay their KV write at `kv_write`'s
measured rate for the cache's format, times the layers holding KV (`paged_decode` times no write;
kvsim's `chunked_prefill` kernel writes its chunk first, so there prefill rows pay none; over an
imported attention table, which times the attention alone, every new token pays it). A lossy part's
quantize-on-write is charged the same way: on the decode rows' tokens alone when `chunked_prefill`
was timed on kvsim's kernel, on every new token over an imported table. A profile without them
prices as before: the 1 ms overhead and no rest.

Left out (taken from the analytic model instead): the per-step overhead (1 ms) when the profile has
no ``step_overhead``, tensor-parallel all-reduces, a prompt's H2O scores (the QK^T half of its
prefill attention), a format switch's re-quantization, and transfers over links the profile did not
measure. MoE and MLA models are refused:
the calibrator measures dense GQA layers only.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from kvsim.core.eviction import EvictionKind, EvictionWork, eviction_from_config
from kvsim.core.sched.output import SeqKind
from kvsim.costs.analytic import AnalyticCostModel, Efficiencies
from kvsim.costs.base import NO_FLAGS, Chunks, Flags, ForwardBatch, StepCostModel, StepPrice
from kvsim.costs.profile_schema import (
    GEMM_LAYERS,
    MODEL_SHAPE_KEYS,
    STEP_REST_PARTS,
    gpu_matches,
    load_profile,
    model_shapes,
)
from kvsim.costs.work import (
    BF16,
    attended_pairs,
    attended_prefix,
    attn_flops_per_pair_layer,
    compact_bytes_per_token_layer,
    decode_tokens_read,
    format_parts,
    gemm_flops,
    h2o_accumulate_bytes_per_token_layer,
    h2o_select_bytes_per_token_layer,
    kv_bytes_per_token_layer_gpu,
    quant_write_bytes_per_token_layer,
    step_rest_bytes_per_token,
)
from kvsim.errors import KvsimError
from kvsim.spec.formats import FormatKind, FormatMix, KVFormat, format_from_name
from kvsim.spec.models import Attention, ModelSpec, TPShapes
from kvsim.spec.topology import Link


# ---- interpolation ------------------------------------------------------------------------------
def _axis_weights(grid: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cell index, weight of the upper neighbour, and an outside-the-grid mask, for log-space x."""
    outside = (x < grid[0]) | (x > grid[-1])
    if len(grid) == 1:
        return np.zeros(x.shape, dtype=np.int64), np.zeros(x.shape), outside
    xc = np.clip(x, grid[0], grid[-1])
    i = np.clip(np.searchsorted(grid, xc, side="right") - 1, 0, len(grid) - 2)
    w = (xc - grid[i]) / (grid[i + 1] - grid[i])
    return i, w, outside


# The `impl` of chunked_prefill points timed by kvsim's calibrator on `kernels.chunked_prefill`.
_WRITING_PREFILL = ("triton:kernels.chunked_prefill", "torch:kernels.chunked_prefill")


@dataclass(frozen=True)
class RateTable:
    """log(rate) on a rectangular grid over log-sized axes; bilinear inside, held at the edges."""

    op: str
    axes: tuple[np.ndarray, ...]  # log of each axis' sizes, ascending
    log_rate: np.ndarray  # shape = tuple(len(a) for a in axes)

    @staticmethod
    def build(op: str, coords: list[tuple[float, ...]], rates: list[float], source: str) -> RateTable:
        logs = np.log(np.asarray(coords, dtype=np.float64))  # [points, dims]
        axes = tuple(np.unique(logs[:, d]) for d in range(logs.shape[1]))
        table = np.full(tuple(len(a) for a in axes), np.nan)
        for row, r in zip(logs, rates, strict=True):
            idx = tuple(int(np.searchsorted(a, x)) for a, x in zip(axes, row, strict=True))
            table[idx] = math.log(r)
        if np.isnan(table).any():
            raise KvsimError("grid is not rectangular (a point is missing)", source=source, path=f"ops.{op}")
        return RateTable(op, axes, table)

    def __call__(self, *sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rates at ``sizes`` (one array per axis, broadcast together) and the outside mask."""
        if len(self.axes) == 1:  # the common case (GEMM over m, copies over bytes): np.interp
            axis = self.axes[0]
            x = np.log(np.asarray(sizes[0], dtype=np.float64))
            return np.exp(np.interp(x, axis, self.log_rate)), (x < axis[0]) | (x > axis[-1])
        xs = np.broadcast_arrays(*[np.log(np.asarray(s, dtype=np.float64)) for s in sizes])
        cells = [_axis_weights(a, x) for a, x in zip(self.axes, xs, strict=True)]
        outside = np.zeros(xs[0].shape, dtype=bool)
        for _, _, o in cells:
            outside |= o
        acc = np.zeros(xs[0].shape)
        for corner in range(1 << len(cells)):
            weight = np.ones(xs[0].shape)
            idx = []
            for d, (i, w, _) in enumerate(cells):
                upper = (corner >> d) & 1
                weight = weight * (w if upper else 1.0 - w)
                idx.append(np.minimum(i + upper, len(self.axes[d]) - 1))
            acc = acc + weight * self.log_rate[tuple(idx)]
        return np.exp(acc), outside

    def at(self, *sizes: float) -> tuple[float, bool]:
        """`__call__` at one point, without arrays: the same float operations in the same order
        (numpy's log and exp on scalars, which equal its array loops), for the per-step look-ups."""
        grids = self._grids
        acc = 0.0
        cells = []
        outside = False
        for grid, s in zip(grids, sizes, strict=True):
            x = float(np.log(np.float64(s)))
            lo, hi = grid[0], grid[-1]
            outside = outside or x < lo or x > hi
            if len(grid) == 1:
                cells.append((0, 0.0))
                continue
            xc = lo if x < lo else hi if x > hi else x
            i = min(max(bisect_right(grid, xc) - 1, 0), len(grid) - 2)
            cells.append((i, (xc - grid[i]) / (grid[i + 1] - grid[i])))
        table = self._table
        for corner in range(1 << len(cells)):
            weight = 1.0
            node: Any = table
            for d, (i, w) in enumerate(cells):
                upper = (corner >> d) & 1
                weight = weight * (w if upper else 1.0 - w)
                node = node[min(i + upper, len(grids[d]) - 1)]
            acc = acc + weight * node
        return float(np.exp(np.float64(acc))), outside

    @cached_property
    def _grids(self) -> tuple[list[float], ...]:
        return tuple(a.tolist() for a in self.axes)

    @cached_property
    def _table(self) -> Any:
        return self.log_rate.tolist()


def _rate(pt: dict[str, Any], work_key: str) -> float:
    return float(pt[work_key]) / float(pt["t_p50"])


def _batch_row(tab: RateTable, num_seqs: int) -> tuple[np.ndarray, bool]:
    """log(rate) over the second axis of a batch x context table at batch size `num_seqs`
    (interpolated in log batch), and whether that batch size is off the table's grid."""
    i, w, out = _axis_weights(tab.axes[0], np.array([math.log(num_seqs)]))
    lo = int(i[0])
    hi = min(lo + 1, len(tab.axes[0]) - 1)
    row = (1.0 - w[0]) * tab.log_rate[lo] + w[0] * tab.log_rate[hi]
    return row, bool(out[0])


# ---- the cost model -----------------------------------------------------------------------------
class ProfileCostModel(StepCostModel):
    """`CostModel` from a validated profile, for one model / TP / KV format."""

    def __init__(
        self,
        profile: dict[str, Any],
        model: ModelSpec,
        tp: int,
        fmt: KVFormat,
        analytic: AnalyticCostModel,
        *,
        source: str,
        label: str,
        mix: FormatMix | None = None,
        force: bool = False,
    ) -> None:
        if model.is_moe or model.attention is Attention.MLA:
            raise KvsimError(
                f"{model.name}: the profile model covers dense GQA/MHA models only (MoE and MLA are not "
                "calibrated yet); use cost_model.kind: analytic",
                source=source,
            )
        self.name = f"profile:{label}"
        self.source = source
        self._profile, self._label = profile, label  # for `format_sign_warnings`' bf16 twin
        self.model, self.tp, self.fmt, self.analytic = model, tp, fmt, analytic
        self.mix, self.force = mix, force
        self.overhead_s = Efficiencies().step_overhead_s
        self._notes: list[str] = []  # about the profile itself, known at construction
        self._gemm_cache: dict[tuple[int, int], tuple[float, int]] = {}
        self._gemm_layers_cache: dict[int, tuple[float, int]] = {}  # the layers' sum, per tokens
        self._lm_head_cache: dict[int, tuple[float, int]] = {}  # per rows sampled
        self._prefill_cache: dict[tuple[int, int], tuple[float, bool]] = {}
        self._extra_cache: dict[tuple[int, int], float] = {}
        self._decode_rows: dict[int, tuple[np.ndarray, bool]] = {}
        self._picked: dict[tuple[str, str], str] = {}  # (op, format wanted) -> the points' format
        ops = profile["ops"]
        for op in ("gemm", "paged_decode", "chunked_prefill"):
            if op not in ops:
                raise KvsimError(
                    "missing op (re-run the calibrator with it)", source=source, path=f"ops.{op}"
                )
        self._init_gemm(ops)
        self.attn_flops_per_pair_layer = attn_flops_per_pair_layer(model, tp)
        # One (format, share of cached vectors) part per format of the cache (two with a mix), each
        # priced at its own measured rates.
        parts = format_parts(fmt, mix)
        self._init_attention(ops, parts)
        self._init_switch(ops)
        self._init_kv_ops(ops, parts)
        self._init_step_ops(ops, parts)
        self._init_copy(ops)
        if tp > 1:
            self._notes.append("profile: tensor-parallel all-reduce is not measured; analytic estimate used")

    def _init_gemm(self, ops: dict[str, Any]) -> None:
        """Each layer's GEMM rates by rows (and the LM head's)."""
        self._gemm_nk = TPShapes.of(self.model, self.tp).gemm_nk  # per-GPU (n, k) per GEMM: 2 m n k FLOPs
        self._gemm: dict[str, RateTable] = {}
        for layer in (*GEMM_LAYERS, "lm_head"):
            pts = [p for p in ops["gemm"]["points"] if p.get("layer") == layer]
            if not pts:
                raise KvsimError(f"no points for layer {layer!r}", source=self.source, path="ops.gemm")
            self._gemm[layer] = RateTable.build(
                "gemm", [(p["m"],) for p in pts], [_rate(p, "flops") for p in pts], self.source
            )

    def _init_attention(self, ops: dict[str, Any], parts: list[tuple[KVFormat, float]]) -> None:
        """Decode and prefill attention's rates, one table per format part of the cache."""
        m, tp = self.model, self.tp
        self._shares = [share for _, share in parts]
        self._part_bytes_layer = [share * kv_bytes_per_token_layer_gpu(m, f, tp) for f, share in parts]
        self.kv_bytes_per_token_layer = kv_bytes_per_token_layer_gpu(m, self.fmt, tp, self.mix)
        self._decodes = [
            self._by_format(ops, "paged_decode", ("batch", "context"), "bytes", f) for f, _ in parts
        ]
        self._prefills = [
            self._by_format(ops, "chunked_prefill", ("chunk", "prefix_plus_1"), "flops", f) for f, _ in parts
        ]
        self._decode = self._decodes[0]
        self._prefill = self._prefills[0]
        # kvquant4's outlier merge where its rates are another format's (`_outlier_adjust_s`).
        self._outlier_s_per_token = sum(
            share * self._outlier_adjust_s("paged_decode", f)
            for f, share in parts
            if f.kind is FormatKind.KVQUANT4
        )
        self._prefill_outlier_s = [
            self._outlier_adjust_s("chunked_prefill", f) if f.kind is FormatKind.KVQUANT4 else 0.0
            for f, _ in parts
        ]
        self._best_prefill_rate = [float(np.exp(tab.log_rate.max())) for tab in self._prefills]
        # Bytes per cached token and layer of each part's format, at share 1 (`_prefill_part`).
        self._bytes_layer = [kv_bytes_per_token_layer_gpu(m, f, tp) for f, _ in parts]

    def _init_switch(self, ops: dict[str, Any]) -> None:
        """A format switch: switched sequences decode at the second format's measured rates (a
        profile without that format is refused unless forced, as for kv.format)."""
        sw = self.analytic.switch
        self._switch_decode: RateTable | None = None
        self._switch_outlier_s = 0.0  # per switched token read, as `_outlier_s_per_token`
        self._switch_bytes_layer = 0.0
        self._switch_tokens_per_slot = 1.0
        if sw is None:
            return
        self._switch_decode = self._by_format(ops, "paged_decode", ("batch", "context"), "bytes", sw.format)
        self._switch_bytes_layer = kv_bytes_per_token_layer_gpu(self.model, sw.format, self.tp)
        if sw.format.kind is FormatKind.KVQUANT4:
            self._switch_outlier_s = self._outlier_adjust_s("paged_decode", sw.format)
        self._switch_tokens_per_slot = self.kv_bytes_per_token_layer / self._switch_bytes_layer
        self._notes.append(
            "profile: the format switch's re-quantization is not measured; analytic estimate used"
        )

    def _init_copy(self, ops: dict[str, Any]) -> None:
        """Copy rates by bytes, per link (the optional ``copy`` op)."""
        self._copy: dict[str, RateTable] = {}
        if "copy" not in ops:
            return
        for link in sorted({p.get("link") for p in ops["copy"]["points"]}):
            pts = [p for p in ops["copy"]["points"] if p.get("link") == link]
            self._copy[link] = RateTable.build(
                "copy", [(p["nbytes"],) for p in pts], [_rate(p, "bytes") for p in pts], self.source
            )

    def _by_format(
        self, ops: dict[str, Any], op: str, axes: tuple[str, ...], work: str, fmt: KVFormat
    ) -> RateTable:
        """The op's rates for `fmt`: its own points, else those of the same kind (fp8 per-head from
        per-tensor); a format the profile has no points for is refused unless ``cost_model.force``
        (then another format's rates are scaled by bytes, with a note)."""
        pts = ops[op]["points"]
        want = fmt.name
        have = sorted({str(p.get("format")) for p in pts})
        kind = fmt.kind.value
        pick = next(
            (f for f in have if f == want),
            next((f for f in have if f.split("/")[0] == kind), None),
        )
        if pick is None:
            pick = next((f for f in ("bf16", "fp16") if f in have), have[0])
            if not self.force:
                raise KvsimError(
                    f"this profile has no {op} points for KV format {want} (it has {', '.join(have)}); "
                    f"calibrate that format, or set cost_model.force: true to scale {pick} rates by bytes",
                    source=self.source,
                    path=f"ops.{op}",
                )
            self._notes.append(
                f"profile: {op} was not measured for KV format {want}; using {pick} rates scaled by bytes"
            )
        self._picked[(op, want)] = pick
        sel = [p for p in pts if str(p.get("format")) == pick]
        coords = [
            tuple(float(p["prefix"]) + 1 if a == "prefix_plus_1" else float(p[a]) for a in axes) for p in sel
        ]
        return RateTable.build(op, coords, [_rate(p, work) for p in sel], self.source)

    def _outlier_adjust_s(self, op: str, fmt: KVFormat) -> float:
        """Seconds per cached token to add to `op`'s rates for `fmt`: kvquant4's outlier merge where
        the rates are another format's (scaled by bytes, which hold the outliers' bytes but not their
        merge), or the difference from the measured kvquant4's, at the analytic estimate
        (`AnalyticCostModel.outlier_merge_s`); 0 when the rates are `fmt`'s own, and noted otherwise."""
        pick = self._picked[(op, fmt.name)]
        try:
            measured = format_from_name(pick)
        except KvsimError:
            measured = KVFormat(kind=FormatKind.BF16)
        a = self.analytic
        extra = a.outlier_merge_s(fmt) - a.outlier_merge_s(measured)
        if extra:
            self._notes.append(
                f"profile: {op}'s {pick} rates for KV format {fmt.name}: kvquant4's outlier merge "
                f"({'added' if extra > 0 else 'the difference taken off'}) at the analytic estimate, "
                f"{abs(extra) * 1e9:.2f} ns per cached token"
            )
        return extra

    def _init_kv_ops(self, ops: dict[str, Any], parts: list[tuple[KVFormat, float]]) -> None:
        """The optional ops' tables (schema 1.1) this scenario uses: H2O's score accumulation per
        decode step, a trim's top-k and compaction, and quantize-on-write of the lossy parts. An op
        the profile lacks (or lacks for a format) stays with the analytic model, with a note."""
        m, tp, ev = self.model, self.tp, self.analytic.eviction
        self._kv_layers = m.kv_layers  # the measured ops run once per layer that holds KV
        self._kv_rows: dict[tuple[str, int, int], tuple[np.ndarray, bool]] = {}
        self._write_cache: dict[int, tuple[float, bool]] = {}
        self._score: list[tuple[RateTable, float]] | None = None
        self._select: RateTable | None = None
        self._compact: list[tuple[RateTable, float]] | None = None
        self._write: list[tuple[RateTable, float]] | None = None
        self._switch_write: list[tuple[RateTable, float]] | None = None
        self._switch_write_cache: dict[int, tuple[float, bool]] = {}
        self._select_s_per_token = 0.0
        # kvsim's own chunked_prefill (the Triton kernel and its torch reference) stores the chunk's
        # K/V through kv_write before attending, so its measured times include a prefill row's
        # quantize-on-write: only decode rows pay `kv_write` on top (an imported table times the
        # attention kernel alone, as vLLM's cache write is a kernel of its own).
        self._prefill_writes = all(
            str(p.get("impl", "")).startswith(_WRITING_PREFILL) for p in ops["chunked_prefill"]["points"]
        )
        if ev is not None and ev.kind is EvictionKind.ENTROPY:
            # Not `h2o_accumulate`: that kernel re-reads K and recomputes QK^T, which the entropy
            # statistics (fused into decode attention, `ModelWork.entropy_stat_work_per_token`) do not.
            self._notes.append(
                "profile: entropy statistics not measured (no kernel; h2o_accumulate, which re-reads "
                "K, is not used for them); attention-entropy statistics priced by the analytic model"
            )
        elif ev is not None and ev.scores():
            tabs = self._optional_tables(
                ops, "h2o_accumulate", ("batch", "context"), parts, "H2O score accumulation"
            )
            if tabs is not None:
                self._score = [
                    (tab, share * h2o_accumulate_bytes_per_token_layer(m, f, tp))
                    for tab, (f, share) in zip(tabs, parts, strict=True)
                ]
                # The steady one-token selection per step re-reads each token's scores: not timed,
                # at the analytic decode rate.
                sel = self._kv_layers * h2o_select_bytes_per_token_layer(m, tp)
                self._select_s_per_token = sel / (self.analytic.bw * self.analytic.ops.decode_attn.e_max)
        if ev is not None and ev.scores():  # a trim's top-k: the same for H2O scores and entropy
            if "h2o_select" in ops:
                pts = ops["h2o_select"]["points"]
                self._select = RateTable.build(
                    "h2o_select", [(p["tokens"],) for p in pts], [_rate(p, "bytes") for p in pts], self.source
                )
            else:
                self._notes.append(
                    "profile: h2o_select not measured (schema 1.1 op); a trim's top-k priced by the analytic model"
                )
        if ev is not None:
            tabs = self._optional_tables(ops, "compact_kv", ("tokens",), parts, "a trim's compaction")
            if tabs is not None:
                self._compact = [
                    (tab, share * compact_bytes_per_token_layer(m, f, tp))
                    for tab, (f, share) in zip(tabs, parts, strict=True)
                ]
        lossy = [(f, share) for f, share in parts if f.lossy]
        if lossy:
            tabs = self._optional_tables(ops, "kv_write", ("tokens",), lossy, "quantize-on-write")
            if tabs is not None:
                self._write = [
                    (tab, share * quant_write_bytes_per_token_layer(m, f, tp))
                    for tab, (f, share) in zip(tabs, lossy, strict=True)
                ]
        sw = self.analytic.switch
        if sw is not None and sw.format.lossy:
            second = [(sw.format, 1.0)]
            tabs = self._optional_tables(ops, "kv_write", ("tokens",), second, "the format switch's writes")
            if tabs is not None:
                self._switch_write = [(tabs[0], quant_write_bytes_per_token_layer(m, sw.format, tp))]

    def _init_step_ops(self, ops: dict[str, Any], parts: list[tuple[KVFormat, float]]) -> None:
        """The step's rest (schema 1.2): `step_rest` per part, `step_overhead` over rows, and the
        decode rows' KV write of a bf16/fp16 cache from `kv_write` (`paged_decode` times no write;
        kvsim's `chunked_prefill` times its chunk's, so prefill rows pay none there, every new token
        over an imported table; a lossy part's write is the quantize-on-write above, over the same
        tokens). Absent ops keep today's prices: the
        analytic 1 ms overhead, and no rest."""
        m, tp = self.model, self.tp
        self._base_cache: dict[tuple[int, int, int, int], tuple[float, frozenset[str]]] = {}
        self._rest: dict[str, tuple[RateTable, float]] | None = None
        if "step_rest" in ops:
            pts = ops["step_rest"]["points"]
            self._rest = {}
            for part in STEP_REST_PARTS:
                sel = [p for p in pts if p.get("part") == part]
                tab = RateTable.build(
                    "step_rest", [(p["tokens"],) for p in sel], [_rate(p, "bytes") for p in sel], self.source
                )
                self._rest[part] = (tab, step_rest_bytes_per_token(m, tp, part))
        self._overhead: RateTable | None = None
        if "step_overhead" in ops:
            pts = ops["step_overhead"]["points"]
            # One call per step: the rate is calls per second, so time = 1 / rate, log-log between rows.
            self._overhead = RateTable.build(
                "step_overhead",
                [(p["rows"],) for p in pts],
                [1.0 / float(p["t_p50"]) for p in pts],
                self.source,
            )
            self.overhead_s = self._overhead_entry(1)[0]  # one row's (`step_overhead`: at any rows)
        self._dec_write: list[tuple[RateTable, float]] | None = None
        exact = [(f, share) for f, share in parts if not f.lossy]
        if exact and "kv_write" in ops:
            have = {str(p.get("format")) for p in ops["kv_write"]["points"]}
            if all(f.name in have for f, _ in exact):
                tabs = self._optional_tables(ops, "kv_write", ("tokens",), exact, "the decode rows' KV write")
                assert tabs is not None
                self._dec_write = [
                    (tab, share * quant_write_bytes_per_token_layer(m, f, tp))
                    for tab, (f, share) in zip(tabs, exact, strict=True)
                ]

    def _overhead_entry(self, rows: int) -> tuple[float, bool]:
        assert self._overhead is not None
        rate, out = self._overhead(np.array([float(max(rows, 1))]))
        return 1.0 / float(rate[0]), bool(out[0])

    def step_overhead(self, num_rows: int) -> float:
        if self._overhead is None:
            return self.overhead_s
        return self._overhead_entry(num_rows)[0]

    def _step_base(self, num_tokens: int, num_rows: int, num_decode: int, num_sampling: int) -> float:
        if self._rest is None and self._overhead is None and self._dec_write is None:
            return self.overhead_s
        return self._base_entry(num_tokens, num_rows, num_decode, num_sampling)[0]

    def _base_entry(
        self, num_tokens: int, num_rows: int, num_decode: int, num_sampling: int
    ) -> tuple[float, frozenset[str]]:
        """`_step_base`'s seconds (memoised) and the ops it priced off their grids: the measured
        overhead at this many rows (else the analytic 1 ms), plus `step_rest`'s layer part over the
        step's tokens times the layers, its embed part over the tokens and sample part over the
        LM-head rows, plus the decode rows' KV write times the layers holding KV (every new token's
        over an imported attention table)."""
        key = (num_tokens, num_rows, num_decode, num_sampling)
        hit = self._base_cache.get(key)
        if hit is not None:
            return hit
        flags: list[str] = []
        t = self.overhead_s
        if self._overhead is not None:
            t, off = self._overhead_entry(num_rows)
            if off:
                flags.append("step_overhead")
        if self._rest is not None:
            for part, n, times in (
                ("layer", num_tokens, self.model.num_layers),
                ("embed", num_tokens, 1),
                ("sample", num_sampling, 1),
            ):
                if n:
                    tab, per_tok = self._rest[part]
                    rate, out = tab(np.array([float(n)]))
                    t += times * n * per_tok / float(rate[0])
                    if out[0] and "step_rest" not in flags:
                        flags.append("step_rest")
        written = self._written(num_tokens, num_decode)
        if self._dec_write is not None and written:
            for tab, per_tok in self._dec_write:
                rate, out = tab(np.array([float(written)]))
                t += self._kv_layers * written * per_tok / float(rate[0])
                if out[0] and "kv_write" not in flags:
                    flags.append("kv_write")
        hit = self._base_cache[key] = (t, frozenset(flags) if flags else NO_FLAGS)
        return hit

    def _optional_tables(
        self,
        ops: dict[str, Any],
        op: str,
        axes: tuple[str, ...],
        parts: list[tuple[KVFormat, float]],
        what: str,
    ) -> list[RateTable] | None:
        """One table per part's format (its own points, else those of the same kind, as
        `_by_format`), or None, with a note, when the profile lacks the op or a part's format."""
        if op not in ops:
            self._notes.append(
                f"profile: {op} not measured (schema 1.1 op); {what} priced by the analytic model"
            )
            return None
        pts = ops[op]["points"]
        have = sorted({str(p.get("format")) for p in pts})
        tabs = []
        for f, _ in parts:
            pick = next(
                (h for h in have if h == f.name),
                next((h for h in have if h.split("/")[0] == f.kind.value), None),
            )
            if pick is None:
                self._notes.append(
                    f"profile: {op} not measured for KV format {f.name} (it has {', '.join(have)}); "
                    f"{what} priced by the analytic model"
                )
                return None
            sel = [p for p in pts if str(p.get("format")) == pick]
            coords = [tuple(float(p[a]) for a in axes) for p in sel]
            tabs.append(RateTable.build(op, coords, [_rate(p, "bytes") for p in sel], self.source))
        return tabs

    # ---- parts ------------------------------------------------------------------------------------
    # The simulator asks for the same shapes over and over (an hour of traffic is ~10^5 steps), so
    # GEMM and prefill times are memoised per shape, and decode rates per batch size: bilinear
    # interpolation on a rectangular grid is linear along the batch axis, then along the context
    # axis, so the row for one batch size is computed once and np.interp does the rest. The memos
    # are pure caches (same answer with or without them); whether a part lay outside the grid is
    # returned with the price (`_off_grid`), never recorded here.
    def _gemm_entry(self, num_tokens: int, num_sampling: int) -> tuple[float, int]:
        key = (num_tokens, num_sampling)
        hit = self._gemm_cache.get(key)
        if hit is None:
            hit = self._gemm_cache[key] = self._gemm_time_uncached(num_tokens, num_sampling)
        return hit

    def _gemm_time(self, num_tokens: int, num_sampling: int) -> float:
        return self._gemm_entry(num_tokens, num_sampling)[0]

    def _gemm_time_uncached(self, num_tokens: int, num_sampling: int) -> tuple[float, int]:
        # The layers' sum depends on the tokens alone (memoised apart: the sampled rows vary more),
        # the LM head's added after it, as one sum would.
        hit = self._gemm_layers_cache.get(num_tokens)
        if hit is None:
            t = 0.0
            outside = 0
            m = np.array([max(num_tokens, 1)], dtype=np.float64)
            for layer in GEMM_LAYERS:
                n, k = self._gemm_nk[layer]
                rate, out = self._gemm[layer](m)
                outside += int(np.count_nonzero(out))
                t += self.model.num_layers * gemm_flops(num_tokens, n, k) / float(rate[0])
            hit = self._gemm_layers_cache[num_tokens] = (t, outside)
        t, outside = hit
        if num_sampling:
            head = self._lm_head_cache.get(num_sampling)
            if head is None:
                n, k = self._gemm_nk["lm_head"]
                rate, out = self._gemm["lm_head"](np.array([num_sampling], dtype=np.float64))
                head = (gemm_flops(num_sampling, n, k) / float(rate[0]), int(np.count_nonzero(out)))
                self._lm_head_cache[num_sampling] = head
            t += head[0]
            outside += head[1]
        return t, outside

    def _decode_row(self, num_seqs: int, part: int = 0) -> tuple[np.ndarray, bool]:
        """log(rate) over the context axis at this batch size, and whether the batch is off-grid."""
        key = num_seqs if not part else -num_seqs
        hit = self._decode_rows.get(key)
        if hit is None:
            hit = self._decode_rows[key] = _batch_row(self._decodes[part], num_seqs)
        return hit

    def _decode_attn_time(self, num_seqs: int, sum_ctx: np.ndarray) -> np.ndarray:
        tokens = decode_tokens_read(num_seqs, sum_ctx)
        x = np.log(tokens / num_seqs)
        # Measured at calibrate's block size (16; the profile does not record it): another block
        # size reads the analytic per-block and partial-block tokens more (or fewer) at the same rate.
        paged = self.analytic.paged_tokens(num_seqs, tokens)
        if len(self._decodes) == 1:
            nbytes = paged * self.kv_bytes_per_token_layer
            row, _ = self._decode_row(num_seqs)
            rate = np.exp(np.interp(x, self._decode.axes[1], row))
            out: np.ndarray = self.model.num_layers * nbytes / rate
            if self.analytic.score_s_per_token:
                out = out + self._score_time(num_seqs, tokens, x)
            if self._outlier_s_per_token:
                out = out + paged * self._outlier_s_per_token
            return out
        t = np.zeros(tokens.shape)
        for part, (tab, per_tok) in enumerate(zip(self._decodes, self._part_bytes_layer, strict=True)):
            row, _ = self._decode_row(num_seqs, part)
            t = t + self.model.num_layers * (paged * per_tok) / np.exp(np.interp(x, tab.axes[1], row))
        if self.analytic.score_s_per_token:
            t = t + self._score_time(num_seqs, tokens, x)
        if self._outlier_s_per_token:
            t = t + paged * self._outlier_s_per_token
        return t

    def _kv_row(self, op: str, part: int, tab: RateTable, num_seqs: int) -> tuple[np.ndarray, bool]:
        """As `_decode_row`, for another batch x context table (H2O's score accumulation)."""
        key = (op, part, num_seqs)
        hit = self._kv_rows.get(key)
        if hit is None:
            hit = self._kv_rows[key] = _batch_row(tab, num_seqs)
        return hit

    def _score_time(self, num_seqs: int, tokens: np.ndarray, x: np.ndarray) -> np.ndarray:
        """H2O's score accumulation and steady selection over ``tokens`` attended tokens of
        ``num_seqs`` sequences (x: log of tokens per sequence): measured where the profile has
        `h2o_accumulate` for the cache's formats, else the analytic model's."""
        if self._score is None:
            return self.analytic.decode_score_time(tokens)
        t: np.ndarray = tokens * self._select_s_per_token
        for part, (tab, per_tok) in enumerate(self._score):
            row, _ = self._kv_row("h2o_accumulate", part, tab, num_seqs)
            t = t + self._kv_layers * (tokens * per_tok) / np.exp(np.interp(x, tab.axes[1], row))
        return t

    def _score_outside(self, num_seqs: int, sum_ctx: np.ndarray) -> bool:
        if self._score is None:
            return False
        x = np.log((sum_ctx[[0, -1]] + num_seqs) / num_seqs)
        for part, (tab, _) in enumerate(self._score):
            _, batch_outside = self._kv_row("h2o_accumulate", part, tab, num_seqs)
            axis = tab.axes[1]
            if batch_outside or bool(x[0] < axis[0]) or bool(x[-1] > axis[-1]):
                return True
        return False

    def _write_entry(
        self,
        num_tokens: int,
        tables: list[tuple[RateTable, float]] | None = None,
        memo: dict[int, tuple[float, bool]] | None = None,
    ) -> tuple[float, bool]:
        """Seconds of writing `num_tokens` new tokens through `tables` (the cache's lossy parts by
        default; a format switch's second format), memoised, and whether they left the grid."""
        tables = self._write if tables is None else tables
        memo = self._write_cache if memo is None else memo
        hit = memo.get(num_tokens)
        if hit is None:
            assert tables is not None
            t, outside = 0.0, False
            n = np.array([float(max(num_tokens, 1))])
            for tab, per_tok in tables:
                rate, out = tab(n)
                t += self._kv_layers * num_tokens * per_tok / float(rate[0])
                outside = outside or bool(out[0])
            hit = memo[num_tokens] = (t, outside)
        return hit

    def _switched_decode_attn_time(
        self, num_seqs: int, sum_ctx: np.ndarray, num_switched: int, switched_ctx: np.ndarray
    ) -> np.ndarray:
        # The unswitched sequences as a batch of their own, the switched ones at the second format's
        # rates over their real tokens (b1 / b2 per first-format slot). Off-grid flags cover the first.
        tab = self._switch_decode
        assert tab is not None
        t = np.zeros(sum_ctx.shape)
        if num_seqs > num_switched:
            t = t + self._decode_attn_time(num_seqs - num_switched, sum_ctx - switched_ctx)
        tokens = decode_tokens_read(num_switched, switched_ctx) * self._switch_tokens_per_slot
        i, w, _ = _axis_weights(tab.axes[0], np.array([math.log(num_switched)]))
        lo = int(i[0])
        hi = min(lo + 1, len(tab.axes[0]) - 1)
        row = (1.0 - w[0]) * tab.log_rate[lo] + w[0] * tab.log_rate[hi]
        rate = np.exp(np.interp(np.log(tokens / num_switched), tab.axes[1], row))
        out: np.ndarray = t + self.model.num_layers * tokens * self._switch_bytes_layer / rate
        if self._switch_outlier_s:
            out = out + tokens * self._switch_outlier_s
        return out

    def _switched_write_time(self, num_tokens: int) -> float:
        """Quantize-on-write of switched sequences' new tokens in the second format: `kv_write`'s
        measured rate for it, the analytic model's without those points."""
        if self._switch_write is None:
            return self.analytic._switched_write_time(num_tokens)
        return self._write_entry(num_tokens, self._switch_write, self._switch_write_cache)[0]

    def _decode_outside(self, num_seqs: int, sum_ctx: np.ndarray) -> bool:
        """Whether decode steps of ``num_seqs`` sequences over the runs ``sum_ctx`` leave the grid."""
        x = np.log((sum_ctx[[0, -1]] + num_seqs) / num_seqs)  # contexts grow along a run
        for part, tab in enumerate(self._decodes):
            _, batch_outside = self._decode_row(num_seqs, part)
            axis = tab.axes[1]
            if batch_outside or bool(x[0] < axis[0]) or bool(x[-1] > axis[-1]):
                return True
        return False

    prefix_rule = (
        "the chunk at the longest measured prefix plus the further prefix's pairs at the best measured "
        "prefill rate, or its KV bytes at the batch-1 decode rate if longer"
    )

    def prefix_extrapolated_s(self, n: int, ctx: int) -> float:
        key = (n, ctx)
        hit = self._extra_cache.get(key)
        if hit is None:
            hit = 0.0
            for part, share in enumerate(self._shares):
                hit += self.model.num_layers * share * self._prefill_part(part, n, ctx)[2]
            self._extra_cache[key] = hit
        return hit

    def _prefill_part(self, part: int, n: int, ctx: int) -> tuple[float, bool, float]:
        """One layer's prefill attention of part ``part`` (all of it at share 1): the grid's price
        up to its longest measured prefix, and beyond it (`PREFIX_RULE`) the further cached tokens'
        pairs at the table's best measured rate, or their bytes read at the decode table's rate at
        batch 1 over that context, whichever is longer."""
        tab = self._prefills[part]
        edge = round(math.exp(float(tab.axes[1][-1]))) - 1  # the longest measured prefix
        c = min(ctx, edge)
        flops = self.attn_flops_per_pair_layer * attended_pairs(self.model, n, c)
        rate, out = tab.at(float(n), float(c) + 1.0)  # the same floats as the array call, faster
        t = flops / rate
        if ctx <= edge:
            return t, out, 0.0
        extra = self.attn_flops_per_pair_layer * (
            attended_pairs(self.model, n, ctx) - attended_pairs(self.model, n, c)
        )
        dec = self._decodes[part]
        row, _ = self._decode_row(1, part)
        dec_rate = float(np.exp(np.interp(math.log(max(ctx, 1)), dec.axes[1], row)))
        nbytes = (attended_prefix(self.model, ctx) - attended_prefix(self.model, c)) * self._bytes_layer[part]
        beyond = max(extra / self._best_prefill_rate[part], nbytes / dec_rate)
        return t + beyond, True, beyond

    def _prefill_entry(self, n: int, ctx: int) -> tuple[float, bool]:
        key = (n, ctx)
        hit = self._prefill_cache.get(key)
        if hit is None:
            t, outside = 0.0, False
            for part, share in enumerate(self._shares):  # each part's share at its own rates
                tp, out, _ = self._prefill_part(part, n, ctx)
                t += self.model.num_layers * share * tp
                outside = outside or out
                if self._prefill_outlier_s[part] and ctx:  # the prefix's outliers, as the analytic model
                    t += share * attended_prefix(self.model, ctx) * self._prefill_outlier_s[part]
            hit = (t, outside)
            if self.analytic.prefill_score:
                hit = (hit[0] + self.analytic.prefill_score_time(n, ctx), hit[1])
            self._prefill_cache[key] = hit
        return hit

    def _prefill_attn_time(self, n: int, ctx: int) -> float:
        return self._prefill_entry(n, ctx)[0]

    def _off_grid(
        self, tokens: int, rows: int, chunks: Chunks, n_dec: int, dec: np.ndarray, seqs: int | None = None
    ) -> Flags:
        flags: list[str] = []
        if self._rest is not None or self._overhead is not None or self._dec_write is not None:
            n_seqs = n_dec + len(chunks) if seqs is None else seqs
            flags.extend(self._base_entry(tokens, n_seqs, n_dec, rows)[1])
        if self._gemm_entry(tokens, rows)[1]:
            flags.append("gemm")
        if any(self._prefill_entry(n, c)[1] for n, c in chunks):
            flags.append("chunked_prefill")
        if n_dec and self._decode_outside(n_dec, dec):
            flags.append("paged_decode")
        if n_dec and self.analytic.score_s_per_token and self._score_outside(n_dec, dec):
            flags.append("h2o_accumulate")
        # A format switch's writes are flagged over the step's tokens (how many switched is not passed).
        sw = self._switch_write
        written = self._written(tokens, n_dec)
        if (self._write is not None and written and self._write_entry(written)[1]) or (
            sw is not None and written and self._write_entry(written, sw, self._switch_write_cache)[1]
        ):
            flags.append("kv_write")
        return frozenset(flags) if flags else NO_FLAGS

    def op_parts(self, batch: ForwardBatch) -> dict[str, float]:
        """`price(batch)`'s seconds split as the profile's ops price them (``kvsim validate``'s
        per-op table): ``gemm:<layer>`` (times the layers; lm_head over the sampled rows),
        ``paged_decode``, ``chunked_prefill``, ``kv_write``, ``step_rest:<part>``, ``step_overhead``
        and ``other`` (the rest of the price: all-reduces, a verify's attention), summing to it.
        Decode and prefill rows only (no format switch)."""
        kinds = batch.kinds
        total = batch.num_tokens
        dec_ctx = [c for k, c in zip(kinds, batch.ctx_before, strict=True) if k is SeqKind.DECODE]
        chunks = [
            (n, c)
            for k, n, c in zip(kinds, batch.num_new, batch.ctx_before, strict=True)
            if k is SeqKind.PREFILL
        ]
        out: dict[str, float] = {}
        m = np.array([max(total, 1)], dtype=np.float64)
        for layer in GEMM_LAYERS:
            n, k = self._gemm_nk[layer]
            rate, _ = self._gemm[layer](m)
            out[f"gemm:{layer}"] = self.model.num_layers * gemm_flops(total, n, k) / float(rate[0])
        if batch.num_sampling:
            n, k = self._gemm_nk["lm_head"]
            rate, _ = self._gemm["lm_head"](np.array([batch.num_sampling], dtype=np.float64))
            out["gemm:lm_head"] = gemm_flops(batch.num_sampling, n, k) / float(rate[0])
        if dec_ctx:
            ctx = np.array([float(sum(dec_ctx))])
            out["paged_decode"] = float(self._decode_part(len(dec_ctx), ctx, 0, None)[0])
        if chunks:
            out["chunked_prefill"] = self.prefill_launch_s + sum(
                self._prefill_attn_time(n, c) for n, c in chunks
            )
        if self._rest is None and self._overhead is None and self._dec_write is None:
            out["step_overhead"] = self.overhead_s
        else:
            out["step_overhead"] = self.step_overhead(len(kinds))
            for part, n, times in (
                ("layer", total, self.model.num_layers),
                ("embed", total, 1),
                ("sample", batch.num_sampling, 1),
            ):
                if n and self._rest is not None:
                    tab, per_tok = self._rest[part]
                    rate, _ = tab(np.array([float(n)]))
                    out[f"step_rest:{part}"] = times * n * per_tok / float(rate[0])
            written = self._written(total, len(dec_ctx))
            if self._dec_write is not None and written:
                out["kv_write"] = sum(
                    self._kv_layers * written * per_tok / float(tab(np.array([float(written)]))[0][0])
                    for tab, per_tok in self._dec_write
                )
        lossy = self._write_part(total, 0, len(dec_ctx))
        if lossy:
            out["kv_write"] = out.get("kv_write", 0.0) + lossy
        out["other"] = self.price(batch).seconds - sum(out.values())
        return out

    # ---- interface --------------------------------------------------------------------------------
    def _comm_time(self, num_tokens: int) -> float:
        return self.analytic._comm_time(num_tokens)  # all-reduces are not measured

    def eviction_time(self, work: EvictionWork) -> float:
        return self.eviction_price(work).seconds

    def eviction_price(self, work: EvictionWork) -> StepPrice:
        """A step's trims as one call per op over all trimmed sequences: the top-k over the scored
        tokens (`h2o_select`) and the compaction of the moved ones (`compact_kv`, block-table update
        included) at their measured rates, times the layers holding KV; the other block-table
        writes, and an op the profile lacks, as the analytic model's kernel for it. Without either
        measured op, or with a format switch's re-quantization in the work (not measured; the
        analytic model's `requant_tokens` pricing, and a switch is refused with kv.eviction), exactly
        the analytic model's `eviction_time`."""
        a = self.analytic
        if (self._select is None and self._compact is None) or work.requant_tokens:
            return StepPrice(a.eviction_time(work))
        t, flags = 0.0, []
        if work.select_tokens:
            if self._select is not None:
                rate, out = self._select(np.array([float(work.select_tokens)]))
                per_tok = h2o_select_bytes_per_token_layer(self.model, self.tp)
                t += self._kv_layers * work.select_tokens * per_tok / float(rate[0])
                if out[0]:
                    flags.append("h2o_select")
            else:
                t += a.trim_op_time(work.select_tokens, 0, 0)
        if work.moved_tokens:
            if self._compact is not None:
                n = np.array([float(work.moved_tokens)])
                for tab, per_tok in self._compact:
                    rate, out = tab(n)
                    t += self._kv_layers * work.moved_tokens * per_tok / float(rate[0])
                    if out[0] and "compact_kv" not in flags:
                        flags.append("compact_kv")
            else:
                t += a.trim_op_time(0, work.moved_tokens, 0)
        if work.table_entries:
            t += a.trim_op_time(0, 0, work.table_entries)
        return StepPrice(t, frozenset(flags) if flags else NO_FLAGS)

    def _written(self, num_tokens: int, num_decode: int) -> int:
        """Of a step's `num_tokens` new tokens (`num_decode` of them decode rows'), those whose KV
        write no timed attention holds: kvsim's chunked_prefill writes its chunk itself, so there
        the decode rows'; an imported attention table times the attention alone, so there all."""
        return num_decode if self._prefill_writes else num_tokens

    def _write_part(self, num_tokens: int, num_switched: int, num_decode: int) -> float:
        written = self._written(num_tokens, num_decode)
        return super()._write_part(written, min(num_switched, written), num_decode)

    def _write_time(self, num_tokens: int) -> float:
        """Quantize-on-write of the new tokens' lossy parts: `kv_write`'s measured rate at this
        token count, times the layers holding KV; the analytic model's without those points."""
        if self._write is None:
            return self.analytic._write_time(num_tokens)
        return self._write_entry(num_tokens)[0]

    def transfer_price(self, nbytes: float, link: Link, num_calls: int = 1) -> StepPrice:
        """``num_calls`` copies of ``nbytes / num_calls`` each at the rate measured for that size (a
        measured copy includes its call overhead); the analytic time over links not measured."""
        table = self._copy.get(link.name)
        if table is None:
            return StepPrice(
                self.analytic.transfer_time(nbytes, link, num_calls), frozenset({f"link:{link.name}"})
            )
        per_call = nbytes / num_calls
        rate, out = table(np.array([max(per_call, 1.0)]))
        return StepPrice(num_calls * per_call / float(rate[0]), frozenset({"copy"}) if out[0] else NO_FLAGS)

    def transfer_time(self, nbytes: float, link: Link, num_calls: int = 1) -> float:
        return self.transfer_price(nbytes, link, num_calls).seconds

    def warnings(self, ran: frozenset[str] = NO_FLAGS) -> list[str]:
        out = list(self._notes)
        for flag in sorted(ran):
            if flag.startswith("link:"):
                out.append(f"profile: link {flag[5:]} not measured; analytic transfer time used")
            else:
                how = "nearest measured rate held"
                if flag == "chunked_prefill":
                    how += "; a prefix beyond the longest measured: its share is warned below"
                out.append(f"profile: {flag} extrapolated beyond the measured grid ({how})")
        return out

    def format_sign_warnings(self, num_seqs: int, ctx_per_seq: float) -> list[str]:
        """The cache's format over bf16 in a decode step of `num_seqs` sequences over `ctx_per_seq`
        tokens each, as this profile prices it and as the analytic model for the GPU (fitted where
        its tables are) does, without eviction or a format switch: one line when one says faster and
        the other slower, each change at least `SIGN_DEAD_BAND`. None for a bf16/fp16 cache, or a
        profile without bf16 decode points. Builds four models: once per run, after it."""
        if num_seqs < 1 or not any(f.lossy for f, _ in format_parts(self.fmt, self.mix)):
            return []
        a = self.analytic
        fmt_a = AnalyticCostModel(
            a.model, a.gpu, a.tp, self.fmt, a.topology, mix=self.mix, block_size=a.block_size
        )
        bf16_a = AnalyticCostModel(a.model, a.gpu, a.tp, BF16, a.topology, block_size=a.block_size)
        try:
            bf16_p = ProfileCostModel(
                self._profile, self.model, self.tp, BF16, bf16_a, source=self.source, label=self._label
            )
        except KvsimError:  # no bf16 points: nothing measured to compare against
            return []
        fmt_p = ProfileCostModel(
            self._profile,
            self.model,
            self.tp,
            self.fmt,
            fmt_a,
            source=self.source,
            label=self._label,
            mix=self.mix,
            force=self.force,
        )
        ctx = np.array([float(num_seqs) * ctx_per_seq])
        prof, ana = (
            float(f.decode_step_times(num_seqs, ctx)[0] / b.decode_step_times(num_seqs, ctx)[0]) - 1.0
            for f, b in ((fmt_p, bf16_p), (fmt_a, bf16_a))
        )
        if prof * ana >= 0.0 or min(abs(prof), abs(ana)) < SIGN_DEAD_BAND:
            return []
        what = self.fmt.name if self.mix is None else f"{self.fmt.name} with {self.mix.name}"
        return [
            f"cost model: the profile and the fitted analytic model disagree on {what}'s direction: a "
            f"decode step of {num_seqs} sequences x {ctx_per_seq:,.0f} tokens (the run's mean) takes "
            f"{prof:+.1%} vs bf16 on the profile, {ana:+.1%} on {fmt_a.name}; which is faster depends "
            "on the cost model (docs/cost-model-accuracy.md)"
        ]


# A change to a step smaller than this has no direction worth a warning: far inside either model's
# error (median 6-9% per decode-attention call on the tables, docs/cost-model-accuracy.md). A kvsim
# choice, not a measurement.
SIGN_DEAD_BAND = 1e-3


def load_profile_cost_model(sc: Any) -> ProfileCostModel:
    """The `ProfileCostModel` for scenario ``sc`` (``sc.cost_model.profile``), refusing a profile measured
    on another GPU or for another model's shapes unless ``sc.cost_model.force``."""
    path = Path(sc.cost_model.profile)
    src = str(path)
    prof = load_profile(path)
    force = bool(sc.cost_model.force)
    notes: list[str] = []
    dev = prof["device"]["name"]
    gpu = sc.cluster.gpu.name
    if not gpu_matches(dev, prof["backend"], gpu):
        if not force:
            raise KvsimError(
                f"profile measured on {dev!r} ({prof['backend']}) does not match the scenario's GPU {gpu}; "
                "set cost_model.force: true to use it anyway",
                source=src,
                path="device.name",
            )
        notes.append(f"profile from {dev!r} forced onto a {gpu} scenario")
    want = model_shapes(sc.model)
    have = {k: prof["model"].get(k) for k in MODEL_SHAPE_KEYS}
    tp = sc.cluster.tensor_parallel
    if have != want or prof["tp"] != tp:
        if not force:
            raise KvsimError(
                f"profile measured for {prof['model']['name']} at tp {prof['tp']}, the scenario runs "
                f"{sc.model.name} at tp {tp}; set cost_model.force: true to scale by FLOPs/bytes",
                source=src,
                path="model",
            )
        notes.append(f"profile for {prof['model']['name']} tp {prof['tp']} scaled to {sc.model.name} tp {tp}")
    if prof["backend"] == "cpu":
        notes.append("cpu profile: timings are from a CPU, not a GPU")
    if not prof["complete"]:
        notes.append("profile is incomplete (calibration was interrupted)")
    mix = sc.kv.format_mix
    analytic = AnalyticCostModel(
        sc.model,
        sc.cluster.gpu,
        tp,
        sc.kv.format,
        sc.cluster.topology,
        mix=mix,
        eviction=eviction_from_config(sc.kv.eviction),
        switch=sc.kv.format_switch,
        block_size=sc.kv.block_size,
    )
    model = ProfileCostModel(
        prof, sc.model, tp, sc.kv.format, analytic, source=src, label=path.name, mix=mix, force=force
    )
    model._notes[:0] = notes
    return model

"""Import NVIDIA aiconfigurator-core's measured kernel tables as a kvsim profile.

The ``aiconfigurator-core`` wheel (Apache-2.0) ships parquet tables of single-op timings that NVIDIA
collected per system (h100_sxm, h200_sxm, b200_sxm, ...), serving framework (vllm, sglang, trtllm)
and framework version, under ``aiconfigurator_core/systems/data/<system>/<family>/<backend>/<ver>/``.
Every table has a ``latency`` column in milliseconds for one call of one op on one GPU (checked: a
bf16 GEMM of 32768 x 65536 x 12288 has latency 63.8 on an H200; as ms that is 827 TFLOP/s, 84% of
the 989 TFLOP/s peak). What maps to what:

- ``gemm/.../gemm_perf.parquet`` (``gemm_dtype``, ``m``, ``n``, ``k``) -> ``gemm``: the tables are
  keyed by generic m, n, k on a grid of 74 m values x 22 n x 22 k; each of the model's per-GPU layer
  shapes (qkv, o, gate_up, down, lm_head) takes log(FLOP/s) interpolated bilinearly in log n and log
  k between the neighbouring grid shapes, at every measured m. A shape beyond the grid (Llama's
  lm_head n = 128256 > 65536) holds the edge shape's rate. The other GEMM dtype goes to
  ``gemm_fp8`` (or ``gemm_bf16``), which kvsim's cost model does not read yet.
- ``attention/.../generation_attention_perf.parquet`` -> ``paged_decode``: one layer, ``batch_size``
  sequences each attending over ``isl + step`` cached tokens (``isl`` is 1 on every decode row), per
  ``kv_cache_dtype`` (bfloat16 -> ``bf16``, fp8 -> ``fp8_e4m3/per_tensor``). The sweep omits large
  batch x long context (it stops at 256K-512K cached tokens per call); kvsim needs a rectangular grid, so each
  missing cell holds the bytes/s of the same batch at its longest measured context and is marked
  ``filled``.
- ``attention/.../context_attention_perf.parquet`` -> ``chunked_prefill``: rows with ``batch_size``
  1, ``chunk`` = ``isl``, ``prefix`` = 0. The tables hold no prefill over a cached prefix: kvsim's
  cost model prices the chunk's own pairs at the prefix-0 rate and the prefix's at the table's best
  rate or its KV bytes at the decode table's (`ProfileCostModel.prefix_rule`), and warns of the share.

Left out: the communication tables (kvsim prices all-reduce analytically), host <-> device copies
(not in the tables; kvsim's analytic link model applies), MoE/MLA tables (kvsim's profile model
covers dense GQA only), and the fp8-block / nvfp4 GEMMs. The tables give one latency per point, so
``t_p20 = t_p50 = t_p80``.
"""

from __future__ import annotations

import datetime
import hashlib
import math
from dataclasses import dataclass
from importlib import metadata, resources
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from kvsim.costs.profile_schema import MODEL_SHAPE_KEYS, SCHEMA, VERSION
from kvsim.costs.work import (
    attn_flops_per_pair_layer,
    causal_pairs,
    gemm_bytes,
    gemm_flops,
    kv_bytes_per_token_layer_gpu,
)
from kvsim.errors import KvsimError
from kvsim.spec.formats import KVFormat, make_format
from kvsim.spec.models import Attention, ModelSpec, TPShapes

PACKAGE = "aiconfigurator_core"
DIST = "aiconfigurator-core"
INSTALL_HINT = "aiconfigurator-core is not installed: pip install 'kvsim[aiconfigurator]'"
LICENSE = "Apache-2.0"
GEMM_TABLE = ("gemm", "gemm_perf.parquet")
DECODE_TABLE = ("attention", "generation_attention_perf.parquet")
PREFILL_TABLE = ("attention", "context_attention_perf.parquet")
KV_DTYPES = {"bfloat16": "bf16", "fp8": "fp8_e4m3"}  # aiconfigurator kv_cache_dtype -> kvsim format
GEMM_DTYPES = {"bfloat16": "gemm_bf16", "fp8": "gemm_fp8"}  # name of the op when not the main `gemm`
# aiconfigurator system -> kvsim GPU preset whose peaks fill `util_*` (as `python -m calibrate` does).
PRESETS = {
    "h100_sxm": "h100-sxm",
    "h100_pcie": "h100-pcie",
    "h200_sxm": "h200-sxm",
    "a100_sxm": "a100-80gb",
    "b200_sxm": "b200",
    "l40s": "l40s",
}
MS = 1e-3


@dataclass(frozen=True)
class Source:
    """One (system, backend, version) of the installed package's data."""

    systems_root: Path  # aiconfigurator_core/systems
    system: str
    backend: str
    version: str
    package_version: str

    @property
    def data_dir(self) -> Path:
        return self.systems_root / "data" / self.system

    def table(self, family: str, name: str) -> Path:
        return self.data_dir / family / self.backend / self.version / name

    def rel(self, path: Path) -> str:
        return str(path.relative_to(self.systems_root.parent.parent))


# ---- locating the data --------------------------------------------------------------------------
def package_root() -> tuple[Path, str]:
    """``aiconfigurator_core/systems`` and the installed version; `KvsimError` when not installed."""
    try:
        import pyarrow.parquet  # noqa: F401  (the tables are parquet)

        root = resources.files(PACKAGE) / "systems"
        version = metadata.version(DIST)
    except (ImportError, metadata.PackageNotFoundError):
        raise KvsimError(INSTALL_HINT) from None
    return Path(str(root)), version


def _version_key(v: str) -> tuple[Any, ...]:
    from packaging.version import InvalidVersion, Version  # a dependency of aiconfigurator-core

    try:
        return (1, Version(v))
    except InvalidVersion:
        return (0, v)


def available(systems_root: Path) -> dict[str, dict[str, list[str]]]:
    """system -> backend -> versions (oldest first) holding the GEMM and both attention tables."""
    out: dict[str, dict[str, list[str]]] = {}
    data = systems_root / "data"
    for sys_dir in sorted(p for p in data.iterdir() if p.is_dir()):
        backends: dict[str, list[str]] = {}
        gemm_dir = sys_dir / GEMM_TABLE[0]
        for be_dir in sorted(p for p in gemm_dir.iterdir() if p.is_dir()) if gemm_dir.is_dir() else []:
            versions = [
                v.name
                for v in be_dir.iterdir()
                if (v / GEMM_TABLE[1]).is_file()
                and all(
                    (sys_dir / f / be_dir.name / v.name / n).is_file()
                    for f, n in (DECODE_TABLE, PREFILL_TABLE)
                )
            ]
            if versions:
                backends[be_dir.name] = sorted(versions, key=_version_key)
        if backends:
            out[sys_dir.name] = backends
    return out


def resolve(system: str, backend: str, version: str | None) -> Source:
    """The data for ``system``/``backend``; ``version`` defaults to the newest with all three tables."""
    root, pkg_version = package_root()
    have = available(root)
    if system not in have:
        raise KvsimError(f"unknown system {system!r}; available: {', '.join(have)}", source="--system")
    if backend not in have[system]:
        raise KvsimError(
            f"no {backend!r} data for {system}; available: {', '.join(have[system])}", source="--backend"
        )
    versions = have[system][backend]
    if version is None:
        version = versions[-1]
    elif version not in versions:
        raise KvsimError(
            f"no {backend} {version} data for {system}; available: {', '.join(versions)}", source="--version"
        )
    return Source(root, system, backend, version, pkg_version)


def _read(path: Path, columns: list[str], defaults: dict[str, Any] | None = None) -> dict[str, np.ndarray]:
    """Columns of one table; a column older tables lack takes its value from ``defaults``."""
    import pyarrow.parquet as pq

    defaults = defaults or {}
    present = set(pq.read_schema(path).names)
    missing = [c for c in columns if c not in present and c not in defaults]
    if missing:
        raise KvsimError(
            f"table lacks column(s) {', '.join(missing)}; it has {', '.join(sorted(present))}",
            source=str(path),
        )
    table = pq.read_table(path, columns=[c for c in columns if c in present])
    out = {c: table.column(c).to_numpy(zero_copy_only=False) for c in columns if c in present}
    for c in columns:
        if c not in present:
            out[c] = np.full(table.num_rows, defaults[c])
    return out


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- shapes -------------------------------------------------------------------------------------
Shapes = TPShapes  # per-GPU shapes, shared with kvsim.costs.profile so both price the same GEMMs


def _with_rates(pt: dict[str, Any], peaks: dict[str, Any]) -> dict[str, Any]:
    t = pt["t_p50"]
    pt["bw_bytes_per_s"] = pt["bytes"] / t
    pt["flops_per_s"] = pt["flops"] / t
    pt["util_bw"] = pt["bw_bytes_per_s"] / peaks["bw_bytes_per_s"] if peaks.get("bw_bytes_per_s") else None
    pt["util_flops"] = pt["flops_per_s"] / peaks["bf16_flops"] if peaks.get("bf16_flops") else None
    return pt


def _timed(t_s: float) -> dict[str, float]:
    return {"t_p20": t_s, "t_p50": t_s, "t_p80": t_s}


# ---- GEMM ---------------------------------------------------------------------------------------
def _bracket(grid: np.ndarray, x: float) -> tuple[list[int], list[float], bool]:
    """Neighbouring grid indices and their weights for x, linear in log space; held at the edges."""
    lg, lx = np.log(grid), math.log(x)
    if lx <= lg[0] or lx >= lg[-1]:
        i = 0 if lx <= lg[0] else len(grid) - 1
        return [i], [1.0], not math.isclose(lx, lg[i])
    j = int(np.searchsorted(lg, lx))
    if math.isclose(lg[j], lx):
        return [j], [1.0], False
    w = (lx - lg[j - 1]) / (lg[j] - lg[j - 1])
    return [j - 1, j], [1.0 - w, w], False


def gemm_points(
    src: Source, shapes: Shapes, dtype: str, peaks: dict[str, Any]
) -> tuple[list[dict[str, Any]], list[str]]:
    """Points of one GEMM dtype at the model's layer shapes, over every measured m."""
    path = src.table(*GEMM_TABLE)
    cols = _read(path, ["gemm_dtype", "kernel_source", "m", "n", "k", "latency"])
    sel = cols["gemm_dtype"] == dtype
    if not sel.any():
        have = sorted(set(cols["gemm_dtype"].tolist()))
        raise KvsimError(
            f"no {dtype} GEMMs in {src.rel(path)}; it has {', '.join(have)}", source="--gemm-dtype"
        )
    m, n, k, lat = (cols[c][sel] for c in ("m", "n", "k", "latency"))
    kernels = sorted(set(cols["kernel_source"][sel].tolist()))
    ms, ns, ks = np.unique(m), np.unique(n), np.unique(k)
    cube = np.full((len(ms), len(ns), len(ks)), np.nan)  # latency ms [m, n, k]; min over kernels
    idx = (np.searchsorted(ms, m), np.searchsorted(ns, n), np.searchsorted(ks, k))
    np.fmin.at(cube, idx, lat)
    flops_cube = gemm_flops(ms[:, None, None], ns[None, :, None], ks[None, None, :])
    log_rate = np.log(flops_cube / (cube * MS))  # log FLOP/s; NaN where not measured
    in_bytes = 1 if dtype == "fp8" else 2  # operands; the output is bf16
    notes: list[str] = []
    points: list[dict[str, Any]] = []
    for layer, (nn, kk) in shapes.gemm_nk.items():
        ni, nw, n_out = _bracket(ns.astype(np.float64), nn)
        ki, kw, k_out = _bracket(ks.astype(np.float64), kk)
        corners = [
            (a, b, wa * wb) for a, wa in zip(ni, nw, strict=True) for b, wb in zip(ki, kw, strict=True)
        ]
        used = [f"{int(ns[a])}x{int(ks[b])}" for a, b, _ in corners]
        if n_out or k_out:
            notes.append(
                f"gemm {layer}: n x k = {nn}x{kk} lies outside the measured {int(ns[0])}..{int(ns[-1])} x "
                f"{int(ks[0])}..{int(ks[-1])} grid; the rate of {', '.join(used)} is held"
            )
        for mi, mm in enumerate(ms):
            vals = [(log_rate[mi, a, b], w) for a, b, w in corners]
            if any(np.isnan(v) for v, _ in vals):
                continue  # a neighbouring shape was not measured at this m
            rate = math.exp(sum(v * w for v, w in vals))
            flops = gemm_flops(float(mm), nn, kk)
            pt = {
                "layer": layer,
                "m": int(mm),
                "n": nn,
                "k": kk,
                **_timed(flops / rate),
                "bytes": gemm_bytes(int(mm), nn, kk, operand_bytes=in_bytes),
                "flops": flops,
                "dtype": dtype,
                "impl": f"aiconfigurator:{'|'.join(kernels)}",
                "from_nk": used,
            }
            points.append(_with_rates(pt, peaks))
    return points, notes


# ---- attention ----------------------------------------------------------------------------------
_ATTN_COLS = [
    "kernel_source",
    "batch_size",
    "isl",
    "step",
    "num_heads",
    "num_key_value_heads",
    "head_dim",
    "beam_width",
    "kv_cache_dtype",
    "window_size",
    "latency",
]


def _attn_rows(
    src: Source, table: tuple[str, str], shapes: Shapes, kernel: str | None
) -> tuple[dict[str, np.ndarray], str, list[str]]:
    """Rows of one attention table at the model's per-GPU heads, full attention, one kernel."""
    path = src.table(*table)
    cols = _read(path, _ATTN_COLS, {"window_size": 0, "beam_width": 1, "step": 0})
    dense = (cols["window_size"] == 0) & (cols["beam_width"] == 1)
    shape = (
        dense
        & (cols["num_heads"] == shapes.heads)
        & (cols["num_key_value_heads"] == shapes.kv_heads)
        & (cols["head_dim"] == shapes.head_dim)
        & np.isin(cols["kv_cache_dtype"], list(KV_DTYPES))
    )
    if not shape.any():
        combos = sorted(
            set(
                zip(
                    cols["num_heads"][dense].tolist(),
                    cols["num_key_value_heads"][dense].tolist(),
                    cols["head_dim"][dense].tolist(),
                    strict=True,
                )
            )
        )
        listed = ", ".join(f"{h}/{kv}/{d}" for h, kv, d in combos if d == shapes.head_dim) or "none"
        raise KvsimError(
            f"{src.rel(path)} has no rows for {shapes.heads} query heads / {shapes.kv_heads} KV heads / "
            f"head_dim {shapes.head_dim} per GPU; heads/kv_heads/head_dim it has at that head_dim: {listed}",
            source="--model",
        )
    counts: dict[str, int] = {}
    for ks in cols["kernel_source"][shape].tolist():
        counts[ks] = counts.get(ks, 0) + 1
    if kernel is None:
        kernel = sorted(counts, key=lambda s: (-counts[s], s))[0]  # the best-covered kernel
    elif kernel not in counts:
        raise KvsimError(
            f"kernel {kernel!r} has no rows at this shape in {src.rel(path)}; "
            f"it has {', '.join(sorted(counts))}",
            source="--attn-kernel",
        )
    keep = shape & (cols["kernel_source"] == kernel)
    return {c: v[keep] for c, v in cols.items()}, kernel, sorted(counts)


def _kv_format(dtype: str) -> KVFormat:
    return make_format(KV_DTYPES[dtype])[0]


def decode_points(
    src: Source, model: ModelSpec, tp: int, kernel: str | None, peaks: dict[str, Any]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    shapes = Shapes.of(model, tp)
    rows, kernel, kernels = _attn_rows(src, DECODE_TABLE, shapes, kernel)
    points: list[dict[str, Any]] = []
    filled = 0
    for dtype in sorted(set(rows["kv_cache_dtype"].tolist())):
        fmt = _kv_format(dtype)
        per_tok = kv_bytes_per_token_layer_gpu(model, fmt, tp)
        sel = rows["kv_cache_dtype"] == dtype
        batch, ctx = rows["batch_size"][sel], rows["isl"][sel] + rows["step"][sel]
        lat = rows["latency"][sel]
        bs, cs = np.unique(batch), np.unique(ctx)
        t = np.full((len(bs), len(cs)), np.nan)  # seconds [batch, context]; median of repeats
        for bi, b in enumerate(bs):
            for ci, c in enumerate(cs):
                hit = lat[(batch == b) & (ctx == c)]
                if hit.size:
                    t[bi, ci] = float(np.median(hit)) * MS
        for bi, b in enumerate(bs):
            measured = np.flatnonzero(~np.isnan(t[bi]))
            if measured.size == 0:
                continue
            for ci, c in enumerate(cs):
                nbytes = float(b * c * per_tok)
                pt: dict[str, Any] = {"batch": int(b), "context": int(c), "format": fmt.name}
                if np.isnan(t[bi, ci]):
                    ref = int(measured[np.argmin(np.abs(np.log(cs[measured]) - math.log(c)))])
                    ref_rate = b * cs[ref] * per_tok / t[bi, ref]
                    pt.update(_timed(nbytes / ref_rate))
                    pt["filled"] = {"rate_of_context": int(cs[ref])}
                    filled += 1
                else:
                    pt.update(_timed(float(t[bi, ci])))
                pt.update(
                    {
                        "bytes": nbytes,
                        "flops": float(attn_flops_per_pair_layer(model, tp) * b * c),
                        "kv_cache_dtype": dtype,
                        "impl": f"aiconfigurator:{kernel}",
                    }
                )
                points.append(_with_rates(pt, peaks))
    return points, {"kernel": kernel, "kernels_at_shape": kernels, "filled_points": filled}


def prefill_points(
    src: Source, model: ModelSpec, tp: int, kernel: str | None, peaks: dict[str, Any]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    shapes = Shapes.of(model, tp)
    rows, kernel, kernels = _attn_rows(src, PREFILL_TABLE, shapes, kernel)
    points: list[dict[str, Any]] = []
    for dtype in sorted(set(rows["kv_cache_dtype"].tolist())):
        fmt = _kv_format(dtype)
        per_tok = kv_bytes_per_token_layer_gpu(model, fmt, tp)
        sel = (rows["kv_cache_dtype"] == dtype) & (rows["batch_size"] == 1) & (rows["step"] == 0)
        isl, lat = rows["isl"][sel], rows["latency"][sel]
        for chunk in np.unique(isl):
            pt = {
                "chunk": int(chunk),
                "prefix": 0,
                "format": fmt.name,
                **_timed(float(np.median(lat[isl == chunk])) * MS),
                "bytes": float(chunk * per_tok),
                "flops": float(attn_flops_per_pair_layer(model, tp) * causal_pairs(int(chunk), 0)),
                "kv_cache_dtype": dtype,
                "impl": f"aiconfigurator:{kernel}",
            }
            points.append(_with_rates(pt, peaks))
    return points, {"kernel": kernel, "kernels_at_shape": kernels}


# ---- the profile --------------------------------------------------------------------------------
def _system_info(src: Source) -> dict[str, Any]:
    path = src.systems_root / f"{src.system}.yaml"
    try:
        return dict(yaml.safe_load(path.read_text()).get("gpu") or {})
    except (OSError, yaml.YAMLError, AttributeError):
        return {}


def _peaks(src: Source, gpu: dict[str, Any]) -> dict[str, Any]:
    preset = PRESETS.get(src.system)
    if preset is not None:
        from kvsim.spec.hardware import load_gpu

        spec = load_gpu(preset)
        return {
            "bf16_flops": float(spec.bf16_flops),
            "bw_bytes_per_s": float(spec.hbm_bw_bytes_per_s),
            "preset": preset,
        }
    flops, bw = gpu.get("bfloat16_tc_flops"), gpu.get("mem_bw")
    return {
        "bf16_flops": float(flops) if flops else None,
        "bw_bytes_per_s": float(bw) if bw else None,
        "preset": f"aiconfigurator {src.system}.yaml" if flops or bw else None,
    }


def build_profile(
    src: Source,
    model: ModelSpec,
    tp: int,
    *,
    gemm_dtype: str = "bfloat16",
    attn_kernel: str | None = None,
) -> dict[str, Any]:
    """A kvsim profile (schema v1) from the tables of ``src`` at ``model``'s per-GPU shapes under ``tp``."""
    if model.is_moe or model.attention is Attention.MLA:
        raise KvsimError(f"{model.name}: only dense GQA/MHA models are imported", source="--model")
    if tp < 1:
        raise KvsimError(f"expected a positive integer, got {tp}", source="--tp")
    if gemm_dtype not in GEMM_DTYPES:
        raise KvsimError(
            f"expected one of {', '.join(GEMM_DTYPES)}, got {gemm_dtype!r}", source="--gemm-dtype"
        )
    shapes = Shapes.of(model, tp)
    gpu = _system_info(src)
    peaks = _peaks(src, gpu)
    gemm, notes = gemm_points(src, shapes, gemm_dtype, peaks)
    ops: dict[str, Any] = {"gemm": {"points": gemm}}
    for other, op_name in GEMM_DTYPES.items():
        if other != gemm_dtype:
            try:
                pts, _ = gemm_points(src, shapes, other, peaks)
                ops[op_name] = {"points": pts}
            except KvsimError:
                pass  # the other dtype is optional
    dec, dec_info = decode_points(src, model, tp, attn_kernel, peaks)
    pre, pre_info = prefill_points(src, model, tp, attn_kernel, peaks)
    ops["paged_decode"] = {"points": dec}
    ops["chunked_prefill"] = {"points": pre}
    tables = [src.table(*t) for t in (GEMM_TABLE, DECODE_TABLE, PREFILL_TABLE)]
    device_col = _read(tables[1], ["device"])["device"]
    device = str(device_col[0]) if device_col.size else src.system
    notes += [
        "latencies are aiconfigurator-core's single value per point (milliseconds in the tables), so "
        "t_p20 = t_p50 = t_p80",
        f"gemm: {gemm_dtype} rows of gemm_perf.parquet, log(FLOP/s) interpolated in log n x log k at each "
        "layer's per-GPU shape; from_nk lists the measured shapes used",
        f"paged_decode: generation_attention_perf.parquet, kernel {dec_info['kernel']}, context = isl + step; "
        f"{dec_info['filled_points']} points the sweep omits (large batch x long context) hold the same "
        "batch's rate at its longest measured context and are marked `filled`",
        f"chunked_prefill: context_attention_perf.parquet, kernel {pre_info['kernel']}, batch_size 1, prefix 0 "
        "only: the tables hold no prefill over a cached prefix, so kvsim prices a chunk with one at the "
        "prefix-0 rate of the same chunk plus the prefix's pairs at the best measured rate (or its KV "
        "bytes at the batch-1 decode rate if longer), and warns that share of busy time",
        "not imported: all-reduce/communication tables (kvsim prices all-reduce analytically), host <-> "
        "device copies (not in the tables), MoE/MLA tables",
    ]
    source = f"aiconfigurator-core {src.package_version} {src.system}/{src.backend}/{src.version}"
    return {
        "schema": SCHEMA,
        "version": VERSION,
        "kind": "measured",
        "backend": "cuda",
        "source": source,
        "device": {
            "name": f"{device} (aiconfigurator {src.system})",
            "memory_bytes": int(gpu["mem_capacity"]) if gpu.get("mem_capacity") else None,
            "driver": None,
            "cuda": None,
        },
        "peaks": peaks,
        "torch": None,
        "triton": None,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": None,
        "model": {
            "name": model.name,
            "num_layers": model.num_layers,
            **{k: int(getattr(model, k)) for k in MODEL_SHAPE_KEYS},
        },
        "tp": tp,
        "kv_formats": sorted({p["format"] for p in dec}),
        "calibration": {
            "import": "aiconfigurator",
            "system": src.system,
            "backend": src.backend,
            "version": src.version,
            "model": model.name,
            "tp": tp,
            "gemm_dtype": gemm_dtype,
            "attn_kernel": attn_kernel,
        },
        "provenance": {
            "package": DIST,
            "package_version": src.package_version,
            "license": LICENSE,
            "publisher": "NVIDIA (ai-dynamo/aiconfigurator)",
            "system": src.system,
            "framework": src.backend,
            "framework_version": src.version,
            "device_in_tables": device,
            "tables": {src.rel(p): _sha256(p) for p in tables},
            "decode_kernel": dec_info["kernel"],
            "decode_kernels_at_shape": dec_info["kernels_at_shape"],
            "prefill_kernel": pre_info["kernel"],
            "prefill_kernels_at_shape": pre_info["kernels_at_shape"],
            "latency_unit_in_tables": "ms",
        },
        "notes": notes,
        "ops": ops,
        # Every op the tables hold was imported; `copy` is absent by nature, not by interruption.
        "complete": True,
    }

"""The measured profile's file format (schema ``kvsim-profile`` v1.2): reading and validation, shared
by the profile cost model and the calibrator. Any defect is one `KvsimError` naming the file and field.

Versions: ``version`` is the major version (a reader refuses a newer one), ``minor_version`` (absent:
0) counts backward-compatible additions, which a reader of an older minor version ignores: 1.1 added
the optional ops ``h2o_accumulate``, ``h2o_select``, ``compact_kv`` and ``kv_write`` (token eviction
and quantize-on-write), 1.2 ``step_rest`` (a step's work besides GEMMs and attention: per part
``layer``, ``embed`` and ``sample``, all three required, over tokens) and ``step_overhead`` (the
serving loop's own time per step, over rows; no work, its time is priced as it is). An optional op's
points of one label must be listed by increasing counts, and a 1.2 op needs ``minor_version`` >= 2.

Every field the cost model reads is checked: per op, each point's grid coordinates are present,
numeric and positive (`OP_COORDS`), no two points share coordinates (two timings of one shape would
be used without a word), times are ordered p20 <= p50 <= p80 within `TIME_BOUNDS_S`, and the work a
rate is computed from (FLOPs or bytes) is positive, with the implied rate below `MAX_RATE`. Strict
JSON: NaN, Infinity and a key given twice are refused."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from kvsim.errors import KvsimError
from kvsim.spec.formats import FormatKind
from kvsim.spec.jsonfile import JsonError
from kvsim.spec.jsonfile import loads as json_loads
from kvsim.spec.models import ModelSpec
from kvsim.spec.schema import shorten, show

SCHEMA = "kvsim-profile"
VERSION = 1
MINOR_VERSION = 2  # 1: the optional eviction and quantize-on-write ops; 2: step_rest, step_overhead
TIME_KEYS = ("t_p20", "t_p50", "t_p80")
GEMM_LAYERS = ("qkv", "o", "gate_up", "down")
TOP_FIELDS = ("schema", "version", "kind", "backend", "device", "model", "tp", "ops", "complete")
MODEL_SHAPE_KEYS = ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size")
GEMM_ALL_LAYERS = (*GEMM_LAYERS, "lm_head")
# Grid coordinates per op: (name, kind) with kind "label" (a string) or "size" (a number > 0; a
# "count" is an integer > 0, "offset" an integer >= 0). "gemm_fp8" and other gemm_* ops share gemm's.
OP_COORDS: dict[str, tuple[tuple[str, str], ...]] = {
    "gemm": (("layer", "label"), ("m", "count")),
    "paged_decode": (("format", "label"), ("batch", "count"), ("context", "count")),
    "chunked_prefill": (("format", "label"), ("chunk", "count"), ("prefix", "offset")),
    "copy": (("link", "label"), ("nbytes", "count")),
    "h2o_accumulate": (("format", "label"), ("batch", "count"), ("context", "count")),
    "h2o_select": (("tokens", "count"),),
    "compact_kv": (("format", "label"), ("tokens", "count")),
    "kv_write": (("format", "label"), ("tokens", "count")),
    "step_rest": (("part", "label"), ("tokens", "count")),
    "step_overhead": (("rows", "count"),),
}
# What a point's "format" label starts with (`KVFormat.name`: bf16, int8/g64, fp8_e4m3/per_tensor);
# the cost model picks a scenario's format's points by its full name, else by this kind.
FORMAT_KINDS = tuple(k.value for k in FormatKind)
# Ops a profile may lack (the cost model prices them analytically then, or not at all for the 1.2
# ones, as before they were measured); minor version 1 added the first four, 2 the step's rest.
KV_OPS = ("h2o_accumulate", "h2o_select", "compact_kv", "kv_write")  # 1.1
OPTIONAL_OPS = (*KV_OPS, "step_rest", "step_overhead")
# The minor version that added an op, where a profile holding it must declare at least that one
# (the 1.1 ops predate the check: 1.1 profiles without minor_version exist).
OP_MINOR = {"step_rest": 2, "step_overhead": 2}
# step_rest's parts: one layer's elementwise work over tokens, the step's embedding lookup over
# tokens, the sampling of rows (`validate.model.step_rest`); a profile with the op has all three.
STEP_REST_PARTS = ("layer", "embed", "sample")
# The work each op's rate is computed from (FLOP/s for GEMMs and prefill, bytes/s for the rest).
OP_WORK: dict[str, str | None] = {
    "gemm": "flops",
    "paged_decode": "bytes",
    "chunked_prefill": "flops",
    "copy": "bytes",
    **dict.fromkeys((*KV_OPS, "step_rest"), "bytes"),
    "step_overhead": None,  # a fixed time per call: no work, the time itself is priced
}
# 1 ns is about two GPU clock cycles, below any timed kernel launch (~2-5 us); 1 h is no single op.
TIME_BOUNDS_S = (1e-9, 3600.0)
# Achieved-rate ceilings, about 20x the fastest preset (B200: 4.5 PFLOP/s dense FP8, 8 TB/s HBM;
# kvsim/spec/hardware.py): a rate above them is a unit mistake, not a measurement.
MAX_RATE = {"flops": 1e17, "bytes": 1.6e14}
# Scenario GPU preset prefix -> substring of torch.cuda.get_device_name().
GPU_NAME_HINTS = {"h100": "H100", "h200": "H200", "a100": "A100", "b200": "B200", "l40s": "L40S"}


# ---- loading and validation ---------------------------------------------------------------------
def load_profile(path: str | Path) -> dict[str, Any]:
    """Read and validate a profile file; any defect -> one-line `KvsimError` naming file and field."""
    p = Path(path)
    src = str(p)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KvsimError(f"cannot read profile: {shorten(str(exc), 120)}", source=src) from None
    try:
        data = json_loads(text)
    except JsonError as exc:
        where = f"line {exc.line}" if exc.line else None
        raise KvsimError(exc.message, source=src, path=where) from None
    validate_profile(data, source=src)
    assert isinstance(data, dict)  # validate_profile refuses anything else
    return data


def validate_profile(data: Any, *, source: str) -> None:
    def err(path: str, msg: str) -> KvsimError:
        return KvsimError(msg, source=source, path=path)

    if not isinstance(data, dict):
        raise err("", "expected a JSON object at the top level")
    if data.get("schema") != SCHEMA:
        raise err("schema", f"expected {SCHEMA!r}, got {show(data.get('schema'))}")
    version = data.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise err("version", f"expected a positive integer, got {show(version)}")
    if version > VERSION:
        raise err("version", f"version {version} is newer than this kvsim reads ({VERSION}); upgrade kvsim")
    minor = data.get("minor_version", 0)
    if not _is_int(minor) or minor < 0:
        raise err("minor_version", f"expected an integer >= 0, got {show(minor)}")
    for key in TOP_FIELDS:
        if key not in data:
            raise err(key, "missing field")
    if data["kind"] not in ("measured", "analytic"):
        raise err("kind", f"expected 'measured' or 'analytic', got {show(data['kind'])}")
    if data["backend"] not in ("cuda", "cpu"):
        raise err("backend", f"expected 'cuda' or 'cpu', got {show(data['backend'])}")
    if not isinstance(data["device"], dict) or not isinstance(data["device"].get("name"), str):
        raise err("device.name", "missing device name")
    model = data["model"]
    if not isinstance(model, dict):
        raise err("model", "expected an object")
    for key in ("name", *MODEL_SHAPE_KEYS):
        if key not in model:
            raise err(f"model.{key}", "missing field")
    for key in MODEL_SHAPE_KEYS:
        v = model[key]
        if not _is_int(v) or v < 1:
            raise err(f"model.{key}", f"expected a positive integer, got {show(v)}")
    if not _is_int(data["tp"]) or data["tp"] < 1:
        raise err("tp", f"expected a positive integer, got {show(data['tp'])}")
    ops = data["ops"]
    if not isinstance(ops, dict):
        raise err("ops", "expected an object")
    for op, body in ops.items():
        _validate_op(str(op), body, err)
        need = OP_MINOR.get(str(op))
        if need is not None and minor < need:
            raise err(
                "minor_version",
                f"ops.{op} was added in schema {VERSION}.{need}, the profile declares {VERSION}.{minor}; "
                f"set minor_version to {need} or more",
            )
    if "step_rest" in ops:
        parts = {p.get("part") for p in ops["step_rest"]["points"]}
        for part in STEP_REST_PARTS:
            if part not in parts:
                raise err(
                    "ops.step_rest.points",
                    f"no points for part {part!r} (it needs {', '.join(STEP_REST_PARTS)})",
                )
        other = sorted(str(x) for x in parts - set(STEP_REST_PARTS))
        if other:
            raise err(
                "ops.step_rest.points", f"unknown part {other[0]!r}; expected {', '.join(STEP_REST_PARTS)}"
            )
    if not isinstance(data["complete"], bool):
        raise err("complete", f"expected true or false, got {show(data['complete'])}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _validate_op(op: str, body: Any, err: Any) -> None:
    """One op's points: coordinates, uniqueness, times and work (see the module docstring)."""
    pts = body.get("points") if isinstance(body, dict) else None
    if not isinstance(pts, list) or not pts:
        raise err(f"ops.{op}.points", "expected a non-empty list of points")
    family = "gemm" if op.startswith("gemm") else op
    coords = OP_COORDS.get(family, ())
    work = OP_WORK.get(family)
    lo_t, hi_t = TIME_BOUNDS_S
    seen: dict[tuple[Any, ...], int] = {}
    last: dict[Any, tuple[Any, ...]] = {}  # optional ops: each label's previous sizes
    for i, pt in enumerate(pts):
        where = f"ops.{op}.points[{i}]"
        if not isinstance(pt, dict):
            raise err(where, "expected an object")
        for field in (*TIME_KEYS, "bytes", "flops"):
            v: Any = pt.get(field)
            if not _is_num(v):
                raise err(f"{where}.{field}", f"expected a number, got {show(v)}")
            if field in TIME_KEYS and not lo_t <= v <= hi_t:
                raise err(f"{where}.{field}", f"time must be in [{lo_t:g}, {hi_t:g}] s, got {show(v)}")
            if v < 0:
                raise err(f"{where}.{field}", f"must be >= 0, got {show(v)}")
        if not pt["t_p20"] <= pt["t_p50"] <= pt["t_p80"]:
            raise err(f"{where}.t_p50", "percentiles out of order: expected t_p20 <= t_p50 <= t_p80")
        if work is not None:
            if pt[work] <= 0:
                raise err(
                    f"{where}.{work}",
                    f"must be > 0 (the {op} rate is {work} per second), got {show(pt[work])}",
                )
            rate = pt[work] / pt["t_p50"]
            if rate > MAX_RATE[work]:
                raise err(
                    f"{where}.t_p50",
                    f"implies {rate:.3g} {work}/s, above any GPU ({MAX_RATE[work]:.3g}); check the units",
                )
        key_values: list[Any] = []
        for name, kind in coords:
            v = pt.get(name)
            if kind == "label":
                ok = isinstance(v, str) and bool(v) and (family != "gemm" or v in GEMM_ALL_LAYERS)
                want = f"one of {', '.join(GEMM_ALL_LAYERS)}" if family == "gemm" else "a name"
            else:
                ok = _is_int(v) and (v >= 1 if kind == "count" else v >= 0)
                want = "a positive integer" if kind == "count" else "an integer >= 0"
            if not ok:
                raise err(f"{where}.{name}", f"expected {want}, got {show(v)}")
            if name == "format" and v.split("/")[0] not in FORMAT_KINDS:
                # A point no scenario's format can select would be silently ignored: refused.
                raise err(
                    f"{where}.{name}",
                    f"no KV format {show(v)}: expected a kind ({', '.join(FORMAT_KINDS)}), as in bf16 or int8/g64",
                )
            key_values.append(v)
        if coords:
            key = tuple(key_values)
            if key in seen:
                shape = ", ".join(f"{n}={shorten(str(v), 30)}" for (n, _), v in zip(coords, key, strict=True))
                raise err(where, f"same {shape} as points[{seen[key]}]; one timing per shape")
            seen[key] = i
        if op in OPTIONAL_OPS:
            _check_rising(coords, key_values, last, where, err)


def _check_rising(
    coords: tuple[tuple[str, str], ...],
    values: list[Any],
    last: dict[Any, tuple[Any, ...]],
    where: str,
    err: Any,
) -> None:
    """Within one label (format), the points' counts rise: (batch, context) or tokens, in order."""
    label = tuple(v for (_, kind), v in zip(coords, values, strict=True) if kind == "label")
    sizes = tuple(v for (_, kind), v in zip(coords, values, strict=True) if kind != "label")
    prev = last.get(label)
    if prev is not None and sizes <= prev:
        names = [n for n, kind in coords if kind != "label"]
        at = next(d for d in range(len(sizes)) if sizes[d] != prev[d]) if sizes != prev else len(sizes) - 1
        whose = "points of one format" if label else "points"
        raise err(
            f"{where}.{names[at]}",
            f"{names[at]} {sizes[at]} after {prev[at]}: {whose} must be listed by increasing {', '.join(names)}",
        )
    last[label] = sizes


# ---- scenario entry point -----------------------------------------------------------------------
def gpu_matches(device_name: str, backend: str, gpu_preset: str) -> bool:
    """Whether a profile's device is the scenario's GPU; a CPU profile never is."""
    if backend != "cuda":
        return False
    prefix = gpu_preset.lower().rstrip("*").split("-")[0]
    hint = GPU_NAME_HINTS.get(prefix, prefix.upper())
    return hint.lower() in device_name.lower()


def model_shapes(model: ModelSpec) -> dict[str, int]:
    return {k: int(getattr(model, k)) for k in MODEL_SHAPE_KEYS}

"""The measured profile's file format (schema ``kvsim-profile`` v1): reading and validation, shared by
the profile cost model and the calibrator. Any defect is one `KvsimError` naming the file and field."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kvsim.errors import KvsimError
from kvsim.spec.models import ModelSpec

SCHEMA = "kvsim-profile"
VERSION = 1
TIME_KEYS = ("t_p20", "t_p50", "t_p80")
GEMM_LAYERS = ("qkv", "o", "gate_up", "down")
TOP_FIELDS = ("schema", "version", "kind", "backend", "device", "model", "tp", "ops", "complete")
MODEL_SHAPE_KEYS = ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size")
# Scenario GPU preset prefix -> substring of torch.cuda.get_device_name().
GPU_NAME_HINTS = {"h100": "H100", "h200": "H200", "a100": "A100", "b200": "B200", "l40s": "L40S"}


# ---- loading and validation ---------------------------------------------------------------------
def load_profile(path: str | Path) -> dict[str, Any]:
    """Read and validate a profile file; any defect -> one-line `KvsimError` naming file and field."""
    p = Path(path)
    src = str(p)
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise KvsimError(f"cannot read profile: {exc}", source=src) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise KvsimError(f"invalid JSON: {exc.msg}", source=src, path=f"line {exc.lineno}") from None
    validate_profile(data, source=src)
    assert isinstance(data, dict)  # validate_profile refuses anything else
    return data


def validate_profile(data: Any, *, source: str) -> None:
    def err(path: str, msg: str) -> KvsimError:
        return KvsimError(msg, source=source, path=path)

    if not isinstance(data, dict):
        raise err("", "expected a JSON object at the top level")
    if data.get("schema") != SCHEMA:
        raise err("schema", f"expected {SCHEMA!r}, got {data.get('schema')!r}")
    version = data.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise err("version", f"expected a positive integer, got {version!r}")
    if version > VERSION:
        raise err("version", f"version {version} is newer than this kvsim reads ({VERSION}); upgrade kvsim")
    for key in TOP_FIELDS:
        if key not in data:
            raise err(key, "missing field")
    if data["kind"] not in ("measured", "analytic"):
        raise err("kind", f"expected 'measured' or 'analytic', got {data['kind']!r}")
    if data["backend"] not in ("cuda", "cpu"):
        raise err("backend", f"expected 'cuda' or 'cpu', got {data['backend']!r}")
    if not isinstance(data["device"], dict) or not isinstance(data["device"].get("name"), str):
        raise err("device.name", "missing device name")
    model = data["model"]
    if not isinstance(model, dict):
        raise err("model", "expected an object")
    for key in ("name", *MODEL_SHAPE_KEYS):
        if key not in model:
            raise err(f"model.{key}", "missing field")
    if not isinstance(data["tp"], int) or data["tp"] < 1:
        raise err("tp", f"expected a positive integer, got {data['tp']!r}")
    ops = data["ops"]
    if not isinstance(ops, dict):
        raise err("ops", "expected an object")
    for op, body in ops.items():
        pts = body.get("points") if isinstance(body, dict) else None
        if not isinstance(pts, list) or not pts:
            raise err(f"ops.{op}.points", "expected a non-empty list of points")
        for i, pt in enumerate(pts):
            if not isinstance(pt, dict):
                raise err(f"ops.{op}.points[{i}]", "expected an object")
            for key in (*TIME_KEYS, "bytes", "flops"):
                v = pt.get(key)
                if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                    raise err(f"ops.{op}.points[{i}].{key}", f"expected a number, got {v!r}")
                if key in TIME_KEYS and v <= 0:
                    raise err(f"ops.{op}.points[{i}].{key}", f"time must be positive, got {v!r}")
    if not isinstance(data["complete"], bool):
        raise err("complete", f"expected true or false, got {data['complete']!r}")


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

"""Check a calibrated profile's token-eviction and quantize-on-write ops (schema 1.1) end to end.

For each of ``h2o_accumulate``, ``h2o_select``, ``compact_kv`` and ``kv_write`` it prints the
measured points (seconds, GB/s, % of the HBM peak when the profile knows it), then loads the
profile into the cost model for an H2O scenario in each KV format the profile covers (Llama-3.1-8B on
the profile's GPU, or forced onto an H200 for a CPU profile) and prints what it prices against the
analytic model: a decode step's score accumulation (16 sequences x 4096 tokens), a trim (4096
tokens scored, 1024 moved, 64 block-table entries) and the quantize-on-write of 256 new tokens.
Exits 1, naming it, when an op is missing or the cost model still prices one analytically (for a
lossy format; a bf16 cache has no quantize-on-write). Needs no simpy, torch or GPU:

    python bench/check_profile_kv_ops.py PROFILE.json [--out RESULT.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from kvsim.core.eviction import EvictionWork
from kvsim.costs.profile import load_profile_cost_model
from kvsim.costs.profile_schema import KV_OPS, load_profile
from kvsim.errors import KvsimError
from kvsim.spec.formats import format_from_name
from kvsim.spec.scenario import scenario_from_dict

H2O = {"policy": "h2o", "heavy_ratio": 0.2, "recent_tokens": 64, "pages": "physical"}
WORK = EvictionWork(trims=1, select_tokens=4096, moved_tokens=1024, table_entries=64)
SEQS, CONTEXT, NEW_TOKENS = 16, 4096, 256
GPU_BY_NAME = (("H100", "h100-sxm"), ("H200", "h200-sxm"), ("A100", "a100-80gb"), ("B200", "b200"))


def _points(prof: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    peak = (prof.get("peaks") or {}).get("bw_bytes_per_s")
    out: dict[str, list[dict[str, Any]]] = {}
    for op in KV_OPS:
        rows = []
        for p in prof["ops"].get(op, {}).get("points", []):
            gbps = p["bytes"] / p["t_p50"] / 1e9
            shape = {k: p[k] for k in ("format", "batch", "context", "tokens") if k in p}
            rows.append(
                {
                    **shape,
                    "t_p50_s": p["t_p50"],
                    "gb_per_s": gbps,
                    "pct_hbm": 1e11 * gbps / peak if peak else None,
                }
            )
        out[op] = rows
    return out


def _kv_fields(name: str) -> dict[str, Any]:
    """A profile's format name ("int8/g64") as the scenario's ``kv`` fields."""
    f = format_from_name(name)
    out: dict[str, Any] = {"format": f.kind.value}
    if f.group_size:
        out["group_size"] = f.group_size
    if f.kind.value == "fp8_e4m3":
        out["scale"] = f.scale.value
    if f.outlier_fraction:
        out["outlier_fraction"] = f.outlier_fraction
    return out


def _priced(path: Path, prof: dict[str, Any], fmt: str) -> dict[str, Any]:
    name = str(prof["device"]["name"])
    gpu = next((g for hint, g in GPU_BY_NAME if hint in name), "h200-sxm")
    sc = scenario_from_dict(
        {
            "model": prof["model"]["name"],
            "cluster": {"gpu": gpu, "gpus_per_node": 1, "tensor_parallel": prof["tp"]},
            "workload": {"synthetic": {"num_requests": 1, "rate": 1}},
            "kv": {**_kv_fields(fmt), "eviction": H2O},
            "cost_model": {"kind": "profile", "profile": str(path), "force": prof["backend"] != "cuda"},
        },
        source="check_profile_kv_ops",
        base_dir=Path.cwd(),
    )
    cm = load_profile_cost_model(sc)
    a = cm.analytic
    tokens = np.array([SEQS * (CONTEXT + 1.0)])
    score = float(cm._score_time(SEQS, tokens, np.log(tokens / SEQS))[0])
    trim = cm.eviction_price(WORK)
    return {
        "format": fmt,
        "gpu": gpu,
        "score_s": {"profile": score, "analytic": float(a.decode_score_time(tokens)[0])},
        "trim_s": {
            "profile": trim.seconds,
            "analytic": a.eviction_time(WORK),
            "off_grid": sorted(trim.off_grid),
        },
        "write_s": {"profile": cm._write_time(NEW_TOKENS), "analytic": a._write_time(NEW_TOKENS)},
        "analytic_notes": [n for n in cm.warnings() if "priced by the analytic model" in n],
        "lossy": sc.kv.format.lossy,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("profile", type=Path)
    p.add_argument("--out", type=Path, help="write the result as JSON here")
    args = p.parse_args(argv)
    try:
        prof = load_profile(args.profile)
        result = {"profile": str(args.profile), "points": _points(prof)}
        formats = [str(f) for f in prof.get("kv_formats") or ["bf16"]]
        result["priced"] = [_priced(args.profile, prof, f) for f in formats]
    except KvsimError as exc:
        print(f"check_profile_kv_ops: error: {exc}", file=sys.stderr)
        return 2
    problems = [f"{op}: no points" for op, rows in result["points"].items() if not rows]
    for r in result["priced"]:
        problems += [f"{r['format']}: {n}" for n in r["analytic_notes"]]
    for op, rows in result["points"].items():
        for row in rows:
            pct = f" ({row['pct_hbm']:.0f}% of HBM peak)" if row["pct_hbm"] is not None else ""
            shape = ", ".join(
                f"{k}={v}" for k, v in row.items() if k in ("format", "batch", "context", "tokens")
            )
            print(f"{op:15s} {shape:38s} {row['t_p50_s'] * 1e6:10.1f} us {row['gb_per_s']:8.2f} GB/s{pct}")
    for r in result["priced"]:
        for key, label in (("score_s", "score/step"), ("trim_s", "trim"), ("write_s", "write")):
            v = r[key]
            print(
                f"{r['format']:9s} {label:10s} profile {v['profile'] * 1e3:9.4f} ms   analytic {v['analytic'] * 1e3:9.4f} ms"
            )
    result["problems"] = problems
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    for line in problems:
        print(f"check_profile_kv_ops: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

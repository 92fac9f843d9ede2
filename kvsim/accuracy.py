"""Accuracy estimates for lossy KV formats: cited figures, never measured by the simulator.

A simulator cannot measure model quality. For each lossy format kvsim shows (a) what the literature
and the design documents claim, with the source, and (b) the relative RMS error of the attention
output that kvsim's own kernels produce on synthetic K/V with outlier channels
(`kvsim/data/format_error.json`, written by ``python -m kernels.accuracy``): a numerical
indication, not a task-accuracy number.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from kvsim.spec.formats import FormatKind, KVFormat

LITERATURE: dict[FormatKind, list[dict[str, str]]] = {
    FormatKind.FP8_E4M3: [
        {
            "claim": "FP8 KV cache keeps 99.5% of original accuracy (Meta, Llama 4 evaluation)",
            "source": "design documents 000, section 3.2",
        },
    ],
    FormatKind.INT8: [
        {
            "claim": "group-wise INT8 KV quantization is nearly lossless",
            "source": "design documents 003, 'KV Cache INT8量化'",
        },
    ],
    FormatKind.INT4: [
        {
            "claim": "INT4 KV cache costs 0.3% accuracy on Llama 70B with 75% memory saved",
            "source": "design documents 003, 'KV Cache INT4量化'",
        },
    ],
    FormatKind.KVQUANT4: [
        {
            "claim": "dense-and-sparse non-uniform quantization with about 1% fp16 outliers: under 0.1 "
            "perplexity loss at 3 bits",
            "source": "KVQuant (Hooper et al., 2024)",
        },
        {
            "claim": "below 500K tokens FP8 suffices; beyond, switch to INT4 + 1% fp16 outliers",
            "source": "design documents 000, section 7.3 (a recommendation, not a measurement)",
        },
    ],
}


def _kernel_errors() -> dict[str, Any]:
    try:
        text = resources.files("kvsim").joinpath("data/format_error.json").read_text()
    except (FileNotFoundError, OSError):
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return data if isinstance(data, dict) else {}


def accuracy_note(fmt: KVFormat, note: str | None) -> dict[str, Any] | None:
    """The report's accuracy section for a lossy format (None for fp16/bf16)."""
    if not fmt.lossy:
        return None
    errors = _kernel_errors()
    entry = errors.get(fmt.name) if isinstance(errors.get(fmt.name), dict) else None
    return {
        "format": fmt.name,
        "note": note,
        "estimate_only": True,
        "kernel_rel_rms": entry.get("attn_out_rel_rms") if entry else None,
        "kernel_method": errors.get("method"),
        "literature": LITERATURE.get(fmt.kind, []),
    }

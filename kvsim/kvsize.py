"""The memory table of the design documents: KV per sequence and per batch, weights, fit.

Pure arithmetic over `ModelSpec` and `KVFormat`; the CLI renders it as a rich table or JSON.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvsim.spec.formats import KVFormat
from kvsim.spec.hardware import GPUSpec
from kvsim.spec.models import ModelSpec


@dataclass(frozen=True)
class KVSizeRow:
    format: str
    context: int
    batch: int
    bytes_per_token: int
    kv_bytes_per_sequence: int
    total_bytes: int  # KV of the whole batch
    weight_bytes: int
    memory_needed_bytes: int  # weights + KV
    gpu_memory_bytes: int  # all GPUs together
    fits: bool
    compression_vs_fp16: float


def kv_size_rows(
    model: ModelSpec,
    formats: list[KVFormat],
    contexts: list[int],
    *,
    batch: int,
    gpu: GPUSpec,
    num_gpus: int,
) -> list[KVSizeRow]:
    from kvsim.spec.formats import make_format

    fp16 = make_format("fp16")[0]
    rows = []
    for fmt in formats:
        for ctx in contexts:
            per_seq = model.kv_bytes(ctx, fmt) + model.kv_static_bytes(fmt)
            total = per_seq * batch
            need = model.weight_bytes + total
            mem = gpu.hbm_bytes * num_gpus
            rows.append(
                KVSizeRow(
                    format=fmt.name,
                    context=ctx,
                    batch=batch,
                    bytes_per_token=model.kv_bytes_per_token(fmt),
                    kv_bytes_per_sequence=per_seq,
                    total_bytes=total,
                    weight_bytes=model.weight_bytes,
                    memory_needed_bytes=need,
                    gpu_memory_bytes=mem,
                    fits=need <= mem,
                    compression_vs_fp16=model.kv_bytes_per_token(fp16) / model.kv_bytes_per_token(fmt),
                )
            )
    return rows


def rows_to_json(model: ModelSpec, rows: list[KVSizeRow], notes: list[str]) -> dict[str, object]:
    first = rows[0]
    return {
        "model": model.name,
        "attention": model.attention.value,
        "params": model.num_params,
        "active_params": model.num_active_params,
        "bytes_per_token": first.bytes_per_token,
        "total_bytes": first.total_bytes,
        "kv_bytes_per_sequence": first.kv_bytes_per_sequence,
        "weight_bytes": first.weight_bytes,
        "fits": first.fits,
        "rows": [asdict(r) for r in rows],
        "notes": notes,
    }

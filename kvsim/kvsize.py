"""The memory table of the design documents: KV per sequence and per batch, weights, fit.

Pure arithmetic over `ModelSpec` and `KVFormat`; the CLI renders it as a rich table or JSON. Fit is
judged per GPU, tensor-parallel over the GPUs (a TP rank's share of GQA heads, all of an MLA latent
on every rank), not on the GPUs' memory pooled. With
a MoE layout (``--attention``, ``--ep``: `kvsim.spec.parallel`) also the memory of one GPU: its
weights as the layout places them and the batch's KV on the busiest GPU (all of each sequence's MLA
latent on every TP rank, a TP rank's share of GQA heads; under DP attention whole sequences,
ceil(batch / dp) of them on one GPU). With ``--pp`` / ``--cp`` (pipeline and context parallelism)
the busiest stage's weights and 1 / (PP x CP) of each sequence's TP share of KV on each GPU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvsim.spec.formats import KVFormat
from kvsim.spec.hardware import GPUSpec
from kvsim.spec.models import ModelSpec
from kvsim.spec.parallel import ParallelLayout, weight_bytes_per_gpu


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
    memory_needed_per_gpu_bytes: int  # one GPU under TP over the GPUs: its weights and KV share
    fits: bool  # on every GPU (per GPU, not pooled: an MLA latent sits on every TP rank)
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
    weights_gpu = weight_bytes_per_gpu(model, num_gpus, None)
    share = model.kv_share(num_gpus)
    rows = []
    for fmt in formats:
        for ctx in contexts:
            per_seq = model.kv_bytes(ctx, fmt) + model.kv_static_bytes(fmt)
            total = per_seq * batch
            need = model.weight_bytes + total
            mem = gpu.hbm_bytes * num_gpus
            need_gpu = weights_gpu + int(total * share)
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
                    memory_needed_per_gpu_bytes=need_gpu,
                    fits=need_gpu <= gpu.hbm_bytes,
                    compression_vs_fp16=model.kv_bytes_per_token(fp16) / model.kv_bytes_per_token(fmt),
                )
            )
    return rows


@dataclass(frozen=True)
class GPUMemoryRow:
    """One GPU of a replica under a layout: weights, the batch's KV on the busiest GPU, and fit."""

    format: str
    context: int
    weight_bytes_per_gpu: int
    kv_bytes_per_gpu: int
    memory_needed_bytes_per_gpu: int
    hbm_bytes_per_gpu: int
    fits: bool


def gpu_memory_rows(
    model: ModelSpec, rows: list[KVSizeRow], *, gpu: GPUSpec, num_gpus: int, layout: ParallelLayout
) -> list[GPUMemoryRow]:
    """`rows` per GPU of one replica of `num_gpus` GPUs under `layout` (see the module docstring)."""
    weights = weight_bytes_per_gpu(model, num_gpus, layout)
    dp = layout.attention_dp(num_gpus)
    share = 1.0 if dp > 1 else model.kv_share(num_gpus)
    share /= layout.stages_or_ranks  # PP: a stage's layers; CP: a rank's shard of each sequence
    out = []
    for r in rows:
        kv = int(-(-r.batch // dp) * r.kv_bytes_per_sequence * share)
        need = weights + kv
        out.append(GPUMemoryRow(r.format, r.context, weights, kv, need, gpu.hbm_bytes, need <= gpu.hbm_bytes))
    return out


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

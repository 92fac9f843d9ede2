"""Block moves in the paged pool: gather/scatter to a contiguous staging buffer, copy-on-write.

What it models: the data movement behind swapping (vLLM ``swap_blocks``: gather a preempted
sequence's blocks into a contiguous staging buffer, then one DMA to pinned host memory, and the
reverse) and copy-on-write of shared prefix blocks (vLLM ``copy_blocks``: src -> dst pairs). Every
format's block is one row of the pool (`kernels.kv_cache`), so a block moves as ``row_bytes``
bytes, copied as 32-bit words, K and V and all their metadata at once. A pool may be one layer
``[num_blocks, row_bytes]`` or all layers ``[num_layers, num_blocks, row_bytes]`` (see
`allocate_layers`); either way one launch moves every listed block of every layer.

Left out: the host side of a swap other than one ``copy_`` to/from a pinned buffer (`swap_out` /
`swap_in`), and overlapping copies with compute (streams are the caller's business).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_cache import ROW_ALIGN_BYTES


@triton.jit
def _gather_rows_kernel(
    src_ptr,
    dst_ptr,
    src_idx_ptr,
    dst_idx_ptr,
    num_src_rows,  # rows per layer in src
    num_dst_rows,  # rows per layer in dst
    words,  # 32-bit words per row
    HAS_SRC_IDX: tl.constexpr,
    HAS_DST_IDX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """dst[layer, dst_idx[i]] = src[layer, src_idx[i]] (an absent index list means i)."""
    i = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    if HAS_SRC_IDX:
        s = tl.load(src_idx_ptr + i).to(tl.int64)
    else:
        s = i.to(tl.int64)
    if HAS_DST_IDX:
        t = tl.load(dst_idx_ptr + i).to(tl.int64)
    else:
        t = i.to(tl.int64)
    w = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = w < words
    x = tl.load(src_ptr + (layer * num_src_rows + s) * words + w, mask=mask)
    tl.store(dst_ptr + (layer * num_dst_rows + t) * words + w, x, mask=mask)


def _as_words(pool: torch.Tensor, name: str) -> torch.Tensor:
    """uint8 [L, rows, row_bytes] or [rows, row_bytes] -> contiguous int32 [L, rows, row_bytes/4]."""
    if pool.dtype != torch.uint8 or pool.dim() not in (2, 3):
        raise ValueError(
            f"{name} must be uint8 [num_blocks, row_bytes] or [num_layers, num_blocks, row_bytes], "
            f"got {pool.dtype} {list(pool.shape)}"
        )
    if not pool.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {pool.stride()}")
    if pool.shape[-1] % ROW_ALIGN_BYTES:
        raise ValueError(f"{name} row_bytes must be a multiple of 16, got {pool.shape[-1]}")
    if pool.data_ptr() % 4:
        raise ValueError(f"{name} must start 4-byte aligned")
    p3 = pool if pool.dim() == 3 else pool.unsqueeze(0)
    return p3.view(torch.int32)


def _check_ids(ids: torch.Tensor, name: str, device: torch.device) -> None:
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be a 1-D int32/int64 tensor, got {ids.dtype} {list(ids.shape)}")
    if ids.numel() > 1 and ids.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got stride {ids.stride()}")
    if ids.device != device:
        raise ValueError(f"{name} is on {ids.device}, the pool on {device}")


def _launch(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_idx: torch.Tensor | None,
    dst_idx: torch.Tensor | None,
    n: int,
    block: int,
) -> None:
    if n == 0:
        return
    layers, words = src.shape[0], src.shape[2]
    dummy = src_idx if src_idx is not None else dst_idx
    grid = (n, layers, triton.cdiv(words, block))
    _gather_rows_kernel[grid](
        src, dst, src_idx if src_idx is not None else dummy, dst_idx if dst_idx is not None else dummy,
        src.shape[1], dst.shape[1], words,
        HAS_SRC_IDX=src_idx is not None, HAS_DST_IDX=dst_idx is not None, BLOCK=block,
    )  # fmt: skip


def gather_blocks(
    pool: torch.Tensor,
    block_ids: torch.Tensor,
    staging: torch.Tensor | None = None,
    *,
    block: int = 1024,
) -> torch.Tensor:
    """staging[l, i] = pool[l, block_ids[i]], one launch. pool: [L,] num_blocks, row_bytes uint8;
    block_ids: [n] int; staging: [L,] n, row_bytes uint8 on the pool's device (allocated when
    None). Returns staging."""
    src = _as_words(pool, "pool")
    _check_ids(block_ids, "block_ids", pool.device)
    n = block_ids.shape[0]
    if staging is None:
        staging = torch.empty((*pool.shape[:-2], n, pool.shape[-1]), dtype=torch.uint8, device=pool.device)
    dst = _as_words(staging, "staging")
    if dst.shape[0] != src.shape[0] or dst.shape[1] != n or dst.shape[2] != src.shape[2]:
        raise ValueError(
            f"staging must be {[*pool.shape[:-2], n, pool.shape[-1]]}, got {list(staging.shape)}"
        )
    if staging.device != pool.device:
        raise ValueError(f"staging is on {staging.device}, the pool on {pool.device}")
    _launch(src, dst, block_ids, None, n, block)
    return staging


def scatter_blocks(
    pool: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor, *, block: int = 1024
) -> None:
    """pool[l, block_ids[i]] = staging[l, i], one launch (block_ids distinct)."""
    dst = _as_words(pool, "pool")
    src = _as_words(staging, "staging")
    _check_ids(block_ids, "block_ids", pool.device)
    n = block_ids.shape[0]
    if src.shape[0] != dst.shape[0] or src.shape[1] != n or src.shape[2] != dst.shape[2]:
        raise ValueError(
            f"staging must be {[*pool.shape[:-2], n, pool.shape[-1]]}, got {list(staging.shape)}"
        )
    if staging.device != pool.device:
        raise ValueError(f"staging is on {staging.device}, the pool on {pool.device}")
    _launch(src, dst, None, block_ids, n, block)


def copy_blocks(pool: torch.Tensor, block_mapping: torch.Tensor, *, block: int = 1024) -> None:
    """Copy-on-write: pool[l, dst] = pool[l, src] for each row (src, dst) of block_mapping [n, 2]
    int, one launch. Destinations must be distinct and never a source of the same call."""
    words = _as_words(pool, "pool")
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be [n, 2] (src, dst), got {list(block_mapping.shape)}")
    src_ids = block_mapping[:, 0].contiguous()
    dst_ids = block_mapping[:, 1].contiguous()
    _check_ids(src_ids, "block_mapping", pool.device)
    _launch(words, words, src_ids, dst_ids, block_mapping.shape[0], block)


def swap_out(
    pool: torch.Tensor, block_ids: torch.Tensor, host: torch.Tensor, *, non_blocking: bool = True
) -> None:
    """Gather blocks on the device, then one copy into ``host`` ([L,] n, row_bytes uint8, pinned
    for an asynchronous DMA)."""
    host.copy_(gather_blocks(pool, block_ids), non_blocking=non_blocking)


def swap_in(
    pool: torch.Tensor, block_ids: torch.Tensor, host: torch.Tensor, *, non_blocking: bool = True
) -> None:
    """One copy of ``host`` to the device, then scatter into ``block_ids``."""
    staging = host.to(pool.device, non_blocking=non_blocking)
    scatter_blocks(pool, block_ids, staging)


def gather_blocks_ref(pool: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Torch reference of `gather_blocks`."""
    return pool[..., block_ids.long(), :].clone()


def scatter_blocks_ref(pool: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor) -> None:
    """Torch reference of `scatter_blocks`."""
    pool[..., block_ids.long(), :] = staging


def copy_blocks_ref(pool: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Torch reference of `copy_blocks`."""
    m = block_mapping.long()
    pool[..., m[:, 1], :] = pool[..., m[:, 0], :]


def make_inputs(
    num_blocks: int,
    row_bytes: int,
    num_moved: int,
    *,
    num_layers: int = 1,
    device: str = "cpu",
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """A random pool [num_layers, num_blocks, row_bytes], ``block_ids`` [num_moved] and a
    CoW ``block_mapping`` [num_moved, 2] with distinct, non-source destinations."""
    if row_bytes % ROW_ALIGN_BYTES or 2 * num_moved > num_blocks:
        raise ValueError("need row_bytes % 16 == 0 and 2 * num_moved <= num_blocks")
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randint(0, 256, (num_layers, num_blocks, row_bytes), generator=gen)
    perm = torch.randperm(num_blocks, generator=gen)
    return {
        "pool": pool.to(torch.uint8).to(device),
        "block_ids": perm[:num_moved].to(device),
        "block_mapping": torch.stack((perm[:num_moved], perm[num_moved : 2 * num_moved]), 1).to(device),
    }

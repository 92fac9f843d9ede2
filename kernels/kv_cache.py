"""Paged KV cache of one attention layer, stored in the exact byte layouts of `kvsim.spec.formats`.

What it models: a block pool ``[num_blocks, row_bytes]`` (uint8) in which each row is one block of
``block_size`` tokens and holds every per-token plane of K and of V (values, group scales and zero
points, kvquant4 scales and outliers). Each plane is a strided view
``[num_blocks, block_size, num_kv_heads, row]``, so the attention kernels see the usual paged layout
``[num_blocks, block_size, num_kv_heads, head_dim]`` for K and V, while block copy, swap and
copy-on-write move whole rows with one launch. Planes with 2-byte elements come first so that every
view is aligned; a row is padded to a multiple of 16 bytes (at most 15 bytes per block, which is not
per-token storage and is not counted by ``bytes_per_vector``).

Per token, per KV head, K and V each (``G = ceil(head_dim / group_size)``,
``N = ceil(outlier_fraction * head_dim)``):

- fp16 / bf16: ``data`` [head_dim] of that dtype.
- fp8_e4m3: ``data`` [head_dim] float8_e4m3fn; static fp32 ``fp8_scale`` [1] or [num_kv_heads].
- int8: ``scale`` [G] fp16, ``zero`` [G] fp16, ``data`` [head_dim] uint8 codes (x = q*scale+zero).
- int4: as int8 with ``data`` [ceil(head_dim/2)] uint8, element i in byte i//2, low nibble first.
- kvquant4: ``scale`` [1] fp16, ``outlier_val`` [N] fp16, ``outlier_idx`` [N] int16,
  ``data`` [ceil(head_dim/2)] uint8 packed codebook indices; static ``codebook`` [num_kv_heads, 16]
  fp16. x = codebook[idx] * scale, then outlier positions take their fp16 value.

Also here: the torch reference quantizers/dequantizers every kernel is tested against, the NF4
default codebook and a Lloyd-Max codebook fit, and `load_kv_tile`, the Triton dequantizing tile
loader shared by the attention kernels.

Left out: multi-layer block tables (one pool per layer; `allocate_layers` stacks them), per-channel
(pre-RoPE) key scaling from KVQuant, and dynamic fp8 scales (scales are static, set by calibration).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvsim.errors import KvsimError
from kvsim.spec.formats import FormatKind, KVFormat, ScaleGranularity, format_from_name

FMT_FP16, FMT_BF16, FMT_FP8, FMT_INT8, FMT_INT4, FMT_KVQ4 = 0, 1, 2, 3, 4, 5
FMT_CODES = {
    FormatKind.FP16: FMT_FP16,
    FormatKind.BF16: FMT_BF16,
    FormatKind.FP8_E4M3: FMT_FP8,
    FormatKind.INT8: FMT_INT8,
    FormatKind.INT4: FMT_INT4,
    FormatKind.KVQUANT4: FMT_KVQ4,
}
FP8_MAX = 448.0  # largest finite float8_e4m3fn
CODEBOOK_ENTRIES = 16
ROW_ALIGN_BYTES = 16

# QLoRA's NormalFloat-4 levels (Dettmers et al., 2023): quantiles of N(0, 1) scaled to [-1, 1].
NF4_CODEBOOK = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip

SIDES = ("k", "v")


def resolve_format(fmt: KVFormat | str) -> KVFormat:
    """A `KVFormat`, or its name as `KVFormat.name` spells it ("int4/g64", "fp8_e4m3/per_head",
    "kvquant4/1.0%") or a bare `make_format` name ("fp16"). Raises ValueError naming the input."""
    if isinstance(fmt, KVFormat):
        return fmt
    if not isinstance(fmt, str):
        raise ValueError(f"format must be a KVFormat or a format name, got {fmt!r}")
    try:
        return format_from_name(fmt)
    except KvsimError as exc:
        raise ValueError(exc.message) from None


@dataclass(frozen=True)
class PlaneSpec:
    """One per-token plane: ``row`` elements of ``dtype`` per token and KV head."""

    name: str
    dtype: torch.dtype
    row: int


@dataclass(frozen=True)
class CacheSpec:
    """Shape and format of one layer's paged cache. Raises ValueError on bad sizes."""

    fmt: KVFormat
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.head_dim > 32767:
            raise ValueError(f"head_dim must fit int16 outlier indices, got {self.head_dim}")

    @property
    def code(self) -> int:
        return FMT_CODES[self.fmt.kind]

    @property
    def group_size(self) -> int:
        """Group size along head_dim for int8/int4 (head_dim otherwise, unused)."""
        return self.fmt.group_size if self.code in (FMT_INT8, FMT_INT4) else self.head_dim

    @property
    def num_groups(self) -> int:
        return math.ceil(self.head_dim / self.group_size)

    @property
    def packed_dim(self) -> int:
        """Bytes of packed 4-bit values per vector (int4, kvquant4)."""
        return math.ceil(self.head_dim / 2)

    @property
    def num_outliers(self) -> int:
        return self.fmt.outliers_per_vector(self.head_dim)

    @property
    def fp8_per_head(self) -> bool:
        return self.code == FMT_FP8 and self.fmt.scale is ScaleGranularity.PER_HEAD

    def planes(self) -> list[PlaneSpec]:
        """Per-token planes of one side (K or V), in storage order."""
        d, c = self.head_dim, self.code
        if c == FMT_FP16:
            return [PlaneSpec("data", torch.float16, d)]
        if c == FMT_BF16:
            return [PlaneSpec("data", torch.bfloat16, d)]
        if c == FMT_FP8:
            return [PlaneSpec("data", torch.float8_e4m3fn, d)]
        if c in (FMT_INT8, FMT_INT4):
            g = self.num_groups
            values = d if c == FMT_INT8 else self.packed_dim
            return [
                PlaneSpec("scale", torch.float16, g),
                PlaneSpec("zero", torch.float16, g),
                PlaneSpec("data", torch.uint8, values),
            ]
        planes = [PlaneSpec("scale", torch.float16, 1)]
        if self.num_outliers:
            planes += [
                PlaneSpec("outlier_val", torch.float16, self.num_outliers),
                PlaneSpec("outlier_idx", torch.int16, self.num_outliers),
            ]
        return [*planes, PlaneSpec("data", torch.uint8, self.packed_dim)]

    def layout(self) -> tuple[list[tuple[str, PlaneSpec, int]], int]:
        """[(side, plane, byte offset within a block row)], row_bytes. 2-byte planes first."""
        entries, offset = [], 0
        per_block = self.block_size * self.num_kv_heads
        for elsize in (2, 1):
            for side in SIDES:
                for plane in self.planes():
                    if plane.dtype.itemsize == elsize:
                        entries.append((side, plane, offset))
                        offset += per_block * plane.row * elsize
        row_bytes = -(-offset // ROW_ALIGN_BYTES) * ROW_ALIGN_BYTES
        return entries, row_bytes

    @property
    def row_bytes(self) -> int:
        return self.layout()[1]


@dataclass
class KVPlanes:
    """The tensors of one side (K or V). Per-token planes are views into the pool."""

    data: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim or packed_dim]
    scale: torch.Tensor | None = None  # int: [NB, BS, H, G] fp16; kvquant4: [NB, BS, H, 1] fp16
    zero: torch.Tensor | None = None  # int: [NB, BS, H, G] fp16
    outlier_val: torch.Tensor | None = None  # kvquant4: [NB, BS, H, N] fp16
    outlier_idx: torch.Tensor | None = None  # kvquant4: [NB, BS, H, N] int16
    fp8_scale: torch.Tensor | None = None  # fp8: [1] or [num_kv_heads] fp32 (static)
    codebook: torch.Tensor | None = None  # kvquant4: [num_kv_heads, 16] fp16 (static)

    def per_token(self) -> dict[str, torch.Tensor]:
        names = ("scale", "zero", "outlier_val", "outlier_idx", "data")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


@dataclass
class PagedKVCache:
    """One layer's paged K/V cache. Build with `PagedKVCache.allocate`."""

    spec: CacheSpec
    pool: torch.Tensor  # [num_blocks, row_bytes] uint8
    k: KVPlanes
    v: KVPlanes

    @classmethod
    def allocate(
        cls,
        fmt: KVFormat | str,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str = "cpu",
        *,
        pool: torch.Tensor | None = None,
        k_fp8_scale: torch.Tensor | None = None,
        v_fp8_scale: torch.Tensor | None = None,
        k_codebook: torch.Tensor | None = None,
        v_codebook: torch.Tensor | None = None,
    ) -> PagedKVCache:
        """Zeroed cache. fp8 scales default to 1.0, kvquant4 codebooks to NF4 for every head.

        ``pool`` may be given ([num_blocks, row_bytes] uint8, rows 16-byte aligned) to place the
        cache in existing memory, e.g. one layer of `allocate_layers`.
        """
        spec = CacheSpec(resolve_format(fmt), num_blocks, block_size, num_kv_heads, head_dim)
        entries, row_bytes = spec.layout()
        if pool is None:
            pool = torch.zeros(num_blocks, row_bytes, dtype=torch.uint8, device=device)
        if pool.dtype != torch.uint8 or tuple(pool.shape) != (num_blocks, row_bytes):
            raise ValueError(
                f"pool must be uint8 [{num_blocks}, {row_bytes}], got {pool.dtype} {list(pool.shape)}"
            )
        if pool.stride(1) != 1 or pool.stride(0) % ROW_ALIGN_BYTES:
            raise ValueError(f"pool rows must be contiguous and 16-byte aligned: {pool.stride()}")
        device = pool.device
        views: dict[str, dict[str, torch.Tensor]] = {s: {} for s in SIDES}
        per_block = block_size * num_kv_heads
        for side, plane, offset in entries:
            nbytes = per_block * plane.row * plane.dtype.itemsize
            view = pool[:, offset : offset + nbytes].view(plane.dtype)
            views[side][plane.name] = view.unflatten(1, (block_size, num_kv_heads, plane.row))
        static: dict[str, dict[str, torch.Tensor]] = {s: {} for s in SIDES}
        if spec.code == FMT_FP8:
            n = num_kv_heads if spec.fp8_per_head else 1
            for side, given in (("k", k_fp8_scale), ("v", v_fp8_scale)):
                t = torch.ones(n) if given is None else given
                if t.numel() != n:
                    raise ValueError(f"{side}_fp8_scale needs {n} values, got {list(t.shape)}")
                static[side]["fp8_scale"] = t.reshape(n).to(device, torch.float32).contiguous()
        if spec.code == FMT_KVQ4:
            for side, given in (("k", k_codebook), ("v", v_codebook)):
                t = torch.tensor(NF4_CODEBOOK).repeat(num_kv_heads, 1) if given is None else given
                if tuple(t.shape) != (num_kv_heads, CODEBOOK_ENTRIES):
                    raise ValueError(f"{side}_codebook must be [{num_kv_heads}, 16], got {list(t.shape)}")
                static[side]["codebook"] = t.to(device, torch.float16).contiguous()
        k = KVPlanes(**views["k"], **static["k"])
        v = KVPlanes(**views["v"], **static["v"])
        return cls(spec=spec, pool=pool, k=k, v=v)

    @property
    def device(self) -> torch.device:
        return self.pool.device

    def side(self, name: str) -> KVPlanes:
        return self.k if name == "k" else self.v

    def bytes_per_token_per_head(self, side: str) -> int:
        """Bytes one token of one KV head takes in the per-token planes of ``side``."""
        s = self.spec
        total = sum(t.numel() * t.element_size() for t in self.side(side).per_token().values())
        assert total % (s.num_blocks * s.block_size * s.num_kv_heads) == 0
        return total // (s.num_blocks * s.block_size * s.num_kv_heads)


def allocate_layers(
    fmt: KVFormat | str,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, list[PagedKVCache]]:
    """A [num_layers, num_blocks, row_bytes] pool and one cache view per layer, so a block id
    names the same row in every layer and `block_copy` can move all layers in one launch."""
    spec = CacheSpec(resolve_format(fmt), num_blocks, block_size, num_kv_heads, head_dim)
    pool = torch.zeros(num_layers, num_blocks, spec.row_bytes, dtype=torch.uint8, device=device)
    caches = [
        PagedKVCache.allocate(spec.fmt, num_blocks, block_size, num_kv_heads, head_dim, pool=p) for p in pool
    ]
    return pool, caches


# --------------------------------------------------------------------------------------------
# Torch references: quantize [T, H, D] vectors into per-token planes, and back.


def fp8_e4m3_encode_ref(y: torch.Tensor) -> torch.Tensor:
    """Saturating float -> float8_e4m3fn (round to nearest even), returned as its uint8 bits."""
    return y.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def _group_pad(x: torch.Tensor, group: int, fill: float) -> torch.Tensor:
    """[T, H, D] -> [T, H, G, group], the last group padded with ``fill``."""
    d = x.shape[-1]
    g = math.ceil(d / group)
    padded = torch.nn.functional.pad(x, (0, g * group - d), value=fill)
    return padded.unflatten(-1, (g, group))


def quantize_ref(
    x: torch.Tensor,
    spec: CacheSpec,
    fp8_scale: torch.Tensor | None = None,
    codebook: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Quantize K or V vectors x [T, H, D] into per-token planes {name: [T, H, row]}.

    int8/int4: per group, scale = fp16((max - min) / qmax), zero = fp16(min),
    q = clamp(floor((x - zero) / scale + 0.5), 0, qmax) (scale 0 is taken as 1).
    kvquant4: the N largest |x| (first index on ties) are kept as fp16 outliers; scale =
    fp16(max |x| over the rest); idx = nearest codebook entry (first on ties) to x / scale.
    """
    c, d = spec.code, spec.head_dim
    x = x.float()
    if c == FMT_FP16:
        return {"data": x.to(torch.float16)}
    if c == FMT_BF16:
        return {"data": x.to(torch.bfloat16)}
    if c == FMT_FP8:
        assert fp8_scale is not None
        sc = fp8_scale.float().reshape(1, -1, 1)
        return {"data": fp8_e4m3_encode_ref(x / sc).view(torch.float8_e4m3fn)}
    if c in (FMT_INT8, FMT_INT4):
        qmax = 255.0 if c == FMT_INT8 else 15.0
        mn = _group_pad(x, spec.group_size, math.inf).amin(-1)  # [T, H, G]
        mx = _group_pad(x, spec.group_size, -math.inf).amax(-1)
        scale = ((mx - mn) / qmax).to(torch.float16)
        zero = mn.to(torch.float16)
        sf = scale.float()
        sf = torch.where(sf > 0, sf, torch.ones_like(sf))
        s_e = sf.repeat_interleave(spec.group_size, -1)[..., :d]
        z_e = zero.float().repeat_interleave(spec.group_size, -1)[..., :d]
        q = torch.floor((x - z_e) / s_e + 0.5).clamp(0, qmax).to(torch.uint8)
        data = q if c == FMT_INT8 else pack_nibbles(q)
        return {"scale": scale, "zero": zero, "data": data}
    assert codebook is not None
    n = spec.num_outliers
    a = x.abs()
    used = torch.zeros_like(x, dtype=torch.bool)
    idx_list, val_list = [], []
    for _ in range(n):
        idx = torch.where(used, -1.0, a).argmax(-1, keepdim=True)  # first max
        idx_list.append(idx)
        val_list.append(x.gather(-1, idx))
        used.scatter_(-1, idx, True)
    rest = torch.where(used, 0.0, a).amax(-1, keepdim=True)  # [T, H, 1]
    scale = rest.to(torch.float16)
    sf = scale.float()
    sf = torch.where(sf > 0, sf, torch.ones_like(sf))
    u = x / sf
    cb = codebook.float()[None, :, None, :]  # [1, H, 1, 16]
    codes = (u[..., None] - cb).abs().argmin(-1).to(torch.uint8)  # first min
    planes = {"scale": scale}
    if n:
        planes["outlier_val"] = torch.cat(val_list, -1).to(torch.float16)
        planes["outlier_idx"] = torch.cat(idx_list, -1).to(torch.int16)
    planes["data"] = pack_nibbles(codes)
    return planes


def dequantize_ref(
    planes: dict[str, torch.Tensor],
    spec: CacheSpec,
    fp8_scale: torch.Tensor | None = None,
    codebook: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token planes {name: [T, H, row]} -> fp32 vectors [T, H, D]."""
    c, d = spec.code, spec.head_dim
    data = planes["data"]
    if c in (FMT_FP16, FMT_BF16):
        return data.float()
    if c == FMT_FP8:
        assert fp8_scale is not None
        return data.float() * fp8_scale.float().reshape(1, -1, 1)
    if c in (FMT_INT8, FMT_INT4):
        q = data.float() if c == FMT_INT8 else unpack_nibbles(data, d).float()
        s = planes["scale"].float().repeat_interleave(spec.group_size, -1)[..., :d]
        z = planes["zero"].float().repeat_interleave(spec.group_size, -1)[..., :d]
        return q * s + z
    assert codebook is not None
    codes = unpack_nibbles(data, d).long()  # [T, H, D]
    cb = codebook.float()  # [H, 16]
    heads = torch.arange(cb.shape[0], device=codes.device)[None, :, None]
    x = cb[heads, codes] * planes["scale"].float()
    if spec.num_outliers:
        x = x.scatter(-1, planes["outlier_idx"].long(), planes["outlier_val"].float())
    return x


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 [..., D] -> bytes [..., ceil(D/2)], element i in byte i//2, low first."""
    if q.shape[-1] % 2:
        q = torch.nn.functional.pad(q, (0, 1))
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_nibbles(b: torch.Tensor, d: int) -> torch.Tensor:
    """Inverse of `pack_nibbles`: bytes [..., ceil(D/2)] -> uint8 codes [..., D]."""
    lo, hi = b & 15, b >> 4
    return torch.stack((lo, hi), -1).flatten(-2)[..., :d]


def slot_coords(spec: CacheSpec, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot ids -> (block, offset), vLLM's slot = block * block_size + offset."""
    slots = slots.long()
    return slots // spec.block_size, slots % spec.block_size


def write_slots_ref(
    cache: PagedKVCache, side: str, slots: torch.Tensor, planes: dict[str, torch.Tensor]
) -> None:
    """Store per-token planes {name: [T, H, row]} into ``slots`` [T]; slot -1 is skipped."""
    keep = slots >= 0
    blk, off = slot_coords(cache.spec, slots[keep])
    for name, tensor in cache.side(side).per_token().items():
        tensor[blk, off] = planes[name][keep].to(tensor.dtype)


def read_slots_ref(cache: PagedKVCache, side: str, slots: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token planes {name: [T, H, row]} of ``slots`` [T] (all valid)."""
    blk, off = slot_coords(cache.spec, slots)
    return {name: t[blk, off] for name, t in cache.side(side).per_token().items()}


def dequantize_slots_ref(cache: PagedKVCache, side: str, slots: torch.Tensor) -> torch.Tensor:
    """fp32 [T, H, D] values stored at ``slots`` [T]."""
    planes = cache.side(side)
    return dequantize_ref(read_slots_ref(cache, side, slots), cache.spec, planes.fp8_scale, planes.codebook)


def sequence_slots(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Slots of positions 0..length-1 of one sequence, from its block table row [max_blocks]."""
    pos = torch.arange(length, device=block_table.device)
    return block_table.long()[pos // block_size] * block_size + pos % block_size


def fit_codebook(
    x: torch.Tensor, num_outliers: int, iters: int = 30, max_samples: int = 1 << 16
) -> torch.Tensor:
    """Lloyd-Max 16-level codebook per KV head for kvquant4, fitted on calibration vectors.

    x: [T, H, D]. Each vector is normalised as `quantize_ref` does (outliers removed, divided by
    the max |x| of the rest), so levels live in [-1, 1]; the end levels are pinned to -1 and 1 so
    the extremes are exact. Returns [H, 16] fp16, sorted ascending.
    """
    x = x.float()
    a = x.abs()
    used = torch.zeros_like(x, dtype=torch.bool)
    for _ in range(num_outliers):
        used.scatter_(-1, torch.where(used, -1.0, a).argmax(-1, keepdim=True), True)
    rest = torch.where(used, 0.0, a).amax(-1, keepdim=True).clamp_min(1e-12)
    u = (x / rest).transpose(0, 1)  # [H, T, D]
    books = []
    gen = torch.Generator().manual_seed(0)
    for h in range(x.shape[1]):
        vals = u[h][~used.transpose(0, 1)[h]].flatten().cpu()
        if vals.numel() > max_samples:
            vals = vals[torch.randperm(vals.numel(), generator=gen)[:max_samples]]
        levels = torch.tensor(NF4_CODEBOOK)
        for _ in range(iters):
            assign = (vals[:, None] - levels[None, :]).abs().argmin(-1)
            sums = torch.zeros(16).index_add_(0, assign, vals)
            counts = torch.zeros(16).index_add_(0, assign, torch.ones_like(vals))
            new = torch.where(counts > 0, sums / counts.clamp_min(1), levels)
            new[0], new[-1] = -1.0, 1.0
            levels = new.sort().values
        books.append(levels)
    return torch.stack(books).to(x.device, torch.float16)


# --------------------------------------------------------------------------------------------
# Triton: one dequantized tile of K or V, shared by paged_decode, chunked_prefill and h2o.


def side_args(cache: PagedKVCache, side: str) -> list[object]:
    """Kernel arguments for `load_kv_tile` / quantize-on-write: 7 pointers and 5 block strides.

    Absent planes are replaced by the data plane; the format's constexpr branches never read them.
    """
    p = cache.side(side)
    dummy = p.data
    tensors = [
        p.data,
        p.scale if p.scale is not None else dummy,
        p.zero if p.zero is not None else dummy,
        p.outlier_val if p.outlier_val is not None else dummy,
        p.outlier_idx if p.outlier_idx is not None else dummy,
        p.fp8_scale if p.fp8_scale is not None else dummy,
        p.codebook if p.codebook is not None else dummy,
    ]
    return tensors + [t.stride(0) for t in tensors[:5]]


def format_constexprs(spec: CacheSpec) -> dict[str, int]:
    """The compile-time format parameters every kernel over the cache takes."""
    return {
        "FMT": spec.code,
        "GROUP": spec.group_size,
        "NG": spec.num_groups,
        "PD": spec.packed_dim,
        "NOUT": spec.num_outliers,
        "FP8_PER_HEAD": int(spec.fp8_per_head),
    }


@triton.jit
def load_kv_tile(
    data_ptr,
    scale_ptr,
    zero_ptr,
    oval_ptr,
    oidx_ptr,
    fp8s_ptr,
    cb_ptr,
    s_data,
    s_scale,
    s_zero,
    s_oval,
    s_oidx,
    blk,  # [BLOCK_N] int64 physical block of each token
    off,  # [BLOCK_N] offset within the block
    tok_mask,  # [BLOCK_N] valid tokens
    h,  # KV head
    d,  # [BLOCK_D] arange
    H,
    D,
    FMT: tl.constexpr,
    GROUP: tl.constexpr,
    NG: tl.constexpr,
    PD: tl.constexpr,
    NOUT: tl.constexpr,
    FP8_PER_HEAD: tl.constexpr,
):
    """[BLOCK_N, BLOCK_D] fp32 tile of dequantized K or V; masked entries are 0."""
    row = off.to(tl.int64) * H + h  # [BLOCK_N] (token, head) row within its block
    dmask = d < D
    m2 = tok_mask[:, None] & dmask[None, :]
    if FMT <= 2:  # fp16, bf16, fp8
        ptrs = data_ptr + (blk * s_data + row * D)[:, None] + d[None, :]
        x = tl.load(ptrs, mask=m2, other=0.0).to(tl.float32)
        if FMT == 2:
            x = x * tl.load(fp8s_ptr + h * FP8_PER_HEAD)
    elif FMT <= 4:  # int8, int4: q * scale + zero per group
        if FMT == 3:
            ptrs = data_ptr + (blk * s_data + row * D)[:, None] + d[None, :]
            q = tl.load(ptrs, mask=m2, other=0).to(tl.float32)
        else:
            ptrs = data_ptr + (blk * s_data + row * PD)[:, None] + (d // 2)[None, :]
            byte = tl.load(ptrs, mask=m2, other=0).to(tl.int32)
            q = ((byte >> ((d % 2) * 4)[None, :]) & 15).to(tl.float32)
        meta = (row * NG)[:, None] + (d // GROUP)[None, :]
        s = tl.load(scale_ptr + (blk * s_scale)[:, None] + meta, mask=m2, other=0.0)
        z = tl.load(zero_ptr + (blk * s_zero)[:, None] + meta, mask=m2, other=0.0)
        x = q * s.to(tl.float32) + z.to(tl.float32)
    else:  # kvquant4: codebook[idx] * scale, then the fp16 outliers
        ptrs = data_ptr + (blk * s_data + row * PD)[:, None] + (d // 2)[None, :]
        byte = tl.load(ptrs, mask=m2, other=0).to(tl.int32)
        code = (byte >> ((d % 2) * 4)[None, :]) & 15
        x = tl.load(cb_ptr + h * 16 + code, mask=m2, other=0.0).to(tl.float32)
        s = tl.load(scale_ptr + blk * s_scale + row, mask=tok_mask, other=0.0).to(tl.float32)
        x = x * s[:, None]
        for j in tl.static_range(NOUT):
            oi = tl.load(oidx_ptr + blk * s_oidx + row * NOUT + j, mask=tok_mask, other=-1)
            ov = tl.load(oval_ptr + blk * s_oval + row * NOUT + j, mask=tok_mask, other=0.0)
            x = tl.where(d[None, :] == oi.to(tl.int32)[:, None], ov.to(tl.float32)[:, None], x)
    return tl.where(m2, x, 0.0)

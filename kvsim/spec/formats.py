"""KV-cache storage formats and their exact bytes per stored element, metadata included.

A format says how one K or V vector of ``head_dim`` elements (one token, one KV head, one layer) is
stored. ``bytes_per_vector(head_dim)`` counts everything that grows with the number of tokens:
packed values, per-token group scales and zero points, per-token outlier values with their indices.
Metadata that does not grow with tokens (per-tensor or per-head fp8 scales, 4-bit codebooks) is
``static_bytes_per_layer`` and is reported separately: it is a few KiB per model.

Layouts (the Triton kernels in ``kernels/`` store exactly these, and a test checks the byte counts):

- ``fp16`` / ``bf16``: 2 bytes per element.
- ``fp8_e4m3``: 1 byte per element; one fp32 scale per layer for K and for V (``per_tensor``) or
  one per KV head (``per_head``).
- ``int8`` / ``int4``: asymmetric group-wise along ``head_dim``, per token: values packed (int4: two
  per byte, low nibble first), and per group one fp16 scale and one fp16 zero point (4 bytes).
  A last group shorter than ``group_size`` still costs a full scale and zero.
- ``kvquant4``: KVQuant's dense-and-sparse scheme (Hooper et al., 2024): per token and KV head,
  ``ceil(outlier_fraction * head_dim)`` coordinates kept as fp16 values with int16 indices, all
  coordinates as 4-bit indices into a 16-entry non-uniform codebook (one fp16 codebook per layer
  and KV head for K and for V), and one fp16 scale. The design documents call this "TurboQuant";
  Google's TurboQuant (Zandieh et al., 2025) is a different, rotation-plus-scalar-codebook scheme,
  so the alias ``turboquant`` maps to ``kvquant4`` with a note saying so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from kvsim.errors import KvsimError
from kvsim.spec.schema import did_you_mean


class FormatKind(str, Enum):
    FP16 = "fp16"
    BF16 = "bf16"
    FP8_E4M3 = "fp8_e4m3"
    INT8 = "int8"
    INT4 = "int4"
    KVQUANT4 = "kvquant4"


class ScaleGranularity(str, Enum):
    PER_TENSOR = "per_tensor"
    PER_HEAD = "per_head"


ALIASES: dict[str, tuple[str, str | None]] = {
    "fp8": ("fp8_e4m3", None),
    "e4m3": ("fp8_e4m3", None),
    "float16": ("fp16", None),
    "half": ("fp16", None),
    "bfloat16": ("bf16", None),
    "turboquant": (
        "kvquant4",
        "'turboquant' is the design documents' name for outlier-aware non-uniform 4-bit, which is "
        "KVQuant's dense-and-sparse scheme; Google's TurboQuant (rotation + scalar codebook) is a "
        "different format",
    ),
}

CODEBOOK_ENTRIES = 16  # 4-bit indices
FP16_BYTES = 2
OUTLIER_INDEX_BYTES = 2  # int16 position within head_dim
GROUP_META_BYTES = 4  # fp16 scale + fp16 zero point per group


@dataclass(frozen=True)
class KVFormat:
    """One storage format with its parameters. Build with `make_format`."""

    kind: FormatKind
    group_size: int = 0  # int8/int4 only
    scale: ScaleGranularity = ScaleGranularity.PER_TENSOR  # fp8 only
    outlier_fraction: float = 0.0  # kvquant4 only

    @property
    def name(self) -> str:
        if self.kind in (FormatKind.INT8, FormatKind.INT4):
            return f"{self.kind.value}/g{self.group_size}"
        if self.kind is FormatKind.FP8_E4M3:
            return f"{self.kind.value}/{self.scale.value}"
        if self.kind is FormatKind.KVQUANT4:
            return f"{self.kind.value}/{self.outlier_fraction:.1%}"
        return self.kind.value

    @property
    def lossy(self) -> bool:
        return self.kind not in (FormatKind.FP16, FormatKind.BF16)

    @property
    def bits(self) -> int:
        return {"fp16": 16, "bf16": 16, "fp8_e4m3": 8, "int8": 8, "int4": 4, "kvquant4": 4}[self.kind.value]

    def outliers_per_vector(self, head_dim: int) -> int:
        if self.kind is not FormatKind.KVQUANT4:
            return 0
        return math.ceil(self.outlier_fraction * head_dim)

    def bytes_per_vector(self, head_dim: int) -> int:
        """Bytes one token's K (or V) vector of one KV head takes, per-token metadata included."""
        k = self.kind
        if k in (FormatKind.FP16, FormatKind.BF16):
            return 2 * head_dim
        if k is FormatKind.FP8_E4M3:
            return head_dim
        if k in (FormatKind.INT8, FormatKind.INT4):
            groups = math.ceil(head_dim / self.group_size)
            values = head_dim if k is FormatKind.INT8 else math.ceil(head_dim / 2)
            return values + groups * GROUP_META_BYTES
        # kvquant4: packed 4-bit indices + one fp16 scale + outliers (fp16 value + int16 index)
        n_out = self.outliers_per_vector(head_dim)
        return math.ceil(head_dim / 2) + FP16_BYTES + n_out * (FP16_BYTES + OUTLIER_INDEX_BYTES)

    def static_bytes_per_layer(self, num_kv_heads: int) -> int:
        """Metadata per layer that does not grow with tokens (K and V together)."""
        if self.kind is FormatKind.FP8_E4M3:
            per = 1 if self.scale is ScaleGranularity.PER_TENSOR else num_kv_heads
            return 2 * 4 * per
        if self.kind is FormatKind.KVQUANT4:
            return 2 * num_kv_heads * CODEBOOK_ENTRIES * FP16_BYTES
        return 0

    def compression_vs_fp16(self, head_dim: int) -> float:
        return 2 * head_dim / self.bytes_per_vector(head_dim)


def make_format(
    name: str,
    *,
    group_size: int = 64,
    scale: str = "per_tensor",
    outlier_fraction: float = 0.01,
) -> tuple[KVFormat, str | None]:
    """Resolve a format name (or alias) with its parameters; returns the format and any alias note.

    Raises `KvsimError` naming the allowed values for unknown names or bad parameters.
    """
    note = None
    key = name.strip().lower() if isinstance(name, str) else name
    if isinstance(key, str) and key in ALIASES:
        key, note = ALIASES[key]
    try:
        kind = FormatKind(key)
    except ValueError:
        allowed = ", ".join([k.value for k in FormatKind] + sorted(ALIASES))
        hint = (
            did_you_mean(key, [k.value for k in FormatKind] + sorted(ALIASES)) if isinstance(key, str) else ""
        )
        raise KvsimError(f"unknown KV format {name!r};{hint} expected one of: {allowed}") from None
    if kind in (FormatKind.INT8, FormatKind.INT4):
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
            raise KvsimError(f"group_size must be a positive integer, got {group_size!r}")
        if group_size % 2 and kind is FormatKind.INT4:
            raise KvsimError(f"int4 group_size must be even (two values per byte), got {group_size}")
    try:
        gran = ScaleGranularity(scale)
    except ValueError:
        raise KvsimError(f"unknown fp8 scale {scale!r}; expected per_tensor or per_head") from None
    if kind is FormatKind.KVQUANT4:
        if not isinstance(outlier_fraction, (int, float)) or not (0 <= outlier_fraction < 0.5):
            raise KvsimError(f"outlier_fraction must be in [0, 0.5), got {outlier_fraction!r}")
    return (
        KVFormat(
            kind=kind,
            group_size=group_size if kind in (FormatKind.INT8, FormatKind.INT4) else 0,
            scale=gran if kind is FormatKind.FP8_E4M3 else ScaleGranularity.PER_TENSOR,
            outlier_fraction=float(outlier_fraction) if kind is FormatKind.KVQUANT4 else 0.0,
        ),
        note,
    )


def format_from_name(name: str) -> KVFormat:
    """The inverse of `KVFormat.name`: "int4/g64", "fp8_e4m3/per_head", "kvquant4/1.0%", or a
    bare `make_format` name ("fp16", "fp8"). Raises `KvsimError` naming the input."""
    if not isinstance(name, str):
        raise KvsimError(f"expected a KV format name, got {name!r}")
    base, _, param = name.strip().lower().partition("/")
    kwargs: dict[str, object] = {}
    try:
        if param:
            if base in ("int8", "int4") and param.startswith("g"):
                kwargs["group_size"] = int(param[1:])
            elif base in ("fp8_e4m3", "fp8", "e4m3"):
                kwargs["scale"] = param
            elif base in ("kvquant4", "turboquant") and param.endswith("%"):
                kwargs["outlier_fraction"] = float(param[:-1]) / 100.0
            else:
                raise KvsimError(f"unknown parameter {param!r}")
        return make_format(base, **kwargs)[0]  # type: ignore[arg-type]
    except (KvsimError, ValueError) as exc:
        raise KvsimError(
            f"bad KV format {name!r}: {exc}; expected e.g. 'fp16', 'bf16', 'fp8_e4m3/per_tensor', "
            "'fp8_e4m3/per_head', 'int8/g64', 'int4/g32', 'kvquant4/1.0%'"
        ) from None


@dataclass(frozen=True)
class FormatMix:
    """Some KV heads stored in a second format (``kv.format_mix``): the design documents' "sensitive
    heads in INT8, the rest INT4" (000, section 3.3). ``heads`` of the model's KV heads (the
    requested ``share`` rounded to whole heads) use ``format``; the others use the cache's main
    format. Under tensor parallelism every GPU is assumed to hold the same split (its bytes per token
    are the model's mixed bytes times its share of heads)."""

    format: KVFormat
    share: float  # the requested share of KV heads, in [0, 1]
    heads: int  # KV heads in `format`, of the model's num_kv_heads
    num_kv_heads: int

    @property
    def fraction(self) -> float:
        """Share of KV heads (hence of cached vectors) in ``format``, after rounding to heads."""
        return self.heads / self.num_kv_heads

    @property
    def name(self) -> str:
        return f"{self.heads}/{self.num_kv_heads} heads {self.format.name}"


@dataclass(frozen=True)
class FormatSwitch:
    """``kv.format_switch``: a sequence's KV is re-quantized to ``format`` once its length passes
    ``after_tokens`` (the design documents' "FP8 below 500K tokens, outlier-aware 4-bit above",
    000 section 7.3); its later tokens are written in ``format`` (`kvsim.core.eviction`)."""

    after_tokens: int
    format: KVFormat

    @property
    def name(self) -> str:
        return f"{self.format.name} after {self.after_tokens:,} tokens"

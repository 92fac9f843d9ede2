"""Model specs: attention design, exact KV bytes per token, parameter counts and weight bytes.

Presets are data copied from each model's Hugging Face ``config.json`` (named beside each one); a
user can point at any ``config.json`` instead. What is modelled: MHA/MQA/GQA (by ``num_kv_heads``),
MLA (a latent of ``kv_lora_rank + qk_rope_head_dim`` per layer), sliding-window layers (with global
"sink" tokens kept), cross-layer KV sharing (``kv_layer_group`` layers share one KV), dense and MoE
FFNs (total and active parameters). Left out: vision towers, multi-token-prediction heads
(DeepSeek-V3's MTP module is not counted: 671B total, as DeepSeek reports), LoRA adapters.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any

from kvsim.errors import KvsimError
from kvsim.spec.formats import FormatMix, KVFormat
from kvsim.spec.jsonfile import JsonError
from kvsim.spec.jsonfile import loads as json_loads
from kvsim.spec.schema import shorten, show


class Attention(str, Enum):
    MHA = "mha"
    MQA = "mqa"
    GQA = "gqa"
    MLA = "mla"


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "float8_e4m3fn": 1, "int4": 0.5}


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, as far as memory and cost are concerned. Units in names."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_context: int
    tie_embeddings: bool = False
    qkv_bias: bool = False
    weight_dtype: str = "bfloat16"
    # MLA (DeepSeek-V2/V3): the cache holds kv_lora_rank + qk_rope_head_dim values per layer.
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    q_lora_rank: int = 0
    # Sliding window: `sliding_window_layers` layers keep only the last `sliding_window` tokens
    # plus `global_tokens` sink tokens; the rest attend to everything.
    sliding_window: int = 0
    sliding_window_layers: int = 0
    global_tokens: int = 0
    # Cross-layer KV sharing (e.g. CLA): each group of this many layers stores one K/V.
    kv_layer_group: int = 1
    # MoE: routed experts, experts per token, shared experts, expert width, dense leading layers.
    num_experts: int = 0
    experts_per_token: int = 0
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    first_dense_layers: int = 0
    source: str = ""
    config_path: Path | None = field(default=None, compare=False)  # the config.json read, if any

    # ---- attention design -------------------------------------------------------------------
    @property
    def attention(self) -> Attention:
        if self.kv_lora_rank:
            return Attention.MLA
        if self.num_kv_heads == self.num_heads:
            return Attention.MHA
        if self.num_kv_heads == 1:
            return Attention.MQA
        return Attention.GQA

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def kv_layers(self) -> int:
        """Layers that store their own K/V (cross-layer sharing divides them)."""
        return math.ceil(self.num_layers / self.kv_layer_group)

    @property
    def kv_vector_dim(self) -> int:
        """Elements per cached vector: head_dim, or the MLA latent width."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.attention is Attention.MLA else self.head_dim

    @property
    def kv_vectors_per_layer(self) -> int:
        """Cached vectors per token per layer: K and V per KV head, or one MLA latent."""
        return 1 if self.attention is Attention.MLA else 2 * self.num_kv_heads

    # ---- KV bytes -------------------------------------------------------------------------------
    def kv_bytes_per_token_layer(self, fmt: KVFormat, mix: FormatMix | None = None) -> int:
        """Bytes one token adds to one layer's cache; with a `FormatMix`, ``mix.heads`` KV heads'
        K and V vectors in ``mix.format`` and the others in `fmt`."""
        d = self.kv_vector_dim
        if mix is None or not mix.heads:
            return self.kv_vectors_per_layer * fmt.bytes_per_vector(d)
        rest = self.num_kv_heads - mix.heads
        return 2 * rest * fmt.bytes_per_vector(d) + 2 * mix.heads * mix.format.bytes_per_vector(d)

    def kv_bytes_per_token(self, fmt: KVFormat, mix: FormatMix | None = None) -> int:
        """Bytes one token adds to the cache across all layers (no window cap applied)."""
        return self.kv_layers * self.kv_bytes_per_token_layer(fmt, mix)

    def kv_share(self, tp: int) -> float:
        """Share of each token's KV that one GPU of a tensor-parallel group holds: its
        ceil(kv_heads / tp) heads (vLLM pads), or all of MLA's latent (replicated on every rank).
        Lives here, below the memory plan and the cost seam, which both build on it
        (`kvsim.costs.work` prices with it)."""
        if self.attention is Attention.MLA:
            return 1.0
        return math.ceil(self.num_kv_heads / tp) / self.num_kv_heads

    def kv_static_bytes(self, fmt: KVFormat) -> int:
        heads = 1 if self.attention is Attention.MLA else self.num_kv_heads
        return self.kv_layers * fmt.static_bytes_per_layer(heads)

    def windowed_kv_layers(self) -> int:
        if not self.sliding_window:
            return 0
        return math.ceil(self.sliding_window_layers / self.kv_layer_group)

    def resident_tokens(self, context: int) -> float:
        """Layer-averaged tokens the cache must hold for one sequence of `context` tokens."""
        win = self.windowed_kv_layers()
        if not win:
            return float(context)
        capped = min(context, self.sliding_window + self.global_tokens)
        return ((self.kv_layers - win) * context + win * capped) / self.kv_layers

    def kv_bytes(self, context: int, fmt: KVFormat) -> int:
        """Exact KV bytes of one sequence of `context` tokens (window caps applied)."""
        per_layer = self.kv_bytes_per_token_layer(fmt)
        win = self.windowed_kv_layers()
        full = self.kv_layers - win
        capped = min(context, self.sliding_window + self.global_tokens) if win else 0
        return per_layer * (full * context + win * capped)

    # ---- parameters -----------------------------------------------------------------------------
    def attention_params_per_layer(self) -> int:
        h = self.hidden_size
        if self.attention is Attention.MLA:
            qk_head = self.qk_nope_head_dim + self.qk_rope_head_dim
            if self.q_lora_rank:
                q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * self.num_heads * qk_head
            else:
                q = h * self.num_heads * qk_head
            kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
            kv_b = self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
            o = self.num_heads * self.v_head_dim * h
            return q + kv_a + kv_b + o
        q = h * self.num_heads * self.head_dim
        kv = 2 * h * self.num_kv_heads * self.head_dim
        o = self.num_heads * self.head_dim * h
        bias = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim if self.qkv_bias else 0
        return q + kv + o + bias

    def _ffn_params(self, width: int) -> int:
        return 3 * self.hidden_size * width  # gated MLP: gate, up, down

    def _layer_params(self, active: bool) -> list[int]:
        out = []
        for i in range(self.num_layers):
            p = self.attention_params_per_layer() + 2 * self.hidden_size  # two RMSNorms
            if self.is_moe and i >= self.first_dense_layers:
                routed = self.experts_per_token if active else self.num_experts
                p += (routed + self.num_shared_experts) * self._ffn_params(self.moe_intermediate_size)
                p += self.hidden_size * self.num_experts  # router
            else:
                p += self._ffn_params(self.intermediate_size)
            out.append(p)
        return out

    def _embedding_params(self) -> int:
        emb = self.vocab_size * self.hidden_size
        return emb + (0 if self.tie_embeddings else emb) + self.hidden_size  # + final norm

    @property
    def num_params(self) -> int:
        return sum(self._layer_params(active=False)) + self._embedding_params()

    @property
    def num_active_params(self) -> int:
        """Parameters touched per token (MoE: routed experts per token + shared)."""
        return sum(self._layer_params(active=True)) + self._embedding_params()

    @property
    def weight_bytes_per_param(self) -> float:
        return DTYPE_BYTES[self.weight_dtype]

    @property
    def weight_bytes(self) -> int:
        return int(self.num_params * self.weight_bytes_per_param)

    def matmul_params_active(self) -> int:
        """Parameters in GEMMs per token (embeddings lookups excluded, LM head included)."""
        return self.num_active_params - self.vocab_size * self.hidden_size * (0 if self.tie_embeddings else 1)


@dataclass(frozen=True)
class TPShapes:
    """Per-GPU shapes of one layer under tensor parallelism (heads rounded up, as vLLM pads):
    the GEMMs' (n, k) per layer type, FLOPs = 2 m n k for m tokens. Dense GQA/MHA layers."""

    heads: int
    kv_heads: int
    head_dim: int
    gemm_nk: dict[str, tuple[int, int]]

    @staticmethod
    def of(m: ModelSpec, tp: int) -> TPShapes:
        heads, kv_heads = math.ceil(m.num_heads / tp), math.ceil(m.num_kv_heads / tp)
        inter = math.ceil(m.intermediate_size / tp)
        nk = {
            "qkv": ((heads + 2 * kv_heads) * m.head_dim, m.hidden_size),
            "o": (m.hidden_size, heads * m.head_dim),
            "gate_up": (2 * inter, m.hidden_size),
            "down": (m.hidden_size, inter),
            "lm_head": (math.ceil(m.vocab_size / tp), m.hidden_size),
        }
        return TPShapes(heads, kv_heads, m.head_dim, nk)


# ---- presets ------------------------------------------------------------------------------------
_HF = "Hugging Face config.json of "
PRESETS: dict[str, ModelSpec] = {
    "llama-3.1-8b": ModelSpec(
        name="llama-3.1-8b",
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        max_context=131072,
        source=_HF + "meta-llama/Llama-3.1-8B",
    ),
    "llama-3.1-70b": ModelSpec(
        name="llama-3.1-70b",
        num_layers=80,
        hidden_size=8192,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=28672,
        vocab_size=128256,
        max_context=131072,
        source=_HF + "meta-llama/Llama-3.1-70B",
    ),
    "llama-3.1-405b": ModelSpec(
        name="llama-3.1-405b",
        num_layers=126,
        hidden_size=16384,
        num_heads=128,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=53248,
        vocab_size=128256,
        max_context=131072,
        source=_HF + "meta-llama/Llama-3.1-405B",
    ),
    "qwen2.5-7b": ModelSpec(
        name="qwen2.5-7b",
        num_layers=28,
        hidden_size=3584,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=18944,
        vocab_size=152064,
        max_context=131072,
        qkv_bias=True,
        source=_HF + "Qwen/Qwen2.5-7B-Instruct (131,072 with YaRN, per its card)",
    ),
    "qwen2.5-72b": ModelSpec(
        name="qwen2.5-72b",
        num_layers=80,
        hidden_size=8192,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=29568,
        vocab_size=152064,
        max_context=131072,
        qkv_bias=True,
        source=_HF + "Qwen/Qwen2.5-72B-Instruct (131,072 with YaRN, per its card)",
    ),
    "mistral-7b": ModelSpec(
        name="mistral-7b",
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=32000,
        max_context=32768,
        sliding_window=4096,
        sliding_window_layers=32,
        source=_HF + "mistralai/Mistral-7B-v0.1 (sliding_window 4096 on every layer)",
    ),
    "deepseek-v3": ModelSpec(
        name="deepseek-v3",
        num_layers=61,
        hidden_size=7168,
        num_heads=128,
        num_kv_heads=128,
        head_dim=192,
        intermediate_size=18432,
        vocab_size=129280,
        max_context=163840,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        q_lora_rank=1536,
        num_experts=256,
        experts_per_token=8,
        num_shared_experts=1,
        moe_intermediate_size=2048,
        first_dense_layers=3,
        weight_dtype="fp8",
        source=_HF + "deepseek-ai/DeepSeek-V3 (weights released in FP8, quantization_config fp8; "
        "MTP module not counted)",
    ),
    # The design documents' running example: a 70B Llama-shaped model with full multi-head KV
    # (64 KV heads x 128), 2,621,440 bytes/token in fp16 (../shared/REFERENCE.md). Hypothetical.
    "llama-70b-mha": ModelSpec(
        name="llama-70b-mha",
        num_layers=80,
        hidden_size=8192,
        num_heads=64,
        num_kv_heads=64,
        head_dim=128,
        intermediate_size=28672,
        vocab_size=32000,
        max_context=2_097_152,
        source="design documents' example (Llama-2-70B shape with MHA; hypothetical max context)",
    ),
}
ALIASES = {"llama-3-8b": "llama-3.1-8b", "llama-3-70b": "llama-3.1-70b", "mistral-7b-v0.1": "mistral-7b"}


# Bounds on config.json fields: generous beyond every released model (the largest presets have 126
# layers, 16,384 hidden, 256 experts, a 2^21 context), tight enough that a typo cannot make the
# reader loop for minutes or the byte counts overflow.
_MAX_LAYERS = 4096
_MAX_WIDTH = 1 << 20  # hidden, intermediate, vocabulary, ranks
_MAX_HEADS = 1 << 16
_MAX_CONTEXT = 1 << 30
_MAX_EXPERTS = 1 << 16
_MAX_CONFIG_BYTES = 16 << 20  # a config.json is a few KiB


class _Fields:
    """Typed reads of one config.json dict; every error names the file and the field."""

    def __init__(self, cfg: dict[str, Any], source: str) -> None:
        self.cfg = cfg
        self.source = source

    def err(self, key: str, message: str) -> KvsimError:
        return KvsimError(message, source=self.source, path=key)

    def given(self, key: str) -> bool:
        return self.cfg.get(key) is not None

    def int(self, key: str, default: int | None = None, *, lo: int = 0, hi: int = _MAX_WIDTH) -> int:
        v = self.cfg.get(key)
        if v is None:
            if default is None:
                raise self.err(key, "missing required field")
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.err(key, f"expected an integer, got {show(v)}")
        if not lo <= v <= hi:
            raise self.err(key, f"expected an integer in [{lo:,}, {hi:,}], got {show(v)}")
        return v

    def bool(self, key: str, default: bool) -> bool:
        v = self.cfg.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise self.err(key, f"expected true or false, got {show(v)}")
        return v

    def str(self, key: str, default: str) -> str:
        v = self.cfg.get(key)
        if v is None:
            return default
        if not isinstance(v, str):
            raise self.err(key, f"expected a string, got {show(v)}")
        return v


def from_hf_config(cfg: dict[str, Any], *, name: str, source: str) -> ModelSpec:
    """Build a spec from a Hugging Face ``config.json`` dict (text models; ``text_config`` too).

    Every field read is checked for type and range, and across fields (KV heads divide heads, experts
    per token <= experts, the sliding window <= the context); any defect is one `KvsimError`."""
    if not isinstance(cfg, dict):
        raise KvsimError(f"expected a JSON object, got {show(cfg)}", source=source)
    text = cfg.get("text_config")
    if text is not None:
        if not isinstance(text, dict):
            raise KvsimError(f"expected an object, got {show(text)}", source=source, path="text_config")
        cfg = {**text}
    f = _Fields(cfg, source)
    layers = f.int("num_hidden_layers", lo=1, hi=_MAX_LAYERS)
    hidden = f.int("hidden_size", lo=1)
    heads = f.int("num_attention_heads", lo=1, hi=_MAX_HEADS)
    kv_heads = f.int("num_key_value_heads", heads, lo=1, hi=_MAX_HEADS)
    if heads % kv_heads:
        raise f.err("num_key_value_heads", f"{kv_heads} must divide num_attention_heads ({heads})")
    if f.given("head_dim"):
        head_dim = f.int("head_dim", lo=1, hi=_MAX_HEADS)
    elif hidden < heads:
        raise f.err("hidden_size", f"{hidden} is smaller than num_attention_heads ({heads}); give head_dim")
    else:
        head_dim = hidden // heads
    torch_dtype, new_dtype = f.str("torch_dtype", ""), f.str("dtype", "")  # both checked
    dtype = torch_dtype or new_dtype or "bfloat16"
    dtype_key = "torch_dtype" if f.given("torch_dtype") else "dtype"
    quant = cfg.get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        raise f.err("quantization_config", f"expected an object, got {show(quant)}")
    if quant is not None:
        method = _Fields(quant, source).str("quant_method", "")
        if method.lower() == "fp8":
            dtype = "fp8"  # weights stored in FP8 (e.g. DeepSeek-V3), whatever torch_dtype says
    if dtype not in DTYPE_BYTES:
        raise f.err(dtype_key, f"unsupported {show(dtype)}; expected one of {sorted(DTYPE_BYTES)}")
    expert_keys = [k for k in ("n_routed_experts", "num_local_experts", "num_experts") if f.given(k)]
    counts = [f.int(k, lo=0, hi=_MAX_EXPERTS) for k in expert_keys]
    n_experts = next((c for c in counts if c), 0)
    experts_key = next((k for k, c in zip(expert_keys, counts, strict=True) if c), "num_experts")
    per_token = f.int("num_experts_per_tok", 0, lo=0, hi=_MAX_EXPERTS)
    if n_experts and not per_token:
        raise f.err("num_experts_per_tok", f"required (>= 1) when {experts_key} is {n_experts}")
    if n_experts and per_token > n_experts:
        raise f.err("num_experts_per_tok", f"{per_token} exceeds {experts_key} ({n_experts})")
    context = f.int("max_position_embeddings", 4096, lo=1, hi=_MAX_CONTEXT)
    window = f.int("sliding_window", 0, lo=0, hi=_MAX_CONTEXT)
    if not f.bool("use_sliding_window", True):
        window = 0
    win_layers = 0
    max_window_layers = (
        f.int("max_window_layers", 0, lo=0, hi=layers) if f.given("max_window_layers") else None
    )
    layer_types = cfg.get("layer_types")
    if layer_types is not None and (
        not isinstance(layer_types, list)
        or len(layer_types) != layers
        or not all(isinstance(t, str) for t in layer_types)
    ):
        raise f.err(
            "layer_types", f"expected a list of {layers} strings (one per layer), got {show(layer_types)}"
        )
    if window:
        if window > context:
            raise f.err("sliding_window", f"{window:,} exceeds max_position_embeddings ({context:,})")
        if layer_types is not None:
            win_layers = sum(1 for t in layer_types if "sliding" in t)
        elif max_window_layers is not None and cfg.get("use_sliding_window"):
            win_layers = layers - max_window_layers
        else:
            win_layers = layers
    bias, model_type = f.bool("attention_bias", False), f.str("model_type", "")
    qkv_bias = bias or model_type.startswith("qwen2")
    hidden_default = min(4 * hidden, _MAX_WIDTH)
    intermediate = f.int("intermediate_size", hidden_default, lo=1)
    spec = ModelSpec(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        vocab_size=f.int("vocab_size", 32000, lo=1),
        max_context=context,
        tie_embeddings=f.bool("tie_word_embeddings", False),
        qkv_bias=qkv_bias,
        weight_dtype=dtype,
        kv_lora_rank=f.int("kv_lora_rank", 0),
        qk_rope_head_dim=f.int("qk_rope_head_dim", 0, hi=_MAX_HEADS),
        qk_nope_head_dim=f.int("qk_nope_head_dim", 0, hi=_MAX_HEADS),
        v_head_dim=f.int("v_head_dim", 0, hi=_MAX_HEADS),
        q_lora_rank=f.int("q_lora_rank", 0),
        sliding_window=window,
        sliding_window_layers=win_layers,
        num_experts=n_experts,
        experts_per_token=per_token if n_experts else 0,
        num_shared_experts=f.int("n_shared_experts", 0, hi=_MAX_EXPERTS),
        moe_intermediate_size=f.int("moe_intermediate_size", 0) or intermediate,
        first_dense_layers=f.int("first_k_dense_replace", 0, hi=layers),
        source=f"config.json {source}",
    )
    if spec.kv_lora_rank and not spec.qk_rope_head_dim:
        raise f.err("qk_rope_head_dim", "required when kv_lora_rank is set (MLA)")
    return spec


def names_a_file(ref: str) -> bool:
    """Whether a model reference is a path to a ``config.json`` rather than a preset name."""
    key = ref.strip().lower()
    if ALIASES.get(key, key) in PRESETS:
        return False
    return ref.endswith(".json") or "/" in ref or "\\" in ref


def load_model(ref: str, *, base_dir: Path | None = None, source: str | None = None) -> ModelSpec:
    """A preset name, or a path to a Hugging Face ``config.json`` (relative to `base_dir`)."""
    if not isinstance(ref, str) or not ref.strip():
        raise KvsimError(
            f"expected a model preset name or a path to config.json, got {show(ref)}", source=source
        )
    key = ref.strip().lower()
    key = ALIASES.get(key, key)
    if key in PRESETS:
        return PRESETS[key]
    if names_a_file(ref):
        path = Path(ref)
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        if not path.is_file():
            what = "is not a file" if path.exists() else "not found"
            raise KvsimError(f"model config file {what}: {shorten(str(path), 200)}", source=source)
        try:
            if path.stat().st_size > _MAX_CONFIG_BYTES:
                raise KvsimError(
                    f"too large for a config.json (over {_MAX_CONFIG_BYTES:,} bytes)", source=str(path)
                )
            cfg = json_loads(path.read_text(encoding="utf-8"))
        except JsonError as exc:
            where = f"line {exc.line}" if exc.line else None
            raise KvsimError(f"malformed JSON: {exc.message}", source=str(path), path=where) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise KvsimError(f"cannot read: {shorten(str(exc), 120)}", source=str(path)) from None
        spec = from_hf_config(cfg, name=path.parent.name or path.stem, source=str(path))
        return replace(spec, config_path=path)
    close = difflib.get_close_matches(key, list(PRESETS) + list(ALIASES), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; presets: {', '.join(PRESETS)}"
    raise KvsimError(f"unknown model {shorten(repr(ref))}{hint}", source=source)


def with_weight_dtype(spec: ModelSpec, dtype: str) -> ModelSpec:
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise KvsimError(f"unknown weight dtype {show(dtype)}; expected one of {sorted(DTYPE_BYTES)}")
    return replace(spec, weight_dtype=dtype)

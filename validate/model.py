"""A Llama-shaped decoder with random weights, whose attention reads and writes a paged KV pool
through `kernels/` (Triton on CUDA, the torch references on a CPU).

Weights are random (N(0, 0.02)): weights do not change costs, and the trace fixes every request's
output length, so no token ever stops a request early. Shapes come from a kvsim `ModelSpec` (a
named model scaled down by ``kvsim validate --scale``): GEMMs are ``x @ w`` with ``w`` [k, n] at
the per-layer shapes the calibrator times (`kvsim.spec.models.TPShapes`, tp 1). Dtypes: fp32 on a
CPU (as the calibrator's CPU GEMMs), bf16 on CUDA; queries, keys and values enter the attention
kernels in fp16 on CUDA (as the calibrator times them).

One forward runs one scheduler step: all its tokens through the GEMMs at once (decode rows first,
then prefill rows, as `kvsim.core.sched.output.SchedulerOutput` orders them); per layer, the decode
rows' new K/V are written (`kv_write`) and attended to (`paged_decode`), and the prefill rows' chunks
written and attended causally over their prefix (`chunked_prefill`); the last position of each
sampling row goes through the LM head and is sampled greedily. Around the GEMMs and attention the
forward calls this module's functions (RMSNorm, rotary, SiLU-and-mul, residual adds, embedding,
sampling); `step_rest` times those same calls at any model's shapes for the calibrator's
``step_rest`` op, so that a profile prices the work this loop runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kernels.chunked_prefill import chunked_prefill, chunked_prefill_ref
from kernels.kv_cache import PagedKVCache
from kernels.kv_write import kv_write, kv_write_ref
from kernels.paged_decode import paged_decode, paged_decode_ref
from kvsim.spec.models import ModelSpec, TPShapes
from validate.opclock import NO_CLOCK


@dataclass
class StepInputs:
    """One step's tensors, built from the scheduler's output and the block tables."""

    input_ids: torch.Tensor  # [T] int64, decode tokens first
    positions: torch.Tensor  # [T] int64
    num_decode: int
    dec_slots: torch.Tensor  # [num_decode] int64
    dec_tables: torch.Tensor  # [num_decode, max_blocks] int32
    dec_lens: torch.Tensor  # [num_decode] int32: context including the new token
    pre_qsl: torch.Tensor  # [num_prefill + 1] int32
    pre_tables: torch.Tensor  # [num_prefill, max_blocks] int32
    pre_lens: torch.Tensor  # [num_prefill] int32: prefix + chunk
    pre_slots: torch.Tensor  # [prefill tokens] int64
    max_query_len: int
    sample_idx: torch.Tensor  # [num_sampling] int64: token rows whose logits are sampled


class TinyLlama:
    def __init__(
        self,
        model: ModelSpec,
        *,
        device: str,
        kv_format: str,
        num_blocks: int,
        block_size: int,
        seed: int,
        triton: bool | None = None,
    ) -> None:
        self.device = device
        # Triton kernels on CUDA, the torch references on a CPU (`triton=True` on a CPU: the
        # Triton interpreter, for tests of the launch path at tiny shapes).
        self.cuda = device == "cuda" if triton is None else triton
        self.dtype = torch.bfloat16 if device == "cuda" else torch.float32
        self.attn_dtype = torch.float16 if self.cuda else torch.float32
        sh = TPShapes.of(model, 1)
        self.heads, self.kv_heads, self.head_dim = sh.heads, sh.kv_heads, sh.head_dim
        self.hidden = model.hidden_size
        self.inter = model.intermediate_size
        self.num_layers = model.num_layers
        # Drawn on the device: a full-size model's 8 B weights drawn on the host would take minutes.
        gen = torch.Generator(device=device).manual_seed(seed)

        def w(k: int, n: int) -> torch.Tensor:
            return (torch.randn(k, n, generator=gen, device=device, dtype=self.dtype)) * 0.02

        self.embed = w(model.vocab_size, self.hidden)
        self.layers = []
        for _ in range(self.num_layers):
            self.layers.append(
                {
                    "qkv": w(*sh.gemm_nk["qkv"][::-1]),
                    "o": w(*sh.gemm_nk["o"][::-1]),
                    "gate_up": w(*sh.gemm_nk["gate_up"][::-1]),
                    "down": w(*sh.gemm_nk["down"][::-1]),
                    "norm1": torch.ones(self.hidden, device=device, dtype=self.dtype),
                    "norm2": torch.ones(self.hidden, device=device, dtype=self.dtype),
                }
            )
        self.final_norm = torch.ones(self.hidden, device=device, dtype=self.dtype)
        self.lm_head = w(*sh.gemm_nk["lm_head"][::-1])
        self.caches = [
            PagedKVCache.allocate(kv_format, num_blocks, block_size, self.kv_heads, self.head_dim, device)
            for _ in range(self.num_layers)
        ]
        self.inv_freq = inv_freq(self.head_dim, device)
        self.sm_scale = self.head_dim**-0.5
        self.clock: Any = NO_CLOCK  # an `OpClock` times each call (``kvsim validate``'s per-op run)

    @torch.inference_mode()
    def forward(self, s: StepInputs) -> torch.Tensor:
        """Run one step; returns the sampled token ids [num_sampling] (on the device). Each call
        runs under `self.clock`, named as the simulation's ops split a step (`validate.opclock`)."""
        c = self.clock
        with c("step_rest:embed"):
            x, cos, sin = embed_step(self.embed, self.inv_freq, s.input_ids, s.positions)
        nd = s.num_decode
        hq, hk, d = self.heads, self.kv_heads, self.head_dim
        for layer, cache in zip(self.layers, self.caches, strict=True):
            with c("step_rest:layer"):
                h = rms_norm(x, layer["norm1"])
            with c("gemm:qkv"):
                qkv = h @ layer["qkv"]
            with c("step_rest:layer"):
                q, k, v = qkv_rope(qkv, cos, sin, hq, hk, d, self.attn_dtype)
            outs: list[torch.Tensor] = []
            if nd:
                if self.cuda:
                    with c("kv_write"):
                        kv_write(k[:nd], v[:nd], cache, s.dec_slots)
                    with c("paged_decode"):
                        outs.append(
                            _one(paged_decode(q[:nd], cache, s.dec_tables, s.dec_lens, self.sm_scale))
                        )
                else:
                    with c("kv_write"):
                        kv_write_ref(k[:nd], v[:nd], cache, s.dec_slots)
                    with c("paged_decode"):
                        outs.append(
                            _one(paged_decode_ref(q[:nd], cache, s.dec_tables, s.dec_lens, self.sm_scale))
                        )
            if q.shape[0] > nd:
                args = (q[nd:], k[nd:], v[nd:], cache, s.pre_tables, s.pre_qsl, s.pre_lens, self.sm_scale)
                with c("chunked_prefill"):
                    if self.cuda:
                        outs.append(
                            chunked_prefill(*args, slot_mapping=s.pre_slots, max_query_len=s.max_query_len)
                        )
                    else:
                        outs.append(chunked_prefill_ref(*args, slot_mapping=s.pre_slots))
            with c("step_rest:layer"):
                attn = attn_rows(torch.cat(outs) if len(outs) > 1 else outs[0], hq * d, self.dtype)
            with c("gemm:o"):
                o = attn @ layer["o"]
            with c("step_rest:layer"):
                x, h = residual_norm(x, o, layer["norm2"])
            with c("gemm:gate_up"):
                gate_up = h @ layer["gate_up"]
            with c("step_rest:layer"):
                act = silu_mul(gate_up)
            with c("gemm:down"):
                down = act @ layer["down"]
            with c("step_rest:layer"):
                x = x + down
        with c("step_rest:sample"):
            rows = final_rows(x, s.sample_idx, self.final_norm)
        with c("gemm:lm_head"):
            logits = rows @ self.lm_head
        with c("step_rest:sample"):
            return greedy(logits)


# ---- the step's work besides GEMMs and attention ------------------------------------------------------
# The forward above is these calls around the GEMMs and attention kernels; `step_rest` below times
# the same calls at a model's shapes (the calibrator's `step_rest` op), so that what the simulator
# prices is the code the serving loop runs.
def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * weight


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def embed_step(
    table: torch.Tensor, freq: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Once per step: the embedding lookup and the rotary cos/sin of every position."""
    return (table[ids], *rotary(freq, positions))


ROPE_THETA = 500000.0  # Llama 3's rope_theta (its config.json)


def inv_freq(head_dim: int, device: str) -> torch.Tensor:
    half = head_dim // 2
    return 1.0 / (ROPE_THETA ** (torch.arange(0, half, device=device, dtype=torch.float32) / half))


def rotary(freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ang = positions.float()[:, None] * freq[None, :]
    return ang.cos()[:, None, :], ang.sin()[:, None, :]


def qkv_rope(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hk: int, d: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused QKV projection split into heads, rotary on Q and K, cast for the attention kernels."""
    q = qkv[:, : hq * d].view(-1, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(-1, hk, d)
    v = qkv[:, (hq + hk) * d :].view(-1, hk, d)
    return rope(q, cos, sin).to(dtype), rope(k, cos, sin).to(dtype), v.to(dtype).contiguous()


def attn_rows(attn: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    return attn.reshape(-1, width).to(dtype)


def residual_norm(
    x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention block's residual add and the MLP's input norm."""
    x = x + y
    return x, rms_norm(x, weight)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def final_rows(x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The sampling rows' last hidden states, normed for the LM head."""
    return rms_norm(x[idx], weight)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


STEP_REST_PARTS = ("layer", "embed", "sample")


def step_rest(
    part: str,
    n: int,
    *,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    vocab: int,
    device: str,
    dtype: torch.dtype,
    attn_dtype: torch.dtype,
    table: torch.Tensor | None = None,
) -> Callable[[], object]:
    """A call of the forward's non-GEMM, non-attention work at one model's (per-GPU) shapes:
    ``layer``, one layer's over `n` tokens (the two RMSNorms, the QKV split with rotary on Q and K,
    the residual adds, SiLU-and-mul); ``embed``, the step's embedding lookup and rotary tables over
    `n` tokens; ``sample``, the final norm and greedy pick of `n` sampled rows (the LM head GEMM
    between them is the calibrator's ``gemm`` lm_head). The GEMM outputs are random tensors of
    their shapes; the embedding table (`table`, to share one between calls) is zeroed, so that its
    rows are real memory (an unwritten one maps every row to one zero page, always cached)."""
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    ones = torch.ones(hidden, device=device, dtype=dtype)
    freq = inv_freq(head_dim, device)
    pos = torch.arange(n, device=device)
    if part == "embed":
        if table is None:
            table = torch.zeros(vocab, hidden, device=device, dtype=dtype)
        ids = torch.randint(0, vocab, (n,), generator=gen, device=device)
        return torch.inference_mode()(lambda: embed_step(table, freq, ids, pos))
    if part == "sample":
        x, logits = rand(n, hidden), rand(n, vocab)
        idx = torch.arange(n, device=device)
        return torch.inference_mode()(lambda: (final_rows(x, idx, ones), greedy(logits)))
    if part != "layer":  # pragma: no cover - the parts are STEP_REST_PARTS
        raise ValueError(part)
    cos, sin = rotary(freq, pos)
    x, qkv = rand(n, hidden), rand(n, (heads + 2 * kv_heads) * head_dim)
    attn = rand(n, heads, head_dim).to(attn_dtype)  # as the attention kernels return it
    o, gate_up, down = rand(n, hidden), rand(n, 2 * intermediate), rand(n, hidden)

    @torch.inference_mode()
    def layer() -> object:
        h = rms_norm(x, ones)
        q, k, v = qkv_rope(qkv, cos, sin, heads, kv_heads, head_dim, attn_dtype)
        a = attn_rows(attn, heads * head_dim, dtype)
        x2, h = residual_norm(x, o, ones)
        return x2 + down, silu_mul(gate_up), a, q, k, v, h

    return layer


def _one(out: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The attention output of a launcher called without ``return_lse``."""
    assert isinstance(out, torch.Tensor)
    return out

"""The analytic model's efficiencies as functions of batch shape, and the measured fits of them.

Each op of a step is priced per kernel call (one layer) by a simple, physical form: a fixed launch
time plus a roofline whose compute efficiency rises with the work's size,
``e(x) = e_max * x / (x + x_half)``. That is the same as a roofline at ``e_max`` plus a term
linear in the small dimension, so the forms are (seconds per call; F FLOPs, W bytes, P the GPU's
dense bf16 peak, B its HBM bandwidth):

- ``gemm``: ``t0 + smooth_max(F / (P e_max), W / (B e_weight); q)`` with W the weights the call
  streams and ``smooth_max(a, b; q) = (a^q + b^q)^(1/q)``: over the token count a GEMM turns from
  weight-bound to compute-bound, and near the turn both limits cost (measured: q about 2).
- ``decode_attn``: ``t0 + b h t_item + max(KV / (B e_max), F / (P e_flops))`` for ``b`` decoding
  sequences over ``h`` KV heads per GPU reading KV bytes: each (sequence, KV head) is a work item
  of the kernel with a fixed cost (the format's decode speed-up divides the bytes term).
- ``prefill_attn``: ``t0 + max((F + F0 n_half / n) / (P e_max), KV / (B e_kv))`` for a chunk of
  ``n`` new tokens: F counts the causal pairs over its cached prefix too, F0 those of the chunk
  alone (no prefix). The tables hold prefix 0 only (F = F0), where this is ``F (1 + n_half / n)``;
  the ramp is charged on the chunk's own pairs so that a short chunk over a long cached prefix (a
  prefix hit's remainder, a one-token recompute) is not priced as ``n_half`` queries over the
  whole prefix, which no measurement supports.

With ``t0 = t_item = 0``, ``n_half = 0`` and ``q = inf`` the forms are the plain roofline of published
peaks times one efficiency (`PUBLISHED`). ``python -m calibrate.fit_analytic`` fits the parameters
per GPU to NVIDIA aiconfigurator-core's measured kernel tables (least squares on log relative
error) and writes them, with the tables' provenance, to ``kvsim/data/analytic_fit.json``, which
`fit_for` reads and validates; `docs/cost-model-accuracy.md` states the error before and after.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, fields
from importlib import resources
from typing import Any

import numpy as np

from kvsim.errors import KvsimError
from kvsim.spec.hardware import GPUSpec

SCHEMA = "kvsim-analytic-fit"
VERSION = 1
FIT_FILE = "data/analytic_fit.json"  # inside the kvsim package


def smooth_max(a: Any, b: Any, q: float) -> Any:
    """``(a^q + b^q)^(1/q)``: the roofline's max(a, b) where the two limits overlap imperfectly
    (q = inf is the max itself; q = 1 their sum). Vectorised."""
    if math.isinf(q):
        return np.maximum(a, b)
    return (a**q + b**q) ** (1.0 / q)


@dataclass(frozen=True)
class GemmEff:
    t0_s: float  # launch time per GEMM call
    e_max: float  # compute efficiency, of the dense bf16 (fp8) peak
    e_weight: float  # weight-streaming efficiency, of HBM bandwidth
    q: float  # how sharply the call turns from weight-bound to compute-bound (`smooth_max`)

    def seconds(self, flops: Any, weight_bytes: Any, peak: float, bw: float) -> Any:
        """One GEMM call (vectorised over numpy arrays)."""
        return self.t0_s + smooth_max(
            flops / (peak * self.e_max), weight_bytes / (bw * self.e_weight), self.q
        )


@dataclass(frozen=True)
class DecodeAttnEff:
    t0_s: float  # launch time per layer
    t_item_s: float  # per (decoding sequence, KV head on this GPU) work item per layer
    e_max: float  # of HBM bandwidth, bf16 KV
    e_flops: float  # of the dense bf16 peak (MLA's absorbed decode can be compute-bound)

    def seconds(self, kv_bytes: Any, flops: Any, items: Any, peak: float, bw: float) -> Any:
        """One layer's decode attention over ``items`` = sequences x KV heads (vectorised)."""
        return (
            self.t0_s
            + items * self.t_item_s
            + np.maximum(kv_bytes / (bw * self.e_max), flops / (peak * self.e_flops))
        )


@dataclass(frozen=True)
class PrefillAttnEff:
    t0_s: float  # launch time per layer per chunk
    e_max: float  # compute efficiency at long chunks, of the dense bf16 peak
    n_half: float  # chunk length at which compute efficiency is half of e_max
    e_kv: float  # of HBM bandwidth, for the KV the chunk reads and writes

    def seconds(
        self, flops: Any, kv_bytes: Any, n: Any, peak: float, bw: float, own_flops: Any = None
    ) -> Any:
        """One layer's attention of a chunk of ``n`` new tokens (vectorised); ``own_flops``: the
        chunk's causal FLOPs without its cached prefix (default ``flops``: no prefix)."""
        work = flops
        if self.n_half != 0.0:
            own = flops if own_flops is None else own_flops
            work = flops + own * (self.n_half / np.maximum(n, 1e-300))
        return self.t0_s + np.maximum(work / (peak * self.e_max), kv_bytes / (bw * self.e_kv))


@dataclass(frozen=True)
class OpFits:
    gemm: GemmEff
    decode_attn: DecodeAttnEff
    prefill_attn: PrefillAttnEff


# Published figures, one efficiency per op (sources in kvsim/costs/analytic.py's docstring):
# decode attention 80% of HBM, weight streaming 80% of HBM, prefill attention 65% of dense peak,
# GEMMs 70% of dense peak (an estimate), no launch time.
PUBLISHED = OpFits(
    gemm=GemmEff(t0_s=0.0, e_max=0.70, e_weight=0.80, q=math.inf),
    decode_attn=DecodeAttnEff(t0_s=0.0, t_item_s=0.0, e_max=0.80, e_flops=0.65),
    prefill_attn=PrefillAttnEff(t0_s=0.0, e_max=0.65, n_half=0.0, e_kv=0.80),
)
OP_CLASSES: dict[str, type[GemmEff] | type[DecodeAttnEff] | type[PrefillAttnEff]] = {
    "gemm": GemmEff,
    "decode_attn": DecodeAttnEff,
    "prefill_attn": PrefillAttnEff,
}
BOUNDS = {  # what a fitted parameter may be: (low, high); efficiencies are shares of a peak
    "t0_s": (0.0, 1e-3),
    "t_item_s": (0.0, 1e-4),
    "e_max": (1e-3, 1.0),
    "e_weight": (1e-3, 1.0),
    "e_flops": (1e-3, 1.0),
    "e_kv": (1e-3, 1.0),
    "q": (1.0, 64.0),
    "n_half": (0.0, 1e6),
}


@dataclass(frozen=True)
class GpuFit:
    """The fitted forms of one GPU preset and where their data came from."""

    gpu: str  # kvsim preset name
    ops: OpFits
    system: str  # aiconfigurator system (h200_sxm, ...)
    source: dict[str, Any]  # provenance of the tables: package, version, backend, dtypes, hashes
    peaks: tuple[float, float]  # the preset's bf16 FLOP/s and HBM bytes/s the efficiencies divide
    reused_from: str | None = None  # a preset of the same architecture whose fit this one reuses
    # fp8 KV over the bf16 forms (``fp8_kv``; None: the published speed-up, no prefill factor):
    fp8_decode_speedup: float | None = None  # decode's bf16-equivalent bytes divided by it
    fp8_prefill_factor: float | None = None  # prefill attention's time multiplied by it

    @property
    def label(self) -> str:
        what = f"aiconfigurator {self.system} tables"
        if self.reused_from:
            what += f", reused from {self.reused_from}"
        return f"analytic (fitted to {what})"


PUBLISHED_LABEL = "analytic (published peaks)"


def _op(cls: Any, raw: object, source: str, path: str) -> Any:
    if not isinstance(raw, dict):
        raise KvsimError("expected an object of the op's parameters", source=source, path=path)
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(raw) - set(names) - {"points", "form"})
    if unknown:
        raise KvsimError(
            f"unknown key(s) {', '.join(unknown)}; expected {', '.join(names)}", source=source, path=path
        )
    values: dict[str, float] = {}
    for name in names:
        v = raw.get(name)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise KvsimError(f"expected a finite number, got {v!r}", source=source, path=f"{path}.{name}")
        lo, hi = BOUNDS[name]
        if not lo <= v <= hi:
            raise KvsimError(
                f"expected {lo:g} <= {name} <= {hi:g}, got {v!r}", source=source, path=f"{path}.{name}"
            )
        values[name] = float(v)
    return cls(**values)


def parse_fits(data: object, source: str) -> dict[str, GpuFit]:
    """The fits of a parsed fit file, validated: every error is one line naming the field."""
    if not isinstance(data, dict):
        raise KvsimError("expected a JSON object", source=source)
    if data.get("schema") != SCHEMA:
        raise KvsimError(f"expected {SCHEMA!r}, got {data.get('schema')!r}", source=source, path="schema")
    if data.get("version") != VERSION:
        raise KvsimError(
            f"expected version {VERSION}, got {data.get('version')!r}", source=source, path="version"
        )
    gpus = data.get("gpus")
    if not isinstance(gpus, dict):
        raise KvsimError("expected an object of GPU preset -> fit", source=source, path="gpus")
    out: dict[str, GpuFit] = {}
    for gpu, entry in gpus.items():
        where = f"gpus.{gpu}"
        if not isinstance(entry, dict):
            raise KvsimError("expected an object", source=source, path=where)
        system, prov = entry.get("system"), entry.get("source")
        if not isinstance(system, str) or not system:
            raise KvsimError("expected the aiconfigurator system name", source=source, path=f"{where}.system")
        if not isinstance(prov, dict) or not isinstance(prov.get("package_version"), str):
            raise KvsimError(
                "expected the tables' provenance with package_version", source=source, path=f"{where}.source"
            )
        peaks = prov.get("peaks")
        if not isinstance(peaks, dict) or not all(
            isinstance(peaks.get(k), int | float) and peaks[k] > 0
            for k in ("bf16_flops", "hbm_bw_bytes_per_s")
        ):
            raise KvsimError(
                "expected bf16_flops and hbm_bw_bytes_per_s, positive numbers",
                source=source,
                path=f"{where}.source.peaks",
            )
        ops = entry.get("ops")
        if not isinstance(ops, dict):
            raise KvsimError("expected an object of op -> parameters", source=source, path=f"{where}.ops")
        missing = [op for op in OP_CLASSES if op not in ops]
        if missing:
            raise KvsimError(f"missing op(s) {', '.join(missing)}", source=source, path=f"{where}.ops")
        parsed = {op: _op(cls, ops[op], source, f"{where}.ops.{op}") for op, cls in OP_CLASSES.items()}
        reused = entry.get("reused_from")
        if reused is not None and not isinstance(reused, str):
            raise KvsimError("expected a GPU preset name or null", source=source, path=f"{where}.reused_from")
        pk = (float(peaks["bf16_flops"]), float(peaks["hbm_bw_bytes_per_s"]))
        fp8: list[float | None] = [None, None]
        raw8 = entry.get("fp8_kv")
        if raw8 is not None:
            if not isinstance(raw8, dict):
                raise KvsimError("expected an object", source=source, path=f"{where}.fp8_kv")
            for i, key in enumerate(("decode_speedup", "prefill_factor")):
                v = raw8.get(key)
                if isinstance(v, bool) or not isinstance(v, int | float) or not 0.25 <= v <= 4.0:
                    raise KvsimError(
                        f"expected a number in 0.25..4, got {v!r}",
                        source=source,
                        path=f"{where}.fp8_kv.{key}",
                    )
                fp8[i] = float(v)
        out[gpu] = GpuFit(gpu, OpFits(**parsed), system, prov, pk, reused, fp8[0], fp8[1])
    return out


def load_fits(text: str, source: str) -> dict[str, GpuFit]:
    """Parse and validate the text of a fit file."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise KvsimError(f"not JSON: {e.msg} at line {e.lineno}", source=source) from None
    return parse_fits(data, source)


@functools.cache
def shipped_fits() -> dict[str, GpuFit]:
    """The fits shipped in ``kvsim/data/analytic_fit.json`` (validated once per process)."""
    source = f"kvsim/{FIT_FILE}"
    try:
        text = resources.files("kvsim").joinpath(FIT_FILE).read_text()
    except (FileNotFoundError, OSError):
        return {}
    return load_fits(text, source)


def fit_for(gpu: GPUSpec) -> GpuFit | None:
    """The shipped fit of a GPU, or None: the published peaks apply. A preset whose memory size a
    scenario overrides (``h100-sxm*``) keeps its fit; one whose peak FLOPs or bandwidth it overrides
    does not (the fitted efficiencies are shares of the preset's peaks)."""
    fit = shipped_fits().get(gpu.name.rstrip("*"))
    if fit is None or (gpu.bf16_flops, gpu.hbm_bw_bytes_per_s) != fit.peaks:
        return None
    return fit

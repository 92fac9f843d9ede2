"""``kvsim stack SCENARIO``: the design documents' technique-stacking table (000, section 7.1),
recomputed by simulation of the scenario's own model and trace.

One row per added technique, each simulated on the scenario's workload with everything above it on:

0. no optimisation: fp16, MHA (the model with as many KV heads as query heads; weights as the
   model's), no prefix sharing: derived only for MHA/GQA models;
1. + GQA/MLA: the model's own attention;
2. + FP8 KV (``fp8_e4m3``);
3. + paging + sharing: the prefix cache on (kvsim always pages: vLLM-style blocks);
4. + H2O keeping 20% of each sequence (``heavy_ratio: 0.2``, no recent window, always, physical
   release: the table's memory column assumes the blocks are freed);
5. + offload: a host-DRAM tier of twice the HBM pool, write-back (SGLang HiCache's default host
   pool ratio, `kvsim.spec.offload`), on top of row 4, H2O on. A running sequence touches all its
   blocks every step, so none is cold, and the prefix blocks a sequence trimmed are rewritten, not
   reusable, so write-back copies none of them down (`kvsim.sim.offload`): the tier holds only
   released prefixes no sequence evicted from, and the HBM column does not fall, unlike the
   documents' "4 GB (GPU) + 2 GB (DRAM)".

A scenario's ``kv.format_switch`` is left out of every row (the rows add the documents' techniques
one at a time). A model with sliding-window layers leaves row 4 unsimulated (its windows are not
combined with token eviction yet) and says so; its row 5 adds the offload tier to row 3 instead,
the windows freeing blocks as in every row.

Columns: KV bytes of one 1,048,576-token sequence (the model's arithmetic, window caps applied,
times H2O's kept share; paging and sharing change nothing for one sequence), HBM in use per GPU at
the run's peak (weights, activation reserve and the KV blocks requests referenced; prefix-cache
blocks no request holds are reclaimable and left out), TTFT and TPOT p99, and cost per million
tokens; beside them the documents' claimed row.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsim.core.eviction import eviction_from_config
from kvsim.progress import PointProgress
from kvsim.run import run_scenario
from kvsim.spec.formats import make_format
from kvsim.spec.models import Attention
from kvsim.spec.offload import OffloadWrite
from kvsim.spec.scenario import EvictionConfig, EvictionPolicy, PagePolicy, PrefixCacheScope, Scenario

ONE_M = 1 << 20
COST_BASIS = (
    "cost per million tokens at the scenario's own load (GPU-hours of the simulated span, and a "
    "global pool's dedicated pool nodes' hours, over the tokens served): while the GPUs have room it is the same for every row; raise "
    "workload.rate_scale (--set) until they are full to compare what each technique serves per GPU"
)
# The documents' table (000, section 7.1): per-million-token memory and cost, as claimed.
CLAIMED: tuple[tuple[str, str], ...] = (
    ("~435 GB", "~$100"),
    ("~54 GB", "~$20"),
    ("~27 GB", "~$12"),
    ("~16 GB", "~$8"),
    ("~6 GB", "~$5"),
    ("~4 GB (GPU) + 2 GB (DRAM)", "~$4.5"),
)
LABELS = (
    "no optimisation (FP16, MHA, no sharing)",
    "+ GQA/MLA (the model's attention)",
    "+ FP8 KV",
    "+ paging + sharing (prefix cache)",
    "+ H2O (20% kept)",
    "+ offload",
)


@dataclass(frozen=True)
class StackRow:
    label: str
    simulated: bool
    note: str
    kv_bytes_1m: int | None
    hbm_peak_bytes: int | None
    ttft_p99_s: float | None
    tpot_p99_s: float | None
    cost_per_mtok_usd: float | None
    completed: int | None
    claimed_memory: str
    claimed_cost: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _variants(sc: Scenario) -> list[tuple[Scenario | None, str]]:
    fp16, _ = make_format("fp16")
    fp8, _ = make_format("fp8")
    kv = sc.kv
    base_kv = dataclasses.replace(
        kv,
        format=fp16,
        format_note=None,
        format_mix=None,
        format_switch=None,  # the table's rows are the documents' techniques, one at a time
        prefix_cache=PrefixCacheScope.NONE,
        eviction=EvictionConfig(),
    )
    own = dataclasses.replace(sc, kv=base_kv)
    out: list[tuple[Scenario | None, str]] = []
    m = sc.model
    if m.attention is Attention.MLA:
        out.append((None, f"{m.name} is MLA: no MHA variant is derived"))
    elif m.num_kv_heads == m.num_heads:
        out.append((own, f"{m.name} is MHA already"))
    else:
        mha = dataclasses.replace(m, num_kv_heads=m.num_heads)
        out.append(
            (dataclasses.replace(own, model=mha), f"{m.num_heads} KV heads instead of {m.num_kv_heads}")
        )
    out.append((own, f"{m.attention.value}, {m.num_kv_heads} KV heads"))
    fp8_sc = dataclasses.replace(own, kv=dataclasses.replace(base_kv, format=fp8))
    out.append((fp8_sc, "fp8_e4m3 per-tensor scales"))
    shared = dataclasses.replace(
        fp8_sc, kv=dataclasses.replace(fp8_sc.kv, prefix_cache=PrefixCacheScope.LOCAL)
    )
    out.append((shared, "one sequence's bytes do not change; sharing pays across requests"))
    h2o = EvictionConfig(
        policy=EvictionPolicy.H2O, heavy_ratio=0.2, recent_tokens=0, pages=PagePolicy.PHYSICAL
    )
    note = (
        "heavy_ratio 0.2, physical release (soft-marked pages would keep the blocks); a sequence that "
        "evicts gives up its shared prefix"
    )
    offload = dataclasses.replace(shared.kv.offload, enabled=True, hbm_ratio=2.0, write=OffloadWrite.BACK)
    if m.windowed_kv_layers():  # `kvsim run` refuses token eviction with them (`_refuse_unsimulated`)
        out.append(
            (
                None,
                f"{m.name}'s sliding-window layers free blocks already; not simulated together with "
                "token eviction yet (one policy per sequence)",
            )
        )
        out.append(
            (
                dataclasses.replace(shared, kv=dataclasses.replace(shared.kv, offload=offload)),
                "host DRAM 2x the HBM pool, write-back, on row 3 (H2O is not simulated with the "
                "windows); prefix blocks a window trimmed are not written back",
            )
        )
        return out
    evicting = dataclasses.replace(shared, kv=dataclasses.replace(shared.kv, eviction=h2o))
    out.append((evicting, note))
    out.append(
        (
            dataclasses.replace(evicting, kv=dataclasses.replace(evicting.kv, offload=offload)),
            "host DRAM 2x the HBM pool, write-back, on row 4 (H2O on); running sequences' blocks are "
            "never cold, so HBM does not fall, and prefix blocks a sequence trimmed are not written back",
        )
    )
    return out


def stack_rows(sc: Scenario, *, progress: bool = False) -> list[StackRow]:
    """Simulate the table's rows for `sc` (its workload, cluster and pricing). `progress`: on
    stderr, a bar on a terminal, a line per simulated row when piped (`kvsim.progress`)."""
    rows = []
    variants = _variants(sc)
    bar = PointProgress(sum(v is not None for v, _ in variants), enabled=progress)
    bar.start()
    try:
        for (variant, note), label, claimed in zip(variants, LABELS, CLAIMED, strict=True):
            rows.append(_row(variant, note, label, claimed))
            if variant is not None:
                bar.finished(label, True)
    finally:
        bar.stop()
    return rows


def _row(variant: Scenario | None, note: str, label: str, claimed: tuple[str, str]) -> StackRow:
    mem, cost = claimed
    if variant is None:
        return StackRow(label, False, note, None, None, None, None, None, None, mem, cost)
    ev = eviction_from_config(variant.kv.eviction)
    kept = ONE_M if ev is None else ev.kept(ONE_M)
    kv_bytes = variant.model.kv_bytes(ONE_M, variant.kv.format) * kept // ONE_M
    s = run_scenario(variant).summary
    return StackRow(
        label,
        True,
        note,
        int(kv_bytes),
        int(
            s["weight_bytes_per_gpu"]
            + s["memory_plan"]["activation_reserve_bytes"]
            + s["kv_peak_used_blocks"] * s["kv_block_bytes"]
        ),
        s["ttft_s"]["p99"],
        s["tpot_s"]["p99"],
        s["cost_per_mtok_usd"],
        int(s["requests"]["completed"]),
        mem,
        cost,
    )


def stack_json(sc: Scenario, rows: list[StackRow]) -> dict[str, Any]:
    return {
        "schema": "kvsim-stack",
        "version": 1,
        "scenario": sc.name,
        "model": sc.model.name,
        "gpu": sc.cluster.gpu.name,
        "trace": str(sc.workload.trace) if sc.workload.trace else "synthetic",
        "claimed_source": "design documents 000, section 7.1 (claims, not measurements)",
        "cost_basis": COST_BASIS,
        "rows": [r.to_dict() for r in rows],
    }


def write_stack_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n")

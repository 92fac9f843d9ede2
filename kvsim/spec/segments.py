"""``kv.segments``: a KV-cache policy per agent prompt segment (design documents 003, 分段管理).

An agent turn's prompt is its segments in order (`kvsim.spec.agent`); ``kv.segments`` says, per
segment, what of a finished turn's KV stays in the prefix cache for the next turn to reuse:
``lru`` (the plain prefix cache), ``keep`` (system prompt and tools: pinned, evicted last),
``window`` (history: the first ``retain`` earlier turns and the last ``turns`` kept; once the
history passes both, everything from earlier turn ``retain`` on leaves, the window too, since
exact-prefix reuse cannot reach past the hole) and ``evict_after_use`` (a tool output leaves the cache when the turn that used it ends). The
policies act on the cache, not on the prompt (what the agent sends is ``workload.agent``'s
``history_turns`` and ``tool_outputs``). Reuse is exact-prefix, so a segment dropped in the middle
is a hole: the next turn recomputes everything after it (docs/architecture.md, "Agent segments").
Left out: compressing a segment to another KV format (one format per run's blocks here).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsim.errors import KvsimError
from kvsim.spec.schema import Section, show

# Segment kinds, in a prompt's order; also the columns of `AgentWorkload.segment_tokens`.
SEGMENTS = ("system", "tools", "history", "tool_output", "user")

# The policies each segment takes besides lru: keep pins shared blocks (a session's own pinned
# would outlive it), window slides over turns, evict_after_use drops a segment used once.
POLICIES = ("lru", "keep", "window", "evict_after_use")
ALLOWED = {
    "system": ("lru", "keep"),
    "tools": ("lru", "keep"),
    "history": ("lru", "window"),
    "tool_output": ("lru", "evict_after_use"),
    "user": ("lru",),
}


@dataclass(frozen=True)
class SegmentPolicy:
    policy: str  # one of POLICIES
    turns: int = 0  # window: the last earlier turns kept reusable (>= 1)
    retain: int = 0  # window: the session's first earlier turns kept too (important messages)


@dataclass(frozen=True)
class SegmentPolicies:
    """Each named segment's policy; segments not named are lru."""

    by_segment: tuple[tuple[str, SegmentPolicy], ...]

    def get(self, segment: str) -> SegmentPolicy:
        return dict(self.by_segment).get(segment, SegmentPolicy("lru"))

    @property
    def kept(self) -> tuple[str, ...]:
        """The segments pinned (policy keep), in prompt order."""
        return tuple(s for s, p in self.by_segment if p.policy == "keep")

    @property
    def drops(self) -> bool:
        """Whether any policy drops blocks at a turn's end (window, evict_after_use)."""
        return any(p.policy in ("window", "evict_after_use") for _, p in self.by_segment)

    def describe(self) -> dict[str, str]:
        out = {}
        for s, p in self.by_segment:
            out[s] = f"window(turns={p.turns}, retain={p.retain})" if p.policy == "window" else p.policy
        return out


def read_segments(s: Section) -> SegmentPolicies | None:
    """``kv.segments``: a mapping segment -> policy name, or -> {policy, turns, retain} (window)."""
    raw = s.raw("segments", None)
    if raw is None:
        return None
    y = Section(raw, source=s.source, path=s._p("segments"))
    out: list[tuple[str, SegmentPolicy]] = []
    for seg in list(y.data):
        if seg not in SEGMENTS:
            raise y.err(str(seg), f"unknown segment {show(seg)}; the agent prompt's: {', '.join(SEGMENTS)}")
        value = y.raw(seg)
        if isinstance(value, str):  # `history: lru`, named at the segment
            y.choice(seg, POLICIES)
            value = {"policy": value}
        p = Section(value, source=y.source, path=y._p(seg))
        name = p.choice("policy", POLICIES)
        if name not in ALLOWED[seg]:
            raise y.err(seg, f"{name} does not apply to {seg}; it takes {', '.join(ALLOWED[seg])}")
        if name == "window":
            pol = SegmentPolicy(name, turns=p.int("turns", lo=1, hi=1000), retain=_retain(p))
        else:
            pol = SegmentPolicy(name)
        p.done()
        out.append((seg, pol))
    order = {seg: i for i, seg in enumerate(SEGMENTS)}
    return SegmentPolicies(tuple(sorted(out, key=lambda sp: order[sp[0]])))


def _retain(p: Section) -> int:
    v = p.raw("retain", 0)
    if isinstance(v, int) and not isinstance(v, bool) and v < 0:
        raise p.err("retain", f"a count of earlier turns kept, >= 0; got {v}")
    return p.int("retain", 0, lo=0, hi=1000)


def check_segments_workload(source: str, segments: SegmentPolicies, agent: object | None) -> None:
    """Refuse a policy for a segment the workload's prompts never hold, in one line naming it."""
    from kvsim.spec.scenario import AgentConfig

    if agent is None:
        raise KvsimError(
            "segment policies need a workload with marked segments (workload.agent)",
            source=source,
            path="kv.segments",
        )
    assert isinstance(agent, AgentConfig)
    absent = {
        "system": (agent.system_prompt_tokens == 0, "workload.agent.system_prompt_tokens is 0"),
        "tools": (agent.tool_tokens == 0, "workload.agent.tool_tokens is 0"),
        "tool_output": (agent.tool_call_share == 0, "workload.agent.tool_call_share is 0: no turn has one"),
        "history": (
            agent.turns.hi <= 1 or (agent.turns.kind == "constant" and agent.turns.mean <= 1),
            "every session has one turn: no prompt has a history",
        ),
    }
    for seg, pol in segments.by_segment:
        missing, why = absent.get(seg, (False, ""))
        if missing and pol.policy != "lru":
            raise KvsimError(
                f"policy {pol.policy} for {seg}, a segment the workload does not have: {why}",
                source=source,
                path=f"kv.segments.{seg}",
            )

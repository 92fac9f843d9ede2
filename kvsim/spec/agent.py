"""The agent-session generator: closed-loop sessions whose prompts are built of marked segments.

An agent session is a run of turns. Turn 0's input is a user message; each reply calls a tool with
probability ``tool_call_share``, and then the next turn's input is that tool's output (sent
``tool_time`` after the reply), else a user message (sent ``think_time`` after it). In closed loop
(the default) a turn is sent only when the previous reply has arrived, so a slow server slows its
own traffic, as real agents do; the engine sends it (`kvsim.sim.cluster.ClosedLoopArrivals`). The
workload's ``arrival_s`` holds each turn's earliest possible time (session start plus the gaps,
zero service time) and orders the requests; the run records the times turns were really sent.

A turn's prompt is its segments in order (design documents 003, 'Agent场景的特殊优化'):

    system prompt | tool definitions | history (earlier turns: input, reply) | this turn's input

and three context policies act on them: ``history_turns`` keeps only the last N earlier turns
(the documents' sliding window; 0 keeps all), and ``tool_outputs`` keeps a used tool output in the
history, drops it, or replaces it by a summary of ``compress_ratio`` of its tokens ("used once,
then compressed or dropped"). A reply's tokens are part of the next prompt unless a policy removes
its turn, so the previous turn's generated blocks are the next turn's prefix hits.

Block ids follow content, 16 tokens per block, and are prefix-unique: block b's id is fixed by the
id of block b - 1 and the pieces of segments inside block b (a segment has an identity: which
session, turn and kind, and whether it is a summary). So the system prompt and tool blocks are
shared by every session using that system prompt, a session's turns share their common prefix,
and a policy that removes a segment from the history breaks the prefix there, as it does in a real
prefix cache. A prompt's partial last block gets an id of its own. The pinnable segments' block ids
are returned (`AgentWorkload.segment_ids`) for ``kv.prefix_cache.pin``, and each prompt's offsets
of its history turns and its input (`segment_cuts`: where ``kv.segments`` cuts a finished turn).

Left out: token-level content (only lengths and identities), parallel tool calls, sub-agents,
and "important messages kept" in the prompt beyond its window (the documents' 重要消息保留): no
trace says which (``kv.segments``' history window keeps a session's first turns in the cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsim.spec.scenario import AgentConfig, ToolOutputPolicy
from kvsim.spec.segments import SEGMENTS, SegmentPolicies
from kvsim.spec.synthetic import SYNTHETIC_BLOCK_TOKENS, _lengths

__all__ = ["SEGMENTS", "AgentWorkload", "agent_workload", "segment_cuts"]
_SYS, _TOOLS, _USER, _TOOL_OUT, _SUMMARY, _REPLY = range(6)  # segment identity kinds


@dataclass(frozen=True)
class AgentWorkload:
    """Per request (row i, in the workload's order) its session structure and segments."""

    session: np.ndarray  # (n,) int64
    turn: np.ndarray  # (n,) int64: 0 for a session's first
    gap_s: np.ndarray  # (n,) float64: think or tool time after the previous reply (0 for turn 0)
    next_request: np.ndarray  # (n,) int64: the row of the session's next turn, -1 after the last
    segment_tokens: np.ndarray  # (n, len(SEGMENTS)) int64: the prompt's tokens by segment kind
    segment_ids: dict[str, frozenset[int]]  # pinnable segment -> ids of the blocks inside it
    closed_loop: bool
    num_sessions: int
    # (n,) per prompt: the token offset of each earlier turn kept in it, and of this turn's input
    history_starts: tuple[tuple[int, ...], ...] = ()
    input_start: np.ndarray | None = None  # (n,) int64


def agent_workload(
    cfg: AgentConfig, *, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray], int, list[np.ndarray], AgentWorkload]:
    """(arrival_s, prompt_tokens, output_tokens, hash_ids, G, output_hash_ids, agent), in order of
    each turn's earliest arrival."""
    rng = np.random.Generator(np.random.PCG64(seed))
    g = SYNTHETIC_BLOCK_TOKENS
    ns = cfg.sessions
    starts = np.cumsum(rng.exponential(1.0 / cfg.rate_per_s, ns))
    starts -= starts[0]  # the first session starts at 0
    turns = _lengths(rng, cfg.turns, ns)
    n = int(turns.sum())
    user = _lengths(rng, cfg.user, n)
    tool_out = _lengths(rng, cfg.tool_output, n)
    output = _lengths(rng, cfg.output, n)
    calls = rng.random(n) < cfg.tool_call_share  # reply i calls a tool
    system = rng.integers(cfg.system_prompts, size=ns)

    table: dict[tuple[object, ...], int] = {}  # block signature -> id
    seg_ids: dict[str, set[int]] = {"system": set(), "tools": set()}
    heads: dict[int, tuple[Pieces, list[int]]] = {}  # system prompt -> its head's pieces and ids
    rows: list[tuple[float, int, int, int, float, list[int], int, list[int]]] = []
    seg_tok = np.zeros((n, len(SEGMENTS)), dtype=np.int64)
    starts_of: list[tuple[int, ...]] = [()] * n  # per generation index: history turns' offsets
    input_at = np.zeros(n, dtype=np.int64)
    first = np.cumsum(turns) - turns
    for s in range(ns):
        head: list[tuple[tuple[int, ...], int]] = []
        if cfg.system_prompt_tokens:
            head.append(((_SYS, int(system[s])), cfg.system_prompt_tokens))
        if cfg.tool_tokens:
            head.append(((_TOOLS, int(system[s])), cfg.tool_tokens))
        head_sys = cfg.system_prompt_tokens
        t_s = float(starts[s])
        history: list[list[tuple[tuple[int, ...], int]]] = []  # per earlier turn: its pieces
        known = heads.get(int(system[s]))  # the previous stream of this session, or the head's
        for t in range(int(turns[s])):
            i = int(first[s] + t)
            tool_in = t > 0 and bool(calls[i - 1])
            gap = 0.0 if t == 0 else (cfg.tool_time_s if tool_in else cfg.think_time_s)
            t_s += gap
            inp = ((_TOOL_OUT, s, t), int(tool_out[i])) if tool_in else ((_USER, s, t), int(user[i]))
            kept = history if cfg.history_turns == 0 else history[len(history) - cfg.history_turns :]
            pieces = list(head)
            at = sum(length for _, length in head)
            offsets = []
            for h in kept:
                offsets.append(at)
                at += sum(length for _, length in h)
                pieces.extend(h)
            starts_of[i] = tuple(offsets)
            input_at[i] = at
            pieces.append(inp)
            p = sum(length for _, length in pieces)
            o = int(output[i])
            stream = [*pieces, ((_REPLY, s, t), o)]
            ids = _block_ids(stream, (p + o - 1) // g, table, known)
            known = (stream, ids)
            full = p // g
            hash_ids = ids[:full] + ([_fresh(table, ("partial", i))] if p % g else [])
            rows.append((t_s, s, t, i, gap, hash_ids, p, ids[full:]))
            # Segment accounting of the prompt.
            seg_tok[i, 0] = head_sys if cfg.system_prompt_tokens else 0
            seg_tok[i, 1] = cfg.tool_tokens
            seg_tok[i, 2] = sum(length for h in kept for _, length in h)
            seg_tok[i, 3 if tool_in else 4] = inp[1]
            if t == 0:
                head_blocks = sum(length for _, length in head) // g
                heads.setdefault(int(system[s]), (head, ids[:head_blocks]))
                for b in range(head_blocks):
                    seg = "system" if (b + 1) * g <= head_sys else "tools"
                    seg_ids[seg].add(ids[b])
            # This turn's input and reply as history for the next turns, after the policy.
            used: tuple[tuple[int, ...], int] | None = inp
            if tool_in:
                if cfg.tool_outputs is ToolOutputPolicy.DROP:
                    used = None
                elif cfg.tool_outputs is ToolOutputPolicy.COMPRESS:
                    used = ((_SUMMARY, s, t), max(1, int(np.ceil(cfg.compress_ratio * inp[1]))))
            history.append(([used] if used else []) + [((_REPLY, s, t), o)])

    order = sorted(range(n), key=lambda r: (rows[r][0], rows[r][1], rows[r][2]))
    pos = np.empty(n, dtype=np.int64)  # row in generation order -> index in arrival order
    pos[np.asarray(order, dtype=np.int64)] = np.arange(n)
    ordered = [rows[r] for r in order]
    gen_index = [row[3] for row in ordered]  # generation index of each request
    nxt = np.full(n, -1, dtype=np.int64)
    for k, row in enumerate(ordered):
        s, t = row[1], row[2]
        if t + 1 < turns[s]:
            nxt[k] = pos[first[s] + t + 1]
    agent = AgentWorkload(
        session=np.array([row[1] for row in ordered], dtype=np.int64),
        turn=np.array([row[2] for row in ordered], dtype=np.int64),
        gap_s=np.array([row[4] for row in ordered], dtype=np.float64),
        next_request=nxt,
        segment_tokens=seg_tok[np.asarray(gen_index, dtype=np.int64)],
        segment_ids={k: frozenset(v) for k, v in seg_ids.items()},
        closed_loop=cfg.closed_loop,
        num_sessions=ns,
        history_starts=tuple(starts_of[j] for j in gen_index),
        input_start=input_at[np.asarray(gen_index, dtype=np.int64)],
    )
    return (
        np.array([row[0] for row in ordered], dtype=np.float64),
        np.array([row[6] for row in ordered], dtype=np.int64),
        output[np.asarray(gen_index, dtype=np.int64)].astype(np.int64),
        [np.asarray(row[5], dtype=np.int64) for row in ordered],
        g,
        [np.asarray(row[7], dtype=np.int64) for row in ordered],
        agent,
    )


def segment_cuts(policies: SegmentPolicies, agent: AgentWorkload) -> list[int]:
    """Per request, the token offset from which ``kv.segments`` drops its finished turn's blocks
    from the cache (-1: none): the block holding that token and every later one leave (exact-prefix
    reuse cannot reach past a hole). ``tool_output: evict_after_use``: a turn whose input is a tool
    output is cut at that input. ``history: window`` (turns W, retain N): the turn's stream is the
    next prompt's history of k + 1 turns (k earlier turns kept here); past N + W turns the window
    slides, so it is cut at earlier turn N, keeping the head and the first N turns reusable."""
    assert agent.input_start is not None
    n = len(agent.session)
    cuts = [-1] * n
    tool = policies.get("tool_output").policy == "evict_after_use"
    win = policies.get("history")
    tool_in = agent.segment_tokens[:, SEGMENTS.index("tool_output")] > 0
    for i in range(n):
        cut = -1
        if tool and tool_in[i]:
            cut = int(agent.input_start[i])
        if win.policy == "window":
            starts = agent.history_starts[i]
            if len(starts) + 1 > win.retain + win.turns:  # then len(starts) > retain
                at = starts[win.retain]
                cut = at if cut < 0 else min(cut, at)
        cuts[i] = cut
    return cuts


def _fresh(table: dict[tuple[object, ...], int], sig: tuple[object, ...]) -> int:
    return table.setdefault(sig, len(table))


Pieces = list[tuple[tuple[int, ...], int]]


def _block_ids(
    pieces: Pieces,
    num_blocks: int,
    table: dict[tuple[object, ...], int],
    known: tuple[Pieces, list[int]] | None = None,
) -> list[int]:
    """Ids of the first `num_blocks` full blocks of the token stream `pieces` ((identity, tokens)
    in order): each block's signature is the previous block's id and the segment pieces inside it
    (a block inside one piece: that piece and the offset it starts at).
    `known`: another stream and its block ids; the blocks inside the pieces the two share at the
    start are copied from it (the same signatures give the same ids), the rest computed."""
    g = SYNTHETIC_BLOCK_TOKENS
    out: list[int] = []
    prev = -1
    k, off = 0, 0  # current piece and tokens of it already consumed
    if known is not None:
        kp, kids = known
        common = 0  # tokens of the leading pieces the streams share
        j = 0
        while j < len(kp) and j < len(pieces) and kp[j] == pieces[j]:
            common += pieces[j][1]
            j += 1
        reuse = min(common // g, len(kids), num_blocks)
        if reuse:
            out = kids[:reuse]
            prev = out[-1]
            pos = reuse * g  # place (k, off) at the first token not yet covered
            while pos >= pieces[k][1]:
                pos -= pieces[k][1]
                k += 1
            off = pos
        num_blocks -= reuse
    setdefault = table.setdefault
    for _ in range(num_blocks):
        ident, length = pieces[k]
        if length - off > g:  # the usual block: inside one piece, which goes on after it
            prev = setdefault((prev, ident, off), len(table))
            out.append(prev)
            off += g
            continue
        need = g
        inside: list[tuple[tuple[int, ...], int, int]] = []
        while need:
            ident, length = pieces[k]
            take = min(need, length - off)
            if take:
                inside.append((ident, off, off + take))
            off += take
            need -= take
            if off == length:
                k, off = k + 1, 0
        prev = setdefault((prev, tuple(inside)), len(table))
        out.append(prev)
    return out

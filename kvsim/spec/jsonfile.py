"""Strict JSON for every JSON kvsim reads (trace lines, ``config.json``, profiles).

Python's ``json`` accepts ``NaN`` and ``Infinity`` (not JSON), keeps the last of two equal keys
without a word, and raises a bare ``ValueError`` for an integer of more than 4,300 digits. Here each
of those is a `JsonError` with a short message; the caller adds the file and line.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvsim.spec.schema import shorten


class JsonError(ValueError):
    """Malformed or non-standard JSON; ``line`` is 1-based where known."""

    def __init__(self, message: str, line: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.line = line


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise JsonError(f"key {shorten(repr(dup))} appears twice in one object")
    return out


class _Constant(Exception):
    def __init__(self, name: str) -> None:
        self.name = name


def _constant(name: str) -> Any:
    raise _Constant(name)


_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|-?Infinity|NaN|[{}\[\],:]')


def _locate(text: str, name: str) -> tuple[int | None, str | None]:
    """The line and field path (``ops.gemm.points[3].t_p50``) of the first `name` constant outside a
    string: ``json`` calls `parse_constant` without a position, so the text is scanned again."""
    stack: list[list[Any]] = []  # per open container: [kind, key or index]
    last_string: str | None = None
    for m in _TOKEN.finditer(text):
        tok = m.group()
        if tok == name:
            line = text.count("\n", 0, m.start()) + 1
            path = ""
            for kind, at in stack:
                if kind == "{" and at is not None:
                    path += f".{at}" if path else str(at)
                elif kind == "[":
                    path += f"[{at}]"
            return line, path or None
        if tok[0] == '"':
            last_string = tok
        elif tok == ":" and stack and stack[-1][0] == "{" and last_string is not None:
            stack[-1][1] = shorten(json.loads(last_string), 40)
        elif tok in "{[":
            stack.append([tok, None if tok == "{" else 0])
        elif tok in "}]":
            if stack:
                stack.pop()
        elif tok == "," and stack and stack[-1][0] == "[":
            stack[-1][1] += 1
    return None, None


def loads(text: str) -> Any:
    """Parse one JSON document strictly (see the module docstring)."""
    try:
        return json.loads(text, object_pairs_hook=_pairs, parse_constant=_constant)
    except JsonError:
        raise
    except _Constant as exc:
        line, path = _locate(text, exc.name)
        field = f" (at {path})" if path else ""
        raise JsonError(f"{exc.name} is not a JSON number{field}", line) from None
    except json.JSONDecodeError as exc:
        raise JsonError(f"invalid JSON ({exc.msg}, column {exc.colno})", exc.lineno) from None
    except (ValueError, RecursionError) as exc:  # int too long; nesting beyond the recursion limit
        what = "nested too deeply" if isinstance(exc, RecursionError) else shorten(str(exc), 80)
        raise JsonError(f"invalid JSON ({what})") from None

"""Strict JSON for every JSON kvsim reads (trace lines, ``config.json``, profiles).

Python's ``json`` accepts ``NaN`` and ``Infinity`` (not JSON), keeps the last of two equal keys
without a word, and raises a bare ``ValueError`` for an integer of more than 4,300 digits. Here each
of those is a `JsonError` with a short message; the caller adds the file and line.
"""

from __future__ import annotations

import json
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


def _constant(name: str) -> Any:
    raise JsonError(f"{name} is not a JSON number")


def loads(text: str) -> Any:
    """Parse one JSON document strictly (see the module docstring)."""
    try:
        return json.loads(text, object_pairs_hook=_pairs, parse_constant=_constant)
    except JsonError:
        raise
    except json.JSONDecodeError as exc:
        raise JsonError(f"invalid JSON ({exc.msg}, column {exc.colno})", exc.lineno) from None
    except (ValueError, RecursionError) as exc:  # int too long; nesting beyond the recursion limit
        what = "nested too deeply" if isinstance(exc, RecursionError) else shorten(str(exc), 80)
        raise JsonError(f"invalid JSON ({what})") from None

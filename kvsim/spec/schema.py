"""A strict reader over parsed YAML: typed field access with paths, unknown keys rejected.

Every error names the file and the dotted field path (``scenario.yaml: cluster.gpu.hbm: ...``).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable
from typing import Any, TypeVar

from kvsim.errors import KvsimError
from kvsim.spec import bounds

T = TypeVar("T")
MAX_SHOWN = 60  # characters of a value quoted in an error message
_MISSING = object()


class Section:
    """One mapping of the scenario, read field by field; `done()` rejects whatever was not read."""

    def __init__(self, data: object, *, source: str, path: str) -> None:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise KvsimError(f"expected a mapping, got {show(data)}", source=source, path=path or None)
        self.data: dict[str, Any] = data
        self.source = source
        self.path = path
        self.read: set[str] = set()
        self.allowed: list[str] = []

    def _p(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def err(self, key: str, message: str) -> KvsimError:
        return KvsimError(message, source=self.source, path=self._p(key))

    def raw(self, key: str, default: object = _MISSING) -> Any:
        self.allowed.append(key)
        self.read.add(key)
        if key in self.data:
            return self.data[key]
        if default is _MISSING:
            raise self.err(key, "required field is missing")
        return default

    def has(self, key: str) -> bool:
        return key in self.data

    def parsed(self, key: str, parse: Callable[[Any], T], default: object = _MISSING) -> T:
        value = self.raw(key, default)
        # The default only where the key is absent (or null with a null default): a value given
        # is parsed even when it equals the default object (YAML's 0 is the interpreter's 0, so
        # `pool_bytes: 0` passed as the default without the check that refuses it).
        if default is not _MISSING and (key not in self.data or (value is None and default is None)):
            return value  # type: ignore[return-value]
        try:
            out = parse(value)
        except KvsimError as exc:
            if exc.source is not None:  # names a file of its own (a model's config.json): keep it
                raise
            raise KvsimError(exc.message, source=self.source, path=self._p(key)) from None
        bounds.note(out, parse, self.source, self._p(key))  # legal, but far from any device?
        return out

    def int(self, key: str, default: object = _MISSING, *, lo: int = 0, hi: int = 2**62) -> int:
        v = self.raw(key, default)
        if isinstance(v, bool) or not isinstance(v, int):
            if isinstance(v, float) and v.is_integer():
                v = int(v)
            else:
                raise self.err(key, f"expected an integer, got {show(v)}")
        if not lo <= v <= hi:
            raise self.err(key, f"expected an integer in [{lo}, {hi}], got {show(v)}")
        return v

    def float(
        self,
        key: str,
        default: object = _MISSING,
        *,
        lo: float = 0.0,
        hi: float = math.inf,
        lo_open: bool = False,
    ) -> float:
        v = self.raw(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or math.isinf(v):
            raise self.err(key, f"expected a number, got {show(v)}")
        if v < lo or v > hi or (lo_open and v == lo):
            bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
            raise self.err(key, f"expected a number in {bound}, got {v}")
        return float(v)

    def bool(self, key: str, default: object = _MISSING) -> bool:
        v = self.raw(key, default)
        if not isinstance(v, bool):
            raise self.err(key, f"expected true or false, got {show(v)}")
        return v

    def str(self, key: str, default: object = _MISSING) -> str:
        v = self.raw(key, default)
        if not isinstance(v, str) or not v.strip():
            raise self.err(key, f"expected a non-empty string, got {show(v)}")
        return v

    def choice(self, key: str, choices: list[str] | tuple[str, ...], default: object = _MISSING) -> str:
        v = self.raw(key, default)
        if v not in choices:
            hint = did_you_mean(v, choices) if isinstance(v, str) else ""
            raise self.err(
                key, f"expected one of {', '.join(choices)}; got {show(v)}" + (f";{hint}" if hint else "")
            )
        return v  # type: ignore[no-any-return]

    def section(self, key: str, *, required: bool = False) -> Section:
        v = self.raw(key, _MISSING if required else None)
        return Section(v, source=self.source, path=self._p(key))

    def done(self) -> None:
        unknown = [k for k in self.data if k not in self.read]
        if unknown:
            k = unknown[0]
            allowed = ", ".join(sorted(set(self.allowed))) or "(none)"
            raise self.err(
                shorten(str(k)), f"unknown key;{did_you_mean(str(k), self.allowed)} allowed here: {allowed}"
            )


def did_you_mean(word: str, candidates: list[str] | tuple[str, ...] | set[str]) -> str:
    """`` did you mean X?`` for the candidate closest to a misspelt `word` (difflib's ratio >= 0.6),
    or empty: put first in an error so that a long list after it cannot cut it off."""
    close = difflib.get_close_matches(word, sorted(set(candidates)), n=1)
    return f" did you mean {close[0]!r}?" if close else ""


def shorten(text: str, limit: int = MAX_SHOWN) -> str:
    """`text` cut to `limit` characters (the full length marks the cut), so that an error stays one
    short line whatever the value (a 35 MB alias expansion, a 5,000-digit number)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def show(v: object) -> str:
    """A value as an error message quotes it: repr, a container by its type, at most MAX_SHOWN chars."""
    if isinstance(v, (dict, list, tuple, set)):
        return type(v).__name__
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) > 10**40:
        return f"an integer of {len(str(abs(v))):,} digits"
    return shorten(repr(v))

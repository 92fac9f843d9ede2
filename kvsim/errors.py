"""Errors a user can cause, each carrying where it came from.

A `KvsimError` is a caller mistake (bad YAML, trace, profile, flag). The CLI prints it as one line,
``FILE: PATH: message``, and exits with code 2. Internal invariants use ``assert`` instead.
"""

from __future__ import annotations


class KvsimError(Exception):
    """A user-facing error: ``source`` (a file or flag) and ``path`` (a field path or line)."""

    def __init__(self, message: str, *, source: str | None = None, path: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.source = source
        self.path = path

    def located(self, *, source: str | None = None, path_prefix: str | None = None) -> KvsimError:
        """Return a copy with a source and/or a path prefix filled in where missing."""
        path = self.path
        if path_prefix:
            path = f"{path_prefix}.{path}" if path else path_prefix
        return KvsimError(self.message, source=self.source or source, path=path)

    def __str__(self) -> str:
        parts = [p for p in (self.source, self.path) if p]
        return ": ".join([*parts, self.message])

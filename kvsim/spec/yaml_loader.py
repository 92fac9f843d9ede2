"""The one YAML loader for scenarios and ``--set`` values: YAML 1.2 scalars, strict structure.

PyYAML's ``safe_load`` follows YAML 1.1, which reads ``0100`` as octal 64, ``1e3`` as a string,
``yes``/``no``/``on``/``off`` as booleans and ``1:30`` as 90. This loader resolves plain scalars by
the YAML 1.2 core schema instead (``1e3`` and ``1e-1`` are numbers; ``yes`` and ``2024-01-01`` are
strings) and refuses the numbers the two versions read differently (``0100``, ``1_000``) with a
hint. It keeps merge keys (``<<: *defaults``; keys given beside the merge win, as YAML says),
refuses a key given twice in one mapping, a list or mapping used as a key, nesting deeper than
`MAX_DEPTH`, documents that expand (through aliases) to more than `MAX_NODES` nodes and files over
`MAX_BYTES`. Every refusal is one `KvsimError` naming the file and the line.

Left out: tags beyond the safe ones, multi-document streams (one document a file).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, ClassVar

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from kvsim.errors import KvsimError
from kvsim.spec.schema import shorten

MAX_DEPTH = 64  # a scenario nests 4 levels; 64 leaves room and keeps Python's recursion far away
MAX_NODES = 100_000  # a scenario has ~100 nodes; this refuses alias bombs ("billion laughs") at once
MAX_BYTES = 1 << 20  # 1 MiB: a scenario is a few KiB

_AMBIGUOUS = "tag:kvsim:ambiguous-number"
_MERGE = "tag:yaml.org,2002:merge"


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 core-schema resolution and the structural limits above."""

    yaml_implicit_resolvers: ClassVar[dict[str, list[tuple[str, re.Pattern[str]]]]] = {}  # 1.1 ones dropped

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels", mark)
            return super().compose_node(parent, index)  # type: ignore[no-any-return]
        finally:
            self._depth -= 1


def _resolver(tag: str, pattern: str, first: str) -> None:
    _Loader.add_implicit_resolver(tag, re.compile(pattern, re.X), list(first))


# YAML 1.2.2 core schema (section 10.3.2), and the 1.1 forms it reads differently refused.
_resolver("tag:yaml.org,2002:null", r"^(?:~|null|Null|NULL|)$", "~nN")
_Loader.add_implicit_resolver("tag:yaml.org,2002:null", re.compile(r"^$"), [""])
_resolver("tag:yaml.org,2002:bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF")
# Refused first: a resolver list is tried in order, and the int pattern would take "0100".
_resolver(_AMBIGUOUS, r"^(?:[-+]?0[0-9]+|[-+]?[0-9][0-9_]*_[0-9_]*(?:\.[0-9_]*)?)$", "-+0123456789")
_resolver("tag:yaml.org,2002:int", r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$", "-+0123456789")
_resolver(
    "tag:yaml.org,2002:float",
    r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$",
    "-+0123456789.",
)
_resolver(_MERGE, r"^(?:<<)$", "<")


def _int(loader: _Loader, node: ScalarNode) -> int:
    text = loader.construct_scalar(node)
    try:
        if text.startswith("0o"):
            return int(text[2:], 8)
        if text.startswith("0x"):
            return int(text[2:], 16)
        return int(text)
    except ValueError:  # more digits than Python converts (4,300)
        raise ConstructorError(
            None, None, f"integer too long ({len(text):,} digits)", node.start_mark
        ) from None


def _float(loader: _Loader, node: ScalarNode) -> float:
    text = loader.construct_scalar(node)
    low = text.lower()
    if low.endswith(".inf"):
        return float("-inf") if low.startswith("-") else float("inf")
    if low == ".nan":
        return float("nan")
    return float(text)


def _ambiguous(loader: _Loader, node: ScalarNode) -> None:
    text = shorten(loader.construct_scalar(node))
    plain = text.replace("_", "").lstrip("+")
    sign = "-" if plain.startswith("-") else ""
    digits = plain.lstrip("-").lstrip("0") or "0"
    raise ConstructorError(
        None,
        None,
        f"ambiguous number {text!r} (YAML 1.1 and 1.2 read it differently); "
        f"write {sign}{digits}, or quote it for a string",
        node.start_mark,
    )


def _mapping(loader: _Loader, node: MappingNode) -> dict[Any, Any]:
    """A mapping whose own keys are scalars given once; merged keys (``<<``) yield to its own."""
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == _MERGE:
            continue
        if not isinstance(key_node, ScalarNode):
            kind = "list" if isinstance(key_node, SequenceNode) else "mapping"
            raise ConstructorError(None, None, f"a {kind} cannot be a key", key_node.start_mark)
        key = loader.construct_object(key_node)
        if key in seen:
            raise ConstructorError(None, None, f"duplicate key {shorten(repr(key))}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node)


_Loader.add_constructor("tag:yaml.org,2002:int", _int)
_Loader.add_constructor("tag:yaml.org,2002:float", _float)
_Loader.add_constructor(_AMBIGUOUS, _ambiguous)
_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def _expanded(root: Node) -> tuple[int, int]:
    """(nodes, depth) of the document with every alias expanded, without expanding it: each
    distinct node is visited once. A node that contains itself is an error."""
    size: dict[int, tuple[int, int]] = {}
    stack: list[tuple[Node, bool]] = [(root, False)]
    open_: set[int] = set()
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            open_.discard(key)
            kids = _children(node)
            n = 1 + sum(size[id(c)][0] for c in kids)
            d = 1 + max((size[id(c)][1] for c in kids), default=0)
            size[key] = (min(n, MAX_NODES + 1), d)
            continue
        if key in size:
            continue
        if key in open_:
            raise yaml.composer.ComposerError(
                None, None, "an alias refers to its own parent", node.start_mark
            )
        open_.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in size)
    return size[id(root)]


def _children(node: Node) -> list[Node]:
    if isinstance(node, SequenceNode):
        return list(node.value)
    if isinstance(node, MappingNode):
        return [x for pair in node.value for x in pair]
    return []


def _load(text: str) -> Any:
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        nodes, depth = _expanded(node)
        if nodes > MAX_NODES or depth > MAX_DEPTH:
            what = (
                f"more than {MAX_NODES:,} values" if nodes > MAX_NODES else f"deeper than {MAX_DEPTH} levels"
            )
            raise yaml.composer.ComposerError(None, None, f"aliases expand it to {what}", node.start_mark)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _problem(exc: yaml.YAMLError) -> tuple[str, str | None]:
    mark = getattr(exc, "problem_mark", None)
    where = f"line {mark.line + 1}" if mark is not None else None
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return shorten(str(problem), 160), where


def read_yaml(path: Path) -> Any:
    """Parse a YAML file (see the module docstring). Raises `KvsimError` naming the file and line."""
    if not path.is_file():
        raise KvsimError("not a file" if path.exists() else "file not found", source=str(path))
    try:
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise KvsimError(f"file too large ({size:,} bytes; at most {MAX_BYTES:,})", source=str(path))
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KvsimError(f"cannot read: {shorten(str(exc), 120)}", source=str(path)) from None
    try:
        return _load(text)
    except yaml.YAMLError as exc:
        problem, where = _problem(exc)
        raise KvsimError(f"invalid YAML: {problem}", source=str(path), path=where) from None
    except RecursionError:
        raise KvsimError(f"invalid YAML: nested deeper than {MAX_DEPTH} levels", source=str(path)) from None


def yaml_scalar(text: str, *, source: str) -> Any:
    """One ``--set`` value, read like a value in the file; text YAML cannot parse stays a string."""
    try:
        return _load(text)
    except ConstructorError as exc:
        if exc.problem and exc.problem.startswith("ambiguous number"):
            raise KvsimError(_problem(exc)[0], source=source) from None
        return text
    except yaml.YAMLError:
        return text

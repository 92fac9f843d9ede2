"""What a sweep runs: factors of overrides, their product, and each point's name.

A sweep is the cartesian product of *factors*, each a list of override sets (``--set``-style
``path=value`` strings): a ``--grid`` axis is one factor with one override per value; the
``--zip`` axes together are one factor whose i-th set takes the i-th value of every zipped axis;
a sweep file's ``points`` list is one factor of explicit sets. The first factor varies slowest.
Parsing here checks the shape only (a dotted path, at least one value, equal zip lengths, no path
twice in one point); whether a value is valid is the scenario loader's answer, asked for every
point before any runs (`kvsim.sweep.runner`). A file a sweep file names (a trace, a profile, a
model's config.json) is relative to the sweep file, and becomes a path from the working directory
as ``--set`` reads it; a ``--grid`` or ``--zip`` value is relative to the working directory already.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsim.errors import KvsimError
from kvsim.spec.models import names_a_file
from kvsim.spec.scenario import OVERRIDE_PATHS
from kvsim.spec.schema import shorten
from kvsim.spec.yaml_loader import read_yaml, yaml_scalar

MAX_POINTS = 10_000  # a typo such as --grid cluster.nodes=1,2,...,999 x 5 axes; a guard, not a measurement
_ID_CHARS = re.compile(r"[^A-Za-z0-9._=,+-]")
_MAX_SLUG = 80  # characters of overrides kept in a point's directory name
_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$")


@dataclass(frozen=True)
class Factor:
    """One dimension of the product: its label (``--grid kv.format``), the paths it sets, and its
    override sets, each a tuple of ``path=value`` strings."""

    label: str
    paths: tuple[str, ...]
    sets: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class SweepPoint:
    index: int
    id: str  # directory name under points/: index and overrides, filesystem-safe
    overrides: tuple[str, ...]
    origins: tuple[str, ...]  # per override: the flag or file field it came from


def _check_path(path: str, source: str) -> str:
    path = path.strip()
    if not _PATH.match(path):
        raise KvsimError(
            f"expected a dotted field path such as kv.format, got {shorten(repr(path))}", source=source
        )
    return path


def _value_text(value: Any, source: str) -> str:
    """A YAML value of a sweep file as ``--set`` text that reads back as the same value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        if not value.strip():
            raise KvsimError("empty value", source=source)
        try:
            same = yaml_scalar(value, source=source) == value
        except KvsimError:
            same = False
        return value if same else json.dumps(value)
    raise KvsimError(f"expected a scalar value, got {type(value).__name__}", source=source)


def parse_axis(text: str, flag: str) -> tuple[str, list[str]]:
    """``PATH=v1,v2,...`` -> (path, ['PATH=v1', 'PATH=v2', ...])."""
    if "=" not in text:
        raise KvsimError(f"expected PATH=V1,V2,..., got {shorten(repr(text))}", source=flag)
    key, _, vals = text.partition("=")
    path = _check_path(key, flag)
    values = [v.strip() for v in vals.split(",")]
    if not vals.strip():
        raise KvsimError(f"{path}: empty axis; give at least one value", source=flag)
    if any(not v for v in values):
        raise KvsimError(f"{path}: empty value in {shorten(repr(vals))}", source=flag)
    if len(set(values)) != len(values):
        raise KvsimError(f"{path}: a value is given twice in {shorten(repr(vals))}", source=flag)
    return path, [f"{path}={v}" for v in values]


def grid_factor(text: str) -> Factor:
    path, sets = parse_axis(text, "--grid")
    return Factor(f"--grid {path}", (path,), tuple((s,) for s in sets))


def zip_factor(axes: list[tuple[str, list[str]]], label: str, source: str) -> Factor:
    """Axes varied together: all of one length."""
    lengths = {len(v) for _, v in axes}
    if len(lengths) > 1:
        sizes = ", ".join(f"{p} has {len(v)}" for p, v in axes)
        raise KvsimError(f"zipped axes must have as many values each: {sizes}", source=source)
    paths = tuple(p for p, _ in axes)
    return Factor(label, paths, tuple(zip(*(v for _, v in axes), strict=True)))


def _from_file(path: str, value: Any, sweep_file: str) -> Any:
    """A sweep file's value for field `path`: a file it names, relative to the sweep file, as a
    path from the working directory (what an override's value is relative to)."""
    model = OVERRIDE_PATHS.get(path)
    if model is None or not isinstance(value, str) or not value.strip() or Path(value).is_absolute():
        return value
    if model and not names_a_file(value):
        return value
    return os.path.normpath(Path(sweep_file).parent / value)


def _file_axes(section: Any, source: str, field: str) -> list[tuple[str, list[str]]]:
    if not isinstance(section, dict) or not section:
        raise KvsimError("expected a mapping of field path -> list of values", source=source, path=field)
    out = []
    for key, values in section.items():
        where = f"{field}.{key}"
        path = _check_path(str(key), f"{source}: {where}")
        if not isinstance(values, list) or not values:
            raise KvsimError("expected a non-empty list of values", source=source, path=where)
        texts = [_value_text(_from_file(path, v, source), f"{source}: {where}") for v in values]
        if len(set(texts)) != len(texts):
            raise KvsimError("a value is given twice", source=source, path=where)
        out.append((path, [f"{path}={t}" for t in texts]))
    return out


def load_sweep_file(path: str) -> list[Factor]:
    """A sweep file's factors: ``grid`` (path -> values, a product), ``zip`` (path -> values,
    varied together; or a list of such groups) and ``points`` (a list of path -> value maps), in
    that order. scenarios/README.md documents the format."""
    data = read_yaml(Path(path))
    if not isinstance(data, dict):
        raise KvsimError("expected a mapping with grid, zip or points", source=path)
    unknown = sorted(set(data) - {"grid", "zip", "points"})
    if unknown:
        raise KvsimError("unknown key; expected grid, zip or points", source=path, path=str(unknown[0]))
    factors: list[Factor] = []
    if "grid" in data:
        for p, sets in _file_axes(data["grid"], path, "grid"):
            factors.append(Factor(f"{path}: grid.{p}", (p,), tuple((s,) for s in sets)))
    if "zip" in data:
        groups = data["zip"] if isinstance(data["zip"], list) else [data["zip"]]
        for i, group in enumerate(groups):
            field = "zip" if not isinstance(data["zip"], list) else f"zip[{i}]"
            factors.append(zip_factor(_file_axes(group, path, field), f"{path}: {field}", f"{path}: {field}"))
    if "points" in data:
        pts = data["points"]
        if not isinstance(pts, list) or not pts:
            raise KvsimError("expected a non-empty list of mappings", source=path, path="points")
        point_sets: list[tuple[str, ...]] = []
        paths: list[str] = []
        for i, pt in enumerate(pts):
            where = f"points[{i}]"
            if not isinstance(pt, dict) or not pt:
                raise KvsimError("expected a mapping of field path -> value", source=path, path=where)
            one = []
            for key, value in pt.items():
                p = _check_path(str(key), f"{path}: {where}")
                one.append(f"{p}={_value_text(_from_file(p, value, path), f'{path}: {where}.{p}')}")
                if p not in paths:
                    paths.append(p)
            point_sets.append(tuple(one))
        factors.append(Factor(f"{path}: points", tuple(paths), tuple(point_sets)))
    if not factors:
        raise KvsimError("no grid, zip or points: nothing to sweep", source=path)
    return factors


def point_id(index: int, overrides: tuple[str, ...], width: int) -> str:
    """``007-format=fp8,nodes=2``: the index, then each override with its path's last part, made
    filesystem-safe (other characters become ``_``; a long tail is cut at an override's end). The
    index keeps ids unique and sorted."""
    short = [o.split("=", 1)[0].rsplit(".", 1)[-1] + "=" + o.split("=", 1)[1] for o in overrides]
    slug = _ID_CHARS.sub("_", ",".join(short))
    if len(slug) > _MAX_SLUG:
        cut = slug[:_MAX_SLUG]
        slug = cut[: cut.rfind(",")] if "," in cut else cut
    return f"{index:0{width}d}-{slug.strip('.') or 'point'}"


def expand(factors: list[Factor]) -> list[SweepPoint]:
    """The product of `factors`, first slowest; refuses a path set by two factors."""
    if not factors:
        raise KvsimError("nothing to sweep: give --grid, --zip or --file", source="kvsim sweep")
    seen: dict[str, str] = {}
    for f in factors:
        for p in f.paths:
            if p in seen:
                raise KvsimError(f"{p} is swept twice: by {seen[p]} and by {f.label}", source="kvsim sweep")
            seen[p] = f.label
    total = 1
    for f in factors:
        total *= len(f.sets)
    if total > MAX_POINTS:
        raise KvsimError(f"{total:,} points; at most {MAX_POINTS:,} in one sweep", source="kvsim sweep")
    width = max(3, len(str(total - 1)))
    points = []
    for i, combo in enumerate(itertools.product(*(f.sets for f in factors))):
        overrides = tuple(o for s in combo for o in s)
        origins = tuple(f.label for f, s in zip(factors, combo, strict=True) for _ in s)
        points.append(SweepPoint(i, point_id(i, overrides, width), overrides, origins))
    return points

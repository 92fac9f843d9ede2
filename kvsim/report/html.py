"""The pages' HTML: Jinja2 templates (``templates/*.html.j2``) with autoescaping, and plotly.js.

Every tag kvsim writes is in a template. Python hands the templates plain text, which is escaped,
or `Markup` made by a template's macro (``parts.html.j2``: tables, notes, spans, links), which is
not; no module escapes by hand. A page with charts loads plotly.js from ``plotly.min.js``, written
once per output folder (`write_plotly_js`) and referenced by a relative ``<script src>``, so that
a folder of pages opens offline from disk and holds one copy of the library, not one per page.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup

from kvsim.errors import KvsimError

PLOTLY_JS = "plotly.min.js"
# The first line of the plotly.min.js kvsim writes: how `is_plotly_js` knows the file is kvsim's.
_PLOTLY_MARK = b"/* plotly.js for the kvsim pages in this folder; written by kvsim, which replaces it */\n"


@cache
def _env() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.PackageLoader("kvsim.report", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


def render(template: str, **context: Any) -> str:
    """The page `template` (a file in templates/) rendered with `context`."""
    return _env().get_template(template).render(**context)


def _parts() -> Any:
    return _env().get_template("parts.html.j2").module


# The building blocks, each a macro of parts.html.j2: text arguments are escaped, Markup is not.
def table(rows: Iterable[Iterable[Any]], header: Iterable[Any] | None = None, cls: str = "") -> Markup:
    """A table in a box that scrolls sideways when it is wider than the page."""
    return Markup(_parts().table([list(r) for r in rows], None if header is None else list(header), cls))


def para(text: Any, cls: str = "") -> Markup:
    return Markup(_parts().para(text, cls))


def note(text: Any) -> Markup:
    return para(text, "note")


def span(text: Any, cls: str = "", **data: Any) -> Markup:
    """``<span class=cls data-KEY=VALUE...>text</span>``."""
    return Markup(_parts().span(text, cls, data))


def link(href: str, text: Any) -> Markup:
    return Markup(_parts().link(href, text))


def code(text: Any) -> Markup:
    return Markup(_parts().code(text))


def bold(text: Any) -> Markup:
    return Markup(_parts().bold(text))


def items(values: Iterable[Any], cls: str = "") -> Markup:
    """A bulleted list."""
    return Markup(_parts().items(list(values), cls))


def lines(values: Iterable[Any]) -> Markup:
    """Values one per line (``<br>`` between them)."""
    return Markup(_parts().lines(list(values)))


def join(parts: Iterable[Any], sep: str = "") -> Markup:
    """Text and Markup joined, the text escaped (``Markup(sep).join``)."""
    return Markup(sep).join(parts)


def section(title: Any, *body: Any) -> Markup:
    """``<h2>title</h2>`` and the body's parts (empty ones left out), one per line."""
    return Markup(_parts().section(title, [b for b in body if b]))


def plotly_js_bytes() -> bytes:
    from plotly.offline import get_plotlyjs

    return _PLOTLY_MARK + str(get_plotlyjs()).encode("utf-8")


def is_plotly_js(path: Path) -> bool:
    """Whether `path` is a plotly.min.js that kvsim wrote (its first line says so)."""
    try:
        with path.open("rb") as f:
            return f.read(len(_PLOTLY_MARK)) == _PLOTLY_MARK
    except OSError:
        return False


def write_plotly_js(folder: Path) -> Path:
    """Write ``folder/plotly.min.js`` unless it already holds these bytes; returns its path. The
    caller has checked that the file may be written (`kvsim.report.outputs.check_output_dir`)."""
    path = Path(folder) / PLOTLY_JS
    data = plotly_js_bytes()
    try:
        if path.is_file() and path.stat().st_size == len(data) and path.read_bytes() == data:
            return path
        tmp = path.with_name(f".{PLOTLY_JS}.partial")
        tmp.write_bytes(data)
        tmp.replace(path)
    except OSError as exc:
        raise KvsimError(f"cannot write plotly.js: {exc.strerror or exc}", source=str(path)) from None
    return path

"""The pages kvsim writes make no network request: no page and no template names an external URL,
and the one file they load, plotly.min.js beside them, holds only the hosts docs/architecture.md
lists (report section), in code kvsim's charts never run (map tiles, CDNs, links in messages).
tests/test_browser.py checks the same in Chromium where it is installed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvsim.cli import main
from kvsim.report.html import plotly_js_bytes

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "kvsim" / "report" / "templates"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
TRACE = "arrival_s,prompt_tokens,output_tokens\n0,64,8\n0.5,128,16\n1.0,32,4\n"
SCENARIO = """model: llama-3.1-8b
cluster: {gpu: h100-sxm, gpus_per_node: 1}
workload: {trace: trace.csv, format: generic}
"""
# The hosts named in plotly.min.js's code (its /*! licence */ comments left out), as
# docs/architecture.md lists them: XML namespaces, links in messages and docs, map tiles, styles
# and fonts (map traces only), the topojson CDN (geo traces), Chart Studio (showLink, off).
PLOTLY_HOSTS = {
    "www.w3.org",
    "github.com",
    "plotly.com",
    "get.webgl.org",
    "maplibre.org",
    "www.esri.com",
    "www.openstreetmap.org",
    "wiki.openstreetmap.org",
    "basemaps.cartocdn.com",
    "tiles.basemaps.cartocdn.com",
    "tile.openstreetmap.org",
    "server.arcgisonline.com",
    "geoserveis.icgc.cat",
    "tilemaps.icgc.cat",
    "fonts.openmaptiles.org",
    "cdn.jsdelivr.net",
    "cdn.plot.ly",
    "cloud.plotly.com",
}
_URL = re.compile(r"https?://([A-Za-z0-9.-]+)", re.IGNORECASE)
_LICENCE = re.compile(r"/\*![\s\S]*?\*/")  # a /*! ... */ comment: what minifiers keep, the licences
# What a page fetches from: an element's src/href/srcset/action/data, a CSS url() or @import.
_FETCH = re.compile(
    r"""\b(?:src|href|srcset|action|data|poster)\s*=\s*["']?([^"'\s>]*)|url\(\s*["']?([^"')]*)|@import"""
)


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict[str, Path]:
    """Every kind of page kvsim writes: a run's report, a comparison, a sweep's and a plan's page
    with their points' reports, and the stack page."""
    root = tmp_path_factory.mktemp("pages")
    (root / "trace.csv").write_text(TRACE)
    (root / "s.yaml").write_text(SCENARIO)
    mp = pytest.MonkeyPatch()
    request.addfinalizer(mp.undo)
    mp.chdir(root)
    for argv in (
        ["run", "s.yaml", "--out", "a", "--no-progress"],
        ["run", "s.yaml", "--set", "kv.format=fp8", "--out", "b", "--no-progress"],
        ["report", "a", "b", "--out", "cmp.html"],
        ["sweep", "s.yaml", "--grid", "kv.format=bf16,fp8", "--out", "sw", "--jobs", "1", "--no-progress"],
        ["plan", "s.yaml", "--slo", "ttft_p99=10s", "--out", "pl", "--jobs", "1", "--no-progress"],
        ["stack", "s.yaml", "--out", "st", "--no-progress"],
    ):
        assert main(argv) == 0, argv
    found = {str(p.relative_to(root)): p for p in sorted(root.rglob("*.html"))}
    kinds = ("a/report.html", "cmp.html", "sw/sweep.html", "pl/plan.html", "st/stack.html")
    assert set(kinds) <= set(found) and any("/points/" in k for k in found), sorted(found)
    return found


def test_no_page_names_an_external_url_or_fetches_from_another_host(pages: dict[str, Path]):
    for name, path in pages.items():
        text = path.read_text(encoding="utf-8")
        assert not _URL.search(text), (name, _URL.search(text))
        for m in _FETCH.finditer(text):
            target = m.group(1) or m.group(2) or ""
            # only relative paths and anchors: no scheme (http:, ftp:...), no protocol-relative //host
            assert not re.match(r"[A-Za-z][A-Za-z0-9+.-]*:|//", target) and m.group(0) != "@import", (
                name,
                m.group(0),
            )
    sources = {
        m for p in pages.values() for m in re.findall(r"<script\b[^>]*\bsrc=\"([^\"]*)\"", p.read_text())
    }
    assert sources == {"plotly.min.js", "../../plotly.min.js"}, sources  # the one script a page loads


def test_no_template_names_an_external_url():
    templates = sorted(TEMPLATES.glob("*.j2"))
    assert len(templates) >= 6
    for t in templates:
        assert not _URL.search(t.read_text(encoding="utf-8")), (t.name, _URL.search(t.read_text()))


def test_plotly_js_names_only_the_documented_hosts():
    js = plotly_js_bytes().decode("utf-8")
    licences = _LICENCE.findall(js)
    assert licences and any("license" in c.lower() for c in licences)
    code_hosts = {h.lower() for h in _URL.findall(_LICENCE.sub("", js))}
    # A plotly.js that adds a host fails here until docs/architecture.md says what it is.
    assert code_hosts <= PLOTLY_HOSTS, sorted(code_hosts - PLOTLY_HOSTS)
    assert {"cdn.plot.ly", "basemaps.cartocdn.com"} <= code_hosts  # the check sees the code's URLs
    doc = ARCHITECTURE.read_text(encoding="utf-8")
    assert all(f"`{h}`" in doc for h in PLOTLY_HOSTS), sorted(h for h in PLOTLY_HOSTS if f"`{h}`" not in doc)

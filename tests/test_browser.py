"""The run, comparison and sweep reports in headless Chromium (Debian's /usr/bin/chromium, which
.ci/run installs): no console errors, no network requests, and every plotly figure drew."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvsim.cli import main
from tests.helpers import CHROMIUM, chromium_args, run_guarded

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="chromium is not installed (.ci/run installs it)"
)

SCENARIO = """\
model: llama-3.1-8b
cluster: {gpu: h100-sxm, gpus_per_node: 1}
workload: {synthetic: {num_requests: 16, rate: 6}}
sim: {seed: 4}
"""
# An element that would fetch something: script/link/img with an http(s) src or href.
_REMOTE = re.compile(r"<(?:script|link|img)\b[^>]*\b(?:src|href)\s*=\s*[\"']?\s*https?://", re.IGNORECASE)


def _chromium(page: Path, profile: Path) -> tuple[str, str]:
    """(dumped DOM, stderr log) of `page` after 5 s of virtual time."""
    cmd = [
        *chromium_args(
            profile, "--enable-logging=stderr", "--v=0", "--virtual-time-budget=5000", "--dump-dom"
        ),
        page.resolve().as_uri(),
    ]
    r = run_guarded(cmd, capture_output=True, text=True, check=False)
    return r.stdout, r.stderr


def _console_errors(log: str) -> list[str]:
    return [ln for ln in log.splitlines() if "Uncaught" in ln or ("CONSOLE(" in ln and "Error" in ln)]


def _figures(page_html: str) -> int:
    """The plotly figures the generated page defines (one div each)."""
    return page_html.count('class="plotly-graph-div"')


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("browser")
    sc = root / "s.yaml"
    sc.write_text(SCENARIO)
    for fmt in ("bf16", "fp8"):
        argv = ["run", str(sc), "--set", f"kv.format={fmt}", "--out", str(root / fmt), "--no-progress"]
        assert main(argv) == 0
    cmp = root / "cmp.html"
    assert main(["report", str(root / "bf16"), str(root / "fp8"), "--out", str(cmp)]) == 0
    sweep = root / "sweep"
    argv = ["sweep", str(sc), "--grid", "kv.format=bf16,fp8", "--out", str(sweep), "--no-progress"]
    assert main(argv) == 0
    return {"run": root / "bf16" / "report.html", "compare": cmp, "sweep": sweep / "sweep.html"}


def test_the_console_check_catches_an_error(tmp_path: Path):
    bad = tmp_path / "bad.html"
    bad.write_text('<!doctype html><html><body><script>throw new Error("x")</script></body></html>')
    _, log = _chromium(bad, tmp_path / "profile")
    assert _console_errors(log), log[-2000:]


@pytest.mark.parametrize("kind", ["run", "compare", "sweep"])
def test_page_loads_offline_without_errors_and_draws_every_chart(
    pages: dict[str, Path], tmp_path: Path, kind: str
):
    page = pages[kind]
    source = page.read_text(encoding="utf-8")
    n = _figures(source)
    assert n >= 1
    dom, log = _chromium(page, tmp_path / "profile")
    assert not _console_errors(log), _console_errors(log)
    assert dom.startswith("<") and "</html>" in dom
    assert not _REMOTE.search(dom), _REMOTE.search(dom)
    assert not _REMOTE.search(source)
    # Every figure div holds plotly's drawn svg: split the DOM at the figure divs and look in each.
    starts = [m.start() for m in re.finditer(r'<div[^>]*class="[^"]*plotly-graph-div', dom)]
    assert len(starts) == n
    pieces = [dom[i:j] for i, j in zip(starts, [*starts[1:], len(dom)], strict=True)]
    assert all('class="main-svg"' in p for p in pieces), [p[:120] for p in pieces if "main-svg" not in p]
    assert dom.count('class="main-svg"') >= n

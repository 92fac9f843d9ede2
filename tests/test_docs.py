"""Keeps scenarios/README.md readable and complete: short table cells, links that resolve, a section
per part of a scenario, and every key the scenario reader accepts documented."""

import re
from pathlib import Path

import pytest

from kvsim.spec import schema
from kvsim.spec.scenario import load_scenario

ROOT = Path(__file__).parent.parent
README = ROOT / "scenarios" / "README.md"
MAX_CELL = 300  # characters; a longer explanation goes in prose under the table
SCENARIOS = sorted((ROOT / "scenarios").rglob("*.yaml")) + sorted(
    (ROOT / "tests/scenarios/valid").glob("*.yaml")
)
# Parts no shipped or corpus scenario turns on, set on the default scenario so their keys are read.
EXTRA = [
    (
        "scheduler.spec_decode.k=4",
        "scheduler.spec_decode.acceptance.dist=beta",
        "scheduler.spec_decode.acceptance.mean=0.7",
        "scheduler.spec_decode.acceptance.concentration=10",
        "scheduler.spec_decode.draft.kind=mtp",
        "scheduler.spec_decode.draft.layer_fraction=1",
    ),
    (
        "scheduler.spec_decode.k=4",
        "scheduler.spec_decode.acceptance.mean=0.7",
        "scheduler.spec_decode.draft.kind=model",
        "scheduler.spec_decode.draft.model=llama-3.1-8b",
    ),
    ("kv.format=int4", "kv.format_mix.format=int8", "kv.format_mix.share=0.25"),
    ("kv.offload.enabled=true", "kv.offload.ssd.capacity=1TB"),
    ("faults.random.rate_per_hour=0.001", "faults.random.mean_down_s=600"),
]


def text() -> str:
    return README.read_text()


def table_cells(doc: str) -> list[tuple[int, str]]:
    """Every cell of every Markdown table, with its line number (GFM splits on unescaped pipes)."""
    cells = []
    for n, line in enumerate(doc.splitlines(), 1):
        if line.startswith("|"):
            cells += [(n, c.strip()) for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
    return cells


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def documented_names(doc: str) -> set[str]:
    names: set[str] = set()
    for span in re.findall(r"`([^`]+)`", doc.replace("```", "")):
        names |= set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", span))
    return names


def test_table_cells_are_short():
    long = [(n, len(c), c[:60]) for n, c in table_cells(text()) if len(c) > MAX_CELL]
    assert not long, f"table cells over {MAX_CELL} characters (line, length, start): {long}"


def test_cell_check_sees_a_long_cell():
    assert max(len(c) for _, c in table_cells("| a | " + "x" * 400 + " |\n")) == 400
    assert [c for _, c in table_cells(r"| `a\|b` | c |")] == [r"`a\|b`", "c"]


def test_in_page_links_resolve():
    doc = text()
    anchors = {slug(h) for h in re.findall(r"^#{1,6} (.+)$", doc, flags=re.M)}
    links = re.findall(r"\]\(#([^)]+)\)", doc)
    assert links, "the table of contents links to the sections"
    assert sorted(set(links) - anchors) == []


def test_slug_matches_github():
    assert slug("`kv.offload`: host DRAM and SSD") == "kvoffload-host-dram-and-ssd"
    assert slug("Global pool (`scope: global`)") == "global-pool-scope-global"


def test_a_section_per_part():
    headings = set(re.findall(r"^### (.+)$", text(), flags=re.M))
    parts = ("name", "model", "cluster", "kv", "scheduler", "workload", "slo", "pricing", "cost_model", "sim")
    assert [p for p in parts if f"`{p}`" not in headings] == []


@pytest.fixture(scope="module")
def keys_read() -> dict[str, set[str]]:
    """Every key the scenario reader asked for, by section path, over the shipped and corpus
    scenarios and EXTRA (a section records the keys it reads: `Section.allowed`)."""
    seen: dict[str, set[str]] = {}
    done = schema.Section.done

    def recording(self: schema.Section) -> None:
        if self.source.endswith(".yaml"):  # not a model's config.json
            seen.setdefault(self.path, set()).update(self.allowed)
        done(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(schema.Section, "done", recording)
        for path in SCENARIOS:
            load_scenario(path)
        for overrides in EXTRA:
            load_scenario(ROOT / "scenarios" / "default.yaml", overrides)
    return seen


def test_every_scenario_key_is_documented(keys_read):
    assert {"", "kv.offload.ssd", "scheduler.spec_decode.draft", "kv.format_mix"} <= set(keys_read)
    names = documented_names(text())
    missing = {path or "(top)": sorted(keys - names) for path, keys in keys_read.items() if keys - names}
    assert missing == {}, f"keys the scenario reader accepts but scenarios/README.md does not name: {missing}"

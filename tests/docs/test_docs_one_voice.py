"""One voice: a fact that several pages state comes from one source, and these checks fail
when a page drifts from it. Each check names the source: the benchmark data files, the
code's own counts and names, the trainer's config."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import handbook_docs_support as support

pytestmark = pytest.mark.docs

FENCE = re.compile(r"^```.*?^```", re.M | re.S)
NUMBER = r"\d{1,3}(?:,\d{3})+"
# "202,657 tokens per second", "283,013 to 399,234 tokens per second", "499,670 tokens/s"
THROUGHPUT = re.compile(rf"(?P<first>{NUMBER})(?:\s+(?:and|against|to|→)\s+(?P<second>{NUMBER}))?"
                        r"\s+tokens(?:\s+per\s+second|/s|\s+a\s+second)")
WORDS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9,
         "ten": 10, "eleven": 11, "twelve": 12}
CELLS = re.compile(rf"\b(?P<count>\d+|{'|'.join(WORDS)})\s+cells\b", re.I)
SECTION = re.compile(r"--8<-- \[start:")


def _prose(path: Path) -> str:
    """A page without its fenced code: what a reader takes as a statement."""
    return FENCE.sub("", path.read_text(encoding="utf-8"))


def _numbers_in_data() -> set[int]:
    found: set[int] = set()

    def walk(value: object) -> None:
        if isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            found.add(round(value))

    for path in (support.DOCS / "data").rglob("*.json"):
        walk(json.loads(path.read_text(encoding="utf-8")))
    return found


def test_every_throughput_on_a_page_is_a_figure_of_the_benchmark_data() -> None:
    """A tokens-per-second figure typed into a page must be one the committed benchmark runs
    hold (`docs/data/*.json`); a figure from a run that was never committed cannot be checked."""
    measured = _numbers_in_data()
    orphans = [f"{support.rel(page)}: {value}" for page in support.markdown_files()
               for match in THROUGHPUT.finditer(_prose(page))
               for value in (match["first"], match["second"]) if value
               if int(value.replace(",", "")) not in measured]
    assert not orphans, "throughputs in no data file:\n" + "\n".join(orphans)


def _sections(module: str) -> int:
    return len(SECTION.findall((support.ROOT / "reference_impl" / module).read_text(encoding="utf-8")))


def test_every_count_of_cells_is_the_interview_core_or_the_notebook() -> None:
    """The interview core is typed as one cell per snippet section of `interview_core.py`; the
    full trainer has one cell per section of `notebook.py`, each a `### Cell` on the
    walkthrough. Every "N cells" on a page or in the README is one of those two counts, and
    the home page gives both."""
    core, notebook = _sections("interview_core.py"), _sections("notebook.py")
    walkthrough = (support.DOCS / "practice" / "notebook-walkthrough.md").read_text(encoding="utf-8")
    assert len(re.findall(r"^### Cell \d+:", walkthrough, re.M)) == notebook
    claims = [(support.rel(path), m["count"]) for path in [*support.markdown_files(), support.ROOT / "README.md"]
              for m in CELLS.finditer(_prose(path))]
    wrong = [(where, count) for where, count in claims
             if WORDS.get(count.lower(), None if not count.isdigit() else int(count)) not in (core, notebook)]
    assert not wrong, f"cell counts that are neither the core's {core} nor the notebook's {notebook}: {wrong}"
    home = _prose(support.DOCS / "index.md")
    assert f"interview core in {core} cells" in home and f"full trainer in {notebook} cells" in home


def test_the_manifest_is_named_by_the_algorithm_the_code_writes() -> None:
    """`integrity.ALGORITHM` names the manifest's checksum; a page that describes the
    trainer's manifest says that name, and no page calls it sha256 (the drills' rubric
    grades a candidate's own manifest, where sha256 is a fine answer)."""
    from reference_impl.checkpoint import integrity

    shown = integrity.ALGORITHM.upper().replace("_", "-")  # xxh3_128 -> XXH3-128
    for page in ("interview/cheatsheet.md", "reliability/checkpointing.md"):
        assert shown in _prose(support.DOCS / page), page
    sha_manifest = re.compile(r"sha256 manifest|manifest of sha256", re.I)
    said = [support.rel(p) for p in support.markdown_files()
            if not p.name.startswith("timed-drills") and sha_manifest.search(_prose(p))]
    assert not said, f"pages that call the trainer's manifest sha256: {said}"


def test_the_glossary_says_what_the_trainer_offers_in_fp8() -> None:
    """The glossary's fp8 entry follows the config: `--fp8` exists, so the entry names it."""
    from reference_impl.config import TrainConfig

    glossary = _prose(support.DOCS / "reference" / "glossary.md")
    entry = glossary[glossary.index("\nfp8\n"):].split("\n\n")[0]
    assert hasattr(TrainConfig(), "fp8")
    assert "`--fp8`" in entry and "does not use" not in entry, entry

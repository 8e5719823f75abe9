"""One voice: a fact that several pages state comes from one source, and these checks fail
when a page drifts from it.

The source is `docs/hooks/facts.py`: each registered fact is read from the code, the committed
benchmark data or the pages that hold a numbered series, and pages say it as
`{{ fact.NAME }}`. Its `STATED` shapes find every statement of a fact in words, on the pages
as the build expands them and in the README (which GitHub shows as written), and each one
must give the source's value. The checks after those keep what no single fact covers: every
throughput is a figure of the benchmark data, every count of cells is one of the two
notebooks', no page calls the trainer's manifest sha256, the glossary's fp8 entry follows
the config."""

from __future__ import annotations

import json
import re
import sys
from functools import cache
from pathlib import Path
from types import SimpleNamespace

import pytest

import handbook_docs_support as support

sys.path.insert(0, str(support.DOCS / "hooks"))
import facts  # noqa: E402

pytestmark = pytest.mark.docs

FENCE = re.compile(r"^\s*```.*?^\s*```", re.M | re.S)
NUMBER = r"\d{1,3}(?:,\d{3})+"
# "202,657 tokens per second", "283,013 to 399,234 tokens per second", "499,670 tokens/s"
THROUGHPUT = re.compile(rf"(?P<first>{NUMBER})(?:\s+(?:and|against|to|→)\s+(?P<second>{NUMBER}))?"
                        r"\s+tokens(?:\s+per\s+second|/s|\s+a\s+second)")
CELLS = re.compile(rf"\b(?P<count>{facts.NUMBER})\s+cells\b", re.I)
README = support.ROOT / "README.md"


@cache
def _prose(path: Path) -> str:
    """A page as the reader gets it, its fenced code blanked (line numbers kept): its facts
    expanded, except in the README, which nothing expands."""
    text = path.read_text(encoding="utf-8")
    return FENCE.sub(lambda m: "\n" * m[0].count("\n"), text if path == README else facts.expand(text))


def _count(text: str) -> int:
    word = text.lower()
    return facts.WORDS.index(word) if word in facts.WORDS else int(text.replace(",", ""))


@cache
def _statements() -> dict[str, list[tuple[str, str]]]:
    """Every statement of a fact in words: fact name -> [(where, value as written)]."""
    found: dict[str, dict[tuple[str, int], str]] = {name: {} for name in facts.FACTS}
    for path in support.markdown_files():
        text = _prose(path)
        for shape in facts.shapes():
            for m in shape.finditer(text):
                for name, said in m.groupdict().items():
                    if said is not None:  # two shapes may find one statement: keyed by its place
                        line = text.count("\n", 0, m.start(name)) + 1
                        found[name][(f"{support.rel(path)}:{line}", m.start(name))] = said
    return {name: [(where, said) for (where, _), said in sorted(places.items())] for name, places in found.items()}


def test_every_statement_shape_names_registered_facts_and_every_fact_has_one() -> None:
    """A shape's groups are fact names; a fact without a shape could drift unseen."""
    named = {name for shape in facts.shapes() for name in shape.groupindex}
    assert named <= set(facts.FACTS), f"shapes name no fact: {sorted(named - set(facts.FACTS))}"
    assert set(facts.FACTS) <= named, f"facts no shape finds on a page: {sorted(set(facts.FACTS) - named)}"


def test_every_fact_in_the_data_file_is_registered_and_says_why() -> None:
    """`docs/hooks/facts.json` holds only facts the hook serves, each with the reason no code
    can give it."""
    known = json.loads(facts.KNOWN_ELSEWHERE.read_text(encoding="utf-8"))
    assert set(known) <= set(facts.FACTS), sorted(set(known) - set(facts.FACTS))
    assert all(isinstance(entry, dict) and entry.get("why") for entry in known.values())


@pytest.mark.parametrize("name", list(facts.FACTS))
def test_every_page_that_states_a_fact_gives_its_source_value(name: str) -> None:
    """Each statement of the fact, on any page or in the README, is the value its source holds
    today; and the fact is stated somewhere, so its shapes still find what the pages say."""
    value = facts.fact(name)
    said = _statements()[name]
    assert said, f"no page states {name} in any of its shapes any more: update facts.STATED"
    if isinstance(value, int):
        wrong = [(where, text) for where, text in said if _count(text) != value]
    else:
        wrong = [(where, text) for where, text in said if " ".join(text.split()) != value]
    assert not wrong, f"{name} is {value!r} in its source, but pages say otherwise: {wrong}"


@pytest.mark.parametrize("name", list(facts.FACTS))
def test_every_fact_is_written_as_a_placeholder_somewhere(name: str) -> None:
    """A registered fact serves the pages: at least one says it through `{{ fact.NAME }}`."""
    pages = [p for p in support.markdown_files() if p != README]
    assert any(m["name"] == name for p in pages
               for m in facts.PLACEHOLDER.finditer(p.read_text(encoding="utf-8"))), name


def test_the_readme_holds_no_placeholder() -> None:
    """GitHub shows the README as written: a placeholder there would show as braces. (In
    inline code it names the syntax, for contributors.)"""
    text = re.sub(r"`[^`\n]*`", "", README.read_text(encoding="utf-8"))
    assert not facts.LOOKS_LIKE.search(text), facts.LOOKS_LIKE.search(text)


def test_an_unknown_or_misspelt_placeholder_stops_the_build() -> None:
    """The hook refuses a name it does not know, listing the known ones, and anything shaped
    like a placeholder that is not one; a count written as a word must be a small count."""
    with pytest.raises(ValueError, match="no such fact.*walkthrough_cells"):
        facts.expand("the {{ fact.walkthrough_cell }} cells")
    for text in ("{{ facts.drills }}", "{{ fact.drills:words }}", "{{ fact.drills | word }}", "{{ fact.Drills }}"):
        with pytest.raises(ValueError, match="not a placeholder"):
            facts.expand(text)
    with pytest.raises(ValueError, match="no count of twelve or less"):
        facts.expand("{{ fact.manifest_checksum:word }}")
    assert facts.expand("{{ fact.core_cells:Word }} cells, {{fact.core_lines}} lines") == (
        f"{facts.WORDS[facts.fact('core_cells')].capitalize()} cells, {facts.fact('core_lines')} lines")


def test_a_placeholder_that_reaches_the_html_stops_the_build() -> None:
    """A Markdown file that a snippet includes arrives after the hook ran: its placeholder
    would reach the reader as braces, so the page's HTML is checked too."""
    page = SimpleNamespace(file=SimpleNamespace(src_uri="practice/x.md"))
    with pytest.raises(ValueError, match=r"practice/x\.md: \{\{ fact\.drills \}\} was not expanded"):
        facts.on_page_content("<p>{{ fact.drills }} drills</p>", page=page)
    with pytest.raises(ValueError, match=r"practice/x\.md: .*no such fact"):
        facts.on_page_markdown("{{ fact.drill }}", page=page)
    assert facts.on_page_content("<p>11 drills</p>", page=page) == "<p>11 drills</p>"


def test_braces_that_are_no_placeholder_pass_through() -> None:
    """Mermaid's hexagons, f-string braces and Jinja-like text that never says `fact` are left
    as they are."""
    text = 'A{{hexagon}} --> B\nf"{{x}}" and {{ page.title }}'
    assert facts.expand(text) == text


def test_the_worked_checkpoint_interval_prints_what_the_pages_state() -> None:
    """The checkpointing page works Young's interval in an executed block, whose printed output
    the code-block tests compare with a run: its inputs are `facts.json`'s, and the MTBF,
    intervals and overheads it prints are the facts other pages state, computed by `calc`."""
    page = (support.DOCS / "reliability" / "checkpointing.md").read_text(encoding="utf-8")
    printed = page[page.index("\njob MTBF: "):].split("```")[0]
    inputs = (f"mtbf_h = {facts.fact('llama3_days')} * 24 / {facts.fact('llama3_unexpected_interruptions')}",
              f"for C in ({facts.fact('worked_save_s')}.0, {facts.fact('worked_async_save_s')}.0):")
    assert all(line in page for line in inputs), inputs
    assert f"job MTBF: {facts.fact('llama3_job_mtbf_h')} h" in printed, printed
    for save, minutes, overhead in (("worked_save_s", "young_minutes", "young_overhead"),
                                    ("worked_async_save_s", "async_young_minutes", "async_young_overhead")):
        line = (rf"C = +{facts.fact(save)} s: interval \d+ s \({re.escape(str(facts.fact(minutes)))} min\), "
                rf"overhead {re.escape(str(facts.fact(overhead)))}\n")
        assert re.search(line, printed), (line, printed)


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
    """A tokens-per-second figure on a page must be one the committed benchmark runs hold
    (`docs/data/*.json`); a figure from a run that was never committed cannot be checked."""
    measured = _numbers_in_data()
    orphans = [f"{support.rel(page)}: {value}" for page in support.markdown_files()
               for match in THROUGHPUT.finditer(_prose(page))
               for value in (match["first"], match["second"]) if value
               if int(value.replace(",", "")) not in measured]
    assert not orphans, "throughputs in no data file:\n" + "\n".join(orphans)


def test_every_count_of_cells_is_the_interview_core_or_the_notebook() -> None:
    """The interview core is typed as one cell per snippet section of `interview_core.py`; the
    full trainer has one cell per section of `notebook.py`, each a `### Cell` on the
    walkthrough. Every "N cells" on a page or in the README is one of those two counts."""
    core, notebook = facts.fact("core_cells"), facts.fact("walkthrough_cells")
    walkthrough = (support.DOCS / "practice" / "notebook-walkthrough.md").read_text(encoding="utf-8")
    assert len(re.findall(r"^### Cell \d+:", walkthrough, re.M)) == notebook
    wrong = [(support.rel(path), m["count"]) for path in support.markdown_files()
             for m in CELLS.finditer(_prose(path)) if _count(m["count"]) not in (core, notebook)]
    assert not wrong, f"cell counts that are neither the core's {core} nor the notebook's {notebook}: {wrong}"
    home = _prose(support.DOCS / "index.md")
    assert f"interview core in {core} cells" in home and f"full trainer in {notebook} cells" in home


def test_the_manifest_is_named_by_the_algorithm_the_code_writes() -> None:
    """The pages that describe the trainer's manifest name its checksum by
    `integrity.ALGORITHM` (fact `manifest_checksum`), and none calls it sha256: the drills'
    rubric grades a candidate's own manifest, where sha256 is a fine answer."""
    for page in ("interview/cheatsheet.md", "reliability/checkpointing.md"):
        assert facts.fact("manifest_checksum") in _prose(support.DOCS / page), page
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

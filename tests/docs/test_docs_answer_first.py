"""Answer first: a content page opens, under its title, with a paragraph of prose, and every H2
section opens with the answer a candidate would give, a short paragraph, before any table,
code, list, figure, admonition or fold. The check reads the Markdown as written, the blocks
the site's hooks expand (`<!-- table: -->`, `<!-- plot: -->`) classified as what they become.

No admonition type marks an answer: an answer is plain prose, so that it reads the same on
the page, in search results and in the printed handbook."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

import handbook_docs_support as support

pytestmark = pytest.mark.docs

# The folders of content pages; API pages are generated from docstrings and have no answer.
CONTENT_FOLDERS = ("interview", "foundations", "practice", "biotech", "reliability", "reference")
# An opening answer is short enough to say aloud; the derivation follows it.
MAX_OPENING_WORDS = 90
# Pages whose H2 sections have another form, each with why; their title still opens with prose.
SECTIONS_EXEMPT = {
    "interview/hard-questions.md": "a question bank: each question's fold opens with its answer",
    "biotech/hard-questions.md": "a question bank: each question's fold opens with its answer",
    "reference/glossary.md": "one section per letter, each a list of definitions",
    "reference/official-reading.md": "a reading list: each section is a table of sources",
    "reference/all-in-one.md": "the other pages, inlined: their sections are checked on their own pages",
}

HEADING = re.compile(r"^(?P<level>#{1,6})\s+(?P<title>.+?)\s*#*\s*$")
# Hook markers that expand to a block: what each becomes on the built page.
EXPANDED = {"<!-- table:": "table", "<!-- plot:": "figure", "<!-- package-install -->": "html",
            "<!-- notebook-links -->": "html", "<!-- self-test -->": "paragraph"}
ADMONITION = re.compile(r"^(?:!!!|\?\?\?\+?)\s*(?P<kind>[\w-]+)")
LIST_ITEM = re.compile(r"^(?:[-*+]|\d+[.)])\s")
# A `<div markdown>` wrapper (and its end) is no block of its own: its Markdown renders inside it.
WRAPPER = re.compile(r"^(?:<div\b[^>]*\bmarkdown\b[^>]*>|</div>)\s*$")
FRONT_MATTER = re.compile(r"\A---\n.*?^---\n", re.M | re.S)
LINK = re.compile(r"!?\[(?P<text>[^\]]*)\]\([^)]*\)|\{[:.#][^}]*\}|<[^>]+>")
# Blank lines, comments (a test marker before a fence) and wrappers are not blocks.
SKIPPED = {"comment", "wrapper"}


@dataclass
class Opening:
    """The first block under a heading: what kind it is, and its words when it is prose."""

    heading: str
    lineno: int
    kind: str
    words: int = 0


def _kind(line: str) -> str:
    """What the block that starts with `line` renders as."""
    for mark, kind in EXPANDED.items():
        if line.startswith(mark):
            return kind
    if WRAPPER.match(line):
        return "wrapper"
    if HEADING.match(line):
        return "heading"
    if m := ADMONITION.match(line):
        return f"admonition {m['kind']}"
    checks = (("```", "code"), ("~~~", "code"), ("|", "table"), (">", "quote"), ("--8<--", "snippet"),
              ("===", "tabs"), ("<!--", "comment"), ("<", "html"), (":", "definition"), ("---", "rule"),
              ("***", "rule"))
    for prefix, kind in checks:
        if line.startswith(prefix):
            return kind
    return "list" if LIST_ITEM.match(line) else "paragraph"


def _words(paragraph: list[str]) -> int:
    return len(LINK.sub(lambda m: m["text"] or " ", " ".join(paragraph)).split())


def openings(text: str) -> list[Opening]:
    """The opening block of the H1 and of each H2 in Markdown `text` (fenced code skipped).

    Front matter becomes blank lines, so that line numbers stay the file's own."""
    front = FRONT_MATTER.match(text)
    lines = [""] * (front[0].count("\n") if front else 0) + text[front.end() if front else 0:].splitlines()
    found: list[Opening] = []
    fence: str | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        if fence:
            fence = None if line.strip().startswith(fence) else fence
        elif m := re.match(r"(`{3,}|~{3,})", line):
            fence = m[1]
        elif (h := HEADING.match(line)) and len(h["level"]) <= 2:
            j = i + 1
            while j < len(lines) and (not lines[j].strip() or _kind(lines[j]) in SKIPPED):
                j += 1
            kind = _kind(lines[j]) if j < len(lines) else "nothing"
            opening = Opening(f"{h['level']} {h['title']}", j + 1, kind)
            if kind == "paragraph":
                end = j
                while end < len(lines) and lines[end].strip() and _kind(lines[end]) == "paragraph":
                    end += 1
                opening.words = _words(lines[j:end])
            found.append(opening)
        i += 1
    return found


def problems_in(text: str, page: str) -> list[str]:
    """Why the page's openings do not lead with an answer (nothing when they do)."""
    problems = []
    for number, opening in enumerate(openings(text)):
        where = f"{page}:{opening.lineno} under '{opening.heading}'"
        if number > 0 and page in SECTIONS_EXEMPT:
            continue
        if opening.kind != "paragraph":
            problems.append(f"{where}: opens with a {opening.kind}; open with the answer in prose")
        elif opening.words > MAX_OPENING_WORDS:
            problems.append(f"{where}: the opening paragraph has {opening.words} words "
                            f"(at most {MAX_OPENING_WORDS}); say the answer, then derive it")
    if not FRONT_MATTER.sub("", text).lstrip().startswith("# "):
        problems.append(f"{page}: no H1 on the first line")
    return problems


def _content_pages() -> list:
    pages = [support.DOCS / "index.md"] + [p for folder in CONTENT_FOLDERS
                                            for p in sorted((support.DOCS / folder).glob("*.md"))]
    return [pytest.param(p, id=support.rel(p)) for p in pages]


@pytest.mark.parametrize("page", _content_pages())
def test_every_page_and_section_opens_with_the_answer(page: Path) -> None:
    name = page.relative_to(support.DOCS).as_posix()
    problems = problems_in(page.read_text(encoding="utf-8"), name)
    assert not problems, "\n".join(problems)


def test_the_check_sees_each_kind_of_opening_that_buries_the_answer() -> None:
    good = ("# Title\n\nThe answer, in two plain sentences.\n\n| a |\n|---|\n\n"
            "## Section\n\n<!-- pytest.mark.skip -->\nAnother answer.\n\n```python\nx = 1\n```\n\n"
            "## Code inside is skipped\n\nAnswer.\n\n```text\n## not a heading\n| x |\n```\n")
    assert problems_in(good, "good.md") == []
    bad = {"## T\n\n| a |\n|---|\n": "table", "## T\n\n```python\nx\n```\n": "code",
           "## T\n\n- item\n": "list", "## T\n\n!!! note\n    aside\n": "admonition note",
           "## T\n\n### Sub\n": "heading", "## T\n\n<!-- table: memory -->\n": "table",
           "## T\n\n<!-- plot: gpu -->\n": "figure", '## T\n\n??? proof "How we know"\n': "admonition proof",
           "## T\n\n" + "word " * 91 + "\n": "91 words"}
    for tail, why in bad.items():
        found = problems_in("# Title\n\nAnswer.\n\n" + tail, "bad.md")
        assert len(found) == 1 and why in found[0], (tail, found)
    assert "opens with a list" in problems_in("# Title\n\n1. first\n", "bad.md")[0]

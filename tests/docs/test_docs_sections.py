"""The text between headings in blocks the browser draws when near (docs/hooks/sections.py)."""

from __future__ import annotations

import re
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

import handbook_docs_support as support

sys.path.insert(0, str(support.DOCS / "hooks"))

import sections  # noqa: E402

pytestmark = pytest.mark.docs

OPEN = re.compile(r'<div class="handbook-section" style="contain-intrinsic-block-size: auto \d+px">')


def _unwrapped(html: str) -> str:
    """`html` with every section block's own tags removed (a block never nests: see below)."""
    pieces, depth = [], 0
    for m in re.finditer(r'(<div class="handbook-section"[^>]*>)|(<div\b[^>]*>)|(</div>)|([^<]+|<[^>]*>)', html):
        if m[1]:
            assert depth == 0, "a section block inside another block"
            depth = 1
        elif m[2]:
            depth += depth > 0
            pieces.append(m[0])
        elif m[3]:
            if depth == 1:
                depth = 0
                continue
            depth -= depth > 0
            pieces.append(m[0])
        else:
            pieces.append(m[0])
    return "".join(pieces)


@pytest.fixture
def any_length(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook wraps a page of any length (these test pages are short)."""
    monkeypatch.setattr(sections, "SHORTEST_PX", 0)


def test_each_run_between_headings_is_one_block_and_the_headings_stay_outside(any_length: None) -> None:
    page = ("<h1 id=\"t\">Title</h1>\n<p>Intro.</p>\n<div class=\"admonition\"><p>Aside</p></div>\n"
            "<h2 id=\"a\">A <code>x</code></h2>\n<table><tr><td>1</td></tr></table><hr>\n"
            "<h2 id=\"b\">B</h2>\n<h3 id=\"c\">C</h3>\n<pre><code>one\ntwo</code></pre>\n")
    wrapped = sections.wrap_sections(page)
    assert _unwrapped(wrapped) == page  # only blocks added: nothing moved, lost or changed
    blocks = re.findall(rf"{OPEN.pattern}(.*?)</div>(?=\n?<h\d|$)", wrapped, re.S)
    assert blocks == ["\n<p>Intro.</p>\n<div class=\"admonition\"><p>Aside</p></div>\n",
                      "\n<table><tr><td>1</td></tr></table><hr>\n", "\n<pre><code>one\ntwo</code></pre>\n"]
    # Between B and C only whitespace: no empty block.
    assert '</h2>\n<h3 id="c">' in wrapped


def test_inside_an_element_that_holds_a_heading_the_same_rule_applies(any_length: None) -> None:
    api = ('<div class="doc doc-object"><h2 id="f">f</h2><div class="doc-contents"><p>Does f.</p>'
           '<div class="doc-children"><h3 id="g">g</h3><p>Does g.</p></div></div></div>\n<p>After.</p>')
    wrapped = sections.wrap_sections(api)
    assert _unwrapped(wrapped) == api
    blocks = re.findall(rf"{OPEN.pattern}(.*?)</div>", wrapped, re.S)
    assert blocks == ["<p>Does f.</p>", "<p>Does g.</p>", "\n<p>After.</p>"]
    assert re.search(r"<h2 id=\"f\">f</h2><div class=\"doc-contents\">", wrapped)


def test_unbalanced_tags_or_a_short_page_are_left_as_they_are(any_length: None, monkeypatch) -> None:
    broken = "<h2>A</h2>\n<div><p>open\n<h2>B</h2><p>x</p>"
    assert sections.wrap_sections(broken) == broken
    crossed = "<h2>A</h2>\n<div><p>x</div></p>"
    assert sections.wrap_sections(crossed) == crossed
    monkeypatch.setattr(sections, "SHORTEST_PX", 3500)
    short = "<h1>T</h1><p>" + "word " * 100 + "</p>"
    assert sections.wrap_sections(short) == short
    assert sections.wrap_sections(short + "<p>" + "word " * 10_000 + "</p>") != short


def test_the_room_held_grows_with_what_the_block_holds() -> None:
    short = sections.room("<p>One line.</p>")
    assert sections.LINE_PX <= short < 100
    assert sections.room("<p>" + "word " * 400 + "</p>") > 10 * short
    assert sections.room("<pre><code>" + "x = 1\n" * 100 + "</code></pre>") >= 100 * sections.CODE_LINE_PX
    assert sections.room("<table>" + "<tr><td>1</td></tr>" * 20 + "</table>") >= 20 * sections.ROW_PX
    # A closed <details> shows its summary only; an open one, all it holds.
    body = "<pre><code>" + "x = 1\n" * 100 + "</code></pre>"
    assert sections.room(f"<details><summary>Source</summary>{body}</details>") < 100
    assert sections.room(f"<details open><summary>Source</summary>{body}</details>") >= 100 * sections.CODE_LINE_PX


class _LooseText(HTMLParser):
    """Text of an HTML fragment that is neither in a heading nor in a section block."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []  # per open element: its tag, or "block" for a section block
        self.loose: list[str] = []
        self.blocks = 0

    def handle_starttag(self, tag, attrs):
        if tag not in sections.VOID:
            block = tag == "div" and dict(attrs).get("class") == "handbook-section"
            self.blocks += block
            self.stack.append("block" if block else tag)

    def handle_endtag(self, tag):
        if tag not in sections.VOID:
            self.stack.pop()

    def handle_data(self, data):
        if data.strip() and not set(self.stack) & (sections.HEADINGS | {"block"}):
            self.loose.append(data.strip())


@pytest.mark.parametrize("page", ["foundations/parallelism/", "foundations/data-parallel/", "reference/all-in-one/", "practice/timed-drills/",
                                  "biotech/molecular-data-pipelines/", "api/bench/", "interview/cheatsheet/"])
def test_a_long_pages_text_is_all_in_headings_and_section_blocks(built_site: Path, page: str) -> None:
    html = (built_site / page / "index.html").read_text(encoding="utf-8")
    start = html.index(">", html.index('<article class="md-content__inner md-typeset">')) + 1
    text = _LooseText()
    text.feed(html[start:html.index("</article>")])
    assert text.blocks >= 3
    assert not text.loose, text.loose[:5]


def test_a_short_page_is_left_as_it_is(built_site: Path) -> None:
    assert "handbook-section" not in (built_site / "practice" / "mock-interview" / "index.html").read_text("utf-8")

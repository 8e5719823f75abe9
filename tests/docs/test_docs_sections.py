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


def test_each_run_between_headings_is_one_block_and_the_headings_stay_outside() -> None:
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


def test_a_run_holding_a_heading_or_unbalanced_tags_is_left_as_it_is() -> None:
    api = '<div class="doc doc-object"><h2 id="f">f</h2><p>Does f.</p></div>\n'
    assert sections.wrap_sections(api) == api
    broken = "<h2>A</h2>\n<div><p>open\n<h2>B</h2><p>x</p>"
    assert sections.wrap_sections(broken) == broken


def test_the_room_held_grows_with_what_the_block_holds() -> None:
    short = sections.room("<p>One line.</p>")
    assert sections.LINE_PX <= short < 100
    assert sections.room("<p>" + "word " * 400 + "</p>") > 10 * short
    assert sections.room("<pre><code>" + "x = 1\n" * 100 + "</code></pre>") >= 100 * sections.CODE_LINE_PX
    assert sections.room("<table>" + "<tr><td>1</td></tr>" * 20 + "</table>") >= 20 * sections.ROW_PX


class _TopLevel(HTMLParser):
    """An article's top-level elements: [tag, class, holds a heading], and text between them."""

    def __init__(self) -> None:
        super().__init__()
        self.depth, self.elements, self.loose_text = 0, [], ""

    def handle_starttag(self, tag, attrs):
        if self.depth == 0:
            self.elements.append([tag, dict(attrs).get("class") or "", False])
        elif tag in sections.HEADINGS:
            self.elements[-1][2] = True
        self.depth += tag not in sections.VOID

    def handle_endtag(self, tag):
        self.depth -= tag not in sections.VOID

    def handle_data(self, data):
        if self.depth == 0:
            self.loose_text += data.strip()


@pytest.mark.parametrize("page", ["foundations/parallelism/", "reference/all-in-one/", "interview/hard-questions/",
                                  "biotech/molecular-data-pipelines/", ""])
def test_a_built_pages_text_is_headings_and_section_blocks(built_site: Path, page: str) -> None:
    html = (built_site / page / "index.html").read_text(encoding="utf-8")
    start = html.index(">", html.index('<article class="md-content__inner md-typeset">')) + 1
    top = _TopLevel()
    top.feed(html[start:html.index("</article>")])
    # Besides headings and blocks: the theme's buttons (edit, view source), and a container
    # with headings inside (the cheatsheet's print wrapper), which the hook leaves as it is.
    others = [(tag, cls) for tag, cls, holds_heading in top.elements
              if tag not in sections.HEADINGS | {"a"} and cls != "handbook-section" and not holds_heading]
    assert not others, others
    assert sum(cls == "handbook-section" for _, cls, _ in top.elements) >= 3
    assert not top.loose_text, top.loose_text[:200]

"""MkDocs hook: the text between two headings becomes a block the browser draws when it nears the screen.

A long page is thousands of elements (the parallelism playbook: 7,500), and on load the
theme's script makes the browser restyle all of them several times over: it reads the
viewport's offset, the palette's colours and the content's scroll position, and each read
after a change restyles the page. On a phone that was most of the main thread's time.

So each run of blocks between two headings is wrapped in `<div class="handbook-section">`,
which `extra.css` gives `content-visibility: auto`: while it is off screen the browser skips
its style, layout and paint and gives it the room this hook estimates
(`contain-intrinsic-block-size`), then the room it really took once it has been drawn. The
text stays in the page for find-in-page, links to an anchor inside it and screen readers.

Headings stay outside every block, so that the table of contents finds them without
drawing what lies above, and a link to a heading scrolls near it at once;
`docs/javascripts/sections.js` then keeps the heading in place while the blocks around it
are drawn at their real size. An element that holds a heading (an API object's `<div>`, the
cheatsheet's print wrapper) is not wrapped: the same rule applies inside it. A page too
short to gain (under `SHORTEST_PX` of estimated text) or whose tags do not balance is left
as it is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from html.parser import HTMLParser
from typing import Any

HEADINGS = {"h1", "h2", "h3", "h4", "h5", "h6"}
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}
OPEN = '<div class="handbook-section" style="contain-intrinsic-block-size: auto {room}px">'
# The room a block holds until it is drawn, from what it holds, for a column about 70
# characters wide: one line of prose per LINE_CHARS characters, plus a line per table row,
# listing line and block. It only has to be near: the browser keeps the real size once drawn.
LINE_PX, LINE_CHARS, CODE_LINE_PX, ROW_PX, BLOCK_PX, DIAGRAM_PX = 26, 70, 18, 34, 20, 320
# About four phone screens: a shorter page is drawn whole on load anyway.
SHORTEST_PX = 3500
LISTING = re.compile(r"<pre\b.*?</pre>", re.S)
# A closed <details> shows its summary only (an API object's source listing, an answer).
CLOSED = re.compile(r"<details\b(?![^>]*\bopen)[^>]*>\s*(<summary\b.*?</summary>).*?</details>", re.S)
TAG = re.compile(r"<[^>]+>")


@dataclass
class _Element:
    """An element of an HTML fragment: its offsets, whether it holds a heading, its children."""

    tag: str
    start: int
    inner_start: int
    inner_end: int = -1
    end: int = -1
    holds_heading: bool = False
    children: list[_Element] = field(default_factory=list)


class _Tree(HTMLParser):
    """The elements of an HTML fragment as a tree, from one pass over it (`root.children`)."""

    def __init__(self, content: str) -> None:
        super().__init__(convert_charrefs=False)
        self.content = content
        self.root = _Element("", 0, 0, len(content), len(content))
        self.balanced = True
        self._open = [self.root]
        self._line_starts = [0] + [m.end() for m in re.finditer("\n", content)]
        self.feed(content)
        self.close()
        self.balanced = self.balanced and len(self._open) == 1

    def _position(self) -> int:
        line, column = self.getpos()
        return self._line_starts[line - 1] + column

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        start = self._position()
        element = _Element(tag, start, start + len(self.get_starttag_text() or ""))
        self._open[-1].children.append(element)
        if tag in HEADINGS:
            for outer in self._open[1:]:
                outer.holds_heading = True
        if tag in VOID:
            element.inner_end = element.end = element.inner_start
        else:
            self._open.append(element)

    def handle_endtag(self, tag: str) -> None:
        if tag in VOID:
            return
        if len(self._open) == 1 or self._open[-1].tag != tag:
            self.balanced = False
            return
        element = self._open.pop()
        element.inner_end = self._position()
        element.end = self.content.index(">", element.inner_end) + 1


def room(run: str) -> int:
    """The height in CSS pixels that a block of HTML `run` holds before it is drawn."""
    run = CLOSED.sub(r"<p>\1</p>", run)
    code_lines = sum(listing.count("\n") + 1 for listing in LISTING.findall(run))
    prose = TAG.sub("", LISTING.sub("", run))
    blocks = len(re.findall(r"<(?:p|li|div|details|table|figure|blockquote)\b", run))
    return (LINE_PX * (len(" ".join(prose.split())) // LINE_CHARS + 1) + CODE_LINE_PX * code_lines
            + ROW_PX * run.count("<tr") + BLOCK_PX * blocks + DIAGRAM_PX * run.count('class="mermaid"'))


def _block(run: str) -> str:
    return OPEN.format(room=room(run)) + run + "</div>" if run.strip() else run


def _wrap(content: str, elements: list[_Element], start: int, end: int) -> str:
    """`content[start:end]`, whose elements are `elements`, with its runs wrapped, recursing
    into the elements that hold a heading."""
    pieces, run_start = [], start
    for element in elements:
        if element.tag not in HEADINGS and not element.holds_heading:
            continue  # part of the current run
        pieces.append(_block(content[run_start:element.start]))
        if element.tag in HEADINGS:
            pieces.append(content[element.start:element.end])
        else:
            pieces += [content[element.start:element.inner_start],
                       _wrap(content, element.children, element.inner_start, element.inner_end),
                       content[element.inner_end:element.end]]
        run_start = element.end
    pieces.append(_block(content[run_start:end]))
    return "".join(pieces)


def wrap_sections(content: str) -> str:
    """`content` with each run of blocks between its headings in a section block, at every
    level that holds headings; as it is when it is short or its tags do not balance."""
    if room(content) < SHORTEST_PX:
        return content
    tree = _Tree(content)
    return _wrap(content, tree.root.children, 0, len(content)) if tree.balanced else content


def on_page_content(content: str, **_: Any) -> str:
    return wrap_sections(content)

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
from dataclasses import dataclass
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
    """A top-level element of an HTML fragment: its offsets and whether it holds a heading."""

    tag: str
    start: int
    inner_start: int
    inner_end: int = -1
    end: int = -1
    holds_heading: bool = False


class _Children(HTMLParser):
    """The top-level elements of an HTML fragment, in order."""

    def __init__(self, content: str) -> None:
        super().__init__(convert_charrefs=False)
        self.content = content
        self.elements: list[_Element] = []
        self.balanced = True
        self._depth = 0
        self._line_starts = [0] + [m.end() for m in re.finditer("\n", content)]
        self.feed(content)
        self.close()
        self.balanced = self.balanced and self._depth == 0

    def _position(self) -> int:
        line, column = self.getpos()
        return self._line_starts[line - 1] + column

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        if self._depth == 0:
            start = self._position()
            self.elements.append(_Element(tag, start, start + len(self.get_starttag_text() or "")))
            if tag in VOID:
                self.elements[-1].inner_end = self.elements[-1].end = self.elements[-1].inner_start
        elif tag in HEADINGS:
            self.elements[-1].holds_heading = True
        self._depth += tag not in VOID

    def handle_endtag(self, tag: str) -> None:
        if tag in VOID:
            return
        self._depth -= 1
        if self._depth < 0 or (self._depth == 0 and tag != self.elements[-1].tag):
            self.balanced, self._depth = False, 0
        elif self._depth == 0:
            element = self.elements[-1]
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


def _wrap(content: str) -> str | None:
    """`content` with its runs wrapped, recursing into elements that hold a heading; None if
    its tags do not balance."""
    children = _Children(content)
    if not children.balanced:
        return None
    pieces, run_start = [], 0
    for element in children.elements:
        if element.tag not in HEADINGS and not element.holds_heading:
            continue  # part of the current run
        pieces.append(_block(content[run_start:element.start]))
        if element.tag in HEADINGS:
            pieces.append(content[element.start:element.end])
        else:
            inner = _wrap(content[element.inner_start:element.inner_end])
            if inner is None:
                return None
            pieces += [content[element.start:element.inner_start], inner, content[element.inner_end:element.end]]
        run_start = element.end
    pieces.append(_block(content[run_start:]))
    return "".join(pieces)


def wrap_sections(content: str) -> str:
    """`content` with each run of blocks between its headings in a section block, at every
    level that holds headings; as it is when it is short or its tags do not balance."""
    if room(content) < SHORTEST_PX:
        return content
    wrapped = _wrap(content)
    return content if wrapped is None else wrapped


def on_page_content(content: str, **_: Any) -> str:
    return wrap_sections(content)

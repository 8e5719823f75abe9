"""MkDocs hook: the text between two headings becomes a block the browser renders when it nears the screen.

A long page is thousands of elements (the parallelism playbook: 7,500), and on load the
theme's script makes the browser restyle all of them several times over: it reads the
viewport's offset, the palette's colours and the content's scroll position, and each read
after a change restyles the page. On a phone that was most of the main thread's time.

So each run of top-level blocks between two headings is wrapped in
`<div class="handbook-section">`, which `extra.css` gives `content-visibility: auto`: while
it is off screen the browser skips its style, layout and paint and gives it the room this
hook estimates (`contain-intrinsic-block-size`), then the room it really took once it has
been drawn. The text stays in the page for find-in-page, links to an anchor inside it and
screen readers. Headings stay outside every block, so the table of contents and the
links to a heading find their place without rendering what lies above.

A run that holds a heading (an API page's object, whose headings sit inside its own
`<div>`) or whose tags do not balance is left as it is.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser
from typing import Any

HEADINGS = {"h1", "h2", "h3", "h4", "h5", "h6"}
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}
OPEN = '<div class="handbook-section" style="contain-intrinsic-block-size: auto {room}px">'
# The room a block holds until it is drawn, from what it holds, for a column about 70
# characters wide: one line of prose per LINE_CHARS characters, plus a line per table row,
# listing line and block. It only has to be near: the browser keeps the real size once drawn.
LINE_PX, LINE_CHARS, CODE_LINE_PX, ROW_PX, BLOCK_PX, DIAGRAM_PX = 26, 70, 18, 34, 20, 320
LISTING = re.compile(r"<pre\b.*?</pre>", re.S)
TAG = re.compile(r"<[^>]+>")


class _Outline(HTMLParser):
    """Offsets of the top-level headings of a page's HTML: (start, end) of each `<hN>...</hN>`."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=False)
        self.headings: list[tuple[int, int]] = []
        self.depth = 0
        self.balanced = True
        self._heading_start: int | None = None
        self._line_starts: list[int] = []

    def _position(self) -> int:
        line, column = self.getpos()
        return self._line_starts[line - 1] + column

    def outline(self, content: str) -> list[tuple[int, int]]:
        self._line_starts = [0] + [m.end() for m in re.finditer("\n", content)]
        self.feed(content)
        self.close()
        self.balanced = self.balanced and self.depth == 0
        return self.headings

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        if tag in VOID:
            return
        if self.depth == 0 and tag in HEADINGS:
            self._heading_start = self._position()
        self.depth += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in VOID:
            return
        self.depth -= 1
        if self.depth < 0:
            self.balanced = False
            self.depth = 0
        if self.depth == 0 and tag in HEADINGS and self._heading_start is not None:
            start = self._position()
            self.headings.append((self._heading_start, start + len(f"</{tag}>")))
            self._heading_start = None


def _balanced_without_heading(run: str) -> bool:
    outline = _Outline()
    headings = outline.outline(run)
    return outline.balanced and not headings and not any(f"<{h}" in run for h in HEADINGS)


def room(run: str) -> int:
    """The height in CSS pixels that a block of HTML `run` holds before it is drawn."""
    code_lines = sum(listing.count("\n") + 1 for listing in LISTING.findall(run))
    prose = TAG.sub("", LISTING.sub("", run))
    blocks = len(re.findall(r"<(?:p|li|div|details|table|figure|blockquote)\b", run))
    return (LINE_PX * (len(" ".join(prose.split())) // LINE_CHARS + 1) + CODE_LINE_PX * code_lines
            + ROW_PX * run.count("<tr") + BLOCK_PX * blocks + DIAGRAM_PX * run.count('class="mermaid"'))


def wrap_sections(content: str) -> str:
    """`content` with each run of top-level blocks between its headings in a section block."""
    outline = _Outline()
    headings = outline.outline(content)
    if not outline.balanced:
        return content
    pieces, cursor = [], 0
    for start, end in [*headings, (len(content), len(content))]:
        run = content[cursor:start]
        if run.strip() and _balanced_without_heading(run):
            pieces.append(OPEN.format(room=room(run)) + run + "</div>")
        else:
            pieces.append(run)
        pieces.append(content[start:end])
        cursor = end
    return "".join(pieces)


def on_page_content(content: str, **_: Any) -> str:
    return wrap_sections(content)

"""MkDocs hook: diagrams drawn ahead of time, so that no page needs the Mermaid bundle to show them.

The ```mermaid blocks in the Markdown stay the diagrams' source. `scripts/render_diagrams.py`
draws each one with the vendored Mermaid, as the theme draws it in the browser, and stores
the SVG in `docs/diagrams/KEY.svg`, KEY naming the block's exact text. This hook marks each
block that has its SVG (`data-diagram="KEY"`); the site's Mermaid stand-in
(`docs/javascripts/diagrams.js`) then hands the theme that SVG instead of loading Mermaid.
Until it does, the marked block holds the drawing's room (its width and aspect ratio, from
the SVG's viewBox) instead of showing its source, so nothing moves when the diagram appears.
Each marked block sits in a frame that knows the drawing's own width: on a phone or tablet a
wide diagram keeps labels a reader can read and the frame scrolls sideways to show the rest
(`docs/stylesheets/extra.css`), instead of shrinking the drawing to the column's width.
A diagram that flows left to right is also drawn top to bottom; where that drawing is the
narrower one, the block names it too (`data-diagram-narrow="KEY"`) and narrow screens get it.
A block without a current SVG (a new or edited diagram) is left unmarked and is drawn in the
browser as before, so the site builds and serves on a machine without Chromium;
`tests/docs/test_docs_diagrams.py` fails until the SVGs are redrawn.
"""

from __future__ import annotations

import hashlib
import html
import logging
import re
from pathlib import Path
from typing import Any

DIAGRAMS = Path(__file__).resolve().parents[1] / "diagrams"
# mermaid2's fence for the theme: `<pre  class="mermaid"><code>SOURCE\n</code></pre>` (the lint
# keeps raw tags out of SOURCE, so its unescaped text is the browser's textContent). In the
# built page the block carries this hook's mark and room.
BLOCK = re.compile(r'<pre\s+class="mermaid"(?:\s[^>]*)?><code>(?P<source>.*?)</code></pre>', re.S)
OPENING = re.compile(r'<pre\s+class="mermaid">')
# The first line of a flowchart drawn left to right (`graph` is Mermaid's older name for it).
LEFT_TO_RIGHT = re.compile(r"\A(?P<head>\s*(?:flowchart|graph)[ \t]+)LR\b")
VIEWBOX = re.compile(r'viewBox="[-\d.]+ [-\d.]+ (?P<width>[\d.]+) (?P<height>[\d.]+)"')
log = logging.getLogger("mkdocs.hooks.diagrams")


def diagram_key(text: str) -> str:
    """The name of a diagram's SVG: a digest of the exact text the browser hands Mermaid."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def narrow_source(text: str) -> str | None:
    """The text of a left-to-right flowchart turned top to bottom; None for any other diagram."""
    turned = LEFT_TO_RIGHT.sub(r"\g<head>TB", text, count=1)
    return turned if turned != text else None


def diagram_sources(content: str) -> dict[str, str]:
    """KEY -> text of every Mermaid block in a page's HTML, and of each one's top-to-bottom turn."""
    sources = {}
    for text in (html.unescape(m["source"]) for m in BLOCK.finditer(content)):
        for drawn in (text, narrow_source(text)):
            if drawn is not None:
                sources[diagram_key(drawn)] = drawn
    return sources


def _size(key: str) -> tuple[str, str] | None:
    """(width, height) of the stored SVG named `key`, from its viewBox; None if it has none."""
    svg = DIAGRAMS / f"{key}.svg"
    box = VIEWBOX.search(svg.read_text(encoding="utf-8")[:4000]) if svg.is_file() else None
    return (box["width"], box["height"]) if box else None


def _marked(match: re.Match[str], page: str) -> str:
    text = html.unescape(match["source"])
    key = diagram_key(text)
    if not (DIAGRAMS / f"{key}.svg").is_file():
        log.info("%s: diagram %s has no SVG yet; it is drawn in the browser "
                 "(python scripts/render_diagrams.py draws it)", page, key)
        return match[0]
    wide = _size(key)
    if wide is None:
        return OPENING.sub(f'<pre class="mermaid" data-diagram="{key}">', match[0], count=1)
    # Mermaid draws the SVG 100% wide, up to its own width, at its viewBox's aspect ratio;
    # the frame tells the block the width and ratio of the drawing this screen gets.
    room = {"wide-width": f"{wide[0]}px", "wide-ratio": f"{wide[0]} / {wide[1]}"}
    turned = narrow_source(text)
    narrow_key = diagram_key(turned) if turned else None
    narrow = _size(narrow_key) if narrow_key else None
    named = ""
    if narrow and float(narrow[0]) < float(wide[0]):
        room |= {"narrow-width": f"{narrow[0]}px", "narrow-ratio": f"{narrow[0]} / {narrow[1]}"}
        named = f' data-diagram-narrow="{narrow_key}"'
    block = OPENING.sub(f'<pre class="mermaid" data-diagram="{key}"{named} '
                        'style="max-width: var(--diagram-width); aspect-ratio: var(--diagram-ratio)">',
                        match[0], count=1)
    style = "; ".join(f"--{name}: {value}" for name, value in room.items())
    # The theme replaces the block with the drawing inside this frame, which stays.
    return f'<div class="diagram-frame" style="{style}">{block}</div>'


def on_page_content(content: str, page: Any, **_: Any) -> str:
    """Mark every Mermaid block whose SVG is in `docs/diagrams/`."""
    return BLOCK.sub(lambda m: _marked(m, page.file.src_uri), content)

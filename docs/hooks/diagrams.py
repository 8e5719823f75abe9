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
VIEWBOX = re.compile(r'viewBox="[-\d.]+ [-\d.]+ (?P<width>[\d.]+) (?P<height>[\d.]+)"')
log = logging.getLogger("mkdocs.hooks.diagrams")


def diagram_key(text: str) -> str:
    """The name of a diagram's SVG: a digest of the exact text the browser hands Mermaid."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def diagram_sources(content: str) -> dict[str, str]:
    """KEY -> text of every Mermaid block in a page's HTML."""
    return {diagram_key(text): text for text in (html.unescape(m["source"]) for m in BLOCK.finditer(content))}


def _marked(match: re.Match[str], page: str) -> str:
    key = diagram_key(html.unescape(match["source"]))
    svg = DIAGRAMS / f"{key}.svg"
    if not svg.is_file():
        log.info("%s: diagram %s has no SVG yet; it is drawn in the browser "
                 "(python scripts/render_diagrams.py draws it)", page, key)
        return match[0]
    box = VIEWBOX.search(svg.read_text(encoding="utf-8")[:4000])
    # Mermaid draws the SVG 100% wide, up to its own width, at its viewBox's aspect ratio.
    room = f' style="max-width: {box["width"]}px; aspect-ratio: {box["width"]} / {box["height"]}"' if box else ""
    block = OPENING.sub(f'<pre class="mermaid" data-diagram="{key}"{room}>', match[0], count=1)
    if not box:
        return block
    # The theme replaces the block with the drawing inside this frame, which stays.
    return f'<div class="diagram-frame" style="--diagram-width: {box["width"]}px">{block}</div>'


def on_page_content(content: str, page: Any, **_: Any) -> str:
    """Mark every Mermaid block whose SVG is in `docs/diagrams/`."""
    return BLOCK.sub(lambda m: _marked(m, page.file.src_uri), content)

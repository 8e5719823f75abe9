"""Every diagram on the site is drawn ahead of time from its current source, so no page loads Mermaid.

`scripts/render_diagrams.py` redraws them; docs/hooks/diagrams.py marks each block whose SVG
exists. A diagram edited without redrawing would fall back to loading the 3.5 MB bundle.
"""

from __future__ import annotations

from html import unescape
import re
import sys
from pathlib import Path

import pytest

import handbook_docs_support as support

sys.path.insert(0, str(support.DOCS / "hooks"))

import diagrams  # noqa: E402

pytestmark = pytest.mark.docs

SVG_TEXT = re.compile(r"<(?:p|text|span)\b[^>]*>\s*[^<\s]")


def _site_diagrams(built_site: Path) -> dict[str, list[str]]:
    """KEY -> the pages (site paths) that show that diagram."""
    found: dict[str, list[str]] = {}
    for html in sorted(built_site.rglob("*.html")):
        for key in diagrams.diagram_sources(html.read_text(encoding="utf-8")):
            found.setdefault(key, []).append(html.relative_to(built_site).as_posix())
    return found


def test_every_diagram_has_an_svg_of_its_current_source_and_no_svg_is_stale(built_site: Path) -> None:
    shown = _site_diagrams(built_site)
    assert len(shown) >= 10, f"only {len(shown)} distinct diagrams on the site"
    stored = {path.stem for path in diagrams.DIAGRAMS.glob("*.svg")}
    missing = {key: pages for key, pages in shown.items() if key not in stored}
    assert not missing, ("diagrams without an SVG of their current source (run python "
                         f"scripts/render_diagrams.py): {missing}")
    assert not stored - set(shown), f"SVGs no page shows: {sorted(stored - set(shown))}"
    blocks = [m for html in built_site.rglob("*.html")
              for m in re.finditer(r'<pre class="mermaid"[^>]*>', html.read_text(encoding="utf-8"))]
    unmarked = [m[0] for m in blocks if "data-diagram=" not in m[0] or "aspect-ratio:" not in m[0]]
    assert not unmarked, f"blocks the page would draw with Mermaid itself: {unmarked[:3]}"


@pytest.mark.parametrize("svg", sorted(diagrams.DIAGRAMS.glob("*.svg")), ids=lambda p: p.stem)
def test_each_svg_is_a_mermaid_drawing_with_readable_text_in_both_palettes(svg: Path) -> None:
    """The stand-in swaps its id for the theme's; its colours are the theme's CSS variables,
    which differ between the light and dark palette; its labels are text a screen reader reads."""
    text = svg.read_text(encoding="utf-8")
    assert text.startswith('<svg id="__mermaid_drawn"'), text[:80]
    assert 'aria-roledescription="' in text and diagrams.VIEWBOX.search(text)
    assert "var(--md-mermaid-label-fg-color)" in text and "var(--md-mermaid-edge-color)" in text
    assert SVG_TEXT.search(text), "no text in the drawing"
    assert "Syntax error" not in text


@pytest.mark.parametrize(("text", "turned"), [
    ("flowchart LR\n  A --> B\n", "flowchart TB\n  A --> B\n"),
    ("graph LR\n  A --> B", "graph TB\n  A --> B"),
    ("flowchart TD\n  A --> B", None),
    ("sequenceDiagram\n  A->>B: LR", None),
    ("flowchart LRX\n  A --> B", None),
])
def test_only_a_left_to_right_flowchart_is_turned_top_to_bottom(text: str, turned: str | None) -> None:
    assert diagrams.narrow_source(text) == turned


FRAMED_BLOCK = re.compile(r'<div class="diagram-frame" style="(?P<style>[^"]*)"><pre class="mermaid" '
                          r'data-diagram="(?P<key>\w+)"(?: data-diagram-narrow="(?P<narrow>\w+)")?[^>]*>'
                          r'<code>(?P<source>.*?)</code>', re.S)


def _drawn_width(key: str) -> str:
    """The width of the stored drawing `key`, as its viewBox gives it."""
    return diagrams.VIEWBOX.search((diagrams.DIAGRAMS / f"{key}.svg").read_text(encoding="utf-8"))["width"]


def test_a_narrow_screen_gets_the_turned_drawing_only_where_it_is_narrower(built_site: Path) -> None:
    """A block names its turned drawing (and its frame holds that drawing's room) exactly
    when the turn is narrower than the drawing the page was written with."""
    checked = named = 0
    for page in built_site.rglob("index.html"):
        for block in FRAMED_BLOCK.finditer(page.read_text(encoding="utf-8")):
            turned = diagrams.narrow_source(unescape(block["source"]))
            turned_key = diagrams.diagram_key(turned) if turned else None
            narrower = bool(turned_key) and float(_drawn_width(turned_key)) < float(_drawn_width(block["key"]))
            assert block["narrow"] == (turned_key if narrower else None), (page, block["key"])
            if narrower:
                assert f"--narrow-width: {_drawn_width(turned_key)}px" in block["style"], (page, block["key"])
            checked, named = checked + 1, named + narrower
    assert checked >= 20 and named >= 5, (checked, named)

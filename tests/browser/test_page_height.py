"""Every content page is short enough to read in one sitting: at most 20,000 px tall at 1280x800.

A page taller than that is split into pages (the design's rule for pages). The height is the page as drawn:
docs/hooks/sections.py lets the browser skip text far from the screen and hold an estimate
of its room instead, so the test draws every block before it measures. The API pages
(generated from docstrings) and the all-in-one page (every page on one, by design) are not
content pages.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from handbook_pdf import new_context
from test_site_in_chromium import Problems

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(480)]  # the site build may fall inside it

DESKTOP = {"width": 1280, "height": 800}
TALLEST_PX = 20_000
NOT_CONTENT = ("api/", "reference/all-in-one/")
# Draw every block now, at its real size, not the room estimated for it while off screen.
DRAW_ALL = ".md-typeset .handbook-section, .md-typeset .highlight { content-visibility: visible !important; }"
HEIGHT = "() => Math.ceil(document.documentElement.scrollHeight)"


def content_pages(site: Path) -> list[str]:
    pages = sorted(p.parent.relative_to(site).as_posix() + "/" for p in site.rglob("index.html"))
    pages = ["" if p == "./" else p for p in pages]
    return [p for p in pages if not p.startswith(NOT_CONTENT) and not p.startswith(("assets/", "search/"))]


def test_every_content_page_is_at_most_20000_px_tall_at_1280x800(browser, server, built_site: Path) -> None:
    pages = content_pages(built_site)
    assert len(pages) > 20 and "foundations/parallelism/" in pages, pages
    context = new_context(browser, viewport=DESKTOP)
    page = context.new_page()
    page.set_default_timeout(20_000)
    problems = Problems(page)
    heights = {}
    try:
        for path in pages:
            page.goto(server + path, wait_until="load")
            page.add_style_tag(content=DRAW_ALL)
            page.evaluate("() => document.fonts.ready.then(() => new Promise(requestAnimationFrame))")
            heights[path] = page.evaluate(HEIGHT)
    finally:
        context.close()
    print("\n" + "\n".join(f"{h:>8,} px  {p or '(home)'}" for p, h in sorted(heights.items(), key=lambda x: -x[1])))
    too_tall = {p: h for p, h in heights.items() if h > TALLEST_PX}
    assert not too_tall, "pages taller than {:,} px at 1280x800 (split them): {}".format(
        TALLEST_PX, ", ".join(f"{p} {h:,} px" for p, h in sorted(too_tall.items(), key=lambda x: -x[1])))
    assert not problems.items, "\n".join(problems.items)

"""Drive the built handbook in headless Chromium: every diagram renders, nothing errors, and
every content page is short enough to read in one sitting (at most 20,000 px tall at 1280x800).

Needs the system Chromium (`apt-get install chromium`, or set CHROMIUM to another binary):
the test fails, never skips, when it is missing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from pathlib import Path
from urllib.parse import urlparse

import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from handbook_pdf import OPEN_SHADOW_ROOTS, new_context

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(480)]  # the site build may fall inside it

COUNT_RENDERED = """
() => Array.from(document.querySelectorAll("div.mermaid")).filter(
  (host) => host.shadowRoot && host.shadowRoot.querySelector("svg")).length
"""
# A diagram renders when it comes near the viewport (docs/javascripts/diagrams.js): bring each
# one into view in turn, as a reader scrolling down the page does.
SCROLL_TO_DIAGRAMS = """
async () => {
  for (const block of document.querySelectorAll("pre.mermaid")) {
    block.scrollIntoView({block: "center"});
    await new Promise((resolve) => requestAnimationFrame(() => setTimeout(resolve, 50)));
  }
}
"""
# For the test of every page: each diagram counts as near the viewport as soon as it is
# observed, so all of them render without scrolling a long page frame by frame. That test
# checks that every diagram renders; test_page_weight.py checks when, with the real observer.
DIAGRAMS_ALL_NEAR = """
const Observer = window.IntersectionObserver;
window.IntersectionObserver = class extends Observer {
  constructor(callback, options) {
    super(callback, options);
    this.notify = callback;
  }
  observe(target) {
    if (target.tagName === "PRE") {
      setTimeout(() => this.notify([{target, isIntersecting: true}], this));
    } else {
      super.observe(target);
    }
  }
};
"""
DESKTOP = {"width": 1280, "height": 800}
TALLEST_PX = 20_000
NOT_CONTENT = ("api/", "reference/all-in-one/")
# Draw every block now, at its real size, not the room estimated for it while off screen.
DRAW_ALL = ".md-typeset .handbook-section, .md-typeset .highlight { content-visibility: visible !important; }"
HEIGHT = "() => Math.ceil(document.documentElement.scrollHeight)"
MERMAID_ERRORS = """
() => Array.from(document.querySelectorAll("div.mermaid")).filter(
  (host) => host.shadowRoot && /Syntax error|Parse error/i.test(host.shadowRoot.textContent)).length
"""


class Problems:
    """Collects page errors, console errors, failed requests and HTTP errors for one page."""

    def __init__(self, page) -> None:
        self.items: list[str] = []
        page.on("pageerror", lambda e: self.items.append(f"pageerror: {e}"))
        page.on("console", lambda m: m.type == "error" and self.items.append(f"console: {m.text}"))
        page.on("requestfailed", self._request_failed)
        page.on("response", lambda r: r.status >= 400 and self.items.append(f"HTTP {r.status}: {r.url}"))

    def _request_failed(self, request) -> None:
        # Chromium cancels its own in-flight requests (the favicon, typically) when a page is
        # swapped or its context closes: net::ERR_ABORTED from the local server is not a fault
        # of the site (a missing file is an HTTP 404, reported above). Anything else counts,
        # and every failure of a request that leaves the local server.
        if request.failure == "net::ERR_ABORTED" and urlparse(request.url).hostname == "127.0.0.1":
            return
        self.items.append(f"requestfailed: {request.url} {request.failure}")


def render_diagrams(page, expected: int, timeout_ms: float = 30_000) -> int:
    """Scroll to every diagram of the page, wait until `expected` have rendered; how many did."""
    page.evaluate(SCROLL_TO_DIAGRAMS)
    with contextlib.suppress(PlaywrightTimeout):  # the caller reports the count
        page.wait_for_function(f"() => ({COUNT_RENDERED})() >= {expected}", timeout=timeout_ms)
    return page.evaluate(COUNT_RENDERED)


def _new_page(browser, *init_scripts: str, search: bool = False):
    context = new_context(browser, OPEN_SHADOW_ROOTS, *init_scripts, search=search, viewport=DESKTOP)
    # Anything outside the local server counts as a failure: the site must work offline.
    page = context.new_page()
    page.set_default_timeout(20_000)
    return context, page


@dataclasses.dataclass
class Walk:
    """What one visit of every page found: problems by page, diagrams, drawn heights."""

    report: list[str]
    total_diagrams: int
    heights: dict[str, int]


def content_pages(site: Path) -> list[str]:
    """Paths of the content pages, relative to the site's root: the API pages (generated
    from docstrings) and the all-in-one page (every page on one, by design) are not."""
    pages = sorted(p.parent.relative_to(site).as_posix() + "/" for p in site.rglob("index.html"))
    pages = ["" if p == "./" else p for p in pages]
    return [p for p in pages if not p.startswith(NOT_CONTENT) and not p.startswith(("assets/", "search/"))]


@pytest.fixture(scope="module")
def walk(browser, server, built_site: Path) -> Walk:
    """Every page, visited once at 1280x800, for the checks that need every page.

    Each page's diagrams must render, with no page error, console error or failed request;
    a problem that the previous page raises late is filed under this page. Then each
    content page is measured as drawn: docs/hooks/sections.py lets the browser skip text far
    from the screen and hold an estimate of its room instead, so every block is drawn first.
    """
    pages = sorted(p for p in built_site.rglob("index.html"))
    assert len(pages) > 10
    content = set(content_pages(built_site))
    walked = Walk([], 0, {})
    # One tab for the whole walk: each goto loads a new document, as a fresh tab would (a new
    # tab per page made the walk take a third longer).
    context, page = _new_page(browser, DIAGRAMS_ALL_NEAR)
    problems, filed = Problems(page), 0
    # Every diagram is drawn ahead of time (tests/docs/test_docs_diagrams.py): none needs Mermaid.
    page.on("request", lambda r: "/vendor/mermaid-" in r.url and problems.items.append(f"loaded {r.url}"))
    try:
        for html in pages:
            expected = html.read_text(encoding="utf-8").count('<pre class="mermaid"')
            walked.total_diagrams += expected
            path = html.parent.relative_to(built_site).as_posix() + "/"
            path = "" if path == "./" else path
            page.goto(server + path, wait_until="load")
            if expected:
                with contextlib.suppress(PlaywrightTimeout):  # reported below with the count
                    page.wait_for_function(f"() => ({COUNT_RENDERED})() >= {expected}", timeout=30_000)
                rendered = page.evaluate(COUNT_RENDERED)
                if rendered < expected:
                    problems.items.append(f"{rendered} of {expected} diagrams rendered to SVG")
                if page.evaluate(MERMAID_ERRORS):
                    problems.items.append("a diagram shows a mermaid syntax error")
            if path in content:
                page.add_style_tag(content=DRAW_ALL)
                page.evaluate("() => document.fonts.ready.then(() => new Promise(requestAnimationFrame))")
                walked.heights[path] = page.evaluate(HEIGHT)
            page.wait_for_timeout(50)
            walked.report += [f"{server + path}: {item}" for item in problems.items[filed:]]
            filed = len(problems.items)
    finally:
        context.close()
    return walked


def test_every_page_renders_its_diagrams_without_errors(walk: Walk) -> None:
    assert walk.total_diagrams >= 10, f"only {walk.total_diagrams} diagrams on the whole site"
    assert not walk.report, "\n".join(walk.report)


def test_every_content_page_is_at_most_20000_px_tall_at_1280x800(walk: Walk) -> None:
    """A page taller than that is split into pages (the design's rule for pages)."""
    heights = walk.heights
    assert len(heights) > 20 and "foundations/parallelism/" in heights, sorted(heights)
    print("\n" + "\n".join(f"{h:>8,} px  {p or '(home)'}" for p, h in sorted(heights.items(), key=lambda x: -x[1])))
    too_tall = {p: h for p, h in heights.items() if h > TALLEST_PX}
    assert not too_tall, "pages taller than {:,} px at 1280x800 (split them): {}".format(
        TALLEST_PX, ", ".join(f"{p} {h:,} px" for p, h in sorted(too_tall.items(), key=lambda x: -x[1])))


def test_search_returns_results(browser, server):
    context, page = _new_page(browser, search=True)
    problems = Problems(page)
    try:
        page.goto(server, wait_until="load")
        page.click("label.md-search__icon, input.md-search__input")
        search = page.locator("input.md-search__input")
        search.click()
        search.press_sequentially("sampler", delay=30)
        page.wait_for_selector(".md-search-result__item", timeout=20_000)
        assert page.locator(".md-search-result__item").count() > 0
        # The index leaves out the all-in-one page and most API text; the pages stay findable.
        search.fill("")
        search.press_sequentially("playbook", delay=30)
        page.wait_for_selector('.md-search-result__item a[href*="/foundations/parallelism/"]', timeout=20_000)
    finally:
        context.close()
    assert not problems.items, "\n".join(problems.items)


@pytest.mark.parametrize("search", [False, True], ids=["search_idle", "search_on"])
def test_the_search_worker_builds_the_index_only_where_search_is_wanted(browser, server, search: bool) -> None:
    """The page fetches the index either way; only a page that wants search loads the theme's
    worker that builds it (`handbook_pdf.SEARCH_IDLE` swaps in an empty one, quietly)."""
    context, page = _new_page(browser, search=search)
    problems, workers = Problems(page), []
    context.on("request", lambda r: "/workers/search." in r.url and workers.append(r.url))
    try:
        page.goto(server, wait_until="networkidle")
    finally:
        context.close()
    assert bool(workers) == search, workers
    assert not problems.items, "\n".join(problems.items)


FIRST_RESULT = "() => document.querySelector('.md-search-result__item > a')?.getAttribute('href') || ''"


@pytest.mark.parametrize(("query", "page"), [
    ("pipeline bubble", "foundations/tensor-pipeline"), ("ZeRO", "foundations/data-parallel"),
    ("graph break", "reliability/graph-breaks"), ("HSDP", "foundations/parallelism"),
    ("FlatParameter", "foundations/fsdp2"), ("MXFP8", "reliability/fp8-recipes"),
    ("flight recorder", "reliability/hang-triage"), ("roofline", "foundations/hardware")])
def test_search_ranks_the_answering_page_first(browser, server, query: str, page: str):
    """In the real dialog, the page that answers ranks first, not one that merely says
    "pipelines" or "zero" (tests/docs/test_docs_search_index.py checks more queries with the
    same worker under Node)."""
    context, tab = _new_page(browser, search=True)
    problems = Problems(tab)
    try:
        tab.goto(server, wait_until="load")
        tab.click("label.md-search__icon, input.md-search__input")
        search = tab.locator("input.md-search__input")
        search.fill(query)
        search.press("End")
        tab.wait_for_selector(".md-search-result__item", timeout=20_000)
        first = tab.evaluate(FIRST_RESULT)
        assert urlparse(first).path.rstrip("/").endswith(page), first
    finally:
        context.close()
    assert not problems.items, "\n".join(problems.items)


def test_dark_mode_toggle_switches_the_palette(browser, server):
    context, page = _new_page(browser)
    problems = Problems(page)
    try:
        page.goto(server, wait_until="load")
        scheme = "() => document.body.getAttribute('data-md-color-scheme')"
        before = page.evaluate(scheme)
        page.locator("form[data-md-component=palette] label:visible").first.click()
        page.wait_for_function(f"() => ({scheme})() !== {before!r}", timeout=10_000)
        after = page.evaluate(scheme)
        assert {before, after} == {"default", "slate"}
        background = page.evaluate("() => getComputedStyle(document.body).backgroundColor")
        assert background not in ("rgb(255, 255, 255)", "rgba(0, 0, 0, 0)") or after == "default"
    finally:
        context.close()
    assert not problems.items, "\n".join(problems.items)


def test_diagrams_render_after_instant_navigation(browser, server, built_site: Path):
    """Arriving by a click (Material's instant navigation, no full reload) from a page without
    a diagram still renders, with the site's own Mermaid (no CDN request)."""
    assert '<pre class="mermaid"' not in (built_site / "api" / "index.html").read_text(encoding="utf-8")
    # The theme navigates instantly only to the addresses in the sitemap, which are on the
    # configured site_url; this server has another port, so serve the sitemap with its address.
    sitemap = (built_site / "sitemap.xml").read_text(encoding="utf-8")
    site_url = re.search(r"<loc>(.*?)</loc>", sitemap)[1]
    context, page = _new_page(browser)
    context.route("**/sitemap.xml", lambda route: route.fulfill(
        body=sitemap.replace(site_url, server), content_type="application/xml"))
    problems = Problems(page)
    try:
        page.goto(server + "api/", wait_until="networkidle")
        page.evaluate("() => { window.handbookSameDocument = true; }")
        page.locator(".md-tabs a", has_text="Foundations").first.click()
        page.wait_for_url("**/foundations/system-model/", timeout=20_000)
        assert page.evaluate("() => window.handbookSameDocument === true"), (
            "the click loaded a new document: instant navigation was off")
        assert render_diagrams(page, 1) >= 1
    finally:
        context.close()
    assert not problems.items, "\n".join(problems.items)


# Material wraps each table in a scrolling box as wide as the content column: a wider table
# scrolls sideways there, and its right-hand columns (the verdicts) are out of sight.
OVERFLOWING_TABLES = """
() => Array.from(document.querySelectorAll("article table")).map((table) => {
  const box = table.closest(".md-typeset__scrollwrap") || table.parentElement;
  return {width: table.scrollWidth, column: box.clientWidth,
          header: Array.from(table.querySelectorAll("th"), (th) => th.textContent).join(" | ")};
}).filter((t) => t.width > t.column)
"""


PARALLELISM_PAGES = ("foundations/parallelism/", "foundations/data-parallel/", "foundations/tensor-pipeline/",
                     "foundations/context-parallel/", "foundations/expert-parallel/")


def test_the_parallelism_pages_tables_fit_their_column_at_desktop_width(browser, server):
    """The 70B plan's mesh tables and every other table on the playbook and its four
    parallelism pages fit the 720 px content column of a 1280 px window without scrolling
    sideways."""
    context, page = _new_page(browser)
    problems = Problems(page)
    overflowing = []
    try:
        for path in PARALLELISM_PAGES:
            page.goto(server + path, wait_until="load")
            if path == PARALLELISM_PAGES[0]:
                column = page.evaluate("() => document.querySelector('.md-typeset__scrollwrap').clientWidth")
            overflowing += page.evaluate(OVERFLOWING_TABLES)
    finally:
        context.close()
    assert 680 <= column <= 760, f"content column {column} px at 1280 px: the check's premise changed"
    assert not overflowing, "\n".join(f"{t['width']} px > {t['column']} px: {t['header']}" for t in overflowing)
    assert not problems.items, "\n".join(problems.items)

"""What a phone downloads and draws: the home page's first screen within budget, a diagram
only when near, a long page's text only when near (docs/hooks/sections.py).

A diagram comes from its SVG, drawn ahead of time (docs/hooks/diagrams.py); one without a
current SVG loads the Mermaid bundle instead, and only when it comes near the viewport.

Bytes are counted as Chromium received them (DevTools' `encodedDataLength`: headers and body
as sent, the worker's fetch of the search index included). The test server does not
compress, so these are the uncompressed sizes, an upper bound on what a compressing host sends.
"""

from __future__ import annotations

import re

import pytest

from handbook_pdf import new_context
from test_site_in_chromium import COUNT_RENDERED, OPEN_SHADOW_ROOTS, Problems

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(120)]

PHONE = {"width": 390, "height": 844}
FIRST_SCREEN_BUDGET = 1_500_000  # bytes
MERMAID_BUNDLE = "/javascripts/vendor/mermaid-"
DRAWN = "/diagrams/"
DIAGRAM_TOPS = "() => Array.from(document.querySelectorAll('pre.mermaid'), (pre) => pre.getBoundingClientRect().top)"
BOX = "(box) => [Math.round(box.width), Math.round(box.height)]"
ROOM = f"() => ({BOX})(document.querySelector('pre.mermaid').getBoundingClientRect())"
DRAWING = f"() => ({BOX})(document.querySelector('div.mermaid').shadowRoot.firstElementChild.getBoundingClientRect())"


class Transfers:
    """The bytes of every request a page makes, as the browser received them."""

    def __init__(self, context, page) -> None:
        self.urls: dict[str, str] = {}
        self.sizes: dict[str, int] = {}
        cdp = context.new_cdp_session(page)
        cdp.on("Network.requestWillBeSent", lambda e: self.urls.setdefault(e["requestId"], e["request"]["url"]))
        cdp.on("Network.loadingFinished", lambda e: self.sizes.__setitem__(e["requestId"], e["encodedDataLength"]))
        cdp.send("Network.enable")

    def total(self) -> int:
        return sum(self.sizes.values())

    def largest(self, n: int = 6) -> str:
        ranked = sorted(self.sizes.items(), key=lambda item: -item[1])[:n]
        return "\n".join(f"{size:>10,} {self.urls.get(rid, rid)}" for rid, size in ranked)

    def asked_for(self, fragment: str) -> bool:
        return any(fragment in url for url in self.urls.values())


def _phone(browser, search: bool = False):
    context = new_context(browser, OPEN_SHADOW_ROOTS, search=search, viewport=PHONE, device_scale_factor=3,
                          is_mobile=True, has_touch=True)
    page = context.new_page()
    page.set_default_timeout(20_000)
    return context, page


def test_home_page_first_screen_on_a_phone_stays_within_budget(browser, server) -> None:
    context, page = _phone(browser, search=True)
    transfers = Transfers(context, page)
    problems = Problems(page)
    try:
        page.goto(server, wait_until="networkidle")  # the search worker's index included
        page.wait_for_timeout(500)
    finally:
        context.close()
    assert transfers.asked_for("/search/search_index.json"), "the count missed the search index"
    assert not transfers.asked_for(MERMAID_BUNDLE), "the first screen has no diagram, yet Mermaid loaded"
    assert transfers.total() <= FIRST_SCREEN_BUDGET, (
        f"{transfers.total():,} bytes > {FIRST_SCREEN_BUDGET:,}; largest:\n{transfers.largest()}")
    assert not problems.items, "\n".join(problems.items)


def _first_diagram_near(page, transfers: Transfers) -> None:
    """On the home page: nothing of a diagram is fetched until the first one comes near."""
    page.wait_for_timeout(500)
    first = min(page.evaluate(DIAGRAM_TOPS))
    assert first > 1.5 * PHONE["height"], "the home page's first diagram is no longer below the first screen"
    assert not transfers.asked_for(MERMAID_BUNDLE) and not transfers.asked_for(DRAWN)
    assert page.evaluate(COUNT_RENDERED) == 0
    # A quarter of a screen below the bottom edge: near, not yet visible.
    page.evaluate(f"() => window.scrollBy(0, {first - 1.25 * PHONE['height']})")
    page.wait_for_function(f"() => ({COUNT_RENDERED})() >= 1", timeout=60_000)


def test_a_diagram_comes_from_its_svg_when_near_in_the_room_held_for_it(browser, server) -> None:
    context, page = _phone(browser)
    transfers = Transfers(context, page)
    problems = Problems(page)
    try:
        page.goto(server, wait_until="networkidle")
        room = page.evaluate(ROOM)
        _first_diagram_near(page, transfers)
        drawing = page.evaluate(DRAWING)
        assert transfers.asked_for(DRAWN)
        assert not transfers.asked_for(MERMAID_BUNDLE), "a diagram drawn ahead of time loaded Mermaid"
    finally:
        context.close()
    assert room == drawing, f"the diagram's room {room} is not the size of its drawing {drawing}"
    assert not problems.items, "\n".join(problems.items)


def test_a_diagram_without_its_svg_loads_mermaid_only_when_near(browser, server) -> None:
    context, page = _phone(browser)

    def unmarked(route) -> None:  # as if every diagram had been edited since it was drawn
        response = route.fetch()
        route.fulfill(response=response, body=re.sub(r' data-diagram="\w+"[^>]*>', ">", response.text()))

    context.route(server, unmarked)
    transfers = Transfers(context, page)
    problems = Problems(page)
    try:
        page.goto(server, wait_until="networkidle")
        _first_diagram_near(page, transfers)
        assert transfers.asked_for(MERMAID_BUNDLE)
        assert not transfers.asked_for(DRAWN)
    finally:
        context.close()
    assert not problems.items, "\n".join(problems.items)


# Each section block: is the browser drawing its text now (checkVisibility counts what a
# content-visibility block skips as not visible), and the block's top edge.
DRAWN_TEXT = "(s) => s.firstElementChild.checkVisibility({contentVisibilityAuto: true})"
SECTIONS = f"""() => Array.from(document.querySelectorAll('.handbook-section'),
  (s) => [({DRAWN_TEXT})(s), Math.round(s.getBoundingClientRect().top)])"""
HEADING_OFFSET = "(id) => { const h = document.getElementById(id); " \
                 "return h.getBoundingClientRect().top - parseFloat(getComputedStyle(h).scrollMarginTop); }"
FAR_HEADING = "in-the-reference-trainer"  # the last heading of the parallelism playbook, half-way down


def test_a_long_pages_text_is_drawn_only_when_near(browser, server) -> None:
    context, page = _phone(browser)
    problems = Problems(page)
    try:
        # The address carries a malformed fragment, which sections.js must ignore without an error.
        page.goto(server + "practice/notebook-walkthrough/#%E0%A4%A", wait_until="load")  # the tallest page
        page.wait_for_timeout(500)
        drawn = page.evaluate(SECTIONS)
    finally:
        context.close()
    assert len(drawn) > 10
    assert drawn[0][0], "the text on the first screen is not drawn"
    far = [visible for visible, top in drawn if top > 3 * PHONE["height"]]
    assert far and not any(far), "text three screens down is drawn on load"
    assert not problems.items, "\n".join(problems.items)


# A link from elsewhere (search, another page) and a link within the page, on the longest
# page and on the API page whose estimated room was furthest off (docs/javascripts/sections.js).
@pytest.mark.parametrize(("path", "heading", "arrive"), [
    ("foundations/parallelism/", FAR_HEADING, "load"),
    ("foundations/parallelism/", FAR_HEADING, "hashchange"),
    ("api/bench/", "reference_impl.bench.common", "load"),
    ("api/bench/", "reference_impl.bench.benchmark", "hashchange"),
])
def test_a_link_to_a_heading_lands_on_it_while_the_text_around_is_drawn(
        browser, server, path: str, heading: str, arrive: str) -> None:
    context, page = _phone(browser)
    problems = Problems(page)
    try:
        if arrive == "load":
            page.goto(f"{server}{path}#{heading}", wait_until="load")
        else:
            page.goto(server + path, wait_until="load")
            page.evaluate(f"() => {{ location.hash = '{heading}'; }}")
        page.wait_for_timeout(1500)
        offset = page.evaluate(HEADING_OFFSET, heading)
        after = page.evaluate(f"() => ({DRAWN_TEXT})(document.getElementById('{heading}').nextElementSibling)")
    finally:
        context.close()
    assert abs(offset) <= 2, f"the heading is {offset:.0f} px from where a link puts it"
    assert after, "the text under the linked heading is not drawn"
    assert not problems.items, "\n".join(problems.items)

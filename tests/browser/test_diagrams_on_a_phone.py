"""Every diagram of every content page is legible on a 390x844 phone, and all of it can be reached.

A label's size is the height of the box its text is drawn in, in CSS pixels after every
scaling (the SVG's fit to its frame included): what the reader's eye gets. Each line of a
label counts as one label. A diagram is reachable when it fits its frame, or its frame
scrolls sideways to its right-hand edge, and the page itself never scrolls sideways.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from handbook_pdf import new_context
from test_site_in_chromium import DIAGRAMS_ALL_NEAR, OPEN_SHADOW_ROOTS, Problems, content_pages, render_diagrams

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(300)]

PHONE = {"width": 390, "height": 844}
MEDIAN_LABEL_PX = 12
SMALLEST_LABEL_PX = 12
# Per diagram, in page order: the height of each drawn line of label text, and whether the
# drawing can be reached (its frame fits it, or scrolls sideways as far as its right edge).
MEASURE = """
() => Array.from(document.querySelectorAll("div.mermaid"), (host) => {
  const svg = host.shadowRoot.querySelector("svg");
  const heights = [];
  const walker = document.createTreeWalker(svg, NodeFilter.SHOW_TEXT);
  for (let text = walker.nextNode(); text; text = walker.nextNode()) {
    const parent = text.parentElement;
    if (!text.data.trim() || parent.closest("style")) continue;
    if (parent instanceof SVGElement) {
      heights.push(parent.getBoundingClientRect().height);
    } else {  // HTML in a foreignObject: one box per drawn line
      const range = document.createRange();
      range.selectNodeContents(text);
      for (const line of range.getClientRects()) heights.push(line.height);
    }
  }
  const drawing = svg.getBoundingClientRect();
  let frame = host.parentElement;
  while (frame && getComputedStyle(frame).overflowX === "visible") frame = frame.parentElement;
  frame = frame || document.documentElement;
  const box = frame.getBoundingClientRect();
  const scrolls = ["auto", "scroll"].includes(getComputedStyle(frame).overflowX);
  const reach = scrolls ? frame.scrollWidth : frame.clientWidth;
  return {
    heights: heights.filter((h) => h > 0),
    width: drawing.width,
    reachable: drawing.left >= box.left - 1 && drawing.left - box.left + frame.scrollLeft + drawing.width <= reach + 1,
  };
})
"""
PAGE_SCROLLS_SIDEWAYS = "() => document.documentElement.scrollWidth > document.documentElement.clientWidth + 1"


def _measure(browser, server: str, built_site: Path) -> dict[str, list[dict]]:
    """Page path -> the measure of each of its diagrams, drawn on a phone."""
    pages = {path: (built_site / path / "index.html").read_text(encoding="utf-8").count('<pre class="mermaid"')
             for path in content_pages(built_site)}
    context = new_context(browser, OPEN_SHADOW_ROOTS, DIAGRAMS_ALL_NEAR, viewport=PHONE, device_scale_factor=2,
                          is_mobile=True, has_touch=True)
    page = context.new_page()
    page.set_default_timeout(20_000)
    problems = Problems(page)
    measured = {}
    try:
        for path, expected in pages.items():
            if not expected:
                continue
            page.goto(server + path, wait_until="load")
            assert render_diagrams(page, expected) >= expected, f"{path}: not every diagram rendered"
            page.evaluate("() => document.fonts.ready.then(() => new Promise(requestAnimationFrame))")
            measured[path] = page.evaluate(MEASURE)
            if page.evaluate(PAGE_SCROLLS_SIDEWAYS):
                problems.items.append(f"{path}: the page scrolls sideways")
    finally:
        context.close()
    assert not problems.items, "\n".join(problems.items)
    return measured


def test_every_diagram_is_legible_and_reachable_on_a_phone(browser, server, built_site: Path) -> None:
    measured = _measure(browser, server, built_site)
    assert sum(map(len, measured.values())) >= 20, measured.keys()
    lines, faults = [], []
    for path, diagrams in measured.items():
        for index, diagram in enumerate(diagrams):
            where = f"{path or '(home)'} diagram {index} ({diagram['width']:.0f} px wide)"
            if not diagram["heights"]:
                faults.append(f"{where}: no label text found")
                continue
            smallest, median = min(diagram["heights"]), statistics.median(diagram["heights"])
            lines.append(f"{where}: labels {smallest:.1f} px smallest, {median:.1f} px median")
            if median < MEDIAN_LABEL_PX or smallest < SMALLEST_LABEL_PX:
                faults.append(f"{where}: labels {smallest:.1f} px smallest, {median:.1f} px median "
                              f"(at least {SMALLEST_LABEL_PX} and {MEDIAN_LABEL_PX})")
            if not diagram["reachable"]:
                faults.append(f"{where}: part of the drawing is clipped away (its frame does not scroll to it)")
    print("\n" + "\n".join(lines))
    assert not faults, "\n".join(faults)


# The system model: its frame scrolls on a phone; at 1280 px the same diagram fits the column.
SCROLLING_PAGE = "foundations/system-model/"
FRAME = """() => {
  const frame = document.querySelector(".diagram-frame");
  return {scrolls: frame.hasAttribute("data-scrolls"), tabIndex: frame.tabIndex, scrollLeft: frame.scrollLeft,
          focused: document.activeElement === frame, label: frame.getAttribute("aria-label"),
          hint: getComputedStyle(frame, "::before").content};
}"""

# The keyboard starts from the block before the diagram, as a reader tabbing on from the text.
START_AT_THE_TEXT_BEFORE = """() => {
  const before = document.querySelector(".diagram-frame").previousElementSibling;
  before.tabIndex = -1;
  before.focus();
}"""


@pytest.mark.parametrize(("viewport", "scrolls"), [(PHONE, True), ({"width": 1280, "height": 800}, False)])
def test_a_frame_that_scrolls_says_so_and_the_keyboard_scrolls_it(browser, server, viewport, scrolls) -> None:
    """Tab reaches a frame that scrolls and the arrow keys scroll it; a frame that fits is no tab stop."""
    context = new_context(browser, OPEN_SHADOW_ROOTS, viewport=viewport)
    page = context.new_page()
    page.set_default_timeout(20_000)
    problems = Problems(page)
    try:
        page.goto(server + SCROLLING_PAGE, wait_until="load")
        assert render_diagrams(page, 1) >= 1
        before = page.evaluate(FRAME)
        page.evaluate(START_AT_THE_TEXT_BEFORE)
        for _ in range(30):  # the text's own links come first
            page.keyboard.press("Tab")
            if page.evaluate(FRAME)["focused"]:
                break
        page.keyboard.press("ArrowRight")
        page.wait_for_timeout(300)  # a smooth scroll
        after = page.evaluate(FRAME)
    finally:
        context.close()
    assert before["scrolls"] is scrolls, before
    if scrolls:
        assert before["tabIndex"] == 0 and before["label"] and "sideways" in before["hint"], before
        assert after["focused"], "Tab never reached the diagram's frame"
        assert after["scrollLeft"] > 0, "the arrow key did not scroll the frame"
    else:
        assert before["tabIndex"] == -1 and before["hint"] == "none", before
        assert not after["focused"], "a frame that does not scroll is a tab stop"
    assert not problems.items, "\n".join(problems.items)

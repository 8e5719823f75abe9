"""axe-core on one page of each kind, light and dark, every answer open: no violation of ours.

axe-core is vendored (`vendor/axe-*.min.js`, MPL-2.0, licence beside it) and injected into
the page, so the test works offline. A violation fails the test unless every node of it
lies in a part of the page that Material's templates own and our CSS cannot reach; those
are listed in `docs/data/accessibility_known.json`, each with the reason it stays (the
accessibility page renders that file).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from handbook_pdf import new_context
from test_site_in_chromium import OPEN_SHADOW_ROOTS, Problems, render_diagrams

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(240)]

AXE = next((Path(__file__).parent / "vendor").glob("axe-*.min.js"))
PAGES = {
    "home": "",
    "diagram": "foundations/system-model/",
    "questions": "interview/hard-questions/",
    "calculator-and-plot": "reliability/performance/",
    "api": "api/config/",
    "tabs": "practice/pitfalls/",
    "sections": "foundations/parallelism/",  # long: its text in section blocks (hooks/sections.py), bold text in them
    "diagram-on-a-phone": "foundations/system-model/",  # its frame scrolls sideways: a keyboard stop with a name
}
PHONE = {"width": 390, "height": 844}
DESKTOP = {"width": 1280, "height": 900}
VIEWPORTS = {"diagram-on-a-phone": PHONE}
SCHEMES = {"light": "default", "dark": "slate"}
# rule -> CSS selector of the theme's elements on which its violations are let pass; the
# accessibility page shows the same file as its table of what remains, and why.
KNOWN_FILE = Path(__file__).resolve().parents[2] / "docs" / "data" / "accessibility_known.json"
KNOWN = {rule: known["selector"] for rule, known in json.loads(KNOWN_FILE.read_text(encoding="utf-8"))["rules"].items()}
# Open every answer, and mark two questions so the pressed and focused states are audited too.
# The theme measures each listing (and drops its keyboard stop if it does not scroll) when
# it first comes near the viewport; axe scrolls while it runs, so without a pass over the
# page first it could catch a listing between the theme's measurement and its correction.
PREPARE = """
async () => {
  const pause = (ms) => new Promise((resolve) => setTimeout(resolve, ms));  // timers, not frames: never stalls
  for (let y = 0; y < document.documentElement.scrollHeight; y += innerHeight) {
    scrollTo(0, y);
    await pause(30);
  }
  scrollTo(0, 0);
  await pause(300);
  // axe reads colours from the drawn boxes, and a section off screen is not drawn until it
  // nears the viewport (hooks/sections.py): draw them all, as a reader scrolling would.
  document.querySelectorAll(".handbook-section").forEach((s) => { s.style.contentVisibility = "visible"; });
  document.querySelectorAll("details").forEach((d) => { d.open = true; });
  const questions = document.querySelectorAll("details.question");
  if (questions.length > 1) {
    questions[0].querySelector(".handbook-quiz__knew").click();
    questions[1].querySelector(".handbook-quiz__again").click();
    questions[0].open = questions[1].open = true;
    questions[1].querySelector(".handbook-quiz__again").focus();
  }
}
"""
RUN_AXE = """
async (known) => {
  const result = await axe.run(document, {resultTypes: ["violations"], elementRef: true});
  return result.violations.map((v) => ({
    id: v.id,
    help: v.help,
    nodes: v.nodes
      .filter((n) => !(known[v.id] && n.element && n.element.closest(known[v.id])))
      .map((n) => `${JSON.stringify(n.target)}: ${n.failureSummary.split("\\n").slice(1).join(" ")}`),
  })).filter((v) => v.nodes.length);
}
"""


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("kind", list(PAGES))
def test_no_accessibility_violation_of_ours(browser, server, built_site: Path, kind: str, scheme: str) -> None:
    path = PAGES[kind]
    diagrams = (built_site / path / "index.html").read_text(encoding="utf-8").count('<pre class="mermaid"')
    context = new_context(browser, OPEN_SHADOW_ROOTS, viewport=VIEWPORTS.get(kind, DESKTOP), color_scheme=scheme)
    page = context.new_page()
    page.set_default_timeout(20_000)
    problems = Problems(page)
    try:
        page.goto(server + path, wait_until="load")
        assert page.evaluate("() => document.body.dataset.mdColorScheme") == SCHEMES[scheme]
        if diagrams:
            assert render_diagrams(page, diagrams) >= diagrams
        page.evaluate(PREPARE)
        page.add_script_tag(path=str(AXE))
        violations = page.evaluate(RUN_AXE, KNOWN)
    finally:
        context.close()
    report = [f"{v['id']} ({v['help']}):\n    " + "\n    ".join(v["nodes"][:10]) for v in violations]
    assert not report, f"{kind} page, {scheme}:\n" + "\n".join(report)
    assert not problems.items, "\n".join(problems.items)


SMALLEST_LABEL_PX = 8 * 4 / 3  # the plots' smallest font, 8 points, at the figure's own size
LEGIBLE_PX = 9
PLOT_BOXES = """() => Array.from(document.querySelectorAll("figure.handbook-plot img"), (img) => {
  const box = img.getBoundingClientRect();
  return {width: box.width, height: box.height, src: img.currentSrc, natural: img.naturalWidth};
})"""


def test_plots_on_a_phone_are_legible_and_hold_their_room_before_they_load(browser, server) -> None:
    """At 390 px the narrow figure shows with labels of 9 px or more; its box does not move when it loads."""
    context = new_context(browser, viewport=PHONE, device_scale_factor=2)
    stalled = []
    context.route("**/plots/*.svg", lambda route: stalled.append(route))  # never answered: still loading
    page = context.new_page()
    try:
        page.goto(server + "reliability/checkpointing/", wait_until="domcontentloaded")
        page.wait_for_function("() => document.querySelector('figure.handbook-plot img')")
        page.wait_for_timeout(300)
        before = page.evaluate(PLOT_BOXES)
    finally:
        context.close()
    context = new_context(browser, viewport=PHONE, device_scale_factor=2)
    page = context.new_page()
    problems = Problems(page)
    try:
        page.goto(server + "reliability/checkpointing/", wait_until="load")
        after = page.evaluate(PLOT_BOXES)
    finally:
        context.close()
    assert stalled and len(before) == len(after) >= 2
    for loading, loaded in zip(before, after, strict=True):
        assert loaded["src"].endswith("-narrow.svg"), loaded
        assert abs(loading["height"] - loaded["height"]) < 1, (loading, loaded)
        assert SMALLEST_LABEL_PX * loaded["width"] / loaded["natural"] >= LEGIBLE_PX, loaded
    assert not problems.items, "\n".join(problems.items)

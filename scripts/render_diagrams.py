"""Draw every Mermaid diagram of the handbook to `docs/diagrams/KEY.svg`, offline.

Pages then show each diagram from its SVG, and no reader's browser loads the 3.5 MB Mermaid
bundle (docs/hooks/diagrams.py, docs/javascripts/diagrams.js). Run it after adding or
editing a ```mermaid block; `tests/docs/test_docs_diagrams.py` fails until then:

    python scripts/render_diagrams.py

It builds the site, serves it locally and, in headless Chromium, lets the theme load the
vendored Mermaid with its own settings (the theme's CSS, whose colours are CSS variables,
so one SVG follows the light and the dark palette). Each diagram is drawn with that Mermaid
from the exact text the page hands it, and each left-to-right flowchart also turned top to
bottom (the hook shows that drawing on narrow screens where it is the narrower one).
SVGs that no page uses any more are deleted.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from handbook_pdf import chromium, serve

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "hooks"))

from diagrams import DIAGRAMS, diagram_sources  # noqa: E402

DRAWN_ID = "__mermaid_drawn"  # docs/javascripts/diagrams.js swaps in the theme's id
MERMAID_READY = "() => Boolean(window.mermaid && window.mermaid.mermaidAPI)"
FIRST_DIAGRAM_NEAR = "() => document.querySelector('pre.mermaid').scrollIntoView()"
DRAW = "async ([id, text]) => (await window.mermaid.render(id, text)).svg"


def site_sources(site: Path) -> tuple[str, dict[str, str]]:
    """(a page with a diagram, KEY -> text of every diagram on the built site)."""
    sources, page = {}, ""
    for html in sorted(site.rglob("*.html")):
        found = diagram_sources(html.read_text(encoding="utf-8"))
        if found and not page:
            page = html.parent.relative_to(site).as_posix().removeprefix(".") + "/"
        sources.update(found)
    return page.lstrip("/"), sources


def draw(site: Path, page: str, sources: dict[str, str]) -> dict[str, str]:
    """KEY -> SVG of each source, drawn by the Mermaid that the theme sets up on `page`."""
    with serve(site) as base, chromium() as browser:
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        # No stored SVG: the stand-in loads Mermaid itself, with the theme's settings.
        context.route("**/diagrams/*.svg", lambda route: route.fulfill(status=404))
        try:
            tab = context.new_page()
            tab.set_default_timeout(120_000)
            tab.goto(base + page, wait_until="load")
            tab.evaluate(FIRST_DIAGRAM_NEAR)
            tab.wait_for_function(MERMAID_READY)
            return {key: tab.evaluate(DRAW, [DRAWN_ID, text]) for key, text in sources.items()}
        finally:
            context.close()


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp)
        subprocess.run([sys.executable, "-m", "mkdocs", "build", "--quiet", "--site-dir", str(site)],
                       cwd=ROOT, check=True)
        page, sources = site_sources(site)
        if not sources:
            raise SystemExit("no Mermaid diagram on the built site")
        drawn = draw(site, page, sources)
    DIAGRAMS.mkdir(exist_ok=True)
    for key, svg in drawn.items():
        (DIAGRAMS / f"{key}.svg").write_text(svg + "\n", encoding="utf-8")
    stale = [path for path in DIAGRAMS.glob("*.svg") if path.stem not in drawn]
    for path in stale:
        path.unlink()
    print(f"{len(drawn)} diagrams drawn to {DIAGRAMS.relative_to(ROOT)}/, {len(stale)} stale SVGs removed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

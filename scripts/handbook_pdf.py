"""Print pages of the built handbook to PDF with headless Chromium, offline.

`scripts/pdf.sh` (and the Pages workflow) builds the site and calls this file to print the
all-in-one page to `handbook.pdf`; the browser tests import it to print single pages and
count their A4 pages. Chromium prints with the site's print stylesheet (`@media print` in
`docs/stylesheets/extra.css`), after every Mermaid diagram on the page has become an SVG.

    python scripts/handbook_pdf.py SITE_DIR OUT.pdf [--page reference/all-in-one/]

The handbook PDF is made navigable in three steps:

1. **Front matter.** Before printing, the page's own title and introduction give way to a
   title block and a table of contents (TOC) in two columns: a line per page (`h2` of the
   all-in-one page) and per section (`h3`), each a link to its heading, and the subsections
   (`h4`) as a run of links under their section. The text follows the TOC on the same page
   (a forced break would leave the TOC's last page mostly empty). Every footer carries
   "Page N of M" (Chromium's `displayHeaderFooter` with a `footerTemplate`).
2. **Page numbers, by named destinations.** Chromium writes a named destination for every
   element that a link in the document points at, with its page and height on that page.
   Since the TOC links every heading, one print tells where each heading landed:
   pypdf reads the destinations. The TOC is printed first with placeholder numbers of the
   same width, so filling in the real ones moves nothing; the page is then printed again and
   the destinations are checked against the numbers shown (and printed once more if any
   moved).
3. **Outline, with pypdf.** Nested bookmarks (pages, sections, subsections, plus the TOC)
   are added to the final PDF, each at its heading's destination.

Why named destinations and pypdf rather than the alternatives: searching the extracted text
for a heading's title is fragile (a title also appears in prose, in the TOC, in a link);
Chromium's own `outline` print option bookmarks every heading of every level but cannot
number a TOC and is not ours to shape (levels, titles, the TOC entry). The destinations are
the browser's own record of where it laid out each heading, and pypdf (pure Python,
maintained, pinned in constraints.txt) reads them and writes the outline.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import html
import http.server
import io
import os
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--no-first-run", "--disable-default-apps", "--disable-extensions",
]
ALL_IN_ONE = "reference/all-in-one/"
# Material draws each diagram into a closed shadow root; open it so the SVG can be counted.
OPEN_SHADOW_ROOTS = """
const attach = Element.prototype.attachShadow;
Element.prototype.attachShadow = function (init) {
  return attach.call(this, Object.assign({}, init, {mode: "open"}));
};
"""
# On every page load Material fetches the search index and hands it to a worker that builds a
# lunr index from it: on a 2-core machine the build costs as much CPU as drawing the page. A
# page that is printed or checked for anything but search gets an empty worker instead (the
# index still arrives; search stays empty).
SEARCH_IDLE = """
const PageWorker = window.Worker;
window.Worker = class extends PageWorker {
  constructor(url, options) {
    const search = /\\/search\\.[^/]*\\.js/.test(String(url));
    super(search ? URL.createObjectURL(new Blob([""], {type: "text/javascript"})) : url, options);
  }
};
"""
DIAGRAMS_PENDING = """
() => document.querySelectorAll("pre.mermaid").length + Array.from(
  document.querySelectorAll("div.mermaid")).filter(
  (host) => !(host.shadowRoot && host.shadowRoot.querySelector("svg"))).length
"""
# Bring each diagram not yet drawn into view for a moment, then go back to the top.
SHOW_PENDING = """
async () => {
  for (const block of document.querySelectorAll("pre.mermaid, div.mermaid")) {
    if (block.shadowRoot && block.shadowRoot.querySelector("svg")) continue;
    block.scrollIntoView();
    await new Promise((done) => setTimeout(done, 50));
  }
  window.scrollTo(0, 0);
}
"""
# The headings of the page's text (h2 to h4) that have an id, in order.
HEADINGS = """
() => Array.from(document.querySelectorAll(
  "article.md-content__inner :is(h2, h3, h4)[id]")).map((h) => {
  const copy = h.cloneNode(true);
  copy.querySelectorAll(".headerlink").forEach((link) => link.remove());
  return {id: h.id, level: Number(h.tagName[1]), title: copy.textContent.replace(/\\s+/g, " ").trim()};
})
"""
# Hide what comes before the first h2 (the page's own h1 and introduction) and put the
# front matter (title block and TOC, given as HTML) in its place.
ADD_FRONT_MATTER = """
(front) => {
  const article = document.querySelector("article.md-content__inner");
  const first = article.querySelector("h2");
  for (const child of Array.from(article.children)) {
    if (child === first) break;
    child.style.display = "none";
  }
  article.insertAdjacentHTML("afterbegin", front);
}
"""
SET_TOC_NUMBERS = """
(numbers) => {
  for (const cell of document.querySelectorAll(".handbook-pdf-toc [data-target]")) {
    cell.textContent = numbers[cell.dataset.target] ?? "?";
  }
}
"""
FRONT_MATTER_STYLE = """
.handbook-pdf-front { font-size: 0.6rem; line-height: 1.45; margin-bottom: 2.5em; }
.md-typeset .handbook-pdf-title { font-size: 2.2em; font-weight: 700; margin: 0 0 0.2em; }
.md-typeset .handbook-pdf-subtitle { margin: 0 0 1.2em; color: #555; }
.md-typeset .handbook-pdf-contents { font-size: 1.3em; font-weight: 700; margin: 0 0 0.4em; }
.md-typeset ol.handbook-pdf-toc { list-style: none; margin: 0; padding: 0; column-count: 2; column-gap: 2.5em; }
.md-typeset .handbook-pdf-toc li { list-style: none; margin: 0; padding: 0; }
.md-typeset .handbook-pdf-toc a { color: inherit; text-decoration: none !important; }
.md-typeset .handbook-pdf-toc li:not(.handbook-pdf-subsections) > a { display: flex; align-items: last baseline; }
.handbook-pdf-toc .handbook-pdf-dots { flex: 1; border-bottom: 1px dotted #999; margin: 0 0.4em 0.35em; }
.handbook-pdf-toc .handbook-pdf-page { min-width: 1.8em; text-align: right; }
.md-typeset .handbook-pdf-toc .handbook-pdf-level2 { font-weight: 700; margin-top: 0.6em; break-after: avoid; }
.md-typeset .handbook-pdf-toc .handbook-pdf-level3 { padding-left: 1em; }
.md-typeset .handbook-pdf-toc .handbook-pdf-subsections { padding-left: 2em; font-size: 0.9em; color: #555; }
"""
FOOTER = ('<div style="width: 100%; font-size: 8px; color: #555; padding: 0 12mm; display: flex;">'
          '<span style="flex: 1;">{title}</span>'
          '<span>Page <span class="pageNumber"></span> of <span class="totalPages"></span></span></div>')
PLACEHOLDER = "000"  # as wide as any page number this handbook will have
# A page object of the PDF (not the `/Type /Pages` tree nodes above them).
PAGE_OBJECT = re.compile(rb"/Type\s*/Page(?![a-zA-Z])")


@dataclass(frozen=True)
class Heading:
    """A heading of the printed page: its element id, level (2 to 4) and text."""

    id: str
    level: int
    title: str


@dataclass(frozen=True)
class Target:
    """Where Chromium laid out a linked element: a 0-based page index and a height in points."""

    page: int
    top: float


def page_count(pdf: bytes) -> int:
    """The number of pages of a PDF that Chromium wrote (its page objects are not compressed)."""
    return len(PAGE_OBJECT.findall(pdf))


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base signature
        pass


@contextlib.contextmanager
def serve(site_dir: Path) -> Iterator[str]:
    """Serve `site_dir` on a free local port; yields the base URL, ending in a slash."""
    handler = functools.partial(_QuietHandler, directory=str(site_dir))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium from the operating system (`CHROMIUM` names another binary)."""
    if not Path(CHROMIUM).is_file():
        raise FileNotFoundError(
            f"Chromium not found at {CHROMIUM}: apt-get install -y chromium fonts-liberation "
            "(or set CHROMIUM to a Chrome/Chromium binary)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS,
                                    headless=True, timeout=60_000)
        try:
            yield browser
        finally:
            browser.close()


def new_context(browser: Any, *init_scripts: str, search: bool = False, **options: Any) -> Any:
    """A browser context (Playwright's `options`) whose pages run `init_scripts` first, with
    the theme's search worker idle unless `search`."""
    context = browser.new_context(**options)
    for script in (*init_scripts, *(() if search else (SEARCH_IDLE,))):
        context.add_init_script(script)
    return context


@contextlib.contextmanager
def ready_to_print(browser: Any, url: str, timeout_ms: int = 300_000) -> Iterator[Any]:
    """Open `url` and yield the Playwright page once its diagrams are drawn, set for print.

    A diagram renders only when it comes near the viewport, so each one still waiting is
    scrolled into view in turn, and again until none waits: on a busy machine a diagram
    passed too quickly (or queued behind the one before it) misses a single pass.

    Raises:
        TimeoutError: Diagrams are still waiting after `timeout_ms`.
    """
    context = new_context(browser, OPEN_SHADOW_ROOTS, viewport={"width": 1280, "height": 900})
    try:
        page = context.new_page()
        page.set_default_timeout(timeout_ms)
        page.goto(url, wait_until="load")
        deadline = time.monotonic() + timeout_ms / 1000
        while pending := page.evaluate(f"({DIAGRAMS_PENDING})()"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url}: {pending} diagram(s) still not drawn after {timeout_ms / 1000:.0f} s")
            page.evaluate(SHOW_PENDING)
            page.wait_for_timeout(250)
        # A browser's own print fires `beforeprint`, on which Material opens every collapsed
        # block (the answers to the hard questions); Chromium's PDF export does not fire it.
        # The print stylesheet keeps folded proofs (`details.proof`) to their one-line summary.
        page.evaluate("() => window.dispatchEvent(new Event('beforeprint'))")
        yield page
    finally:
        context.close()


def print_page(browser: Any, url: str, timeout_ms: int = 300_000) -> bytes:
    """Print `url` to A4 PDF bytes once its diagrams are drawn (no front matter, no outline)."""
    with ready_to_print(browser, url, timeout_ms) as page:
        return page.pdf(format="A4", print_background=True)


def headings(page: Any) -> list[Heading]:
    """The h2 to h4 headings with an id in the page's text, in document order."""
    return [Heading(**h) for h in page.evaluate(HEADINGS)]


def _toc_line(h: Heading) -> str:
    """A TOC line: the heading's title, a dotted leader and its page number (a placeholder)."""
    esc = html.escape
    return (f'<a href="#{esc(h.id)}"><span>{esc(h.title)}</span><span class="handbook-pdf-dots"></span>'
            f'<span class="handbook-pdf-page" data-target="{esc(h.id)}">{PLACEHOLDER}</span></a>')


def _toc_entries(toc: list[Heading]) -> str:
    """The TOC's list items: a line per h2 and h3, each h3's h4s as one run of links below it."""
    items: list[str] = []
    run: list[str] = []

    def close_run() -> None:
        if run:
            items.append(f'<li class="handbook-pdf-subsections">{" · ".join(run)}</li>')
            run.clear()

    for h in toc:
        if h.level == 4:
            run.append(f'<a href="#{html.escape(h.id)}">{html.escape(h.title)}</a>')
            continue
        close_run()
        items.append(f'<li class="handbook-pdf-level{h.level}">{_toc_line(h)}</li>')
    close_run()
    return "".join(items)


def front_matter(title: str, subtitle: str, toc: list[Heading]) -> str:
    """HTML of the title block and the TOC, with its print-only style.

    Every page number starts as `PLACEHOLDER`; `SET_TOC_NUMBERS` fills in the real ones.
    """
    esc = html.escape
    return (f"<style>@media print {{ {FRONT_MATTER_STYLE} }} @media screen {{ .handbook-pdf-front "
            f"{{ display: none; }} }}</style><section class=\"handbook-pdf-front\">"
            f'<p class="handbook-pdf-title">{esc(title)}</p><p class="handbook-pdf-subtitle">{esc(subtitle)}</p>'
            f'<p class="handbook-pdf-contents">Contents</p><ol class="handbook-pdf-toc">{_toc_entries(toc)}</ol>'
            "</section>")


def destinations(pdf: bytes) -> dict[str, Target]:
    """Every named destination of a PDF Chromium wrote: element id -> where it landed."""
    from pypdf import PdfReader

    reader = PdfReader(io.BytesIO(pdf))
    found = {}
    for name, dest in reader.named_destinations.items():
        found[name.removeprefix("/")] = Target(reader.get_destination_page_number(dest), float(dest.top or 0))
    return found


def _pdf_options(title: str) -> dict[str, Any]:
    return {"format": "A4", "print_background": True, "display_header_footer": True,
            "header_template": "<span></span>", "footer_template": FOOTER.format(title=html.escape(title))}


def add_outline(pdf: bytes, toc: list[Heading], targets: dict[str, Target]) -> bytes:
    """`pdf` with nested bookmarks: "Contents", then each heading under the one above it.

    Raises:
        KeyError: A heading has no destination (nothing in the document links to it).
    """
    from pypdf import PdfReader, PdfWriter
    from pypdf.generic import Fit

    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(pdf)))
    writer.add_outline_item(title="Contents", page_number=0)
    parents: dict[int, Any] = {}
    for h in toc:
        target = targets[h.id]
        parent = next((parents[level] for level in range(h.level - 1, 1, -1) if level in parents), None)
        parents[h.level] = writer.add_outline_item(
            title=h.title, page_number=target.page, parent=parent, fit=Fit.xyz(top=target.top), is_open=False)
        for deeper in [level for level in parents if level > h.level]:
            del parents[deeper]
    writer.page_mode = "/UseOutlines"  # readers open with the bookmarks shown
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def _site_title(page: Any) -> str:
    return page.evaluate("() => document.title.split(' - ').pop().trim()")


def print_handbook(browser: Any, url: str, timeout_ms: int = 300_000, outline: bool = True) -> bytes:
    """Print `url` with a title block, a numbered TOC, page-numbered footers and bookmarks.

    Raises:
        RuntimeError: The TOC's page numbers still disagree with the print after three prints.
    """
    with ready_to_print(browser, url, timeout_ms) as page:
        toc = headings(page)
        title = _site_title(page)
        subtitle = f"Every page and section of the handbook, printed {datetime.date.today():%d %B %Y}."
        page.evaluate(ADD_FRONT_MATTER, front_matter(title, subtitle, toc))
        shown: dict[str, str] = {}
        for _ in range(3):
            pdf = page.pdf(**_pdf_options(title))
            targets = destinations(pdf)
            numbers = {h.id: str(targets[h.id].page + 1) for h in toc}
            if numbers == shown:
                break
            page.evaluate(SET_TOC_NUMBERS, numbers)
            shown = numbers
        else:
            raise RuntimeError(f"{url}: the TOC's page numbers did not settle after three prints")
    return add_outline(pdf, toc, targets) if outline else pdf


def main(argv: list[str] | None = None) -> int:
    """Print one page of a built site to a PDF; the all-in-one page gets TOC and bookmarks."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site", type=Path, help="the directory `mkdocs build` wrote")
    parser.add_argument("out", type=Path, help="the PDF to write")
    parser.add_argument("--page", default=ALL_IN_ONE, help="the page's path under the site")
    args = parser.parse_args(argv)
    started = time.monotonic()
    with serve(args.site) as base, chromium() as browser:
        pdf = print_handbook(browser, base + args.page)
    args.out.write_bytes(pdf)
    print(f"{args.out}: {page_count(pdf)} A4 pages ({len(pdf) / 1e6:.1f} MB, "
          f"printed in {time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Print pages of the built handbook to PDF with headless Chromium, offline.

`scripts/pdf.sh` builds the site and calls this file to print the all-in-one page to
`handbook.pdf`; the browser tests import it to print single pages and count their A4 pages.
Chromium prints with the site's print stylesheet (`@media print` in
`docs/stylesheets/extra.css`), after every Mermaid diagram on the page has become an SVG.

    python scripts/handbook_pdf.py SITE_DIR OUT.pdf [--page reference/all-in-one/]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import os
import re
import threading
import time
from collections.abc import Iterator
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
# A page object of the PDF (not the `/Type /Pages` tree nodes above them).
PAGE_OBJECT = re.compile(rb"/Type\s*/Page(?![a-zA-Z])")


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


def print_page(browser: Any, url: str, timeout_ms: int = 300_000) -> bytes:
    """Print `url` to A4 PDF bytes once its diagrams are drawn.

    A diagram renders only when it comes near the viewport, so each one still waiting is
    scrolled into view in turn, and again until none waits: on a busy machine a diagram
    passed too quickly (or queued behind the one before it) misses a single pass.

    Raises:
        TimeoutError: Diagrams are still waiting after `timeout_ms`.
    """
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.add_init_script(OPEN_SHADOW_ROOTS)
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
        page.evaluate("() => window.dispatchEvent(new Event('beforeprint'))")
        return page.pdf(format="A4", print_background=True)
    finally:
        context.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site", type=Path, help="the directory `mkdocs build` wrote")
    parser.add_argument("out", type=Path, help="the PDF to write")
    parser.add_argument("--page", default=ALL_IN_ONE, help="the page's path under the site")
    args = parser.parse_args(argv)
    with serve(args.site) as base, chromium() as browser:
        pdf = print_page(browser, base + args.page)
    args.out.write_bytes(pdf)
    print(f"{args.out}: {page_count(pdf)} A4 pages ({len(pdf) / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

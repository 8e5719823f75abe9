"""The all-in-one page: every page in its table of contents, each code block once, light."""

from __future__ import annotations

import gzip
import html
import re
from pathlib import Path

import pytest

import handbook_docs_support as support

pytestmark = pytest.mark.docs


def test_the_all_in_one_page_has_a_toc_no_repeated_code_and_stays_small(built_site: Path) -> None:
    page = (built_site / "reference" / "all-in-one" / "index.html").read_text(encoding="utf-8")
    # A phone downloads it gzipped and parses the raw HTML: both stay bounded. It holds every
    # page, so it grows with the handbook (119 KB gzipped when context and expert parallel
    # joined; 131 KB with the folded proofs, the host-bound profile and the interview core's
    # checks; 150 KB with the pages on FSDP2, FP8 recipes, graph breaks, hang triage and the
    # hardware). 170 KB is under a second on a 1.6 Mbit/s link.
    assert len(gzip.compress(page.encode())) < 170_000, f"{len(gzip.compress(page.encode()))} bytes gzipped"
    assert len(page.encode()) < 600_000, f"{len(page.encode())} bytes"
    source = (support.DOCS / "reference" / "all-in-one.md").read_text(encoding="utf-8")
    included = re.findall(r'^--8<-- "(docs/[^"]+\.md)"$', source, re.M)
    toc = re.search(r'<nav aria-label="Table of contents" class="md-nav md-nav--secondary">(.*?)'
                    r'<div class="md-content"', page, re.S)
    assert toc, "the page has a table of contents"
    toc_text = html.unescape(re.sub(r"<[^>]+>", " ", toc.group(1)))
    for path in included:
        title = re.search(r"^# (.+)$", (support.ROOT / path).read_text(encoding="utf-8"), re.M)[1]
        title = re.sub(r"[`*]", "", title)
        assert title in toc_text, f"{path}: '{title}' is missing from the table of contents"
    blocks = [html.unescape(re.sub(r"<[^>]+>", "", b))
              for b in re.findall(r'<div class="language-\w+ highlight">(.*?)</div>', page, re.S)]
    repeated = {b[:80] for b in blocks if blocks.count(b) > 1 and len(b) > 200}
    assert not repeated, f"code shown more than once: {sorted(repeated)}"

"""What the site does for its PDF (docs/hooks/pdf.py): the link to it, and folded proofs.

The PDF itself is printed and checked in tests/browser/test_handbook_pdf.py.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
from pypdf import PdfReader

import handbook_docs_support as support

sys.path.insert(0, str(support.DOCS / "hooks"))
import pdf as pdf_hook  # noqa: E402

pytestmark = pytest.mark.docs


def test_the_stand_in_pdf_is_a_valid_page_that_says_how_to_print_the_real_one() -> None:
    reader = PdfReader(io.BytesIO(pdf_hook.placeholder_pdf()), strict=True)
    assert len(reader.pages) == 1
    text = reader.pages[0].extract_text()
    assert "./scripts/pdf.sh" in text and "no PDF" in text


def test_pdf_strings_are_escaped() -> None:
    reader = PdfReader(io.BytesIO(pdf_hook.placeholder_pdf(("a (b) \\ c",))), strict=True)
    assert reader.pages[0].extract_text().strip() == "a (b) \\ c"


def test_how_we_know_blocks_become_proofs_once_and_nothing_else_does() -> None:
    page = ('<details class="note">\n<summary>How we know</summary>\n<p>x</p></details>'
            '<details class="proof">\n<summary>How we know it</summary></details>'
            '<details class="note" open="open">\n<summary>How we know</summary></details>'
            '<details class="question">\n<summary>Why DDP?</summary></details>')
    marked = pdf_hook.mark_proofs(page)
    assert marked.count('class="note proof"') == 1
    assert '<details class="proof">' in marked and "proof proof" not in marked
    assert '<details class="note" open="open">' in marked  # open on the site: not a folded proof
    assert '<details class="question">' in marked
    assert pdf_hook.mark_proofs(marked) == marked


def test_the_home_and_all_in_one_pages_link_the_pdf_at_the_site_root(built_site: Path) -> None:
    assert (built_site / "handbook.pdf").read_bytes() == pdf_hook.placeholder_pdf()
    for page, href in (("index.html", "handbook.pdf"), ("reference/all-in-one/index.html", "../../handbook.pdf")):
        assert f'<a href="{href}">' in (built_site / page).read_text(encoding="utf-8"), page

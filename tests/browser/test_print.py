"""Print the built handbook as Chromium does and count the A4 pages.

The cheatsheet must fit two pages with the site's print stylesheet. The all-in-one page's
count is checked on the one handbook PDF that tests/browser/test_handbook_pdf.py prints.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import handbook_pdf

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(420)]


def test_the_cheatsheet_prints_on_two_a4_pages(built_site: Path) -> None:
    with handbook_pdf.serve(built_site) as base, handbook_pdf.chromium() as browser:
        pdf = handbook_pdf.print_page(browser, base + "interview/cheatsheet/")
    pages = handbook_pdf.page_count(pdf)
    print(f"cheatsheet: {pages} A4 pages")
    assert 1 <= pages <= 2, f"the cheatsheet prints on {pages} A4 pages"


def test_page_count_counts_page_objects_not_the_page_tree() -> None:
    pdf = (b"1 0 obj << /Type /Pages /Kids [2 0 R 3 0 R] /Count 2 >> endobj "
           b"2 0 obj << /Type /Page /Parent 1 0 R >> endobj 3 0 obj <</Type/Page>> endobj")
    assert handbook_pdf.page_count(pdf) == 2

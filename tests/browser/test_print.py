"""Print the built handbook as Chromium does and count the A4 pages.

The cheatsheet must fit two pages with the site's print stylesheet; the all-in-one page is
printed by the same code as `scripts/pdf.sh` and must stay well under the 157 pages it took
before the print stylesheet.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import handbook_pdf

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(420)]

ALL_IN_ONE_PAGES_WITHOUT_PRINT_STYLES = 157


def test_the_cheatsheet_prints_on_two_a4_pages(built_site: Path) -> None:
    with handbook_pdf.serve(built_site) as base, handbook_pdf.chromium() as browser:
        pdf = handbook_pdf.print_page(browser, base + "interview/cheatsheet/")
    pages = handbook_pdf.page_count(pdf)
    print(f"cheatsheet: {pages} A4 pages")
    assert 1 <= pages <= 2, f"the cheatsheet prints on {pages} A4 pages"


def test_the_handbook_pdf_holds_the_whole_all_in_one_page(built_site: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "handbook.pdf"
    assert handbook_pdf.main([str(built_site), str(out)]) == 0
    pages = handbook_pdf.page_count(out.read_bytes())
    with capsys.disabled():
        print(f"\nall-in-one: {pages} A4 pages (was {ALL_IN_ONE_PAGES_WITHOUT_PRINT_STYLES})")
    assert 50 < pages < ALL_IN_ONE_PAGES_WITHOUT_PRINT_STYLES


def test_page_count_counts_page_objects_not_the_page_tree() -> None:
    pdf = (b"1 0 obj << /Type /Pages /Kids [2 0 R 3 0 R] /Count 2 >> endobj "
           b"2 0 obj << /Type /Page /Parent 1 0 R >> endobj 3 0 obj <</Type/Page>> endobj")
    assert handbook_pdf.page_count(pdf) == 2

"""The handbook PDF that readers can navigate: bookmarks, a numbered TOC, page numbers.

`scripts/handbook_pdf.py` prints the all-in-one page once for the module (about 12 s on
the 2-core machine, after the shared site build) and every test reads that PDF with pypdf.
"""

from __future__ import annotations

import html
import io
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from pypdf import PdfReader, PdfWriter

import handbook_docs_support as support
import handbook_pdf

sys.path.insert(0, str(support.DOCS / "hooks"))
import pdf as pdf_hook  # noqa: E402 - docs/hooks/pdf.py: the stand-in PDF

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(420)]

HEADING = re.compile(r'<h(?P<level>[234]) id="(?P<id>[^"]+)"[^>]*>(?P<title>.*?)</h(?P=level)>', re.S)
FOOTER_HEIGHT_PT = 40  # the bottom margin (14 mm) that holds the footer
ALL_IN_ONE_PAGES_WITHOUT_PRINT_STYLES = 157


@dataclass
class Printed:
    """The handbook PDF as the tests read it."""

    path: Path
    reader: PdfReader
    texts: list[str]
    seconds: float


@dataclass(frozen=True)
class Bookmark:
    """An outline entry: how deep it is nested, its title and its 0-based target page."""

    depth: int
    title: str
    page: int


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def bookmarks(reader: PdfReader) -> list[Bookmark]:
    """The PDF's outline, depth first, as a flat list."""
    found: list[Bookmark] = []

    def walk(items: list, depth: int) -> None:
        for item in items:
            if isinstance(item, list):
                walk(item, depth + 1)
            else:
                found.append(Bookmark(depth, str(item.title), reader.get_destination_page_number(item)))

    walk(reader.outline, 0)
    return found


def all_in_one_headings(site: Path) -> list[tuple[int, str]]:
    """(level, text) of every h2 to h4 of the built all-in-one page's text, in order."""
    page = (site / "reference" / "all-in-one" / "index.html").read_text(encoding="utf-8")
    article = page[page.index("<article"):page.index("</article>")]
    return [(int(m["level"]), _flat(html.unescape(re.sub(r"<[^>]+>", "", m["title"]))))
            for m in HEADING.finditer(article)]


def nav_titles() -> list[str]:
    """The title of every page the all-in-one page holds, in its order."""
    source = (support.DOCS / "reference" / "all-in-one.md").read_text(encoding="utf-8")
    titles = []
    for path in re.findall(r'^--8<-- "(docs/[^"]+\.md)"$', source, re.M):
        title = re.search(r"^# (.+)$", (support.ROOT / path).read_text(encoding="utf-8"), re.M)[1]
        titles.append(re.sub(r"[`*]", "", title))
    return titles


def body_text_rows(reader: PdfReader, index: int) -> list[tuple[float, str]]:
    """(height in points, text) of each piece of text on a page, the footer left out."""
    rows: list[tuple[float, str]] = []

    def visit(text: str, cm: list[float], tm: list[float], *_: object) -> None:
        y = tm[4] * cm[1] + tm[5] * cm[3] + cm[5]
        if text.strip() and y > FOOTER_HEIGHT_PT:
            rows.append((y, text))

    reader.pages[index].extract_text(visitor_text=visit)
    return rows


def opening_page_problems(reader: PdfReader) -> list[str]:
    """Why page 1 or 2 reads as mostly empty: its text stops early, or there is little of it."""
    problems = []
    for index in (0, 1):
        rows = body_text_rows(reader, index)
        height = float(reader.pages[index].mediabox.height)
        chars = sum(len(text.strip()) for _, text in rows)
        lowest = min((y for y, _ in rows), default=height)
        if lowest > height / 4:
            problems.append(f"page {index + 1}: its text stops {1 - lowest / height:.0%} down the page")
        if chars < 1000:
            problems.append(f"page {index + 1}: {chars} characters of text")
    return problems


@pytest.fixture(scope="module")
def printed(built_site: Path, tmp_path_factory: pytest.TempPathFactory) -> Printed:
    """The handbook printed by the same entry point as scripts/pdf.sh and the Pages workflow."""
    out = tmp_path_factory.mktemp("pdf") / "handbook.pdf"
    started = time.monotonic()
    assert handbook_pdf.main([str(built_site), str(out)]) == 0
    seconds = time.monotonic() - started
    reader = PdfReader(out)
    return Printed(out, reader, [page.extract_text() for page in reader.pages], seconds)


def test_every_page_and_section_has_a_bookmark_at_its_heading(printed: Printed, built_site: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    marks = bookmarks(printed.reader)
    with capsys.disabled():
        print(f"\nhandbook.pdf: {len(printed.reader.pages)} pages, {len(marks)} bookmarks, "
              f"printed in {printed.seconds:.0f} s")
    assert marks, "the PDF has no outline"
    assert marks[0] == Bookmark(0, "Contents", 0)
    assert [m.title for m in marks if m.depth == 0][1:] == nav_titles()
    expected = all_in_one_headings(built_site)
    assert [(m.depth + 2, _flat(m.title)) for m in marks[1:]] == expected
    misplaced = [f"{m.title!r} -> page {m.page + 1}" for m in marks[1:]
                 if _flat(m.title) not in _flat(printed.texts[m.page])]
    assert not misplaced, "bookmarks whose target page does not show their heading:\n" + "\n".join(misplaced)


def test_the_handbook_pdf_holds_the_whole_all_in_one_page(printed: Printed,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """The print stylesheet keeps the all-in-one page well under the 157 A4 pages it took without it."""
    pages = handbook_pdf.page_count(printed.path.read_bytes())
    with capsys.disabled():
        print(f"\nall-in-one: {pages} A4 pages (was {ALL_IN_ONE_PAGES_WITHOUT_PRINT_STYLES})")
    assert 50 < pages < ALL_IN_ONE_PAGES_WITHOUT_PRINT_STYLES


def test_the_toc_opens_the_pdf_and_numbers_every_page(printed: Printed) -> None:
    marks = {m.title: m.page for m in bookmarks(printed.reader) if m.depth == 0}
    first_text_page = marks[nav_titles()[0]]
    toc = "\n".join(printed.texts[:first_text_page + 1])
    assert printed.texts[0].lstrip().startswith("Distributed Training Interview Handbook")
    assert "\nContents\n" in toc
    for title in nav_titles():
        words = r"\s+".join(map(re.escape, title.split()))  # a long title wraps in its column
        line = re.search(rf"^{words}\s+(\d+)$", toc, re.M)
        assert line, f"the TOC has no numbered line for {title!r}"
        assert int(line[1]) == marks[title] + 1, f"the TOC gives {title!r} page {line[1]}"
    links = [a.get_object() for a in printed.reader.pages[0].get("/Annots", [])]
    assert sum(1 for a in links if a.get("/Subtype") == "/Link" and "/Dest" in a) > 50


def test_every_footer_carries_its_page_number(printed: Printed) -> None:
    total = len(printed.texts)
    missing = [i + 1 for i, text in enumerate(printed.texts) if f"Page {i + 1} of {total}" not in text]
    assert not missing, f"pages without 'Page N of {total}' in the footer: {missing[:20]}"


def test_the_opening_pages_are_full(printed: Printed) -> None:
    assert not opening_page_problems(printed.reader)


def test_folded_proofs_print_as_their_summary_line(built_site: Path, tmp_path: Path) -> None:
    """A "How we know" block (class `proof`, docs/hooks/pdf.py) put into a built page stays
    folded in print, while the theme opens the hard questions' answers around it."""
    site = tmp_path / "site"
    site.mkdir()
    for entry in built_site.iterdir():
        (site / entry.name).symlink_to(entry)
    page = (built_site / "interview" / "hard-questions" / "index.html").read_text(encoding="utf-8")
    proof = ('<details class="note proof">\n<summary>How we know</summary>\n'
             "<p>PROOF-BODY-SENTINEL, which print must not show.</p>\n</details>\n")
    first_question = page.index('<details class="question"')
    (site / "proof-check" / "page").mkdir(parents=True)
    (site / "proof-check" / "page" / "index.html").write_text(
        page[:first_question] + proof + page[first_question:], encoding="utf-8")
    with handbook_pdf.serve(site) as base, handbook_pdf.chromium() as browser:
        pdf = handbook_pdf.print_page(browser, base + "proof-check/page/")
    text = _flat(" ".join(p.extract_text() for p in PdfReader(io.BytesIO(pdf)).pages))
    assert "How we know" in text
    assert "PROOF-BODY-SENTINEL" not in text
    assert "DDP is the smallest correct distributed design" in text  # an answer, opened for print


def test_the_all_in_one_page_prints_its_folded_proofs_folded(printed: Printed, built_site: Path) -> None:
    page = (built_site / "reference" / "all-in-one" / "index.html").read_text(encoding="utf-8")
    bodies = re.findall(r'<details class="[^"]*\bproof\b[^"]*">\s*<summary>.*?</summary>(.*?)</details>', page, re.S)
    text = _flat(" ".join(printed.texts)).replace(" ", "")
    # A proof's test ids appear nowhere else on the site (the docs lint holds them to the
    # folds), so one printed means its fold printed open; its prose may repeat a table's row.
    ids = [found[0] for b in bodies if (found := re.findall(r"tests/[\w./-]+::test_\w+", b))]
    assert ids, "the all-in-one page has folded proofs to check"
    shown = [i for i in ids if i in text]
    assert not shown, f"folded proofs printed open: {shown[:5]}"


def test_the_check_of_the_opening_pages_has_teeth() -> None:
    """Two pages of one short line each, like the stand-in PDF, fail the check twice over."""
    writer = PdfWriter()
    for _ in range(2):
        writer.add_page(PdfReader(io.BytesIO(pdf_hook.placeholder_pdf(("One short line.",)))).pages[0])
    out = io.BytesIO()
    writer.write(out)
    problems = opening_page_problems(PdfReader(io.BytesIO(out.getvalue())))
    assert len(problems) == 4, problems

"""MkDocs hook: what the handbook's PDF needs from the site.

* The site links the PDF at its root, `handbook.pdf`. The PDF is printed from the built site
  (`scripts/pdf.sh`, and the Pages workflow writes it over `site/handbook.pdf`), so a plain
  build (`mkdocs build`, `mkdocs serve`, the tests) cannot hold it yet: this hook adds a
  one-page stand-in there that says how to print the real one. The links then resolve in
  every build, and the strict build and the link check see a real file.
* A folded block whose summary starts "How we know" gets the class `proof`, which the print
  stylesheet keeps folded to its one-line summary (as it does any `??? proof` block).
"""

from __future__ import annotations

import re
from typing import Any

from mkdocs.structure.files import File, Files

PDF_PATH = "handbook.pdf"
PLACEHOLDER_LINES = (
    "This build of the handbook has no PDF yet.",
    "The published site carries the real one, printed from the All-in-one page.",
    "To print it from a clone:  ./scripts/pdf.sh  (writes handbook.pdf).",
)
# pymdownx.details writes `<details class="TYPE">`, a newline, then `<summary>`; an open
# block (`???+`) carries `open="open"` and is not folded, so it does not match.
HOW_WE_KNOW = re.compile(r'<details class="(?P<classes>[^"]*)">(?P<gap>\s*)<summary>(?=How we know)')


def _pdf_text(line: str) -> bytes:
    """A PDF literal string: backslashes and parentheses escaped, Latin-1 encoded."""
    return b"(" + re.sub(r"([\\()])", r"\\\1", line).encode("latin-1") + b")"


def placeholder_pdf(lines: tuple[str, ...] = PLACEHOLDER_LINES) -> bytes:
    """A one-page A4 PDF with `lines` in Helvetica, written by hand (five objects)."""
    text = b" ".join(_pdf_text(line) + b" Tj 0 -22 Td" for line in lines)
    stream = b"BT /F1 13 Tf 56 760 Td " + text + b" ET"
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 595 842] "
        b"/Resources << /Font << /F1 4 0 R >> >> /Contents 5 0 R >>",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
        b"<< /Length %d >>\nstream\n%s\nendstream" % (len(stream), stream),
    ]
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (number, body)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def mark_proofs(html: str) -> str:
    """Give every folded "How we know" block the class `proof` (once), so print keeps it folded."""
    def mark(m: re.Match[str]) -> str:
        classes = m["classes"].split()
        if "proof" in classes:
            return m[0]
        return f'<details class="{" ".join([*classes, "proof"])}">{m["gap"]}<summary>'

    return HOW_WE_KNOW.sub(mark, html)


def on_files(files: Files, config: Any, **_: Any) -> Files:
    """Add the stand-in `handbook.pdf` at the site's root, unless the docs hold a real one."""
    if files.get_file_from_path(PDF_PATH) is None:
        files.append(File.generated(config, PDF_PATH, content=placeholder_pdf()))
    return files


def on_page_content(html: str, **_: Any) -> str:
    """Mark the folded "How we know" blocks of every page as proofs."""
    return mark_proofs(html)

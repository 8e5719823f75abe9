"""Each built page describes itself: its meta description is its own opening, not the tagline."""

from __future__ import annotations

import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

import handbook_docs_support as support

sys.path.insert(0, str(support.DOCS / "hooks"))
import descriptions  # noqa: E402

pytestmark = pytest.mark.docs


class _Descriptions(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.found: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "meta" and attrs.get("name") == "description":
            self.found.append(attrs.get("content") or "")


def _description(path: Path) -> str:
    parser = _Descriptions()
    parser.feed(path.read_text(encoding="utf-8"))
    assert len(parser.found) == 1, f"{path}: {len(parser.found)} meta descriptions"
    return parser.found[0]


def test_every_page_has_its_own_description(built_site: Path) -> None:
    pages = support.html_pages(built_site)
    found = {path.relative_to(built_site).as_posix(): _description(path) for path in pages}
    assert len(found) > 50
    by_text: dict[str, list[str]] = {}
    for page, text in found.items():
        assert len(text) >= descriptions.SHORTEST and len(text) <= descriptions.LIMIT, (page, text)
        by_text.setdefault(text, []).append(page)
    shared = {text: names for text, names in by_text.items() if len(names) > 1}
    assert not shared, f"pages sharing a description: {shared}"
    home = (support.DOCS / "index.md").read_text(encoding="utf-8")
    assert " ".join(home.split()).find(found["index.html"].removesuffix("…")[:60]) >= 0


@pytest.mark.parametrize(("content", "expected"), [
    ("<p>Short.</p><p>" + "word " * 12 + "</p>", ("word " * 12).strip()),
    ('<div class="admonition note"><p>' + "aside " * 12 + "</p></div><p>" + "prose " * 12 + "</p>",
     ("prose " * 12).strip()),
    ("<details><p>" + "answer " * 12 + "</p></details>", None),
    ("<p>" + "long " * 60 + "</p>", ("long " * 31).strip() + "…"),
    ("<p>Tags <code>x &lt; y</code> and entities &amp; text are read as text, this long.</p>",
     "Tags x < y and entities & text are read as text, this long."),
])
def test_description_is_the_first_paragraph_outside_asides(content: str, expected: str | None) -> None:
    assert descriptions.describe(content) == expected

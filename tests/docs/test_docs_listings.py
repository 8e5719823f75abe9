"""Highlighted listings lose the token spans that change nothing on screen, and only those."""

from __future__ import annotations

import html
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import markdown
import material
import pytest

import handbook_docs_support as support

sys.path.insert(0, str(support.DOCS / "hooks"))
import handbook  # noqa: E402

pytestmark = pytest.mark.docs

LISTING = ('```python\ndef shard(params: list[int], world: int) -> int:\n'
           '    """Split."""\n    return len(params) // world  # rows\n```\n')
STYLESHEETS = Path(material.__file__).parent / "templates" / "assets" / "stylesheets"


def _text(page: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", page))


def test_names_and_whitespace_lose_their_spans_and_the_listing_its_nothing_else() -> None:
    highlighted = markdown.markdown(LISTING, extensions=["pymdownx.highlight", "pymdownx.superfences"])
    assert '<span class="n">' in highlighted and '<span class="w">' in highlighted, "the sample has both"
    page = handbook.on_page_content(highlighted, SimpleNamespace(file=SimpleNamespace(src_uri="x.md")))
    assert _text(page) == _text(highlighted), "the listing's text is unchanged"
    assert not re.search(r'<span class="[nw]">', page)
    kept = re.findall(r'<span class="(\w+)">', page)
    assert kept == [c for c in re.findall(r'<span class="(\w+)">', highlighted) if c not in ("n", "w")]


@pytest.mark.parametrize("sheet", ["main", "palette"])
def test_the_theme_colours_a_name_as_the_listings_own_text(sheet: str) -> None:
    """Why a name's span can go: in both palettes its colour is the listing's foreground."""
    (css,) = [p.read_text(encoding="utf-8") for p in STYLESHEETS.glob(f"{sheet}.*.min.css")]
    names = set(re.findall(r"--md-code-hl-name-color:([^;}]+)", css))
    assert names == {"var(--md-code-fg-color)"}, names
    assert not re.search(r"\.highlight \.w[,{]", css), "whitespace tokens have no style of their own"

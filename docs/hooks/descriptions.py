"""MkDocs hook: each page's meta description is its own opening, not the site's tagline.

Search results and link previews show the description; with one shared by every page they
all read alike. A page that sets `description:` in its front matter keeps it; any other
page gets the text of its first paragraph of some length (a short line says little) that
is not inside an admonition, a folded answer or an install line, which many pages share,
cut at a word near `LIMIT` characters.
"""

from __future__ import annotations

import html
import re
from html.parser import HTMLParser
from typing import Any

LIMIT = 160
SHORTEST = 50  # characters: a shorter paragraph is a caption or a hint, not an opening
CONTAINERS = {"div", "details", "aside"}
ASIDE_CLASSES = {"admonition", "handbook-install"}


class _Paragraphs(HTMLParser):
    """The text of each <p> outside the asides of a page's HTML, in order."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.texts: list[str] = []
        self._current: list[str] | None = None
        self._aside: list[bool] = []  # per open container: is it, or is it inside, an aside

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        if tag in CONTAINERS:
            classes = set((dict(attrs).get("class") or "").split())
            self._aside.append(tag == "details" or bool(classes & ASIDE_CLASSES) or any(self._aside))
        elif tag == "p" and not any(self._aside):
            self._current = []

    def handle_endtag(self, tag: str) -> None:
        if tag in CONTAINERS and self._aside:
            self._aside.pop()
        elif tag == "p" and self._current is not None:
            self.texts.append(" ".join("".join(self._current).split()))
            self._current = None

    def handle_data(self, data: str) -> None:
        if self._current is not None:
            self._current.append(data)


def describe(content: str) -> str | None:
    """The description for a page whose rendered body is `content`, or None without prose."""
    parser = _Paragraphs()
    parser.feed(content)
    opening = next((text for text in parser.texts if len(text) >= SHORTEST), None)
    if opening is None or len(opening) <= LIMIT:
        return opening
    cut = opening[:LIMIT - 1]
    return re.sub(r"\s+\S*$", "", cut).rstrip(",;:") + "…"


def on_page_content(content: str, page: Any, **_: Any) -> str:
    """Set `page.meta['description']` from the page's opening unless the page names one."""
    if not page.meta.get("description"):
        description = describe(content)
        if description:
            # The theme writes it into an attribute as it is: escape it here.
            page.meta["description"] = html.escape(description)
    return content

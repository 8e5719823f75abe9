"""The built site: `mkdocs build --strict` passes, and every internal link and anchor resolves."""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

import handbook_docs_support as support

pytestmark = pytest.mark.docs


def test_strict_build_passes(site_build: support.SiteBuild) -> None:
    assert site_build.returncode == 0, site_build.output[-6000:]
    assert (site_build.site_dir / "index.html").is_file()
    print(f"mkdocs build --strict: {site_build.seconds:.1f} s")


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.refs: list[tuple[str, str]] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for key in ("id", "name") if tag in ("a",) else ("id",):
            if attrs.get(key):
                self.ids.add(attrs[key])
        for key in ("href", "src"):
            if attrs.get(key) is not None:
                self.refs.append((tag, attrs[key]))


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def test_internal_links_and_anchors_resolve(built_site: Path) -> None:
    pages = {p: _parse(p) for p in support.html_pages(built_site)}
    assert len(pages) > 10
    broken, checked = [], 0
    for path, page in pages.items():
        for tag, ref in page.refs:
            url = urlsplit(ref)
            if url.scheme or url.netloc or ref.startswith(("mailto:", "javascript:", "data:")):
                continue
            checked += 1
            if url.path:
                target = (path.parent / unquote(url.path)).resolve()
                if url.path.endswith("/") or target.is_dir():
                    target = target / "index.html"
            else:
                target = path
            where = f"{path.relative_to(built_site)}: <{tag}> {ref}"
            if not target.is_file():
                broken.append(f"{where}: no such file")
                continue
            if url.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else _parse(target).ids
                if unquote(url.fragment) not in ids:
                    broken.append(f"{where}: no element with id '{unquote(url.fragment)}'")
    assert checked > 100
    assert not broken, "\n".join(broken)

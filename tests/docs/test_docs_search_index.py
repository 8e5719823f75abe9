"""The search index every page downloads: no all-in-one copy, API objects by their summary."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

import handbook_docs_support as support

sys.path.insert(0, str(support.DOCS / "hooks"))

import search_index  # noqa: E402

pytestmark = pytest.mark.docs

INDEX_BUDGET = 700_000  # bytes; 1.24 MB with the all-in-one page and whole API docstrings


def test_api_objects_keep_their_heading_and_summary_only_and_listings_are_dropped() -> None:
    entries = [
        {"location": "api/bench/#reference_impl.bench.BenchmarkError", "title": "BenchmarkError",
         "text": "<p>  Bases: <code>RuntimeError</code></p> <p>A benchmark ran but failed.</p> <p>More.</p>"},
        {"location": "api/bench/#reference_impl.bench.main", "title": "main",
         "text": "<pre><code>main(argv)</code></pre> <p>Run it.</p> <p>Parameters:</p> <code>argv</code>"},
        {"location": "api/", "title": "API reference", "text": "<p>One.</p> <p>Two.</p>"},
        {"location": "foundations/parallelism/", "title": "Parallelism playbook",
         "text": "<p>A.</p> <pre><code>import torch\nx = 1</code></pre> <p>B.</p>"},
    ]
    lighter = search_index.lighten(entries)
    assert [e["text"] for e in lighter] == [
        "<p>A benchmark ran but failed.</p>", "<p>Run it.</p>", "<p>One.</p> <p>Two.</p>", "<p>A.</p>  <p>B.</p>"]
    assert [e.get("boost") for e in lighter] == [search_index.API_BOOST] * 3 + [None]
    assert [e["title"] for e in lighter] == [e["title"] for e in entries]


def test_the_built_index_is_light_and_still_finds_every_page(built_site: Path) -> None:
    raw = (built_site / "search" / "search_index.json").read_bytes()
    assert len(raw) <= INDEX_BUDGET, f"{len(raw):,} bytes"
    docs = json.loads(raw)["docs"]
    pages = {e["location"].split("#")[0] for e in docs}
    assert not any(p.startswith("reference/all-in-one/") for p in pages), "the all-in-one page is indexed"
    built = {p.parent.relative_to(built_site).as_posix() + "/" for p in built_site.rglob("index.html")}
    built = {"" if p == "./" else p for p in built} - {"reference/all-in-one/"}
    assert built <= pages, f"pages missing from the index: {sorted(built - pages)}"
    assert any(e["location"] == "foundations/parallelism/" and e["title"] == "Parallelism playbook" for e in docs)
    api_objects = [e for e in docs if e["location"].startswith("api/") and "#reference_impl." in e["location"]]
    assert len(api_objects) > 100
    assert all(len(re.findall(r"<p>", e["text"])) <= 1 and "<pre>" not in e["text"] for e in api_objects)
    assert all(e.get("boost") == search_index.API_BOOST for e in docs if e["location"].startswith("api/"))

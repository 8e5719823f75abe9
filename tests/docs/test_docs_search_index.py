"""The search index every page downloads: no all-in-one copy, API objects by their summary;
and, run through the theme's own search worker, the page that answers a query comes first."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import handbook_docs_support as support
import pytest

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


# Each query an interviewer might type, and the page that answers it (issue 36, item 7).
FIRST_HITS = {
    "graph break": "reliability/graph-breaks/",
    "torch._dynamo.explain": "reliability/graph-breaks/",
    "HSDP": "foundations/parallelism/",
    "FlatParameter": "foundations/fsdp2/",
    "FSDP1": "foundations/fsdp2/",
    "MXFP8": "reliability/fp8-recipes/",
    "NVFP4": "reliability/fp8-recipes/",
    "flight recorder": "reliability/hang-triage/",
    "hang": "reliability/hang-triage/",
    "Korthikanti": "foundations/data-parallel/",
    "roofline": "foundations/hardware/",
    "NVLink": "foundations/hardware/",
    "InfiniBand": "foundations/hardware/",
    "arithmetic intensity": "foundations/hardware/",
    "pipeline bubble": "foundations/tensor-pipeline/",
    "ZeRO": "foundations/data-parallel/",
    "Ulysses": "foundations/context-parallel/",
    "interleaved 1F1B": "foundations/tensor-pipeline/",
    "straggler": "reliability/failure-model/",
    "torchft": "reliability/survivors/",
    "goodput": "reliability/failure-model/",
}


def material_search(site: Path, queries: list[str]) -> dict[str, list[str]]:
    """The result locations, in the dialog's order, that the theme's own search worker gives."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed; tests/browser/test_site_in_chromium.py checks six of "
                    "these queries in the real dialog")
    (worker,) = (site / "assets" / "javascripts" / "workers").glob("search.*.min.js")
    run = subprocess.run([node, str(support.DOCS.parent / "tests" / "docs" / "material_search.js"), str(worker),
                          str(site / "search" / "search_index.json"), *queries],
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(run.stdout)


def wrong_first_hits(site: Path, expected: dict[str, str]) -> dict[str, list[str]]:
    """The queries whose first result is not on their page, with their first three results."""
    ranked = material_search(site, list(expected))
    return {q: ranked[q][:3] or ["(nothing)"] for q, page in expected.items()
            if not ranked[q] or ranked[q][0].split("#")[0] != page}


def test_search_ranks_the_page_that_answers_first(built_site: Path) -> None:
    wrong = wrong_first_hits(built_site, FIRST_HITS)
    assert not wrong, "\n".join(f"{q!r}: wanted {FIRST_HITS[q]}, got {hits}" for q, hits in wrong.items())


def test_the_search_check_fails_when_the_answering_section_is_gone(built_site: Path, tmp_path: Path) -> None:
    """Without the playbook's HSDP section (as before it had a heading of its own) another
    page that mentions HSDP wins: the check reports it."""
    site = tmp_path / "site"
    (site / "search").mkdir(parents=True)
    shutil.copytree(built_site / "assets" / "javascripts" / "workers", site / "assets" / "javascripts" / "workers")
    index = json.loads((built_site / "search" / "search_index.json").read_text(encoding="utf-8"))
    index["docs"] = [e for e in index["docs"] if not e["location"].startswith("foundations/parallelism/#hsdp")]
    (site / "search" / "search_index.json").write_text(json.dumps(index), encoding="utf-8")
    wrong = wrong_first_hits(site, {"HSDP": "foundations/parallelism/"})
    assert list(wrong) == ["HSDP"] and not wrong["HSDP"][0].startswith("foundations/parallelism/#hsdp"), wrong

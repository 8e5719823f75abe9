"""MkDocs hook: a search index light enough for a phone, since every page loads all of it.

* The all-in-one page repeats the other pages' text; its front matter leaves it out
  (`search: exclude: true`), so each hit points at the page that owns the section.
* Code listings and diagram sources (`<pre>` blocks, 45% of the text) are left out: the
  names a listing uses are in the prose around it and in the API entries, and a hit inside
  40 lines of code would not say where to read.
* An API page's object (a `#reference_impl.` anchor) keeps its heading and the first
  paragraph of its docstring; signatures, parameter tables and the rest of the docstring
  are dropped. Every API entry is ranked below prose (`API_BOOST`), so a word that a page
  explains finds the explanation before the reference.

The theme's search plugin writes `search/search_index.json` after the pages are built; this
hook runs after it (lower priority) and rewrites the file in the plugin's own compact form.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from mkdocs.plugins import event_priority

INDEX = Path("search") / "search_index.json"
API_PREFIX = "api/"
API_OBJECT = "#reference_impl."
API_BOOST = 0.5
# The first paragraph of an object's text; the "Bases: ..." line of a class is not its summary.
SUMMARY = re.compile(r"<p>(?!\s*Bases:)(.*?)</p>", re.S)
LISTING = re.compile(r"<pre>.*?</pre>", re.S)


def lighten(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The entries without code listings, API objects cut to their summary and every API
    entry down-weighted."""
    lighter = []
    for entry in entries:
        entry = dict(entry, text=LISTING.sub("", entry["text"]))
        if entry["location"].startswith(API_PREFIX):
            if API_OBJECT in entry["location"]:
                summary = SUMMARY.search(entry["text"])
                entry["text"] = f"<p>{summary[1].strip()}</p>" if summary else ""
            entry["boost"] = API_BOOST
        lighter.append(entry)
    return lighter


@event_priority(-100)  # after the search plugin (default priority 0) has written the index
def on_post_build(config: Any, **_: Any) -> None:
    path = Path(config["site_dir"]) / INDEX
    index = json.loads(path.read_text(encoding="utf-8"))
    index["docs"] = lighten(index["docs"])
    path.write_text(json.dumps(index, separators=(",", ":"), default=str), encoding="utf-8")

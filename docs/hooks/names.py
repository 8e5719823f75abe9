"""MkDocs hook: accessible names for elements that the theme and a Markdown extension leave unnamed.

Material's search overlay is `role="dialog"` and its instant-navigation bar is
`role="progressbar"`, both unnamed in its templates, so a screen reader announces "dialog"
and "progress bar" alone and axe and Lighthouse flag them. Naming them here, in the built
HTML, spares copying the theme's partials into the project. Likewise each checkbox of a
task list (`- [x] item`, pymdownx.tasklist) sits in a label of its own with no text: it
is named by its item's text.
"""

from __future__ import annotations

import html
import re
from typing import Any

NAMES = {"md-search": "Search", "md-progress": "Page loading"}
TAG = re.compile(r'<div(?P<attrs>[^>]*\bclass="(?P<cls>md-search|md-progress)"[^>]*)>')
# The item's own text runs from the checkbox's label to the item's end or its nested list.
TASK = re.compile(r'(?P<input><input type="checkbox" disabled(?: checked)?)'
                  r'(?P<rest>/><span class="task-list-indicator"></span></label>)(?P<item>.*?)(?=</li>|<ul|<ol)', re.S)


def _named(match: re.Match[str]) -> str:
    attrs = match["attrs"]
    if "aria-label=" in attrs:
        return match[0]
    return f'<div{attrs} aria-label="{NAMES[match["cls"]]}">'


def _task_named(match: re.Match[str]) -> str:
    name = " ".join(html.unescape(re.sub(r"<[^>]+>", "", match["item"])).split())
    return f'{match["input"]} aria-label="{html.escape(name)}"{match["rest"]}{match["item"]}'


def on_page_content(content: str, **_: Any) -> str:
    """Name each task-list checkbox by its item's text."""
    return TASK.sub(_task_named, content)


def on_post_page(output: str, **_: Any) -> str:
    """Name the theme's search dialog and progress bar on every page."""
    return TAG.sub(_named, output)

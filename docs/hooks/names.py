"""MkDocs hook: accessible names for two of the theme's elements that have a role and no name.

Material's search overlay is `role="dialog"` and its instant-navigation bar is
`role="progressbar"`, both unnamed in its templates, so a screen reader announces "dialog"
and "progress bar" alone and axe and Lighthouse flag them. Naming them here, in the built
HTML, spares copying the theme's partials into the project.
"""

from __future__ import annotations

import re
from typing import Any

NAMES = {"md-search": "Search", "md-progress": "Page loading"}
TAG = re.compile(r'<div(?P<attrs>[^>]*\bclass="(?P<cls>md-search|md-progress)"[^>]*)>')


def _named(match: re.Match[str]) -> str:
    attrs = match["attrs"]
    if "aria-label=" in attrs:
        return match[0]
    return f'<div{attrs} aria-label="{NAMES[match["cls"]]}">'


def on_post_page(output: str, **_: Any) -> str:
    """Name the theme's search dialog and progress bar on every page."""
    return TAG.sub(_named, output)

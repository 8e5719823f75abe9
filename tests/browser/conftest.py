"""Fixtures for the browser tests: the strict build (shared with tests/docs) and the site served
over HTTP, one of each per test process, and a headless Chromium per module."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))  # handbook_pdf

import handbook_docs_support as support  # noqa: E402
import handbook_pdf  # noqa: E402


@pytest.fixture(scope="session")
def built_site() -> Path:
    """The built site's directory; fails every dependent test when the strict build failed."""
    build = support.build_site()
    if build.returncode != 0:
        pytest.fail("mkdocs build --strict failed:\n" + build.output[-6000:], pytrace=False)
    return build.site_dir


@pytest.fixture(scope="session")
def server(built_site: Path) -> Iterator[str]:
    """The built site's base URL, served on a free local port."""
    with handbook_pdf.serve(built_site) as base:
        yield base


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """The operating system's Chromium, headless: one per test module, because a module that
    prints with scripts/handbook_pdf.py starts its own, and two Playwright drivers cannot
    share a thread."""
    with handbook_pdf.chromium() as b:
        yield b

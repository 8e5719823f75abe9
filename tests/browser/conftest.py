"""Fixtures for the browser test: the strict build is shared with tests/docs (one per process)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))  # handbook_pdf

import handbook_docs_support as support  # noqa: E402


@pytest.fixture(scope="session")
def built_site() -> Path:
    """The built site's directory; fails every dependent test when the strict build failed."""
    build = support.build_site()
    if build.returncode != 0:
        pytest.fail("mkdocs build --strict failed:\n" + build.output[-6000:], pytrace=False)
    return build.site_dir

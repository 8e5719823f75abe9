"""Fixtures for the handbook tests: one strict build per test process, shared by every test."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import handbook_docs_support as support  # noqa: E402


@pytest.fixture(scope="session")
def site_build() -> support.SiteBuild:
    """The result of `mkdocs build --strict` (built once, into a temporary directory)."""
    return support.build_site()


@pytest.fixture(scope="session")
def built_site(site_build: support.SiteBuild) -> Path:
    """The built site's directory; fails every dependent test when the strict build failed."""
    if site_build.returncode != 0:
        pytest.fail("mkdocs build --strict failed:\n" + site_build.output[-6000:], pytrace=False)
    return site_build.site_dir

"""The site serves the notebook generated from `reference_impl/notebook.py`, and links to it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import handbook_docs_support as support

sys.path.insert(0, str(support.DOCS / "hooks"))
import handbook  # noqa: E402

pytestmark = pytest.mark.docs


def test_the_built_site_serves_the_generated_notebook(built_site: Path) -> None:
    served = built_site / handbook.SITE_PATH
    assert served.read_text(encoding="utf-8") == handbook.notebook_json()
    page = (built_site / "practice" / "notebook-walkthrough" / "index.html").read_text(encoding="utf-8")
    assert 'href="../interview_trainer.ipynb"' in page, "the walkthrough links the download"


def test_every_cell_of_the_notebook_is_a_section_of_the_module() -> None:
    source = handbook.SOURCE.read_text(encoding="utf-8")
    sections = [m["body"].rstrip("\n") for m in handbook.SECTION.finditer(source)]
    code = ["".join(c["source"]) for c in handbook.build_notebook()["cells"] if c["cell_type"] == "code"]
    assert code[:len(sections)] == sections, "the notebook's cells are the tested text, in order"
    assert code[len(sections)].startswith("%%writefile interview_trainer.py\n")


@pytest.mark.parametrize("repo_url,expected", [
    ("https://github.com/acme/handbook", "https://colab.research.google.com/github/acme/handbook/blob/main/"
                                         "notebooks/interview_trainer.ipynb"),
    ("https://github.com/acme/handbook.git/", "https://colab.research.google.com/github/acme/handbook/blob/main/"
                                              "notebooks/interview_trainer.ipynb"),
    ("https://gitlab.com/acme/handbook", None),
    (None, None),
])
def test_the_colab_link_is_built_only_from_a_github_repository(repo_url: str | None, expected: str | None) -> None:
    assert handbook.colab_url(repo_url) == expected

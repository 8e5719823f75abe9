"""Static checks of the handbook's Markdown: nothing that looks runnable escapes the tests,
every test a page cites exists, diagrams are safe for mermaid, snippet sections are well formed."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import handbook_docs_support as support

pytestmark = pytest.mark.docs

SKIP_WITH_REASON = re.compile(r"""pytest\.mark\.skip(?:if)?\(.*reason\s*=\s*(['"])(?P<reason>.+?)\1""")
TEST_REF = re.compile(r"`(?P<file>tests/[\w./-]+\.py)::(?P<name>[\w:]+)(?:\[[^\]`]*\])?`")
SECTION_MARK = re.compile(r"--8<--\s*\[(?P<kind>start|end):(?P<name>[a-z][-_0-9a-z]*)\]", re.I)


def _page_params():
    return [pytest.param(p, id=support.rel(p)) for p in support.markdown_files()]


@pytest.mark.parametrize("page", _page_params())
def test_every_runnable_looking_fence_is_executed_or_explains_why(page: Path) -> None:
    problems = []
    for block in support.blocks_in(page):
        if block.lang in support.RUNNABLE_LOOKING and block.info not in support.EXECUTED_LANGS:
            problems.append(f"{block.id}: fence '```{block.info}' is never collected; write exactly "
                            "```python, ```sh or ```bash (or ```console for commands that must not run)")
        if block.info in support.EXECUTED_LANGS:
            for mark in block.marks:
                if mark.startswith(("pytest.mark.skip", "pytest.mark.xfail")):
                    m = SKIP_WITH_REASON.search(mark) or re.search(r"reason\s*=\s*(['\"])(?P<reason>.+?)\1", mark)
                    if not m or not m["reason"].strip():
                        problems.append(f"{block.id}: '{mark}' needs a written reason=")
            if not block.code.strip():
                problems.append(f"{block.id}: empty code block")
            for path, section in block.includes:
                if path.startswith("reference_impl/") and not section:
                    problems.append(f"{block.id}: include a named section, not the whole file {path}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", _page_params())
def test_mermaid_fences_escape_angle_brackets(page: Path) -> None:
    bad = [f"{b.id}: raw '<' in a mermaid diagram; write &lt;"
           for b in support.blocks_in(page)
           if b.lang == "mermaid" and re.search(r"<[A-Za-z/]", b.code)]
    assert not bad, "\n".join(bad)


def _defined_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(f"{node.name}::{sub.name}")
    return names


def test_every_cited_test_exists() -> None:
    """A claim links to its proof as `tests/<file>.py::<test>`; that test must exist."""
    missing, cited = [], 0
    for page in support.markdown_files():
        for lineno, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for m in TEST_REF.finditer(line):
                cited += 1
                target = support.ROOT / m["file"]
                where = f"{support.rel(page)}:{lineno}: {m['file']}::{m['name']}"
                if not target.is_file():
                    missing.append(f"{where}: no such file")
                elif m["name"] not in _defined_names(target):
                    missing.append(f"{where}: no such test in the file")
    assert not missing, "\n".join(missing)
    assert cited > 0, "no page cites a test"


def test_snippet_sections_are_well_formed() -> None:
    problems = []
    for path in sorted((support.ROOT / "reference_impl").rglob("*.py")):
        opened: dict[str, int] = {}
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for m in SECTION_MARK.finditer(line):
                name = m["name"]
                if m["kind"] == "start":
                    if name in opened:
                        problems.append(f"{support.rel(path)}:{lineno}: section '{name}' started twice")
                    opened[name] = lineno
                elif opened.pop(name, None) is None:
                    problems.append(f"{support.rel(path)}:{lineno}: end of '{name}' without a start")
        problems += [f"{support.rel(path)}:{n}: section '{s}' never ends" for s, n in opened.items()]
    assert not problems, "\n".join(problems)


def test_vendored_mermaid_is_the_configured_one() -> None:
    """The diagram renderer is served from the site itself, and its version is in its name."""
    config = (support.ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    m = re.search(r"javascript:\s*(javascripts/vendor/mermaid-(\d+)\.(\d+)\.(\d+)\.min\.js)", config)
    assert m, "mermaid2 must point at a vendored, versioned UMD build"
    bundle = support.DOCS / m[1]
    assert bundle.is_file()
    head = bundle.read_bytes()[:200_000].decode("utf-8", "replace")
    assert int(m[2]) == 11
    assert "unpkg.com" not in config and "cdn.jsdelivr" not in config
    assert head  # a real file, not an LFS pointer


def test_pages_workflow_builds_strictly_with_least_privilege() -> None:
    import yaml

    workflow = yaml.safe_load((support.ROOT / ".github/workflows/pages.yml").read_text(encoding="utf-8"))
    assert workflow["permissions"] == {"contents": "read"}
    jobs = workflow["jobs"]
    assert "permissions" not in jobs["build"]
    assert jobs["deploy"]["permissions"] == {"pages": "write", "id-token": "write"}
    assert jobs["deploy"]["needs"] == "build"
    build_steps = " ".join(str(step.get("run", "")) for step in jobs["build"]["steps"])
    assert "mkdocs build --strict" in build_steps
    assert "-c constraints.txt" in build_steps
    triggers = workflow.get("on") or workflow.get(True)  # YAML 1.1 reads a bare `on` as True
    assert triggers["push"]["branches"] == ["main"]

"""Static checks of the handbook's Markdown: nothing that looks runnable escapes the tests,
every test a page cites exists, diagrams are safe for mermaid, snippet sections are well formed."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

import handbook_docs_support as support

pytestmark = pytest.mark.docs

SKIP_WITH_REASON = re.compile(r"""pytest\.mark\.skip(?:if)?\(.*reason\s*=\s*(['"])(?P<reason>.+?)\1""")
TEST_REF = re.compile(r"`(?P<file>tests/[\w./-]+\.py)::(?P<name>[\w:]+)(?:\[[^\]`]*\])?`")
SECTION_MARK = re.compile(r"--8<--\s*\[(?P<kind>start|end):(?P<name>[a-z][-_0-9a-z]*)\]", re.I)
# Git LFS pointer files (https://github.com/git-lfs/git-lfs/blob/main/docs/spec.md): a
# `version` line naming the spec (hawser.github.com before LFS 1.0), then `oid sha256:...`,
# `size N` and optional `ext-...` lines. LFS itself only reads blobs under 1024 bytes as pointers.
LFS_MAX_POINTER_BYTES = 1024
LFS_VERSION = re.compile(rb"^\s*version\s+https?://(?:git-lfs|hawser)\.github\.com/spec/v\d+\s*$", re.M)
LFS_OID = re.compile(rb"^\s*oid\s+sha256:[0-9a-f]{64}\s*$", re.M | re.I)
LFS_SIZE = re.compile(rb"^\s*size\s+\d+\s*$", re.M)


def _page_params():
    return [pytest.param(p, id=support.rel(p)) for p in support.markdown_files()]


@pytest.mark.parametrize("page", _page_params())
def test_every_runnable_looking_fence_is_executed_or_explains_why(page: Path) -> None:
    problems = []
    for block in support.blocks_in(page):
        if block.lang in support.RUNNABLE_LOOKING and not block.executed:
            problems.append(f"{block.id}: fence '```{block.info}' is never collected; write exactly "
                            "```python (optionally ```python title=\"reference_impl/<module>.py\" for an "
                            "excerpt), ```sh or ```bash (or ```console for commands that must not run)")
        if block.title is not None:
            paths = {path for path, _ in block.includes}
            if not block.is_slice or paths != {block.title}:
                problems.append(f"{block.id}: a title labels an excerpt of one package module, so the fence "
                                f"must be only includes of sections of {block.title!r} (it includes "
                                f"{sorted(paths) or 'nothing'})")
        if block.executed:
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


BARE_TEST = re.compile(r"`(?P<name>test_\w+)`")


def _site_pages() -> list:
    return [pytest.param(p, id=support.rel(p)) for p in sorted(support.DOCS.rglob("*.md"))]


@functools.lru_cache(maxsize=1)
def _every_test_name() -> frozenset[str]:
    names: set[str] = set()
    for path in (support.ROOT / "tests").rglob("test_*.py"):
        names |= {n.rsplit("::", 1)[-1] for n in _defined_names(path)}
    return frozenset(names)


def test_every_cited_test_exists() -> None:
    """A claim links to its proof as `tests/<file>.py::<test>` (or names a test as `test_<name>`
    in a fold that has named its file); that test must exist."""
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
            for m in BARE_TEST.finditer(line):
                cited += 1
                if m["name"] not in _every_test_name():
                    missing.append(f"{support.rel(page)}:{lineno}: {m['name']}: no test of that name under tests/")
    assert not missing, "\n".join(missing)
    assert cited > 0, "no page cites a test"


@pytest.mark.parametrize("page", _site_pages())
def test_test_ids_sit_only_in_how_we_know_folds(page: Path) -> None:
    """Evidence is folded: a test id in running prose, a table or a question's answer is noise to
    a candidate, so every id on a page sits inside a `??? proof "How we know"` fold, and every
    proof fold carries that one title (one element, styled once in docs/stylesheets/extra.css)."""
    problems = []
    for line in support.prose_lines(page):
        m = support.PROOF_FOLD.match(line.text)
        if m and m["title"].strip() != support.PROOF_TITLE:
            problems.append(f"{support.rel(page)}:{line.lineno}: a proof fold is titled "
                            f"{m['title'].strip() or '(nothing)'}; write ??? proof {support.PROOF_TITLE}")
        if not line.in_proof:
            for hit in support.TEST_ID.findall(line.text):
                problems.append(f"{support.rel(page)}:{line.lineno}: {hit} in running prose; move it "
                                f"into the section's ??? proof {support.PROOF_TITLE} fold")
    assert not problems, "\n".join(problems)


def test_the_fold_check_sees_an_id_in_prose_and_none_in_a_fold(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("The answer first.\n\n"
                    '??? proof "How we know"\n\n'
                    "    - `tests/test_calc.py::test_fsdp_sends_one_and_a_half_times_ddp`\n"
                    "    - `test_two_stages_under_gpipe_match_one_process`\n\n"
                    "```console\n$ pytest tests/test_x.py::test_y\n```\n\n"
                    "Back in prose (`tests/test_calc.py::test_fsdp_sends_one_and_a_half_times_ddp`).\n",
                    encoding="utf-8")
    outside = [(line.lineno, hit) for line in support.prose_lines(page) if not line.in_proof
               for hit in support.TEST_ID.findall(line.text)]
    assert outside == [(12, "tests/test_calc.py::test_fsdp_sends_one_and_a_half_times_ddp")]


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
    """The diagram renderer is served from the site itself, and its version is in its name.

    mermaid2 injects the lazy loader (docs/javascripts/diagrams.js), and the loader names the vendored bundle."""
    config = (support.ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert re.search(r"^\s+javascript:\s*javascripts/diagrams\.js\s*$", config, re.M), (
        "mermaid2 must inject the lazy loader")
    loader = (support.DOCS / "javascripts" / "diagrams.js").read_text(encoding="utf-8")
    m = re.search(r'"(vendor/mermaid-(\d+)\.(\d+)\.(\d+)\.min\.js)"', loader)
    assert m, "the loader must name a vendored, versioned UMD build"
    bundle = support.DOCS / "javascripts" / m[1]
    assert bundle.is_file()
    content = bundle.read_bytes()
    assert int(m[2]) == 11
    assert not re.search(r"unpkg\.com|cdn\.jsdelivr", config + loader)
    assert not is_lfs_pointer(content), "the bundle is a Git LFS pointer, not the script"
    assert f'"{m[2]}.{m[3]}.{m[4]}"'.encode() in content, "the bundle carries the version its name says"


def is_lfs_pointer(data: bytes) -> bool:
    """True for a Git LFS pointer in any of its forms: the canonical three lines, with
    extension lines, CRLF endings, no final newline, the pre-1.0 hawser URL, or a pointer
    whose version line was lost (an `oid sha256:` line and a `size` line in a small file)."""
    if len(data) >= LFS_MAX_POINTER_BYTES:
        return False
    first = data.lstrip().split(b"\n", 1)[0]
    return bool(LFS_VERSION.match(first) or (LFS_OID.search(data) and LFS_SIZE.search(data)))


def lfs_pointers_under(root: Path) -> list[Path]:
    """Every file under `root` that is a Git LFS pointer instead of its content."""
    return sorted(p for p in root.rglob("*")
                  if p.is_file() and p.stat().st_size < LFS_MAX_POINTER_BYTES and is_lfs_pointer(p.read_bytes()))


def test_no_site_source_is_an_lfs_pointer() -> None:
    """A checkout without `git lfs pull` leaves pointers where scripts, styles and pages
    should be; the site would build and then fail in the browser."""
    pointers = [support.rel(p) for root in (support.DOCS, support.ROOT / "reference_impl")
                for p in lfs_pointers_under(root)]
    assert not pointers, f"Git LFS pointers instead of files: {pointers}"


OID = "4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393"
LFS_POINTER_FORMS = {
    "canonical": f"version https://git-lfs.github.com/spec/v1\noid sha256:{OID}\nsize 12345\n",
    "with-extensions": (f"version https://git-lfs.github.com/spec/v1\next-0-foo sha256:{OID}\n"
                        f"oid sha256:{OID}\nsize 3500000\n"),
    "crlf": f"version https://git-lfs.github.com/spec/v1\r\noid sha256:{OID}\r\nsize 12345\r\n",
    "no-final-newline": f"version https://git-lfs.github.com/spec/v1\noid sha256:{OID}\nsize 12345",
    "pre-1.0-hawser": f"version https://hawser.github.com/spec/v1\noid sha256:{OID}\nsize 12345\n",
    "version-line-lost": f"oid sha256:{OID}\nsize 12345\n",
}


@pytest.mark.parametrize("form", sorted(LFS_POINTER_FORMS))
def test_an_lfs_pointer_file_is_caught(form: str, tmp_path: Path) -> None:
    """The lint has teeth: a pointer of each form, placed among real assets, is reported,
    and the real files beside it (a script that mentions LFS, an empty file) are not."""
    vendor = tmp_path / "javascripts" / "vendor"
    vendor.mkdir(parents=True)
    (vendor / "mermaid-11.17.2.min.js").write_text(LFS_POINTER_FORMS[form], newline="")
    (tmp_path / "extra.js").write_text('// size 12\nconst spec = "version https://git-lfs.github.com/spec/v1";\n')
    (tmp_path / "empty.css").write_bytes(b"")
    assert lfs_pointers_under(tmp_path) == [vendor / "mermaid-11.17.2.min.js"]


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
    # The PDF the site links is printed into the built site, after the build and before upload.
    runs = [str(step.get("run", "")) for step in jobs["build"]["steps"]]
    uploads = [i for i, step in enumerate(jobs["build"]["steps"]) if "upload-pages-artifact" in step.get("uses", "")]
    build = next(i for i, run in enumerate(runs) if "mkdocs build --strict --site-dir site" in run)
    printed = next(i for i, run in enumerate(runs) if "scripts/handbook_pdf.py site site/handbook.pdf" in run)
    assert build < printed < uploads[0]
    triggers = workflow.get("on") or workflow.get(True)  # YAML 1.1 reads a bare `on` as True
    assert triggers["push"]["branches"] == ["main"]


def test_imports_sections_hold_only_third_party_imports() -> None:
    """A page shows `m.py:imports` before a section of m.py so that the block runs where it is
    pasted: the section must hold import statements only, and none of reference_impl."""
    problems = []
    for path in sorted((support.ROOT / "reference_impl").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if "[start:imports]" not in text:
            continue
        section = support.expand_snippets(f'--8<-- "{support.rel(path)}:imports"')
        for node in ast.parse(section).body:
            where = f"{support.rel(path)}, section 'imports', line {node.lineno}"
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                problems.append(f"{where}: not an import; end the section before it")
            elif any((getattr(node, "module", None) or a.name).startswith("reference_impl")
                     for a in node.names):
                problems.append(f"{where}: imports reference_impl; keep package imports after "
                                "`# --8<-- [end:imports]`")
    assert not problems, "\n".join(problems)

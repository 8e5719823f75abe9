"""Shared helpers for the handbook's tests: snippet expansion, code-block discovery, site build.

The code-block tests, the lint, the link check and the browser test all use this module, so
each of them sees the Markdown exactly as `mkdocs build` does.
"""

from __future__ import annotations

import atexit
import fcntl
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MKDOCS_YML = ROOT / "mkdocs.yml"

# Fences whose language is one of these are executed by the code-block tests.
EXECUTED_LANGS = {"python", "sh", "bash"}
# Languages that look runnable: a fence using one of them must be exactly an executed language.
RUNNABLE_LOOKING = {"python", "py", "python3", "pycon", "ipython", "sh", "bash", "shell", "zsh"}
# The one fence attribute the code-block tests accept: a python block's title, which labels it
# as an excerpt of a package module (```python title="reference_impl/step.py"```).
EXECUTED_INFO = re.compile(r'^(?:(?:sh|bash)|python(?:\s+title="(?P<title>[^"]*)")?)$')
SECTION_START = re.compile(r"--8<--\s*\[start:(?P<name>[a-z][-_0-9a-z]*)\]", re.I)
INCLUDE_LINE = re.compile(r'^\s*-{1,}8<-{1,}\s+"(?P<path>[^"]+?)(?::(?P<section>[a-z][-_0-9a-z]*))?"\s*$', re.I)


def markdown_files() -> list[Path]:
    """Every Markdown page of the handbook, plus the README, in a stable order."""
    files = sorted(DOCS.rglob("*.md"))
    readme = ROOT / "README.md"
    if readme.exists():
        files.append(readme)
    return files


# Evidence on a page (test ids, how a figure was measured) sits in one folded element,
# `??? proof "How we know"`, which pymdownx.details renders as <details class="proof">.
PROOF_FOLD = re.compile(r'^(?P<indent>[ \t]*)\?\?\?\+?[ \t]+proof\b(?P<title>.*)$')
PROOF_TITLE = '"How we know"'
# A test id as the pages write it: `tests/<file>.py::test_<name>` or a bare `test_<name>` in a
# code span (a file path alone, `tests/<file>.py`, names no test and is not an id).
TEST_ID = re.compile(r"tests/[\w./-]+\.py::(?:\w+::)?test_\w+|`test_\w+`")


@dataclass
class ProseLine:
    """One line of a page outside fenced code, and whether it sits in a "How we know" fold."""

    lineno: int
    text: str
    in_proof: bool


def prose_lines(path: Path) -> list[ProseLine]:
    """The lines of a page outside fenced code, each marked in or out of a proof fold.

    A fold is the `??? proof "How we know"` line and every following line that is blank or
    indented deeper than it, as pymdownx.details reads it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[ProseLine] = []
    fence: str | None = None
    fold_indent: int | None = None
    for lineno, line in enumerate(lines, 1):
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if fold_indent is not None and stripped and indent <= fold_indent:
            fold_indent = None
        if fence:
            if stripped.startswith(fence) and not stripped.strip(fence[0]):
                fence = None
            continue
        if m := re.match(r"(`{3,}|~{3,})", stripped):
            fence = m[1]
            continue
        if fold_indent is None and (m := PROOF_FOLD.match(line)):
            fold_indent = len(m["indent"].expandtabs(4))
            out.append(ProseLine(lineno, line, True))
            continue
        out.append(ProseLine(lineno, line, fold_indent is not None))
    return out


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@functools.lru_cache(maxsize=1)
def snippet_options() -> dict:
    """The pymdownx.snippets options of mkdocs.yml, resolved exactly as MkDocs resolves them."""
    from mkdocs.config import load_config

    cfg = load_config(str(MKDOCS_YML))
    return dict(cfg["mdx_configs"]["pymdownx.snippets"])


def expand_snippets(text: str) -> str:
    """Expand `--8<--` includes in `text` with the site's own snippets preprocessor."""
    import markdown

    md = markdown.Markdown(extensions=["pymdownx.snippets"],
                           extension_configs={"pymdownx.snippets": snippet_options()})
    lines = text.split("\n")
    return "\n".join(md.preprocessors["snippet"].run(lines))


@dataclass
class DocBlock:
    """One fenced code block of a page, as pytest-codeblocks' parser found it."""

    path: Path
    lineno: int
    info: str
    code: str
    marks: list[str] = field(default_factory=list)
    expected_output: str | None = None

    @property
    def lang(self) -> str:
        return self.info.split()[0].lower() if self.info.strip() else ""

    @property
    def id(self) -> str:
        return f"{rel(self.path)}:{self.lineno}"

    @property
    def executed(self) -> bool:
        """True for ```python (with or without a title), ```sh and ```bash fences."""
        return bool(EXECUTED_INFO.match(self.info))

    @property
    def title(self) -> str | None:
        m = EXECUTED_INFO.match(self.info)
        return m["title"] if m else None

    @property
    def includes(self) -> list[tuple[str, str | None]]:
        return [(m["path"], m["section"]) for line in self.code.splitlines()
                if (m := INCLUDE_LINE.match(line))]

    @property
    def is_slice(self) -> bool:
        """True when the block is nothing but snippet includes of reference_impl sections."""
        lines = [line for line in self.code.splitlines() if line.strip()]
        return bool(lines) and all(INCLUDE_LINE.match(line) for line in lines) and all(
            p.startswith("reference_impl/") and p.endswith(".py") and s for p, s in self.includes)


def blocks_in(path: Path) -> list[DocBlock]:
    from pytest_codeblocks import extract_from_buffer

    with open(path, encoding="utf-8") as handle:
        found = extract_from_buffer(handle)
    return [DocBlock(path, b.lineno, (b.syntax or "").strip(), b.code, list(b.marks),
                     b.expected_output) for b in found]


def all_blocks() -> list[DocBlock]:
    return [b for path in markdown_files() for b in blocks_in(path)]


def executed_blocks() -> list[DocBlock]:
    return [b for b in all_blocks() if b.executed]


# Modules that are scripts made of cells (they run on import): their sections on a page are
# executed together, in page order, in one namespace, like a notebook.
SCRIPT_MODULES = {"reference_impl/notebook.py"}


def script_module(block: DocBlock) -> str | None:
    paths = {p for p, _ in block.includes}
    if block.is_slice and len(paths) == 1 and paths <= SCRIPT_MODULES:
        return paths.pop()
    return None


def module_name(path: str) -> str:
    return path[: -len(".py")].replace("/", ".")


# ---------------------------------------------------------------- site build (once per process)

@dataclass
class SiteBuild:
    returncode: int
    output: str
    site_dir: Path
    seconds: float


@functools.lru_cache(maxsize=1)
def build_site() -> SiteBuild:
    """Run `mkdocs build --strict` once per test run and remember the result.

    Under pytest-xdist the workers of one run share a single build: the first to take the
    lock builds into a directory named by the run's id and records the outcome; the others
    wait on the lock and read it. Outside xdist each process builds into its own directory.
    """
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run_id:
        out = Path(tempfile.mkdtemp(prefix="handbook-site-"))
        atexit.register(shutil.rmtree, out, ignore_errors=True)
        return _build_into(out)
    shared = Path(tempfile.gettempdir()) / f"handbook-site-{run_id}"
    shared.mkdir(exist_ok=True)
    outcome = shared / "build.json"
    with open(shared / "lock", "w") as lock:
        fcntl.lockf(lock, fcntl.LOCK_EX)  # released when the file closes, also if we die
        if not outcome.exists():
            _remove_old_shared_builds(keep=shared)
            build = _build_into(shared / "site")
            outcome.write_text(json.dumps({"returncode": build.returncode, "output": build.output,
                                           "seconds": build.seconds}))
    # No atexit removal: another worker may still be reading the site when this one exits.
    recorded = json.loads(outcome.read_text())
    return SiteBuild(recorded["returncode"], recorded["output"], shared / "site", recorded["seconds"])


def _build_into(out: Path) -> SiteBuild:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--clean",
         "-f", str(MKDOCS_YML), "-d", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    return SiteBuild(proc.returncode, proc.stdout + proc.stderr, out, time.perf_counter() - started)


def _remove_old_shared_builds(keep: Path, older_than_s: float = 6 * 3600) -> None:
    """Earlier runs' shared builds, once no run can still be using them."""
    for old in Path(tempfile.gettempdir()).glob("handbook-site-*"):
        try:
            if old != keep and time.time() - old.stat().st_mtime > older_than_s:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            continue


def html_pages(site_dir: Path) -> list[Path]:
    return sorted(p for p in site_dir.rglob("*.html") if p.name != "404.html")

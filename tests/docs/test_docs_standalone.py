"""Every python block on the built site runs where it is pasted, or says what it needs.

A reader copies a block into a blank notebook that has torch and numpy and nothing else. So
each `div.language-python` of the BUILT pages (after snippet expansion; the API pages'
mkdocstrings signatures and sources are not counted) runs in a fresh interpreter of this
venv, from a temporary directory, with `import reference_impl` made to fail. For speed the
interpreter is a fork of a server that has imported torch and numpy and nothing else (a
block must still import every name it uses); HANDBOOK_BLOCKS_FRESH=1 starts a brand-new
interpreter per block instead, for the same verdicts. A block passes:

* standalone: it runs, and pyflakes finds no name it uses without defining or importing
  (annotations aside: the package's modules defer them with `from __future__ import
  annotations`); a block that only runs because its function body is never called would
  otherwise paste a function that cannot be called; or
* as a labelled excerpt: its fence has a title naming the package module it comes from
  (`title="reference_impl/step.py"`, rendered as `span.filename`), every line of it is in
  that module, and the page shows the install line (`.handbook-install`, from the
  `<!-- package-install -->` marker) exactly once; or
* as a package example: it says what it needs in its own text, an `import reference_impl...`
  statement, fails only because that import fails, and its page shows the install line once.

The interview core's blocks and the notebook walkthrough's are cells of one notebook each:
each page's blocks run concatenated, in page order, in ONE fresh interpreter instead
(test_the_notebook_pages_run_as_one_chain_each).

Run only this test with:  pytest tests/docs/test_docs_standalone.py -s   (-s prints the counts)
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

import handbook_docs_support as support

pytestmark = pytest.mark.docs

TESTS = Path(__file__).resolve().parents[1]  # where without_package.py, the package hider, lives
sys.path.insert(0, str(TESTS))
from without_package import HIDDEN as HIDDEN_MARK  # noqa: E402
# Pages whose cells form one notebook each, run as one chain per page.
CHAIN_PAGES = ("practice/interview-core/index.html", "practice/notebook-walkthrough/index.html")
PARALLEL = 2  # blocks run at a time (the test machines have two cores)
BLOCK_TIMEOUT = 60  # seconds per block
CHAIN_TIMEOUT = 240
MIN_STANDALONE = 0.80
TITLE_MODULE = re.compile(r"^reference_impl/[\w/]+\.py$")

# The runner: hides the package, then runs a block as a pasted script, in a new `__main__`.
# `run BLOCK ID` does that in this (new) interpreter; `serve` imports torch and numpy once and
# then forks one child per block request read from stdin (a fork server): each child is a
# copy of an interpreter that has imported nothing but torch and numpy, so a block still has
# to import every name it uses, and pays no torch import (seconds on a loaded 2-core machine).
RUNNER = textwrap.dedent("""\
    import os, signal, sys, time, types

    sys.path.insert(0, TESTS_DIR)
    import without_package  # hides reference_impl and all of its submodules
    sys.path.remove(TESTS_DIR)
    without_package.block()

    def run(path, block_id):
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        sys.argv = [path]
        with open(path, encoding="utf-8") as f:
            code = compile(f.read(), block_id, "exec", dont_inherit=True)
        exec(code, main.__dict__)

    def run_forked(path, block_id):
        # Exit as an interpreter does (threads joined, atexit handlers run, output flushed),
        # less the slow teardown of every loaded module, which a block cannot observe.
        import atexit, threading, traceback
        rc = 0
        try:
            run(path, block_id)
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
            rc = 1
        try:
            threading._shutdown()
            atexit._run_exitfuncs()
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(rc)

    def serve():
        import numpy, torch  # noqa: F401  (what a blank notebook has; nothing else)
        print("ready", flush=True)
        for line in sys.stdin:
            workdir, block_id, timeout = line.rstrip("\\n").split("\\t")
            sys.stdout.flush(); sys.stderr.flush()
            started = time.perf_counter()
            pid = os.fork()
            if pid == 0:  # the child: its own session, directory, output, and no stdin
                os.setsid()
                os.chdir(workdir)
                os.environ["HOME"] = workdir
                null = os.open(os.devnull, os.O_RDONLY)
                out = os.open(os.path.join(workdir, "output.txt"), os.O_WRONLY | os.O_CREAT, 0o600)
                os.dup2(null, 0); os.dup2(out, 1); os.dup2(out, 2)
                run_forked(os.path.join(workdir, "block.py"), block_id)
            deadline = started + float(timeout)
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    rc = os.waitstatus_to_exitcode(status)
                    break
                if time.perf_counter() > deadline:
                    os.killpg(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    rc = "timeout"
                    break
                time.sleep(0.01)
            print(f"{rc}\\t{time.perf_counter() - started}", flush=True)

    if __name__ == "__main__":
        if sys.argv[1] == "serve":
            serve()
        else:
            run(sys.argv[2], sys.argv[3])
""").replace("TESTS_DIR", repr(str(TESTS)))


def _clean_env(home: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "PYTEST", "MASTER_", "TORCHELASTIC", "LOCAL_RANK"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HOME=home, MPLBACKEND="Agg")
    return env


@dataclass
class SiteBlock:
    page: str  # the built page, relative to the site: "reliability/debugging/index.html"
    index: int  # 1-based position among the page's python blocks
    title: str | None  # the fence's title, if any
    code: str
    page_install_lines: int  # how many `.handbook-install` elements the page has

    @property
    def id(self) -> str:
        return f"{self.page.removesuffix('index.html')}#python-block-{self.index}"


@dataclass
class Outcome:
    returncode: int | None  # None: timed out
    output: str
    seconds: float


def site_python_blocks(site: Path) -> list[SiteBlock]:
    """Every rendered python block of every page, in page order (mkdocstrings' aside)."""
    from bs4 import BeautifulSoup

    blocks = []
    for path in support.html_pages(site):
        soup = BeautifulSoup(path.read_text(encoding="utf-8"), "html.parser")
        divs = [d for d in soup.select("div.language-python.highlight") if not d.find_parent(class_="doc")]
        installs = len(soup.select(".handbook-install"))
        for index, div in enumerate(divs, 1):
            title = div.select_one("span.filename")
            code = div.select_one("pre > code")
            assert code is not None, f"{path}: a python block without <pre><code>"
            blocks.append(SiteBlock(path.relative_to(site).as_posix(), index,
                                    title.get_text().strip() if title else None,
                                    code.get_text(), installs))
    return blocks


class _DropAnnotations(ast.NodeTransformer):
    """Annotations are deferred (`from __future__ import annotations`) and never evaluated."""

    def visit_arg(self, node: ast.arg) -> ast.arg:
        node.annotation = None
        return node

    def _function(self, node):
        node.returns = None
        return self.generic_visit(node)

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AST:
        if node.value is None:
            return ast.copy_location(ast.Pass(), node)
        return ast.copy_location(ast.Assign(targets=[node.target], value=self.visit(node.value)), node)


def undefined_names(code: str) -> list[str]:
    """Names the code uses without defining or importing them (pyflakes), annotations aside."""
    from pyflakes import checker, messages

    tree = ast.fix_missing_locations(_DropAnnotations().visit(ast.parse(code)))
    found = checker.Checker(tree, filename="<block>").messages
    return sorted({m.message_args[0] for m in found if isinstance(m, messages.UndefinedName)})


def run_fresh(code: str, block_id: str, timeout: float) -> Outcome:
    """Run `code` in a new interpreter of this venv, in an empty directory, without the package."""
    with tempfile.TemporaryDirectory(prefix="handbook-block-") as tmp:
        (Path(tmp) / "runner.py").write_text(RUNNER, encoding="utf-8")
        (Path(tmp) / "block.py").write_text(code, encoding="utf-8")
        started = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, "-I", "runner.py", "run", "block.py", block_id], cwd=tmp,
                                  env=_clean_env(tmp), capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            out = (exc.stdout or b"") + (exc.stderr or b"")
            out = out.decode(errors="replace") if isinstance(out, bytes) else out
            return Outcome(None, out + f"\n[timed out after {timeout} s]", time.perf_counter() - started)
        return Outcome(proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - started)


class ForkServer:
    """One interpreter that has imported torch and numpy; every block runs in a fork of it."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="handbook-forkserver-")
        (Path(self.dir) / "runner.py").write_text(RUNNER, encoding="utf-8")
        self.proc = subprocess.Popen([sys.executable, "-I", "runner.py", "serve"], cwd=self.dir,
                                     env=_clean_env(self.dir), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        assert self.proc.stdout.readline().strip() == "ready", "the fork server did not start"

    def run(self, code: str, block_id: str, timeout: float) -> Outcome:
        workdir = tempfile.mkdtemp(prefix="handbook-block-")
        try:
            (Path(workdir) / "block.py").write_text(code, encoding="utf-8")
            self.proc.stdin.write(f"{workdir}\t{block_id}\t{timeout}\n")
            self.proc.stdin.flush()
            reply = self.proc.stdout.readline()
            assert reply, "the fork server died"
            rc, seconds = reply.rstrip("\n").split("\t")
            output = (Path(workdir) / "output.txt").read_text(encoding="utf-8", errors="replace")
            if rc == "timeout":
                return Outcome(None, output + f"\n[timed out after {timeout} s]", float(seconds))
            return Outcome(int(rc), output, float(seconds))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        shutil.rmtree(self.dir, ignore_errors=True)


def run_all(blocks: list[SiteBlock]) -> list[Outcome]:
    """Run every block, PARALLEL at a time, each in a fork of a warm server; with
    HANDBOOK_BLOCKS_FRESH=1, each in a brand-new interpreter instead (slower, same verdicts)."""
    if os.environ.get("HANDBOOK_BLOCKS_FRESH") == "1":
        with ThreadPoolExecutor(max_workers=PARALLEL) as pool:
            return list(pool.map(lambda b: run_fresh(b.code, b.id, BLOCK_TIMEOUT), blocks))
    return run_forked([(b.code, b.id) for b in blocks], BLOCK_TIMEOUT)


def run_forked(jobs: list[tuple[str, str]], timeout: float) -> list[Outcome]:
    """Run each (code, label) in a fork of a warm `ForkServer`, PARALLEL servers taking
    jobs from one queue; outcomes in the order of `jobs`."""
    queue = list(enumerate(jobs))
    results: dict[int, Outcome] = {}
    lock = threading.Lock()

    def lane() -> None:
        server = ForkServer()
        try:
            while True:
                with lock:
                    if not queue:
                        return
                    index, (code, label) = queue.pop(0)
                results[index] = server.run(code, label, timeout)
        finally:
            server.close()

    with ThreadPoolExecutor(max_workers=PARALLEL) as pool:
        for future in [pool.submit(lane) for _ in range(PARALLEL)]:
            future.result()
    return [results[i] for i in range(len(jobs))]


def imports_the_package(code: str) -> bool:
    """True when the block imports reference_impl itself, so it says what it needs."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return False
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        if any(n == "reference_impl" or n.startswith("reference_impl.") for n in names):
            return True
    return False


def failed_on_the_hidden_package(outcome: Outcome) -> bool:
    lines = outcome.output.strip().splitlines()
    return bool(lines) and lines[-1].startswith("ModuleNotFoundError: No module named 'reference_impl") \
        and HIDDEN_MARK in lines[-1]


def excerpt_label_problems(block: SiteBlock) -> list[str]:
    """Why the block is not a correctly labelled excerpt (empty: it is one)."""
    problems = []
    if not block.title:
        problems.append('its fence has no title; give it title="reference_impl/<module>.py"')
    elif not TITLE_MODULE.match(block.title) or not (support.ROOT / block.title).is_file():
        problems.append(f"its title {block.title!r} does not name a package module")
    else:
        module_lines = {line.strip() for line in (support.ROOT / block.title).read_text(encoding="utf-8").splitlines()}
        foreign = [line for line in block.code.splitlines() if line.strip() and line.strip() not in module_lines]
        if foreign:
            problems.append(f"its title names {block.title}, which does not contain {foreign[0].strip()!r}")
    if block.page_install_lines != 1:
        problems.append(f"its page shows the install line {block.page_install_lines} times (want exactly once: "
                        "put <!-- package-install --> near the top of the page)")
    return problems


@pytest.fixture(scope="module")
def site_blocks(built_site: Path) -> list[SiteBlock]:
    blocks = site_python_blocks(built_site)
    assert blocks, "no python blocks found on the built site"
    return blocks


@pytest.mark.slow
def test_every_python_block_runs_where_it_is_pasted_or_says_what_it_needs(site_blocks: list[SiteBlock]) -> None:
    singles = [b for b in site_blocks if b.page not in CHAIN_PAGES]
    chain = [b for b in site_blocks if b.page in CHAIN_PAGES]
    started = time.perf_counter()
    outcomes = run_all(singles)
    wall = time.perf_counter() - started

    standalone, excerpts, examples, failures = [], [], [], []
    for block, outcome in zip(singles, outcomes):
        ran = outcome.returncode == 0
        missing = undefined_names(block.code) if ran else []
        if ran and not missing:
            standalone.append(block)
            continue
        if (not ran and imports_the_package(block.code) and failed_on_the_hidden_package(outcome)
                and block.page_install_lines == 1):
            examples.append(block)
            continue
        last = outcome.output.strip().splitlines()[-1] if outcome.output.strip() else "no output"
        why = (f"uses {', '.join(missing)} without defining or importing it" if ran else f"fails: {last}")
        problems = excerpt_label_problems(block)
        if problems:
            detail = "" if ran else "\n" + textwrap.indent(outcome.output.strip()[-1500:], "        ")
            failures.append(f"{block.id} {why} in a fresh interpreter without the package{detail}\n"
                            f"    and it is not labelled as an excerpt: " + "; ".join(problems))
        else:
            excerpts.append((block, why))

    print(f"\npython blocks on the site: {len(site_blocks)} ({len(chain)} on {', '.join(CHAIN_PAGES)}, run as one chain each); "
          f"of the other {len(singles)}: {len(standalone)} run standalone, {len(excerpts)} labelled excerpts, "
          f"{len(examples)} package examples, {len(failures)} failing; "
          f"{wall:.1f} s for {len(singles)} blocks, {PARALLEL} at a time")
    for block, why in excerpts:
        print(f"  excerpt {block.id} ({block.title}): {why}")
    for block in examples:
        print(f"  package example {block.id}: imports reference_impl")
    assert not failures, f"{len(failures)} python block(s) neither run where pasted nor say what they need:\n\n" + \
        "\n\n".join(failures)
    # The chain page's cells run (test below), so they count as runnable for the site's share.
    runnable = len(standalone) + len(chain)
    assert runnable >= MIN_STANDALONE * len(site_blocks), (
        f"only {runnable} of {len(site_blocks)} python blocks run standalone (want {MIN_STANDALONE:.0%}); "
        "include the module's `imports` section before its code instead of labelling it")


@pytest.mark.parametrize("chain_page", CHAIN_PAGES)
def test_the_notebook_pages_run_as_one_chain_each(site_blocks: list[SiteBlock], chain_page: str) -> None:
    cells = [b for b in site_blocks if b.page == chain_page]
    assert cells, f"no python blocks on {chain_page}"
    code = "\n\n".join(b.code for b in cells)
    missing = undefined_names(code)
    assert not missing, f"the walkthrough's cells use {missing} without defining or importing them"
    outcome = run_fresh(code, f"{chain_page} (all {len(cells)} cells)", CHAIN_TIMEOUT)
    print(f"\n{chain_page}: {len(cells)} cells in one fresh interpreter, {outcome.seconds:.1f} s")
    assert outcome.returncode == 0, (f"the walkthrough's {len(cells)} cells, run top to bottom in a blank "
                                     f"interpreter, fail:\n{outcome.output[-4000:]}")


def test_the_runner_hides_the_package_and_reports_failures() -> None:
    """The harness itself: the package is hidden, a failing block fails, pyflakes sees missing names."""
    hidden = run_fresh("import reference_impl.step\n", "probe", BLOCK_TIMEOUT)
    assert hidden.returncode != 0 and "ModuleNotFoundError" in hidden.output, hidden.output
    cwd = run_fresh("import os, pathlib\nassert not (pathlib.Path(os.getcwd()) / 'reference_impl').exists()\n",
                    "probe", BLOCK_TIMEOUT)
    assert cwd.returncode == 0, cwd.output
    assert undefined_names("def f(x: Tensor) -> int:\n    return nn.Linear(x)\n") == ["nn"]
    assert undefined_names("import torch\nfrom torch import nn\nlayer = nn.Linear(2, 2)\n") == []

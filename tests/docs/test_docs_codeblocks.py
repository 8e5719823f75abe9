"""Run every python/sh/bash code block of the handbook, after expanding snippets as the build does.

* A block made only of `--8<-- "reference_impl/m.py:section"` lines is a *slice*: the expanded
  text is executed in a copy of the module's namespace, which proves that what the page shows
  is valid, self-consistent code of that module (its behaviour is proven by the unit tests).
  Then every line shown must be a line of the module, every function and class the slice
  defines must be the module's own (the module's source of that object, from its first
  decorator, starts with the text shown; a section may elide the end of a class), every name it imports must be bound to the very object the
  module has, and every constant it assigns must equal the module's.
* Any other python block runs in a fresh namespace; `<!--pytest-codeblocks:expected-output-->`
  followed by a fence makes the printed output part of the test.
* sh/bash blocks run with `bash -euo pipefail` from the repository root, with this
  interpreter's directory first on PATH.

Run only these tests with:  pytest tests/docs/test_docs_codeblocks.py
"""

from __future__ import annotations

import __future__
import ast
import contextlib
import importlib
import inspect
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

import handbook_docs_support as support

pytestmark = pytest.mark.docs


def _params():
    params = []
    for block in support.executed_blocks():
        if support.script_module(block):
            continue  # run as a chain by test_notebook_cells_run_top_to_bottom
        marks = [eval(m, {"pytest": pytest, "sys": sys}) for m in block.marks]  # noqa: S307
        params.append(pytest.param(block, id=block.id, marks=marks))
    return params


@contextlib.contextmanager
def _isolated_process_state():
    """Blocks run in this process: undo environment changes and leftover process groups."""
    saved_env = dict(os.environ)
    cwd = os.getcwd()
    try:
        yield
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(cwd)


_MARKER_LINE = re.compile(r"^\s*#\s*-+8<-+\s*\[(?:start|end):[a-z][-_0-9a-z]*\]\s*$", re.I)


def _without_markers(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not _MARKER_LINE.match(line))


def _method_of_a_class(module_ns: dict[str, object], name: str, path: str) -> object | None:
    """The method `name` of the one class defined in the module that has it: a section may
    show a single method of a class."""
    found = [vars(cls)[name] for cls in module_ns.values()
             if inspect.isclass(cls) and cls.__module__ == module_ns["__name__"] and name in vars(cls)]
    assert len(found) <= 1, f"{path}: more than one class defines {name}; the slice is ambiguous"
    return found[0] if found else None


def _run_slice(block: support.DocBlock, code: str) -> None:
    """Run a block made of module sections in those modules' namespaces, and check that
    every import, definition and assignment it shows is the modules' own."""
    paths = list(dict.fromkeys(path for path, _ in block.includes))
    modules = [vars(importlib.import_module(support.module_name(path))) for path in paths]
    namespace: dict[str, object] = {}
    for module_ns in modules:
        namespace.update(module_ns)
    # Compile with the modules' own `from __future__ import annotations`, if they have it.
    future = any(ns.get("annotations") is __future__.annotations for ns in modules)
    exec(compile(code, block.id, "exec", flags=__future__.annotations.compiler_flag if future else 0,  # noqa: S102
                 dont_inherit=True), namespace)
    where = " or ".join(paths)

    # What ran is what the modules hold: nothing shown that they lack, nothing redefined.
    module_lines = {line.strip() for path in paths
                    for line in (support.ROOT / path).read_text(encoding="utf-8").splitlines()}
    foreign = [line for line in code.splitlines() if line.strip() and line.strip() not in module_lines]
    assert not foreign, f"{block.id}: shows lines that {where} does not have: {foreign[:3]}"
    shown = textwrap.dedent(code)
    for node in ast.parse(shown).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                name = alias.asname or alias.name.split(".")[0]
                if name != "annotations" or not isinstance(node, ast.ImportFrom) or node.module != "__future__":
                    assert any(namespace[name] is ns.get(name) for ns in modules), (
                        f"{block.id}: `{name}` is imported differently from {where}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            targets = [ns.get(node.name) or _method_of_a_class(ns, node.name, path)
                       for ns, path in zip(modules, paths)]
            target = next((t for t in targets if t is not None), None)
            assert target is not None, f"{block.id}: defines {node.name}, which {where} does not have"
            # A section may end inside a class (the rest of it is elided), but what it shows is
            # the module's definition from its first decorator on, line for line.
            own = _without_markers(textwrap.dedent(inspect.getsource(target))).strip()
            first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            as_shown = "\n".join(shown.splitlines()[first - 1: node.end_lineno])
            as_shown = _without_markers(as_shown).strip()
            assert own.startswith(as_shown), (
                f"{block.id}: `{node.name}` as shown is not the start of {where}'s `{node.name}`")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for name in (n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name)):
                owner = next((ns for ns in modules if name in ns), None)
                assert owner is not None, f"{block.id}: assigns {name}, which {where} does not have"
                with contextlib.suppress(Exception):  # values without a usable == are only checked by name
                    assert bool(namespace[name] == owner[name]), f"{block.id}: {name} differs from {where}'s"


def _run_python(block: support.DocBlock, code: str) -> str:
    namespace = {"__name__": "__handbook_block__"}
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        exec(compile(code, block.id, "exec"), namespace)  # noqa: S102
    return buffer.getvalue()


def _run_shell(block: support.DocBlock, code: str) -> str:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=support.ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (
        f"{block.id}: exit status {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}"
        f"\n--- stderr\n{proc.stderr[-3000:]}")
    return proc.stdout


@pytest.mark.parametrize("block", _params())
def test_code_block(block: support.DocBlock) -> None:
    code = support.expand_snippets(block.code)
    with _isolated_process_state():
        if block.lang == "python" and block.is_slice:
            _run_slice(block, code)
            output = None
        elif block.lang == "python":
            output = _run_python(block, code)
        else:
            output = _run_shell(block, code)
    if block.expected_output is not None:
        assert output is not None, f"{block.id}: a slice cannot have expected output"
        assert output.rstrip() == block.expected_output.rstrip(), (
            f"{block.id}: printed output differs from the page\n--- printed\n{output}"
            f"--- page\n{block.expected_output}")


def _chains():
    chains: dict[tuple[str, str], list[support.DocBlock]] = {}
    for block in support.executed_blocks():
        if module := support.script_module(block):
            chains.setdefault((support.rel(block.path), module), []).append(block)
    return [pytest.param(blocks, id=f"{page}:{module}") for (page, module), blocks in chains.items()]


@pytest.mark.parametrize("blocks", _chains())
def test_notebook_cells_run_top_to_bottom(blocks: list[support.DocBlock]) -> None:
    """A page that walks through a script module shows all of it, in order, and it runs."""
    (module, _), *_ = blocks[0].includes
    sections = [s for b in blocks for _, s in b.includes]
    source = (support.ROOT / module).read_text(encoding="utf-8")
    defined = [m["name"] for m in support.SECTION_START.finditer(source)]
    assert sections == defined, f"the page shows {sections}, the module defines {defined}"
    namespace = {"__name__": "__main__"}  # as in a notebook kernel, so the run cell trains
    with _isolated_process_state():
        run_id = f"handbook-docs-{os.getpid()}-{time.time_ns()}"
        os.environ["TORCHELASTIC_RUN_ID"] = run_id
        buffer = io.StringIO()
        argv, sys.argv = sys.argv, [module]  # the trainer reads flags; pytest's are not for it
        try:
            with contextlib.redirect_stdout(buffer):
                for block in blocks:
                    code = support.expand_snippets(block.code)
                    exec(compile(code, block.id, "exec", dont_inherit=True), namespace)  # noqa: S102
        finally:
            sys.argv = argv
            shutil.rmtree(Path(tempfile.gettempdir()) / f"interview-{run_id}", ignore_errors=True)
    assert '"run_complete"' in buffer.getvalue()

"""The downloadable notebook runs in a real Jupyter kernel that cannot import the package,
top to bottom, its two-rank cells included, and then every cell that runs in the kernel
all over again in the same kernel."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from launch import REPO

sys.path.insert(0, str(REPO / "docs" / "hooks"))
import handbook  # noqa: E402  (the mkdocs hook that generates the notebook)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # its last cells start two-rank gloo jobs

WITHOUT_PACKAGE = Path(__file__).with_name("without_package.py")
SHELL_OUT = "!{sys.executable}"  # IPython's shell escape, as the two torchrun cells use it
PROOF_CELL = """try:
    import reference_impl
except ModuleNotFoundError:
    print("blank kernel: reference_impl is not importable")
else:
    raise AssertionError("this kernel can import the package, so it proves nothing")"""


def _events(cell: nbformat.NotebookNode) -> list[dict]:
    text = "".join(out.get("text", "") for out in cell.outputs if out.output_type == "stream")
    return [json.loads(line) for line in text.splitlines() if line.startswith('{"event"')]


def test_the_committed_notebook_is_the_generated_one() -> None:
    """Colab opens the committed copy: it must be what the build generates from the module."""
    assert handbook.COMMITTED.read_text(encoding="utf-8") == handbook.notebook_json(), (
        "notebooks/interview_trainer.ipynb is stale: run `python docs/hooks/handbook.py`")
    nbformat.validate(nbformat.reads(handbook.notebook_json(), as_version=4))


@pytest.mark.timeout(600)
def test_the_notebook_runs_twice_in_one_kernel_without_the_package(tmp_path: Path, monkeypatch) -> None:
    spec = tmp_path / "jupyter" / "kernels" / "blank-notebook"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, str(WITHOUT_PACKAGE), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python without reference_impl", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # every checkpoint directory lands here
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    (tmp_path / "tmp").mkdir()
    (tmp_path / "work").mkdir()

    nb = nbformat.reads(handbook.notebook_json(), as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(PROOF_CELL))
    run_cell = next(i for i, c in enumerate(nb.cells) if "result = run()" in c.source)
    client = NotebookClient(nb, kernel_name="blank-notebook", timeout=240,
                            resources={"metadata": {"path": str(tmp_path / "work")}})
    finished, seconds = [], []
    with client.setup_kernel():
        for second_pass in (False, True):
            # The second pass re-runs, in the same already-used kernel, every cell whose work
            # happens in it: a cell that shells out to torchrun runs its job in new processes,
            # which the kernel's state cannot reach (its variables stay from the first pass).
            started = time.perf_counter()
            for index, cell in enumerate(nb.cells):
                if not (second_pass and SHELL_OUT in cell.source):
                    client.execute_cell(cell, index)  # raises CellExecutionError on any error
            seconds.append(round(time.perf_counter() - started, 1))
            events = _events(nb.cells[run_cell])
            finished.append(events[-1])
            assert [e["event"] for e in events if e["event"].startswith("checkpoint_re")] == [], \
                "a fresh run restores nothing: no earlier run's checkpoint leaks in"
            assert "blank kernel" in nb.cells[-1].outputs[0]["text"]
    print(f"notebook in one kernel: first pass {seconds[0]} s, second pass {seconds[1]} s")
    first, second = finished
    assert first["event"] == second["event"] == "run_complete" and first["step"] == 40
    assert first["state_digest"] == second["state_digest"], "same config, same final state"

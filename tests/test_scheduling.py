"""A run on two xdist workers whose worker dies still ends, red, with every other test run."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from launch import run_command

HERE = Path(__file__).resolve().parent
PASS = "def test_{n}():\n    pass\n"
WAIT = "def test_{n}():\n    import time\n    time.sleep(0.5)\n"  # keeps files queued for the replacement


def test_a_worker_that_dies_mid_file_fails_its_test_and_the_run_still_ends(tmp_path: Path) -> None:
    """xdist 3.8's own file scheduler hangs here forever (it sends the dead worker's finished
    files out again as empty batches) and runs the deadly test again on each replacement.
    scripts/test.sh's options, a worker killed in the middle of a file, and files still
    queued when its replacement starts."""
    (tmp_path / "test_a_first.py").write_text("".join(PASS.format(n=n) for n in range(3)))
    (tmp_path / "test_b_dies.py").write_text(PASS.format(n=0) + "def test_dies():\n    import os\n    os._exit(3)\n"
                                             + PASS.format(n=2) + PASS.format(n=3))
    for name in "cdefghij":
        (tmp_path / f"test_{name}_one.py").write_text(WAIT.format(n=0))
    run = run_command([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadfile", "--no-loadscope-reorder",
                       "-p", "scheduling", "-p", "no:cacheprovider", "-q", "-o", "timeout=0", str(tmp_path)],
                      timeout=120, cwd=tmp_path, env={"PYTHONPATH": str(HERE)})
    assert run.returncode == 1, run.stdout[-3000:]
    assert "worker 'gw" in run.stdout and "crashed while running 'test_b_dies.py::test_dies'" in run.stdout
    assert run.stdout.rstrip().splitlines()[-1].startswith("1 failed, 14 passed"), run.stdout[-3000:]


def test_the_faulthandler_deadline_comes_after_every_tests_own_timeout(request: pytest.FixtureRequest) -> None:
    """pytest's faulthandler ends a worker whose test outlives `faulthandler_timeout`: only
    a test that its own timeout (pytest-timeout's signal) could not stop may get there."""
    limits = [int(n) for path in HERE.rglob("test_*.py")
              for n in re.findall(r"mark\.timeout\((\d+)\)", path.read_text())]
    assert len(limits) > 20, "the pattern still finds the suite's timeouts"
    longest = max(float(request.config.getini("timeout")), *limits)
    assert float(request.config.getini("faulthandler_timeout")) > longest + 60
    assert request.config.getini("faulthandler_exit_on_timeout") is True

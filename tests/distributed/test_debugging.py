"""The debugging page's recipes, run for real on gloo: what each tool shows for a broken job."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch import REPO, kill_tree, torchrun
from reference_impl.launch import torchrun_command

pytestmark = pytest.mark.distributed

DEMO = "reference_impl.debug_demos"


def test_detail_mode_names_the_mismatched_collective_and_its_shapes() -> None:
    run = torchrun(["mismatch", "--timeout-s", "20"], module=DEMO, timeout=90,
                   env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert run.returncode != 0
    assert "Detected mismatch between collectives" in run.stderr
    assert "TensorShape=[4]" in run.stderr and "TensorShape=[5]" in run.stderr


def test_without_detail_the_same_bug_gives_no_such_diagnosis() -> None:
    run = torchrun(["mismatch", "--timeout-s", "20"], module=DEMO, timeout=90)
    assert run.returncode != 0, "the job fails (a gloo size check or the timeout), but..."
    assert "Detected mismatch between collectives" not in run.stderr, "...nothing names the collectives"


@pytest.mark.timeout(120)
def test_py_spy_dump_shows_the_rank_waiting_in_its_all_reduce() -> None:
    py_spy = Path(sys.executable).with_name("py-spy")
    cmd = torchrun_command(2, DEMO, ["stuck", "--timeout-s", "60"])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    try:
        pid, seen = None, ""
        deadline = time.monotonic() + 60
        while pid is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break  # the job ended
            seen += line
            # The ranks share one pipe, so their lines can arrive glued together.
            if match := re.search(r"rank 0 pid (\d+) running", line):
                pid = int(match[1])
        assert pid, f"rank 0 never reported its pid; the job printed: {seen[-2000:]!r}"
        time.sleep(2)  # let it reach the collective
        dump = subprocess.run([str(py_spy), "dump", "--pid", str(pid)], capture_output=True, text=True,
                              timeout=30)
    finally:
        kill_tree(proc)
    assert dump.returncode == 0, dump.stderr
    assert "all_reduce" in dump.stdout and "stuck_collective" in dump.stdout, dump.stdout

"""The debugging page's recipes, run for real on gloo: what each tool shows for a broken job."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch import REPO, kill_tree, torchrun

from reference_impl.interview.debug_demos import ranks_behind
from reference_impl.launch import torchrun_command

pytestmark = pytest.mark.distributed

DEMO = "reference_impl.interview.debug_demos"


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


@pytest.mark.timeout(120)
def test_the_flight_recorder_names_the_rank_that_never_entered_the_collective(tmp_path: Path) -> None:
    """Four gloo ranks; rank 2 stops before the third all-reduce. The others time out in it,
    every rank dumps its flight recorder, and the dumps agree on who is missing."""
    run = torchrun(["behind", "--timeout-s", "3", "--trace-dir", str(tmp_path)], nproc=4, module=DEMO,
                   timeout=100, env={"TORCH_FR_BUFFER_SIZE": "2000"})
    assert run.returncode != 0, "the job fails: the waiting ranks time out"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"rank_{r}.json" for r in range(4)]
    assert ranks_behind(str(tmp_path)) == {"0": {"seq": 3, "op": "gloo:all_reduce", "missing": [2]}}


def test_ranks_behind_finds_one_rank_in_512(tmp_path: Path) -> None:
    """The analysis is per rank and per group, so 512 dumps cost no more thought than four:
    rank 317 entered 41 collectives of the default group, every other rank 42."""
    for rank in range(512):
        seq = 41 if rank == 317 else 42
        trace = {"pg_status": {"0": {"last_enqueued_collective": str(seq)}},
                 "entries": [{"pg_id": 0, "collective_seq_id": s, "profiling_name": "nccl:reduce_scatter"}
                             for s in range(seq - 2, seq + 1)]}
        (tmp_path / f"rank_{rank}.json").write_text(json.dumps(trace), encoding="utf-8")
    assert ranks_behind(str(tmp_path)) == {"0": {"seq": 42, "op": "nccl:reduce_scatter", "missing": [317]}}

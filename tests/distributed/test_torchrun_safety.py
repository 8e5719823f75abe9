"""Operational safety under real torchrun: agent loss, preemption, a shrinking world's
sample log, and bad input reported once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from launch import REPO, alive, descendants, forked_ranks, kill_tree, python_module, torchrun
from reference_impl.checkpoint.lock import DirectoryLock
from reference_impl.launch import torchrun_command
from reference_impl.reliability.lifecycle import AGREE_AT_LEAST_EVERY, PREEMPTED_EXIT

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

BASE = ["--max-steps", "30", "--checkpoint-every", "10", "--warmup-steps", "5", "--log-every", "10",
        "--dataset-size", "512", "--micro-batch-size", "8", "--hidden-dim", "32", "--pg-timeout-s", "30"]


def start_endless_run(ckpt: Path, *flags: str) -> subprocess.Popen:
    """A 2-rank torchrun job that trains until stopped; its events come on the agent's stdout."""
    cmd = torchrun_command(2, "reference_impl.train", [*BASE, "--max-steps", "1000000", "--checkpoint-every", "0",
                                                       "--checkpoint-dir", str(ckpt), *flags])
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)


@pytest.mark.slow
def test_workers_die_with_a_sigkilled_agent(tmp_path: Path) -> None:
    agent = start_endless_run(tmp_path)
    try:
        for line in agent.stdout:  # type: ignore[union-attr]
            if '"event": "step"' in line:
                break
        workers = descendants(agent.pid)
        assert len(workers) >= 2
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait(10)
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        survivors = [pid for pid in workers if alive(pid)]
        assert survivors == [], "workers kept training without their agent"
    finally:
        kill_tree(agent)
    relaunch = torchrun([*BASE, "--max-steps", "20", "--checkpoint-dir", str(tmp_path)], timeout=90)
    assert relaunch.returncode == 0, relaunch.stderr[-3000:]  # the lock went with the workers


def importing_torch(pid: int) -> bool:
    """True once `pid` has mapped libtorch: it is inside `import torch`, past the package's
    `__init__` and still a second or more from the trainer's `main()`."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return "libtorch" in f.read()
    except OSError:
        return False


def test_workers_die_with_an_agent_sigkilled_while_they_import(tmp_path: Path) -> None:
    agent = start_endless_run(tmp_path, "--checkpoint-every", "1")
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            workers = descendants(agent.pid)
            if len(workers) >= 2 and all(importing_torch(pid) for pid in workers):
                break
            time.sleep(0.005)
        assert len(workers) == 2, f"expected two workers importing torch, found {workers}"
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait(10)
        deadline = time.monotonic() + 30  # they die once their imports end (seconds on a loaded machine)
        while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = [pid for pid in workers if alive(pid)]
    finally:
        for pid in workers:  # orphans are outside the agent's tree, and hold its stdout open
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        kill_tree(agent)
    assert survivors == [], "workers outlived an agent that died while they were starting"
    assert not list(tmp_path.glob("step-*")), "an orphaned worker published a checkpoint"
    with DirectoryLock(tmp_path):  # a relaunch would get the lock
        pass


@pytest.mark.slow  # the stopped attempt and its restart under torchrun; the reference on forked ranks
def test_sigterm_on_one_rank_stops_every_rank_at_the_same_step_and_resumes_bit_exactly(tmp_path: Path) -> None:
    reference = forked_ranks([*BASE, "--checkpoint-dir", str(tmp_path / "reference")])
    run = torchrun([*BASE, "--fail-mode", "sigterm", "--fail-at-step", "15", "--fail-rank", "1",
                    "--checkpoint-dir", str(tmp_path / "ckpt")], max_restarts=1)
    assert run.returncode == 0, run.stderr[-3000:]
    stopped = [e["step"] for e in run.of("preempted")]
    assert len(stopped) == 1 and 15 <= stopped[0] <= 15 + AGREE_AT_LEAST_EVERY + 1, stopped
    saved = [e["step"] for e in run.of("checkpoint_saved")]
    assert saved[:saved.index(stopped[0]) + 1] == [s for s in (10, 20) if s < stopped[0]] + stopped
    assert [e["step"] for e in run.of("checkpoint_restored")] == stopped, "torchrun restarted the stopped group"
    assert run.digest() == reference.digest()


@pytest.mark.parametrize("workers", [0, 2], ids=["no_loader_workers", "loader_workers"])
def test_sigterm_to_the_agent_is_forwarded_and_ends_with_a_checkpoint(tmp_path: Path, workers: int) -> None:
    agent = start_endless_run(tmp_path, "--num-workers", str(workers))
    tree: list[int] = []
    try:
        lines = []
        for line in agent.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if '"event": "step"' in line:
                tree = descendants(agent.pid)  # the ranks and their DataLoader workers
                agent.send_signal(signal.SIGTERM)
                break
        lines += agent.stdout.read().splitlines(keepends=True)  # type: ignore[union-attr]
        agent.wait(60)
    finally:
        kill_tree(agent)
    events = [json.loads(line) for line in lines if line.startswith("{")]
    preempted = [e for e in events if e["event"] == "preempted"]
    saved = [e for e in events if e["event"] == "checkpoint_saved"]
    assert len(tree) == 2 + 2 * workers, tree
    assert len(preempted) == 1, "".join(lines)[-3000:]
    assert preempted[0]["exit_status"] == PREEMPTED_EXIT
    assert saved and saved[-1]["step"] == preempted[0]["step"]
    assert (tmp_path / f"step-{preempted[0]['step']:08d}" / "manifest.json").is_file()
    assert [pid for pid in tree if alive(pid)] == [], "a process outlived the stopped job"


@pytest.mark.slow
def test_a_smaller_world_cuts_the_departed_ranks_sample_log(tmp_path: Path) -> None:
    log, ckpt = tmp_path / "samples", tmp_path / "ckpt"
    killed = torchrun([*BASE, "--sample-log", str(log), "--fail-at-step", "15", "--fail-rank", "1",
                       "--checkpoint-dir", str(ckpt)])
    assert killed.returncode != 0
    resumed = python_module([*BASE, "--micro-batch-size", "16", "--sample-log", str(log),
                             "--checkpoint-dir", str(ckpt)], timeout=60)
    assert resumed.of("checkpoint_restored")[0]["step"] == 10
    per_step: dict[int, list[int]] = {}
    for file in log.glob("rank*.jsonl"):
        for line in file.read_text().splitlines():
            entry = json.loads(line)
            per_step.setdefault(entry["step"], []).extend(entry["indices"])
    assert sorted(per_step) == list(range(1, 31))
    assert all(len(indices) == 16 for indices in per_step.values()), "each step's global batch once"


def test_bad_input_under_torchrun_is_one_line_from_local_rank_0(tmp_path: Path) -> None:
    run = torchrun([*BASE, "--seed", str(2**64), "--checkpoint-dir", str(tmp_path)], timeout=60)
    ours = [line for line in run.stderr.splitlines() if line.startswith("reference_impl.train: error:")]
    assert ours == [ours[0]] and "seed must be in" in ours[0]
    assert "reference_impl/" not in run.stderr, "no traceback through the package"


# Local rank 0 reaches the bad flag last: the quiet rank 1 exits first, and torchrun then
# stops every worker that is still running.
SLOW_RANK_0 = """import os, time
from reference_impl.distributed import exit_after
from reference_impl.train import main
if os.environ["LOCAL_RANK"] == "0":
    time.sleep(3)
exit_after(main)
"""


def test_the_error_line_survives_a_quiet_rank_that_exits_first(tmp_path: Path) -> None:
    script = tmp_path / "slow_rank_0.py"
    script.write_text(SLOW_RANK_0)
    run = torchrun([*BASE, "--seed", "-1", "--checkpoint-dir", str(tmp_path / "ckpt")], timeout=60,
                   module=str(script))
    assert run.returncode != 0
    ours = [line for line in run.stderr.splitlines() if line.startswith("reference_impl.train: error:")]
    assert len(ours) == 1 and "seed must be >= 0" in ours[0], run.stderr[-2000:]

"""Launching `reference_impl.train` with torchrun: one agent on one node, and two agents
that rendezvous like two nodes (c10d) on this machine and must compute the same job."""

from __future__ import annotations

import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import launch

pytestmark = pytest.mark.distributed

FLAGS = ["--max-steps", "6", "--warmup-steps", "0", "--log-every", "3", "--micro-batch-size", "16",
         "--dataset-size", "512", "--num-workers", "2"]


def two_agents(args: list[str], timeout: float) -> list[launch.Run]:
    """Two torchrun agents (`--nnodes 2`, one worker each) started together on this machine.

    Each agent runs through `launch.run_command` in its own thread, so each keeps that
    helper's process group and hard timeout; the threads only let them rendezvous.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{launch.free_port()}",
           "--rdzv-id", uuid.uuid4().hex, "--max-restarts", "0", "-m", "reference_impl.train", *args]
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(launch.run_command, cmd, timeout) for _ in range(2)]
        return [f.result() for f in futures]


@pytest.fixture(scope="module")
def standalone() -> launch.Run:
    """`torchrun --standalone --nproc-per-node 2` with DataLoader workers."""
    return launch.torchrun(FLAGS, nproc=2, timeout=90)


def test_standalone_two_processes_train_on_cpu(standalone: launch.Run) -> None:
    assert standalone.returncode == 0, standalone.stderr[-5000:]
    start = standalone.of("run_start")[0]
    assert start["world_size"] == 2 and start["device"] == "cpu" and start["backend"] == "gloo"
    assert [e["step"] for e in standalone.of("step")] == [3, 6]
    assert standalone.of("run_complete")[-1]["step"] == 6


@pytest.mark.slow
def test_two_agents_rendezvous_as_two_nodes_and_match_standalone(standalone: launch.Run) -> None:
    runs = two_agents(FLAGS, timeout=90)
    assert [r.returncode for r in runs] == [0, 0], "\n".join(r.stderr[-3000:] for r in runs)
    # Progress comes from global rank 0 only, so exactly one agent reports the job.
    reporting = [r for r in runs if r.of("run_complete")]
    assert len(reporting) == 1
    assert reporting[0].of("run_start")[0]["world_size"] == 2
    assert reporting[0].digest() == standalone.digest()


def test_a_failed_jobs_reason_is_the_ranks_exception_not_torchruns_banner(tmp_path: Path) -> None:
    """A bench that reports a failed torchrun job names why it failed; torchrun's own
    report ends with a line of `=`, which is what the last line of stderr says."""
    script = tmp_path / "fails.py"
    script.write_text("import os\nif os.environ['RANK'] == '1':\n    raise ValueError('rank 1 cannot go on')\n")
    run = launch.torchrun([], nproc=2, timeout=90, module=str(script))
    assert run.returncode != 0 and run.stderr.strip().splitlines()[-1].startswith("====")
    assert run.failure() == "ValueError: rank 1 cannot go on"


def test_a_rank_killed_by_a_signal_is_named_by_its_signal(tmp_path: Path) -> None:
    """No exception to report: the reason is the signal torchrun saw."""
    script = tmp_path / "aborts.py"
    script.write_text("import os\nif os.environ['RANK'] == '1':\n    os.abort()\n")
    run = launch.torchrun([], nproc=2, timeout=90, module=str(script))
    assert run.returncode != 0
    assert "SIGABRT" in run.failure(), run.stderr[-2000:]

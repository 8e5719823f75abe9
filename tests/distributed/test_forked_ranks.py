"""`forked_ranks`, the suite's fast launcher for one uninterrupted job, against torchrun:
the same training, the same failure reporting, the same hard deadline."""

from __future__ import annotations

from pathlib import Path

import pytest
from launch import alive, forked_ranks, torchrun

pytestmark = pytest.mark.distributed

FLAGS = ["--max-steps", "6", "--warmup-steps", "0", "--log-every", "2", "--micro-batch-size", "8",
         "--dataset-size", "256"]


def test_forked_ranks_train_exactly_like_torchrun() -> None:
    under_torchrun, forked = torchrun(FLAGS), forked_ranks(FLAGS)
    assert under_torchrun.returncode == forked.returncode == 0, forked.stderr[-3000:]
    assert forked.digest() == under_torchrun.digest()
    losses = [[(e["step"], e["loss"]) for e in run.of("step")] for run in (under_torchrun, forked)]
    assert losses[0] == losses[1] and len(losses[0]) == 3


def test_a_rank_that_fails_fails_the_job() -> None:
    run = forked_ranks(["exit", "1", "3"], module="rank_probe", timeout=60)
    assert run.returncode == 3
    assert "rank 1 fails on purpose" in run.stdout


def test_a_hung_rank_is_killed_at_the_deadline(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    with pytest.raises(pytest.fail.Exception, match="timed out after 3s"):
        forked_ranks(["hang", "0", str(pidfile)], module="rank_probe", timeout=3)
    assert not alive(int(pidfile.read_text()))

"""A checkpoint directory that is not one directory: node-local disks mounted at the same
path. Every rank writes its part into its own node's copy, so under FSDP every save used to
say `checkpoint_saved` while its manifest listed files only another node held; after a fault
every restore refused them and training silently started again from step 0. The first save
now proves that every rank reads a token rank 0 wrote, or fails the job in one line.

Two nodes are simulated on one machine, in a real gloo group of ranks forked with torchrun's
environment (`launch.forked_ranks`, held equal to torchrun by tests/distributed/test_forked_ranks.py;
what torchrun's agent itself prints is tested in tests/distributed/test_torchrun_safety.py):
`tests/per_rank_flags.py` gives each rank its own directory (`D/node0`, `D/node1`), which to
the trainer is exactly what two disks at one path are (a mount namespace per rank would need
privileges CI lacks).
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from checkpoints import published
from launch import forked_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

FLAGS = ["--max-steps", "12", "--checkpoint-every", "5", "--warmup-steps", "2", "--log-every", "5",
         "--dataset-size", "256", "--micro-batch-size", "8", "--hidden-dim", "32", "--pg-timeout-s", "60"]


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_node_local_checkpoint_directories_fail_the_first_save_in_one_line(strategy: str, tmp_path: Path) -> None:
    nodes = {f"RANK{rank}_FLAGS": f"--checkpoint-dir {shlex.quote(str(tmp_path / f'node{rank}'))}" for rank in (0, 1)}
    run = forked_ranks([*FLAGS, "--strategy", strategy, "--checkpoint-dir", str(tmp_path)],
                       module="tests/per_rank_flags.py", env=nodes, timeout=180)
    assert run.returncode != 0, "the job succeeded with a checkpoint directory each node sees alone"
    assert run.of("checkpoint_saved") == [] and run.of("run_complete") == []
    ours = [line for line in run.stderr.splitlines() if line.startswith("reference_impl.train: error:")]
    assert len(ours) == 1, run.stderr[-3000:]
    assert "is not shared" in ours[0] and "rank 1" in ours[0] and "shared filesystem" in ours[0], ours[0]
    assert "reference_impl/" not in run.stderr, "no traceback through the package"
    errors = run.of("error")
    assert sorted(e["rank"] for e in errors) == [0, 1], errors
    assert all(e["error"] == "DirectoryNotShared" and e["phase"] == "checkpoint" and e["step"] == 5 for e in errors)
    for node in ("node0", "node1"):
        assert published(tmp_path / node) == []
        assert [p.name for p in (tmp_path / node).glob(".tmp-*")] == [], "the save's temporary directory is gone"

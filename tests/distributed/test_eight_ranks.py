"""The DP, FSDP and 2-D FSDP+TP plans at eight ranks: eight gloo processes on one CPU.

Two ranks cannot tell a plan that shards by the global rank from one that shards by the
data-parallel rank, nor a mesh whose axes are laid out in the wrong order; eight can. Each
plan trains a tiny transformer for six steps on the same global batch (16 sequences) as one
process, and must give its losses within 1e-5, with every sample of a step trained by
exactly one data-parallel group and read alike by the ranks of a tensor-parallel group.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launch import forked_ranks, python_module
from sample_logs import losses, rank_log

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

COMMON = ["--model", "transformer", "--dataset-size", "256", "--warmup-steps", "2", "--log-every", "1",
          "--max-steps", "6", "--pg-timeout-s", "60"]
GLOBAL_BATCH = 16
TOL = 1e-5

# plan: (flags, micro-batch per data-parallel group, the mesh run_start must report)
PLANS = {
    "ddp": (["--strategy", "ddp"], 2, {"pp": 1, "dp_replicate": 8, "dp_shard": 1, "cp": 1, "tp": 1, "ep": 1}),
    "fsdp": (["--strategy", "fsdp"], 2, {"pp": 1, "dp_replicate": 1, "dp_shard": 8, "cp": 1, "tp": 1, "ep": 1}),
    "fsdp_tp": (["--strategy", "fsdp", "--tp-degree", "2"], 4,
                {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "cp": 1, "tp": 2, "ep": 1}),
}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The per-step losses of one process training on the whole global batch."""
    run = python_module([*COMMON, "--micro-batch-size", str(GLOBAL_BATCH),
                         "--checkpoint-dir", str(tmp_path_factory.mktemp("one"))], timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    return losses(run)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("plan", list(PLANS))
def test_eight_ranks_train_like_one_process(plan: str, one_process: list[float], tmp_path: Path) -> None:
    flags, micro_batch, mesh = PLANS[plan]
    run = forked_ranks([*COMMON, *flags, "--micro-batch-size", str(micro_batch), "--checkpoint-dir",
                        str(tmp_path / "ckpt"), "--sample-log", str(tmp_path / "samples")], nproc=8, timeout=240)
    assert run.returncode == 0, run.stderr[-4000:]
    start = run.of("run_start")[0]
    assert start["mesh"] == mesh and start["global_batch_size"] == GLOBAL_BATCH
    assert losses(run) == pytest.approx(one_process, abs=TOL)

    logs = [rank_log(tmp_path / "samples", rank) for rank in range(8)]
    tp = mesh["tp"]
    for group in range(8 // tp):  # ranks [group*tp, (group+1)*tp) form one TP group
        assert all(logs[group * tp + i] == logs[group * tp] for i in range(tp)), "TP partners read alike"
    for step in range(1, 7):
        per_group = [logs[group * tp][step] for group in range(8 // tp)]
        trained = [index for indices in per_group for index in indices]
        assert all(len(indices) == micro_batch for indices in per_group)
        assert len(trained) == len(set(trained)) == GLOBAL_BATCH, f"step {step}: each sample once"

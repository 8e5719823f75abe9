"""Tensor parallel (DTensor, with sequence parallel norms) under real torchrun on gloo.

TP ranks split every matmul and share their samples, so a TP=2 run on 2 ranks trains on the
same global batch as one process: same losses up to rounding, and exactly the same samples.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from launch import Run, python_module, train_ok
from sample_logs import assert_trained_once_in_order, losses, rank_log

pytestmark = pytest.mark.distributed

COMMON = ["--model", "transformer", "--dataset-size", "512", "--warmup-steps", "2", "--log-every", "1",
          "--checkpoint-every", "10", "--pg-timeout-s", "60", "--max-steps", "20"]
TP2 = [*COMMON, "--tp-degree", "2", "--micro-batch-size", "16"]  # 1 data-parallel rank x 16
ONE = [*COMMON, "--micro-batch-size", "16"]                      # the same global batch
TOL = 1e-5


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Path, Path]:
    """An uninterrupted TP=2 run of 20 steps (checkpoints at 10 and 20), with its sample log."""
    root = tmp_path_factory.mktemp("tp_reference")
    run = train_ok(TP2, root / "ckpt", "--sample-log", str(root / "samples"))
    return run, root / "ckpt", root / "samples"


def test_tp_two_ranks_match_one_process(reference: tuple[Run, Path, Path], tmp_path: Path) -> None:
    single = python_module([*ONE, "--checkpoint-dir", str(tmp_path)], timeout=120)
    assert single.returncode == 0, single.stderr[-3000:]
    assert reference[0].of("run_start")[0]["mesh"]["tp"] == 2
    assert len(losses(reference[0])) == 20
    assert losses(reference[0]) == pytest.approx(losses(single), abs=TOL)


def test_the_ranks_of_one_tp_group_read_the_same_samples(reference: tuple[Run, Path, Path]) -> None:
    rank0, rank1 = rank_log(reference[2], 0), rank_log(reference[2], 1)
    assert sorted(rank0) == list(range(1, 21))
    assert rank0 == rank1, "both halves of every matmul saw the same batch"
    assert all(len(indices) == 16 for indices in rank0.values()), "each reads the whole global batch"


@pytest.mark.slow
def test_sigkill_under_tp_resumes_bit_exactly(reference: tuple[Run, Path, Path], tmp_path: Path) -> None:
    run = train_ok(TP2, tmp_path, "--fail-at-step", "15", "--fail-rank", "1", restarts=1)
    assert [e["step"] for e in run.of("checkpoint_restored")] == [10]
    assert run.digest() == reference[0].digest()


def test_a_tp_checkpoint_restores_on_one_rank_with_exactly_once_data(
        reference: tuple[Run, Path, Path], tmp_path: Path) -> None:
    """Resume the TP=2 run's step-10 checkpoint in one process (DCP reshards the DTensors):
    the next 10 steps repeat the TP run's losses, and the 20 steps trained every sample of
    the first 20 global batches exactly once."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "samples"
    ckpt.mkdir()
    shutil.copytree(reference[1] / "step-00000010", ckpt / "step-00000010")  # a symlinked step is refused
    shutil.copytree(reference[2], log)
    single = python_module([*ONE, "--checkpoint-dir", str(ckpt), "--sample-log", str(log)], timeout=120)
    assert single.returncode == 0, single.stderr[-3000:]
    assert single.of("checkpoint_restored")[0]["step"] == 10
    assert losses(single) == pytest.approx(losses(reference[0])[10:], abs=TOL)
    assert_trained_once_in_order(log, [0], steps=20, global_batch=16, dataset_size=512)  # rank 1: its TP partner
    assert sorted(rank_log(log, 1)) == list(range(1, 11)), "the departed rank's replayed steps were cut"


FSDP_TP = ["--strategy", "fsdp", *COMMON[:-4], "--checkpoint-every", "6", "--max-steps", "12",
           "--tp-degree", "2", "--micro-batch-size", "8"]  # 2 data-parallel ranks x 8


@pytest.mark.slow
def test_fsdp_and_tp_on_a_two_by_two_mesh(tmp_path: Path) -> None:
    """FSDP2 over dp_shard=2 and TP over tp=2 (4 ranks): the losses of one process within
    1e-5; TP partners read the same samples and the two data-parallel groups disjoint ones;
    a SIGKILL resumes to the uninterrupted run's state bit for bit."""
    run = train_ok(FSDP_TP, tmp_path / "ckpt", "--sample-log", str(tmp_path / "samples"), nproc=4)
    assert run.of("run_start")[0]["mesh"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2, "ep": 1}
    single_flags = [*FSDP_TP[:-4], "--micro-batch-size", "16", "--checkpoint-dir", str(tmp_path / "one")]
    single = python_module(single_flags, timeout=120)
    assert single.returncode == 0, single.stderr[-3000:]
    assert losses(run) == pytest.approx(losses(single), abs=TOL)
    logs = [rank_log(tmp_path / "samples", r) for r in range(4)]
    assert logs[0] == logs[1] and logs[2] == logs[3]
    assert all(not set(logs[0][s]) & set(logs[2][s]) and len(logs[0][s]) == 8 for s in logs[0])
    killed = train_ok(FSDP_TP, tmp_path / "killed", "--fail-at-step", "9", "--fail-rank", "3", nproc=4,
                    restarts=1)
    assert [e["step"] for e in killed.of("checkpoint_restored")] == [6]
    assert killed.digest() == run.digest()

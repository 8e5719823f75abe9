"""HSDP (`--dp-replicate 2` with FSDP2) on 4 ranks under real torchrun (gloo).

Two replica groups of two shards each: FSDP2 shards within a group and all-reduces the
gradient shards across groups. All four ranks read different samples, so the run trains
the same global batch as one process: the same losses up to rounding.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from launch import Run, python_module, train_ok
from reference_impl.data import ResumableDistributedSampler
from sample_logs import losses, rank_log

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # every 4-rank job takes 30-70 s here

COMMON = ["--strategy", "fsdp", "--model", "transformer", "--dataset-size", "512", "--warmup-steps", "2",
          "--log-every", "1", "--checkpoint-every", "6", "--max-steps", "12", "--pg-timeout-s", "60"]
HSDP = [*COMMON, "--dp-replicate", "2", "--micro-batch-size", "4"]  # 2 replicas x 2 shards x 4 = 16
ONE = [*COMMON, "--micro-batch-size", "16"]                          # the same global batch
TOL = 1e-6  # as FSDP against one process (tests/distributed/test_fsdp.py)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Path, Path]:
    """An uninterrupted 2 x 2 HSDP run of 12 steps (checkpoints at 6 and 12), with its sample log."""
    root = tmp_path_factory.mktemp("hsdp_reference")
    run = train_ok(HSDP, root / "ckpt", "--sample-log", str(root / "samples"), nproc=4)
    return run, root / "ckpt", root / "samples"


def test_hsdp_four_ranks_match_one_process(reference: tuple[Run, Path, Path], tmp_path: Path) -> None:
    assert reference[0].of("run_start")[0]["mesh"] == {"pp": 1, "dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 1,
                                                       "ep": 1}
    single = python_module([*ONE, "--checkpoint-dir", str(tmp_path)], timeout=120)
    assert single.returncode == 0, single.stderr[-3000:]
    assert len(losses(reference[0])) == 12
    assert losses(reference[0]) == pytest.approx(losses(single), abs=TOL)


def test_every_hsdp_rank_reads_its_own_shard_of_each_global_batch(reference: tuple[Run, Path, Path]) -> None:
    """Replicas hold the same weights but not the same data: at every step the four ranks'
    samples are disjoint, 4 each, and together that step's global batch of the epoch."""
    logs = [rank_log(reference[2], r) for r in range(4)]
    perm = ResumableDistributedSampler(512, world_size=1, rank=0, global_batch_size=16).epoch_permutation()
    assert all(sorted(log) == list(range(1, 13)) for log in logs)
    for step in range(1, 13):
        per_rank = [set(log[step]) for log in logs]
        assert all(len(indices) == 4 for indices in per_rank)
        assert len(set().union(*per_rank)) == 16, f"step {step}: two ranks trained the same samples"
        assert set().union(*per_rank) == set(perm[16 * (step - 1):16 * step].tolist()), f"step {step}"


def test_sigkill_under_hsdp_resumes_bit_exactly(reference: tuple[Run, Path, Path], tmp_path: Path) -> None:
    """Rank 3 (second replica group) is killed before step 9; torchrun restarts all four,
    they restore step 6 and end on the uninterrupted run's state bit for bit."""
    run = train_ok(HSDP, tmp_path, "--fail-at-step", "9", "--fail-rank", "3", nproc=4, restarts=1)
    assert [e["step"] for e in run.of("checkpoint_restored")] == [6]
    assert run.digest() == reference[0].digest()


def test_an_hsdp_checkpoint_restores_at_another_replicate_degree(
        reference: tuple[Run, Path, Path], tmp_path: Path) -> None:
    """The 2 x 2 checkpoint of step 12, restored as plain FSDP over 4 ranks (1 x 4: DCP
    reshards every tensor), holds the 2 x 2 run's final state bit for bit."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copytree(reference[1] / "step-00000012", ckpt / "step-00000012")  # a symlinked step is refused
    run = train_ok([*COMMON, "--dp-replicate", "1", "--micro-batch-size", "4"], ckpt, nproc=4)
    assert run.of("run_start")[0]["mesh"]["dp_shard"] == 4
    assert run.of("checkpoint_restored")[0]["step"] == 12
    assert run.digest() == reference[0].digest()

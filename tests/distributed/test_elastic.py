"""Elastic restarts as a chain: one FSDP2 run resumed at 4, 2, 3, 1 and again 4 ranks.

Each leg restores the previous leg's checkpoint at a new world size (DCP reshards the
parameters and Adam state; the sampler re-splits the same global batches), trains four
steps and checkpoints. The sample log must show every sample of the epoch trained exactly
once, in the epoch's order, across all five legs; the losses must follow an uninterrupted
4-rank run to a stated tolerance. The first leg is that run's own start: the chain begins
from a copy of its step-4 checkpoint and sample log, as a job that shrinks after its first
four steps would.

Bit-exactness cannot hold across a change of world size: each rank sums its own samples'
gradients before the reduce-scatter adds the ranks' sums, so 4 ranks add 6 samples at a
time and 3 ranks add 8; floating-point addition is not associative, and the matmuls see
other batch sizes and split their reductions differently. The differences start at float
rounding (about 1e-7 relative) and Adam carries them forward, so the tolerance is on the
loss, not on the bits.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from launch import train_ok
from reference_impl.data import ResumableDistributedSampler
from sample_logs import losses, trained_by_step

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

GLOBAL_BATCH, DATASET, STEPS_PER_LEG = 24, 512, 4
CHAIN = (4, 2, 3, 1, 4)  # ranks per leg; 24 divides by each
BASE = ["--strategy", "fsdp", "--model", "transformer", "--dataset-size", str(DATASET), "--warmup-steps", "2",
        "--log-every", "1", "--checkpoint-every", str(STEPS_PER_LEG), "--pg-timeout-s", "90",
        "--min-lr-ratio", "1", "--allow-config-change", "max_steps"]  # a flat schedule: each leg's end
# is its own --max-steps, and a cosine over a shorter run would change every step's rate
LOSS_RTOL = 1e-4


def leg(ckpt: Path, log: Path, ranks: int, start: int, steps: int, *flags: str) -> list[float]:
    """Train from `start` (restored from `ckpt`, or from scratch at 0) to `steps` on `ranks` ranks."""
    run = train_ok([*BASE, "--micro-batch-size", str(GLOBAL_BATCH // ranks), "--max-steps", str(steps),
                    "--sample-log", str(log), *flags], ckpt, nproc=ranks)
    assert [e["step"] for e in run.of("checkpoint_restored")] == ([start] if start else [])
    return losses(run)


def test_a_chain_of_world_sizes_trains_every_sample_once_and_follows_the_uninterrupted_loss(tmp_path: Path) -> None:
    total = STEPS_PER_LEG * len(CHAIN)
    assert total * GLOBAL_BATCH <= DATASET, "the chain stays inside one epoch"
    # Retention keeps every checkpoint of the reference (one per leg), the first leg's among them.
    reference = leg(tmp_path / "reference", tmp_path / "reference-samples", CHAIN[0], 0, total,
                    "--keep-last", str(len(CHAIN)))
    first = f"step-{STEPS_PER_LEG:08d}"
    (tmp_path / "chain").mkdir()
    shutil.copytree(tmp_path / "reference" / first, tmp_path / "chain" / first)  # a symlinked step is refused
    # The whole log: the next leg's restore cuts every rank's file back to the restored step.
    shutil.copytree(tmp_path / "reference-samples", tmp_path / "chain-samples")
    chained = reference[:STEPS_PER_LEG]
    for i, ranks in enumerate(CHAIN[1:], start=1):
        chained += leg(tmp_path / "chain", tmp_path / "chain-samples", ranks, i * STEPS_PER_LEG,
                       (i + 1) * STEPS_PER_LEG)
    assert len(chained) == len(reference) == total
    worst = max(abs(a - b) / abs(b) for a, b in zip(chained, reference, strict=True))
    assert worst <= LOSS_RTOL, f"losses differ by up to {worst:.2e} relative"
    by_step = trained_by_step(tmp_path / "chain-samples")
    assert sorted(by_step) == list(range(1, total + 1))
    trained = [i for step in sorted(by_step) for i in by_step[step]]
    assert len(trained) == len(set(trained)) == total * GLOBAL_BATCH, "no sample twice, none skipped"
    epoch = ResumableDistributedSampler(DATASET, world_size=1, rank=0, global_batch_size=GLOBAL_BATCH
                                        ).epoch_permutation().tolist()
    for step, indices in by_step.items():  # how a step's batch is split over the ranks varies; the batch does not
        assert sorted(indices) == sorted(epoch[(step - 1) * GLOBAL_BATCH:step * GLOBAL_BATCH]), step

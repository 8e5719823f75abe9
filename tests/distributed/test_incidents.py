"""Public resume bugs, replayed: the naive step shows the reported symptom, the trainer does not.

Each test has two halves, both real. The first runs a naive version of the step the bug
lived in (`tests/incidents_naive.py`) and asserts the symptom that was reported, so the
test fails if the replay ever stops reproducing it. The second runs the trainer's own code
path on the same situation and asserts the symptom is absent.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from incidents_naive import PerRankLoaderState, cached_state_dict_worker, learning_rates, resumed_epoch_batches
from launch import Run, free_port, run_ranks, train_ok
from sample_logs import trained_by_step
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from reference_impl.data import ResumableDistributedSampler
from reference_impl.step import build_scheduler

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

MLP = ["--model", "mlp", "--log-every", "1", "--pg-timeout-s", "60"]


def by_step(run: Run, key: str) -> dict[int, Any]:
    """`key` of each step event, by step; a step trained again after a restore keeps its last value."""
    return {e["step"]: e[key] for e in run.of("step")}


def restored_steps(run: Run) -> list[int]:
    return [e["step"] for e in run.of("checkpoint_restored")]


# pytorch/torchtitan#1136 ------------------------------------------------------------------
UNEVEN = [*MLP, "--strategy", "fsdp", "--num-classes", "11", "--dataset-size", "256", "--micro-batch-size", "8",
          "--warmup-steps", "2", "--max-steps", "6", "--checkpoint-every", "2"]  # 11 rows over 2 ranks: 6 + 5


@pytest.mark.slow
def test_torchtitan_1136_a_cached_state_dict_saves_stale_weights_ours_resumes_to_the_same_loss(
        tmp_path: Path) -> None:
    run_ranks(cached_state_dict_worker, (2, free_port(), str(tmp_path)), nprocs=2, timeout=180)
    naive = json.loads((tmp_path / "result.json").read_text())
    assert "2.weight" in naive["stale"], "the unevenly sharded weight was saved as it was before training"
    assert naive["resumed_loss"] != naive["live_loss"], "a resume from that save does not continue the run"

    reference = train_ok(UNEVEN, tmp_path / "reference")
    resumed = train_ok(UNEVEN, tmp_path / "resumed", "--fail-at-step", "5", "--fail-rank", "1", restarts=1)
    assert restored_steps(resumed) == [4]
    assert by_step(resumed, "loss") == by_step(reference, "loss"), "every loss, the resumed steps included"
    assert resumed.digest() == reference.digest()


# pytorch/torchtitan#811 -------------------------------------------------------------------
GLOBAL_BATCH, DATASET = 12, 96  # 12 = 2 x 6 = 3 x 4: the same global batch at both world sizes


def test_torchtitan_811_per_rank_loader_state_cannot_follow_a_world_size_change_ours_does(tmp_path: Path) -> None:
    saved: dict[str, int] = {}
    trained = []
    for rank in range(2):  # 3 steps at world size 2, 6 samples per rank per step
        state = PerRankLoaderState(DATASET, world_size=2, rank=rank)
        trained += state.take(3 * 6)
        saved.update(state.state_dict())
    with pytest.raises(KeyError, match="dp_rank_2"):  # more ranks: the new one has no entry
        PerRankLoaderState(DATASET, world_size=3, rank=2).load_state_dict(saved)
    one = PerRankLoaderState(DATASET, world_size=1, rank=0)  # fewer ranks: loads, silently wrong
    one.load_state_dict(saved)
    trained += one.take(3 * GLOBAL_BATCH)
    assert len(set(trained)) < len(trained), "samples trained twice after the change"

    log, ckpt = tmp_path / "samples", tmp_path / "ckpt"
    base = [*MLP, "--dataset-size", str(DATASET), "--warmup-steps", "2", "--checkpoint-every", "4",
            "--sample-log", str(log)]
    train_ok([*base, "--micro-batch-size", "6", "--max-steps", "4"], ckpt, nproc=2)
    grown = train_ok([*base, "--micro-batch-size", "4", "--max-steps", "8", "--allow-config-change", "max_steps"],
                     ckpt, nproc=3)
    assert restored_steps(grown) == [4]
    steps = trained_by_step(log)
    assert sorted(steps) == list(range(1, 9))
    everything = [i for step in steps.values() for i in step]
    assert len(everything) == len(set(everything)) == 8 * GLOBAL_BATCH, "no sample twice, none skipped"
    perm = ResumableDistributedSampler(DATASET, world_size=1, rank=0, global_batch_size=GLOBAL_BATCH
                                       ).epoch_permutation().tolist()
    for step, indices in steps.items():  # each step trains its block of the epoch, at either world size
        assert sorted(indices) == sorted(perm[(step - 1) * GLOBAL_BATCH:step * GLOBAL_BATCH]), step


# Lightning-AI/pytorch-lightning#7637 -------------------------------------------------------
SCHEDULE = [*MLP, "--dataset-size", "256", "--micro-batch-size", "8", "--warmup-steps", "3", "--max-steps", "8",
            "--checkpoint-every", "4"]


@pytest.mark.slow
def test_lightning_7637_a_checkpoint_before_the_scheduler_step_lags_one_rate_ours_keeps_every_rate(
        tmp_path: Path) -> None:
    cfg = SimpleNamespace(warmup_steps=3, max_steps=10, min_lr_ratio=0.1)

    def fresh() -> tuple[Any, torch.optim.Optimizer]:
        optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1.0)
        return build_scheduler(optimizer, cfg), optimizer  # type: ignore[arg-type]

    uninterrupted, _ = learning_rates(*fresh(), range(1, 11))
    _, checkpoint = learning_rates(*fresh(), range(1, 5), save_at=4)
    assert checkpoint is not None
    scheduler, optimizer = fresh()  # the restart
    optimizer.load_state_dict(checkpoint["optimizer"])
    scheduler.load_state_dict(checkpoint["scheduler"])
    resumed, _ = learning_rates(scheduler, optimizer, range(5, 11))
    assert resumed == uninterrupted[3:9] != uninterrupted[4:10], "each resumed step runs the previous step's rate"

    reference = train_ok(SCHEDULE, tmp_path / "reference")
    resumed_run = train_ok(SCHEDULE, tmp_path / "resumed", "--fail-at-step", "6", "--fail-rank", "1", restarts=1)
    assert restored_steps(resumed_run) == [4]
    rates = by_step(reference, "lr")  # the rate the next step will use
    assert all(rates[step] != rates[step + 1] for step in range(4, 8)), "a lag of one step would show"
    assert by_step(resumed_run, "lr") == rates
    assert by_step(resumed_run, "loss") == by_step(reference, "loss")


# Lightning-AI/pytorch-lightning#21938 ------------------------------------------------------
EPOCHS = [*MLP, "--dataset-size", "48", "--micro-batch-size", "4", "--num-workers", "2", "--warmup-steps", "2",
          "--max-steps", "9", "--checkpoint-every", "6"]  # 2 ranks x 4 = 8 per step: 6 steps per epoch


@pytest.mark.slow
def test_lightning_21938_an_iterator_made_before_set_epoch_replays_epoch_0_ours_resumes_the_right_epoch(
        tmp_path: Path) -> None:
    data = TensorDataset(torch.arange(32))
    sampler: DistributedSampler[Any] = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    order = {}
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        order[epoch] = list(sampler)
    assert order[0] != order[1]
    for workers, drawn in ((2, order[0]), (0, order[1])):  # workers prefetch when the iterator is made
        sampler.set_epoch(0)  # the fresh process
        loader = DataLoader(data, batch_size=4, sampler=sampler, num_workers=workers)
        trained = [int(i) for (batch,) in resumed_epoch_batches(loader, sampler, epoch=1) for i in batch]
        assert trained == drawn, f"{workers} workers"

    logs = {name: tmp_path / f"{name}-samples" for name in ("reference", "resumed")}
    reference = train_ok([*EPOCHS, "--sample-log", str(logs["reference"])], tmp_path / "reference")
    resumed = train_ok([*EPOCHS, "--sample-log", str(logs["resumed"])], tmp_path / "resumed",
                       "--fail-at-step", "8", "--fail-rank", "0", restarts=1)
    assert restored_steps(resumed) == [6], "the last step of epoch 0"
    assert trained_by_step(logs["resumed"]) == trained_by_step(logs["reference"])
    ours = ResumableDistributedSampler(48, world_size=1, rank=0, global_batch_size=8)
    ours.set_epoch(1)
    epoch1 = ours.epoch_permutation().tolist()
    for step in (7, 8, 9):
        assert sorted(trained_by_step(logs["resumed"])[step]) == sorted(epoch1[(step - 7) * 8:(step - 6) * 8]), step
    assert resumed.digest() == reference.digest()

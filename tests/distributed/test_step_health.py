"""Stragglers and non-finite losses on two gloo ranks: the slowed rank is named once, a clean
run names none; the rank, step and module of an injected NaN are named; `skip` drops exactly
that update on every rank; `rollback` ends where an uninterrupted run ends.

Jobs run as forked ranks in a real gloo group (`launch.forked_ranks`), one under real torchrun.
No timing is asserted: the injected sleep is many times a step of this tiny model, and the
clean run is judged by the detector's own noise rule.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import launch
from checkpoints import published
from reference_impl.checkpoint.files import load_weights_only
from reference_impl.config import TrainConfig
from reference_impl.launch import Run

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

BASE = ["--micro-batch-size", "8", "--dataset-size", "512", "--hidden-dim", "32", "--warmup-steps", "2",
        "--log-every", "5", "--pg-timeout-s", "60"]
DEFAULTS = TrainConfig()
# From the step the sleep starts, a straggler is reported once `patience` whole windows were
# slow; the window the sleep starts in may be partly fast, and so may not count.
REPORT_WITHIN = DEFAULTS.straggler_window * (DEFAULTS.straggler_patience + 1)
POISONED = "net.2"  # the MLP's middle linear layer: `faults.poison_target` of the MLP


def job(steps: int, *flags: str) -> Run:
    return launch.forked_ranks([*BASE, "--max-steps", str(steps), *flags], nproc=2, timeout=240)


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Path]:
    """An uninterrupted 40-step run with checkpoints every 5 steps and a sample log."""
    root = tmp_path_factory.mktemp("clean")
    run = job(40, "--checkpoint-dir", str(root / "ckpt"), "--checkpoint-every", "5",
              "--sample-log", str(root / "samples"))
    assert run.returncode == 0, run.stderr[-3000:]
    return run, root


def test_a_clean_run_names_no_straggler(clean: tuple[Run, Path]) -> None:
    run, _ = clean
    assert run.of("straggler") == [], run.of("straggler")
    assert run.of("nonfinite") == [] and run.of("step_skipped") == []


def test_a_slowed_rank_is_named_once_under_torchrun(tmp_path: Path) -> None:
    run = launch.torchrun([*BASE, "--max-steps", "25", "--fail-mode", "slow", "--fail-at-step", "4",
                           "--fail-rank", "1", "--fail-slow-s", "0.25"], timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert_one_straggler(run, rank=1, since=4)


def test_a_slowed_rank_0_is_named_and_not_its_waiting_peer() -> None:
    run = job(25, "--fail-mode", "slow", "--fail-at-step", "7", "--fail-rank", "0", "--fail-slow-s", "0.25")
    assert run.returncode == 0, run.stderr[-3000:]
    assert_one_straggler(run, rank=0, since=7)


def assert_one_straggler(run: Run, rank: int, since: int) -> None:
    events = run.of("straggler")
    assert len(events) == 1, events
    event = events[0]
    assert event["rank"] == rank, event
    assert since <= event["step"] <= since + REPORT_WITHIN, event
    assert event["slowdown"] >= DEFAULTS.straggler_threshold, event


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])  # FSDP: the replay's all-gathers run on every rank
def test_a_nan_stops_the_run_naming_rank_step_and_module(strategy: str, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run = job(20, "--fail-mode", "nan", "--fail-at-step", "8", "--fail-rank", "1", "--strategy", strategy,
              "--checkpoint-dir", str(ckpt), "--checkpoint-every", "5")
    assert run.returncode == 1
    assert [(e["rank"], e["step"], e["module"]) for e in run.of("nonfinite")] == [(1, 8, POISONED)]
    assert {e["error"] for e in run.of("error")} == {"NonFiniteLoss"}, "every rank halts on the same step"
    assert run.stderr.strip().splitlines() == ["reference_impl.train: error: non-finite loss on rank 1 at step 8; "
                                               "halting before it is checkpointed"]
    assert [p.name for p in published(ckpt)] == ["step-00000005"], "no checkpoint holds the poisoned step"


def test_skip_drops_exactly_that_update_on_every_rank(tmp_path: Path) -> None:
    """Checkpoints after steps 5, 6 and 7: the update of step 6 was dropped, so its model,
    optimizer and schedule equal step 5's bit for bit, while step 7 moved on; the samples of
    step 6 are logged as skipped on both ranks; every weight is finite at the end."""
    ckpt, samples = tmp_path / "ckpt", tmp_path / "samples"
    run = job(7, "--fail-mode", "nan", "--fail-at-step", "6", "--fail-rank", "0", "--nonfinite-policy", "skip",
              "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1", "--keep-last", "3",
              "--sample-log", str(samples))
    assert run.returncode == 0, run.stderr[-3000:]
    assert [(e["rank"], e["step"], e["module"]) for e in run.of("nonfinite")] == [(0, 6, POISONED)]
    assert [(e["step"], e["ranks"]) for e in run.of("step_skipped")] == [(6, [0])]
    five, six, seven = (load_weights_only(ckpt / f"step-0000000{s}" / "train.pt") for s in (5, 6, 7))
    for part in ("model", "optimizer", "scheduler"):
        assert same(five[part], six[part]), f"the skipped step changed the {part}"
        assert not same(six[part], seven[part]), f"step 7 left the {part} as it was: the comparison sees nothing"
    assert six["sampler"] != five["sampler"], "the skipped step's samples were consumed, not replayed"
    assert all(torch.isfinite(t).all() for t in seven["model"].values())
    for rank in (0, 1):
        entries = [json.loads(line) for line in (samples / f"rank{rank}.jsonl").read_text().splitlines()]
        assert [e["step"] for e in entries] == list(range(1, 8))
        assert [e["step"] for e in entries if e.get("skipped")] == [6], entries


def test_rollback_ends_with_the_digest_of_an_uninterrupted_run(clean: tuple[Run, Path], tmp_path: Path) -> None:
    """A transient NaN at step 13 on rank 1: both ranks restore step 10 and train 11-40 again.
    Model, optimizer, RNG streams and data order all come back, so the end is bit-identical,
    and the sample log describes the same history as the uninterrupted run's."""
    straight, root = clean
    samples = tmp_path / "samples"
    run = job(40, "--fail-mode", "nan", "--fail-at-step", "13", "--fail-rank", "1",
              "--nonfinite-policy", "rollback", "--checkpoint-dir", str(tmp_path / "ckpt"),
              "--checkpoint-every", "5", "--sample-log", str(samples))
    assert run.returncode == 0, run.stderr[-3000:]
    assert [(e["rank"], e["step"], e["module"]) for e in run.of("nonfinite")] == [(1, 13, POISONED)]
    assert [(e["step"], e["restored_step"]) for e in run.of("rollback")] == [(13, 10)]
    assert run.digest() == straight.digest()
    for rank in (0, 1):
        name = f"rank{rank}.jsonl"
        assert (samples / name).read_text() == (root / "samples" / name).read_text()


def test_a_nan_that_repeats_after_rollback_stops_the_run(tmp_path: Path) -> None:
    """A learning rate of 1e30 makes every step after the first non-finite: rolling back to
    step 1 cannot help, so the second failure of step 2 stops the run instead of looping."""
    run = launch.python_module([*BASE, "--max-steps", "10", "--optimizer", "sgd", "--lr", "1e30", "--grad-clip", "0",
                                "--warmup-steps", "0", "--nonfinite-policy", "rollback",
                                "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "1"])
    assert run.returncode == 1
    assert [(e["step"], e["restored_step"]) for e in run.of("rollback")] == [(2, 1)]
    assert [e["step"] for e in run.of("nonfinite")] == [2, 2]
    assert "again after rolling back" in run.stderr


def same(a: Any, b: Any) -> bool:
    """Equal structure and values, tensors compared bit for bit (NaN equal to NaN)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(bits(a), bits(b)))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return bool(a == b)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, so that equal NaNs compare equal and -0.0 differs from 0.0."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8)

"""Read what `--sample-log` recorded: the dataset indices each rank trained, by step."""

from __future__ import annotations

import json
from pathlib import Path

from reference_impl.data import ResumableDistributedSampler
from reference_impl.launch import Run


def losses(run: Run) -> list[float]:
    """The loss of every `step` event, in order."""
    return [e["loss"] for e in run.of("step")]


def rank_log(log: Path, rank: int) -> dict[int, list[int]]:
    """One rank's trained indices, by committed step (a step whose update was skipped
    trained nothing, so it is left out)."""
    return {entry["step"]: entry["indices"]
            for entry in map(json.loads, (log / f"rank{rank}.jsonl").read_text().splitlines())
            if not entry.get("skipped")}


def trained_by_step(log: Path, ranks: list[int] | None = None) -> dict[int, list[int]]:
    """Indices trained at each step, over the given ranks' logs (every rank's by default)."""
    ranks = ranks if ranks is not None else sorted(int(f.stem[4:]) for f in log.glob("rank*.jsonl"))
    by_step: dict[int, list[int]] = {}
    for rank in ranks:
        for step, indices in rank_log(log, rank).items():
            by_step.setdefault(step, []).extend(indices)
    return by_step


def assert_trained_once_in_order(log: Path, ranks: list[int], steps: int, global_batch: int,
                                 dataset_size: int) -> None:
    """Steps 1..`steps` in the logs of `ranks` (one per data-parallel group) trained the
    epoch's first `steps` global batches: every sample once, none skipped, in order."""
    by_step = trained_by_step(log, ranks)
    assert sorted(by_step) == list(range(1, steps + 1))
    trained = [i for step in sorted(by_step) for i in by_step[step]]
    assert len(trained) == len(set(trained)) == steps * global_batch, "no sample twice, none skipped"
    perm = ResumableDistributedSampler(dataset_size, world_size=1, rank=0,
                                       global_batch_size=global_batch).epoch_permutation()
    assert trained == perm[:steps * global_batch].tolist(), "the epoch's first global batches, in order"

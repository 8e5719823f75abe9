"""Read what `--sample-log` recorded: the dataset indices each rank trained, by step."""

from __future__ import annotations

import json
from pathlib import Path

from reference_impl.launch import Run


def losses(run: Run) -> list[float]:
    """The loss of every `step` event, in order."""
    return [e["loss"] for e in run.of("step")]


def rank_log(log: Path, rank: int) -> dict[int, list[int]]:
    """One rank's trained indices, by committed step."""
    return {entry["step"]: entry["indices"]
            for entry in map(json.loads, (log / f"rank{rank}.jsonl").read_text().splitlines())}


def trained_by_step(log: Path, ranks: list[int] | None = None) -> dict[int, list[int]]:
    """Indices trained at each step, over the given ranks' logs (every rank's by default)."""
    ranks = ranks if ranks is not None else sorted(int(f.stem[4:]) for f in log.glob("rank*.jsonl"))
    by_step: dict[int, list[int]] = {}
    for rank in ranks:
        for step, indices in rank_log(log, rank).items():
            by_step.setdefault(step, []).extend(indices)
    return by_step

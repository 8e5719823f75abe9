"""The sample log (`--sample-log D`): each rank's dataset indices of every committed step.

It records what the sampler of `reference_impl.data` handed out and the step trained, so a
test can prove every sample was trained exactly once across restarts and world sizes.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import torch
import torch.distributed as dist

from reference_impl.config import ConfigError
from reference_impl.distributed import DistContext


class SampleLog:
    """Appends, per rank, the dataset indices of every committed optimizer step (JSONL).

    At every start the log is cut back to the restored step (0 without a checkpoint), so
    it always describes the training history the final model actually went through,
    replays included once.
    """

    def __init__(self, directory: str | None, ctx: DistContext) -> None:
        self.path = Path(directory) / f"rank{ctx.rank}.jsonl" if directory else None
        self.ctx = ctx
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, step: int, epoch: int, indices: list[torch.Tensor], skipped: bool = False) -> None:
        """Record the samples of one committed step; `skipped` marks a step whose update was
        dropped (its samples were read, never learned from)."""
        if self.path:
            entry = {"step": step, "epoch": epoch, "indices": torch.cat(indices).tolist()}
            with self.path.open("a") as f:
                f.write(json.dumps({**entry, "skipped": True} if skipped else entry) + "\n")

    def truncate(self, step: int) -> None:
        """Drop the entries after `step` (steps that will be trained again), for every rank.

        Rank 0 cuts the file of every rank that ever wrote, not only the live ones: after
        a change to a smaller world size, a departed rank's entries for replayed steps
        would otherwise stay. The barrier keeps every rank from appending before that.
        """
        if not self.path:
            return
        if self.ctx.is_main:
            for file in sample_log_files(self.path.parent):
                keep = [line for line in file.read_text().splitlines() if line and _logged_step(file, line) <= step]
                tmp = file.with_suffix(".tmp")
                tmp.write_text("".join(line + "\n" for line in keep))
                os.replace(tmp, file)
        if self.ctx.distributed:
            dist.barrier()


def sample_log_files(directory: Path) -> list[Path]:
    """Every rank's file in a sample log directory, each a regular file.

    Raises:
        ConfigError: A `rank*.jsonl` entry is a directory, a link, a FIFO or a device
            (opening a FIFO to read it would wait forever for a writer).
    """
    files = sorted(directory.glob("rank*.jsonl"))
    for file in files:
        if not stat.S_ISREG(file.lstat().st_mode):
            raise ConfigError(f"sample_log {directory} holds {file.name}, which is not a regular file")
    return files


def _logged_step(file: Path, line: str) -> int:
    """The step of one sample log entry.

    Raises:
        ConfigError: The line is not an entry this log writes.
    """
    try:
        step = json.loads(line)["step"]
    except (ValueError, TypeError, KeyError):
        step = None
    if type(step) is not int:
        raise ConfigError(f"sample_log {file} holds a line that is not a sample log entry: {line[:60]!r}")
    return step

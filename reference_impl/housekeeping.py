"""Housekeeping of a checkpoint directory: deleting safely, retention on restore, the
leftovers of crashed writers, and the progress note that counts replayed steps."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from reference_impl.checkpoint_validate import CheckpointError, published
from reference_impl.config import TrainConfig
from reference_impl.distributed import DistContext
from reference_impl.metrics import EventLog

PROGRESS = "progress.json"


def remove(path: Path) -> None:
    """Delete a file, a link (never what it points to) or a directory tree."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def record_progress(cfg: TrainConfig, ctx: DistContext, step: int) -> None:
    """Rank 0 notes the furthest step reached, to count the steps a restart replays.

    Raises:
        CheckpointError: The note cannot be written (a full disk), as for a failed save.
    """
    if not (ctx.is_main and cfg.checkpoint_dir):
        return
    root = Path(cfg.checkpoint_dir)
    tmp = root / f".{PROGRESS}.{os.getpid()}.tmp"
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"step": step}))
        os.replace(tmp, root / PROGRESS)
    except OSError as exc:
        remove(tmp)
        raise CheckpointError(f"recording progress (step {step}) in {root} failed: {exc}; "
                              "published checkpoints are untouched") from exc


def remove_debris(root: Path) -> None:
    """Delete the temporary files of earlier writers (crashed saves, progress notes).

    Call only while holding the directory's lock: then no other writer is alive.
    """
    if root.is_dir():
        for path in root.iterdir():
            if path.name.startswith(".tmp-step-") or (path.name.startswith(f".{PROGRESS}.")
                                                     and path.name.endswith(".tmp")):
                remove(path)


def steps_replayed(root: Path, restored: int) -> int:
    """Steps between the restored one and the furthest one recorded: work a restart redoes."""
    try:
        reached = int(json.loads((root / PROGRESS).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    return max(0, reached - restored)


def prune(root: Path, restored: Path, keep_last: int, log: EventLog) -> None:
    """Apply retention before training: keep `restored` and the newest older ones.

    A relaunch with a smaller `keep_last` frees room before its first save, which a
    full disk needs; newer entries that failed validation are left for inspection.
    """
    older = [p for p in published(root) if p.name < restored.name][max(keep_last - 1, 0):]
    for path in older:
        remove(path)
    if older:
        log.progress("checkpoints_pruned", paths=[str(p) for p in older], keep_last=keep_last)

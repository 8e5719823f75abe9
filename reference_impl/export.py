"""Export the newest valid checkpoint as one consolidated, weights-only model file.

    python -m reference_impl.export CHECKPOINT_DIR OUT.pt

The output holds `{"model": state_dict, "step": N, "resume_fields": {...}}` with full
(unsharded) tensors, so it loads into a plain `nn.Module` outside FSDP and outside any
process group, with `torch.load(OUT, weights_only=True)`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import stat
import sys
from pathlib import Path

from reference_impl.checkpoint import CheckpointError, CheckpointManager, Chosen
from reference_impl.checkpoint.files import fsync_dir, remove
from reference_impl.checkpoint.layouts import LAYOUTS
from reference_impl.checkpoint.publish import write_file
from reference_impl.metrics import EventLog

# A run that saves every step can publish a newer checkpoint and prune the one just
# listed before it is pinned: then the listing is taken again, a bounded number of times.
ATTEMPTS = 5


def export(checkpoint_dir: Path, out: Path, log: EventLog | None = None) -> Path:
    """Write the newest valid checkpoint's model to `out` atomically and return its source.

    The checkpoint is chosen by the same rules as a restore (`checkpoint_skipped` events
    go to `log`, stderr by default) and stays pinned while it is read, so a run that is
    still saving into `checkpoint_dir` cannot prune it mid-read.

    Raises:
        CheckpointError: `out` is a directory, a link, a device or anything else that is not a
            regular file, or is inside `checkpoint_dir` (whose files belong to the run that
            writes them); no published checkpoint is valid; or writing `out` failed (nothing
            is left behind but what `out` held before).
    """
    check_target(out)
    if out.resolve().is_relative_to(checkpoint_dir.resolve()):
        raise CheckpointError(f"{out} is inside {checkpoint_dir}; write the export elsewhere")
    with contextlib.ExitStack() as pins:
        path, manifest, saved = choose_pinned(CheckpointManager(checkpoint_dir, log or EventLog(0, sys.stderr)), pins)
        # The layout that wrote the checkpoint merges its model in memory: nothing is written
        # inside the checkpoint directory (it belongs to the run that writes it).
        model = LAYOUTS[manifest["layout"]].full_model(path, saved)
    payload = {"model": model, "step": manifest["step"],
               "resume_fields": manifest["resume_fields"]}
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")  # unique per writer
    try:
        write_file(tmp, payload)  # fsynced: the rename below never publishes a torn file
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except OSError as exc:
        with contextlib.suppress(OSError):  # e.g. ENOTDIR: there is nothing to remove
            remove(tmp)
        raise CheckpointError(f"writing {out} failed: {exc.strerror or exc}") from exc
    return path


def check_target(out: Path) -> None:
    """Refuse an existing `out` that is not a regular file: the rename would replace it.

    `/dev/stdout` is a link and `/dev/full` a device; as root, renaming a file over
    them replaces the system's own.

    Raises:
        CheckpointError: Naming what `out` is.
    """
    try:
        mode = out.lstat().st_mode
    except OSError:  # missing, or its parent is no directory: the write says why
        return
    if stat.S_ISDIR(mode):
        raise CheckpointError(f"{out} is a directory; give the file to write")
    if not stat.S_ISREG(mode):
        what = ("a symbolic link" if stat.S_ISLNK(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
        raise CheckpointError(f"{out} is {what}; export replaces only a regular file")


def choose_pinned(manager: CheckpointManager, pins: contextlib.ExitStack) -> Chosen:
    """The newest valid checkpoint, pinned in `pins`; listed again while newer ones appear.

    Raises:
        CheckpointError: No published checkpoint is valid.
    """
    for _ in range(ATTEMPTS):
        listed = manager.steps()[:1]
        chosen = manager.choose(pins=pins)
        if chosen is not None:
            return chosen
        if manager.steps()[:1] == listed:  # nothing newer was published meanwhile
            break
    raise CheckpointError(f"no valid checkpoint under {manager.root}")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; exits 2 when there is nothing valid to export or `out` cannot be written."""
    parser = argparse.ArgumentParser(prog="python -m reference_impl.export", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint_dir", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    try:
        source = export(args.checkpoint_dir, args.out)
    except CheckpointError as exc:
        print(f"reference_impl.export: error: {exc}", file=sys.stderr)
        return 2
    print(f"exported {source} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

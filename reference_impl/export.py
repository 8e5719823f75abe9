"""Export the newest valid checkpoint as one consolidated, weights-only model file.

    python -m reference_impl.export CHECKPOINT_DIR OUT.pt

The output holds `{"model": state_dict, "step": N, "resume_fields": {...}}` with full
(unsharded) tensors, so it loads into a plain `nn.Module` outside FSDP and outside any
process group, with `torch.load(OUT, weights_only=True)`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from reference_impl.checkpoint import CheckpointError, CheckpointManager
from reference_impl.checkpoint.layouts import LAYOUTS
from reference_impl.metrics import EventLog


def export(checkpoint_dir: Path, out: Path, log: EventLog | None = None) -> Path:
    """Write the newest valid checkpoint's model to `out` atomically and return its source.

    The checkpoint is chosen by the same rules as a restore (`checkpoint_skipped` events
    go to `log`, stderr by default).

    Raises:
        CheckpointError: No published checkpoint is valid.
    """
    chosen = CheckpointManager(checkpoint_dir, log or EventLog(0, sys.stderr)).choose()
    if chosen is None:
        raise CheckpointError(f"no valid checkpoint under {checkpoint_dir}")
    path, manifest, saved = chosen
    # The layout that wrote the checkpoint merges its model in memory: nothing is written
    # inside the checkpoint directory (it belongs to the run that writes it).
    model = LAYOUTS[manifest["layout"]].full_model(path, saved)
    payload = {"model": model, "step": manifest["step"],
               "resume_fields": manifest["resume_fields"]}
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")  # unique per writer
    torch.save(payload, tmp)
    os.replace(tmp, out)
    return path


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; exits 2 when there is nothing valid to export."""
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

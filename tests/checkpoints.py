"""Test helpers that look into a checkpoint directory through the manager's own rules."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

from reference_impl.checkpoint import CheckpointManager
from reference_impl.checkpoint import manifest as manifests
from reference_impl.metrics import EventLog


def manager(root: Path, keep_last: int = 1) -> CheckpointManager:
    """A manager of `root` whose events go nowhere."""
    return CheckpointManager(root, EventLog(0, io.StringIO()), keep_last)


def published(root: Path) -> list[Path]:
    """Every entry named like a published checkpoint, newest first."""
    return [path for _, path in manager(root).steps()]


def verify(path: Path) -> dict[str, Any]:
    """The manifest of `path` once every file it lists has verified (raises `CheckpointError`)."""
    manifest = manifests.read_manifest(path)
    manifests.verify(path, manifest)
    return manifest


class RunsCode:
    """Unpickling this runs `touch marker`: what a crafted checkpoint (or peer) would do."""

    def __init__(self, marker: Path | str) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))

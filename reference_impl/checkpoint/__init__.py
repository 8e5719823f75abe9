"""Checkpoints: one `CheckpointManager` owns a checkpoint directory.

The modules, each importing only those above it:

* `files`: the directory as untrusted input (no link followed, no blocking open, size caps, modes).
* `integrity`: the checksums in a manifest.
* `dcp_safe`: reading DCP metadata and shards without running code or leaving the directory.
* `staging`: an async save's copy of host state, into buffers reused across saves.
* `fit`: whether intact contents fit the objects a restore loads them into.
* `layouts`: where model and optimizer state go (`torch_save`, `dcp`), and async DCP saves.
* `manifest`: what a checkpoint must satisfy before any byte of it is used.
* `publish`: writing files, the manifest and the atomic rename.
* `lock`: one writer per directory.
* `manager`: `CheckpointManager`: lock, save, restore, retention.
"""

from reference_impl.checkpoint.files import CheckpointError
from reference_impl.checkpoint.layouts import AsyncSaver
from reference_impl.checkpoint.manager import CheckpointManager, Chosen
from reference_impl.checkpoint.manifest import IncompatibleCheckpoint

__all__ = ["AsyncSaver", "CheckpointError", "CheckpointManager", "Chosen", "IncompatibleCheckpoint"]

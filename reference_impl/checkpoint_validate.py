"""A checkpoint directory is untrusted input: what must hold before any byte of it is used.

Anything can sit under `--checkpoint-dir`: a torn save, a manifest edited by hand, a
symbolic link into another tree, a file copied in from another run. A step directory
counts only when

* it is a real directory (not a symbolic link) named `step-NNNNNNNN`;
* its `manifest.json` is a JSON object of the expected shape, whose `step` is the
  number in the directory's name;
* every file the restore needs (`train.pt`, one `rank-NNNNN.pt` per saved rank, and
  what its layout requires, such as DCP's `.metadata`) is listed, and every listed name stays inside the directory;
* every listed file is a regular file (no link anywhere on its path) whose size and
  checksums (XXH3-128, or sha256 in older manifests) match the manifest;
* the loaded `train.pt` holds the parts a restore reads, for the manifest's step.

Each check raises `CheckpointError` with the reason; the caller skips that checkpoint,
says why, and tries the next older one.
"""

from __future__ import annotations

import json
import re
from dataclasses import fields
from pathlib import Path, PurePosixPath
from typing import Any

from reference_impl import integrity
from reference_impl.checkpoint_layout import LAYOUTS
from reference_impl.config import STRUCTURAL_FIELDS, TrainConfig

# 2: the `dcp` layout stores optimizer state flattened per parameter name. A checkpoint of
# format 1 is skipped with its reason, and restore falls back past it.
FORMAT = 2
MANIFEST = "manifest.json"
TRAIN_FILE = "train.pt"
STEP_DIR = re.compile(r"^step-(\d{8})$")
# train.pt keys every restore reads; each layout adds its own (`CheckpointLayout.train_keys`).
_TRAIN_KEYS = frozenset({"step", "scheduler", "scaler", "sampler"})


class CheckpointError(RuntimeError):
    """A checkpoint is missing, torn, corrupt, unsafe or cannot be written."""


class IncompatibleCheckpoint(CheckpointError):
    """The checkpoint was written by a run whose step computes something else."""


def rank_file(rank: int) -> str:
    """File name of one rank's private state."""
    return f"rank-{rank:05d}.pt"


def published(root: Path) -> list[Path]:
    """Entries named like a published checkpoint, newest first (temporary ones never match).

    Symbolic links are listed too, so that a restore reports why it skips them.
    """
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.match(p.name) and (p.is_dir() or p.is_symlink())]
    return sorted(found, key=lambda p: p.name, reverse=True)


def _need(ok: bool, reason: str) -> None:
    if not ok:
        raise CheckpointError(reason)


def _is_int(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _check_name(name: Any) -> None:
    """A listed file name must be a plain relative path that stays inside the directory."""
    _need(isinstance(name, str) and name != "", f"manifest lists a file with a non-string name {name!r}")
    parts = PurePosixPath(name).parts
    _need(not name.startswith("/") and "\\" not in name and ".." not in parts
          and "." not in name.split("/") and "" not in name.split("/"),
          f"manifest lists {name!r}, a path outside the checkpoint directory")


def _check_entry(name: str, entry: Any) -> None:
    _need(integrity.algorithm_of(entry) is not None,
          f"manifest entry of {name!r} is not {{'{integrity.ALGORITHM}' (or 'sha256'): hex, 'bytes': int}}")


def required_files(manifest: dict[str, Any]) -> set[str]:
    """The files a restore of this manifest reads, whatever the manifest lists."""
    needed = {TRAIN_FILE, *(rank_file(r) for r in range(manifest["world_size"]))}
    return needed | LAYOUTS[manifest["layout"]].required


def check_manifest(manifest: Any, path: Path) -> dict[str, Any]:
    """Validate the shape of a parsed manifest against its directory; return it.

    Raises:
        CheckpointError: Naming the first field or file that is wrong.
    """
    _need(isinstance(manifest, dict), f"manifest is a JSON {type(manifest).__name__}, not an object")
    _need(manifest.get("format") == FORMAT, f"unknown checkpoint format {manifest.get('format')!r}")
    types = {"step": lambda v: _is_int(v, 0), "epoch": lambda v: _is_int(v, 0),
             "world_size": lambda v: _is_int(v, 1), "layout": lambda v: v in LAYOUTS,
             "config_digest": lambda v: isinstance(v, str),
             "resume_fields": lambda v: isinstance(v, dict), "files": lambda v: isinstance(v, dict) and v}
    for key, valid in types.items():
        _need(key in manifest, f"manifest has no {key!r}")
        _need(bool(valid(manifest[key])), f"manifest field {key!r} is invalid ({manifest[key]!r:.80})")
    named = STEP_DIR.match(path.name)
    _need(named is not None and int(named.group(1)) == manifest["step"],
          f"directory {path.name} holds a manifest of step {manifest['step']}")
    files = manifest["files"]
    _need(manifest["world_size"] <= len(files), f"world size {manifest['world_size']} exceeds the files listed")
    for name, entry in files.items():
        _check_name(name)
        _check_entry(name, entry)
    missing = sorted(required_files(manifest) - set(files))
    _need(not missing, f"required part {', '.join(missing)} is not listed in the manifest")
    return manifest


def read_manifest(path: Path) -> dict[str, Any]:
    """The validated manifest of the step directory `path` (no file is hashed).

    Raises:
        CheckpointError: The directory is a link, or its manifest is missing or malformed.
    """
    _need(not path.is_symlink(), "the step directory is a symbolic link; it is never followed")
    _need(path.is_dir(), "not a directory")
    file = path / MANIFEST
    _need(not file.is_symlink(), "the manifest is a symbolic link")
    try:
        text = file.read_text()
    except FileNotFoundError:
        raise CheckpointError("no manifest: the save never completed") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"unreadable manifest: {exc}") from None
    try:
        manifest = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointError(f"unreadable manifest: {str(exc)[:200]}") from None
    return check_manifest(manifest, path)


def member(path: Path, name: str) -> Path:
    """`path / name`, refusing a symbolic link at any level below `path`."""
    current = path
    for part in PurePosixPath(name).parts:
        current = current / part
        _need(not current.is_symlink(), f"{name} is reached through a symbolic link")
    _need(current.is_file(), f"{name} is missing")
    return current


def verify(path: Path) -> dict[str, Any]:
    """Return the manifest of `path` if it is valid and every file it lists is intact.

    Raises:
        CheckpointError: With the reason the checkpoint cannot be used.
    """
    manifest = read_manifest(path)
    for name, expected in manifest["files"].items():
        if reason := integrity.mismatch(member(path, name), expected):
            raise CheckpointError(f"{name}: {reason}")
    return manifest


def check_contents(manifest: dict[str, Any], saved: Any, rank_states: list[Any]) -> None:
    """The loaded train.pt and rank files hold what a restore reads, for the manifest's step.

    Raises:
        CheckpointError: A part is missing or belongs to another step.
    """
    keys = _TRAIN_KEYS | LAYOUTS[manifest["layout"]].train_keys
    _need(isinstance(saved, dict) and keys <= set(saved), f"{TRAIN_FILE} lacks {sorted(keys)}")
    _need(saved["step"] == manifest["step"],
          f"{TRAIN_FILE} holds step {saved['step']!r}, the manifest says {manifest['step']}")
    _need(isinstance(saved["sampler"], dict), f"{TRAIN_FILE} holds no sampler state")
    for rank, state in enumerate(rank_states):
        _need(isinstance(state, dict) and state.get("rank") == rank and isinstance(state.get("rng"), dict),
              f"{rank_file(rank)} does not hold rank {rank}'s RNG state")


def newest_manifest(root: Path) -> dict[str, Any] | None:
    """The manifest of the newest published checkpoint whose manifest is valid."""
    for path in published(root):
        try:
            return read_manifest(path)
        except CheckpointError:
            continue
    return None


def check_compatible(manifest: dict[str, Any], cfg: TrainConfig) -> None:
    """Refuse to resume when a field that decides what a step computes has changed.

    The message suggests `--allow-config-change` only for fields it can allow, and for
    a changed global batch the micro-batch and accumulation that keep it.

    Raises:
        IncompatibleCheckpoint: Naming each field, its saved and its current value.
    """
    saved, now = manifest["resume_fields"], cfg.resume_fields()
    changed = [k for k in sorted(set(saved) | set(now))
               if saved.get(k) != now.get(k) and k not in cfg.allow_config_change]
    if not changed:
        return
    names = {f.name for f in fields(TrainConfig)}
    allowable = [k for k in changed if k in names and k not in STRUCTURAL_FIELDS]
    fixed = [k for k in changed if k not in allowable and k != "global_batch_size"]
    hints = [f"allow a deliberate change with --allow-config-change {','.join(allowable)}"] if allowable else []
    if "global_batch_size" in changed:
        hints.append(_batch_hint(saved.get("global_batch_size"), cfg))
    if fixed:
        hints.append(f"{', '.join(fixed)} cannot change on resume")
    detail = ", ".join(f"{k}: checkpoint {saved.get(k)!r}, now {now.get(k)!r}" for k in changed)
    raise IncompatibleCheckpoint(f"checkpoint at step {manifest['step']} is incompatible ({detail}); "
                                 + "; ".join(hints))


def _batch_hint(batch: Any, cfg: TrainConfig) -> str:
    """How to keep the checkpoint's global batch at this data-parallel size, if any way exists."""
    world = cfg.data_parallel_size  # tensor-parallel ranks share their samples
    if not isinstance(batch, int) or batch % world:
        return f"the global batch cannot change on resume, and {batch!r} does not split over {world} ranks"
    per_rank = batch // world
    accum = cfg.grad_accum_steps if per_rank % cfg.grad_accum_steps == 0 else 1
    return (f"the global batch cannot change on resume: keep {batch} at world size {world} with "
            f"--micro-batch-size {per_rank // accum} --grad-accum-steps {accum}")

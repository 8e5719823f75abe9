"""A checkpoint's manifest: what must hold before any byte of its directory is used.

Anything can sit under `--checkpoint-dir`: a torn save, a manifest edited by hand, a
symbolic link into another tree, a file copied in from another run. A step directory
counts only when

* it is a real directory (not a symbolic link) named ASCII `step-` and eight ASCII digits;
* its `manifest.json` is a regular file of at most `MANIFEST_CAP` bytes holding a JSON
  object of the expected shape (every field of the expected type, whatever JSON holds),
  whose `step` is the number in the directory's name;
* every file the restore needs (`train.pt`, one `rank-NNNNN.pt` per saved rank, and
  what its layout requires, such as DCP's `.metadata`) is listed, and every listed name
  stays inside the directory;
* every listed file is a regular file (no link anywhere on its path) whose size and
  checksums (XXH3-128, or sha256) match the manifest, and every file the layout reads
  (DCP's shards, as its metadata names them) is among them;
* the loaded `train.pt` holds the parts a restore reads, for the manifest's step.

Each check raises `CheckpointError` with the reason; the manager skips that checkpoint,
says why, and tries the next older one.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from reference_impl.checkpoint import integrity
from reference_impl.checkpoint.files import CheckpointError, check_relative, member, need, read_bounded, step_of
from reference_impl.checkpoint.layouts import LAYOUTS
from reference_impl.config import STRUCTURAL_FIELDS, TrainConfig

# 2: the `dcp` layout stores optimizer state flattened per parameter name. A checkpoint of
# format 1 is skipped with its reason, and restore falls back past it.
FORMAT = 2
MANIFEST = "manifest.json"
MANIFEST_CAP = 64 << 20  # a few hundred bytes per listed file: room for ~100k ranks
TRAIN_FILE = "train.pt"
# train.pt keys every restore reads; each layout adds its own (`CheckpointLayout.train_keys`).
_TRAIN_KEYS = frozenset({"step", "scheduler", "scaler", "sampler"})


class IncompatibleCheckpoint(CheckpointError):
    """The checkpoint was written by a run whose step computes something else."""


def rank_file(rank: int) -> str:
    """File name of one rank's private state."""
    return f"rank-{rank:05d}.pt"


def _is_int(value: Any, minimum: int) -> bool:
    return type(value) is int and value >= minimum


_FIELDS = {"step": lambda v: _is_int(v, 0), "epoch": lambda v: _is_int(v, 0),
           "world_size": lambda v: _is_int(v, 1), "layout": lambda v: isinstance(v, str) and v in LAYOUTS,
           "config_digest": lambda v: isinstance(v, str),
           "resume_fields": lambda v: isinstance(v, dict), "files": lambda v: isinstance(v, dict) and bool(v)}


def required_files(manifest: dict[str, Any]) -> set[str]:
    """The files a restore of this (shape-checked) manifest reads, whatever the manifest lists."""
    needed = {TRAIN_FILE, *(rank_file(r) for r in range(manifest["world_size"]))}
    return needed | LAYOUTS[manifest["layout"]].required


def check_manifest(manifest: Any, path: Path) -> dict[str, Any]:
    """Validate the shape of a parsed manifest against its directory; return it.

    Raises:
        CheckpointError: Naming the first field or file that is wrong.
    """
    need(isinstance(manifest, dict), f"manifest is a JSON {type(manifest).__name__}, not an object")
    need(manifest.get("format") == FORMAT and type(manifest.get("format")) is int,
         f"unknown checkpoint format {manifest.get('format')!r:.80}")
    for key, valid in _FIELDS.items():
        need(key in manifest, f"manifest has no {key!r}")
        need(bool(valid(manifest[key])), f"manifest field {key!r} is invalid ({manifest[key]!r:.80})")
    need(step_of(path.name) == manifest["step"], f"directory {path.name} holds a manifest of step {manifest['step']}")
    files = manifest["files"]
    need(manifest["world_size"] <= len(files), f"world size {manifest['world_size']} exceeds the files listed")
    for name, entry in files.items():
        check_relative(name)
        need(integrity.algorithm_of(entry) is not None,
             f"manifest entry of {name!r:.120} is not {{'{integrity.ALGORITHM}' (or 'sha256'): hex, 'bytes': int}}")
    missing = sorted(required_files(manifest) - set(files))
    need(not missing, f"required part {', '.join(missing[:3])} is not listed in the manifest")
    return manifest


def read_manifest(path: Path) -> dict[str, Any]:
    """The validated manifest of the step directory `path` (no other file is read).

    Raises:
        CheckpointError: The directory is a link, or its manifest is missing, not a
            regular file, too large or malformed.
    """
    need(not path.is_symlink(), "the step directory is a symbolic link; it is never followed")
    need(path.is_dir(), "not a directory")
    try:
        text = read_bounded(path / MANIFEST, MANIFEST_CAP)
    except CheckpointError as exc:
        if not (path / MANIFEST).exists() and not (path / MANIFEST).is_symlink():
            raise CheckpointError("no manifest: the save never completed") from None
        raise CheckpointError(f"unusable manifest: {exc}") from None
    try:
        manifest = json.loads(text)
    except (ValueError, RecursionError) as exc:  # bad JSON, bad UTF-8, nesting too deep
        raise CheckpointError(f"unreadable manifest: {str(exc)[:200]}") from None
    return check_manifest(manifest, path)


def verify(path: Path, manifest: dict[str, Any]) -> None:
    """Check that every file `manifest` lists is intact, and the layout reads no other.

    Raises:
        CheckpointError: With the reason the checkpoint cannot be used.
    """
    for name, expected in manifest["files"].items():
        if reason := integrity.mismatch(member(path, name), expected):
            raise CheckpointError(f"{name}: {reason}")
    LAYOUTS[manifest["layout"]].check_files(path, set(manifest["files"]))


def check_contents(manifest: dict[str, Any], saved: Any, rank_states: list[Any]) -> None:
    """The loaded train.pt and rank files hold what a restore reads, for the manifest's step.

    Raises:
        CheckpointError: A part is missing or belongs to another step.
    """
    keys = _TRAIN_KEYS | LAYOUTS[manifest["layout"]].train_keys
    need(isinstance(saved, dict) and keys <= set(saved), f"{TRAIN_FILE} lacks {sorted(keys)}")
    need(saved["step"] == manifest["step"],
         f"{TRAIN_FILE} holds step {saved['step']!r:.40}, the manifest says {manifest['step']}")
    need(isinstance(saved["sampler"], dict), f"{TRAIN_FILE} holds no sampler state")
    for rank, state in enumerate(rank_states):
        need(isinstance(state, dict) and state.get("rank") == rank and isinstance(state.get("rng"), dict),
             f"{rank_file(rank)} does not hold rank {rank}'s RNG state")


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

"""The checkpoint contract: atomic, verified, per-rank, with fallback.

Layout of one checkpoint (DDP)::

    step-00000040/
        manifest.json   step, epoch, world size, config digest and resume fields,
                        torch version, and the sha256 and size of every file
        train.pt        model, optimizer, scheduler, scaler, sampler progress, step
        rank-00000.pt   rank 0's RNG state (Python, NumPy, torch, CUDA)
        rank-00001.pt   rank 1's ...

A checkpoint exists only once its directory has its final name: files are written under
`.tmp-step-NNNNNNNN/`, fsynced, hashed into the manifest, and the directory is renamed
into place (an atomic operation on POSIX filesystems), then the parent is fsynced.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed as dist

from reference_impl.config import TrainConfig
from reference_impl.distributed import DistContext
from reference_impl.faults import FaultInjector, enospc
from reference_impl.metrics import EventLog
from reference_impl.parallel import unwrap
from reference_impl.state import rng_state, set_rng_state

FORMAT = 1
MANIFEST = "manifest.json"
PROGRESS = "progress.json"
TRAIN_FILE = "train.pt"
STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, torn, corrupt, unsafe or cannot be written."""


class IncompatibleCheckpoint(CheckpointError):
    """The checkpoint was written by a run whose step computes something else."""


def step_dir(root: Path, step: int) -> Path:
    """The published directory of `step`."""
    return root / f"step-{step:08d}"


def rank_file(rank: int) -> str:
    """File name of one rank's private state."""
    return f"rank-{rank:05d}.pt"


def published(root: Path) -> list[Path]:
    """Published checkpoint directories, newest first (temporary ones never match)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: p.name, reverse=True)


class _HashingWriter:
    """A file wrapper that hashes what it writes, so saving reads nothing back."""

    def __init__(self, f: BinaryIO, fail_after: int | None) -> None:
        self.f, self.sha, self.size, self.fail_after = f, hashlib.sha256(), 0, fail_after
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            if self.fail_after is not None and self.size + len(data) > self.fail_after:
                raise enospc()
            written = self.f.write(data)
        except OSError as exc:
            self.error = exc  # torch.save re-raises it as a bare RuntimeError; keep the errno
            raise
        self.sha.update(data)
        self.size += len(data)
        return written

    def flush(self) -> None:
        self.f.flush()


def _write(path: Path, obj: Any, fail_after: int | None = None) -> dict[str, Any]:
    """torch.save `obj` to `path`, fsync it, return its sha256 and size."""
    with path.open("wb") as f:
        writer = _HashingWriter(f, fail_after)
        try:
            torch.save(obj, writer)  # type: ignore[arg-type]
        except RuntimeError as exc:
            raise (writer.error or exc) from exc
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": writer.sha.hexdigest(), "bytes": writer.size}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier()


# --8<-- [start:checkpoint_save]
def save_checkpoint(state: Any, cfg: TrainConfig, ctx: DistContext, log: EventLog,
                    faults: FaultInjector | None = None) -> Path:
    """Write, verify-by-construction and atomically publish the checkpoint of `state.step`.

    Every rank writes its own RNG file; rank 0 writes the replicated training state,
    the manifest, publishes, and applies retention. An error (a full disk) leaves the
    published checkpoints untouched and raises `CheckpointError`.
    """
    t0 = time.perf_counter()
    faults = faults or FaultInjector.disabled()
    root = Path(cfg.checkpoint_dir or "")
    tmp, final = root / f".tmp-step-{state.step:08d}", step_dir(root, state.step)
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # debris of an earlier crash at this step
        tmp.mkdir(parents=True)
    _barrier(ctx)
    limit = faults.write_limit(state.step)
    try:
        mine = rank_file(ctx.rank)
        _write(tmp / mine, {"rank": ctx.rank, "rng": rng_state()}, limit)
        faults.after_write(state.step, str(tmp / mine))
        if ctx.is_main:
            _write(tmp / TRAIN_FILE, {
                "step": state.step,
                "model": unwrap(state.model).state_dict(),
                "optimizer": state.optimizer.state_dict(),
                "scheduler": state.scheduler.state_dict(),
                "scaler": state.scaler.state_dict() if state.scaler else None,
                "sampler": state.sampler.state_dict(),
            }, limit)
    except OSError as exc:
        raise CheckpointError(f"writing the checkpoint of step {state.step} failed: {exc}; "
                              f"published checkpoints are untouched") from exc
    faults.before_publish(state.step)
    _barrier(ctx)  # every rank's file is on disk before rank 0 hashes and publishes
    if ctx.is_main:
        files = {p.name: _digest_file(p) for p in sorted(tmp.iterdir())}
        manifest = {"format": FORMAT, "step": state.step, "epoch": state.sampler.epoch,
                    "world_size": ctx.world_size, "config_digest": cfg.digest(),
                    "resume_fields": cfg.resume_fields(), "torch_version": torch.__version__,
                    "saved_at": time.time(), "files": files}
        with (tmp / MANIFEST).open("w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if final.exists():  # only an invalid one can be here: a valid one would have been resumed
            shutil.rmtree(final)
        os.rename(tmp, final)  # the commit point
        _fsync_dir(root)
        for old in published(root)[cfg.keep_last:]:
            shutil.rmtree(old, ignore_errors=True)
        log.emit("checkpoint_saved", step=state.step, path=str(final),
                 bytes=sum(f["bytes"] for f in files.values()),
                 save_s=round(time.perf_counter() - t0, 4))
    _barrier(ctx)
    return final
# --8<-- [end:checkpoint_save]


def _digest_file(path: Path) -> dict[str, Any]:
    sha = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            sha.update(chunk)
    return {"sha256": sha.hexdigest(), "bytes": path.stat().st_size}


def verify(path: Path) -> dict[str, Any]:
    """Return the manifest of `path` if every file it lists is present and intact.

    Raises:
        CheckpointError: With the reason the checkpoint cannot be used.
    """
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError("no manifest: the save never completed") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"unreadable manifest: {exc}") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"unknown checkpoint format {manifest.get('format')!r}")
    for name, expected in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{name} is missing")
        actual = _digest_file(file)
        if actual["bytes"] != expected["bytes"]:
            raise CheckpointError(f"{name} has {actual['bytes']} bytes, the manifest says {expected['bytes']}")
        if actual["sha256"] != expected["sha256"]:
            raise CheckpointError(f"{name} fails its sha256 check (corrupt)")
    return manifest


def load_file(path: Path) -> Any:
    """`torch.load` with `weights_only=True`: tensors and plain containers, never code."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # UnpicklingError and friends: refuse, never fall back to full pickle
        raise CheckpointError(f"{path.name} refused by the weights-only loader: "
                              f"{type(exc).__name__}: {str(exc).splitlines()[0]}") from None


def record_progress(cfg: TrainConfig, ctx: DistContext, step: int) -> None:
    """Rank 0 notes the furthest step reached, to count the steps a restart replays."""
    if not (ctx.is_main and cfg.checkpoint_dir):
        return
    root = Path(cfg.checkpoint_dir)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{PROGRESS}.tmp"
    tmp.write_text(json.dumps({"step": step}))
    os.replace(tmp, root / PROGRESS)


def _steps_replayed(root: Path, restored: int) -> int:
    try:
        reached = json.loads((root / PROGRESS).read_text())["step"]
    except (OSError, ValueError, KeyError):
        return 0
    return max(0, reached - restored)


def newest_manifest(root: Path) -> dict[str, Any] | None:
    """The manifest of the newest published checkpoint that has a readable one."""
    for path in published(root):
        try:
            return json.loads((path / MANIFEST).read_text())
        except (OSError, ValueError):
            continue
    return None


def check_compatible(manifest: dict[str, Any], cfg: TrainConfig) -> None:
    """Refuse to resume when a field that decides what a step computes has changed.

    Raises:
        IncompatibleCheckpoint: Naming each field, its saved and its current value.
    """
    saved, now = manifest["resume_fields"], cfg.resume_fields()
    changed = [k for k in sorted(set(saved) | set(now))
               if saved.get(k) != now.get(k) and k not in cfg.allow_config_change]
    if changed:
        detail = ", ".join(f"{k}: checkpoint {saved.get(k)!r}, now {now.get(k)!r}" for k in changed)
        raise IncompatibleCheckpoint(
            f"checkpoint at step {manifest['step']} is incompatible ({detail}); "
            "allow a deliberate change with --allow-config-change FIELD[,FIELD]")


def _choose(root: Path, log: EventLog) -> tuple[Path, dict[str, Any]] | None:
    """Newest checkpoint whose files verify and load safely; report each one skipped."""
    for path in published(root):
        try:
            manifest = verify(path)
            for name in manifest["files"]:
                load_file(path / name)
            return path, manifest
        except CheckpointError as exc:
            log.emit("checkpoint_skipped", path=str(path), reason=str(exc))
    return None


# --8<-- [start:checkpoint_restore]
def restore_checkpoint(state: Any, cfg: TrainConfig, ctx: DistContext, log: EventLog) -> int | None:
    """Load the newest valid checkpoint into `state`; return its step, or None if none.

    Rank 0 picks the checkpoint (falling back past torn or corrupt ones) and broadcasts
    the choice, so every rank restores the same step.
    """
    if not cfg.checkpoint_dir:
        return None
    t0 = time.perf_counter()
    choice = [_choose(Path(cfg.checkpoint_dir), log) if ctx.is_main else None]
    if ctx.distributed:
        dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return None
    path, manifest = choice[0]
    check_compatible(manifest, cfg)
    saved = load_file(path / TRAIN_FILE)
    skip = set(cfg.resume_skip)
    unwrap(state.model).load_state_dict(saved["model"])
    state.optimizer.load_state_dict(saved["optimizer"])
    if "scheduler" not in skip:
        state.scheduler.load_state_dict(saved["scheduler"])
    if state.scaler and saved["scaler"] and "scaler" not in skip:
        state.scaler.load_state_dict(saved["scaler"])
    if "data" not in skip:
        state.sampler.load_state_dict(saved["sampler"])
    state.step = saved["step"]
    if "rng" not in skip:
        if manifest["world_size"] == ctx.world_size:
            set_rng_state(load_file(path / rank_file(ctx.rank))["rng"])
        else:  # another world size: no saved stream belongs to this rank
            torch.manual_seed(cfg.seed + ctx.rank + 7919 * state.step)
            log.progress("rng_reseeded", reason=f"world size {manifest['world_size']} -> {ctx.world_size}")
    log.progress("checkpoint_restored", step=state.step, path=str(path), restart_count=ctx.restart_count,
                 steps_replayed=_steps_replayed(Path(cfg.checkpoint_dir), state.step),
                 restore_s=round(time.perf_counter() - t0, 4), skipped_parts=sorted(skip))
    return state.step
# --8<-- [end:checkpoint_restore]

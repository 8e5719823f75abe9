"""The checkpoint contract: atomic, verified, per-rank, with fallback.

Layout of one checkpoint::

    step-00000040/
        manifest.json   step, epoch, world size, layout, config digest and resume
                        fields, torch version, and the checksum and size of every file
        train.pt        scheduler, scaler, sampler progress, step; under DDP also the
                        (replicated) model and optimizer
        rank-00000.pt   rank 0's RNG state (Python, NumPy, torch, CUDA)
        rank-00001.pt   rank 1's ...
        dcp/            FSDP only: DCP's sharded model and optimizer, with its own
                        commit point `.metadata`; restorable at another world size

A checkpoint exists only once its directory has its final name: files are written under
`.tmp-step-NNNNNNNN/`, fsynced, hashed into the manifest, and the directory is renamed
into place (an atomic operation on POSIX filesystems), then the parent is fsynced.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from reference_impl.checkpoint_validate import (DCP_DIR, FORMAT, MANIFEST, TRAIN_FILE, CheckpointError,
                                                check_compatible, check_contents, member,
                                                published, rank_file, read_manifest, verify)
from reference_impl import integrity
from reference_impl.config import TrainConfig
from reference_impl.step import lr_multiplier
from reference_impl.distributed import DistContext
from reference_impl.faults import FaultInjector, enospc
from reference_impl.housekeeping import prune, remove, steps_replayed
from reference_impl.metrics import EventLog
from reference_impl.parallel import unwrap
from reference_impl.state import RESUME_NAMES, TrainState, rng_state, set_rng_state

SCHEDULE_FIELDS = ("lr", "warmup_steps", "min_lr_ratio", "max_steps")  # what lr_multiplier reads


def step_dir(root: Path, step: int) -> Path:
    """The published directory of `step`."""
    return root / f"step-{step:08d}"


class _HashingWriter:
    """A file wrapper that hashes what it writes, so saving reads nothing back.

    XXH3 hashes at memory speed, so hashing inline costs less than handing chunks to a
    thread would.
    """

    def __init__(self, f: BinaryIO, fail_after: int | None) -> None:
        self.f, self.hasher, self.size, self.fail_after = f, integrity.new_hasher(), 0, fail_after
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            if self.fail_after is not None and self.size + len(data) > self.fail_after:
                raise enospc()
            written = self.f.write(data)
            self.hasher.update(data)
        except OSError as exc:
            self.error = exc  # torch.save re-raises it as a bare RuntimeError; keep the errno
            raise
        self.size += len(data)
        return written

    def flush(self) -> None:
        self.f.flush()


def _write(path: Path, obj: Any, fail_after: int | None = None) -> dict[str, Any]:
    """torch.save `obj` to `path`, fsync it, return its manifest entry (checksum and size)."""
    with path.open("wb") as f:
        writer = _HashingWriter(f, fail_after)
        try:
            torch.save(obj, writer)  # type: ignore[arg-type]
        except RuntimeError as exc:
            raise (writer.error or exc) from exc
        f.flush()
        os.fsync(f.fileno())
    return integrity.entry(writer.hasher.hexdigest(), writer.size)


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
def save_checkpoint(state: TrainState, cfg: TrainConfig, ctx: DistContext, log: EventLog,
                    faults: FaultInjector | None = None, saver: AsyncSaver | None = None) -> Path:
    """Write the checkpoint of `state.step` and publish it atomically.

    Every rank writes its own RNG file. Under DDP rank 0 writes the replicated state
    with `torch.save`; under FSDP every rank writes its shards through DCP, in the
    background when `saver` is given. Rank 0 then writes the manifest and renames the
    directory into place. An error (a full disk) raises `CheckpointError` and leaves the
    published checkpoints untouched.
    """
    t0 = time.perf_counter()
    faults = faults or FaultInjector.disabled()
    if saver:
        saver.wait()  # one save in flight at a time
    root = Path(cfg.checkpoint_dir or "")
    tmp, final = _temporary_dir(root, state.step, ctx), step_dir(root, state.step)
    limit, sharded = faults.write_limit(state.step), cfg.strategy == "fsdp"
    files, error = {}, None
    try:
        mine = rank_file(ctx.rank)
        files = {mine: _write(tmp / mine, {"rank": ctx.rank, "rng": rng_state()}, limit)}
        faults.after_write(state.step, str(tmp / mine))
        if ctx.is_main:
            files[TRAIN_FILE] = _write(tmp / TRAIN_FILE, {
                "step": state.step,
                **{key: part.state_dict() if part is not None else None
                   for key, part in state.replicated_parts().items()},
                **({} if sharded else {"model": unwrap(state.model).state_dict(),
                                       "optimizer": state.optimizer.state_dict()}),
            }, limit)
    except OSError as exc:
        error = exc
    _agree_written(error, tmp, state.step, ctx)
    files = _gather_files(files, ctx)
    meta = {"format": FORMAT, "step": state.step, "epoch": state.sampler.epoch,
            "world_size": ctx.world_size, "layout": "dcp" if sharded else "torch_save",
            "config_digest": cfg.digest(), "resume_fields": cfg.resume_fields(),
            "torch_version": torch.__version__}
    publish = Publication(tmp, final, meta, files, cfg.keep_last, log, faults, t0)
    if sharded:
        sharded_state = {"model_optim": _sharded_state(state)}
        if saver:
            saver.start(sharded_state, tmp / DCP_DIR, publish if ctx.is_main else None)
            return final
        dcp.save(sharded_state, checkpoint_id=tmp / DCP_DIR)
    faults.before_publish(state.step)
    _barrier(ctx)  # every rank's files are on disk before rank 0 publishes
    if ctx.is_main:
        publish()
    _barrier(ctx)
    return final
# --8<-- [end:checkpoint_save]


def _temporary_dir(root: Path, step: int, ctx: DistContext) -> Path:
    """A fresh directory for this save, named after its writer (host and pid of rank 0).

    Only the holder of the directory lock writes here, but a unique name still keeps two
    writers that bypass the lock (or a reused name after a crash) from sharing files.
    """
    name = [f".tmp-step-{step:08d}.{socket.gethostname()}.{os.getpid()}"]
    if ctx.is_main:
        tmp = root / name[0]
        remove(tmp)
        try:
            tmp.mkdir(parents=True)
        except OSError as exc:
            raise CheckpointError(f"creating {tmp} failed: {exc}; published checkpoints are untouched") from exc
    if ctx.distributed:
        dist.broadcast_object_list(name, src=0)  # after rank 0 created it
    return root / name[0]


def _agree_written(error: OSError | None, tmp: Path, step: int, ctx: DistContext) -> None:
    """Raise `CheckpointError` on every rank if any rank failed to write its part.

    All ranks learn of the failure (a rank that failed alone would leave its peers
    waiting in the next collective), and rank 0 removes the temporary directory, so a
    full disk leaves no debris behind to fill it further.
    """
    failed = torch.tensor(float(error is not None), device=ctx.device)
    if ctx.distributed:
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if not failed.item():
        return
    if ctx.is_main:
        remove(tmp)
    reason = error or "another rank failed to write its part"
    raise CheckpointError(f"writing the checkpoint of step {step} failed: {reason}; "
                          "published checkpoints are untouched") from error


class Publication:
    """Rank 0's last act of a save: manifest, fsync, atomic rename, retention, event."""

    def __init__(self, tmp: Path, final: Path, meta: dict[str, Any], files: dict[str, Any],
                 keep_last: int, log: EventLog, faults: FaultInjector, started: float) -> None:
        self.tmp, self.final, self.meta, self.files = tmp, final, meta, files
        self.keep_last, self.log, self.faults, self.started = keep_last, log, faults, started
        self.blocked_s: float | None = None  # set by an async save: how long training waited

    def __call__(self) -> None:
        self.faults.before_publish(self.meta["step"])
        try:
            files = self._commit()
        except OSError as exc:
            remove(self.tmp)
            raise CheckpointError(f"publishing the checkpoint of step {self.meta['step']} failed: {exc}; "
                                  "published checkpoints are untouched") from exc
        for old in published(self.final.parent)[self.keep_last:]:
            remove(old)
        extra = {} if self.blocked_s is None else {"blocked_s": round(self.blocked_s, 4)}
        self.log.emit("checkpoint_saved", step=self.meta["step"], path=str(self.final),
                      bytes=sum(f["bytes"] for f in files.values()),
                      save_s=round(time.perf_counter() - self.started, 4), **extra)

    def _commit(self) -> dict[str, Any]:
        """Write the manifest and rename into place; return every file it lists."""
        files = dict(self.files)
        for path in sorted((self.tmp / DCP_DIR).rglob("*")) if (self.tmp / DCP_DIR).exists() else []:
            files[str(path.relative_to(self.tmp))] = integrity.digest_file(path)  # DCP wrote these
        manifest = {**self.meta, "saved_at": time.time(), "files": files}
        with (self.tmp / MANIFEST).open("w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(self.tmp)
        # Only an invalid entry can be here (a valid one is resumed); if it is a link,
        # the link goes and its target stays.
        remove(self.final)
        os.rename(self.tmp, self.final)  # the commit point
        _fsync_dir(self.final.parent)
        return files


class AsyncSaver:
    """Runs DCP saves in the background on a dedicated gloo group.

    The training collectives keep the default group; sharing it with a background save
    interleaves two streams of collectives on one communicator, which crashes or hangs.
    DCP copies (stages) the state before `async_save` returns, so the next optimizer step
    can safely change the parameters. Rank 0 publishes as soon as the write completes.
    """

    def __init__(self, timeout_s: float = 120.0) -> None:
        self.group = (dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
                      if dist.is_initialized() else None)
        self._future: Any = None
        self._published = threading.Event()
        self._error: BaseException | None = None

    def start(self, state: dict[str, Any], path: Path, publish: Publication | None) -> None:
        """Begin writing `state` to `path`; `publish` runs (on rank 0) once it is complete."""
        future = dcp.async_save(state, checkpoint_id=path, process_group=self.group)
        self._published.clear()
        if publish is None:
            self._published.set()
        else:
            publish.blocked_s = time.perf_counter() - publish.started
            future.add_done_callback(lambda f: self._publish(f, publish))
        self._future = future

    def _publish(self, future: Any, publish: Publication) -> None:
        try:
            if future.exception() is None:
                publish()
        except BaseException as exc:  # surfaced on the training thread by wait()
            self._error = exc
        finally:
            self._published.set()

    def wait(self) -> None:
        """Block until the save in flight (if any) is written and published; re-raise errors."""
        if self._future is None:
            return
        future, self._future = self._future, None
        future.result()
        self._published.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"publishing an async checkpoint failed: {error}") from error


def _sharded_state(state: TrainState) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(state.model, state.optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _gather_files(files: dict[str, Any], ctx: DistContext) -> dict[str, Any]:
    """Rank 0 collects the name, size and checksum of every file each rank wrote."""
    if not ctx.distributed:
        return files
    gathered: list[Any] = [None] * ctx.world_size if ctx.is_main else []
    dist.gather_object(files, gathered if ctx.is_main else None, dst=0)
    return {k: v for part in gathered for k, v in part.items()} if ctx.is_main else {}


def load_file(path: Path) -> Any:
    """`torch.load` with `weights_only=True`: tensors and plain containers, never code."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # UnpicklingError and friends: refuse, never fall back to full pickle
        raise CheckpointError(f"{path.name} refused by the weights-only loader: "
                              f"{type(exc).__name__}: {str(exc).splitlines()[0]}") from None


def rebase_schedule(state: TrainState, cfg: TrainConfig, saved_fields: dict[str, Any], log: EventLog) -> None:
    """Continue on the schedule `cfg` defines when an allowed change altered it.

    The restored scheduler and optimizer carry the old schedule's base rate and next
    rate; left alone, the new fields would take effect one step late and only partly.
    The event shows the rate the old and the new schedule give the next step.
    """
    changed = [f for f in SCHEDULE_FIELDS if saved_fields.get(f) != getattr(cfg, f)]
    if not changed or "scheduler" in cfg.resume_skip:
        return
    old_lr = state.optimizer.param_groups[0]["lr"]
    state.scheduler.base_lrs = [cfg.lr for _ in state.optimizer.param_groups]
    new_lr = cfg.lr * lr_multiplier(state.step, cfg)
    for group in state.optimizer.param_groups:
        group["lr"] = new_lr
    log.progress("lr_schedule_changed", step=state.step, changed=changed, old_lr=old_lr, new_lr=new_lr)


def choose(root: Path, log: EventLog) -> tuple[Path, dict[str, Any], Any] | None:
    """Newest checkpoint that validates, verifies and loads safely, with its loaded train.pt.

    The manifest's shape is checked before any other byte is read. Then train.pt is
    loaded once while another thread hashes every file; a corrupt file is reported as
    corrupt even if it also fails to load. Each skipped checkpoint is an event.
    """
    for path in published(root):
        try:
            manifest = read_manifest(path)
            with ThreadPoolExecutor(1) as pool:
                verified = pool.submit(verify, path)
                try:
                    saved, load_error = load_file(member(path, TRAIN_FILE)), None
                except CheckpointError as exc:
                    saved, load_error = None, exc
                verified.result()
            if load_error:
                raise load_error
            ranks = [load_file(path / rank_file(r)) for r in range(manifest["world_size"])]
            check_contents(manifest, saved, ranks)
            return path, manifest, saved
        except (CheckpointError, OSError) as exc:
            log.emit("checkpoint_skipped", path=str(path), reason=str(exc))
    return None


# --8<-- [start:checkpoint_restore]
def restore_checkpoint(state: TrainState, cfg: TrainConfig, ctx: DistContext, log: EventLog) -> int | None:
    """Load the newest valid checkpoint into `state`; return its step, or None if none.

    Rank 0 picks the checkpoint (falling back past torn or corrupt ones) and broadcasts
    the choice, so every rank restores the same step.
    """
    if not cfg.checkpoint_dir:
        return None
    t0 = time.perf_counter()
    chosen = choose(Path(cfg.checkpoint_dir), log) if ctx.is_main else None
    choice = [chosen[:2] if chosen else None]  # broadcast the choice, never the loaded state
    if ctx.distributed:
        dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return None
    path, manifest = choice[0]
    check_compatible(manifest, cfg)
    saved = chosen[2] if chosen else load_file(path / TRAIN_FILE)
    skip = set(cfg.resume_skip)
    if manifest["layout"] == "dcp":  # reshards: the saved world size may differ from ours
        sharded = {"model_optim": _sharded_state(state)}
        dcp.load(sharded, checkpoint_id=path / DCP_DIR)
        set_state_dict(state.model, state.optimizer, model_state_dict=sharded["model_optim"]["model"],
                       optim_state_dict=sharded["model_optim"]["optim"])
    else:
        unwrap(state.model).load_state_dict(saved["model"])
        state.optimizer.load_state_dict(saved["optimizer"])
    for key, part in state.replicated_parts().items():
        if part is not None and saved[key] is not None and RESUME_NAMES.get(key, key) not in skip:
            part.load_state_dict(saved[key])
    state.step = saved["step"]
    rebase_schedule(state, cfg, manifest["resume_fields"], log)
    if "rng" not in skip:
        if manifest["world_size"] == ctx.world_size:
            set_rng_state(load_file(path / rank_file(ctx.rank))["rng"])
        else:  # another world size: no saved stream belongs to this rank
            torch.manual_seed(cfg.seed + ctx.rank + 7919 * state.step)
            log.progress("rng_reseeded", reason=f"world size {manifest['world_size']} -> {ctx.world_size}")
    log.progress("checkpoint_restored", step=state.step, path=str(path), restart_count=ctx.restart_count,
                 steps_replayed=steps_replayed(Path(cfg.checkpoint_dir), state.step),
                 restore_s=round(time.perf_counter() - t0, 4), skipped_parts=sorted(skip))
    if ctx.is_main and state.step < cfg.max_steps:  # at the end nothing is trained or deleted
        prune(Path(cfg.checkpoint_dir), path, cfg.keep_last, log)
    return state.step
# --8<-- [end:checkpoint_restore]

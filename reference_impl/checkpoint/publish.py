"""Writing a checkpoint: files, checksums, the manifest and the atomic publish.

Layout of one checkpoint::

    step-00000040/
        manifest.json   step, epoch, world size, mesh, layout, config digest and resume
                        fields, torch version, and the checksum and size of every file
        train.pt        scheduler, scaler, sampler progress, step; plus what the layout
                        puts there (the whole model and optimizer under `torch_save`)
        rank-00000.pt   rank 0's RNG state (Python, NumPy, torch, CUDA)
        rank-00001.pt   rank 1's ...
        dcp/            `dcp` layout only: DCP's sharded model and optimizer, with its own
                        commit point `.metadata`; restorable on another mesh

A checkpoint exists only once its directory has its final name: files are written under
`.tmp-step-NNNNNNNN.HOST.PID/` (mode 0o700: no other user can reach into a save in
progress), fsynced, hashed into the manifest (every file, DCP's shards included), given
their published modes (0o755 directories, 0o644 files, whatever the umask), and the
directory is renamed into place (an atomic operation on POSIX filesystems), then the
parent is fsynced.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from reference_impl.checkpoint import integrity
from reference_impl.checkpoint.files import (
    PRIVATE_DIR_MODE,
    CheckpointError,
    fsync_dir,
    lock_lost,
    read_bounded,
    remove,
    seal,
    vanished,
    write_private,
)
from reference_impl.checkpoint.manifest import MANIFEST
from reference_impl.distributed import DistContext
from reference_impl.metrics import EventLog
from reference_impl.reliability.faults import FaultInjector, enospc

TMP_PREFIX = ".tmp-step-"


_CRC32_LOCK = threading.Lock()


@contextmanager
def _without_crc32() -> Iterator[None]:
    """torch.save without the zip's CRC32 inside the block; the caller's setting afterwards.

    The CRC32 is most of torch.save's CPU time (about 1.3 s of 1.6 s for a 1.2 GB file
    here), and nothing reads it: `torch.load` never checks it, and the manifest's XXH3
    checksum covers every byte of the file instead. torch keeps the setting per thread
    (2.13) or per process (older releases); in the second case the lock stops two of our
    writes (a synchronous save's on the training thread, an async save's on its writer
    thread) from interleaving their set-and-restore. One save is in flight at a time, so
    it rarely waits.
    """
    with _CRC32_LOCK:
        previous = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            yield
        finally:
            torch.serialization.set_crc32_options(previous)


def write_file(path: Path, obj: Any, fail_after: int | None = None) -> dict[str, Any]:
    """torch.save `obj` to `path`, fsync it, return its manifest entry (checksum and size).

    torch writes the file itself, and the checksum is taken afterwards from the page cache
    through a memory map (XXH3 reads about 30 GB/s here: 0.04 s for a 1.2 GB file); the zip's
    own CRC32, most of torch.save's CPU time, is left out (`_without_crc32`). Handing
    torch a file-like object instead, to hash while writing, makes it stream a zip with data
    descriptors that loads 14% slower (0.71 s against 0.62 s at 1.2 GB). torch's own writer
    reports a failed write without its errno ("unexpected pos"), so a failure is reproduced
    by appending one byte where the write stopped, which raises the real OSError: no space
    left, file too large.

    Args:
        path: Where to write, inside a private temporary directory; a partial file is
            left for the caller's cleanup.
        obj: What to save (tensors and plain containers).
        fail_after: Fault injection: behave as a disk that is full after this many bytes.

    Raises:
        OSError: The write failed, with the errno the filesystem gave.
    """
    try:
        with _without_crc32():
            torch.save(obj, path)
    except RuntimeError as exc:
        raise _write_error(path, exc) from exc
    if fail_after is not None and path.stat().st_size > fail_after:
        os.truncate(path, fail_after)
        raise enospc()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return integrity.digest_file(path)


def _write_error(path: Path, failure: RuntimeError) -> OSError:
    """The OSError behind torch's errno-less write failure: append one byte and see."""
    try:
        with path.open("ab") as f:
            f.write(b"\0")
    except OSError as real:
        return real
    return OSError(errno.EIO, f"torch.save to {path.name} failed: {failure}")


def barrier(ctx: DistContext, group: dist.ProcessGroup | None = None) -> None:
    """Wait for every rank of `group` (the default group when None; no-op in a single process)."""
    if ctx.distributed:
        dist.barrier(group=group)


def temporary_dir(root: Path, step: int, ctx: DistContext, ready: Callable[[], None]) -> Path:
    """A fresh private directory for this save, named after its writer (host and pid of rank 0).

    Only the holder of the directory lock writes here, but a unique name still keeps two
    writers that bypass the lock (or a reused name after a crash) from sharing files.
    Rank 0 first checks that the directory is still the run's to write (`ready`: the lock
    is still there), and makes only the temporary directory, so a directory deleted under
    the run is never made again by it. Its answer, a name or the error, reaches every rank,
    and every rank raises the same `CheckpointError`.
    """
    answer: list[str | CheckpointError] = [f"{TMP_PREFIX}{step:08d}.{socket.gethostname()}.{os.getpid()}"]
    if ctx.is_main:
        tmp = root / str(answer[0])
        try:
            ready()
            remove(tmp)
            tmp.mkdir(PRIVATE_DIR_MODE)  # not its parents: the checkpoint directory exists or was deleted
            os.chmod(tmp, PRIVATE_DIR_MODE)  # whatever the umask
        except CheckpointError as exc:
            answer[0] = exc
        except OSError as exc:
            answer[0] = CheckpointError(f"creating {tmp} failed: {exc}; published checkpoints are untouched")
    if ctx.distributed:
        dist.broadcast_object_list(answer, src=0)  # after rank 0 created it
    if isinstance(answer[0], CheckpointError):
        raise answer[0]
    return root / answer[0]


SHARED_TOKEN = ".shared-token"  # in a save's temporary directory, only until every rank has read it
_SHARED_TRIES = (0.0, 0.5, 2.0)  # seconds before each read: a slow filesystem's new name may show late


class DirectoryNotShared(CheckpointError):
    """The ranks do not see one checkpoint directory (node-local disks at the same path)."""


def prove_shared(tmp: Path, ctx: DistContext) -> None:
    """Prove that every rank sees the directory rank 0 created for this save, or fail on all.

    Node-local disks mounted at the same path look like one directory: each rank writes
    its part into its own node's copy, rank 0 publishes a manifest listing files only
    other nodes hold, and every restore then refuses it and silently starts again from
    step 0. So rank 0 writes a random token into `tmp`, and every rank reads it back; the
    ranks agree (all-gather) before any checkpoint file is written. Rank 0 then removes
    the token (and, on failure, `tmp`), so no manifest lists it.

    Raises:
        DirectoryNotShared: Some rank could not read the token (on every rank).
    """
    if not ctx.distributed:
        return
    path, token = tmp / SHARED_TOKEN, secrets.token_hex(16)
    written: list[Any] = [token, None]  # rank 0's token and why writing it failed
    if ctx.is_main:
        try:
            write_private(path, token.encode(), durable=False)
        except OSError as exc:
            written[1] = str(exc)
    dist.broadcast_object_list(written, src=0)  # sent once the token is written
    if written[1]:
        if ctx.is_main:
            remove(tmp)
        raise CheckpointError(f"writing to {tmp} failed: {written[1]}; published checkpoints are untouched")
    answers: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(answers, (_reads_token(path, written[0]), socket.gethostname()))
    if ctx.is_main:
        remove(tmp if any(reason for reason, _ in answers) else path)
    blind = [(rank, host, reason) for rank, (reason, host) in enumerate(answers) if reason]
    if blind:
        rank, host, reason = blind[0]
        raise DirectoryNotShared(
            f"the checkpoint directory {tmp.parent} is not shared: {len(blind)} rank(s), first rank {rank} "
            f"on {host}, cannot read the file rank 0 on {answers[0][1]} wrote in it ({reason}); put "
            "--checkpoint-dir on a shared filesystem that every node mounts at the same path")


def _reads_token(path: Path, token: str) -> str:
    """Why this rank cannot read `token` from `path` ("" when it can), after a few tries."""
    reason = ""
    for wait in _SHARED_TRIES:
        time.sleep(wait)
        try:
            if read_bounded(path, 64).decode(errors="replace") == token:
                return ""
            reason = "it holds another token"
        except CheckpointError as exc:
            reason = str(exc)
    return reason


def any_rank_failed(failed: bool, ctx: DistContext, group: dist.ProcessGroup | None = None) -> bool:
    """Whether `failed` holds on any rank of `group` (the default group when None); every
    rank must call it. A collective, so it is also a barrier."""
    flag = torch.tensor(float(failed), device="cpu" if group else ctx.device)
    if ctx.distributed:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def agree_written(error: BaseException | None, tmp: Path, step: int, ctx: DistContext,
                  group: dist.ProcessGroup | None = None) -> None:
    """Raise `CheckpointError` on every rank if any rank failed to write its part.

    All ranks learn of the failure (a rank that failed alone would leave its peers
    waiting in the next collective), and rank 0 removes the temporary directory, so a
    full disk leaves no debris behind to fill it further. `group` is the group to agree
    on (the default group when None; an async save's own gloo group, on its thread).
    """
    if not any_rank_failed(error is not None, ctx, group):
        return
    if ctx.is_main:
        remove(tmp)
    reason = error or "another rank failed to write its part"
    raise CheckpointError(f"writing the checkpoint of step {step} failed: {reason}; "
                          "published checkpoints are untouched") from error


def gather_files(files: dict[str, Any], ctx: DistContext, group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """Rank 0 collects the name, size and checksum of every file each rank wrote."""
    if not ctx.distributed:
        return files
    gathered: list[Any] = [None] * ctx.world_size if ctx.is_main else []
    dist.gather_object(files, gathered if ctx.is_main else None, dst=0, group=group)
    return {k: v for part in gathered for k, v in part.items()} if ctx.is_main else {}


def finish_save(own: dict[str, Any], publish: Publication, ctx: DistContext,
                group: dist.ProcessGroup | None = None, failure: BaseException | None = None) -> None:
    """Every rank's end of a save: write its own files, agree, and rank 0 publishes.

    Runs on the training thread after a synchronous save, and on the async save's thread,
    with that save's gloo group, once the layout's background write completes; a failed
    write anywhere (`failure`: the layout's; an OSError here) fails the save on every rank.

    Args:
        own: File name -> object this rank writes (its RNG file; train.pt on rank 0).
        publish: Rank 0's publication of this save.
        ctx: This rank's context.
        group: The process group for the agreement (None: the default group).
        failure: Why the layout's write failed, if it did.
    """
    step, faults = publish.meta["step"], publish.faults
    files: dict[str, Any] = {}
    error = failure
    for name, obj in own.items() if error is None else ():
        try:
            files[name] = write_file(publish.tmp / name, obj, faults.write_limit(step))
        except (OSError, CheckpointError) as exc:  # the second: the file vanished before it was hashed
            error = exc
            break
        faults.after_write(step, str(publish.tmp / name))
    if error is not None and ctx.is_main:
        error = publish.cause(error)
    agree_written(error, publish.tmp, step, ctx, group)
    files = gather_files(files, ctx, group)
    faults.before_publish(step)
    barrier(ctx, group)  # every rank's files are on disk before rank 0 publishes
    unpublished: Exception | None = None
    if ctx.is_main:
        try:
            publish(files)
        except Exception as exc:  # the others learn of it below, not from a barrier's timeout
            unpublished = exc
    if any_rank_failed(unpublished is not None, ctx, group):  # no rank returns before the publish
        raise unpublished or CheckpointError(f"rank 0 failed to publish the checkpoint of step {step}; "
                                             "published checkpoints are untouched")


class Publication:
    """Rank 0's last act of a save: manifest, modes, fsync, atomic rename, retention, event.

    Args:
        tmp: The private directory every rank wrote into.
        final: The published name, `step-NNNNNNNN`.
        meta: The manifest's fields other than `files` and `saved_at`.
        retain: Called with `final` once it is published (the manager's retention).
        log: Where `checkpoint_saved` goes.
        faults: Fault injection (a full disk, a kill mid-write or just before the publish).
        started: `perf_counter()` at the start of the save.
        ready: Raises `CheckpointError` if the directory is no longer the run's to write (its
            lock was lost meanwhile).
    """

    def __init__(self, tmp: Path, final: Path, meta: dict[str, Any], retain: Callable[[Path], None],
                 log: EventLog, faults: FaultInjector, started: float, ready: Callable[[], None]) -> None:
        self.tmp, self.final, self.meta = tmp, final, meta
        self.retain, self.log, self.faults, self.started = retain, log, faults, started
        self.ready = ready
        self.blocked_s: float | None = None  # set by an async save: how long training waited

    def __call__(self, files: dict[str, Any]) -> None:
        """Publish, given the manifest entries of the files the ranks wrote themselves."""
        try:
            files = self._commit(files)
            self.retain(self.final)
        except (OSError, CheckpointError) as exc:
            remove(self.tmp)
            raise CheckpointError(f"publishing the checkpoint of step {self.meta['step']} failed: "
                                  f"{self.cause(exc)}; published checkpoints are untouched") from exc
        extra = {} if self.blocked_s is None else {"blocked_s": round(self.blocked_s, 4)}
        self.log.emit("checkpoint_saved", step=self.meta["step"], path=str(self.final),
                      bytes=sum(f["bytes"] for f in files.values()),
                      save_s=round(time.perf_counter() - self.started, 4), **extra)

    def cause(self, error: BaseException) -> BaseException:
        """`error`, or the lost lock behind it: under a run whose directory was deleted, files
        vanish mid-save, and which one vanished first says less than why. An `rm -rf` still
        under way may not have reached `.lock` yet; a file this save wrote that vanished is
        the same evidence."""
        try:
            self.ready()
        except CheckpointError as lost:
            return lost
        gone = vanished(error, self.tmp, self.final)
        return lock_lost(self.final.parent, f"{gone.name}, written by this save, vanished") if gone else error

    def _commit(self, written: dict[str, Any]) -> dict[str, Any]:
        """Write the manifest and rename into place; return every file it lists."""
        files = dict(written)
        for path in sorted(self.tmp.rglob("*")):  # what the layout wrote itself (DCP's shards)
            name = path.relative_to(self.tmp).as_posix()
            if not path.is_dir() and name not in files:
                files[name] = integrity.digest_file(path)  # refuses a link or a FIFO
        manifest = {**self.meta, "saved_at": time.time(), "files": files}
        write_private(self.tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
        seal(self.tmp)  # 0o755/0o644 from here on, whatever the umask
        fsync_dir(self.tmp)
        self.ready()  # the write took a while: another run may own the directory by now
        # Only an invalid entry can be here (a valid one is resumed); if it is a link,
        # the link goes and its target stays.
        remove(self.final)
        os.rename(self.tmp, self.final)  # the commit point
        fsync_dir(self.final.parent)
        return files

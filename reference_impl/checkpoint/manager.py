"""The checkpoint manager: one object owns a checkpoint directory.

It takes the directory's lock, saves (through `publish`), restores the newest valid
checkpoint (through `manifest` and the layouts), applies retention, and keeps the progress
note that counts replayed steps. Everything it reads from the directory is untrusted
(`reference_impl.checkpoint.files`); everything it deletes it has first proved to be
older than a valid checkpoint.
"""

from __future__ import annotations

import copy
import json
import os
import re
import stat
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from reference_impl.checkpoint.files import (
    CheckpointError,
    load_weights_only,
    lock_lost,
    make_dir,
    member,
    pinned,
    read_bounded,
    remove,
    remove_unless_pinned,
    step_name,
    step_of,
    vanished,
    write_private,
)
from reference_impl.checkpoint.fit import check_rng, same_structure
from reference_impl.checkpoint.layouts import LAYOUTS, AsyncSaver
from reference_impl.checkpoint.lock import DirectoryLock, held_lock
from reference_impl.checkpoint.manifest import (
    FORMAT,
    MANIFEST,
    TRAIN_FILE,
    check_compatible,
    check_contents,
    rank_file,
    read_manifest,
    verify,
)
from reference_impl.checkpoint.publish import TMP_PREFIX, Publication, finish_save, prove_shared, temporary_dir
from reference_impl.config import ConfigError, TrainConfig
from reference_impl.distributed import DistContext
from reference_impl.metrics import EventLog
from reference_impl.parallel.registry import checkpoint_layout
from reference_impl.reliability.faults import FaultInjector
from reference_impl.state import RESUME_NAMES, TrainState, rng_state, set_rng_state
from reference_impl.step import lr_multiplier

PROGRESS = "progress.json"
_PROGRESS_CAP = 4096
# What earlier writers of this trainer leave behind: `publish.temporary_dir`'s name for a
# save (step, host, pid) and `record_progress`'s for a note (pid). Nothing else is debris.
_SAVE_DEBRIS = re.compile(re.escape(TMP_PREFIX) + r"[0-9]{8}\..+\.[0-9]+", re.ASCII)
_NOTE_DEBRIS = re.compile(re.escape(f".{PROGRESS}.") + r"[0-9]+\.tmp", re.ASCII)
SCHEDULE_FIELDS = ("lr", "warmup_steps", "min_lr_ratio", "max_steps")  # what lr_multiplier reads


class Chosen(NamedTuple):
    """The checkpoint a restore uses: its directory, its manifest and its loaded train.pt."""

    path: Path
    manifest: dict[str, Any]
    saved: dict[str, Any]


class CheckpointManager:
    """Owns one checkpoint directory: lock, save, restore, retention, validation.

    Args:
        root: The checkpoint directory (`--checkpoint-dir`).
        log: Where events go (`checkpoint_saved`, `checkpoint_skipped`, ...).
        keep_last: How many valid checkpoints retention keeps (`--keep-last`).
    """

    def __init__(self, root: Path, log: EventLog, keep_last: int = 1) -> None:
        self.root, self.log, self.keep_last = root, log, keep_last
        self._valid: dict[str, tuple[int, int]] = {}  # step dir name -> its manifest's (inode, mtime)
        self._lost: str | None = None  # why the lock is gone, once noticed
        self._shared = False  # every rank proved to see this directory (at the first save)

    def ready_to_write(self) -> None:
        """Check, before anything is written, that the directory is still this run's to write.

        The lock holder checks that its lock is still there, and never makes the directory
        again: the lock made it, so gone, it was deleted under the run. A process that
        never took the lock (a test driving `train` directly) makes it when it is missing.

        Raises:
            CheckpointError: This process held the directory's lock and lost it.
        """
        lock = held_lock(self.root)
        if lock is None:
            make_dir(self.root)
        else:
            lock.check()

    # --- reading the directory ---------------------------------------------------------

    def steps(self) -> list[tuple[int, Path]]:
        """Entries named exactly `step-NNNNNNNN` (ASCII), newest first; any kind, links included.

        Temporary saves and every other name are never listed, so never restored or deleted.
        """
        found = [(step, self.root / name) for name in self._names() if (step := step_of(name)) is not None]
        return sorted(found, reverse=True)

    def _names(self) -> list[str]:
        try:
            return os.listdir(self.root)
        except OSError:  # missing, not a directory, unreadable: nothing to restore (the lock says why)
            return []

    def _report_misnamed(self) -> None:
        """Say why entries that look like checkpoints are ignored (Unicode digits, a newline...)."""
        for name in sorted(self._names()):
            if name.startswith("step") and step_of(name) is None:
                self.log.emit("checkpoint_ignored", path=str(self.root / name),
                              reason=f"{name!r:.60} is not 'step-' and eight ASCII digits")

    def newest_manifest(self) -> dict[str, Any] | None:
        """The manifest of the newest checkpoint whose manifest is valid (no file is hashed)."""
        for _, path in self.steps():
            try:
                return read_manifest(path)
            except CheckpointError:
                continue
        return None

    def choose(self, refused: frozenset[str] = frozenset(), pins: ExitStack | None = None) -> Chosen | None:
        """Newest checkpoint that validates, verifies and loads safely, with its loaded train.pt.

        The manifest is read and shape-checked once, before any other byte. Then train.pt
        is loaded while another thread hashes every listed file and checks that the layout
        reads nothing unlisted; a corrupt file is reported as corrupt even if it also fails
        to load. Each skipped checkpoint is an event.

        Args:
            refused: Names of step directories to pass over (refused by another rank).
            pins: A reader outside the run (export) pins each candidate before reading it,
                and the chosen one stays pinned until `pins` closes: the run's retention
                cannot delete it mid-read.
        """
        self._report_misnamed()
        for _, path in self.steps():
            if path.name in refused:
                continue
            with ExitStack() as candidate:
                try:
                    if pins is not None:
                        candidate.enter_context(pinned(path))
                    chosen = self._validate(path)
                except (CheckpointError, OSError) as exc:
                    self.log.emit("checkpoint_skipped", path=str(path), reason=str(exc))
                    continue
                if pins is not None:
                    pins.push(candidate.pop_all())
                return chosen
        return None

    def _validate(self, path: Path) -> Chosen:
        """`path` as a restore would use it, once every check has passed (raises `CheckpointError`)."""
        manifest = read_manifest(path)
        with ThreadPoolExecutor(1) as pool:
            verified = pool.submit(verify, path, manifest)
            try:
                saved, load_error = load_weights_only(member(path, TRAIN_FILE)), None
            except CheckpointError as exc:
                saved, load_error = None, exc
            verified.result()
        if load_error:
            raise load_error
        ranks = [load_weights_only(member(path, rank_file(r))) for r in range(manifest["world_size"])]
        check_contents(manifest, saved, ranks)
        self._remember_valid(path)
        return Chosen(path, manifest, saved)

    def _remember_valid(self, path: Path) -> None:
        info = (path / MANIFEST).stat()
        self._valid[path.name] = (info.st_ino, info.st_mtime_ns)

    def _is_valid(self, path: Path) -> bool:
        """Whether `path` is a checkpoint that verifies (remembered once verified or published here)."""
        try:
            info = (path / MANIFEST).lstat()
            if self._valid.get(path.name) == (info.st_ino, info.st_mtime_ns) and not path.is_symlink():
                return True
            verify(path, read_manifest(path))
        except (CheckpointError, OSError):
            return False
        self._remember_valid(path)
        return True

    # --- retention ---------------------------------------------------------------------

    # --8<-- [start:retention]
    def retain(self, anchor: Path) -> None:
        """Keep `anchor` (just published or restored) and the newest valid checkpoints below it.

        The one pruning rule, after a save and after a restore: walking down from the
        anchor, each checkpoint that verifies is kept until `keep_last` are kept; every
        other entry below the anchor is removed, unless an export has it pinned (then a
        later call removes it). Entries above the anchor are never
        touched (they failed validation, and stay for inspection) and never counted, so
        a corrupt newer directory cannot push a valid one out.
        """
        anchor_step, kept, removed, pinned_now = step_of(anchor.name), 1, [], []
        for step, path in self.steps():
            if anchor_step is None or step >= anchor_step:
                continue
            if kept < self.keep_last and self._is_valid(path):
                kept += 1
                continue
            if not remove_unless_pinned(path):  # an export is reading it: the next save prunes it
                pinned_now.append(str(path))
                continue
            self._valid.pop(path.name, None)
            removed.append(str(path))
        if removed or pinned_now:
            self.log.progress("checkpoints_pruned", paths=removed, keep_last=self.keep_last, pinned=pinned_now)
    # --8<-- [end:retention]

    # --- a run's lifetime --------------------------------------------------------------

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the directory's lock; then no other writer is alive, so clear their debris."""
        with DirectoryLock(self.root):
            self.remove_debris()
            yield

    def remove_debris(self) -> None:
        """Delete the temporary files of earlier writers (crashed saves, progress notes): only
        names this trainer gives them, and only the kind it makes.

        Raises:
            ConfigError: The progress note's name holds something this trainer did not write
                (a directory, a FIFO, a file of other content): replacing it every step would
                destroy it, so the run refuses the directory. A link is removed, never followed.
        """
        for name in self._names():
            path = self.root / name
            if (_SAVE_DEBRIS.fullmatch(name) and path.is_dir() and not path.is_symlink()
                    or _NOTE_DEBRIS.fullmatch(name) and path.is_file() and not path.is_symlink()):
                remove(path)
        note = self.root / PROGRESS
        if note.is_symlink():
            remove(note)  # the link goes, its target stays as it was
        elif note.exists() and self._noted_step() is None:
            raise ConfigError(f"checkpoint_dir {self.root} holds {PROGRESS}, which this trainer did not write "
                              f"({_kind(note)}); move it away or choose another directory")

    def record_progress(self, step: int, ctx: DistContext) -> None:
        """Rank 0 notes the furthest step reached, to count the steps a restart replays.

        Raises:
            CheckpointError: The note cannot be written (a full disk), as for a failed save.
        """
        if not ctx.is_main or self._lost:
            return
        try:
            self.ready_to_write()
        except CheckpointError as exc:
            return self._note_lost(step, exc)
        tmp = self.root / f".{PROGRESS}.{os.getpid()}.tmp"
        try:
            write_private(tmp, json.dumps({"step": step}).encode(), durable=False)  # a hint: no fsync
            os.replace(tmp, self.root / PROGRESS)
        except OSError as exc:
            remove(tmp)
            try:  # an `rm -rf` of the directory under the run, caught mid-way
                self.ready_to_write()
            except CheckpointError as lost:
                return self._note_lost(step, lost)
            if gone := vanished(exc, self.root):
                return self._note_lost(step, lock_lost(self.root, f"{gone.name}, written by this run, vanished"))
            raise CheckpointError(f"recording progress (step {step}) in {self.root} failed: {exc}; "
                                  "published checkpoints are untouched") from exc

    def _note_lost(self, step: int, lost: CheckpointError) -> None:
        """The lock is lost: write nothing more, and let the next save stop every rank at once."""
        self._lost = str(lost)
        self.log.emit("checkpoint_lock_lost", step=step, reason=self._lost)

    def steps_replayed(self, restored: int) -> int:
        """Steps between the restored one and the furthest one recorded: work a restart redoes."""
        reached = self._noted_step()
        return max(0, reached - restored) if reached else 0

    def _noted_step(self) -> int | None:
        """The step in the progress note; 0 for an empty one (a crash lost its unsynced write);
        None when there is no note of ours."""
        try:
            text = read_bounded(self.root / PROGRESS, _PROGRESS_CAP)
            note = json.loads(text) if text else {"step": 0}
        except (CheckpointError, ValueError):
            return None
        ours = isinstance(note, dict) and set(note) == {"step"} and type(note["step"]) is int
        return note["step"] if ours else None

    # --8<-- [start:checkpoint_save]
    def save(self, state: TrainState, cfg: TrainConfig, ctx: DistContext,
             faults: FaultInjector | None = None, saver: AsyncSaver | None = None) -> Path:
        """Write the checkpoint of `state.step` and publish it atomically.

        The layout that the parallelisms call for (`torch_save` or `dcp`) writes the model
        and optimizer; then every rank writes its own RNG file, rank 0 writes train.pt, the
        ranks agree that all of it is on disk, and rank 0 writes the manifest, renames the
        directory into place and applies retention (`finish_save`). With `saver`, all of
        that runs in the background once the state is copied, and training waits only for
        the capture. An error (a full disk) raises `CheckpointError`, here or from the next
        `saver.wait()`, and leaves the published checkpoints untouched. The first save
        proves that every rank sees the directory (`prove_shared`): node-local disks fail it.
        """
        t0 = time.perf_counter()
        faults = faults or FaultInjector.disabled()
        if saver:
            saver.wait()  # one save in flight at a time
        layout_name = checkpoint_layout(cfg)
        layout = LAYOUTS[layout_name]
        tmp, final = temporary_dir(self.root, state.step, ctx, self.ready_to_write), self.root / step_name(state.step)
        if not self._shared:  # node-local disks at one path: fail before any rank writes its part
            prove_shared(tmp, ctx)
            self._shared = True
        own: dict[str, Any] = {rank_file(ctx.rank): {"rank": ctx.rank, "rng": rng_state()}}
        if ctx.is_main:
            own[TRAIN_FILE] = {"step": state.step,
                               **{key: part.state_dict() if part is not None else None
                                  for key, part in state.replicated_parts().items()},
                               **layout.train_entries(state)}
        meta = {"format": FORMAT, "step": state.step, "epoch": state.sampler.epoch,
                "world_size": ctx.world_size, "mesh": state.mesh.describe(), "layout": layout_name,
                "config_digest": cfg.digest(), "resume_fields": cfg.resume_fields(),
                "torch_version": torch.__version__}
        publish = Publication(tmp, final, meta, self._published, self.log, faults, t0, self.ready_to_write)
        if layout.write(state, tmp, saver):  # the copy is taken; the write goes on in the background
            publish.blocked_s = time.perf_counter() - t0  # training resumes now
            saver.then(partial(finish_save, copy.deepcopy(own), publish, ctx, saver.group))  # type: ignore[union-attr]
            return final
        finish_save(own, publish, ctx)
        return final
    # --8<-- [end:checkpoint_save]

    def _published(self, final: Path) -> None:
        """What follows a publish: this checkpoint is valid (we wrote it), then retention."""
        self._remember_valid(final)
        self.retain(final)

    # --8<-- [start:checkpoint_restore]
    def restore(self, state: TrainState, cfg: TrainConfig, ctx: DistContext) -> int | None:
        """Load the newest valid checkpoint into `state`; return its step, or None if none.

        Rank 0 picks the checkpoint (falling back past torn, corrupt or unsafe ones) and
        broadcasts the choice; every rank then checks that it can load its part (a
        DCP plan against this mesh) before anything changes, and if any rank cannot,
        rank 0 picks the next older one. The model and optimizer are read by the layout
        that wrote them, which may differ from the one this run saves with.
        """
        t0 = time.perf_counter()
        refused: frozenset[str] = frozenset()
        while True:
            chosen = self.choose(refused) if ctx.is_main else None
            choice = [chosen[:2] if chosen else None]  # broadcast the choice, never the loaded state
            if ctx.distributed:
                dist.broadcast_object_list(choice, src=0)
            if choice[0] is None:
                return None
            path, manifest = choice[0]
            reason = _first_reason(_unfit(state, cfg, ctx, path, manifest, chosen.saved if chosen else None), ctx)
            if reason is None:
                break
            if ctx.is_main:
                self.log.emit("checkpoint_skipped", path=str(path), reason=reason)
            refused |= {path.name}
        check_compatible(manifest, cfg)
        saved = chosen.saved if chosen else load_weights_only(member(path, TRAIN_FILE))
        skip = set(cfg.resume_skip)
        LAYOUTS[manifest["layout"]].load(state, path, saved)
        for key, part in state.replicated_parts().items():
            if part is not None and saved[key] is not None and RESUME_NAMES.get(key, key) not in skip:
                part.load_state_dict(saved[key])
        state.step = saved["step"]
        rebase_schedule(state, cfg, manifest["resume_fields"], self.log)
        if "rng" not in skip:
            if manifest["world_size"] == ctx.world_size:
                set_rng_state(load_weights_only(member(path, rank_file(ctx.rank)))["rng"])
            else:  # another world size: no saved stream belongs to this rank
                torch.manual_seed(cfg.seed + ctx.rank + 7919 * state.step)
                self.log.progress("rng_reseeded", reason=f"world size {manifest['world_size']} -> {ctx.world_size}")
        self.log.progress("checkpoint_restored", step=state.step, path=str(path), restart_count=ctx.restart_count,
                          steps_replayed=self.steps_replayed(state.step),
                          restore_s=round(time.perf_counter() - t0, 4), skipped_parts=sorted(skip))
        if ctx.is_main and state.step < cfg.max_steps:  # at the end nothing is trained or deleted
            self.retain(path)
        return state.step
    # --8<-- [end:checkpoint_restore]


def _unfit(state: TrainState, cfg: TrainConfig, ctx: DistContext, path: Path, manifest: dict[str, Any],
           saved: dict[str, Any] | None) -> str | None:
    """Why this rank cannot load its part of `path` into `state`, or None when it can; nothing changes.

    Every rank checks its read plan and its own RNG file; rank 0, which loaded train.pt
    (`saved`) while choosing, checks that each part of it fits what it will be loaded into.
    """
    skip = set(cfg.resume_skip)
    try:
        LAYOUTS[manifest["layout"]].check_loadable(state, path)
        if saved is not None:
            check_parts(state, saved, manifest["layout"], skip)
        if "rng" not in skip and manifest["world_size"] == ctx.world_size:
            name = rank_file(ctx.rank)
            check_rng(load_weights_only(member(path, name))["rng"], f"{name}'s RNG state")
    except CheckpointError as exc:
        return str(exc)
    return None


def check_parts(state: TrainState, saved: dict[str, Any], layout: str, skip: set[str]) -> None:
    """Each part of train.pt that a restore loads fits the live object it goes into.

    Raises:
        CheckpointError: Naming the part and where it does not fit.
    """
    LAYOUTS[layout].check_entries(state, saved)
    for key, part in state.replicated_parts().items():
        if part is None or saved[key] is None or RESUME_NAMES.get(key, key) in skip:
            continue
        if part is state.sampler:  # its progress must also be one this step can have
            try:
                state.sampler.check_state(saved[key], saved["step"])
            except ValueError as exc:
                raise CheckpointError(f"{TRAIN_FILE}'s sampler: {exc}") from None
        else:
            same_structure(saved[key], part.state_dict(), f"{TRAIN_FILE}'s {key}")


def _first_reason(reason: str | None, ctx: DistContext) -> str | None:
    """Every rank's reason, agreed: the first rank's that has one, naming it."""
    if not ctx.distributed:
        return reason
    reasons: list[str | None] = [None] * ctx.world_size
    dist.all_gather_object(reasons, reason)
    return next((f"rank {r}: {text}" for r, text in enumerate(reasons) if text), None)


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


def _kind(path: Path) -> str:
    """What `path` is, in a few words, for a refusal."""
    mode = path.lstat().st_mode
    return ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a file of other content" if stat.S_ISREG(mode) else "not a regular file")

"""Save and restore a training state: the checkpoint contract, atomic, verified, per-rank.

The store (`reference_impl.checkpoint_store`) writes files, the manifest and the atomic
publish; the layout (`reference_impl.checkpoint_layout`) decides where the model and
optimizer go. This module puts them together, and restores the newest valid checkpoint,
falling back past torn or corrupt ones.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from reference_impl.checkpoint_layout import LAYOUTS
from reference_impl.checkpoint_store import (AsyncSaver, Publication, agree_written, barrier, gather_files,
                                             load_file, step_dir, temporary_dir, write_file)
from reference_impl.checkpoint_validate import (FORMAT, TRAIN_FILE, CheckpointError, check_compatible,
                                                check_contents, member, published, rank_file, read_manifest,
                                                verify)
from reference_impl.config import TrainConfig
from reference_impl.distributed import DistContext
from reference_impl.faults import FaultInjector
from reference_impl.housekeeping import prune, steps_replayed
from reference_impl.metrics import EventLog
from reference_impl.parallel import checkpoint_layout
from reference_impl.state import RESUME_NAMES, TrainState, rng_state, set_rng_state
from reference_impl.step import lr_multiplier

SCHEDULE_FIELDS = ("lr", "warmup_steps", "min_lr_ratio", "max_steps")  # what lr_multiplier reads


# --8<-- [start:checkpoint_save]
def save_checkpoint(state: TrainState, cfg: TrainConfig, ctx: DistContext, log: EventLog,
                    faults: FaultInjector | None = None, saver: AsyncSaver | None = None) -> Path:
    """Write the checkpoint of `state.step` and publish it atomically.

    Every rank writes its own RNG file and rank 0 writes train.pt; the layout that the
    parallelisms call for (`torch_save` or `dcp`) adds the model and optimizer, in the
    background when `saver` is given. Rank 0 then writes the manifest and renames the
    directory into place. An error (a full disk) raises `CheckpointError` and leaves the
    published checkpoints untouched.
    """
    t0 = time.perf_counter()
    faults = faults or FaultInjector.disabled()
    if saver:
        saver.wait()  # one save in flight at a time
    root, layout_name = Path(cfg.checkpoint_dir or ""), checkpoint_layout(cfg)
    layout = LAYOUTS[layout_name]
    tmp, final = temporary_dir(root, state.step, ctx), step_dir(root, state.step)
    limit, files, error = faults.write_limit(state.step), {}, None
    try:
        mine = rank_file(ctx.rank)
        files = {mine: write_file(tmp / mine, {"rank": ctx.rank, "rng": rng_state()}, limit)}
        faults.after_write(state.step, str(tmp / mine))
        if ctx.is_main:
            files[TRAIN_FILE] = write_file(tmp / TRAIN_FILE, {
                "step": state.step,
                **{key: part.state_dict() if part is not None else None
                   for key, part in state.replicated_parts().items()},
                **layout.train_entries(state),
            }, limit)
    except OSError as exc:
        error = exc
    agree_written(error, tmp, state.step, ctx)
    files = gather_files(files, ctx)
    meta = {"format": FORMAT, "step": state.step, "epoch": state.sampler.epoch,
            "world_size": ctx.world_size, "mesh": state.mesh.describe(), "layout": layout_name,
            "config_digest": cfg.digest(), "resume_fields": cfg.resume_fields(),
            "torch_version": torch.__version__}
    publish = Publication(tmp, final, meta, files, cfg.keep_last, log, faults, t0)
    if layout.write(state, tmp, saver):
        saver.publish_when_done(publish if ctx.is_main else None)  # type: ignore[union-attr]
        return final
    faults.before_publish(state.step)
    barrier(ctx)  # every rank's files are on disk before rank 0 publishes
    if ctx.is_main:
        publish()
    barrier(ctx)
    return final
# --8<-- [end:checkpoint_save]


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
    the choice, so every rank restores the same step. The model and optimizer are read
    by the layout that wrote them, which may differ from the one this run saves with.
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
    LAYOUTS[manifest["layout"]].load(state, path, saved)
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

"""`bench checkpoint`: our save and restore against raw torch.save/torch.load and the disk's
own write+fsync, and SIGKILL recovery against a bare torchrun restart."""

from __future__ import annotations

import argparse
import gc
import io
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from reference_impl.bench.common import (
    BenchmarkError,
    benchmark,
    int_list,
    interleave,
    launched,
    median,
    positive_int,
    report,
    settle,
    timed,
    trained_state,
)
from reference_impl.bench.floors import disk_write_floor, restart_floor
from reference_impl.checkpoint import CheckpointManager
from reference_impl.config import ConfigError, TrainConfig
from reference_impl.distributed import DistContext
from reference_impl.launch import torchrun_command
from reference_impl.metrics import EventLog
from reference_impl.parallel.registry import unwrap
from reference_impl.state import TrainState

RECOVERY_TIMEOUT_S = 300.0


def _add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="rounds per measurement (median reported), and SIGKILL recovery runs")
    parser.add_argument("--hidden-dims", type=int_list, default=(4096, 10000),
                        help="model sizes: comma-separated --hidden-dim values, one measurement each "
                             "(MLP: 4096 is 16.9M parameters, 10000 is 100.4M)")


def _raw_state(state: TrainState) -> dict[str, Any]:
    return {"model": unwrap(state.model).state_dict(), "optimizer": state.optimizer.state_dict()}


def checkpoint_round_trip(cfg: TrainConfig, rounds: int) -> dict[str, Any]:
    """Time our save and restore of one model size against raw `torch.save`/`torch.load`.

    In one process on the CPU, a model trained `cfg.max_steps` steps (so AdamW's two
    moments exist) is saved, in interleaved rounds, three ways into one directory:

    * ours: `CheckpointManager.save` (DDP layout: `torch.save` of model, optimizer, schedule and
      sampler, fsync and XXH3 of every file, read back from the page cache, manifest, atomic rename);
    * raw: `torch.save({"model": ..., "optimizer": ...}, path)`, without fsync: the data
      may still be in the page cache when the clock stops;
    * raw+fsync: the same followed by `os.fsync` of the file, a durable baseline;
    * floor: the disk writing and fsyncing as many bytes as our checkpoint holds, with
      `O_DIRECT` where the file system allows it
      ([`disk_write_floor`][reference_impl.bench.floors.disk_write_floor]).

    Then the newest files are restored, in interleaved rounds: ours with
    `CheckpointManager.restore` (verify every file's XXH3, load with `weights_only=True`,
    load the state dicts) and raw with `torch.load(weights_only=True)` and the same two
    `load_state_dict` calls. Every case starts after an untimed `os.sync()`, and every
    save case removes its files once its clock stops, so each save starts from the same
    disk; restores read files the page cache holds, for both sides.

    Args:
        cfg: The run whose state is saved; `hidden_dim` sets the size.
        rounds: Timed rounds per case; medians are reported.

    Returns:
        Parameter count, state bytes, median seconds per case, the ratios of the medians
        and of each case's fastest round (`best_save_ratio_fsync`, `best_save_floor_ratio`),
        and every round's seconds per case (`save_ours_s_all`, ...).
    """
    ctx, log = DistContext(), EventLog(0, io.StringIO())
    state = trained_state(cfg, ctx)
    root = Path(tempfile.mkdtemp(prefix="bench-checkpoint-"))
    ckpt_cfg, raw = replace(cfg, checkpoint_dir=str(root)), root / "raw.pt"
    ckpt = CheckpointManager(root, log, ckpt_cfg.keep_last)

    def write_ours() -> None:
        ckpt.save(state, ckpt_cfg, ctx)

    def write_raw(fsync: bool) -> None:
        torch.save(_raw_state(state), raw)
        if fsync:
            fd = os.open(raw, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def remove_outputs() -> None:
        for _, step_dir in ckpt.steps():
            shutil.rmtree(step_dir)
        raw.unlink(missing_ok=True)

    def save(write: Callable[[], None]) -> float:
        # Each save starts from the same disk: no output of an earlier case, nothing dirty.
        # Removing this case's output afterwards also drops raw's unsynced pages, which
        # would otherwise be written back at the next case's start, on a disk (a VM's
        # virtual one here) that is then slower for the next seconds.
        settle(ctx)
        try:
            return timed(write)
        finally:
            remove_outputs()

    def load_raw() -> None:
        saved = torch.load(raw, map_location="cpu", weights_only=True)
        unwrap(state.model).load_state_dict(saved["model"])
        state.optimizer.load_state_dict(saved["optimizer"])

    def restore(fn: Callable[[], object]) -> float:
        gc.collect()  # the previous case's loaded copy is freed before, not during, the timing
        settle(ctx)
        return timed(fn)

    def save_floor() -> float:
        settle(ctx)
        seconds, method = disk_write_floor(root, checkpoint_bytes)
        floor_methods.add(method)
        return seconds

    try:
        write_ours()  # untimed: how many bytes a checkpoint of this state holds
        checkpoint_bytes = sum(f.stat().st_size for _, step_dir in ckpt.steps() for f in step_dir.rglob("*"))
        remove_outputs()
        floor_methods: set[str] = set()
        save_cases: dict[str, Callable[[], float]] = {
            "ours": partial(save, write_ours), "raw": partial(save, partial(write_raw, False)),
            "raw_fsync": partial(save, partial(write_raw, True)), "floor": save_floor}
        saves = interleave(rounds, save_cases)
        write_ours()  # untimed: the files the restores read
        write_raw(True)
        restores = interleave(rounds, {"ours": partial(restore, lambda: ckpt.restore(state, ckpt_cfg, ctx)),
                                       "raw": partial(restore, load_raw)})
        state_bytes = raw.stat().st_size
    finally:
        shutil.rmtree(root, ignore_errors=True)
    save_s = {name: median(t) for name, t in saves.items()}
    restore_s = {name: median(t) for name, t in restores.items()}
    return {
        "hidden_dim": cfg.hidden_dim, "params": sum(p.numel() for p in state.model.parameters()),
        "state_bytes": state_bytes, "checkpoint_bytes": checkpoint_bytes,
        "save_ours_s": round(save_s["ours"], 4), "save_raw_s": round(save_s["raw"], 4),
        "save_raw_fsync_s": round(save_s["raw_fsync"], 4), "save_floor_s": round(save_s["floor"], 4),
        "floor_method": "/".join(sorted(floor_methods)),
        "restore_ours_s": round(restore_s["ours"], 4), "restore_raw_s": round(restore_s["raw"], 4),
        "save_ratio": round(save_s["ours"] / save_s["raw"], 4),
        "save_ratio_fsync": round(save_s["ours"] / save_s["raw_fsync"], 4),
        "save_floor_ratio": round(save_s["ours"] / save_s["floor"], 4),
        "restore_ratio": round(restore_s["ours"] / restore_s["raw"], 4),
        # Every round, in order: a virtual disk can take an identical write several times as long
        # from one minute to the next, and a median of a few rounds hides which case it hit. The
        # fastest round of each case is each one on the disk at its best.
        "best_save_ratio_fsync": round(min(saves["ours"]) / min(saves["raw_fsync"]), 4),
        "best_save_floor_ratio": round(min(saves["ours"]) / min(saves["floor"]), 4),
        **{f"save_{name}_s_all": [round(t, 6) for t in times] for name, times in saves.items()},
        **{f"restore_{name}_s_all": [round(t, 6) for t in times] for name, times in restores.items()},
    }


def recovery_times(events: Sequence[dict[str, Any]]) -> tuple[float, float]:
    """Seconds from the kill to the restore, and to the first step after it.

    The kill is dated by attempt 0's last `step` event: with `--log-every 1` rank 0
    logs every step, and the failing rank dies just before the next one.

    Args:
        events: The run's events (rank 0's progress across both attempts), in order.

    Returns:
        (kill to `checkpoint_restored` of attempt 1, kill to attempt 1's first `step`).

    Raises:
        BenchmarkError: The events do not show a kill, a restore and a resumed step.
    """
    names = [(e.get("event"), e.get("restart_count")) for e in events]
    try:
        restart = names.index(("run_start", 1))
        killed = [e for e in events[:restart] if e["event"] == "step"][-1]["time"]
        restored = names.index(("checkpoint_restored", 1), restart)
        resumed = next(e for e in events[restored:] if e["event"] == "step")["time"]
    except (ValueError, IndexError, StopIteration):
        raise BenchmarkError("the recovery run did not show a kill, a restore and a resumed step") from None
    return events[restored]["time"] - killed, resumed - killed


def recovery_run() -> tuple[float, float]:
    """Kill rank 1 of a 2-rank torchrun job at step 15, let torchrun restart it, time it.

    The job is the trainer's small default MLP, checkpointing every 10 steps, so the
    numbers are the restart machinery (process start, rendezvous, verified restore),
    not checkpoint I/O.

    Returns:
        (kill to restore, kill to the first resumed step) in seconds, from the events'
        wall-clock `time` fields.

    Raises:
        BenchmarkError: The job failed, timed out or did not resume.
    """
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as root:
        flags = ["--max-steps", "30", "--warmup-steps", "0", "--micro-batch-size", "8",
                 "--dataset-size", "512", "--device", "cpu", "--checkpoint-dir", root,
                 "--checkpoint-every", "10", "--fail-at-step", "15", "--fail-rank", "1", "--log-every", "1"]
        run = launched(torchrun_command(2, "reference_impl.train", flags, max_restarts=1), RECOVERY_TIMEOUT_S)
    if run.returncode != 0:
        raise BenchmarkError(f"the recovery run failed (exit {run.returncode}): "
                             f"{run.failure()}")
    return recovery_times(run.events)


@benchmark("checkpoint", "save/restore of our checkpoints against raw torch.save/torch.load, "
                         "and SIGKILL-to-resumed-step recovery under torchrun",
           train_defaults=("--model", "mlp", "--micro-batch-size", "8", "--dataset-size", "64",
                           "--max-steps", "1", "--warmup-steps", "0", "--device", "cpu", "--keep-last", "1"),
           add_arguments=_add_checkpoint_arguments)


def checkpoint(args: argparse.Namespace, cfg: TrainConfig) -> dict[str, Any]:
    """Checkpoint cost per model size ([`checkpoint_round_trip`][reference_impl.bench.checkpoint.checkpoint_round_trip])
    and restart latency ([`recovery_run`][reference_impl.bench.checkpoint.recovery_run]).

    Args:
        args: `--rounds` and `--hidden-dims`.
        cfg: The single-process run whose state is saved, one size per `--hidden-dims` entry.
    """
    if cfg.world_size != 1:
        raise ConfigError("checkpoint runs in one process (it starts its own torchrun job); "
                          "run it with python -m, not torchrun")
    sizes = []
    for hidden_dim in args.hidden_dims:
        sizes.append(checkpoint_round_trip(replace(cfg, hidden_dim=hidden_dim), args.rounds))
        gc.collect()
    runs, floors = [], []
    for _ in range(args.rounds):  # alternated, so drifting load reaches both alike
        runs.append(recovery_run())
        floors.append(restart_floor(RECOVERY_TIMEOUT_S))
    restored, resumed = zip(*runs, strict=True)
    floor, ddp_floor = median([f.group_s for f in floors]), median([f.ddp_s for f in floors])
    rows: list[list[Any]] = []
    for s in sizes:
        size = [f"{s['params'] / 1e6:.1f}M", f"{s['state_bytes'] / 1e6:.0f}"]
        rows.append([*size, "save", s["save_ours_s"], s["save_raw_s"], s["save_raw_fsync_s"], s["save_floor_s"],
                     s["save_ratio"], s["save_ratio_fsync"], s["save_floor_ratio"]])
        rows.append([*size, "restore", s["restore_ours_s"], s["restore_raw_s"], "", "", s["restore_ratio"], "", ""])
    rows.append(["2 ranks", "", "SIGKILL->restored", median(restored), "", "", "", "", "", ""])
    rows.append(["2 ranks", "", "SIGKILL->1st step", median(resumed), "", "", floor, "", "", median(resumed) / floor])
    rows.append(["2 ranks", "", "  floor + DDP, optimizer", "", "", "", ddp_floor, "", "",
                 median(resumed) / ddp_floor])
    return report("checkpoint", ["params", "MB", "operation", "ours s", "raw s", "raw+fsync s", "floor s",
                                 "ours/raw", "ours/(raw+fsync)", "ours/floor"], rows, {
        "sizes": sizes,
        "max_save_ratio": max(s["save_ratio"] for s in sizes),
        "max_save_ratio_fsync": max(s["save_ratio_fsync"] for s in sizes),
        "max_save_floor_ratio": max(s["save_floor_ratio"] for s in sizes),
        "max_restore_ratio": max(s["restore_ratio"] for s in sizes),
        "recovery_restored_s": round(median(restored), 3), "recovery_s": round(median(resumed), 3),
        "recovery_s_all": [round(t, 3) for t in resumed],
        "recovery_floor_s": round(floor, 3), "recovery_floor_s_all": [round(f.group_s, 3) for f in floors],
        "recovery_floor_ratio": round(median(resumed) / floor, 4),
        "recovery_ddp_floor_s": round(ddp_floor, 3),
        "recovery_ddp_floor_s_all": [round(f.ddp_s, 3) for f in floors],
        "recovery_ddp_floor_ratio": round(median(resumed) / ddp_floor, 4), "raw_save_fsync": False,
        "rounds": args.rounds, "model": cfg.model, "config_digest": cfg.digest(),
    })

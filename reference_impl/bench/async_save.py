"""`bench async`: how long an async FSDP checkpoint blocks training, against a sync save."""

from __future__ import annotations

import argparse
import io
import itertools
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from reference_impl.bench.common import (
    add_rounds_argument,
    benchmark,
    interleave,
    median,
    remove_shared,
    report,
    settle,
    shared_tempdir,
    slowest,
    trained_state,
)
from reference_impl.checkpoint import AsyncSaver, CheckpointManager
from reference_impl.config import ConfigError, TrainConfig
from reference_impl.distributed import DistContext, distributed
from reference_impl.metrics import EventLog
from reference_impl.state import TrainState


def checkpoint_stall(state: TrainState, cfg: TrainConfig, ctx: DistContext, rounds: int) -> dict[str, list[float]]:
    """Seconds training waits for a sync FSDP save and for an async one, in interleaved rounds,
    and the floor under the async stall: a copy of the same state into buffers that exist.

    Each save is `CheckpointManager.save` of the same state into a fresh directory, timed
    from the call to its return; the async one (`saver=AsyncSaver()`) returns while DCP
    copies the state on a thread of its own, is then waited for until the copy is done
    (`staged`: what the next optimizer step would wait for if no forward and backward ran
    in between), and then until written and published (`total`). Every value is the
    slowest rank's. One untimed save of each kind comes
    first (DCP's planning, the saver's gloo group). The floor copies this rank's shards of
    the parameters and optimizer state into preallocated host buffers (pinned for GPU
    state), already touched, so it is the memcpy an async save cannot avoid.

    Args:
        state: An FSDP state; every rank calls this.
        cfg: Its config (`checkpoint_dir` is replaced by a scratch directory).
        ctx: This rank's context.
        rounds: Timed rounds.

    Returns:
        `sync`, `blocked` (async, until `CheckpointManager.save` returned), `staged`,
        `async_total` and `floor` seconds, one value per round.
    """
    root, saver, log = shared_tempdir(ctx), AsyncSaver(cfg.pg_timeout_s), EventLog(ctx.rank, io.StringIO())
    saves = itertools.count()

    def save(background: bool, proven: bool = True) -> tuple[float, ...]:
        path = root / str(next(saves))
        manager = CheckpointManager(path, log)
        # A run proves once, at its first save, that every rank sees its directory; the
        # untimed first save here proved it for `root`, so timed saves leave it out.
        manager._shared = proven
        settle(ctx)
        t0 = time.perf_counter()
        manager.save(state, replace(cfg, checkpoint_dir=str(path)), ctx, saver=saver if background else None)
        returned = time.perf_counter() - t0
        saver.wait_staged()  # what the next optimizer step would wait for, with no compute to overlap
        staged = time.perf_counter() - t0
        saver.wait()
        done = time.perf_counter() - t0
        remove_shared(path, ctx)
        return slowest(ctx, returned, staged, done)

    sources = _state_tensors(state)
    # GPU state: pinned buffers, the fastest a device-to-host copy can land (pageable memory
    # goes through a bounce buffer), so the floor is the link's, not the bounce's.
    buffers = [torch.empty_like(t, device="cpu", pin_memory=t.is_cuda) for t in sources]

    def copy() -> tuple[float, ...]:
        settle(ctx)
        t0 = time.perf_counter()
        for buffer, source in zip(buffers, sources, strict=True):
            buffer.copy_(source, non_blocking=True)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        return slowest(ctx, time.perf_counter() - t0)

    try:
        save(False, proven=False)
        save(True)
        copy()  # touches every buffer page once, as a reused stager's buffers are
        cases: dict[str, Callable[[], tuple[float, ...]]] = {
            "sync": partial(save, False), "async": partial(save, True), "floor": copy}
        times = interleave(rounds, cases)
    finally:
        remove_shared(root, ctx)
    return {"sync": [t[0] for t in times["sync"]], "blocked": [t[0] for t in times["async"]],
            "staged": [t[1] for t in times["async"]], "async_total": [t[2] for t in times["async"]],
            "floor": [t[0] for t in times["floor"]]}


def _state_tensors(state: TrainState) -> list[torch.Tensor]:
    """This rank's parameters and optimizer state, as local tensors (a DTensor's own shard)."""
    found = [*state.model.parameters(), *(t for per_param in state.optimizer.state.values()
                                         for t in per_param.values() if isinstance(t, torch.Tensor))]
    return [t.to_local() if isinstance(t, DTensor) else t for t in found]


def stall_summary(stall: dict[str, list[float]]) -> dict[str, float]:
    """Medians of a `checkpoint_stall` result and the ratios to the sync save and the floor."""
    medians = {name: median(t) for name, t in stall.items()}
    return {"sync_s": round(medians["sync"], 4), "blocked_s": round(medians["blocked"], 4),
            "staged_s": round(medians["staged"], 4), "async_total_s": round(medians["async_total"], 4),
            "blocked_ratio": round(medians["blocked"] / medians["sync"], 4),
            "floor_s": round(medians["floor"], 4),
            "blocked_floor_ratio": round(medians["blocked"] / medians["floor"], 4),
            "staged_floor_ratio": round(medians["staged"] / medians["floor"], 4)}


def _check_async(args: argparse.Namespace, cfg: TrainConfig) -> None:
    if cfg.strategy != "fsdp":
        raise ConfigError("async checkpoints are FSDP-only (--strategy fsdp)")


@benchmark("async", "how long an async FSDP checkpoint blocks training against a sync save "
                    "(torchrun, CPU/gloo by default)",
           train_defaults=("--model", "transformer", "--strategy", "fsdp", "--d-model", "512",
                           "--n-layers", "8", "--n-heads", "8", "--hidden-dim", "2048",
                           "--micro-batch-size", "4", "--dataset-size", "64", "--max-steps", "1",
                           "--warmup-steps", "0", "--device", "cpu"),
           add_arguments=add_rounds_argument, nproc=2, check=_check_async)


def async_checkpoint(args: argparse.Namespace, cfg: TrainConfig) -> dict[str, Any]:
    """Async versus sync `CheckpointManager.save` of one FSDP state (25.2M parameters by default).

    Runs on every rank under torchrun; rank 0 reports. See
    [`checkpoint_stall`][reference_impl.bench.async_save.checkpoint_stall] for what is timed.

    Args:
        args: `--rounds` (and `--nproc`, used by the launcher).
        cfg: The FSDP run whose state is saved, after `max_steps` steps of training.
    """
    with distributed(cfg.device, cfg.pg_timeout_s) as ctx:
        state = trained_state(cfg, ctx)
        params = sum(p.numel() for p in state.model.parameters())  # DTensors: global sizes
        stall = checkpoint_stall(state, cfg, ctx, args.rounds)
        if not ctx.is_main:
            return {}
        summary = stall_summary(stall)
        rows = [["sync save", summary["sync_s"], min(stall["sync"]), max(stall["sync"])],
                ["async, until save() returned", summary["blocked_s"], min(stall["blocked"]), max(stall["blocked"])],
                ["async, until the copy is done", summary["staged_s"], min(stall["staged"]), max(stall["staged"])],
                ["async, until published", summary["async_total_s"], min(stall["async_total"]),
                 max(stall["async_total"])],
                ["copy into preallocated buffers (floor)", summary["floor_s"], min(stall["floor"]),
                 max(stall["floor"])],
                ["blocked/sync", summary["blocked_ratio"], "", ""],
                ["blocked/floor", summary["blocked_floor_ratio"], "", ""],
                ["copied/floor", summary["staged_floor_ratio"], "", ""]]
        return report("async", ["save", "median s", "min", "max"], rows, {
            **summary, "params": params, "world_size": ctx.world_size, "device": str(ctx.device),
            "rounds": args.rounds, "config_digest": cfg.digest(),
        })

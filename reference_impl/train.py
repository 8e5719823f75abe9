"""The training loop and the command line: `python -m reference_impl.train --help`.

Run it alone on one process, or under torchrun for one process per device:

    torchrun --standalone --nproc-per-node 2 -m reference_impl.train --max-steps 50
"""

from __future__ import annotations

import functools
import math
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from reference_impl.checkpoint import AsyncSaver, CheckpointError, CheckpointManager, IncompatibleCheckpoint
from reference_impl.checkpoint.files import make_dir
from reference_impl.checkpoint.manifest import check_compatible
from reference_impl.config import ConfigError, TrainConfig
from reference_impl.data import Batch, ResumableDistributedSampler, Sample
from reference_impl.distributed import (
    DistContext,
    distributed,
    env_count,
    exit_after,
    launch_env,
    node_ranks,
    pick_device,
    rendezvous_address,
)
from reference_impl.metrics import EventLog, PhaseTimer, Throughput
from reference_impl.model import build_model, spec_of
from reference_impl.parallel.experts import take_stats
from reference_impl.parallel.registry import build_runner, dims_of, parallelize, shard_data
from reference_impl.reliability.faults import FaultInjector, Watchdog
from reference_impl.reliability.lifecycle import PREEMPTED_EXIT, Preemption, die_with_parent, loader_worker_init
from reference_impl.reliability.nonfinite import NonFiniteGuard, NonFiniteLoss
from reference_impl.reliability.stragglers import StragglerMonitor
from reference_impl.sample_log import SampleLog, sample_log_files
from reference_impl.state import TrainState, state_digest
from reference_impl.step import build_optimizer, build_scaler, build_scheduler, pipeline_train_step, train_step


def build_dataset(cfg: TrainConfig) -> Dataset[Sample]:
    """The synthetic dataset of `cfg.model` (its spec's), generated from `cfg.seed`."""
    return spec_of(cfg).dataset(cfg)


def build_state(cfg: TrainConfig, ctx: DistContext, replicas: int = 1, replica: int = 0) -> TrainState:
    """Model, optimizer, schedule, scaler and data pipeline for this rank.

    The sampler shards the data over the data-parallel ranks only: the ranks of one
    tensor-parallel group, and the stages of one pipeline, read the same samples.
    `replicas` independent copies of this job (`reference_impl.ft`) each take their own
    shard: replica `replica` reads the data-parallel slots after those of the replicas before it.
    """
    dataset, mesh = build_dataset(cfg), dims_of(cfg, ctx.device.type)
    dataset = shard_data(dataset, cfg, mesh, ctx.rank)  # under context parallel: its chunks of every sequence
    dp_rank = replica * mesh.dp_size + mesh.dp_rank(ctx.rank)
    sampler = ResumableDistributedSampler(cfg.dataset_size, world_size=mesh.dp_size * replicas, rank=dp_rank,
                                          global_batch_size=cfg.global_batch_size * replicas, seed=cfg.seed)
    # The loader's own generator seeds its workers, so creating an iterator (at an epoch
    # start, or mid-epoch after a resume) never draws from the global RNG that dropout uses.
    # Its workers take SIGTERM only from the rank: a preemption stops the rank, which stops them.
    loader = DataLoader(dataset, batch_size=cfg.micro_batch_size, sampler=sampler,
                        num_workers=cfg.num_workers, pin_memory=ctx.device.type == "cuda",
                        generator=torch.Generator().manual_seed(cfg.seed + dp_rank),
                        worker_init_fn=loader_worker_init)
    model = parallelize(build_model(cfg), mesh, cfg, ctx)  # under pipeline parallel: this rank's stage
    pipeline = build_runner(model, cfg, mesh, ctx.device)  # pipeline parallel's schedule, else None
    optimizer = build_optimizer(model, cfg)
    return TrainState(model, optimizer, build_scheduler(optimizer, cfg),
                      build_scaler(cfg, ctx.device), sampler, loader, mesh, pipeline)




def step_batches(state: TrainState, cfg: TrainConfig) -> Iterator[Iterator[Batch]]:
    """For each remaining optimizer step, the iterator its micro-batches come from.

    A new DataLoader iterator starts at every epoch boundary and after a resume; it begins
    at the sampler's committed position, so a resumed run continues mid-epoch.
    """
    per_rank_step = cfg.micro_batch_size * cfg.grad_accum_steps
    while True:
        state.sampler.set_epoch(state.step // state.sampler.steps_per_epoch)
        batches = iter(state.loader)
        for _ in range(len(state.sampler) // per_rank_step):
            yield batches


def use_deterministic_kernels() -> None:
    """Make every kernel deterministic, so that equal inputs give bit-equal results on a GPU.

    Atomics-based kernels (the embedding's and attention's backward, index_add) sum in
    whatever order threads finish; their deterministic variants do not. cuBLAS reads its
    workspace setting when its handle is created, at the first matmul, which comes later.
    An op without a deterministic variant warns (naming itself) instead of failing the run.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)


# --8<-- [start:train_loop]
def train(cfg: TrainConfig, ctx: DistContext, log: EventLog, state: TrainState | None = None,
          on_step: Callable[[TrainState], None] | None = None) -> TrainState:
    """Resume if a checkpoint exists, train to `cfg.max_steps`, return the final state."""
    if cfg.deterministic:
        use_deterministic_kernels()
    torch.manual_seed(cfg.seed + ctx.rank)  # per-rank stream (dropout); weights are seeded apart
    state = state or build_state(cfg, ctx)
    timer, meter, samples = PhaseTimer(ctx.device), Throughput(), SampleLog(cfg.sample_log, ctx)
    faults, saver = FaultInjector(cfg, ctx), AsyncSaver(cfg.pg_timeout_s) if cfg.async_checkpoint else None
    if saver:  # the optimizer step, the first write to the parameters, waits for the save's copy
        saver.guard(state.optimizer)
    ckpt = CheckpointManager(Path(cfg.checkpoint_dir), log, cfg.keep_last) if cfg.checkpoint_dir else None
    log.progress("run_start", config_digest=cfg.digest(), world_size=ctx.world_size, mesh=state.mesh.describe(),
                 global_batch_size=cfg.global_batch_size, device=str(ctx.device),
                 backend=ctx.backend or "none", restart_count=ctx.restart_count)
    with timer.phase("restore", host=True):
        samples.truncate((ckpt.restore(state, cfg, ctx) if ckpt else None) or 0)
    # fp16: the GradScaler skips the steps whose gradients overflow, so it needs no guard.
    guard = NonFiniteGuard(state.model, cfg, ctx, log) if cfg.precision != "fp16" else None
    stragglers, rolled_back = StragglerMonitor(cfg, ctx, log, timer), set[int]()
    state.model.train()
    try:
        # A failure is reported innermost, while Preemption still holds SIGTERM: a launcher
        # stops a failed rank's survivors with it, just as their own collectives fail too.
        with (Watchdog(cfg.step_timeout_s, timer, log) as watchdog,
              Preemption(cfg.preempt_grace_s, ctx, log) as stop,
              failures_reported(log, timer, state)):
            steps = step_batches(state, cfg)
            while state.step < cfg.max_steps:  # a restore at or past the end trains nothing
                batches, started = next(steps), stragglers.start_step()
                faults.before_step(state.step + 1, state.model)
                approve = functools.partial(guard.approve, step=state.step + 1) if guard else None
                if state.pipeline:
                    loss, indices = pipeline_train_step(state.pipeline, state.model, batches, state.optimizer,
                                                        state.scheduler, cfg, ctx.device, timer, approve)
                else:
                    loss, indices = train_step(state.model, batches, state.optimizer, state.scheduler,
                                               state.scaler, cfg, ctx.device, timer, approve)
                bad_ranks = guard.bad_ranks if guard else []  # non-empty: no rank applied the update
                if bad_ranks and cfg.nonfinite_policy != "skip":
                    roll_back(state, cfg, ctx, log, bad_ranks, ckpt, samples, saver, rolled_back)
                    steps = step_batches(state, cfg)  # the data resumes where the checkpoint left it
                    continue
                state.sampler.commit(cfg.global_batch_size)  # trained, not merely prefetched
                state.step += 1
                stragglers.end_step(state.step, started)
                meter.add(cfg.global_batch_size)
                samples.append(state.step, state.sampler.epoch, indices, skipped=bool(bad_ranks))
                if bad_ranks:
                    log.progress("step_skipped", step=state.step, ranks=bad_ranks)
                if ckpt:
                    ckpt.record_progress(state.step, ctx)
                if on_step:
                    on_step(state)
                if state.step % cfg.log_every == 0 or state.step == cfg.max_steps:
                    log_step(state, cfg, ctx, log, loss, timer, meter)
                state.preempted = stop.should_stop(state.step)  # every rank stops after the same step
                if ckpt and (cfg.is_checkpoint_step(state.step) or state.preempted):
                    with timer.phase("checkpoint", host=True):
                        ckpt.save(state, cfg, ctx, faults, saver)
                watchdog.beat()
                if state.preempted:
                    break
            if saver:
                saver.wait()  # the last checkpoint is published before the run reports success
    finally:
        if saver:
            saver.close()  # its hook on the optimizer, its copying thread and buffers
    return state


@contextmanager
def failures_reported(log: EventLog, timer: PhaseTimer, state: TrainState) -> Iterator[None]:
    """Report any failure with the rank, the phase and the step it happened in, then re-raise it."""
    try:
        yield
    except Exception as exc:
        log.error(timer.current, exc, step=state.step)
        raise
# --8<-- [end:train_loop]


# --8<-- [start:roll_back]
def roll_back(state: TrainState, cfg: TrainConfig, ctx: DistContext, log: EventLog, bad_ranks: list[int],
              ckpt: CheckpointManager | None, samples: SampleLog, saver: AsyncSaver | None,
              rolled_back: set[int]) -> None:
    """After a step whose update every rank dropped: stop, or restore the last checkpoint.

    Raises:
        NonFiniteLoss: The policy is `stop`; or there is no checkpoint to roll back to; or
            this step went non-finite again after a rollback, so the fault repeats and
            another rollback would loop forever.
    """
    step = state.step + 1
    where = f"non-finite loss on rank {', '.join(map(str, bad_ranks))} at step {step}"
    if cfg.nonfinite_policy == "stop":
        raise NonFiniteLoss(f"{where}; halting before it is checkpointed")
    if step in rolled_back:
        raise NonFiniteLoss(f"{where} again after rolling back: the fault repeats")
    if saver:
        saver.wait()  # the newest checkpoint may still be on its way to the disk
    restored = ckpt.restore(state, cfg, ctx) if ckpt else None
    if restored is None:
        raise NonFiniteLoss(f"{where} before any checkpoint to roll back to")
    rolled_back.add(step)
    samples.truncate(restored)  # the log keeps describing the history the weights went through
    log.progress("rollback", step=step, restored_step=restored)
# --8<-- [end:roll_back]


def log_step(state: TrainState, cfg: TrainConfig, ctx: DistContext, log: EventLog,
             loss: torch.Tensor, timer: PhaseTimer, meter: Throughput) -> None:
    """Emit a progress event: the step's loss is `null` when the step was skipped as non-finite."""
    if ctx.distributed:
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # report the global mean, not rank 0's
    value = loss.item()
    shown = value if math.isfinite(value) else None  # fp16 overflow, or a skipped step
    # Mixture of experts: the last micro-batch's load-balancing loss (part of `loss`) and the
    # (token, expert) assignments this rank dropped over capacity since the last log.
    moe = take_stats(state.model) if cfg.n_experts else {}
    log.progress("step", step=state.step, epoch=state.sampler.epoch, loss=shown, **moe,
                 lr=state.scheduler.get_last_lr()[0], samples_per_s=round(meter.rate(), 1),
                 phase_s={k: round(v, 6) for k, v in timer.flush().items()})


def preflight(cfg: TrainConfig, ranks_per_node: int | None = None) -> None:
    """Checks that need no process group: the device exists, the paths are usable, the
    checkpoint fits the config.

    Args:
        cfg: The run.
        ranks_per_node: Ranks a launcher is about to start on this node; by default the
            count in this process's own torchrun environment.

    Raises:
        ConfigError: torchrun's variables are malformed or inconsistent, the device is
            missing (or has fewer GPUs than ranks on this node), a path is not a directory,
            the sample log cannot be written or holds a rank file that is not a regular file,
            or the newest checkpoint is incompatible.
    """
    launched = "WORLD_SIZE" in os.environ
    try:
        if launched:
            launch_env()
        else:
            env_count("RANK", "0")
        pick_device(cfg.device, *((0, ranks_per_node) if ranks_per_node else node_ranks()))
    except RuntimeError as exc:
        raise ConfigError(str(exc)) from None
    for name in ("checkpoint_dir", "sample_log"):
        if getattr(cfg, name):
            check_directory(Path(getattr(cfg, name)), name)
    if cfg.sample_log:
        check_writable(Path(cfg.sample_log), "sample_log")
        sample_log_files(Path(cfg.sample_log))
    manifest = (CheckpointManager(Path(cfg.checkpoint_dir), EventLog(0, sys.stderr)).newest_manifest()
                if cfg.checkpoint_dir else None)
    if manifest is not None:
        try:
            check_compatible(manifest, cfg)
        except IncompatibleCheckpoint as exc:
            raise ConfigError(str(exc)) from None
    if launched:  # last: a config or checkpoint at fault says more than a missing address
        try:
            rendezvous_address()
        except RuntimeError as exc:
            raise ConfigError(str(exc)) from None


def check_directory(path: Path, name: str) -> None:
    """`path` is a directory or can become one: its nearest existing ancestor is a directory.

    Raises:
        ConfigError: `path`, or a component of it, is a file, a FIFO or a link that leads
            nowhere (dangling, or a loop).
    """
    existing = next(p for p in (path, *path.parents) if p.exists() or p.is_symlink())
    if not existing.is_dir():
        what = ("a link that leads nowhere" if not existing.exists()
                else "a FIFO" if existing.is_fifo() else "a file")
        raise ConfigError(f"{name} {path} is not a directory ({existing} is {what})")


def check_writable(path: Path, name: str) -> None:
    """`path` is a directory this process can create files in (creating it if needed).

    Checked by writing: permission bits do not tell (root ignores them; a read-only
    mount does not show in them).

    Raises:
        ConfigError: The directory cannot be created, or a file cannot be created in it.
    """
    probe = path / f".probe-{socket.gethostname()}-{os.getpid()}"
    try:
        make_dir(path)
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(f"{name} {path} is not writable: {exc.strerror}") from None


def start(argv: list[str] | None, stack: ExitStack) -> TrainConfig:
    """Parse and check the flags; global rank 0 takes the checkpoint directory's lock.

    Raises:
        ConfigError: Bad input, an incompatible checkpoint, or a directory in use.
    """
    cfg = TrainConfig.from_cli(argv)
    preflight(cfg)
    if cfg.checkpoint_dir and os.environ.get("RANK", "0") == "0":
        stack.enter_context(CheckpointManager(Path(cfg.checkpoint_dir), EventLog(0, sys.stderr)).lock())
    return cfg


QUIET_RANK_WAIT_S = 10.0  # how long a rank that prints nothing outlives a bad config


def main(argv: list[str] | None = None) -> int:
    """Parse flags, train inside a process group, print `run_complete`.

    Returns 2 on bad input, 1 when a non-finite loss or a failed save halted the run (a full
    disk, a lost directory lock; each printed once per node, by local rank 0), and
    `PREEMPTED_EXIT` after SIGTERM stopped the run with a checkpoint.
    """
    die_with_parent()
    with ExitStack() as stack:
        try:
            return run(start(argv, stack))
        except (ConfigError, IncompatibleCheckpoint) as exc:
            # The second is found at the restore when the newest checkpoint is unusable and
            # the one before it was saved by another config: the same refusal, on every rank.
            return one_line(exc, 2)
        except (NonFiniteLoss, CheckpointError) as exc:  # every rank halts on the same step (a
            # failed or refused save is agreed by all ranks); the event log has the details
            return one_line(exc, 1)


def one_line(error: Exception, status: int) -> int:
    """Print `error` as one line, once per node (by local rank 0), and return `status`."""
    local_rank = os.environ.get("LOCAL_RANK", "0")
    # Under torchrun, one line per node. A LOCAL_RANK that is no number may be the error.
    if local_rank == "0" or not local_rank.isdigit():
        print(f"reference_impl.train: error: {error}", file=sys.stderr)
    else:
        # torchrun stops every worker once one exits: leaving first could get local
        # rank 0 killed before it printed the error. Its exit ends this wait early.
        time.sleep(QUIET_RANK_WAIT_S)
    return status


def run(cfg: TrainConfig) -> int:
    """Train inside a process group and report how the run ended."""
    started = time.perf_counter()
    with distributed(cfg.device, cfg.pg_timeout_s) as ctx:
        log = EventLog(ctx.rank)
        state = train(cfg, ctx, log)
        if state.preempted:
            log.progress("preempted", step=state.step, exit_status=PREEMPTED_EXIT,
                         checkpointed=bool(cfg.checkpoint_dir))
            return PREEMPTED_EXIT
        try:
            digest = state_digest(state.model, state.optimizer, state.mesh.group("pp"))
        except Exception as exc:
            log.error("state_digest", exc)
            raise
        log.progress("run_complete", step=state.step, state_digest=digest,
                     config_digest=cfg.digest(), wall_s=round(time.perf_counter() - started, 3))
    return 0


if __name__ == "__main__":
    exit_after(main)

"""The training loop and the command line: `python -m reference_impl.train --help`.

Run it alone on one process, or under torchrun for one process per device:

    torchrun --standalone --nproc-per-node 2 -m reference_impl.train --max-steps 50
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, Dataset

from reference_impl.config import ConfigError, TrainConfig
from reference_impl.data import ResumableDistributedSampler, Sample, SyntheticClassification, SyntheticTokens
from reference_impl.distributed import DistContext, distributed, pick_device
from reference_impl.metrics import EventLog, PhaseTimer, Throughput
from reference_impl.model import build_model
from reference_impl.parallel import wrap_model
from reference_impl.state import state_digest
from reference_impl.step import build_optimizer, build_scaler, build_scheduler, train_step


@dataclass
class TrainState:
    """Everything the loop mutates; a checkpoint must capture all of it to resume exactly."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    scaler: torch.amp.GradScaler | None
    sampler: ResumableDistributedSampler
    loader: DataLoader[Sample]
    step: int = 0


def build_dataset(cfg: TrainConfig) -> Dataset[Sample]:
    """The synthetic dataset that matches `cfg.model`, generated from `cfg.seed`."""
    if cfg.model == "mlp":
        return SyntheticClassification(cfg.dataset_size, cfg.input_dim, cfg.num_classes, cfg.seed)
    return SyntheticTokens(cfg.dataset_size, cfg.seq_len, cfg.vocab_size, cfg.seed)


def build_state(cfg: TrainConfig, ctx: DistContext) -> TrainState:
    """Model, optimizer, schedule, scaler and data pipeline for this rank."""
    dataset = build_dataset(cfg)
    sampler = ResumableDistributedSampler(len(dataset), world_size=ctx.world_size, rank=ctx.rank,
                                          global_batch_size=cfg.global_batch_size, seed=cfg.seed)
    loader = DataLoader(dataset, batch_size=cfg.micro_batch_size, sampler=sampler,
                        num_workers=cfg.num_workers, pin_memory=ctx.device.type == "cuda")
    model = wrap_model(build_model(cfg), cfg, ctx)
    optimizer = build_optimizer(model, cfg)
    return TrainState(model, optimizer, build_scheduler(optimizer, cfg),
                      build_scaler(cfg, ctx.device), sampler, loader)


class SampleLog:
    """Appends, per rank, the dataset indices of every committed optimizer step (JSONL)."""

    def __init__(self, directory: str | None, rank: int) -> None:
        self.path = Path(directory) / f"rank{rank}.jsonl" if directory else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, step: int, epoch: int, indices: list[torch.Tensor]) -> None:
        """Record the samples of one committed step."""
        if self.path:
            with self.path.open("a") as f:
                f.write(json.dumps({"step": step, "epoch": epoch,
                                    "indices": torch.cat(indices).tolist()}) + "\n")


def maybe_fail(cfg: TrainConfig, ctx: DistContext, next_step: int) -> None:
    """Fault injection: SIGKILL this rank before `fail_at_step`, on the first attempt only."""
    if cfg.fail_at_step == next_step and ctx.rank == cfg.fail_rank and ctx.restart_count == 0:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


# --8<-- [start:train_loop]
def train(cfg: TrainConfig, ctx: DistContext, log: EventLog, state: TrainState | None = None,
          on_step: Callable[[TrainState], None] | None = None) -> TrainState:
    """Train to `cfg.max_steps`, emitting progress events, and return the final state."""
    torch.manual_seed(cfg.seed + ctx.rank)  # per-rank stream (dropout); weights are seeded apart
    state = state or build_state(cfg, ctx)
    timer, meter, samples = PhaseTimer(ctx.device), Throughput(), SampleLog(cfg.sample_log, ctx.rank)
    log.progress("run_start", config_digest=cfg.digest(), world_size=ctx.world_size,
                 global_batch_size=cfg.global_batch_size, device=str(ctx.device),
                 backend=ctx.backend or "none", restart_count=ctx.restart_count)
    state.model.train()
    per_rank_step = cfg.micro_batch_size * cfg.grad_accum_steps
    while state.step < cfg.max_steps:
        state.sampler.set_epoch(state.step // state.sampler.steps_per_epoch)
        batches = iter(state.loader)  # starts at the sampler's committed position
        for _ in range(len(state.sampler) // per_rank_step):
            maybe_fail(cfg, ctx, state.step + 1)
            loss, indices = train_step(state.model, batches, state.optimizer, state.scheduler,
                                       state.scaler, cfg, ctx.device, timer)
            state.sampler.commit(cfg.global_batch_size)  # trained, not merely prefetched
            state.step += 1
            meter.add(cfg.global_batch_size)
            samples.append(state.step, state.sampler.epoch, indices)
            if on_step:
                on_step(state)
            if state.step % cfg.log_every == 0 or state.step == cfg.max_steps:
                if ctx.distributed:  # a log step syncs anyway: report the global mean loss
                    dist.all_reduce(loss, op=dist.ReduceOp.AVG)
                log.progress("step", step=state.step, epoch=state.sampler.epoch, loss=loss.item(),
                             lr=state.scheduler.get_last_lr()[0], samples_per_s=round(meter.rate(), 1),
                             phase_s={k: round(v, 6) for k, v in timer.flush().items()})
            if state.step == cfg.max_steps:
                break
        del batches  # shuts down DataLoader workers before the next epoch starts its own
    return state
# --8<-- [end:train_loop]


def main(argv: list[str] | None = None) -> int:
    """Parse flags, train inside a process group, print `run_complete`; 2 on a bad flag."""
    try:
        cfg = TrainConfig.from_cli(argv)
        pick_device(cfg.device, 0)
    except (ConfigError, RuntimeError) as exc:
        print(f"reference_impl.train: error: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    with distributed(cfg.device, cfg.pg_timeout_s) as ctx:
        log = EventLog(ctx.rank)
        try:
            state = train(cfg, ctx, log)
            digest = state_digest(state.model, state.optimizer)
        except Exception as exc:
            log.error("train", exc)
            raise
        log.progress("run_complete", step=state.step, state_digest=digest,
                     config_digest=cfg.digest(), wall_s=round(time.perf_counter() - started, 3))
    return 0


if __name__ == "__main__":
    sys.exit(main())

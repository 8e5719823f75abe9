"""One optimizer step: gradient accumulation, autocast, loss scaling and clipping."""

# --8<-- [start:imports]
from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
# --8<-- [end:imports]

from reference_impl.config import TrainConfig
from reference_impl.data import Sample
from reference_impl.metrics import PhaseTimer
from reference_impl.model import loss_fn
from reference_impl.parallel import gradient_sync

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW or plain SGD over all parameters, at the schedule's base rate."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


# --8<-- [start:build_scaler]
def build_scaler(cfg: TrainConfig, device: torch.device) -> torch.amp.GradScaler | None:
    """A GradScaler for fp16 only: bf16 has fp32's exponent range and needs none."""
    if cfg.precision != "fp16":
        return None
    return torch.amp.GradScaler(device.type, init_scale=cfg.fp16_init_scale)
# --8<-- [end:build_scaler]


# --8<-- [start:lr_schedule]
def lr_multiplier(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to 1, then cosine decay to `min_lr_ratio` at `max_steps`."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> LambdaLR:
    """The schedule as a LambdaLR, whose `state_dict` records how far it has run."""
    return LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg))
# --8<-- [end:lr_schedule]


# --8<-- [start:train_step]
def train_step(model: nn.Module, batches: Iterator[Sample], optimizer: torch.optim.Optimizer,
               scheduler: LambdaLR, scaler: torch.amp.GradScaler | None, cfg: TrainConfig,
               device: torch.device, timer: PhaseTimer) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Run `grad_accum_steps` micro-batches and one optimizer step.

    Returns the mean loss as a device tensor (reading it would sync the device, so the
    caller does that only at log steps) and the dataset indices that were trained.
    """
    accum = cfg.grad_accum_steps
    total_loss = torch.zeros((), device=device)
    indices = []
    for micro in range(accum):
        with timer.phase("data", host=True):
            x, y, idx = next(batches)
        with timer.phase("h2d"):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        # Only the last micro-batch all-reduces; the others accumulate locally.
        with gradient_sync(model, enabled=micro == accum - 1 or cfg.fsdp_grad_sync == "every"):
            with timer.phase("forward"), torch.autocast(
                    device.type, dtype=AUTOCAST_DTYPES.get(cfg.precision), enabled=cfg.precision != "fp32"):
                # Dividing by accum makes the summed gradients the mean over the global batch.
                loss = loss_fn(model(x), y) / accum
            with timer.phase("backward"):  # includes the gradient all-reduce on the last micro-batch
                (scaler.scale(loss) if scaler else loss).backward()
        total_loss += loss.detach()
        indices.append(idx)
    with timer.phase("optimizer"):
        if scaler:
            scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        if scaler:
            scaler.step(optimizer)  # skipped when the unscaled gradients hold inf/NaN
            scaler.update()
        else:
            optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return total_loss, indices
# --8<-- [end:train_step]

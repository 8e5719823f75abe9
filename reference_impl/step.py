"""One optimizer step: gradient accumulation, autocast, loss scaling and clipping, for a
whole model (`train_step`) or one pipeline stage (`pipeline_train_step`)."""

# --8<-- [start:imports]
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

# --8<-- [end:imports]
from reference_impl.compiled import compiled_loss
from reference_impl.config import TrainConfig
from reference_impl.data import Batch
from reference_impl.metrics import PhaseTimer
from reference_impl.model import loss_fn
from reference_impl.parallel.experts import aux_loss
from reference_impl.parallel.pipeline import Pipeline, pipeline_step
from reference_impl.parallel.registry import gradient_sync

# Whether a step's update may be applied, given its loss and (when the whole model is on this
# rank's side) its micro-batches; see `reference_impl.reliability.nonfinite.NonFiniteGuard.approve`.
Approve = Callable[[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]] | None], bool]


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW or plain SGD over all parameters, at the schedule's base rate.

    On CUDA, AdamW is PyTorch's fused kernel: one pass that reads each parameter, its
    gradient and both moments once and writes them back, where the default multi-tensor
    (`foreach`) path makes a pass over all of them per arithmetic operation. Memory-bound
    either way, so the pass count is the optimizer's time. The CPU keeps the default.
    """
    params = list(model.parameters())
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    on_cuda = all(p.is_cuda for p in params)  # `--device auto` is resolved by where the model is
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True if on_cuda else None)


# --8<-- [start:build_scaler]
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # fp32: no autocast


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
def train_step(model: nn.Module, batches: Iterator[Batch], optimizer: torch.optim.Optimizer,
               scheduler: LambdaLR, scaler: torch.amp.GradScaler | None, cfg: TrainConfig,
               device: torch.device, timer: PhaseTimer,
               approve: Approve | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Run `grad_accum_steps` micro-batches and one optimizer step.

    Returns the mean loss as a device tensor (reading it would sync the device, so the
    caller does that only at log steps) and the dataset indices that were trained.
    `approve(loss, inputs)`, if given, sees the loss and the micro-batches after the
    backward; when it says no, the update is dropped: no optimizer or schedule step, and
    the gradients are cleared.
    """
    inputs: list[tuple[torch.Tensor, torch.Tensor]] | None = [] if approve else None
    loss, indices = accumulate_gradients(model, batches, scaler, cfg, device, timer, inputs)
    if approve is None or approved(approve, loss, inputs, timer):
        optimizer_step(model, optimizer, scheduler, scaler, cfg, timer)
    else:
        optimizer.zero_grad(set_to_none=True)
    return loss, indices


def accumulate_gradients(model: nn.Module, batches: Iterator[Batch], scaler: torch.amp.GradScaler | None,
                         cfg: TrainConfig, device: torch.device, timer: PhaseTimer,
                         inputs: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                         ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Forward and backward `grad_accum_steps` micro-batches into the gradients; no step.

    Returns the mean loss and the dataset indices, as `train_step` does. Without
    accumulation the loss is returned as computed: dividing by 1 and adding to zero
    would be two device ops per step that change no bit. `inputs`, if given, receives
    each micro-batch as it ran (for a replay that looks for the first non-finite module).
    """
    accum = cfg.grad_accum_steps
    criterion = compiled_loss(loss_fn) if cfg.compile else loss_fn
    losses, indices = [], []
    for micro in range(accum):
        with timer.phase("data", host=True):
            x, y, idx = next(batches)
        with timer.phase("h2d"):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        # Only the last micro-batch all-reduces; the others accumulate locally.
        with gradient_sync(model, enabled=micro == accum - 1 or cfg.fsdp_grad_sync == "every"):
            with timer.phase("forward"), autocast(device, cfg):
                loss = criterion(model(x), y)
                if cfg.n_experts:  # the routers' load-balancing loss trains with the task's
                    loss = loss + cfg.moe_aux_loss_coef * aux_loss(model)
                if accum > 1:  # makes the summed gradients the mean over the global batch
                    loss = loss / accum
            with timer.phase("backward"):  # includes the gradient all-reduce on the last micro-batch
                (scaler.scale(loss) if scaler else loss).backward()
        losses.append(loss.detach())
        indices.append(idx)
        if inputs is not None:
            inputs.append((x, y))
    return functools.reduce(torch.add, losses), indices
# --8<-- [end:train_step]


def approved(approve: Approve, loss: torch.Tensor, inputs: list[tuple[torch.Tensor, torch.Tensor]] | None,
             timer: PhaseTimer) -> bool:
    """`approve(loss, inputs)`, timed as the `finite_check` phase: it waits for every rank
    (a collective and a host read), so a straggler detector leaves it out of a rank's own time."""
    with timer.phase("finite_check", host=True):
        return approve(loss, inputs)


def autocast(device: torch.device, cfg: TrainConfig) -> AbstractContextManager[object]:
    """The forward pass's autocast for `cfg.precision`; none at all in fp32.

    A disabled `torch.autocast` still saves and restores the autocast state on every
    entry; fp32 runs skip it.
    """
    if cfg.precision == "fp32":
        return nullcontext()
    return torch.autocast(device.type, dtype=AUTOCAST_DTYPES[cfg.precision])


# --8<-- [start:optimizer_step]
def optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: LambdaLR,
                   scaler: torch.amp.GradScaler | None, cfg: TrainConfig, timer: PhaseTimer,
                   pp_group: dist.ProcessGroup | None = None) -> None:
    """Unscale, clip, step, advance the schedule and drop the gradients."""
    with timer.phase("optimizer"):
        if scaler:
            scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        if cfg.grad_clip > 0:
            clip_gradients(list(model.parameters()), cfg.grad_clip, pp_group)
        if scaler:
            scaler.step(optimizer)  # skipped when the unscaled gradients hold inf/NaN
            scaler.update()
        else:
            optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
# --8<-- [end:optimizer_step]


# --8<-- [start:clip_gradients]
def clip_gradients(parameters: list[nn.Parameter], max_norm: float,
                   pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Scale the gradients so that their global norm is at most `max_norm`; return the norm.

    Each pipeline stage holds only its own parameters' gradients, so the stages add their
    squared norms over `pp_group` first: every stage then scales by the same factor, the
    one a single process holding the whole model would use. Under expert parallel the
    experts are DTensors and the rest plain tensors, which torch's clipping does not mix:
    the two norms are taken apart (the DTensors' over every rank's shard) and added in squares.
    """
    kinds = [[p for p in parameters if isinstance(p, DTensor) == sharded] for sharded in (True, False)]
    if pp_group is None and not all(kinds):
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    squares = []
    for kind in kinds:
        norm = torch.nn.utils.get_total_norm([p.grad for p in kind if p.grad is not None])
        if isinstance(norm, DTensor):  # FSDP2 or expert shards: the whole tensors' norm
            norm = norm.full_tensor()
        squares.append(norm.pow(2))
    squared = functools.reduce(torch.add, squares)
    if pp_group is not None:
        dist.all_reduce(squared, group=pp_group)
    norm = squared.sqrt()
    for kind in kinds:
        torch.nn.utils.clip_grads_with_norm_(kind, max_norm, norm)
    return norm
# --8<-- [end:clip_gradients]


# --8<-- [start:pipeline_train_step]
def pipeline_train_step(pipeline: Pipeline, model: nn.Module, batches: Iterator[Batch],
                        optimizer: torch.optim.Optimizer, scheduler: LambdaLR, cfg: TrainConfig,
                        device: torch.device, timer: PhaseTimer,
                        approve: Approve | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`train_step` for one pipeline stage: the schedule runs forward and backward of every
    pipeline micro-batch, then each stage steps its own parameters.

    Every stage reads the same micro-batches (the first needs the tokens, the last the
    targets). The returned loss is the mean over the step on every stage: the last stage
    computed it and sends it to the others. `approve` sees no micro-batches: a stage
    cannot replay the whole model's forward.
    """
    total_loss = torch.zeros((), device=device)
    indices = []
    for _ in range(cfg.grad_accum_steps):
        with timer.phase("data", host=True):
            x, y, idx = next(batches)
        with timer.phase("h2d"):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with timer.phase("pipeline"):  # forward and backward, interleaved by the schedule
            loss = pipeline_step(pipeline.schedule, pipeline.stage, pipeline.degree, x, y)
        if loss is not None:
            total_loss += loss.detach()
        indices.append(idx)
    dist.broadcast(total_loss, group=pipeline.group, group_src=pipeline.degree - 1)
    if approve is None or approved(approve, total_loss, None, timer):
        optimizer_step(model, optimizer, scheduler, None, cfg, timer, pipeline.group)
    else:
        optimizer.zero_grad(set_to_none=True)
    return total_loss, indices
# --8<-- [end:pipeline_train_step]

"""Pipeline parallelism: the transformer cut into consecutive stages, one per rank.

Each optimizer step splits the batch into M micro-batches. A schedule from
`torch.distributed.pipelining` moves them through the stages: activations go forward to
the next rank with point-to-point sends, gradients come back the same way. GPipe runs
every forward, then every backward; 1F1B starts the backward of micro-batch i as soon as
it leaves the last stage, so at most P micro-batches are in flight per stage (less
activation memory) while the bubble stays the same: with P stages and M micro-batches,
each stage idles for (P-1)/(M+P-1) of the step.

Proven on gloo: tests/distributed/test_pipeline.py trains the same steps as one process.
"""

from __future__ import annotations

# --8<-- [start:imports]
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

# --8<-- [end:imports]
from reference_impl.config import TrainConfig
from reference_impl.model import TinyTransformer, loss_fn, run_blocks

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}  # --pp-schedule -> pipelining's class


def _schedule_and_stage(kind: str) -> tuple[Any, Any]:
    """The schedule class named by `kind` and `PipelineStage`, imported when a pipeline is
    built: `torch.distributed.pipelining` costs every other run's start-up (and restart)
    an import it never uses."""
    import torch.distributed.pipelining as pipelining

    return getattr(pipelining, SCHEDULES[kind]), pipelining.PipelineStage


# --8<-- [start:stage]
def stage_layers(n_layers: int, pp_degree: int, stage: int) -> range:
    """The blocks of `stage`: contiguous, as even as possible, earlier stages one larger."""
    if not 1 <= pp_degree <= n_layers:
        raise ValueError(f"pp_degree must be in [1, n_layers={n_layers}] (got {pp_degree})")
    base, extra = divmod(n_layers, pp_degree)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


class Stage(nn.Module):
    """One pipeline stage: the first adds the embeddings, the last the norm and the head.

    Blocks keep their index in the whole model (`blocks.2` stays `blocks.2` on the second
    stage), so every stage's state dict uses the whole model's names: a checkpoint written
    by the stages together restores into any other number of stages, or none.
    """

    def __init__(self, model: TinyTransformer, stage: int, pp_degree: int,
                 autocast_dtype: torch.dtype | None = None) -> None:
        """Take stage `stage` of `pp_degree` from a `TinyTransformer` built on every rank."""
        super().__init__()
        self.first, self.last = stage == 0, stage == pp_degree - 1
        self.autocast_dtype, self.checkpoint_blocks = autocast_dtype, model.checkpoint_blocks
        # Shared modules, not copies: every rank built the same seeded model and keeps its part.
        self.embed: nn.Embedding | None = model.embed if self.first else None
        self.pos: nn.Parameter | None = model.pos if self.first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i]
                                     for i in stage_layers(len(model.blocks), pp_degree, stage)})
        self.norm: nn.LayerNorm | None = model.norm if self.last else None
        self.head: nn.Linear | None = model.head if self.last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Autocast here, not around the schedule: the schedule also runs the backward pass.
        with torch.autocast(x.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            if self.embed is not None and self.pos is not None:  # the first stage: x holds token ids
                x = self.embed(x) + self.pos[: x.shape[1]]
            x = run_blocks(self.blocks.values(), x, recompute=self.checkpoint_blocks and self.training)
            return self.head(self.norm(x)) if self.norm is not None and self.head is not None else x
# --8<-- [end:stage]


def split(model: nn.Module, mesh: DeviceMesh, cfg: TrainConfig) -> Stage:
    """This rank's stage of `model`: the wrap function of the `pp` mesh axis.

    Every rank builds the whole model first and keeps one stage of it; the rest is freed
    when the caller drops the model. (A model too large for one device would be built on
    the meta device and only its stage materialised.)

    Raises:
        TypeError: `model` is not a `TinyTransformer`, the model cut into stages of blocks.
    """
    if not isinstance(model, TinyTransformer):  # the config allows pipeline stages for the transformer only
        raise TypeError(f"pipeline stages are cut from a TinyTransformer, not {type(model).__name__}")
    return Stage(model, mesh.get_local_rank(), mesh.size(),
                 autocast_dtype=torch.bfloat16 if cfg.precision == "bf16" else None)


@dataclass
class Pipeline:
    """This rank's place in its pipeline, and the schedule that runs its stage.

    Attributes:
        schedule: The `torch.distributed.pipelining` schedule over this rank's stage.
        stage: This rank's stage index (its coordinate on the pp axis).
        degree: Stages in the pipeline.
        group: The process group of this rank's pipeline.
    """

    schedule: Any
    stage: int
    degree: int
    group: dist.ProcessGroup


def build_pipeline(stage: nn.Module, mesh: DeviceMesh, cfg: TrainConfig, device: torch.device) -> Pipeline:
    """The schedule (`cfg.pp_schedule`) that drives this rank's `stage` (its `Stage`, or a
    DDP/FSDP2 wrapper of it) over `mesh`, the pp axis of this rank.

    Each pipeline micro-batch's loss is divided by M x G (pipeline micro-batches times
    accumulated micro-batches), so the gradients the stage accumulates over a step are
    those of the mean loss over the global batch, as in one process. `TrainConfig` has
    checked the schedule's name and that M is at least the number of stages.
    """
    index, degree, group = mesh.get_local_rank(), mesh.size(), mesh.get_group()
    divisor = cfg.pipeline_microbatches * cfg.grad_accum_steps
    # Scaling the loss, not the gradients: the schedule's own gradient scaling divides every
    # gradient the stage holds, which would shrink the ones accumulated in earlier steps again.
    schedule_class, stage_class = _schedule_and_stage(cfg.pp_schedule)
    schedule = schedule_class(
        stage_class(stage, index, degree, device, group=group), n_microbatches=cfg.pipeline_microbatches,
        scale_grads=False, loss_fn=lambda output, target: loss_fn(output, target) / divisor)
    return Pipeline(schedule, index, degree, group)


# --8<-- [start:pipeline_step]
def pipeline_step(schedule, index: int, pp_degree: int, tokens: torch.Tensor,  # noqa: ANN001
                  targets: torch.Tensor) -> torch.Tensor | None:
    """Forward and backward of one batch through the pipeline; the last stage returns the
    sum of its micro-batches' (divided) losses, the others None.

    Only the first stage feeds inputs and only the last sees targets: the ranks in
    between receive activations from the previous stage and gradients from the next.
    """
    losses: list[torch.Tensor] = []
    if index == 0:
        schedule.step(tokens)
    elif index == pp_degree - 1:
        schedule.step(target=targets, losses=losses)
    else:
        schedule.step()
    return torch.stack(losses).sum() if losses else None
# --8<-- [end:pipeline_step]


# --8<-- [start:bubble]
def bubble_fraction(pp_degree: int, microbatches: int) -> float:
    """Share of a step each stage idles under GPipe or 1F1B: (P-1) / (M+P-1)."""
    return (pp_degree - 1) / (microbatches + pp_degree - 1)
# --8<-- [end:bubble]


class _Work(torch.autograd.Function):
    """Identity that sleeps: a stage whose forward and backward take known, fixed times."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:  # noqa: ANN001
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # noqa: ANN001
        time.sleep(ctx.backward_s)
        return grad, None, None


class _TimedStage(nn.Module):
    def __init__(self, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))  # something to hold a gradient
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Work.apply(x * self.scale, self.forward_s, self.backward_s)


def measure_bubble(kind: str, microbatches: int, forward_s: float = 0.02, backward_s: float = 0.04,
                   rounds: int = 2) -> dict[str, Any]:
    """Measured idle share of one stage per step, against `bubble_fraction` (collective).

    Every stage's forward and backward of one micro-batch sleep a fixed time, so a stage
    is busy M x (forward_s + backward_s) per step, and whatever else the step takes is
    idle time: the bubble plus point-to-point latency. Run on every rank of the group.
    """
    index, pp_degree = dist.get_rank(), dist.get_world_size()
    schedule_class, stage_class = _schedule_and_stage(kind)
    schedule = schedule_class(stage_class(_TimedStage(forward_s, backward_s), index, pp_degree, torch.device("cpu")),
                              n_microbatches=microbatches, loss_fn=lambda out, _target: out.mean())
    batch, walls = torch.ones(microbatches, 4), []
    for _ in range(rounds + 1):  # the first step also sets up the stage's buffers: untimed
        dist.barrier()
        started = time.perf_counter()
        if index == 0:
            schedule.step(batch)
        elif index == pp_degree - 1:
            schedule.step(target=batch)
        else:
            schedule.step()
        walls.append(time.perf_counter() - started)
    wall = torch.tensor(min(walls[1:]))
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # the step ends when its slowest stage does
    busy = microbatches * (forward_s + backward_s)
    return {"schedule": kind, "microbatches": microbatches, "pp_degree": pp_degree,
            "step_s": round(wall.item(), 4), "busy_s": round(busy, 4),
            "measured_idle": round(1 - busy / wall.item(), 4),
            "formula_idle": round(bubble_fraction(pp_degree, microbatches), 4)}

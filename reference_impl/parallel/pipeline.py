"""Pipeline parallelism: the model cut into consecutive stages (its spec says where), one per rank.

Each optimizer step splits the batch into M micro-batches. A schedule from
`torch.distributed.pipelining` moves them through the stages: activations go forward to
the next rank with point-to-point sends, gradients come back the same way. GPipe runs
every forward, then every backward; 1F1B starts the backward of micro-batch i as soon as
it leaves the last stage, so at most P micro-batches are in flight per stage (less
activation memory) while the bubble stays the same: with P stages and M micro-batches,
each stage idles for (P-1)/(M+P-1) of the step. Interleaved 1F1B gives each rank V
smaller stages (rank r holds r, r+P, ...), which cuts the idle share to (P-1)/(V x M+P-1)
for V times the point-to-point messages.

Proven on gloo: tests/distributed/test_pipeline.py trains the same steps as one process.
"""

from __future__ import annotations

# --8<-- [start:imports]
import time
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

# --8<-- [end:imports]
from reference_impl.config import TrainConfig
from reference_impl.model import loss_fn, spec_of

# --8<-- [start:schedule]
# --pp-schedule -> pipelining's class
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B"}
INTERLEAVED = frozenset({"interleaved-1f1b"})  # schedules that run a list of stages per rank


def _schedule_and_stage(kind: str) -> tuple[Any, Any]:
    """The schedule class named by `kind` and `PipelineStage`, imported when a pipeline is
    built: `torch.distributed.pipelining` costs every other run's start-up (and restart)
    an import it never uses."""
    import torch.distributed.pipelining as pipelining

    return getattr(pipelining, SCHEDULES[kind]), pipelining.PipelineStage


def _schedule(kind: str, chunks: tuple[nn.Module, ...], index: int, degree: int, device: torch.device,
              group: dist.ProcessGroup | None = None, **options: Any) -> Any:
    """The `kind` schedule over `chunks`, this rank's stages `index`, `index + degree`, ...
    of `degree x len(chunks)` (round-robin, as torch's interleaved schedules expect); the
    one-stage schedules take the single stage itself. `options` go to the schedule."""
    schedule_class, stage_class = _schedule_and_stage(kind)
    n_stages = degree * len(chunks)
    stages = [stage_class(chunk, index + i * degree, n_stages, device, group=group) for i, chunk in enumerate(chunks)]
    return schedule_class(stages if kind in INTERLEAVED else stages[0], **options)
# --8<-- [end:schedule]


def split(model: nn.Module, mesh: DeviceMesh, cfg: TrainConfig) -> nn.Module:
    """This rank's stage of `model`, as the model's spec cuts it: the wrap function of the
    `pp` mesh axis.

    Every rank builds the whole model first and keeps one stage of it; the rest is freed
    when the caller drops the model. (A model too large for one device would be built on
    the meta device and only its stage materialised.)

    Raises:
        TypeError: The model's spec has no pipeline stages.
    """
    cut = spec_of(cfg).pipeline_stage
    if cut is None:
        raise TypeError(f"{type(model).__name__} has no pipeline stages; it cannot run pipeline parallel")
    return cut(model, cfg, mesh.size(), mesh.get_local_rank())


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
    """The schedule (`cfg.pp_schedule`) that drives this rank's `stage` (the module its model's spec cut, or a
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
    # Under an interleaved schedule this rank's module holds V stages, r, r+P, ... of V x P.
    chunks = cast(tuple[nn.Module, ...], stage.chunks) if cfg.pp_schedule in INTERLEAVED else (stage,)
    schedule = _schedule(cfg.pp_schedule, chunks, index, degree, device, group,
                         n_microbatches=cfg.pipeline_microbatches, scale_grads=False,
                         loss_fn=lambda output, target: loss_fn(output, target) / divisor)
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
def bubble_fraction(pp_degree: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Share of a step each stage idles: (P-1) / (V x M + P-1), V = 1 for GPipe and 1F1B.

    Interleaving V stages per rank shortens each of the P-1 slots that fill and drain the
    pipeline to one stage's work, a V-th of the rank's.
    """
    return (pp_degree - 1) / (virtual_stages * microbatches + pp_degree - 1)
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
                   rounds: int = 2, virtual_stages: int = 2) -> dict[str, Any]:
    """Measured idle share of one stage per step, against `bubble_fraction` (collective).

    Every rank's forward and backward of one micro-batch sleep a fixed time, so a rank
    is busy M x (forward_s + backward_s) per step, and whatever else the step takes is
    idle time: the bubble plus point-to-point latency. Under an interleaved `kind` the
    rank's work is cut into `virtual_stages` stages of a V-th of those times each (ignored
    otherwise). Run on every rank of the group.
    """
    index, pp_degree = dist.get_rank(), dist.get_world_size()
    v = virtual_stages if kind in INTERLEAVED else 1
    chunks = tuple(_TimedStage(forward_s / v, backward_s / v) for _ in range(v))
    schedule = _schedule(kind, chunks, index, pp_degree, torch.device("cpu"), n_microbatches=microbatches,
                         loss_fn=lambda out, _target: out.mean())
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
    return {"schedule": kind, "microbatches": microbatches, "pp_degree": pp_degree, "virtual_stages": v,
            "step_s": round(wall.item(), 4), "busy_s": round(busy, 4),
            "measured_idle": round(1 - busy / wall.item(), 4),
            "formula_idle": round(bubble_fraction(pp_degree, microbatches, v), 4)}

"""The registry of parallelisms, and `parallelize`, which applies the ones a run uses.

A parallelism is one module (its wrap function and whatever it needs) plus one entry in
`PARALLELISMS`, which declares everything the rest of the trainer must know about it: the
mesh axis that turns it on, which of the parallelisms sharing that axis the config picks,
the ranks it spans, whether it shards the parameters (the checkpoint layout), how its
gradients are synchronised, how it changes what a rank reads, the config options it reads
and what it refuses to run with. Nothing else in the trainer branches on a parallelism:
`train.py`, `step.py`, `mesh.py` and the checkpoint manager ask this registry.
"""

# --8<-- [start:imports]
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset

# --8<-- [end:imports]
from reference_impl.compiled import compile_units
from reference_impl.config import TrainConfig
from reference_impl.distributed import DistContext
from reference_impl.model import spec_of
from reference_impl.parallel import context_parallel, data_parallel, experts, pipeline, tensor_parallel, ulysses
from reference_impl.parallel.mesh import EP_AXES, ParallelDims

Wrap = Callable[[nn.Module, DeviceMesh, TrainConfig], nn.Module]
Sync = Callable[[nn.Module, bool], AbstractContextManager[None] | None]
ShardData = Callable[[Dataset[Any], ParallelDims, int], Dataset[Any]]
Runner = Callable[[nn.Module, DeviceMesh, TrainConfig, torch.device], Any]


# --8<-- [start:registry]
@dataclass(frozen=True)
class Parallelism:
    """One way of splitting the work, and everything it implies for the rest of the run.

    Attributes:
        axis: The mesh axis (`reference_impl.parallel.mesh.AXES`, or "ep") whose degree
            turns it on.
        wrap: Returns the model wrapped over the ranks of `mesh`.
        options: The config fields it reads (its flags in kebab case).
        chosen: Whether the config picks this one of the parallelisms that share its axis
            (the strategy: DDP or FSDP2; the cp style: ring or Ulysses).
        applies: Whether it wraps under this mesh. Default: its axis spans more than one rank.
        mesh: The ranks it spans. Default: its axis. A parallelism may span another's ranks
            too (data parallel spans the cp ranks: they read the same samples).
        sharded: Ranks hold different parts of the parameters (DTensor shards or pipeline
            stages), so every rank writes its part and checkpoints go through DCP.
        sync: Gradient synchronisation: a context for each micro-batch's forward and
            backward that communicates when `enabled` (the last micro-batch, or every one
            under `--fsdp-grad-sync every`) and only accumulates when not; None when the
            model is not one it wrapped. None for a parallelism whose collectives are part
            of the math (tensor and context parallel) or whose ranks own their parameters
            (pipeline stages).
        shard_data: What a rank reads under it (context parallel: its tokens of every
            sample); None when every rank of its axis reads the same samples.
        runner: What drives the step in place of `train_step` (a pipeline schedule).
        after_compile: Applied after `--compile`, so its hooks stay outside compiled code.
        refuses: The other parallelisms it does not run with (DDP: with more than one
            data-parallel rank); `TrainConfig` refuses each combination in one line before
            any process starts. HSDP (`--dp-replicate`) runs with data parallel alone.
    """

    axis: str
    wrap: Wrap
    options: tuple[str, ...]
    chosen: Callable[[TrainConfig], bool] = lambda cfg: True
    applies: Callable[[ParallelDims], bool] | None = None
    mesh: Callable[[ParallelDims], DeviceMesh] | None = None
    sharded: bool = False
    sync: Sync | None = None
    shard_data: ShardData | None = None
    runner: Runner | None = None
    after_compile: bool = False
    refuses: tuple[str, ...] = ()

    def used(self, dims: ParallelDims) -> bool:
        """Whether it wraps the model under `dims` (for a config that chose it)."""
        return self.applies(dims) if self.applies else self.axis in dims.used_axes

    def mesh_of(self, dims: ParallelDims) -> DeviceMesh:
        """The mesh it spans (collective: builds the process groups on first use)."""
        return self.mesh(dims) if self.mesh else dims.device_mesh[self.axis]


PARALLELISMS: dict[str, Parallelism] = {  # applied in this order
    "pp": Parallelism("pp", pipeline.split, ("pp_degree", "pp_microbatches", "pp_schedule", "pp_virtual_stages"),
                      sharded=True, runner=pipeline.build_pipeline, refuses=("ddp", "tp", "cp", "ulysses", "ep")),
    "tp": Parallelism("tp", tensor_parallel.parallelize, ("tp_degree",), sharded=True,
                      refuses=("ddp", "pp", "cp", "ulysses", "ep")),
    "cp": Parallelism("cp", context_parallel.wrap, ("cp_degree", "cp_style"), chosen=lambda c: c.cp_style == "ring",
                      shard_data=context_parallel.shard_data, refuses=("pp", "tp", "ep")),
    "ulysses": Parallelism("cp", ulysses.wrap, ("cp_degree", "cp_style"), chosen=lambda c: c.cp_style == "ulysses",
                           shard_data=context_parallel.shard_data, refuses=("pp", "tp", "ep")),
    "ep": Parallelism("ep", experts.wrap, ("n_experts", "ep_degree"), mesh=lambda d: d.device_mesh[EP_AXES],
                      sharded=True, sync=experts.gradient_sync, refuses=("pp", "tp", "cp", "ulysses", "fsdp")),
    "ddp": Parallelism("dp_replicate", data_parallel.ddp, ("strategy",), chosen=lambda c: c.strategy == "ddp",
                       applies=lambda d: data_parallel.wraps("dp_replicate", d), mesh=data_parallel.data_mesh,
                       sync=data_parallel.ddp_sync, after_compile=True),
    "fsdp": Parallelism("dp_shard", data_parallel.fsdp, ("strategy", "dp_replicate", "fsdp_grad_sync"),
                        chosen=lambda c: c.strategy == "fsdp", applies=lambda d: data_parallel.wraps("dp_shard", d),
                        mesh=data_parallel.data_mesh, sharded=True, sync=data_parallel.fsdp_sync, after_compile=True),
}
# --8<-- [end:registry]


def chosen(cfg: TrainConfig) -> list[Parallelism]:
    """The parallelisms `cfg` picks, one per axis, in the registry's order."""
    return [p for p in PARALLELISMS.values() if p.chosen(cfg)]


def dims_of(cfg: TrainConfig, device_type: str = "cpu") -> ParallelDims:
    """The mesh of `cfg`: `--pp-degree`, `--tp-degree`, `--cp-degree` and `--ep-degree` on
    their axes, the rest on the axis of the data-parallel strategy."""
    data_axis = next(p.axis for p in chosen(cfg) if p.after_compile)
    return ParallelDims.from_config(cfg, data_axis, device_type)


def applied(cfg: TrainConfig, dims: ParallelDims) -> list[Parallelism]:
    """The parallelisms that wrap the model of `cfg` under `dims`, in the order they apply."""
    return [p for p in chosen(cfg) if p.used(dims)]


def checkpoint_layout(cfg: TrainConfig) -> str:
    """"dcp" when a parallelism the run applies splits the parameters, else "torch_save"."""
    return "dcp" if any(p.sharded for p in applied(cfg, dims_of(cfg))) else "torch_save"


def shard_data(dataset: Dataset[Any], cfg: TrainConfig, dims: ParallelDims, rank: int) -> Dataset[Any]:
    """What global `rank` reads: `dataset` as each applied parallelism's `shard_data` leaves it."""
    for parallelism in applied(cfg, dims):
        if parallelism.shard_data:
            dataset = parallelism.shard_data(dataset, dims, rank)
    return dataset


def build_runner(model: nn.Module, cfg: TrainConfig, dims: ParallelDims, device: torch.device) -> Any:
    """What drives this rank's step when an applied parallelism has its own (a pipeline
    schedule), else None (`train_step` runs the model)."""
    for parallelism in applied(cfg, dims):
        if parallelism.runner:
            return parallelism.runner(model, parallelism.mesh_of(dims), cfg, device)
    return None


# --8<-- [start:parallelize]
def parallelize(model: nn.Module, dims: ParallelDims, cfg: TrainConfig, ctx: DistContext) -> nn.Module:
    """Move the model to its device and apply the parallelisms the run uses, in
    torchtitan's order: pp, tp, cp, ep, then `--compile`, then the data-parallel wrappers.

    What is model-specific (the units to shard and compile, the TP plan, the pipeline
    stages) comes from the model's spec (`reference_impl.model.spec_of`).
    """
    model = model.to(ctx.device)
    if cfg.activation_checkpointing:
        model.checkpoint_blocks = True  # type: ignore[assignment]  # torch types Module attributes as Tensor | Module
    used = applied(cfg, dims) if ctx.distributed else []
    # Compile sees the split (pipeline stage, tensor-parallel) model; the data-parallel
    # wrappers come after it, so their hooks stay outside the compiled code.
    for parallelism in [p for p in used if not p.after_compile]:
        model = parallelism.wrap(model, parallelism.mesh_of(dims), cfg)
    if cfg.compile:
        compile_units(model, spec_of(cfg).repeated_units(model))
    for parallelism in [p for p in used if p.after_compile]:
        model = parallelism.wrap(model, parallelism.mesh_of(dims), cfg)
    return model
# --8<-- [end:parallelize]


# --8<-- [start:gradient_sync]
@contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """The gradient synchronisation of every parallelism that wrapped `model`, around one
    micro-batch's forward and backward: communicate when `enabled`, only accumulate when not.

    Each registered `sync` recognises its own wrapping of the model (DDP: `no_sync()`;
    FSDP2: its reduce-scatter switched off; expert parallel: its averages run after the
    backward) and returns None for a model it did not wrap. Tensor and context parallel have
    none: their collectives are part of the math.
    """
    with ExitStack() as stack:
        for parallelism in PARALLELISMS.values():
            context = parallelism.sync(model, enabled) if parallelism.sync else None
            if context is not None:
                stack.enter_context(context)
        yield
# --8<-- [end:gradient_sync]


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module underneath any DDP wrapper (FSDP2 and tensor parallel wrap in place)."""
    return model.module if isinstance(model, DDP) else model

"""Wrap a model for the configured parallelisms, chosen from one registry.

Each parallelism is a function that takes the model and the mesh of its axis and returns
the wrapped model. `PARALLELISMS` names them in the order they apply: pipeline parallel
keeps this rank's stage of the model, tensor parallel splits its matmuls, context parallel
its sequences, expert parallel its experts, then a
data-parallel wrapper (DDP or FSDP2) spans the replicas. Adding a parallelism is a module
with its wrap function and one entry here.
"""

# --8<-- [start:imports]
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from reference_impl.compiled import compile_units
from reference_impl.config import TrainConfig
from reference_impl.distributed import DistContext
from reference_impl.model import spec_of

# --8<-- [end:imports]
from reference_impl.parallel import context_parallel, experts, pipeline, tensor_parallel, ulysses
from reference_impl.parallel.mesh import ParallelDims


# --8<-- [start:data_parallel]
def ddp(model: nn.Module, mesh: DeviceMesh, cfg: TrainConfig) -> nn.Module:
    """Replicate the model: DDP broadcasts rank 0's weights at construction, then
    all-reduces gradients in buckets that overlap with the rest of the backward pass.

    The gradients are views into the buckets (`gradient_as_bucket_view`): otherwise each
    gradient is a tensor of its own that DDP copies into its bucket, one kernel launch per
    parameter and step, which costs more host time than GPU time at small batches (on an
    H200, 150 launches fewer per step and 36.8 -> 31.8 ms per step for the 219 M model at
    eight sequences; `scripts/gpu_profile.py`).
    """
    on_cuda = mesh.device_type == "cuda"
    return DDP(model, process_group=mesh.get_group(), device_ids=[torch.cuda.current_device()] if on_cuda else None,
               gradient_as_bucket_view=True)


def own_tensor(module: nn.Module, args: object, output: object) -> object:
    """A forward hook: the root's output as a tensor of its own when it is a view.

    FSDP2 hooks the backward pass onto the root's output and warns on every forward when
    that output is a view (an in-place op on it would drop the hook). A transformer's logits
    are one: Linear on 3-D input views a 2-D matmul's result. Only FSDP2 pays for the copy;
    DDP and a single process train on the view, since at a large vocabulary the logits are
    the step's largest tensor.
    """
    return output.clone() if isinstance(output, torch.Tensor) and output._is_view() else output


def fsdp(model: nn.Module, mesh: DeviceMesh, cfg: TrainConfig) -> nn.Module:
    """Shard every parameter over `mesh` with FSDP2 (`fully_shard`). A 2-D mesh
    (dp_replicate, dp_shard) makes it HSDP: shards within each replica group, gradients
    reduce-scattered there and all-reduced across the groups."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if cfg.precision == "bf16" else MixedPrecisionPolicy()
    # Shard each repeated unit (a transformer's blocks) first so its parameters are gathered
    # just before use and freed right after; the root call then covers the leftovers
    # (embeddings, head).
    for unit in spec_of(cfg).repeated_units(model):
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    model.register_forward_hook(own_tensor)  # before fully_shard's, so FSDP2 sees the copy
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model
# --8<-- [end:data_parallel]


# --8<-- [start:registry]
@dataclass(frozen=True)
class Parallelism:
    """One way of splitting the work, and what it implies for the rest of the run.

    Attributes:
        axis: The mesh axis it spans (see `reference_impl.parallel.mesh.AXES`).
        wrap: Returns the model wrapped over the mesh of that axis.
        sharded: Ranks hold different parts of the parameters (DTensor shards, or pipeline
            stages), so every rank writes its part and checkpoints go through DCP.
    """

    axis: str
    wrap: Callable[[nn.Module, DeviceMesh, TrainConfig], nn.Module]
    sharded: bool


# The attention that context parallel runs (`--cp-style`): both keep the same tokens per rank.
CP_STYLES: dict[str, Callable[[nn.Module, DeviceMesh, TrainConfig], nn.Module]] = {
    "ring": context_parallel.wrap, "ulysses": ulysses.wrap}
PARALLELISMS: dict[str, Parallelism] = {  # applied in this order
    "pp": Parallelism("pp", pipeline.split, sharded=True),
    "tp": Parallelism("tp", tensor_parallel.parallelize, sharded=True),
    "cp": Parallelism("cp", lambda model, mesh, cfg: CP_STYLES[cfg.cp_style](model, mesh, cfg), sharded=False),
    "ep": Parallelism("ep", experts.wrap, sharded=True),
    "ddp": Parallelism("dp_replicate", ddp, sharded=False),
    "fsdp": Parallelism("dp_shard", fsdp, sharded=True),
}
DATA_PARALLEL_AXES = ("dp_replicate", "dp_shard")  # their wrappers come last, after compile
# --8<-- [end:registry]


def dims_of(cfg: TrainConfig, device_type: str = "cpu") -> ParallelDims:
    """The mesh of `cfg`: `--pp-degree`, `--tp-degree`, `--cp-degree` and `--ep-degree` on
    their axes, the rest on the strategy's axis."""
    return ParallelDims.from_config(cfg, PARALLELISMS[cfg.strategy].axis, device_type)


def checkpoint_layout(cfg: TrainConfig) -> str:
    """"dcp" when a parallelism the run applies splits the parameters, else "torch_save"."""
    used = dims_of(cfg).wrapped_axes  # the axes `parallelize` applies a parallelism over
    return "dcp" if any(p.sharded for p in PARALLELISMS.values() if p.axis in used) else "torch_save"


# --8<-- [start:parallelize]
def parallelize(model: nn.Module, dims: ParallelDims, cfg: TrainConfig, ctx: DistContext) -> nn.Module:
    """Move the model to its device and apply the parallelism of every used mesh axis, in
    torchtitan's order: pp, tp, cp, ep, then `--compile`, then the data-parallel wrappers.

    What is model-specific (the units to shard and compile, the TP plan, the pipeline
    stages) comes from the model's spec (`reference_impl.model.spec_of`).
    """
    model = model.to(ctx.device)
    if cfg.activation_checkpointing:
        model.checkpoint_blocks = True  # type: ignore[assignment]  # torch types Module attributes as Tensor | Module
    applied = [p for p in PARALLELISMS.values() if ctx.distributed and p.axis in dims.wrapped_axes]
    # Compile sees the split (pipeline stage, tensor-parallel) model; the data-parallel
    # wrappers come after it, so their hooks stay outside the compiled code.
    for parallelism in [p for p in applied if p.axis not in DATA_PARALLEL_AXES]:
        model = parallelism.wrap(model, dims.mesh_of(parallelism.axis), cfg)
    if cfg.compile:
        compile_units(model, spec_of(cfg).repeated_units(model))
    for parallelism in [p for p in applied if p.axis in DATA_PARALLEL_AXES]:
        model = parallelism.wrap(model, dims.mesh_of(parallelism.axis), cfg)
    return model
# --8<-- [end:parallelize]


def gradient_sync(model: nn.Module, enabled: bool) -> AbstractContextManager[None]:
    """Skip the gradient all-reduce (DDP) or reduce-scatter (FSDP2) when not `enabled`.

    Under DDP this is `no_sync()`. Under FSDP2 skipping the reduce-scatter keeps
    unsharded gradients on every rank until the last micro-batch: less communication,
    more memory (`--fsdp-grad-sync every` passes `enabled=True` on every micro-batch).
    Tensor parallel has no gradient sync to skip: its collectives are part of the math.
    """
    if enabled:
        return _fsdp_sync(model, True) if isinstance(model, FSDPModule) else nullcontext()
    if isinstance(model, DDP):
        return model.no_sync()
    if isinstance(model, FSDPModule):
        return _fsdp_sync(model, False)
    return nullcontext()


@contextmanager
def _fsdp_sync(model: FSDPModule, enabled: bool) -> Iterator[None]:
    model.set_requires_gradient_sync(enabled)
    yield


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module underneath any DDP wrapper (FSDP2 and tensor parallel wrap in place)."""
    return model.module if isinstance(model, DDP) else model

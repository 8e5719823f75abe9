"""Data parallel: DDP replicates the model, FSDP2 shards it (HSDP: shards within replica
groups), and both average the gradients of the ranks that read different samples.

Their registry entries (`reference_impl.parallel.registry`) apply them last, after
`--compile`, over the data axis and, under context parallel, the cp ranks too: those train
on different tokens of the same samples, so their gradients are averaged alike.
"""

# --8<-- [start:imports]
from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

# --8<-- [end:imports]
from reference_impl.config import TrainConfig
from reference_impl.model import spec_of
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


def shard(model: nn.Module, units: Iterable[nn.Module], mesh: DeviceMesh, bf16: bool) -> nn.Module:
    """Shard every parameter over `mesh` with FSDP2 (`fully_shard`), each of `units` (a
    transformer's blocks) as a group of its own. A 2-D mesh (dp_replicate, dp_shard) makes
    it HSDP: shards within each replica group, gradients reduce-scattered there and
    all-reduced across the groups."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if bf16 else MixedPrecisionPolicy()
    # Shard each repeated unit first so its parameters are gathered just before use and
    # freed right after; the root call then covers the leftovers (embeddings, head).
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    model.register_forward_hook(own_tensor)  # before fully_shard's, so FSDP2 sees the copy
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model
# --8<-- [end:data_parallel]


def fsdp(model: nn.Module, mesh: DeviceMesh, cfg: TrainConfig) -> nn.Module:
    """FSDP2 as the registry applies it: `shard` over the repeated units the model's spec
    names, in bf16 with fp32 gradient reduction under `--precision bf16`."""
    return shard(model, spec_of(cfg).repeated_units(model), mesh, bf16=cfg.precision == "bf16")


def wraps(axis: str, dims: ParallelDims) -> bool:
    """Whether the data-parallel wrapper of `axis` (dp_replicate: DDP, dp_shard: FSDP2) runs:
    its axis is the run's data axis, expert parallel does not average the data ranks in its
    place, and it spans more than one rank (or the cp ranks, or a one-rank job's one rank)."""
    return dims.data_axis == axis and dims.ep == 1 and (axis in dims.used_axes or dims.cp > 1)


def _hsdp(dims: ParallelDims) -> bool:
    """FSDP2 shards over dp_shard and replicates over dp_replicate: one wrapper spans both."""
    return dims.data_axis == "dp_shard" and dims.dp_replicate > 1


def data_mesh(dims: ParallelDims) -> DeviceMesh:
    """The ranks the data-parallel wrapper spans: under HSDP the 2-D (dp_replicate,
    dp_shard) mesh, which `fully_shard` treats as shard-within-replicate; under context
    parallel the data and cp ranks as one flat axis (the ranks of a cp group train on
    different tokens of the same samples, so their gradients are averaged as the data
    shards' are); else the data axis."""
    axis, mesh = dims.data_axis, dims.device_mesh
    if _hsdp(dims):
        return mesh["dp_replicate", "dp_shard"]
    if dims.cp > 1:
        return mesh[axis, "cp"]._flatten() if dims.degree(axis) > 1 else mesh["cp"]
    return mesh[axis]


def ddp_sync(model: nn.Module, enabled: bool) -> AbstractContextManager[None] | None:
    """DDP's all-reduce skipped (`no_sync`) on the micro-batches that only accumulate."""
    return model.no_sync() if isinstance(model, DDP) and not enabled else None


def fsdp_sync(model: nn.Module, enabled: bool) -> AbstractContextManager[None] | None:
    """FSDP2's reduce-scatter on or off. Skipping it keeps unsharded gradients on every rank
    until the last micro-batch: less communication, more memory (`--fsdp-grad-sync every`
    passes `enabled=True` on every micro-batch)."""
    return _requires_gradient_sync(model, enabled) if isinstance(model, FSDPModule) else None


@contextmanager
def _requires_gradient_sync(model: FSDPModule, enabled: bool) -> Iterator[None]:
    model.set_requires_gradient_sync(enabled)
    yield

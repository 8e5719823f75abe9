"""Wrap a model for data parallelism: DDP replicates it, FSDP2 shards it."""

# --8<-- [start:imports]
from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
# --8<-- [end:imports]

from reference_impl.config import TrainConfig
from reference_impl.distributed import DistContext


# --8<-- [start:wrap_model]
def wrap_model(model: nn.Module, cfg: TrainConfig, ctx: DistContext) -> nn.Module:
    """Move the model to its device and wrap it for the configured strategy."""
    model = model.to(ctx.device)
    if cfg.activation_checkpointing:
        model.checkpoint_blocks = True
    if not ctx.distributed:
        return model
    if cfg.strategy == "ddp":
        # DDP broadcasts rank 0's weights at construction, then all-reduces gradients
        # in buckets that overlap with the rest of the backward pass.
        return DDP(model, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None)
    # An explicit mesh on the training device: gloo on CPU, NCCL on CUDA.
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if cfg.precision == "bf16" else MixedPrecisionPolicy()
    # Shard each block first so its parameters are gathered just before use and freed
    # right after; the root call then covers the leftovers (embeddings, head).
    for block in getattr(model, "blocks", []):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model
# --8<-- [end:wrap_model]


def gradient_sync(model: nn.Module, enabled: bool) -> AbstractContextManager[None]:
    """Skip the gradient all-reduce (DDP) or reduce-scatter (FSDP2) when not `enabled`.

    Under DDP this is `no_sync()`. Under FSDP2 skipping the reduce-scatter keeps
    unsharded gradients on every rank until the last micro-batch: less communication,
    more memory (`--fsdp-grad-sync every` passes `enabled=True` on every micro-batch).
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
    """The user's module underneath any DDP wrapper (FSDP2 wraps in place)."""
    return model.module if isinstance(model, DDP) else model

"""A rank of the FSDP2 accumulation test, in a module of its own: a spawned child imports
only torch and `reference_impl`, not the test module's imports.

Each rank shards the trainer's MLP with the trainer's own `fsdp` wrap, runs two micro-batches
of its own through `gradient_sync` as `train_step` does (the first accumulating, the last
synchronising), and records what its sharded parameters hold after each backward.
"""

from __future__ import annotations

import copy
import json
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from reference_impl.config import TrainConfig
from reference_impl.model import build_model
from reference_impl.parallel.data_parallel import fsdp
from reference_impl.parallel.registry import gradient_sync

MICRO_BATCH = 4


def _micro_batch(cfg: TrainConfig, rank: int, index: int) -> torch.Tensor:
    """Rank `rank`'s micro-batch `index`, which every rank can draw to build the reference."""
    return torch.randn(MICRO_BATCH, cfg.input_dim, generator=torch.Generator().manual_seed(100 * rank + index))


def accumulate(rank: int, world_size: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=60))
    try:
        cfg = TrainConfig(strategy="fsdp", model="mlp", hidden_dim=16)
        torch.manual_seed(0)
        model = build_model(cfg)
        reference = copy.deepcopy(model)  # unsharded: every rank's micro-batches, in this process
        fsdp(model, init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",)), cfg)
        seen = {}
        for index, last in enumerate((False, True)):
            with gradient_sync(model, enabled=last):
                model(_micro_batch(cfg, rank, index)).sum().backward()
            seen["after_last" if last else "after_accumulating"] = [p.grad is not None for p in model.parameters()]
        # FSDP2 averages over the ranks; each rank's gradient is the sum over its micro-batches.
        for r in range(world_size):
            for index in range(2):
                (reference(_micro_batch(cfg, r, index)).sum() / world_size).backward()
        seen["max_error"] = max(float((p.grad.full_tensor() - q.grad).abs().max()) if p.grad is not None
                                else float("inf")
                                for p, q in zip(model.parameters(), reference.parameters(), strict=True))
        Path(out, f"rank{rank}.json").write_text(json.dumps(seen))
    finally:
        dist.destroy_process_group()

"""The run's full state as plain, canonically ordered dictionaries, and its digest."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """Unsharded model and optimizer state keyed by parameter name, on the CPU.

    Works for plain modules, DDP and FSDP2 alike. Under FSDP2 this gathers shards, so
    every rank must call it; only rank 0 receives the values.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_state_dict(model, optimizer, options=options)


def state_digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """sha256 over every parameter and optimizer-state value in sorted-key order.

    Two runs that should be bit-identical print the same digest; a single flipped bit
    in any weight or Adam moment changes it. Collective under FSDP2 (see `full_state`).
    """
    model_sd, optim_sd = full_state(model, optimizer)
    h = hashlib.sha256()
    _update(h, "model", model_sd)
    _update(h, "optim", optim_sd)
    return h.hexdigest()


def _update(h: Any, prefix: str, value: Any) -> None:
    if isinstance(value, dict):
        for key in sorted(value, key=str):
            _update(h, f"{prefix}.{key}", value[key])
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _update(h, f"{prefix}.{i}", item)
    elif isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous().reshape(-1)
        h.update(f"{prefix}:{value.dtype}:{tuple(value.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    else:
        h.update(f"{prefix}={json.dumps(value, default=str)}".encode())

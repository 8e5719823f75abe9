"""Tensor parallel with DTensor: the model's own plan, applied over the mesh's tp axis.

A model that supports tensor parallel has a `tp_plan` in its spec naming, per submodule, a
`ParallelStyle` (`ColwiseParallel`, `RowwiseParallel`, `SequenceParallel`, ...). This
module applies it and then turns every parameter the plan left whole (embeddings) into
a replicated DTensor, so the optimizer, gradient clipping, FSDP2 and DCP see one kind of
parameter on one mesh.
"""

# --8<-- [start:imports]
from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

# --8<-- [end:imports]
from reference_impl.config import TrainConfig
from reference_impl.model import spec_of


# --8<-- [start:apply_plan]
def apply_plan(model: nn.Module, mesh: DeviceMesh, plan: dict[str, ParallelStyle]) -> nn.Module:
    """Split `model` over `mesh` (the tp axis) in place by `plan`, then replicate the rest."""
    parallelize_module(model, mesh, plan)
    # Every parameter not yet a DTensor becomes a Replicate one; the root's inputs (token
    # ids, the same on every rank of the group) become Replicate DTensors to match.
    # torch annotates input_fn as returning None, but the pre-hook it installs returns its result: the new inputs.
    distribute_module(model, mesh, input_fn=_replicate_inputs)  # type: ignore[arg-type]
    return model


def _replicate_inputs(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)
# --8<-- [end:apply_plan]


def parallelize(model: nn.Module, mesh: DeviceMesh, cfg: TrainConfig) -> nn.Module:
    """Split `model` over `mesh` (the tp axis) in place, following its spec's `tp_plan`.

    Raises:
        TypeError: The model's spec has no tensor-parallel plan.
    """
    tp_plan = spec_of(cfg).tp_plan
    if tp_plan is None:
        raise TypeError(f"{type(model).__name__} has no tp_plan; it cannot run tensor parallel")
    return apply_plan(model, mesh, tp_plan(model))

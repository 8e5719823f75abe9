"""What each model can run with, declared next to the names `--model` accepts, without torch.

The config's checks ask this declaration instead of comparing model names;
`tests/test_spec.py` checks it against the specs in `reference_impl.model` (the code that
builds and parallelizes each model), so the two cannot drift apart.
"""

# --8<-- [start:capabilities]
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ModelCapabilities:
    """What a model can run with; each False is a `ConfigError` for the flag that needs it."""

    tensor_parallel: bool = False
    """It has a tensor-parallel plan (`ModelSpec.tp_plan`)."""
    pipeline: bool = False
    """It can be cut into stages (`ModelSpec.pipeline_stage`)."""
    context_parallel: bool = False
    """Its attention can run as ring attention over a split sequence."""
    experts: bool = False
    """Its MLPs can become a mixture of experts."""
    fp8: bool = False
    """Its linears can be swapped for float8 ones."""
    activation_checkpointing: bool = False
    """It has repeated blocks to recompute (`ModelSpec.repeated_units`)."""


ModelName = Literal["mlp", "transformer"]  # what --model accepts; each one declared below
MODEL_CAPABILITIES: dict[str, ModelCapabilities] = {
    "mlp": ModelCapabilities(),
    "transformer": ModelCapabilities(tensor_parallel=True, pipeline=True, context_parallel=True,
                                     experts=True, fp8=True, activation_checkpointing=True),
}


def models_with(capability: str) -> str:
    """The `--model` names that have `capability`, as a message names them."""
    return " or ".join(name for name, caps in MODEL_CAPABILITIES.items() if getattr(caps, capability))
# --8<-- [end:capabilities]

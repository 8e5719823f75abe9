"""What a model tells the parallel code about itself, so that code never names its attributes.

A model module defines one `ModelSpec` for each model it holds and `reference_impl.model`
registers it under the `--model` name. FSDP2, `--compile`, tensor and pipeline parallel, the
trainer's dataset and the benchmarks' FLOPs all ask the spec.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle
from torch.utils.data import Dataset

if TYPE_CHECKING:
    from reference_impl.config import TrainConfig
    from reference_impl.data import Sample


# --8<-- [start:spec]
@dataclass(frozen=True)
class ModelSpec:
    """Everything model-specific that building, parallelizing and measuring a model needs.

    Attributes:
        build: Constructs the model from the config (the caller seeds the RNG around it).
        dataset: The synthetic dataset whose samples the model takes, from the config.
        flops_per_sample: Training FLOPs (forward and backward) per sample, from the config.
        repeated_units: The model's (or its pipeline stage's) repeated submodules: each one
            is an FSDP2 unit, a `--compile` unit and an activation-checkpointing unit. Empty
            when the model has none (FSDP2 then shards the root alone, compile the root).
        tp_plan: The `ParallelStyle` of each submodule for tensor parallel, or None when
            the model cannot run tensor parallel.
        pipeline_stage: `(model, cfg, pp_degree, stage)` to the module that stage `stage`
            of `pp_degree` keeps (under an interleaved schedule, a module whose `chunks` are
            its stages, the ones the schedule runs), or None when the model cannot be cut
            into stages.
    """

    build: Callable[[TrainConfig], nn.Module]
    dataset: Callable[[TrainConfig], Dataset[Sample]]
    flops_per_sample: Callable[[TrainConfig], float]
    repeated_units: Callable[[nn.Module], list[nn.Module]]
    tp_plan: Callable[[nn.Module], dict[str, ParallelStyle]] | None = None
    pipeline_stage: Callable[[nn.Module, TrainConfig, int, int], nn.Module] | None = None
# --8<-- [end:spec]

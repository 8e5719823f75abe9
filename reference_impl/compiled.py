"""`--compile`: torch.compile (inductor) on the model's repeated units (its spec names them), in place.

Only each unit's `forward` is replaced, never `__call__`: the hooks that DDP, FSDP2 and
activation checkpointing hang on a module run eagerly around the compiled code, and the
parameter names (hence state dicts and checkpoints) are those of the eager model, so a
checkpoint written by a compiled run restores into an eager one and back.
"""

# --8<-- [start:imports]
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

# --8<-- [end:imports]


# --8<-- [start:compile_units]
def compile_units(model: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """Compile the forward of each of `units` (the model's repeated units, such as a
    transformer's blocks) in place, or the whole model's forward when it has none (an MLP).

    One compiled block serves every block: they share code and shapes, so dynamo traces
    once and reuses the graph (parameters are graph inputs, not constants). Called after
    tensor parallel and before DDP or FSDP2 wrap the model, as torchtitan orders it.

    Returns:
        The modules whose forward is now compiled.
    """
    units = units or [model]
    for unit in units:
        unit.forward = torch.compile(unit.forward)
    return units
# --8<-- [end:compile_units]


# --8<-- [start:compiled_loss]
@functools.cache
def compiled_loss(loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                  ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`loss` compiled, once per process: what `--compile` trains with.

    The loss is the one memory-bound stretch the blocks' compile does not reach. Eager,
    the cross-entropy's fp32 upcast, log-softmax and their backward each make a full pass
    over the batch x sequence x vocabulary logits; inductor fuses them, reading the bf16
    logits and writing their bf16 gradient without materializing the fp32 copy.
    """
    return torch.compile(loss)
# --8<-- [end:compiled_loss]

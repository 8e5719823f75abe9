"""Whether a checkpoint's contents fit the objects a restore loads them into.

A checkpoint can be intact (every checksum right) and still not fit: a parameter renamed
by a code change, an RNG state of another size, a scheduler state edited by hand. The
loaders would fail halfway through a restore (`load_state_dict` raising after the model is
already loaded) or, worse, accept it and fail at the first step. So every part is checked
against the live object before anything is loaded, and a part that does not fit is a
reason to fall back, like a corrupt file.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from reference_impl.checkpoint.files import CheckpointError, need
from reference_impl.state import rng_state, set_rng_state


def same_structure(saved: Any, live: Any, where: str) -> None:
    """`saved` has the shape of `live` (a part's own `state_dict()`): the same keys, lengths,
    tensor shapes and scalar types, and finite floats.

    Raises:
        CheckpointError: Naming the first place where they differ.
    """
    if isinstance(live, dict):
        need(isinstance(saved, dict) and set(saved) == set(live),
             f"{where} holds {_keys(saved)}, this run's has {_keys(live)}")
        for key, value in live.items():
            same_structure(saved[key], value, f"{where}.{key}")
    elif isinstance(live, (list, tuple)):
        need(isinstance(saved, (list, tuple)) and len(saved) == len(live),
             f"{where} is {type(saved).__name__} {saved!r:.60}, not {len(live)} items")
        for i, (item, expected) in enumerate(zip(saved, live, strict=True)):
            same_structure(item, expected, f"{where}[{i}]")
    elif isinstance(live, torch.Tensor):
        need(isinstance(saved, torch.Tensor) and saved.shape == live.shape,
             f"{where} is {_describe(saved)}, not a tensor of shape {tuple(live.shape)}")
    else:
        need(type(saved) is type(live) and not (isinstance(saved, float) and not math.isfinite(saved)),
             f"{where} is {saved!r:.60}, not a finite {type(live).__name__}")


def check_model(saved: Any, model: nn.Module, where: str) -> None:
    """A whole model's saved state dict has this model's names and shapes.

    Raises:
        CheckpointError: Naming parameters missing, unexpected or of another shape.
    """
    live = model.state_dict()
    need(isinstance(saved, dict), f"{where} is no state dict")
    missing, unexpected = sorted(set(live) - set(saved)), sorted(set(saved) - set(live), key=str)
    need(not missing and not unexpected, f"{where} does not fit this model: missing {missing[:3]}, "
                                         f"unexpected {[str(k)[:60] for k in unexpected[:3]]}")
    for name, tensor in live.items():
        same_structure(saved[name], tensor, f"{where} {name}")


def check_optimizer(saved: Any, optimizer: torch.optim.Optimizer, where: str) -> None:
    """A saved optimizer state has this optimizer's groups and parameters, and each
    parameter's state tensors are scalars or of its shape (Adam's moments, SGD's momentum).

    torch's own `load_state_dict` checks only the number of parameters per group: a moment
    of another shape loads and fails at the next step.

    Raises:
        CheckpointError: Naming the first group or parameter that does not fit.
    """
    live = optimizer.state_dict()
    need(isinstance(saved, dict) and isinstance(saved.get("state"), dict)
         and isinstance(saved.get("param_groups"), list), f"{where} is no optimizer state dict")
    groups = saved["param_groups"]
    need(len(groups) == len(live["param_groups"]), f"{where} has {len(groups)} param groups, "
                                                   f"this optimizer {len(live['param_groups'])}")
    for i, (group, own) in enumerate(zip(groups, live["param_groups"], strict=True)):
        need(isinstance(group, dict) and group.get("params") == own["params"],
             f"{where} param group {i} lists other parameters")
    shapes = {index: param.shape for own, group in zip(live["param_groups"], optimizer.param_groups, strict=True)
              for index, param in zip(own["params"], group["params"], strict=True)}
    for index, state in saved["state"].items():
        need(index in shapes and isinstance(state, dict), f"{where} holds state for no parameter ({index!r:.40})")
        for key, value in state.items():
            need(not isinstance(value, torch.Tensor) or value.ndim == 0 or value.shape == shapes[index],
                 f"{where} {key} of parameter {index} is {_describe(value)}, the parameter {tuple(shapes[index])}")


def check_rng(saved: Any, where: str) -> None:
    """This process's generators accept `saved`: tried, then put back as they were.

    A dry run rather than a list of sizes: Python, NumPy, torch and CUDA each check their
    own state, and they know it best.

    Raises:
        CheckpointError: With the generator's own reason.
    """
    current = rng_state()
    try:
        set_rng_state(saved)
    except Exception as exc:  # whatever a generator refuses with: untrusted input, a reason
        raise CheckpointError(f"{where} does not fit this process's generators: "
                              f"{type(exc).__name__}: {str(exc)[:120]}") from None
    finally:
        set_rng_state(current)


def _keys(value: Any) -> str:
    return str(sorted(map(str, value))[:6]) if isinstance(value, dict) else type(value).__name__


def _describe(value: Any) -> str:
    return f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else f"{value!r:.40}"

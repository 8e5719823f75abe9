"""The training state: what the loop mutates, what a checkpoint saves, and its digest."""

# --8<-- [start:imports]
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader

# --8<-- [end:imports]
from reference_impl.data import ResumableDistributedSampler, Sample
from reference_impl.parallel.mesh import ParallelDims

if TYPE_CHECKING:
    from reference_impl.parallel.pipeline import Pipeline

# A part's key in train.pt, to its name in `--resume-skip` where the two differ.
RESUME_NAMES = {"sampler": "data"}


@dataclass
class TrainState:
    """Everything the loop mutates; a checkpoint must capture all of it to resume exactly.

    `mesh` and `pipeline` are the exceptions, fixed for the run: how the ranks split the
    work (read by the sampler's construction, the model wrappers and the checkpoint), and,
    under pipeline parallel, the schedule that runs this rank's stage (`model`).
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    scaler: torch.amp.GradScaler | None
    sampler: ResumableDistributedSampler
    loader: DataLoader[Sample]
    mesh: ParallelDims
    pipeline: Pipeline | None = None
    step: int = 0
    preempted: bool = False

    def replicated_parts(self) -> dict[str, Any]:
        """The stateful parts every rank holds alike, by their key in train.pt.

        Save writes each one's `state_dict()` and restore loads each one back from this one
        mapping, so a new part is one line here. Model and optimizer are not in it: their
        layout depends on the strategy (one copy under DDP, shards under FSDP). A part that
        does not exist in this run (no GradScaler outside fp16) is None.
        """
        return {"scheduler": self.scheduler, "scaler": self.scaler, "sampler": self.sampler}


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer,
               pp_group: dist.ProcessGroup | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Unsharded model and optimizer state keyed by parameter name, on the CPU.

    Works for plain modules, DDP and FSDP2 alike. Under FSDP2 this gathers shards, so
    every rank must call it; only rank 0 receives the values. Under pipeline parallel,
    `pp_group` is the rank's pipeline: its stages' states are merged into the whole
    model's, on every rank of it.
    """
    # Imported here, at the end of a run, not with this module: a restarted run would pay
    # for DCP's modules before its first step (see `reference_impl.checkpoint.layouts`).
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    if pp_group is None:
        return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # No CPU offload: it would keep the values on global rank 0 alone, not on each stage.
    mine = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    mine = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.detach().cpu(), mine)
    stages: list[Any] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(stages, mine, group=pp_group)
    return merge_stages(stages)


def merge_stages(stages: list[tuple[dict[str, Any], dict[str, Any]]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """One model and optimizer state from the stages' states, in stage order.

    Parameter names are already the whole model's (`reference_impl.model.Stage`); each
    optimizer param group lists the stages' parameters one rank after another, which is
    the whole model's parameter order with one stage per rank. Under an interleaved
    schedule it is rank order (stages 0 and 2, then 1 and 3): the same for any two runs of
    one layout, so their digests still compare.
    """
    model_sd = {k: v for model_part, _ in stages for k, v in model_part.items()}
    optim_state = {k: v for _, optim_part in stages for k, v in optim_part["state"].items()}
    groups = [{**same[0], "params": [name for group in same for name in group["params"]]}
              for same in zip(*(optim_part["param_groups"] for _, optim_part in stages), strict=True)]
    return model_sd, {"state": optim_state, "param_groups": groups}


def state_digest(model: nn.Module, optimizer: torch.optim.Optimizer,
                 pp_group: dist.ProcessGroup | None = None) -> str:
    """sha256 over every parameter and optimizer-state value in sorted-key order.

    Two runs that should be bit-identical print the same digest; a single flipped bit
    in any weight or Adam moment changes it. Collective under FSDP2 and pipeline
    parallel (see `full_state`).
    """
    model_sd, optim_sd = full_state(model, optimizer, pp_group)
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


# --8<-- [start:rng_state]
def rng_state() -> dict[str, Any]:
    """This rank's Python, NumPy, torch and CUDA generator states as tensors and ints.

    NumPy's state holds an ndarray that `torch.load(weights_only=True)` refuses, so its
    key array is stored as an int64 tensor and rebuilt on load: no pickled NumPy objects.
    """
    import random

    import numpy as np

    version, py_state, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(py_state, dtype=torch.int64), "gauss": gauss},
        "numpy": {"keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` captured, exactly."""
    import random

    import numpy as np

    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state(("MT19937", npy["keys"].numpy().astype(np.uint32), npy["pos"],
                         npy["has_gauss"], npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
# --8<-- [end:rng_state]

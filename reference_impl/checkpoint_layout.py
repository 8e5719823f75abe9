"""How model and optimizer state go into a checkpoint directory: one class per layout.

The checkpoint store (`reference_impl.checkpoint_store`) knows file names, hashing, the
manifest and the atomic publish, and nothing about tensors. A layout knows the tensors:

* `torch_save`: the model and optimizer are whole on every rank (single process, DDP);
  rank 0 puts them into train.pt.
* `dcp`: ranks hold different parts of the parameters (FSDP2 and tensor-parallel shards,
  pipeline stages); every rank writes its part with torch.distributed.checkpoint under
  `dcp/`, under the whole model's names, restorable on another mesh.

`LAYOUTS` maps the name recorded in the manifest to the layout, so a restore reads a
checkpoint with the layout that wrote it, whatever the current run uses. Adding a layout
is a subclass of `CheckpointLayout` and one entry in `LAYOUTS`.
"""

from __future__ import annotations

import tempfile
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from reference_impl.parallel import unwrap
from reference_impl.state import TrainState

if TYPE_CHECKING:  # the store imports this module's registry
    from reference_impl.checkpoint_store import AsyncSaver

DCP_DIR = "dcp"
# Optimizer state keyed per parameter name ("param_groups.blocks.0.qkv.weight.lr"), not as
# one list of param groups: pipeline stages each hold some of the parameters, and
# per-stage lists saved under one key would overwrite each other.
DCP_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


# --8<-- [start:interface]
class CheckpointLayout(ABC):
    """Where the model and optimizer state of a checkpoint live, and how to read them back.

    Attributes:
        train_keys: Keys this layout adds to train.pt (written by rank 0).
        required: Files besides train.pt and the rank files that a restore reads.
    """

    train_keys: ClassVar[frozenset[str]] = frozenset()
    required: ClassVar[frozenset[str]] = frozenset()

    def train_entries(self, state: TrainState) -> dict[str, Any]:
        """Model and optimizer entries for train.pt (rank 0 only); none by default."""
        return {}

    def write(self, state: TrainState, directory: Path, saver: AsyncSaver | None) -> bool:
        """Every rank writes its own files into `directory` (none by default).

        Returns True when the write continues in the background in `saver`, which then
        publishes the checkpoint once it completes.
        """
        return False

    @abstractmethod
    def load(self, state: TrainState, path: Path, saved: dict[str, Any]) -> None:
        """Load model and optimizer into `state` from step directory `path` (every rank)."""

    @abstractmethod
    def full_model(self, path: Path, saved: dict[str, Any], scratch: Path) -> dict[str, torch.Tensor]:
        """The whole model's state dict, in one process; temporary files go under `scratch`."""
# --8<-- [end:interface]


class TorchSaveLayout(CheckpointLayout):
    """Whole tensors in train.pt, loaded with the weights-only unpickler."""

    train_keys = frozenset({"model", "optimizer"})

    def train_entries(self, state: TrainState) -> dict[str, Any]:
        return {"model": unwrap(state.model).state_dict(), "optimizer": state.optimizer.state_dict()}

    def load(self, state: TrainState, path: Path, saved: dict[str, Any]) -> None:
        unwrap(state.model).load_state_dict(saved["model"])
        state.optimizer.load_state_dict(saved["optimizer"])

    def full_model(self, path: Path, saved: dict[str, Any], scratch: Path) -> dict[str, torch.Tensor]:
        return saved["model"]


# --8<-- [start:dcp_layout]
class DcpLayout(CheckpointLayout):
    """DTensor shards written by every rank through DCP; DCP reshards them on load."""

    required = frozenset({f"{DCP_DIR}/.metadata"})  # DCP's own commit point

    def write(self, state: TrainState, directory: Path, saver: AsyncSaver | None) -> bool:
        sharded = {"model_optim": _sharded_state(state)}
        if saver:
            saver.start(sharded, directory / DCP_DIR)
            return True
        dcp.save(sharded, checkpoint_id=directory / DCP_DIR)
        return False

    def load(self, state: TrainState, path: Path, saved: dict[str, Any]) -> None:
        # The fresh state's own shards say which slices this rank reads: the saved mesh
        # (world size, tp degree) may differ from ours.
        sharded = {"model_optim": _sharded_state(state)}
        dcp.load(sharded, checkpoint_id=path / DCP_DIR)
        set_state_dict(state.model, state.optimizer, model_state_dict=sharded["model_optim"]["model"],
                       optim_state_dict=sharded["model_optim"]["optim"], options=DCP_OPTIONS)

    def full_model(self, path: Path, saved: dict[str, Any], scratch: Path) -> dict[str, torch.Tensor]:
        with tempfile.TemporaryDirectory(dir=scratch, prefix=".export-") as tmp:
            merged = Path(tmp) / "merged.pt"
            dcp_to_torch_save(path / DCP_DIR, merged)  # gathers every shard into full tensors
            return torch.load(merged, map_location="cpu", weights_only=True)["model_optim"]["model"]
# --8<-- [end:dcp_layout]


# --8<-- [start:layouts]
LAYOUTS: dict[str, CheckpointLayout] = {"torch_save": TorchSaveLayout(), "dcp": DcpLayout()}
# --8<-- [end:layouts]


def _sharded_state(state: TrainState) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(state.model, state.optimizer, options=DCP_OPTIONS)
    return {"model": model_sd, "optim": optim_sd}

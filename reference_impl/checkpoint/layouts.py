"""How model and optimizer state go into a checkpoint directory: one class per layout.

The manager (`reference_impl.checkpoint.manager`) knows file names, hashing, the
manifest, the atomic publish and retention, and nothing about tensors. A layout knows
the tensors:

* `torch_save`: the model and optimizer are whole on every rank (single process, DDP);
  rank 0 puts them into train.pt.
* `dcp`: ranks hold different parts of the parameters (FSDP2 and tensor-parallel shards,
  pipeline stages); every rank writes its part with torch.distributed.checkpoint under
  `dcp/`, under the whole model's names, restorable on another mesh. It is read back only
  through `reference_impl.checkpoint.dcp_safe`, never with DCP's pickle-based reader.

`LAYOUTS` maps the name recorded in the manifest to the layout, so a restore reads a
checkpoint with the layout that wrote it, whatever the current run uses. Adding a layout
is a subclass of `CheckpointLayout` and one entry in `LAYOUTS`.

DCP (`torch.distributed.checkpoint`, and `dcp_safe` on top of it) is imported inside the
methods of `DcpLayout` and `AsyncSaver` that use it, not with this module: a run whose
parameters are whole (single process, DDP) never needs it, and each of its processes
would pay for it again at every restart, before the first resumed step (0.07-0.08 s of
CPU here, on top of the DTensor and torch._dynamo modules that building any torch
optimizer imports anyway).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from reference_impl.checkpoint.files import CheckpointError, need
from reference_impl.checkpoint.fit import check_model, check_optimizer
from reference_impl.parallel.registry import unwrap
from reference_impl.state import TrainState

DCP_DIR = "dcp"
DCP_METADATA = f"{DCP_DIR}/.metadata"  # DCP's own commit point (`dcp_safe.METADATA`)


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

        Returns True when the write continues in the background in `saver`; the manager
        then finishes the save there (`AsyncSaver.then`) once the write completes.
        """
        return False

    def check_files(self, path: Path, listed: set[str]) -> None:
        """Raise `CheckpointError` unless every file a load of `path` reads is in `listed`.

        The manifest's hashes cover the listed files; this makes sure nothing else is
        read. By default there is nothing else: the manager's required files are all.
        """
        return

    def check_loadable(self, state: TrainState, path: Path) -> None:
        """Raise `CheckpointError` if `path` cannot be loaded into `state` (every rank, before any change)."""
        return

    def check_entries(self, state: TrainState, saved: dict[str, Any]) -> None:
        """Raise `CheckpointError` unless this layout's entries in train.pt fit `state` (rank 0,
        before any change); none by default."""
        return

    @abstractmethod
    def load(self, state: TrainState, path: Path, saved: dict[str, Any]) -> None:
        """Load model and optimizer into `state` from step directory `path` (every rank)."""

    @abstractmethod
    def full_model(self, path: Path, saved: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The whole model's state dict, in one process."""
# --8<-- [end:interface]


class TorchSaveLayout(CheckpointLayout):
    """Whole tensors in train.pt, loaded with the weights-only unpickler."""

    train_keys = frozenset({"model", "optimizer"})

    def train_entries(self, state: TrainState) -> dict[str, Any]:
        return {"model": unwrap(state.model).state_dict(), "optimizer": state.optimizer.state_dict()}

    def check_entries(self, state: TrainState, saved: dict[str, Any]) -> None:
        # Same config, other code (a renamed parameter), or an edited file with its checksum.
        check_model(saved["model"], unwrap(state.model), "train.pt's model")
        check_optimizer(saved["optimizer"], state.optimizer, "train.pt's optimizer")

    def load(self, state: TrainState, path: Path, saved: dict[str, Any]) -> None:
        unwrap(state.model).load_state_dict(saved["model"])
        state.optimizer.load_state_dict(saved["optimizer"])

    def full_model(self, path: Path, saved: dict[str, Any]) -> dict[str, torch.Tensor]:
        return saved["model"]


# --8<-- [start:dcp_layout]
class DcpLayout(CheckpointLayout):
    """DTensor shards written by every rank through DCP; DCP reshards them on load.

    Reading goes through `dcp_safe`: metadata unpickled with an allow-list, shard paths
    confined to `dcp/`, non-tensor items loaded weights-only.
    """

    required = frozenset({DCP_METADATA})

    def write(self, state: TrainState, directory: Path, saver: AsyncSaver | None) -> bool:
        import torch.distributed.checkpoint as dcp

        sharded = {"model_optim": _sharded_state(state)}
        if saver:
            saver.start(sharded, directory / DCP_DIR)
            return True
        dcp.save(sharded, checkpoint_id=directory / DCP_DIR)
        return False

    def check_files(self, path: Path, listed: set[str]) -> None:
        from reference_impl.checkpoint.dcp_safe import check_plain_items, read_metadata, storage_files

        metadata = read_metadata(path / DCP_DIR)
        unlisted = sorted(f"{DCP_DIR}/{name}" for name in storage_files(metadata)
                          if f"{DCP_DIR}/{name}" not in listed)
        need(not unlisted, f"{DCP_METADATA} reads {', '.join(unlisted[:3])}, not listed in the manifest")
        check_plain_items(path / DCP_DIR, metadata)  # before any rank's load: a refusal is a fallback

    def check_loadable(self, state: TrainState, path: Path) -> None:
        from reference_impl.checkpoint.dcp_safe import WeightsOnlyLoadPlanner, read_metadata

        # A dry run of this rank's read plan: every key this rank needs is saved, with
        # the shape it has now. Nothing is read into the model yet.
        planner = WeightsOnlyLoadPlanner()
        planner.set_up_planner({"model_optim": _sharded_state(state)}, read_metadata(path / DCP_DIR), False)
        try:
            planner.create_local_plan()
        except (RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointError(f"{DCP_DIR}/ does not fit this model: {str(exc).splitlines()[0][:200]}") from None

    def load(self, state: TrainState, path: Path, saved: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from reference_impl.checkpoint.dcp_safe import ConfinedReader, WeightsOnlyLoadPlanner

        # The fresh state's own shards say which slices this rank reads: the saved mesh
        # (world size, tp degree) may differ from ours.
        sharded = {"model_optim": _sharded_state(state)}
        dcp.load(sharded, storage_reader=ConfinedReader(path / DCP_DIR), planner=WeightsOnlyLoadPlanner())
        set_state_dict(state.model, state.optimizer, model_state_dict=sharded["model_optim"]["model"],
                       optim_state_dict=sharded["model_optim"]["optim"], options=_dcp_options())

    def full_model(self, path: Path, saved: dict[str, Any]) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        from reference_impl.checkpoint.dcp_safe import ConfinedReader, WeightsOnlyFullPlanner

        # Rebuilt from the metadata, every shard gathered into full tensors, as torch's own
        # dcp_to_torch_save does it (the public `dcp.load` would fill a copy of `merged`).
        merged: dict[str, Any] = {}
        try:
            _load_state_dict(merged, storage_reader=ConfinedReader(path / DCP_DIR),
                             planner=WeightsOnlyFullPlanner(), no_dist=True)
        except CheckpointException as exc:  # a BaseException: a shard gone since it was verified
            raise CheckpointError(f"reading {DCP_DIR}/ of {path.name} failed: "
                                  f"{str(exc).splitlines()[0][:200]}") from None
        return merged["model_optim"]["model"]
# --8<-- [end:dcp_layout]


# --8<-- [start:layouts]
LAYOUTS: dict[str, CheckpointLayout] = {"torch_save": TorchSaveLayout(), "dcp": DcpLayout()}
# --8<-- [end:layouts]


def _dcp_options() -> Any:
    """DCP's `StateDictOptions`: optimizer state keyed per parameter name.

    Keys such as "param_groups.blocks.0.qkv.weight.lr", not one list of param groups:
    pipeline stages each hold some of the parameters, and per-stage lists saved under one
    key would overwrite each other.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _sharded_state(state: TrainState) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(state.model, state.optimizer, options=_dcp_options())
    return {"model": model_sd, "optim": optim_sd}


def _on_host(state: dict[str, Any]) -> bool:
    """Whether every tensor in `state` is in host memory."""
    from torch.utils._pytree import tree_leaves

    return all(leaf.device.type == "cpu" for leaf in tree_leaves(state) if isinstance(leaf, torch.Tensor))


# From torch 2.13 a stager passed to `async_save` stays open until its owner closes it.
_CALLER_CLOSES_STAGER = torch.torch_version.TorchVersion(torch.__version__) >= "2.13"


class AsyncSaver:
    """Runs DCP saves in the background on a dedicated gloo group.

    The training collectives keep the default group; sharing it with a background save
    interleaves two streams of collectives on one communicator, which crashes or hangs.
    The state is copied (staged) on a thread of its own, so `async_save` returns at once
    and the next step's forward and backward run during the copy; only the optimizer step,
    which changes the parameters, waits for it (`guard` registers the wait as the
    optimizer's step pre-hook). Staging copies into host buffers kept from the first save,
    so a save's stall is a memcpy, not fresh allocations and their page faults (the price:
    one host copy of the rank's state held for the run): `HostStager`
    (`reference_impl.checkpoint.staging`) for state in host memory, DCP's `DefaultStager`
    (pinned buffers, a side stream) for state on a GPU. Before torch 2.13, `async_save`
    closes the stager it is given when the save completes (seen with torch 2.11: the next
    save failed with `KeyError: <class 'type'>`), so there each GPU save gets a
    `DefaultStager` of its own. Under a process group the ranks agree that every copy
    succeeded before DCP's collectives start (`AgreedStager`), so a copy that fails on one
    rank fails the save on all of them at once. The rest of the save (`then`: the small
    files, the ranks' agreement, rank 0's publish) runs on the writing thread as soon as
    the write completes. `close` releases the stager and the optimizer's hook after a run.
    """

    def __init__(self, timeout_s: float = 120.0) -> None:
        self.group = (dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
                      if dist.is_initialized() else None)
        self._stager: Any = None
        self._future: Any = None
        self._staged: Any = None
        self._finished = threading.Event()
        self._finishing = False  # whether `then` gave the save in flight an end to run
        self._error: BaseException | None = None
        self._hook: Any = None

    def start(self, state: dict[str, Any], path: Path) -> None:
        """Begin copying `state` and writing it to `path` with DCP; returns at once."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        from reference_impl.checkpoint.staging import AgreedStager, HostStager

        # One stager for the run, except a DefaultStager that torch closes after each save.
        kept = isinstance(self._stager, HostStager) or (self._stager is not None and _CALLER_CLOSES_STAGER)
        if not kept:
            self._stager = HostStager() if _on_host(state) else DefaultStager(StagingOptions(
                use_pinned_memory=True, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=True))
        stager = self._stager if self.group is None else AgreedStager(self._stager, self.group)
        response = dcp.async_save(state, checkpoint_id=path, process_group=self.group, async_stager=stager)
        # With background staging DCP returns two futures: copied, and written.
        self._staged = getattr(response, "staging_completion", None)
        self._future = getattr(response, "upload_completion", response)
        self._finished.clear()
        self._finishing = False

    def wait_staged(self) -> None:
        """Block until DCP's copy of the state is complete: the parameters may change after.

        A failed copy does not raise here (in the optimizer's step): it fails the write as
        well, and `wait` reports it as the save's error.
        """
        staged, self._staged = self._staged, None
        if staged is not None:
            staged.exception()

    def guard(self, optimizer: torch.optim.Optimizer) -> None:
        """Make every `optimizer.step()` wait until the save in flight has copied the state."""
        self._hook = optimizer.register_step_pre_hook(lambda *_: self.wait_staged())

    def then(self, finish: Callable[[BaseException | None], None]) -> None:
        """Run `finish` once the write in flight completes, with the write's error or None.

        It runs on DCP's writing thread (or at once, here, if the write is already done), so
        its collectives must use this saver's `group`; `wait` re-raises what it raises.
        """
        self._finishing = True
        self._future.add_done_callback(lambda done: self._finish(done, finish))

    def _finish(self, done: Any, finish: Callable[[BaseException | None], None]) -> None:
        try:
            finish(done.exception())
        except BaseException as exc:  # surfaced on the training thread by wait()
            self._error = exc
        finally:
            self._finished.set()

    def wait(self) -> None:
        """Block until the save in flight (if any) is written and finished; re-raise its error."""
        self.wait_staged()
        future, self._future = self._future, None
        if future is None:
            return
        if self._finishing:
            self._finished.wait()
        else:  # started, but given no end to run: the write is all there is to wait for
            self._error = future.exception()
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointError(f"finishing an async checkpoint failed: {error}") from error

    def close(self) -> None:
        """Release what the saver holds for the run: the optimizer's hook (which keeps the saver
        alive), and, unless a save is still in flight, the stager's thread and buffers."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._future is not None:  # a failed run may leave a write going: it keeps its stager
            return
        from reference_impl.checkpoint.staging import HostStager

        stager, self._stager = self._stager, None
        if isinstance(stager, HostStager):
            stager.shutdown()
        elif stager is not None and _CALLER_CLOSES_STAGER:  # a DefaultStager torch left open
            stager.close()

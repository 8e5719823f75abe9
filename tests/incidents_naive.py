"""Naive versions of the steps where four public resume bugs lived, for tests/distributed/test_incidents.py.

Each function or class reproduces the shape of the code that broke, small enough to read
at once; the tests show that it exhibits the reported symptom and that the trainer's own
code path does not. Nothing in `reference_impl` uses them.

- pytorch/torchtitan#1136 (fixed by pytorch/torchtitan#1702): the model state dict was
  taken once, before training, and every save wrote that cached dict.
- pytorch/torchtitan#811: each data-parallel rank saved its own loader position under its
  own key, so the positions could not follow a change of world size.
- Lightning-AI/pytorch-lightning#7637: a step-interval checkpoint was written before the
  learning-rate scheduler stepped, so the saved schedule was one step behind.
- Lightning-AI/pytorch-lightning#21938: on resume, the DataLoader iterator was created
  (and, with workers, prefetched its first indices) before the sampler's epoch was set.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


# ---------------------------------------------------------------- pytorch/torchtitan#1136
class CachedStateDictWrapper:
    """The model's state dict, taken once at construction and returned for every save.

    The cache holds the parameters' tensors, so it follows training only while FSDP2 keeps
    each parameter's local shard in the same storage. torchtitan#1136: FSDP2's lazy
    initialisation (the first forward) re-padded unevenly sharded parameters into new
    storage, so their saved values stayed at initialisation.
    """

    def __init__(self, model: nn.Module) -> None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        self.cache: dict[str, Any] = get_model_state_dict(model)

    def state_dict(self) -> dict[str, Any]:
        """What a save writes: the dict taken at construction."""
        return self.cache


def uneven_model() -> nn.Module:
    """An MLP whose output layer has 11 rows: FSDP2 over 2 ranks shards it 6 + 5 (padded)."""
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 11))


def cached_state_dict_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Train an FSDP2 model whose state dict was cached before a restore, save, compare.

    In torchtitan#1136 the parameters left the cache when FSDP2's lazy initialisation
    re-padded the uneven shards into new storage (`reset_sharded_param`). This PyTorch
    skips that re-pad when the storage is unchanged (pytorch/pytorch#163130), so here the
    storage changes where it still does: a restore with `assign=True`, after which the
    same function re-pads the uneven shard. Rank 0 writes which saved values differ from
    the trained ones, and the loss of a model restored from the save beside the trained
    model's.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = uneven_model()
    fully_shard(model)
    wrapper = CachedStateDictWrapper(model)  # built with the trainer, before the restore
    current: dict[str, Any] = get_model_state_dict(model)
    restored = {k: v.detach().clone() for k, v in current.items()}
    model.load_state_dict(restored, assign=True)  # the resume: a checkpoint's tensors
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 8, generator=gen), torch.randint(0, 11, (16,), generator=gen)
    for _ in range(3):
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    saved = {k: v.full_tensor() for k, v in wrapper.state_dict().items()}
    now: dict[str, Any] = get_model_state_dict(model)  # a fresh dict: the parameters as they are
    trained = {k: v.full_tensor() for k, v in now.items()}
    with torch.no_grad():
        live_loss = nn.functional.cross_entropy(model(x), y).item()
    if rank == 0:
        reloaded = uneven_model()
        reloaded.load_state_dict(saved)
        with torch.no_grad():
            resumed_loss = nn.functional.cross_entropy(reloaded(x), y).item()
        stale = sorted(k for k in trained if not torch.equal(saved[k], trained[k]))
        Path(out_dir, "result.json").write_text(json.dumps(
            {"stale": stale, "live_loss": live_loss, "resumed_loss": resumed_loss}))
    # No teardown: an FSDP2 group freed at exit can hang (see reference_impl.distributed.exit_process).
    dist.barrier()
    os._exit(0)


# ---------------------------------------------------------------- pytorch/torchtitan#811
class PerRankLoaderState:
    """A data-parallel rank's loader position, saved under that rank's own key.

    Each rank draws `DistributedSampler`'s shard (every `world_size`-th index of the
    epoch's permutation) and records how many of its samples it has taken, as
    `{"dp_rank_<r>": samples}` (a stateful loader's `samples_yielded`). The position means
    something only at the world size that wrote it.
    """

    def __init__(self, num_samples: int, *, world_size: int, rank: int) -> None:
        self.rank, self.yielded = rank, 0
        data = TensorDataset(torch.arange(num_samples))
        self.sampler: DistributedSampler[Any] = DistributedSampler(data, num_replicas=world_size, rank=rank,
                                                                   shuffle=True, seed=0, drop_last=True)

    def take(self, count: int) -> list[int]:
        """This rank's next `count` indices; the position moves past them."""
        mine = list(self.sampler)[self.yielded:self.yielded + count]
        self.yielded += count
        return mine

    def state_dict(self) -> dict[str, int]:
        return {f"dp_rank_{self.rank}": self.yielded}

    def load_state_dict(self, saved: dict[str, int]) -> None:
        """Take this rank's own entry: a KeyError for a rank the saving run did not have."""
        self.yielded = saved[f"dp_rank_{self.rank}"]


# ---------------------------------------------------------------- Lightning-AI/pytorch-lightning#7637
def learning_rates(scheduler: LambdaLR, optimizer: torch.optim.Optimizer, steps: range,
                   save_at: int | None = None) -> tuple[list[float], dict[str, Any] | None]:
    """Run `steps` optimizer steps; return the rate each used and the checkpoint taken.

    The checkpoint is taken where a batch-end callback runs: after the optimizer step and
    before the scheduler steps, so it holds the schedule of the step just trained.
    """
    rates: list[float] = []
    checkpoint = None
    for step in steps:
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        if step == save_at:  # on_train_batch_end: the scheduler has not stepped yet
            checkpoint = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
        scheduler.step()
    return rates, checkpoint


# ---------------------------------------------------------------- Lightning-AI/pytorch-lightning#21938
def resumed_epoch_batches(loader: DataLoader[Any], sampler: DistributedSampler[Any],
                          epoch: int) -> Iterator[Any]:
    """The first resumed epoch's iterator, made before the restored epoch reaches the sampler.

    A DataLoader with workers draws the sampler's order when its iterator is created (it
    prefetches), so the epoch set afterwards comes too late for this epoch.
    """
    batches = iter(loader)  # setup_data() creates the iterator
    sampler.set_epoch(epoch)  # on_advance_start() sets the epoch
    return batches

"""Synthetic datasets generated from a seed, and the resumable distributed sampler.

Nothing is downloaded: every sample is a pure function of (seed, index), so a resumed
or resharded run sees exactly the data an uninterrupted one would.
"""

# --8<-- [start:imports]
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler

# --8<-- [end:imports]
from reference_impl.options.training import SEED_STRIDE

# --8<-- [start:sample]
Sample = tuple[torch.Tensor, torch.Tensor, int]
# --8<-- [end:sample]
# What a DataLoader yields: the samples' inputs, targets and indices, each stacked into a tensor.
Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


# --8<-- [start:synthetic_datasets]
class SyntheticClassification(Dataset[Sample]):
    """Gaussian inputs labelled by a fixed random linear teacher: learnable, not trivial."""

    def __init__(self, size: int, input_dim: int, num_classes: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, input_dim, generator=gen)
        teacher = torch.randn(input_dim, num_classes, generator=gen)
        self.y = (self.x @ teacher).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> Sample:
        # The index travels with the sample so the loop can log what it really trained on.
        return self.x[index], self.y[index], index


class SyntheticTokens(Dataset[Sample]):
    """Sequences t[k+1] = (t[k] + stride) mod vocab: next-token prediction needs context."""

    def __init__(self, size: int, seq_len: int, vocab_size: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab_size, (size, 1), generator=gen)
        stride = torch.randint(1, 8, (size, 1), generator=gen)
        self.tokens = (start + stride * torch.arange(seq_len + 1)) % vocab_size

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> Sample:
        seq = self.tokens[index]
        return seq[:-1], seq[1:], index
# --8<-- [end:synthetic_datasets]


# --8<-- [start:resumable_sampler]
class ResumableDistributedSampler(Sampler[int]):
    """Shards one seeded permutation per epoch across ranks and resumes mid-epoch.

    Contract:
        * Deterministic: the epoch's order is `randperm(num_samples)` seeded by
          (seed, epoch), identical on every rank and independent of the world size.
        * Disjoint and complete: optimizer step k consumes the contiguous block
          `perm[k*B:(k+1)*B]` (B = global batch); rank r takes every world_size-th index
          of it. Every index of the epoch is trained exactly once, except the tail
          `num_samples % B` of the permutation, which is dropped (no padding, so no
          sample is ever trained twice in an epoch). A new shuffle drops a new tail.
        * Progress counts trained samples: `consumed` moves only when the training loop
          calls `commit` after an optimizer step, never while the DataLoader prefetches.
          Because progress is global, a checkpoint resumes at another world size with
          the same global batch and still trains every remaining sample exactly once.
    """

    def __init__(self, num_samples: int, *, world_size: int, rank: int,
                 global_batch_size: int, seed: int = 0) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        if global_batch_size % world_size:
            raise ValueError("global_batch_size must be a multiple of world_size")
        self.num_samples, self.world_size, self.rank = num_samples, world_size, rank
        self.global_batch_size, self.seed = global_batch_size, seed
        self.steps_per_epoch = num_samples // global_batch_size
        if self.steps_per_epoch == 0:
            raise ValueError("the dataset is smaller than one global batch")
        self.epoch, self.consumed = 0, 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's shuffle; progress resets only when the epoch changes."""
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0

    def commit(self, num_samples: int) -> None:
        """Record that `num_samples` (global) more samples were trained in this epoch."""
        self.consumed = min(self.consumed + num_samples, self.steps_per_epoch * self.global_batch_size)

    def epoch_permutation(self) -> torch.Tensor:
        """The epoch's global order, before the tail is dropped."""
        gen = torch.Generator().manual_seed(self.seed * SEED_STRIDE + self.epoch)
        return torch.randperm(self.num_samples, generator=gen)

    def __iter__(self) -> Iterator[int]:
        usable = self.steps_per_epoch * self.global_batch_size
        mine = self.epoch_permutation()[self.consumed + self.rank:usable:self.world_size]
        return iter(mine.tolist())

    def __len__(self) -> int:
        return (self.steps_per_epoch * self.global_batch_size - self.consumed) // self.world_size

    def state_dict(self) -> dict[str, int]:
        """A copy of the progress (never a live reference a loader could snapshot late)."""
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed,
                "num_samples": self.num_samples, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume progress; the world size may differ, the data and global batch may not."""
        self.check_state(state)
        self.epoch, self.consumed = state["epoch"], state["consumed"]

    def check_state(self, state: Any, step: int | None = None) -> None:
        """Raise ValueError unless `state` is progress this sampler could have saved, after
        `step` optimizer steps when given (a checkpoint is untrusted input).

        An epoch starts at a step boundary and lasts at most `steps_per_epoch` steps, so
        after step k the epoch e is k // steps_per_epoch, or one less when it just ended,
        and the progress is exactly k - e * steps_per_epoch global batches: more would skip
        samples (or, at the epoch's end, leave the loop no batch to draw), less repeat them.
        """
        keys = ("epoch", "consumed", "seed", "num_samples", "global_batch_size")
        if not isinstance(state, dict) or any(type(state.get(key)) is not int for key in keys):
            raise ValueError(f"sampler state is not the integers {', '.join(keys)}")
        for key in keys[2:]:
            if state[key] != getattr(self, key):
                raise ValueError(f"sampler {key} changed: checkpoint {state[key]}, now {getattr(self, key)}")
        usable = self.steps_per_epoch * self.global_batch_size
        if not 0 <= state["consumed"] <= usable or state["consumed"] % self.global_batch_size:
            raise ValueError(f"saved progress {state['consumed']} is not an optimizer-step boundary in [0, {usable}]")
        if step is None:
            return
        epoch = step // self.steps_per_epoch
        if not max(epoch - 1, 0) <= state["epoch"] <= epoch:
            raise ValueError(f"saved epoch {state['epoch']} cannot follow step {step} "
                             f"({self.steps_per_epoch} steps per epoch)")
        if state["consumed"] != (step - state["epoch"] * self.steps_per_epoch) * self.global_batch_size:
            raise ValueError(f"saved progress {state['consumed']} cannot follow step {step} in epoch "
                             f"{state['epoch']} ({self.steps_per_epoch} steps of {self.global_batch_size} per epoch)")
# --8<-- [end:resumable_sampler]

"""Variable-length sequence batches: padding with a mask, and token-budget batching.

Protein and SMILES sequences vary in length by orders of magnitude. Batching by a
fixed number of sequences wastes compute on padding and makes memory depend on the
longest sequence drawn; batching by a token budget bounds ``max_len * batch_size``.
"""

# --8<-- [start:imports]
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Literal, NamedTuple

import numpy as np
import torch

# --8<-- [end:imports]


# --8<-- [start:padded_batch]
class PaddedBatch(NamedTuple):
    """A padded batch.

    Attributes:
        tokens: ``[B, L]`` token ids, ``pad_id`` after each sequence's end.
        mask: ``[B, L]`` bool, **True at real tokens**, False at padding. This is the
            polarity of ``F.scaled_dot_product_attention(attn_mask=...)`` and of the
            Hugging Face ``attention_mask``; ``nn.MultiheadAttention``'s
            ``key_padding_mask`` uses the opposite (True = ignore), so pass ``~mask``.
        lengths: ``[B]`` real lengths.
    """

    tokens: torch.Tensor
    mask: torch.Tensor
    lengths: torch.Tensor
# --8<-- [end:padded_batch]


# --8<-- [start:pad_batch]
def pad_batch(sequences: Sequence[torch.Tensor], pad_id: int = 1) -> PaddedBatch:
    """Right-pad 1-D token tensors to the longest one and build the mask.

    Args:
        sequences: Token id tensors of shape ``[L_i]``.
        pad_id: Padding id (1 is ESM's ``<pad>``).

    Returns:
        Tokens, mask (True = real token) and lengths.
    """
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.long)
    tokens = torch.nn.utils.rnn.pad_sequence(list(sequences), batch_first=True, padding_value=pad_id)
    mask = torch.arange(tokens.shape[1]) < lengths[:, None]
    return PaddedBatch(tokens, mask, lengths)
# --8<-- [end:pad_batch]


# --8<-- [start:token_budget_sampler]
def token_budget_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Pack indices, shortest first, into batches with ``max_len * size <= max_tokens``.

    A sequence longer than the budget still gets a batch of its own (callers crop
    before batching if that must not happen).

    Args:
        lengths: Length of each sequence.
        max_tokens: Token budget per batch, counting padding.

    Returns:
        Batches of dataset indices.
    """
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in np.argsort(np.asarray(lengths), kind="stable").tolist():
        grown = max(longest, lengths[i])
        if current and grown * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, grown = [], lengths[i]
        current.append(i)
        longest = grown
    if current:
        batches.append(current)
    return batches


class TokenBudgetBatchSampler:
    """Distributed batch sampler over token-budget batches.

    The batches are built once, from all lengths, identically on every rank. Each
    epoch they are shuffled with a generator seeded by ``(seed, epoch)``, the same
    order on every rank, and rank ``r`` takes batches ``r, r + W, r + 2W, ...``.
    Every rank must run the same number of steps or DDP's all-reduce hangs, so the
    batch list is first made a multiple of ``W``:

    - ``"repeat"`` (default) appends the first batches of the epoch's order again,
      so every sample is seen at least once and a few twice;
    - ``"drop"`` removes the last batches, so every sample is seen at most once.

    Args:
        lengths: Length of each sequence in the dataset.
        max_tokens: Token budget per batch.
        rank: This process's rank.
        world_size: Number of ranks.
        seed: Shuffle seed, shared by all ranks.
        policy: ``"repeat"`` or ``"drop"``, see above.

    Raises:
        ValueError: On an unknown policy or a rank outside ``[0, world_size)``.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        max_tokens: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        policy: Literal["repeat", "drop"] = "repeat",
    ) -> None:
        if policy not in ("repeat", "drop"):
            raise ValueError(f"policy must be 'repeat' or 'drop', got {policy!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.batches = token_budget_batches(lengths, max_tokens)
        self.rank, self.world_size, self.seed, self.policy = rank, world_size, seed, policy
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose shuffle `__iter__` yields; call it every epoch.

        Args:
            epoch: Epoch number.
        """
        self.epoch = epoch

    def _global_order(self) -> list[int]:
        rng = np.random.default_rng([self.seed, self.epoch])
        order = rng.permutation(len(self.batches)).tolist()
        extra = len(order) % self.world_size
        if extra and self.policy == "drop":
            order = order[: len(order) - extra]
        elif extra:
            order += order[: self.world_size - extra]
        return order

    def __iter__(self) -> Iterator[list[int]]:
        for b in self._global_order()[self.rank :: self.world_size]:
            yield list(self.batches[b])

    def __len__(self) -> int:
        return len(self._global_order()) // self.world_size
# --8<-- [end:token_budget_sampler]

"""Geometric preprocessing and normalisation that respect rotations and translations.

A model of 3-D structure should not care where a molecule sits or how it is
oriented. Two data-pipeline rules follow: centre each molecule on its own
centroid, never on the batch's, and normalise vector features only by rotation
invariant quantities (their norms); a per-axis BatchNorm is not equivariant.
"""

# --8<-- [start:imports]
from __future__ import annotations

import torch
from torch import nn

# --8<-- [end:imports]


# --8<-- [start:center_per_molecule]
def center_per_molecule(pos: torch.Tensor, batch: torch.Tensor, num_graphs: int) -> torch.Tensor:
    """Subtract each molecule's own centroid from its atoms' coordinates.

    Centering on the batch centroid instead would make one molecule's input
    depend on which other molecules share its batch. When a molecule's atoms are
    sharded across ranks, all-reduce the per-molecule sums and counts first.

    Args:
        pos: ``[N, 3]`` coordinates of all atoms in the batch.
        batch: ``[N]`` molecule id of every atom.
        num_graphs: Number of molecules.

    Returns:
        ``[N, 3]`` coordinates whose per-molecule mean is zero.
    """
    sums = pos.new_zeros(num_graphs, pos.shape[1]).index_add_(0, batch, pos)
    counts = torch.bincount(batch, minlength=num_graphs).clamp(min=1).to(pos.dtype)
    return pos - (sums / counts[:, None])[batch]
# --8<-- [end:center_per_molecule]


# --8<-- [start:vector_norm]
class VectorNorm(nn.Module):
    """Equivariant normalisation of vector features ``[N, C, 3]``.

    Each node's vectors are divided by the root mean square of their norms over
    channels, then each channel is scaled by a learned weight. Norms are
    rotation invariant, so ``f(x R^T) = f(x) R^T`` for any rotation ``R``. There is
    no mean subtraction and no bias: either would pick a direction in space.

    Args:
        channels: Number of vector channels ``C``.
        eps: Added to the mean squared norm for stability.
    """

    def __init__(self, channels: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.eps = eps

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        """Normalise ``v`` of shape ``[N, C, 3]``.

        Args:
            v: Vector features.

        Returns:
            Normalised features, same shape.
        """
        mean_sq = v.pow(2).sum(dim=-1).mean(dim=-1, keepdim=True)  # [N, 1]
        return v * torch.rsqrt(mean_sq + self.eps)[..., None] * self.weight[:, None]
# --8<-- [end:vector_norm]

"""Multitask binary cross-entropy for sparse assay labels.

In bioassay tables most (compound, assay) cells were never measured. A missing
label is encoded as NaN and is excluded from the loss; it is never a negative.
"""

# --8<-- [start:imports]
from __future__ import annotations

import torch
import torch.nn.functional as F

# --8<-- [end:imports]


# --8<-- [start:masked_bce]
def masked_multitask_bce(
    logits: torch.Tensor, targets: torch.Tensor, pos_weight: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean binary cross-entropy over the observed (non-NaN) targets only.

    Both the targets and the logits are replaced by zeros at missing positions
    *before* the loss, with `torch.where`. Multiplying by a mask afterwards is not
    enough: ``NaN * 0`` is NaN, in the loss and in its gradient. Missing positions
    therefore contribute exactly zero to the loss and get exactly zero gradient,
    whatever the logits hold there.

    Args:
        logits: Raw scores, shape ``[B, T]`` (any shape matching ``targets``).
        targets: Labels in {0, 1}, NaN where the label is missing.
        pos_weight: Optional weight of the positive term per task, shape ``[T]``;
            see `pos_weight_from_labels`.

    Returns:
        A scalar: the sum of per-entry losses divided by the number of observed
        entries (zero when nothing is observed).
    """
    observed = ~torch.isnan(targets)
    zeros = torch.zeros_like(logits)
    safe_logits = torch.where(observed, logits, zeros)
    safe_targets = torch.where(observed, targets, torch.zeros_like(targets))
    per_entry = F.binary_cross_entropy_with_logits(
        safe_logits, safe_targets, pos_weight=pos_weight, reduction="none"
    )
    per_entry = torch.where(observed, per_entry, zeros)
    return per_entry.sum() / observed.sum().clamp(min=1)
# --8<-- [end:masked_bce]


# --8<-- [start:pos_weight]
def pos_weight_from_labels(train_targets: torch.Tensor) -> torch.Tensor:
    """Per-task ``n_negative / n_positive`` from observed training labels.

    Compute it on the training split only; using all rows leaks the test label
    balance into training. A task with no observed positive or no observed
    negative gets weight 1 (there is nothing to rebalance).

    Args:
        train_targets: Training labels, shape ``[N, T]``, NaN where missing.

    Returns:
        A float tensor of shape ``[T]``, for `masked_multitask_bce`.
    """
    observed = ~torch.isnan(train_targets)
    pos = ((train_targets == 1) & observed).sum(dim=0).to(torch.float32)
    neg = ((train_targets == 0) & observed).sum(dim=0).to(torch.float32)
    both = (pos > 0) & (neg > 0)
    return torch.where(both, neg / pos.clamp(min=1), torch.ones_like(pos))
# --8<-- [end:pos_weight]

import math

import pytest
import torch
import torch.nn.functional as F

from reference_impl.bio.losses import masked_multitask_bce, pos_weight_from_labels

pytestmark = pytest.mark.bio


def sparse_labels(seed: int = 0, n: int = 32, t: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, t, generator=g, dtype=torch.float64)
    targets = (torch.rand(n, t, generator=g) < 0.3).double()
    targets[torch.rand(n, t, generator=g) < 0.4] = float("nan")
    return logits, targets


def loss_and_grad(logits, targets, pos_weight=None):
    x = logits.clone().requires_grad_(True)
    loss = masked_multitask_bce(x, targets, pos_weight)
    loss.backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("fill", [0.0, 1.0, 1e9, -math.inf, math.nan])
def test_masked_logits_change_neither_loss_nor_gradients(fill):
    logits, targets = sparse_labels()
    pos_weight = torch.tensor([1.0, 2.0, 0.5, 3.0, 1.0], dtype=torch.float64)
    missing = torch.isnan(targets)
    base_loss, base_grad = loss_and_grad(logits, targets, pos_weight)
    filled = logits.masked_fill(missing, fill)
    loss, grad = loss_and_grad(filled, targets, pos_weight)
    assert torch.equal(loss, base_loss)
    assert torch.equal(grad, base_grad)
    assert torch.all(grad[missing] == 0)  # exactly zero, never NaN
    assert torch.all(grad[~missing] != 0)


def test_multiplying_by_a_mask_after_the_loss_is_not_enough():
    """Masking after the loss multiplies NaN by 0, which is NaN: loss and gradients are
    poisoned. The package's loss, on the same logits and NaN-marked targets, is finite
    and equals the mean over the observed entries."""
    logits, targets = sparse_labels()
    x = logits.clone().requires_grad_(True)
    naive = F.binary_cross_entropy_with_logits(x, targets, reduction="none")
    naive = (naive * (~torch.isnan(targets))).sum()
    naive.backward()
    assert torch.isnan(naive) and torch.isnan(x.grad).any()

    loss, grad = loss_and_grad(logits, targets)
    observed = ~torch.isnan(targets)
    expected = F.binary_cross_entropy_with_logits(logits[observed], targets[observed])
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert loss == pytest.approx(expected.item(), rel=1e-12)


def test_equals_mean_over_observed_entries():
    logits, targets = sparse_labels(1)
    pos_weight = torch.tensor([1.0, 4.0, 0.25, 2.0, 1.0], dtype=torch.float64)
    seen = ~torch.isnan(targets)
    per_entry = F.binary_cross_entropy_with_logits(
        logits, targets.nan_to_num(0.0), pos_weight=pos_weight, reduction="none"
    )
    expected = per_entry[seen].mean()
    assert torch.allclose(masked_multitask_bce(logits, targets, pos_weight), expected, rtol=1e-12)


def test_fully_observed_equals_plain_bce():
    logits, targets = sparse_labels(2)
    targets = targets.nan_to_num(1.0)
    pos_weight = torch.full((5,), 3.0, dtype=torch.float64)
    plain = F.binary_cross_entropy_with_logits(logits, targets, pos_weight=pos_weight)
    assert torch.allclose(masked_multitask_bce(logits, targets, pos_weight), plain, rtol=1e-12)


def test_missing_is_not_negative():
    logits, targets = sparse_labels(3)
    as_negative = targets.nan_to_num(0.0)  # the silent bug: fillna(0)
    assert not torch.allclose(masked_multitask_bce(logits, targets), masked_multitask_bce(logits, as_negative))


def test_nothing_observed_gives_zero_loss_and_zero_grad():
    logits = torch.randn(4, 3, dtype=torch.float64)
    targets = torch.full((4, 3), float("nan"), dtype=torch.float64)
    loss, grad = loss_and_grad(logits, targets)
    assert loss.item() == 0.0 and torch.all(grad == 0)


def test_task_without_labels_does_not_change_the_loss():
    logits, targets = sparse_labels(4)
    targets[:, 2] = float("nan")
    loss = masked_multitask_bce(logits, targets)
    keep = [0, 1, 3, 4]
    assert torch.allclose(loss, masked_multitask_bce(logits[:, keep], targets[:, keep]), rtol=1e-12)


def test_pos_weight_ignores_missing_labels():
    nan = float("nan")
    y = torch.tensor(
        [[1, 0, nan, 1], [0, 0, nan, 1], [nan, 0, nan, 1], [0, nan, nan, 1], [nan, 1, nan, nan]]
    )
    pw = pos_weight_from_labels(y)
    # task 0: 1 positive, 2 negatives; task 1: 1 positive, 3 negatives;
    # task 2: no labels; task 3: positives only -> nothing to rebalance.
    assert torch.equal(pw, torch.tensor([2.0, 3.0, 1.0, 1.0]))
    wrong = pos_weight_from_labels(y.nan_to_num(0.0))  # missing counted as negative
    assert wrong[0] == 4.0 and not torch.equal(wrong, pw)


def test_loss_works_under_cpu_autocast():
    logits, targets = sparse_labels(5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = masked_multitask_bce(logits.float(), targets.float())
    assert torch.isfinite(loss)

"""Ranking metrics for virtual screening and multitask assays.

`per_task_auroc` averages a rank-based AUROC over tasks that have both classes;
`bedroc` and `enrichment_factor` measure early recognition, which is what a
screening campaign pays for: only the top of the ranked list is ever tested.
"""

# --8<-- [start:imports]
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from scipy.stats import rankdata

# --8<-- [end:imports]


# --8<-- [start:auroc_result]
class AurocResult(NamedTuple):
    """Per-task AUROC.

    Attributes:
        per_task: AUROC per task, NaN for a skipped task.
        mean: Unweighted mean over the scored tasks (macro average).
        n_skipped: Tasks skipped because their observed labels have one class.
    """

    per_task: np.ndarray
    mean: float
    n_skipped: int
# --8<-- [end:auroc_result]


# --8<-- [start:auroc]
def binary_auroc(y_true: np.ndarray, y_score: np.ndarray) -> float:
    """AUROC as the Mann-Whitney statistic; tied scores get half credit.

    Args:
        y_true: Labels in {0, 1}, both classes present.
        y_score: Scores, higher means more likely positive.

    Returns:
        The probability that a random positive outranks a random negative.
    """
    pos = np.asarray(y_true) == 1
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    ranks = rankdata(y_score)  # average ranks: ties count one half
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def per_task_auroc(y_true: np.ndarray, y_score: np.ndarray) -> AurocResult:
    """AUROC per task on the observed entries, skipping single-class tasks.

    Args:
        y_true: Labels, shape ``[N, T]``, NaN where missing.
        y_score: Scores, shape ``[N, T]``.

    Returns:
        Per-task values, their mean, and the number of skipped tasks.

    Raises:
        ValueError: If no task has both classes among its observed labels.
    """
    y_true, y_score = np.asarray(y_true, dtype=float), np.asarray(y_score, dtype=float)
    values = np.full(y_true.shape[1], np.nan)
    for t in range(y_true.shape[1]):
        seen = ~np.isnan(y_true[:, t])
        labels = y_true[seen, t]
        if len(np.unique(labels)) == 2:
            values[t] = binary_auroc(labels, y_score[seen, t])
    scored = ~np.isnan(values)
    if not scored.any():
        raise ValueError("no task has both classes among its observed labels")
    return AurocResult(values, float(values[scored].mean()), int((~scored).sum()))
# --8<-- [end:auroc]


# --8<-- [start:rank_actives]
def _rank_actives(y_true: np.ndarray, y_score: np.ndarray) -> np.ndarray:
    """Labels reordered best score first; ties keep input order (as RDKit does)."""
    order = np.argsort(-np.asarray(y_score, dtype=float), kind="stable")
    return np.asarray(y_true)[order].astype(bool)
# --8<-- [end:rank_actives]


# --8<-- [start:bedroc]
def bedroc(y_true: np.ndarray, y_score: np.ndarray, alpha: float = 20.0) -> float:
    """Boltzmann-enhanced discrimination of ROC (Truchon and Bayly, 2007).

    ``RIE = sum_i exp(-alpha r_i / N) / (n/N * (1 - e^-alpha) / (e^(alpha/N) - 1))``
    over the 1-based ranks ``r_i`` of the ``n`` actives among ``N``, rescaled to
    [0, 1] by its extreme values: 1 when all actives are ranked first, 0 when they
    are ranked last. Random ranking is *not* 0.5 (about 0.08 at alpha=20 and 5%
    actives). 80% of the score comes from the top ``ln(5)/alpha`` of the list
    (8% at alpha=20). Same conventions as RDKit's ``CalcBEDROC``.

    Args:
        y_true: Labels in {0, 1}, shape ``[N]``.
        y_score: Scores, higher is better; ties keep input order.
        alpha: Early-recognition weight, > 0.

    Returns:
        BEDROC in [0, 1]; 0 if there are no actives, 1 if every row is active.

    Raises:
        ValueError: If ``alpha <= 0`` or the input is empty.
    """
    if alpha <= 0:
        raise ValueError("alpha must be positive")
    active = _rank_actives(y_true, y_score)
    n_mol, n_act = len(active), int(active.sum())
    if n_mol == 0:
        raise ValueError("empty input")
    if n_act == 0:
        return 0.0
    ranks = np.flatnonzero(active) + 1.0
    ra = n_act / n_mol
    random_sum = ra * (1 - math.exp(-alpha)) / (math.exp(alpha / n_mol) - 1)
    rie = float(np.exp(-alpha * ranks / n_mol).sum()) / random_sum
    rie_max = (1 - math.exp(-alpha * ra)) / (ra * (1 - math.exp(-alpha)))
    rie_min = (1 - math.exp(alpha * ra)) / (ra * (1 - math.exp(alpha)))
    if rie_max == rie_min:  # every row is active
        return 1.0
    return (rie - rie_min) / (rie_max - rie_min)
# --8<-- [end:bedroc]


# --8<-- [start:enrichment]
def enrichment_factor(
    y_true: np.ndarray, y_score: np.ndarray, fraction: float = 0.01, *, tie_aware: bool = False
) -> float:
    """Enrichment factor ``EF_x = (a_x / n_x) / (A / N)`` at the top fraction ``x``.

    ``n_x = ceil(N x)`` rows are selected (``N x`` is rounded to 9 decimals first,
    so ``100 * 0.07 = 7.000000000000001`` selects 7 rows, not 8); ``a_x`` of them are
    active, out of ``A`` actives in all. The value can never exceed
    ``min(N / n_x, N / A) <= min(1 / x, N / A)``: with 50 actives in 1000 rows,
    a perfect EF@1% is 20, not 100.

    Args:
        y_true: Labels in {0, 1}, shape ``[N]``.
        y_score: Scores, higher is better.
        fraction: The top fraction ``x`` in (0, 1].
        tie_aware: If True, a group of tied scores that straddles the cutoff
            contributes its mean activity per selected slot instead of depending
            on input order (RDKit and the default keep input order).

    Returns:
        The enrichment factor; 0 if there are no actives.

    Raises:
        ValueError: If ``fraction`` is outside (0, 1].
    """
    if not 0 < fraction <= 1:
        raise ValueError("fraction must be in (0, 1]")
    y = np.asarray(y_true).astype(bool)
    s = np.asarray(y_score, dtype=float)
    n_mol, n_act = len(y), int(y.sum())
    if n_act == 0:
        return 0.0
    n_sel = math.ceil(round(n_mol * fraction, 9))
    if tie_aware:
        cutoff = np.sort(s)[::-1][n_sel - 1]
        above = s > cutoff
        tied = s == cutoff
        hits = y[above].sum() + (n_sel - above.sum()) * y[tied].mean()
    else:
        hits = _rank_actives(y, s)[:n_sel].sum()
    return float(hits / n_sel) / (n_act / n_mol)
# --8<-- [end:enrichment]

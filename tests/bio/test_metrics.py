import math

import numpy as np
import pytest
from rdkit.ML.Scoring.Scoring import CalcBEDROC, CalcEnrichment
from sklearn.metrics import roc_auc_score

from reference_impl.bio.metrics import bedroc, binary_auroc, enrichment_factor, per_task_auroc

pytestmark = pytest.mark.bio


def rdkit_rows(y, s):
    """RDKit wants rows pre-sorted best first; sort stably like our metrics do."""
    order = np.argsort(-s, kind="stable")
    return [[float(s[i]), int(y[i])] for i in order]


def closed_form_bedroc(y, s, alpha):
    """Truchon and Bayly's eq. 36 form (sinh/cosh), independent of the min/max form."""
    order = np.argsort(-s, kind="stable")
    n, ranks = len(y), np.flatnonzero(y[order]) + 1.0
    ra = len(ranks) / n
    rie = np.exp(-alpha * ranks / n).sum() / (ra * (1 - math.exp(-alpha)) / (math.exp(alpha / n) - 1))
    return (
        rie * ra * math.sinh(alpha / 2) / (math.cosh(alpha / 2) - math.cosh(alpha / 2 - alpha * ra))
        + 1 / (1 - math.exp(alpha * (1 - ra)))
    )


@pytest.mark.parametrize("alpha", [20.0, 80.5, 160.9])
@pytest.mark.parametrize("n,rate", [(200, 0.05), (1000, 0.02), (3000, 0.1)])
def test_bedroc_matches_rdkit(alpha, n, rate):
    rng = np.random.default_rng(n + int(alpha))
    for _ in range(5):
        y = (rng.random(n) < rate).astype(int)
        y[rng.integers(n)] = 1
        s = rng.random(n)
        ours = bedroc(y, s, alpha)
        assert abs(ours - CalcBEDROC(rdkit_rows(y, s), 1, alpha)) < 1e-12
        assert abs(ours - closed_form_bedroc(y, s, alpha)) < 1e-9
        assert 0.0 <= ours <= 1.0


def test_bedroc_perfect_is_one_and_worst_is_zero():
    y = np.zeros(1000, dtype=int)
    y[:50] = 1
    s = -np.arange(1000.0)  # actives ranked first
    assert bedroc(y, s) == pytest.approx(1.0, abs=1e-12)
    assert bedroc(y, -s) == pytest.approx(0.0, abs=1e-12)


def test_bedroc_random_ranking_is_far_below_half():
    rng = np.random.default_rng(0)
    y = np.zeros(1000, dtype=int)
    y[:50] = 1
    mean = np.mean([bedroc(y, rng.random(1000)) for _ in range(300)])
    assert 0.06 < mean < 0.10  # about 0.08 at alpha=20 and 5% actives, not 0.5


def test_bedroc_invariant_to_monotone_score_transform():
    rng = np.random.default_rng(1)
    y, s = (rng.random(500) < 0.1).astype(int), rng.random(500)
    assert bedroc(y, s) == bedroc(y, np.exp(3 * s) - 7)


def test_bedroc_edge_cases():
    assert bedroc(np.zeros(10), np.arange(10.0)) == 0.0
    assert bedroc(np.ones(10), np.arange(10.0)) == 1.0
    with pytest.raises(ValueError):
        bedroc(np.ones(3), np.arange(3.0), alpha=0.0)


@pytest.mark.parametrize("fraction", [0.01, 0.02, 0.05, 0.1])
def test_enrichment_matches_rdkit(fraction):
    rng = np.random.default_rng(7)
    for n in (1000, 2000):
        y, s = (rng.random(n) < 0.05).astype(int), rng.random(n) + 0.3 * (rng.random(n) < 0.05)
        rd = CalcEnrichment(rdkit_rows(y, s), 1, [fraction])[0]
        assert enrichment_factor(y, s, fraction) == pytest.approx(rd, rel=1e-12)


def test_enrichment_never_exceeds_cap():
    rng = np.random.default_rng(3)
    for _ in range(200):
        n = int(rng.integers(50, 2000))
        y = (rng.random(n) < rng.uniform(0.005, 0.5)).astype(int)
        y[0] = 1
        a = y.sum()
        for fraction in (0.01, 0.05, 0.2):
            cap = min(1 / fraction, n / a)
            perfect = enrichment_factor(y, y + 0.01 * rng.random(n), fraction)
            assert enrichment_factor(y, rng.random(n), fraction) <= cap + 1e-12
            assert perfect <= cap + 1e-12
            n_sel = math.ceil(round(n * fraction, 9))
            assert perfect == pytest.approx(min(n / n_sel, n / a))


def test_perfect_ef_at_one_percent_with_five_percent_actives_is_twenty():
    y = np.zeros(1000, dtype=int)
    y[:50] = 1
    assert enrichment_factor(y, -np.arange(1000.0), 0.01) == pytest.approx(20.0)


def test_enrichment_cutoff_ignores_float_noise():
    y = np.zeros(100, dtype=int)
    y[:7] = 1
    s = -np.arange(100.0)
    # 100 * 0.07 == 7.000000000000001; a raw ceil would select 8 rows (RDKit: 12.5).
    assert enrichment_factor(y, s, 0.07) == pytest.approx(100 / 7)
    assert CalcEnrichment(rdkit_rows(y, s), 1, [0.07])[0] == pytest.approx(12.5)


def test_tie_aware_enrichment_does_not_depend_on_input_order():
    s = np.array([5.0, 4.0, 4.0, 4.0, 4.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    y_a = np.array([1, 0, 0, 1, 1, 0, 0, 0, 0, 0])  # tied inactives first
    y_b = np.array([1, 1, 1, 0, 0, 0, 0, 0, 0, 0])  # tied actives first
    # top 30% = 3 slots: one clear active, then 2 slots from a tie of 4 with 2 actives
    expected = (1 + 2 * 0.5) / 3 / (3 / 10)
    assert enrichment_factor(y_a, s, 0.3, tie_aware=True) == pytest.approx(expected)
    assert enrichment_factor(y_b, s, 0.3, tie_aware=True) == pytest.approx(expected)
    assert enrichment_factor(y_a, s, 0.3) != enrichment_factor(y_b, s, 0.3)


def test_binary_auroc_matches_sklearn_with_ties():
    rng = np.random.default_rng(0)
    y = (rng.random(300) < 0.3).astype(int)
    s = np.round(rng.random(300) + 0.3 * y, 1)  # many ties
    assert binary_auroc(y, s) == pytest.approx(roc_auc_score(y, s), abs=1e-12)


def test_per_task_auroc_skips_single_class_and_matches_sklearn():
    rng = np.random.default_rng(1)
    n, t = 400, 5
    y = (rng.random((n, t)) < 0.3).astype(float)
    y[rng.random((n, t)) < 0.5] = np.nan
    y[:, 3] = np.where(np.isnan(y[:, 3]), np.nan, 1.0)  # only positives observed
    s = rng.random((n, t)) + 0.5 * np.nan_to_num(y)
    result = per_task_auroc(y, s)
    assert result.n_skipped == 1 and np.isnan(result.per_task[3])
    for k in (0, 1, 2, 4):
        seen = ~np.isnan(y[:, k])
        assert result.per_task[k] == pytest.approx(roc_auc_score(y[seen, k], s[seen, k]), abs=1e-12)
    assert result.mean == pytest.approx(np.nanmean(result.per_task))


def test_per_task_auroc_raises_when_no_task_has_two_classes():
    y = np.array([[1.0, np.nan], [1.0, 0.0], [np.nan, 0.0]])
    with pytest.raises(ValueError, match="both classes"):
        per_task_auroc(y, np.zeros_like(y))

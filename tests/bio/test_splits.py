import logging
from pathlib import Path

import numpy as np
import pytest
from rdkit import Chem, RDConfig, rdBase
from rdkit.Chem.Scaffolds import MurckoScaffold

from reference_impl.bio.splits import (
    assign_groups,
    scaffold_groups,
    scaffold_key,
    scaffold_split,
    time_split,
)

pytestmark = pytest.mark.bio

NCI = Path(RDConfig.RDDataDir) / "NCI" / "first_5K.smi"


@pytest.fixture(scope="module")
def nci_smiles() -> list[str]:
    return [line.split()[0] for line in NCI.read_text().splitlines()]


@pytest.fixture(scope="module")
def nci_grouped(nci_smiles):
    return scaffold_groups(nci_smiles, invalid="drop")


@pytest.fixture(scope="module")
def rdkit_scaffold(nci_smiles):
    """Row -> scaffold computed by RDKit's own helper, independently of our code."""
    out = {}
    with rdBase.BlockLogs():
        for i, smi in enumerate(nci_smiles):
            if Chem.MolFromSmiles(smi) is not None:
                out[i] = MurckoScaffold.MurckoScaffoldSmiles(smi)
    return out


@pytest.fixture(scope="module")
def nci_splits(nci_smiles, nci_grouped):
    return {
        "largest_first": scaffold_split(nci_smiles, invalid="drop"),
        "balanced": assign_groups(nci_grouped.groups, balanced=True, seed=3),
    }


def test_scaffold_key_examples():
    assert scaffold_key("Cc1cc(Oc2nccc(CCC)c2)ccc1") == "c1ccc(Oc2ccccn2)cc1"
    assert scaffold_key("Cc1cc(Oc2nccc(CCC)c2)ccc1", generic=True) == "C1CCC(CC2CCCCC2)CC1"
    assert scaffold_key("CCO") == ""
    assert scaffold_key("CC(=O)N1CCCCC1") == "C1CCNCC1"
    assert scaffold_key("[Na+].[O-]C(=O)c1ccccc1") == "c1ccccc1"
    chiral = "c1ccc(cc1)[C@H]1CCCN1C"
    assert scaffold_key(chiral) == "c1ccc(C2CCCN2)cc1"
    assert scaffold_key(chiral, include_chirality=True) == "c1ccc([C@H]2CCCN2)cc1"
    assert scaffold_key("C1CC") is None


def test_nci_groups_match_reference_counts(nci_grouped):
    assert len(nci_grouped.invalid) == 8
    assert len(nci_grouped.groups) == 1069
    assert max(len(g) for g in nci_grouped.groups) == 1149  # the acyclic '' group


@pytest.mark.parametrize("kind", ["largest_first", "balanced"])
def test_split_disjoint_and_complete(nci_smiles, nci_grouped, nci_splits, kind):
    parts = [set(p.tolist()) for p in nci_splits[kind]]
    assert not (parts[0] & parts[1] or parts[0] & parts[2] or parts[1] & parts[2])
    expected = set(range(len(nci_smiles))) - set(nci_grouped.invalid.tolist())
    assert parts[0] | parts[1] | parts[2] == expected


@pytest.mark.parametrize("kind", ["largest_first", "balanced"])
def test_train_and_test_share_no_scaffold(nci_splits, rdkit_scaffold, kind):
    tr, va, te = ({rdkit_scaffold[int(i)] for i in p} for p in nci_splits[kind])
    assert not (tr & te) and not (tr & va) and not (va & te)


def test_random_split_would_share_scaffolds(rdkit_scaffold):
    rows = np.random.default_rng(0).permutation(sorted(rdkit_scaffold))
    train, test = rows[:4000], rows[4000:]
    shared = {rdkit_scaffold[int(i)] for i in train} & {rdkit_scaffold[int(i)] for i in test}
    assert len(shared) > 50  # the leakage a scaffold split removes


def test_sizes_match_reference_and_targets(nci_splits):
    n_valid = 4991
    train, valid, test = nci_splits["largest_first"]
    assert (len(train), len(valid), len(test)) == (3992, 499, 500)
    b_train, b_valid, _ = nci_splits["balanced"]
    assert len(b_train) <= 0.8 * n_valid and len(b_valid) <= 0.1 * n_valid


def test_same_seed_same_split_and_seed_matters_only_when_balanced(nci_grouped):
    groups = nci_grouped.groups
    a = assign_groups(groups, balanced=True, seed=1)
    b = assign_groups(groups, balanced=True, seed=1)
    c = assign_groups(groups, balanced=True, seed=2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a.test, c.test)
    d = assign_groups(groups, seed=1)
    e = assign_groups(groups, seed=2)
    assert all(np.array_equal(x, y) for x, y in zip(d, e))


def test_acyclic_molecules_stay_together(nci_splits, rdkit_scaffold):
    holding = [p for p in nci_splits["largest_first"] if any(rdkit_scaffold[int(i)] == "" for i in p)]
    assert len(holding) == 1


def test_invalid_policy_raise():
    with pytest.raises(ValueError, match="does not parse"):
        scaffold_split(["c1ccccc1", "C1CC", "CCO"])


def test_invalid_policy_drop_reports_count(caplog):
    smiles = ["c1ccccc1C", "C1CC", "CCO", "not-a-smiles", "c1ccncc1"] * 4
    grouped = scaffold_groups(smiles, invalid="drop")
    assert len(grouped.invalid) == 8
    with caplog.at_level(logging.WARNING, logger="reference_impl.bio.splits"):
        parts = scaffold_split(smiles, invalid="drop")
    assert "8 invalid SMILES" in caplog.text
    kept = set(np.concatenate(parts).tolist())
    assert kept.isdisjoint(grouped.invalid.tolist()) and len(kept) == 12


def test_invalid_policy_singleton_keeps_every_row():
    smiles = ["c1ccccc1C", "C1CC", "CCO", "not-a-smiles", "c1ccncc1"] * 4
    grouped = scaffold_groups(smiles, invalid="singleton")
    assert len(grouped.invalid) == 8
    assert sum(len(g) == 1 and g[0] in grouped.invalid for g in grouped.groups) == 8
    parts = scaffold_split(smiles, invalid="singleton")
    assert sorted(np.concatenate(parts).tolist()) == list(range(len(smiles)))


def test_unknown_policy_rejected():
    with pytest.raises(ValueError, match="invalid must be"):
        scaffold_groups(["CCO"], invalid="ignore")  # type: ignore[arg-type]


def test_assign_groups_never_splits_a_group():
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 30, size=60)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    groups = [np.arange(bounds[i], bounds[i + 1]) for i in range(len(sizes))]
    parts = assign_groups(groups, (0.7, 0.15, 0.15), balanced=True, seed=5)
    where = {int(i): k for k, p in enumerate(parts) for i in p}
    assert all(len({where[int(i)] for i in g}) == 1 for g in groups)


def test_time_split_orders_and_keeps_ties_together():
    rng = np.random.default_rng(0)
    t = rng.integers(0, 40, size=500)  # many ties
    train, valid, test = time_split(t, (0.8, 0.1, 0.1))
    assert sorted(np.concatenate([train, valid, test]).tolist()) == list(range(500))
    assert t[train].max() < t[valid].min() and t[valid].max() < t[test].min()
    assert abs(len(train) - 400) <= np.bincount(t).max()


def test_time_split_without_ties_is_exact():
    t = np.random.default_rng(1).permutation(1000).astype(float)
    train, valid, test = time_split(t, (0.8, 0.1, 0.1))
    assert (len(train), len(valid), len(test)) == (800, 100, 100)
    assert np.all(np.diff(t[train]) > 0) and t[train].max() < t[test].min()


def test_largest_first_test_set_holds_only_singleton_scaffolds(nci_splits, rdkit_scaffold):
    counts: dict[str, int] = {}
    for scaffold in rdkit_scaffold.values():
        counts[scaffold] = counts.get(scaffold, 0) + 1
    test = nci_splits["largest_first"].test
    assert all(counts[rdkit_scaffold[int(i)]] == 1 for i in test)

"""Leakage-aware dataset splits: Bemis-Murcko scaffold groups and time splits.

A scaffold split keeps every molecule that shares a Bemis-Murcko scaffold in the
same partition, so the test set measures generalisation to unseen chemotypes rather
than to near-copies of training molecules. A time split trains on the past and tests
on the future, the closest offline proxy for prospective use.
"""

# --8<-- [start:imports]
from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Literal, NamedTuple

import numpy as np
from rdkit import Chem, rdBase
from rdkit.Chem.Scaffolds import MurckoScaffold

# --8<-- [end:imports]

# --8<-- [start:split_types]
logger = logging.getLogger(__name__)

InvalidPolicy = Literal["raise", "drop", "singleton"]


class SplitIndices(NamedTuple):
    """Row indices of the three partitions; unpacks as ``train, valid, test``."""

    train: np.ndarray
    valid: np.ndarray
    test: np.ndarray


class ScaffoldGroups(NamedTuple):
    """Rows grouped by scaffold, plus the rows whose SMILES did not parse.

    Attributes:
        groups: One index array per group, in order of first appearance. Under the
            ``"singleton"`` policy every invalid row is a group of its own.
        invalid: Indices of the SMILES that RDKit could not parse.
    """

    groups: list[np.ndarray]
    invalid: np.ndarray
# --8<-- [end:split_types]


# --8<-- [start:scaffold_key]
def scaffold_key(
    smiles: str, *, include_chirality: bool = False, generic: bool = False
) -> str | None:
    """Return the Bemis-Murcko scaffold SMILES of one molecule.

    Args:
        smiles: Input SMILES.
        include_chirality: Keep stereocentres in the scaffold, so enantiomers land in
            different groups (the pretrain-gnns convention).
        generic: Replace every atom by carbon and every bond by a single bond
            (``MakeScaffoldGeneric``), which merges close analogues.

    Returns:
        The canonical scaffold SMILES (``""`` for an acyclic molecule), or ``None``
        when the SMILES does not parse.
    """
    with rdBase.BlockLogs():
        mol = Chem.MolFromSmiles(smiles)
    if mol is None:
        return None
    core = MurckoScaffold.GetScaffoldForMol(mol)
    if generic:
        core = MurckoScaffold.MakeScaffoldGeneric(core)
    return Chem.MolToSmiles(core, isomericSmiles=include_chirality)
# --8<-- [end:scaffold_key]


# --8<-- [start:scaffold_groups]
def scaffold_groups(
    smiles: Sequence[str],
    *,
    invalid: InvalidPolicy = "raise",
    include_chirality: bool = False,
    generic: bool = False,
) -> ScaffoldGroups:
    """Group row indices by scaffold.

    Args:
        smiles: One SMILES per row.
        invalid: What to do with a SMILES that does not parse: ``"raise"`` a
            ``ValueError``, ``"drop"`` the row from every group, or put it in a
            ``"singleton"`` group of its own.
        include_chirality: Passed to `scaffold_key`.
        generic: Passed to `scaffold_key`.

    Returns:
        The groups and the indices of the invalid rows.

    Raises:
        ValueError: If ``invalid="raise"`` and a SMILES does not parse, or the
            policy is unknown.
    """
    if invalid not in ("raise", "drop", "singleton"):
        raise ValueError(f"invalid must be 'raise', 'drop' or 'singleton', got {invalid!r}")
    by_key: dict[str, list[int]] = {}
    bad: list[int] = []
    for i, smi in enumerate(smiles):
        key = scaffold_key(smi, include_chirality=include_chirality, generic=generic)
        if key is None:
            if invalid == "raise":
                raise ValueError(f"row {i}: SMILES {smi!r} does not parse")
            bad.append(i)
            if invalid == "singleton":
                by_key[f"\x00invalid:{i}"] = [i]
            continue
        by_key.setdefault(key, []).append(i)
    groups = [np.asarray(rows, dtype=np.int64) for rows in by_key.values()]
    return ScaffoldGroups(groups, np.asarray(bad, dtype=np.int64))
# --8<-- [end:scaffold_groups]


# --8<-- [start:scaffold_split]
def assign_groups(
    groups: Sequence[np.ndarray],
    fractions: tuple[float, float, float] = (0.8, 0.1, 0.1),
    *,
    balanced: bool = False,
    seed: int = 0,
) -> SplitIndices:
    """Assign whole groups to train, valid and test; a group is never split.

    Unbalanced (deterministic, ``seed`` unused): largest group first, ties broken by
    the group's first row index. Balanced (chemprop's variant): groups bigger than
    half the valid or test target go first in a seeded random order, then the
    small groups, also shuffled. A group goes to train if it fits under the train
    target, else to valid if it fits there, else to test.

    Args:
        groups: Row indices per group.
        fractions: Target fractions of train, valid and test; they must sum to 1.
        balanced: Use the seeded balanced order instead of largest-first.
        seed: Seed of the balanced order.

    Returns:
        Sorted row indices of train, valid and test.

    Raises:
        ValueError: If ``fractions`` are not three non-negative numbers summing to 1.
    """
    if len(fractions) != 3 or min(fractions) < 0 or not math.isclose(sum(fractions), 1.0):
        raise ValueError(f"fractions must be three non-negative numbers summing to 1, got {fractions}")
    n = sum(len(g) for g in groups)
    train_cap, valid_cap = fractions[0] * n, fractions[1] * n
    if balanced:
        rng = np.random.default_rng(seed)
        big_cut = min(valid_cap, fractions[2] * n) / 2
        big = [g for g in groups if len(g) > big_cut]
        small = [g for g in groups if len(g) <= big_cut]
        order = [big[i] for i in rng.permutation(len(big))]
        order += [small[i] for i in rng.permutation(len(small))]
    else:
        order = sorted(groups, key=lambda g: (-len(g), int(g.min())))
    parts: tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]] = ([], [], [])
    sizes = [0, 0, 0]
    for g in order:
        if sizes[0] + len(g) <= train_cap:
            k = 0
        elif sizes[1] + len(g) <= valid_cap:
            k = 1
        else:
            k = 2
        parts[k].append(g)
        sizes[k] += len(g)
    return SplitIndices(*(np.sort(np.concatenate(p)) if p else np.empty(0, np.int64) for p in parts))


def scaffold_split(
    smiles: Sequence[str],
    fractions: tuple[float, float, float] = (0.8, 0.1, 0.1),
    *,
    balanced: bool = False,
    seed: int = 0,
    invalid: InvalidPolicy = "raise",
    include_chirality: bool = False,
    generic: bool = False,
) -> SplitIndices:
    """Split rows so that no Bemis-Murcko scaffold appears in two partitions.

    The number of unparseable SMILES is logged as a warning; call
    `scaffold_groups` directly to get the invalid rows themselves.

    Args:
        smiles: One SMILES per row.
        fractions: Target fractions of train, valid and test.
        balanced: Seeded balanced group order instead of largest-first.
        seed: Seed of the balanced order.
        invalid: ``"raise"``, ``"drop"`` or ``"singleton"``; see `scaffold_groups`.
        include_chirality: Chiral scaffolds (splits enantiomers apart).
        generic: Generic (all-carbon, single-bond) scaffolds.

    Returns:
        ``(train, valid, test)`` row indices into ``smiles``.
    """
    grouped = scaffold_groups(
        smiles, invalid=invalid, include_chirality=include_chirality, generic=generic
    )
    if len(grouped.invalid):
        logger.warning("scaffold_split: %d invalid SMILES (policy %r)", len(grouped.invalid), invalid)
    return assign_groups(grouped.groups, fractions, balanced=balanced, seed=seed)
# --8<-- [end:scaffold_split]


# --8<-- [start:time_split]
def time_split(
    timestamps: Sequence[float] | np.ndarray, fractions: tuple[float, float, float] = (0.8, 0.1, 0.1)
) -> SplitIndices:
    """Split rows chronologically: train on the oldest, test on the newest.

    Rows with equal timestamps always stay in one partition (a cut point moves
    back to the first row of a tie), so every train timestamp is strictly earlier than
    every valid timestamp, and every valid one strictly earlier than every test one.

    Args:
        timestamps: One sortable time per row (e.g. seconds or days since an epoch).
        fractions: Target fractions of train, valid and test.

    Returns:
        Row indices of train, valid and test, each in chronological order.

    Raises:
        ValueError: If ``fractions`` do not sum to 1.
    """
    t = np.asarray(timestamps)
    if not math.isclose(sum(fractions), 1.0):
        raise ValueError(f"fractions must sum to 1, got {fractions}")
    order = np.argsort(t, kind="stable")
    ts, n = t[order], len(t)

    def cut(k: int) -> int:
        # Move the cut back to the first row of the tie group it falls in.
        return n if k >= n else int(np.searchsorted(ts, ts[k], side="left"))

    cut1 = cut(round(fractions[0] * n))
    cut2 = max(cut1, cut(round((fractions[0] + fractions[1]) * n)))
    return SplitIndices(order[:cut1], order[cut1:cut2], order[cut2:])
# --8<-- [end:time_split]

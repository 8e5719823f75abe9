"""Multitask molecular property demo: random split versus scaffold split, on DDP.

Molecules come from the NCI sample that ships inside the RDKit wheel, so nothing
is downloaded. Six binary tasks are thresholds on RDKit-computed properties; 30%
of the labels are hidden at random, as in a sparse assay table. A small MLP on
Morgan fingerprints is trained with the masked loss, once on a random split and
once on a scaffold split, and the per-task test AUROC of both is printed as one
JSON line by rank 0.

Run it alone (``python -m reference_impl.bio.demo``) or on two CPU ranks
(``torchrun --standalone --nproc-per-node 2 -m reference_impl.bio.demo``).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from rdkit import Chem, RDConfig, rdBase
from rdkit.Chem import Crippen, rdFingerprintGenerator, rdMolDescriptors
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from reference_impl.bio.losses import masked_multitask_bce, pos_weight_from_labels
from reference_impl.bio.metrics import AurocResult, per_task_auroc
from reference_impl.bio.splits import SplitIndices, scaffold_split
from reference_impl.distributed import exit_after

NCI_SMILES = Path(RDConfig.RDDataDir) / "NCI" / "first_5K.smi"

#: Task name -> rule on an RDKit molecule.
TASKS: dict[str, Callable[[Chem.Mol], bool]] = {
    "logp_gt_3": lambda m: Crippen.MolLogP(m) > 3.0,  # type: ignore[attr-defined]  # missing from rdkit's stubs
    "tpsa_gt_60": lambda m: rdMolDescriptors.CalcTPSA(m) > 60.0,
    "rings_ge_3": lambda m: rdMolDescriptors.CalcNumRings(m) >= 3,
    "hbd_ge_2": lambda m: rdMolDescriptors.CalcNumHBD(m) >= 2,
    "aromatic_rings_ge_2": lambda m: rdMolDescriptors.CalcNumAromaticRings(m) >= 2,
    "heavy_atoms_gt_20": lambda m: m.GetNumHeavyAtoms() > 20,
}


def load_molecules(path: Path = NCI_SMILES) -> tuple[list[str], list[Chem.Mol], int]:
    """Read a ``SMILES<tab>id`` file and keep the molecules RDKit parses.

    Args:
        path: The SMILES file.

    Returns:
        Valid SMILES, their molecules, and the number of lines that did not parse.
    """
    smiles, mols, n_invalid = [], [], 0
    with rdBase.BlockLogs():
        for line in path.read_text().splitlines():
            smi = line.split()[0]
            mol = Chem.MolFromSmiles(smi)
            if mol is None:
                n_invalid += 1
                continue
            smiles.append(smi)
            mols.append(mol)
    return smiles, mols, n_invalid


def featurize(mols: Sequence[Chem.Mol], missing_rate: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Morgan fingerprints and property-threshold labels with random gaps.

    Args:
        mols: Molecules.
        missing_rate: Fraction of labels replaced by NaN (missing, not negative).
        seed: Seed of the missingness pattern.

    Returns:
        ``X`` of shape ``[N, 2048]`` (float32 bits) and ``Y`` of shape ``[N, T]``.
    """
    gen = rdFingerprintGenerator.GetMorganGenerator(radius=2, fpSize=2048)
    x = np.stack([gen.GetFingerprintAsNumPy(m) for m in mols]).astype(np.float32)
    y = np.array([[float(rule(m)) for rule in TASKS.values()] for m in mols], dtype=np.float32)
    hidden = np.random.default_rng(seed).random(y.shape) < missing_rate
    y[hidden] = np.nan
    return x, y


def random_split(n: int, seed: int, fractions: tuple[float, float, float] = (0.8, 0.1, 0.1)) -> SplitIndices:
    """Seeded random 80/10/10 split of ``n`` rows (the optimistic baseline).

    Args:
        n: Number of rows.
        seed: Permutation seed.
        fractions: Train, valid and test fractions.

    Returns:
        Row indices of train, valid and test.
    """
    perm = np.random.default_rng(seed).permutation(n)
    a, b = int(fractions[0] * n), int((fractions[0] + fractions[1]) * n)
    return SplitIndices(np.sort(perm[:a]), np.sort(perm[a:b]), np.sort(perm[b:]))


# --8<-- [start:demo_train]
def train_and_evaluate(
    x: np.ndarray, y: np.ndarray, split: SplitIndices, *, epochs: int, seed: int
) -> AurocResult | None:
    """Train an MLP with the masked loss on ``split.train``; score ``split.test``.

    Under a process group the model is wrapped in DDP and every rank sees a
    disjoint shard of each epoch (``DistributedSampler``, reseeded by ``set_epoch``).

    Args:
        x: Features ``[N, F]``.
        y: Labels ``[N, T]`` with NaN for missing.
        split: Train/valid/test indices.
        epochs: Passes over the training split.
        seed: Seed of initialisation and shuffling (identical on all ranks).

    Returns:
        Per-task test AUROC on rank 0, None on the other ranks.
    """
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    torch.manual_seed(seed)
    model: nn.Module = nn.Sequential(
        nn.Linear(x.shape[1], 256), nn.ReLU(), nn.Dropout(0.2), nn.Linear(256, y.shape[1])
    )
    if distributed:
        model = DistributedDataParallel(model)
    train_y = torch.from_numpy(y[split.train])
    pos_weight = pos_weight_from_labels(train_y)  # training labels only
    data = TensorDataset(torch.from_numpy(x[split.train]), train_y)
    sampler: DistributedSampler[int] = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True,
                                                          seed=seed)
    loader = DataLoader(data, batch_size=64, sampler=sampler)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        model.train()
        for xb, yb in loader:
            opt.zero_grad(set_to_none=True)
            masked_multitask_bce(model(xb), yb, pos_weight).backward()
            opt.step()
    if rank != 0:
        return None
    model.eval()
    with torch.no_grad():
        scores = model(torch.from_numpy(x[split.test])).numpy()
    return per_task_auroc(y[split.test], scores)
# --8<-- [end:demo_train]


def _report(result: AurocResult, split: SplitIndices) -> dict[str, object]:
    return {
        "sizes": [len(split.train), len(split.valid), len(split.test)],
        "auroc": {name: round(float(v), 4) for name, v in zip(TASKS, result.per_task, strict=True)},
        "mean_auroc": round(result.mean, 4),
        "skipped_tasks": result.n_skipped,
    }


def _count(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least `low` (argparse reports a ValueError itself)."""
    def whole_number(text: str) -> int:
        if int(text) < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {text}")
        return int(text)
    return whole_number


def _rate(text: str) -> float:
    """An argparse type: a share in [0, 1); NaN is refused too."""
    if not 0 <= float(text) < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return float(text)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; print one JSON line from rank 0.

    Args:
        argv: Command-line arguments (``--epochs``, ``--seed``, ``--missing-rate``).

    Returns:
        Process exit status.
    """
    parser = argparse.ArgumentParser(prog="python -m reference_impl.bio.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=_count(1), default=8)
    parser.add_argument("--seed", type=_count(0), default=0)
    parser.add_argument("--missing-rate", type=_rate, default=0.3, help="share of labels hidden, in [0, 1)")
    args = parser.parse_args(argv)
    world_size = os.environ.get("WORLD_SIZE", "1")
    if not (world_size.isascii() and world_size.isdigit() and int(world_size) >= 1):
        parser.error(f"WORLD_SIZE={world_size!r} in the environment is not a whole number of at least 1")
    world = int(world_size)
    if world > 1:
        torch.set_num_threads(1)  # one core per rank on a small CPU machine
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        smiles, mols, n_invalid = load_molecules()
        x, y = featurize(mols, args.missing_rate, args.seed)
        splits = {
            "random": random_split(len(smiles), args.seed),
            "scaffold": scaffold_split(smiles, (0.8, 0.1, 0.1)),
        }
        results = {
            name: train_and_evaluate(x, y, split, epochs=args.epochs, seed=args.seed)
            for name, split in splits.items()
        }
        if int(os.environ.get("RANK", "0")) == 0:
            line = {
                "event": "bio_demo",
                "world_size": world,
                "molecules": len(smiles),
                "invalid_smiles": n_invalid,
                "missing_rate": args.missing_rate,
                "tasks": list(TASKS),
            }
            for name, result in results.items():
                assert result is not None
                line[name] = _report(result, splits[name])
            print(json.dumps(line), flush=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_after(main)  # a torchrun worker: ends as the trainer does, also after a failed collective

"""Sparse genomic matrices (cells x genes) served by row slices of a CSR matrix.

A CSR row is a contiguous run of ``data``/``indices`` between ``indptr[i]`` and
``indptr[i+1]``, so selecting rows is cheap, but every separate ``X[i]`` call pays
SciPy's per-call overhead. The dataset here therefore slices once per minibatch:
the DataLoader hands it the whole index list through ``__getitems__``.
"""

# --8<-- [start:imports]
from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

import numpy as np
import scipy.sparse as sp
import torch
from torch.utils.data import Dataset

# --8<-- [end:imports]


# --8<-- [start:csr_batch]
class CSRBatch(NamedTuple):
    """Rows of a CSR matrix and their labels, before conversion to tensors."""

    x: sp.csr_matrix
    y: np.ndarray
# --8<-- [end:csr_batch]


# --8<-- [start:csr_dataset]
class CSRDataset(Dataset):
    """Map-style dataset over the rows of a ``scipy.sparse.csr_matrix``.

    Use it with a batch sampler (``DataLoader(ds, batch_size=..., collate_fn=...)``
    or ``batch_sampler=...``): the loader then calls `__getitems__` once per batch
    with the list of indices, and the matrix is sliced once.

    Args:
        x: ``[N, G]`` expression matrix in CSR format.
        y: ``[N, ...]`` labels, one row per matrix row.

    Raises:
        ValueError: If ``x`` and ``y`` have different numbers of rows.
    """

    def __init__(self, x: sp.csr_matrix, y: np.ndarray) -> None:
        if x.shape[0] != len(y):
            raise ValueError(f"{x.shape[0]} rows but {len(y)} labels")
        self.x = sp.csr_matrix(x)
        self.y = np.asarray(y)

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, index: int) -> CSRBatch:
        return self.__getitems__([index])

    def __getitems__(self, indices: Sequence[int]) -> CSRBatch:
        """Slice all requested rows with one fancy index (repeats and order kept).

        Args:
            indices: Row indices of one minibatch.

        Returns:
            The rows as a ``[len(indices), G]`` CSR matrix, and their labels.
        """
        idx = np.asarray(indices, dtype=np.int64)
        return CSRBatch(self.x[idx], self.y[idx])


def collate_csr(
    batch: CSRBatch, layout: Literal["dense", "sparse_csr", "sparse_coo"] = "dense"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn a `CSRBatch` into tensors; the default collate cannot stack SciPy rows.

    Args:
        batch: What `CSRDataset.__getitems__` returned.
        layout: ``"dense"`` (a strided tensor), ``"sparse_csr"`` or ``"sparse_coo"``.

    Returns:
        ``(x, y)`` with ``x`` of shape ``[B, G]`` in the requested layout.

    Raises:
        ValueError: On an unknown layout.
    """
    x, y = batch.x, torch.from_numpy(batch.y)
    if layout == "dense":
        return torch.from_numpy(x.toarray()), y
    if layout == "sparse_csr":
        return torch.sparse_csr_tensor(
            torch.from_numpy(x.indptr.astype(np.int64)),
            torch.from_numpy(x.indices.astype(np.int64)),
            torch.from_numpy(x.data),
            size=x.shape,
            check_invariants=False,  # SciPy's slice is already a valid CSR structure
        ), y
    if layout == "sparse_coo":
        coo = x.tocoo()
        index = torch.from_numpy(np.vstack([coo.row, coo.col]).astype(np.int64))
        return torch.sparse_coo_tensor(
            index, torch.from_numpy(coo.data), size=x.shape, check_invariants=False
        ), y
    raise ValueError(f"unknown layout {layout!r}")
# --8<-- [end:csr_dataset]

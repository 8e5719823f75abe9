"""Activation memory of AlphaFold-2-style pair representations.

The pair representation ``z`` is ``[N, N, c_z]``: quadratic in the number of
residues ``N``. Triangle attention is worse: for each of the ``N`` rows it forms
``H`` attention maps of ``N x N`` logits, ``H * N^3`` values per layer, unless the
rows are processed in chunks. Shapes follow OpenFold's configuration: ``c_z=128``,
triangle attention with 4 heads of 32 channels, triangle multiplication with 128
hidden channels, outer-product mean with 32 channels, pair transition x4.
"""

# --8<-- [start:imports]
from __future__ import annotations

from typing import NamedTuple

import torch

# --8<-- [end:imports]


# --8<-- [start:pair_memory_type]
class PairMemory(NamedTuple):
    """Bytes of the largest pair-stack tensors of one Evoformer block.

    Attributes:
        pair: ``z``, ``[N, N, c_z]``.
        triangle_logits: Triangle-attention logits ``[rows, H, N, N]``, where
            ``rows`` is ``N`` unchunked or the chunk size.
        triangle_mult_projection: One of the two ``[N, N, c_mult]`` projections
            (``a`` or ``b``) of triangle multiplication.
        outer_product: The outer-product-mean intermediate ``[N, N, c_opm, c_opm]``.
        transition_hidden: The pair transition's hidden activation ``[N, N, 4 c_z]``.
    """

    pair: int
    triangle_logits: int
    triangle_mult_projection: int
    outer_product: int
    transition_hidden: int
# --8<-- [end:pair_memory_type]


# --8<-- [start:pair_memory]
def pair_memory(
    n_res: int,
    *,
    c_z: int = 128,
    heads: int = 4,
    c_mult: int = 128,
    c_opm: int = 32,
    dtype: torch.dtype = torch.bfloat16,
    chunk_rows: int | None = None,
) -> PairMemory:
    """Bytes of the main pair-stack tensors for ``n_res`` residues.

    Bytes per element are ``dtype.itemsize``: 4 for float32, 2 for bfloat16 and
    float16. Example: ``n_res=1024``, bfloat16 gives ``z`` = 1024 * 1024 * 128 * 2
    = 256 MiB and unchunked triangle logits = 1024 * 4 * 1024 * 1024 * 2 = 8 GiB
    per layer.

    Args:
        n_res: Number of residues (crop length) ``N``.
        c_z: Pair channels.
        heads: Triangle-attention heads ``H``.
        c_mult: Hidden channels of triangle multiplication.
        c_opm: Channels of the outer-product mean.
        dtype: Activation dtype.
        chunk_rows: Rows of triangle attention computed at once; None = all ``N``.

    Returns:
        Sizes in bytes.
    """
    b, n2 = dtype.itemsize, n_res * n_res
    rows = n_res if chunk_rows is None else min(chunk_rows, n_res)
    return PairMemory(
        pair=n2 * c_z * b,
        triangle_logits=rows * heads * n2 * b,
        triangle_mult_projection=n2 * c_mult * b,
        outer_product=n2 * c_opm * c_opm * b,
        transition_hidden=n2 * 4 * c_z * b,
    )
# --8<-- [end:pair_memory]

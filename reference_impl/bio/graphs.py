"""Molecular graphs from SMILES and their mini-batching, without PyTorch Geometric.

A batch of graphs is one big disconnected graph: node features are concatenated,
each graph's edge indices are shifted by the number of nodes before it (its
offset), and a ``batch`` vector maps every node to its graph. Message passing then
runs once over the whole batch and never crosses between molecules.
"""

# --8<-- [start:imports]
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from rdkit import Chem

# --8<-- [end:imports]

#: Atomic numbers with their own one-hot slot; every other element shares the last.
ATOM_TYPES: tuple[int, ...] = (6, 7, 8, 9, 15, 16, 17, 35, 53)
NUM_NODE_FEATURES = len(ATOM_TYPES) + 1 + 4


# --8<-- [start:graph_types]
@dataclass
class MolGraph:
    """One molecule as a graph.

    Attributes:
        x: ``[N, F]`` float node features.
        edge_index: ``[2, E]`` long, both directions of every bond.
    """

    x: torch.Tensor
    edge_index: torch.Tensor


@dataclass
class GraphBatch:
    """Several graphs as one disconnected graph.

    Attributes:
        x: ``[sum N_g, F]`` concatenated node features.
        edge_index: ``[2, sum E_g]`` edges, shifted by each graph's node offset.
        batch: ``[sum N_g]`` graph id of every node (sorted).
        ptr: ``[G + 1]`` node offsets: graph ``g`` owns nodes ``ptr[g]:ptr[g+1]``.
        edge_ptr: ``[G + 1]`` edge offsets: graph ``g`` owns edge columns
            ``edge_ptr[g]:edge_ptr[g+1]``.
    """

    x: torch.Tensor
    edge_index: torch.Tensor
    batch: torch.Tensor
    ptr: torch.Tensor
    edge_ptr: torch.Tensor

    @property
    def num_graphs(self) -> int:
        """Number of graphs in the batch."""
        return len(self.ptr) - 1
# --8<-- [end:graph_types]


def mol_to_graph(smiles: str) -> MolGraph:
    """Featurise one molecule: element one-hot, degree, charge, aromaticity, H count.

    Args:
        smiles: A valid SMILES.

    Returns:
        The molecule's graph (heavy atoms only; a bond becomes two directed edges).

    Raises:
        ValueError: If the SMILES does not parse.
    """
    mol = Chem.MolFromSmiles(smiles)
    if mol is None:
        raise ValueError(f"SMILES {smiles!r} does not parse")
    rows = []
    for atom in mol.GetAtoms():
        one_hot = [0.0] * (len(ATOM_TYPES) + 1)
        z = atom.GetAtomicNum()
        one_hot[ATOM_TYPES.index(z) if z in ATOM_TYPES else len(ATOM_TYPES)] = 1.0
        rows.append(one_hot + [
            float(atom.GetDegree()),
            float(atom.GetFormalCharge()),
            float(atom.GetIsAromatic()),
            float(atom.GetTotalNumHs()),
        ])
    pairs = [(b.GetBeginAtomIdx(), b.GetEndAtomIdx()) for b in mol.GetBonds()]
    src = [i for i, j in pairs] + [j for i, j in pairs]
    dst = [j for i, j in pairs] + [i for i, j in pairs]
    x = torch.tensor(rows, dtype=torch.float32).reshape(-1, NUM_NODE_FEATURES)
    return MolGraph(x, torch.tensor([src, dst], dtype=torch.long).reshape(2, -1))


# --8<-- [start:graph_batch]
def batch_graphs(graphs: Sequence[MolGraph]) -> GraphBatch:
    """Concatenate graphs into one disconnected graph.

    Args:
        graphs: Graphs to batch.

    Returns:
        The batch; ``edge_index`` of graph ``g`` is shifted by ``ptr[g]``.
    """
    num_nodes = torch.tensor([g.x.shape[0] for g in graphs], dtype=torch.long)
    num_edges = torch.tensor([g.edge_index.shape[1] for g in graphs], dtype=torch.long)
    ptr = torch.cat([torch.zeros(1, dtype=torch.long), num_nodes.cumsum(0)])
    edge_ptr = torch.cat([torch.zeros(1, dtype=torch.long), num_edges.cumsum(0)])
    edge_index = torch.cat([g.edge_index + ptr[i] for i, g in enumerate(graphs)], dim=1)
    batch = torch.repeat_interleave(torch.arange(len(graphs)), num_nodes)
    x = torch.cat([g.x for g in graphs], dim=0)
    return GraphBatch(x, edge_index, batch, ptr, edge_ptr)


def unbatch(batch: GraphBatch) -> list[MolGraph]:
    """Invert `batch_graphs`.

    Args:
        batch: A batch from `batch_graphs`.

    Returns:
        The original graphs, in order.
    """
    p, e = batch.ptr.tolist(), batch.edge_ptr.tolist()
    return [
        MolGraph(batch.x[p[g] : p[g + 1]], batch.edge_index[:, e[g] : e[g + 1]] - p[g])
        for g in range(batch.num_graphs)
    ]
# --8<-- [end:graph_batch]


# --8<-- [start:graph_readout]
def neighbor_sum(x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
    """One message-passing step: each node receives the sum of its neighbours.

    Args:
        x: ``[N, F]`` node features.
        edge_index: ``[2, E]`` directed edges ``source -> target``.

    Returns:
        ``[N, F]``: for every node, the sum of ``x`` over its incoming edges.
    """
    src, dst = edge_index
    return torch.zeros_like(x).index_add_(0, dst, x[src])


def graph_readout(
    x: torch.Tensor, batch: torch.Tensor, num_graphs: int, reduce: Literal["sum", "mean"] = "sum"
) -> torch.Tensor:
    """Pool node features per graph with a scatter over the batch vector.

    Args:
        x: ``[N, F]`` node features of a batch.
        batch: ``[N]`` graph id of every node.
        num_graphs: Number of graphs (a graph with no nodes yields zeros).
        reduce: ``"sum"`` or ``"mean"``.

    Returns:
        ``[num_graphs, F]`` pooled features.
    """
    out = x.new_zeros(num_graphs, x.shape[1]).index_add_(0, batch, x)
    if reduce == "mean":
        counts = torch.bincount(batch, minlength=num_graphs).clamp(min=1)
        out = out / counts[:, None].to(x.dtype)
    return out
# --8<-- [end:graph_readout]

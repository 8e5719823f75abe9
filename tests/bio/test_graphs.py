import pytest
import torch

from reference_impl.bio.graphs import (
    NUM_NODE_FEATURES,
    batch_graphs,
    graph_readout,
    mol_to_graph,
    neighbor_sum,
    unbatch,
)

pytestmark = pytest.mark.bio

SMILES = ["CCO", "c1ccccc1O", "[Na+]", "CC(=O)Nc1ccc(O)cc1", "C", "O=C(O)c1ccccc1C(=O)O"]


@pytest.fixture(scope="module")
def graphs():
    return [mol_to_graph(s) for s in SMILES]


def test_featurisation_shapes(graphs):
    assert graphs[0].x.shape == (3, NUM_NODE_FEATURES)
    assert graphs[1].edge_index.shape == (2, 14)  # 7 bonds, both directions
    assert graphs[2].edge_index.shape == (2, 0)  # a lone ion has no edges
    with pytest.raises(ValueError):
        mol_to_graph("C1CC")


def test_batch_invariants(graphs):
    b = batch_graphs(graphs)
    sizes = torch.tensor([g.x.shape[0] for g in graphs])
    assert b.x.shape[0] == sizes.sum() and b.num_graphs == len(graphs)
    assert b.edge_index.shape[1] == sum(g.edge_index.shape[1] for g in graphs)
    assert torch.equal(b.ptr[1:] - b.ptr[:-1], sizes)
    assert torch.equal(torch.bincount(b.batch, minlength=len(graphs)), sizes)
    assert torch.all(b.batch[1:] >= b.batch[:-1])
    src, dst = b.edge_index
    assert torch.equal(b.batch[src], b.batch[dst])  # no edge crosses molecules
    for g in range(b.num_graphs):
        cols = b.edge_index[:, b.edge_ptr[g] : b.edge_ptr[g + 1]]
        assert torch.all((cols >= b.ptr[g]) & (cols < b.ptr[g + 1]))
        assert torch.equal(cols - b.ptr[g], graphs[g].edge_index)


def test_unbatch_round_trip(graphs):
    back = unbatch(batch_graphs(graphs))
    assert len(back) == len(graphs)
    for a, b in zip(back, graphs):
        assert torch.equal(a.x, b.x) and torch.equal(a.edge_index, b.edge_index)


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_readout_after_message_passing_equals_per_molecule(graphs, reduce):
    b = batch_graphs(graphs)
    h = b.x + neighbor_sum(b.x, b.edge_index)
    pooled = graph_readout(h, b.batch, b.num_graphs, reduce)
    for g, mol in enumerate(graphs):
        h_alone = mol.x + neighbor_sum(mol.x, mol.edge_index)
        expected = h_alone.sum(0) if reduce == "sum" else h_alone.mean(0)
        assert torch.allclose(pooled[g], expected, atol=1e-6)


def test_permuting_graphs_permutes_outputs(graphs):
    perm = [3, 0, 5, 2, 1, 4]
    a = batch_graphs(graphs)
    b = batch_graphs([graphs[i] for i in perm])
    pa = graph_readout(a.x + neighbor_sum(a.x, a.edge_index), a.batch, a.num_graphs)
    pb = graph_readout(b.x + neighbor_sum(b.x, b.edge_index), b.batch, b.num_graphs)
    assert torch.allclose(pa[perm], pb)


def test_forgetting_the_offset_breaks_readout(graphs):
    b = batch_graphs(graphs)
    unshifted = torch.cat([g.edge_index for g in graphs], dim=1)  # the classic bug
    good = graph_readout(neighbor_sum(b.x, b.edge_index), b.batch, b.num_graphs)
    bad = graph_readout(neighbor_sum(b.x, unshifted), b.batch, b.num_graphs)
    assert not torch.allclose(good, bad)

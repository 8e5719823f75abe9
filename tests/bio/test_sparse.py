import functools

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from torch.utils.data import DataLoader

from reference_impl.bio.sparse import CSRDataset, collate_csr

pytestmark = pytest.mark.bio


@pytest.fixture(scope="module")
def matrix() -> sp.csr_matrix:
    return sp.random(300, 80, density=0.05, format="csr", random_state=0, dtype=np.float32)


@pytest.mark.parametrize("layout", ["dense", "sparse_csr", "sparse_coo"])
def test_minibatch_equals_dense_rows(matrix, layout):
    ds = CSRDataset(matrix, np.arange(300))
    idx = [17, 3, 3, 250, 0, 17, 299]  # unsorted, repeated
    x, y = collate_csr(ds.__getitems__(idx), layout)
    dense = x if layout == "dense" else x.to_dense()
    assert torch.equal(dense, torch.from_numpy(matrix.toarray()[idx]))
    assert y.tolist() == idx


def test_single_item_equals_the_dense_row_and_its_label(matrix):
    """`ds[i]` (the path a loader without batching takes) is row i and label i."""
    ds = CSRDataset(matrix, np.arange(300) * 10)
    for i in (0, 123, 299):
        item = ds[i]
        assert item.x.shape == (1, 80)
        assert np.array_equal(item.x.toarray()[0], matrix.toarray()[i])
        assert item.y.tolist() == [i * 10]


class CountingCSRDataset(CSRDataset):
    def __init__(self, *args):
        super().__init__(*args)
        self.batched_calls = 0
        self.single_calls = 0

    def __getitem__(self, index):
        self.single_calls += 1
        return super().__getitem__(index)

    def __getitems__(self, indices):
        self.batched_calls += 1
        return super().__getitems__(indices)


def test_loader_slices_once_per_minibatch_and_covers_the_epoch(matrix):
    ds = CountingCSRDataset(matrix, np.arange(300))
    loader = DataLoader(ds, batch_size=32, shuffle=True, collate_fn=functools.partial(collate_csr, layout="sparse_csr"))
    seen = []
    for x, y in loader:
        assert torch.equal(x.to_dense(), torch.from_numpy(matrix.toarray()[y.numpy()]))
        seen += y.tolist()
    assert ds.batched_calls == len(loader) == 10
    assert ds.single_calls == 0
    assert sorted(seen) == list(range(300))


def test_label_count_must_match_rows(matrix):
    with pytest.raises(ValueError):
        CSRDataset(matrix, np.arange(10))

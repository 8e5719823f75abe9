"""What FSDP2's per-parameter sharding changed from FSDP1's FlatParameter, checked on torch.

Four ranks of the fake backend in one process (rank 1 of 4, so the shards are not the first
ones): shapes, names, placements and state-dict keys are decided on every rank alike, and the
fake backend runs no numerics, which none of these facts need.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

WORLD = 4


@pytest.fixture
def mesh() -> Iterator[DeviceMesh]:
    dist.init_process_group("fake", rank=1, world_size=WORLD, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (WORLD,))
    finally:
        dist.destroy_process_group()


def small() -> nn.Sequential:
    # 10 rows do not divide by 4 ranks: the uneven case.
    return nn.Sequential(nn.Linear(16, 10), nn.LayerNorm(10), nn.Linear(10, 8))


def test_fsdp1_flattens_a_unit_into_one_1d_parameter_and_refuses_mixed_requires_grad(mesh: DeviceMesh) -> None:
    model = small()
    total = sum(p.numel() for p in model.parameters())
    wrapped = FSDP1(model, device_id="cpu", use_orig_params=False)
    names = [(name, tuple(p.shape)) for name, p in wrapped.named_parameters()]
    # Every parameter of the unit is one padded 1-D slice of a concatenation: the names are gone.
    assert names == [("_fsdp_wrapped_module._flat_param", (-(-total // WORLD),))]
    frozen = small()
    frozen[0].weight.requires_grad_(False)
    with pytest.raises(ValueError, match="uniform `requires_grad`"):
        FSDP1(frozen, device_id="cpu", use_orig_params=False)


def test_fsdp2_keeps_each_parameter_a_dtensor_sharded_on_dim_0_under_its_own_name(mesh: DeviceMesh) -> None:
    reference = small()
    model = small()
    model[0].weight.requires_grad_(False)  # a frozen weight beside trainable ones, in one group
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]
    for (name, p), (_, ref) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert isinstance(p, DTensor) and p.placements == (Shard(0),), name
        assert p.shape == ref.shape, name  # the global shape; the rank holds a slice
        rows, rank = -(-ref.shape[0] // WORLD), dist.get_rank()  # torch.chunk's split: padded at the end
        assert p.to_local().shape[0] == min(rows, max(ref.shape[0] - rank * rows, 0)), name
    assert [p.requires_grad for p in model.parameters()] == [False, True, True, True, True, True]
    state = model.state_dict()
    assert list(state) == list(reference.state_dict())
    assert all(isinstance(v, DTensor) and v.placements == (Shard(0),) for v in state.values())


def test_fsdp2_unshards_to_plain_full_parameters_and_back(mesh: DeviceMesh) -> None:
    model = small()
    fully_shard(model, mesh=mesh)
    model.unshard()
    assert [type(p) for p in model.parameters()] == [nn.Parameter] * 6
    assert [tuple(p.shape) for p in model.parameters()] == [tuple(p.shape) for p in small().parameters()]
    model.reshard()
    assert all(isinstance(p, DTensor) for p in model.parameters())

"""ParallelDims: where each rank sits on the pp, dp_replicate, dp_shard, cp and tp axes, which
data shard it reads, and the expert-parallel groups carved out of the data axis, against an
independent row-major layout and torch's DeviceMesh."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from reference_impl.parallel.mesh import AXES, ParallelDims

# (pp, dp_replicate, dp_shard, cp, tp): every axis alone, pairs, and all five at once.
MESHES = [(1, 1, 1, 1, 1), (1, 1, 1, 1, 4), (4, 1, 1, 1, 1), (1, 3, 1, 1, 1), (1, 1, 3, 1, 1),
          (1, 1, 1, 2, 1), (2, 1, 2, 1, 2), (2, 2, 1, 1, 2), (1, 2, 2, 1, 2), (2, 2, 2, 1, 1),
          (3, 2, 1, 1, 2), (2, 2, 2, 1, 2), (2, 3, 2, 1, 2), (1, 1, 2, 2, 1), (1, 3, 1, 2, 1),
          (2, 2, 2, 2, 2)]
Shape = tuple[int, int, int, int, int]


def _dims(shape: Shape) -> ParallelDims:
    pp, replicate, shard, cp, tp = shape
    return ParallelDims(pp=pp, dp_replicate=replicate, dp_shard=shard, cp=cp, tp=tp,
                        data_axis="dp_shard" if shard > 1 else "dp_replicate")


@pytest.mark.parametrize("shape", MESHES, ids=["x".join(map(str, s)) for s in MESHES])
def test_coordinates_are_the_row_major_position_with_tp_fastest(shape: Shape) -> None:
    """The ranks laid out as a tensor of shape (pp, dp_replicate, dp_shard, cp, tp), as DeviceMesh
    lays them out: each rank's coordinates are its index there, so tp varies fastest."""
    dims = _dims(shape)
    grid = torch.arange(dims.world_size).reshape(shape)
    assert dims.world_size == grid.numel()
    for index in itertools.product(*map(range, shape)):
        rank = int(grid[index])
        assert dims.coordinates(rank) == dict(zip(AXES, index, strict=True)), rank
    assert [dims.coordinates(r)["tp"] for r in range(dims.world_size)] == [r % dims.tp for r in range(dims.world_size)]


@pytest.mark.parametrize("shape", MESHES, ids=["x".join(map(str, s)) for s in MESHES])
def test_dp_rank_numbers_the_data_shards_in_rank_order_shared_by_each_tp_group(shape: Shape) -> None:
    """Within a pipeline stage, the ranks at one (cp, tp) position read shards 0, 1, ...,
    dp_size - 1 in rank order (replicas outer, shards inner); the ranks of one cp x tp
    block read the same."""
    dims = _dims(shape)
    grid = torch.arange(dims.world_size).reshape(shape)
    for stage, cp, tp in itertools.product(range(dims.pp), range(dims.cp), range(dims.tp)):
        ranks = grid[stage, :, :, cp, tp].flatten().tolist()
        assert ranks == sorted(ranks)
        assert [dims.dp_rank(r) for r in ranks] == list(range(dims.dp_size))
    for group in grid.reshape(-1, dims.cp * dims.tp).tolist():
        assert len({dims.dp_rank(r) for r in group}) == 1, group


@pytest.mark.parametrize(("shape", "axes"), [((2, 1, 2, 1, 2), ("pp", "dp_shard", "tp")),
                                             ((1, 2, 2, 1, 2), ("dp_replicate", "dp_shard", "tp")),
                                             ((1, 1, 2, 2, 1), ("dp_shard", "cp"))])
def test_coordinates_match_torchs_device_mesh_on_every_rank(shape: Shape,
                                                             axes: tuple[str, ...]) -> None:
    """torch's own DeviceMesh, built on each rank of a fake process group (real layout, no
    communication), puts every rank where `coordinates` says and groups the same ranks on
    the innermost axis."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dims = _dims(shape)
    assert dims.used_axes == axes
    for rank in range(dims.world_size):
        dist.init_process_group("fake", rank=rank, world_size=dims.world_size, store=FakeStore())
        try:
            mesh = init_device_mesh("cpu", tuple(dims.degree(a) for a in axes), mesh_dim_names=axes)
            coords = dims.coordinates(rank)
            assert list(mesh.get_coordinate() or ()) == [coords[a] for a in axes], rank
            same_inner = [r for r in range(dims.world_size)
                          if all(dims.coordinates(r)[a] == coords[a] for a in AXES if a != axes[-1])]
            assert mesh[axes[-1]].mesh.flatten().tolist() == same_inner
        finally:
            dist.destroy_process_group()


def test_hsdp_gives_fsdp2_the_replicate_by_shard_mesh_with_shard_groups_of_neighbours() -> None:
    """`--dp-replicate 2` on 4 ranks: one FSDP2 wrapper over the 2-D (dp_replicate, dp_shard)
    mesh, no DDP of its own on dp_replicate; ranks 0,1 and 2,3 each hold one whole set of
    shards (built on a fake process group: real layout, no communication)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from reference_impl.config import TrainConfig
    from reference_impl.parallel.registry import PARALLELISMS, applied, dims_of

    cfg = TrainConfig(strategy="fsdp", model="transformer", dp_replicate=2, world_size=4, micro_batch_size=4)
    dims = dims_of(cfg)
    assert (dims.dp_replicate, dims.dp_shard, dims.dp_size) == (2, 2, 4)
    assert dims.used_axes == ("dp_replicate", "dp_shard") and applied(cfg, dims) == [PARALLELISMS["fsdp"]]
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        mesh = PARALLELISMS["fsdp"].mesh_of(dims)
        assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard")
        assert mesh.mesh.tolist() == [[0, 1], [2, 3]]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("strategy", "world", "data_ranks"), [("ddp", 2, [0, 1]), ("fsdp", 4, [0, 1, 2, 3])])
def test_context_parallel_ranks_join_the_data_parallel_wrapper(strategy: str, world: int,
                                                               data_ranks: list[int]) -> None:
    """`--cp-degree 2`: ring attention over neighbouring ranks (0,1), and a data-parallel
    wrapper over the data and cp ranks together, even when the data axis alone spans one
    rank: the cp ranks train on different tokens, so it averages their gradients too."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from reference_impl.config import TrainConfig
    from reference_impl.parallel.registry import PARALLELISMS, applied, dims_of

    cfg = TrainConfig(strategy=strategy, model="transformer", cp_degree=2, world_size=world)  # type: ignore[arg-type]
    dims = dims_of(cfg)
    assert applied(cfg, dims) == [PARALLELISMS["cp"], PARALLELISMS[strategy]] and dims.dp_size == world // 2
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        assert PARALLELISMS["cp"].mesh_of(dims).mesh.tolist() == [0, 1]
        assert PARALLELISMS[strategy].mesh_of(dims).mesh.flatten().tolist() == data_ranks
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("data", [2, 4, 6])
def test_expert_parallel_groups_are_consecutive_data_ranks(data: int) -> None:
    """`ep` 2 over `data` DDP ranks adds no rank: the world is the data axis, each rank reads
    its own shard, and the mesh splits the data axis into (ep_replicate, ep) = (data / 2, 2):
    ranks 2i and 2i + 1 form an ep group, and the ranks at one position of every group (those
    holding the same experts) form an ep_replicate group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from reference_impl.config import TrainConfig
    from reference_impl.parallel.registry import PARALLELISMS, applied

    dims = ParallelDims(dp_replicate=data, ep=2)
    cfg = TrainConfig(model="transformer", n_experts=4, ep_degree=2, world_size=data)
    assert dims.world_size == data and dims.ep_replicate == data // 2
    assert [dims.dp_rank(r) for r in range(data)] == list(range(data))
    assert dims.used_axes == ("dp_replicate", "ep") and applied(cfg, dims) == [PARALLELISMS["ep"]]
    for rank in range(data):
        dist.init_process_group("fake", rank=rank, world_size=data, store=FakeStore())
        try:
            mesh = PARALLELISMS["ep"].mesh_of(dims)
            assert mesh.mesh_dim_names == ("ep_replicate", "ep")
            assert mesh["ep"].mesh.tolist() == [rank - rank % 2, rank - rank % 2 + 1]
            assert mesh["ep_replicate"].mesh.tolist() == list(range(rank % 2, data, 2))
        finally:
            dist.destroy_process_group()
            dims.__dict__.pop("device_mesh", None)  # the cached mesh belongs to that process group

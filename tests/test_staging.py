"""`HostStager`: an async save's copy of host state, into buffers reused across saves.

What a staged dict must be: a snapshot (nothing done to the source after the copy shows in
it), the same values under the same keys, DTensors with the source's layout, and, from the
second save on, the same buffers refilled rather than new ones.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from reference_impl.checkpoint.staging import HostStager


@pytest.fixture
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def staged(stager: HostStager, state: dict) -> dict:
    return stager.stage(state).result(timeout=30)


def test_a_staged_dict_is_a_snapshot_with_the_same_values() -> None:
    weight, step = torch.randn(4, 3), torch.tensor(7.0)
    state = {"model": {"w": weight}, "optim": {"state": {"w": {"step": step}}, "groups": [{"lr": 0.1, "ids": [0]}]},
             "extra": {"seen": {1, 2}}}
    copy, before = staged(HostStager(), state), weight.clone()
    weight.add_(1.0)
    step.add_(1.0)
    state["optim"]["groups"][0]["lr"] = 0.2
    state["optim"]["groups"][0]["ids"].append(1)
    state["extra"]["seen"].add(3)
    assert torch.equal(copy["model"]["w"], before)
    assert copy["optim"]["state"]["w"]["step"].item() == 7.0
    assert copy["optim"]["groups"] == [{"lr": 0.1, "ids": [0]}], "plain values are copied when staged"
    assert copy["extra"]["seen"] == {1, 2}, "and so is any other object"


def test_the_second_save_refills_the_first_saves_buffers_with_the_new_values() -> None:
    stager, weight = HostStager(), torch.randn(64, 64)
    first = staged(stager, {"w": weight})["w"]
    weight.mul_(-1.0)
    second = staged(stager, {"w": weight})["w"]
    assert second.data_ptr() == first.data_ptr(), "the buffer is reused"
    assert torch.equal(second, weight), "and holds the second save's values"


def test_a_tensor_whose_shape_changed_gets_a_buffer_of_its_own() -> None:
    stager = HostStager()
    first = staged(stager, {"w": torch.randn(8)})["w"]
    second = staged(stager, {"w": torch.ones(2, 8)})["w"]
    assert second.shape == (2, 8) and torch.equal(second, torch.ones(2, 8))
    assert first.shape == (8,), "the old buffer was not resized under its readers"


def test_a_parameter_that_requires_grad_stages_without_an_autograd_link() -> None:
    param = torch.nn.Parameter(torch.randn(5))
    copy = staged(HostStager(), {"p": param})["p"]
    assert not copy.requires_grad and copy.grad_fn is None
    assert torch.equal(copy, param.detach())


def test_a_dtensor_stages_as_a_dtensor_of_the_same_layout(one_rank: None) -> None:
    mesh = init_device_mesh("cpu", (1,))
    source = distribute_tensor(torch.arange(12.0).reshape(6, 2), mesh, [Shard(0)])
    stager = HostStager()
    copy = staged(stager, {"w": source})["w"]
    assert isinstance(copy, DTensor)
    assert (copy.device_mesh, copy.placements, copy.shape, copy.stride()) == (
        source.device_mesh, source.placements, source.shape, source.stride())
    source.to_local().add_(100.0)
    assert torch.equal(copy.to_local(), torch.arange(12.0).reshape(6, 2))
    again = staged(stager, {"w": source})["w"]
    assert again is copy and torch.equal(again.to_local(), source.to_local()), "one wrapper, refilled"


def test_a_dtensor_of_a_gpu_mesh_stays_in_its_host_buffer() -> None:
    """State on a GPU mesh: the staged DTensor must hold the host buffer the copies fill.
    `DTensor.from_local` would move the buffer to the mesh's device (a GPU copy made once and
    never refilled); on this CPU-only build such a move fails outright. A "cuda" mesh over a
    fake process group gives the layout without a GPU."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        mesh = DeviceMesh("cuda", [0, 1], _init_backend=False)
        local = torch.arange(6.0)  # rank 0's half of 12 values, held on the host for the test
        spec = DTensorSpec(mesh, (Shard(0),), TensorMeta(torch.Size([12]), (1,), local.dtype))
        source = DTensor(local, spec, requires_grad=False)
        stager = HostStager()
        copy = staged(stager, {"w": source})["w"]
        assert isinstance(copy, DTensor) and copy.device_mesh is mesh and copy.placements == (Shard(0),)
        assert copy.shape == (12,) and copy._local_tensor.device.type == "cpu"
        local.add_(100.0)
        again = staged(stager, {"w": source})["w"]
        assert again is copy and torch.equal(again._local_tensor, local), "the wrapper holds the refilled buffer"
    finally:
        dist.destroy_process_group()


"""A model's spec, not its attribute names, decides what the parallel code does to it.

A toy model whose repeated layers are called `floors` (no `blocks`, no `tp_plan`, no
pipeline stages) is registered under `--model mlp` for the test: FSDP2 shards its floors,
`--compile` compiles them, and tensor and pipeline parallel refuse it through its spec.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.testing._internal.distributed.fake_pg import FakeStore

from reference_impl import model as models
from reference_impl.config import TrainConfig
from reference_impl.distributed import DistContext
from reference_impl.model import MLP_SPEC, TRANSFORMER_SPEC, build_model
from reference_impl.options.capabilities import MODEL_CAPABILITIES
from reference_impl.parallel import data_parallel, pipeline, tensor_parallel
from reference_impl.parallel import registry as parallel
from reference_impl.spec import ModelSpec


class Tower(nn.Module):
    """A stem, three residual floors and an output layer: the transformer's shape under other names."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.stem = nn.Linear(4, width)
        self.floors = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(3))
        self.out = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for floor in self.floors:
            x = x + floor(x)
        return self.out(x)


TOWER_SPEC = ModelSpec(build=lambda cfg: Tower(), dataset=MLP_SPEC.dataset, flops_per_sample=lambda cfg: 0.0,
                       repeated_units=lambda model: list(model.get_submodule("floors").children()))


@pytest.fixture
def tower_cfg(monkeypatch: pytest.MonkeyPatch) -> TrainConfig:
    """A config whose `--model` resolves to `TOWER_SPEC`."""
    monkeypatch.setitem(models.SPECS, "mlp", TOWER_SPEC)
    return TrainConfig(model="mlp", input_dim=4, num_classes=2)


@pytest.fixture
def mesh() -> Iterator[DeviceMesh]:
    """Two ranks on the fake backend: FSDP2 and DTensor set up as on a real job, in one process."""
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def test_fsdp_shards_the_units_the_spec_names(tower_cfg: TrainConfig, mesh: DeviceMesh) -> None:
    model = data_parallel.fsdp(build_model(tower_cfg), mesh, tower_cfg)
    assert all(isinstance(floor, FSDPModule) for floor in model.get_submodule("floors").children())
    assert isinstance(model, FSDPModule) and not isinstance(model.get_submodule("stem"), FSDPModule)


def test_compile_compiles_the_units_the_spec_names(tower_cfg: TrainConfig) -> None:
    cfg = dataclasses.replace(tower_cfg, compile=True)
    model = parallel.parallelize(build_model(cfg), parallel.dims_of(cfg), cfg, DistContext())
    compiled = [hasattr(m.forward, "_torchdynamo_orig_callable") for m in (model, *model.get_submodule("floors"))]
    assert compiled == [False, True, True, True]
    torch._dynamo.reset()


def test_tensor_and_pipeline_parallel_refuse_a_spec_without_them(tower_cfg: TrainConfig, mesh: DeviceMesh) -> None:
    with pytest.raises(TypeError, match="Tower has no tp_plan"):
        tensor_parallel.parallelize(build_model(tower_cfg), mesh, tower_cfg)
    with pytest.raises(TypeError, match="Tower has no pipeline stages"):
        pipeline.split(build_model(tower_cfg), mesh, tower_cfg)


def test_the_transformer_spec_names_its_blocks() -> None:
    cfg = TrainConfig(model="transformer", n_layers=3)
    model = build_model(cfg)
    assert TRANSFORMER_SPEC.repeated_units(model) == list(model.get_submodule("blocks"))
    assert MLP_SPEC.repeated_units(build_model(TrainConfig())) == []


@pytest.mark.parametrize("name", list(models.SPECS))
def test_the_declared_capabilities_agree_with_the_spec(name: str) -> None:
    """The torch-free declaration the config checks and the spec the parallel code uses cannot drift."""
    caps, spec = MODEL_CAPABILITIES[name], models.SPECS[name]
    assert caps.tensor_parallel == (spec.tp_plan is not None)
    assert caps.pipeline == (spec.pipeline_stage is not None)
    assert caps.activation_checkpointing == bool(spec.repeated_units(spec.build(TrainConfig(model=name))))  # type: ignore[arg-type]


def test_every_spec_declares_its_capabilities() -> None:
    assert list(models.SPECS) == list(MODEL_CAPABILITIES)

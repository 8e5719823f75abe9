"""Pipeline parallelism (reference_impl.pipeline): the stages partition the model, and two
ranks fed micro-batches by GPipe or 1F1B train exactly the steps one process trains."""

from __future__ import annotations

import pytest
import torch

from launch import REPO, torchrun
from reference_impl.model import build_model
from reference_impl.pipeline import Stage, stage_layers, stage_parameters
from pp_driver import CFG


@pytest.mark.parametrize("n_layers,pp_degree", [(4, 2), (5, 2), (7, 3), (4, 4), (3, 1)])
def test_stages_cover_every_block_once_in_order(n_layers: int, pp_degree: int) -> None:
    blocks = [i for s in range(pp_degree) for i in stage_layers(n_layers, pp_degree, s)]
    sizes = [len(stage_layers(n_layers, pp_degree, s)) for s in range(pp_degree)]
    assert blocks == list(range(n_layers)) and max(sizes) - min(sizes) <= 1


def test_the_stages_partition_the_parameters() -> None:
    model = build_model(CFG)
    owned = [id(p) for s in range(3) for p in stage_parameters(Stage(model, s, 3))]
    assert sorted(owned) == sorted(id(p) for p in model.parameters()), "each parameter in exactly one stage"


def test_one_stage_is_the_whole_model() -> None:
    model = build_model(CFG)
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    assert torch.equal(Stage(model, 0, 1)(tokens), model(tokens))


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["gpipe", pytest.param("1f1b", marks=pytest.mark.slow)])
def test_two_stages_train_the_same_steps_as_one_process(schedule: str) -> None:
    run = torchrun([schedule, "4", "6"], module=str(REPO / "tests" / "distributed" / "pp_driver.py"), timeout=120)
    assert run.returncode == 0, run.stderr[-4000:]
    steps = [e for e in run.events if "pipeline" in e]
    assert [e["step"] for e in steps] == list(range(1, 7))
    worst = max(abs(e["pipeline"] - e["single"]) for e in steps)
    assert worst <= 1e-5, f"pipeline and single-process losses differ by up to {worst}"
    assert steps[-1]["single"] < steps[0]["single"], "and it learns"

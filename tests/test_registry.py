"""The registry of parallelisms declares what the trainer needs of each one, and the
declarations hold: the config's choices, the refusals, the checkpoint layouts, and the
trainer files that must not branch on a parallelism."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path
from typing import Any, get_args, get_type_hints

import pytest

from reference_impl.config import ConfigError, TrainConfig
from reference_impl.parallel.registry import PARALLELISMS, applied, checkpoint_layout, chosen, dims_of

ROOT = Path(__file__).resolve().parents[1] / "reference_impl"
# The flags that turn each registered parallelism on, on a 16-rank transformer run.
TURN_ON: dict[str, dict[str, Any]] = {
    "pp": {"pp_degree": 2}, "tp": {"tp_degree": 2}, "cp": {"cp_degree": 2, "cp_style": "ring"},
    "ulysses": {"cp_degree": 2, "cp_style": "ulysses"}, "ep": {"n_experts": 4, "ep_degree": 2},
    "ddp": {"strategy": "ddp"}, "fsdp": {"strategy": "fsdp"}}
BASE = {"model": "transformer", "world_size": 16, "micro_batch_size": 8, "n_layers": 4, "seq_len": 32,
        "dropout": 0.0}


def test_the_config_chooses_exactly_one_parallelism_per_axis() -> None:
    """Every value of `--strategy` and `--cp-style` picks one entry of its axis, and no
    configuration picks two entries that share an axis."""
    hints = get_type_hints(TrainConfig)
    for strategy, style in itertools.product(get_args(hints["strategy"]), get_args(hints["cp_style"])):
        cfg = TrainConfig(**{**BASE, "world_size": 2, "cp_degree": 2, "strategy": strategy, "cp_style": style})
        axes = [p.axis for p in chosen(cfg)]
        assert len(axes) == len(set(axes)), (strategy, style)
        assert {name for name, p in PARALLELISMS.items() if p in chosen(cfg)} >= {strategy}
        assert [p.wrap.__module__.rsplit(".", 1)[1] for p in chosen(cfg) if p.axis == "cp"] == \
            ["context_parallel" if style == "ring" else "ulysses"]
    assert {PARALLELISMS[n].axis for n in ("cp", "ulysses")} == {"cp"}


def test_every_declared_option_is_a_config_field() -> None:
    fields = set(TrainConfig.__dataclass_fields__)
    for name, parallelism in PARALLELISMS.items():
        assert set(parallelism.options) <= fields, name


@pytest.mark.parametrize(("a", "b"), [(a, b) for a, b in itertools.combinations(PARALLELISMS, 2)
                                      if PARALLELISMS[a].axis != PARALLELISMS[b].axis
                                      and not (PARALLELISMS[a].after_compile and PARALLELISMS[b].after_compile)])
def test_the_config_refuses_exactly_the_declared_combinations(a: str, b: str) -> None:
    """Two parallelisms turned on together (on FSDP2 unless one of them is DDP or needs
    it): the config refuses them if and only if one declares it refuses the other."""
    data = {} if {a, b} & {"ddp", "fsdp"} else {"strategy": "ddp" if "ep" in (a, b) else "fsdp"}
    declared = b in PARALLELISMS[a].refuses or a in PARALLELISMS[b].refuses
    try:
        cfg = TrainConfig(**{**BASE, **data, **TURN_ON[a], **TURN_ON[b]})
    except ConfigError:
        assert declared, f"{a} + {b} refused but not declared"
        return
    assert not declared, f"{a} + {b} declared refused but accepted"
    turned_on = {PARALLELISMS[n] for n in (a, b) if not PARALLELISMS[n].after_compile}
    assert turned_on <= set(applied(cfg, dims_of(cfg)))


@pytest.mark.parametrize(("flags", "layout"), [
    ({"strategy": "ddp"}, "torch_save"), ({"strategy": "fsdp"}, "dcp"),
    ({"strategy": "ddp", "cp_degree": 2}, "torch_save"), ({"strategy": "fsdp", "tp_degree": 2}, "dcp"),
    ({"strategy": "fsdp", "pp_degree": 2}, "dcp"), ({"strategy": "ddp", "n_experts": 4, "ep_degree": 2}, "dcp"),
    ({"strategy": "ddp", "n_experts": 4}, "torch_save")])
def test_the_checkpoint_layout_is_dcp_exactly_when_an_applied_parallelism_shards(flags: dict[str, Any],
                                                                                 layout: str) -> None:
    cfg = TrainConfig(**{**BASE, **flags})
    assert checkpoint_layout(cfg) == layout


def test_expert_parallel_replaces_the_data_parallel_wrapper_and_cp_joins_it() -> None:
    """Under expert parallel its own gradient sync averages the data ranks (no DDP); under
    context parallel the data-parallel wrapper runs even on one data rank (it averages the
    cp ranks' gradients)."""
    ep = TrainConfig(**{**BASE, "n_experts": 4, "ep_degree": 2})
    assert applied(ep, dims_of(ep)) == [PARALLELISMS["ep"]]
    cp = TrainConfig(**{**BASE, "world_size": 2, "cp_degree": 2})
    assert applied(cp, dims_of(cp)) == [PARALLELISMS["cp"], PARALLELISMS["ddp"]]


# The trainer's core files, which must reach every parallelism through the registry only.
CORE = ("train.py", "step.py", "parallel/mesh.py", "checkpoint/manager.py", "checkpoint/layouts.py")
# What a core file may import from `reference_impl.parallel`: the registry, the mesh, and
# the pipeline's stage step and the experts' load-balancing loss (model features the step
# computes whatever the mesh: a pipeline stage's step, a mixture-of-experts loss).
ALLOWED = {"reference_impl.parallel.registry", "reference_impl.parallel.mesh",
           "reference_impl.parallel.pipeline", "reference_impl.parallel.experts"}


@pytest.mark.parametrize("name", CORE)
def test_the_core_reaches_parallelisms_only_through_the_registry(name: str) -> None:
    """No core file imports a parallelism's module for its wrapping, or compares the
    strategy or a cp style by name."""
    tree = ast.parse((ROOT / name).read_text(encoding="utf-8"))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
                and node.module.startswith("reference_impl.parallel")}
    assert imported <= ALLOWED, imported - ALLOWED
    named = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Compare)
             and any(isinstance(side, ast.Attribute) and side.attr in ("strategy", "cp_style")
                     for side in (node.left, *node.comparators))]
    assert not named, named

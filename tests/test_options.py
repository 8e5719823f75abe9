"""The config's components: each validates its own fields alone, and together they are `TrainConfig`."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import subprocess
import sys
from typing import Any, get_args, get_type_hints

import pytest
from launch import REPO

from reference_impl.config import COMPONENTS, ConfigError, TrainConfig, build_parser, field_docs
from reference_impl.options.capabilities import MODEL_CAPABILITIES
from reference_impl.options.model import ExpertOptions, ModelOptions
from reference_impl.options.operations import CheckpointOptions, FaultOptions, RuntimeOptions
from reference_impl.options.parallel import ParallelOptions
from reference_impl.options.training import OptimizerOptions, PrecisionOptions, RunOptions

# One value per component that only that component's own check refuses, and the message.
OWN_ERRORS: list[tuple[type, dict[str, Any], str]] = [
    (ParallelOptions, {"tp_degree": 3, "world_size": 2}, "tp_degree (3) must divide the world size (2)"),
    (ParallelOptions, {"strategy": "zero3"}, "strategy must be one of ddp, fsdp"),
    (ExpertOptions, {"n_experts": -1}, "n_experts must be >= 0"),
    (ModelOptions, {"d_model": 60, "n_heads": 8}, "n_heads (8) must divide d_model (60)"),
    (RunOptions, {"micro_batch_size": 0}, "micro_batch_size must be >= 1"),
    (RunOptions, {"max_steps": 10**30}, f"max_steps must be at most 99999999 (got {10**30})"),
    # A ninth digit in step-NNNNNNNN: a checkpoint that is never restored and never pruned.
    (RunOptions, {"max_steps": 10**8}, "max_steps must be at most 99999999 (got 100000000): a checkpoint is named"),
    (PrecisionOptions, {"fp16_init_scale": 0.0}, "fp16_init_scale must be a positive finite number"),
    (OptimizerOptions, {"lr": math.nan}, "lr must be a positive finite number"),
    (RuntimeOptions, {"log_every": 0}, "log_every must be >= 1"),
    (CheckpointOptions, {"checkpoint_every": 10}, "checkpoint_every needs checkpoint_dir"),
    (CheckpointOptions, {"checkpoint_dir": ""}, "checkpoint_dir is empty; leave the flag out to run without one"),
    (RuntimeOptions, {"sample_log": ""}, "sample_log is empty; leave the flag out to run without one"),
    (FaultOptions, {"preempt_grace_s": -1.0}, "preempt_grace_s must be a positive finite number"),
    # Finite but past what the first use can hold: float32 math, a thread's wait.
    (OptimizerOptions, {"lr": 1e300}, "lr must be at most 3.40282e+38 (got 1e+300)"),
    (OptimizerOptions, {"weight_decay": 1e39}, "weight_decay must be at most 3.40282e+38 (got 1e+39)"),
    (PrecisionOptions, {"fp16_init_scale": 1e300}, "fp16_init_scale must be at most 3.40282e+38 (got 1e+300)"),
    (RuntimeOptions, {"pg_timeout_s": 1e300}, "pg_timeout_s must be at most 9.22337e+09 (got 1e+300)"),
    (FaultOptions, {"preempt_grace_s": 1e300}, "preempt_grace_s must be at most 9.22337e+09 (got 1e+300)"),
    (FaultOptions, {"step_timeout_s": 1e300}, "step_timeout_s must be at most 9.22337e+09 (got 1e+300)"),
]


@pytest.mark.parametrize("component,values,message", OWN_ERRORS)
def test_each_component_refuses_its_own_bad_values_alone(component: type, values: dict[str, Any],
                                                         message: str) -> None:
    """The check lives in the component: constructing it alone raises, and so does the whole config."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        component(**values)
    with pytest.raises(ConfigError, match=re.escape(message)):
        TrainConfig(**values)


def test_every_component_has_a_bad_value_tested_and_is_valid_by_default() -> None:
    assert {component for component, _, _ in OWN_ERRORS} == set(COMPONENTS)
    for component in COMPONENTS:
        component()


def test_the_config_is_exactly_its_components_fields_each_documented_in_the_help() -> None:
    """No field is declared outside a component, none twice, and each one's docstring is its flag's help."""
    names = [f.name for component in COMPONENTS for f in dataclasses.fields(component)]
    assert len(names) == len(set(names)) and set(names) == {f.name for f in dataclasses.fields(TrainConfig)}
    docs = field_docs()
    helps = {a.dest: a.help for a in build_parser()._actions}
    for name in names:
        if name != "world_size":  # comes from torchrun's environment, not a flag
            assert helps[name] == f"{docs[name]} (default: {getattr(TrainConfig(), name)})"


def test_the_model_names_are_the_ones_with_declared_capabilities() -> None:
    assert get_args(get_type_hints(ModelOptions)["model"]) == tuple(MODEL_CAPABILITIES)


def test_the_digest_of_old_configs_is_unchanged() -> None:
    """Checkpoints record the digest; a changed value would refuse to resume them."""
    assert TrainConfig().digest() == "103fce090762fe8abcc03dbe1a2f97011d73c11e5958855465c21ee58ff608be"
    cfg = TrainConfig(model="transformer", strategy="fsdp", tp_degree=2, world_size=4)
    assert cfg.digest() == "ec5751a75c126dcb42c75efea1f72b9ca52c8a233ee7a11150c9d7c2ed0be40f"


def test_the_config_imports_no_torch() -> None:
    """`--help` and a bad flag answer before torch's seconds of import."""
    code = ("import json, sys; import reference_impl.config;"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         check=True).stdout
    assert json.loads(out) == []

"""Training configuration: one dataclass composed of its components, with a stable digest.

Each component's options live in their own dataclass in `reference_impl.options`, which
validates its own fields when constructed; `TrainConfig` inherits them all, so every field is
still read as `cfg.name`, and adds only the checks that span components. The command line of
`python -m reference_impl.train` is generated from the fields: each becomes a kebab-case flag
and its docstring becomes the flag's help text, so the documentation and the CLI cannot drift
apart. Nothing here imports torch, so `--help` and a bad flag answer at once.
"""

# --8<-- [start:imports]
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
from dataclasses import dataclass, fields
from typing import Any, get_args, get_type_hints

# --8<-- [end:imports]
# --8<-- [start:package_imports]
from reference_impl.options.base import ConfigError, choices_of, class_field_docs, fail
from reference_impl.options.capabilities import models_with
from reference_impl.options.model import ExpertOptions, ModelOptions
from reference_impl.options.operations import (
    RESUMABLE_PARTS,
    SAVE_FAULTS,
    STRUCTURAL_FIELDS,
    CheckpointOptions,
    FaultOptions,
    RuntimeOptions,
)
from reference_impl.options.parallel import ParallelOptions
from reference_impl.options.training import OptimizerOptions, PrecisionOptions, RunOptions

# --8<-- [end:package_imports]


__all__ = ["OPERATIONAL_FIELDS", "RESUMABLE_PARTS", "STRUCTURAL_FIELDS", "ConfigError", "TrainConfig",
           "build_parser", "field_docs"]

# --8<-- [start:operational_fields]
# Fields that never change what a step computes: they may differ freely on resume. The
# micro-batch size and accumulation may change as long as the global batch does not
# (that is how a run moves to another world size). max_steps is not among them: the
# cosine schedule decays towards it, so changing it changes every later learning rate.
OPERATIONAL_FIELDS = ("micro_batch_size", "grad_accum_steps", "num_workers", "device",
                      "pg_timeout_s", "log_every", "activation_checkpointing", "fsdp_grad_sync",
                      "async_checkpoint", "checkpoint_dir", "checkpoint_every", "keep_last", "sample_log",
                      "allow_config_change", "step_timeout_s", "fail_at_step", "fail_rank",
                      "fail_mode", "resume_skip", "world_size", "preempt_grace_s", "tp_degree",
                      "pp_degree", "pp_microbatches", "pp_schedule", "pp_virtual_stages", "dp_replicate", "compile",
                      "deterministic", "cp_degree", "cp_style", "fail_slow_s", "straggler_threshold",
                      "straggler_window", "straggler_patience", "nonfinite_policy")
# Fields added after checkpoints began recording the digest: left out of it while at their
# default, so every config that could be written before they existed keeps its digest.
LATER_FIELDS = ("pp_virtual_stages", "cp_style", "fail_slow_s", "straggler_threshold", "straggler_window",
                "straggler_patience", "nonfinite_policy")
# --8<-- [end:operational_fields]


# --8<-- [start:train_config]
# The components in the order their fields (and the CLI's flags) come; dataclasses collect
# the fields of the bases in reverse, so the class statement lists them last to first.
COMPONENTS = (ParallelOptions, ExpertOptions, ModelOptions, RunOptions, PrecisionOptions, OptimizerOptions,
              RuntimeOptions, CheckpointOptions, FaultOptions)


@dataclass(frozen=True)
class TrainConfig(FaultOptions, CheckpointOptions, RuntimeOptions, OptimizerOptions, PrecisionOptions,
                  RunOptions, ModelOptions, ExpertOptions, ParallelOptions):
    """Everything that defines a training run. Invalid values raise `ConfigError`."""

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step across all ranks: M x G x data-parallel size."""
        return self.micro_batch_size * self.grad_accum_steps * self.data_parallel_size

    def is_checkpoint_step(self, step: int) -> bool:
        """True when the loop saves a checkpoint after `step` (always after the last step)."""
        if not self.checkpoint_dir:
            return False
        return step == self.max_steps or bool(self.checkpoint_every and step % self.checkpoint_every == 0)

    def resume_fields(self) -> dict[str, Any]:
        """The fields that must match a checkpoint's, plus the global batch size."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in OPERATIONAL_FIELDS}
        return {**values, "global_batch_size": self.global_batch_size}

    def digest_fields(self) -> dict[str, Any]:
        """The fields the digest covers: every field, `LATER_FIELDS` only away from their default."""
        defaults = {f.name: f.default for f in fields(self)}
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in LATER_FIELDS or v != defaults[k]}

    def digest(self) -> str:
        """sha256 of the canonical JSON of `digest_fields`: equal in every process and run."""
        canonical = json.dumps(self.digest_fields(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def validate(self) -> None:
        """Each component's own checks, then the ones that need two components."""
        for component in COMPONENTS:
            component.validate(self)
        self._check_model_supports()
        self._check_parallel_fits_model()
        self._check_experts()
        self._check_run_plan()
    # --8<-- [end:train_config]

    def _check_model_supports(self) -> None:
        """Every feature asked for is one the model declares (`MODEL_CAPABILITIES`)."""
        caps = self.capabilities
        if self.tp_degree > 1 and not caps.tensor_parallel:
            fail(f"tp_degree above 1 needs --model {models_with('tensor_parallel')} "
                 "(the model with a tensor-parallel plan)")
        if self.pp_degree > 1 and not caps.pipeline:
            fail(f"pp_degree above 1 needs --model {models_with('pipeline')} (the model cut into stages of blocks)")
        if self.cp_degree > 1 and (not caps.context_parallel or self.dropout):
            fail(f"cp_degree above 1 needs --model {models_with('context_parallel')} with dropout 0 "
                 "(context-parallel attention has no dropout)")
        if self.n_experts and not caps.experts:
            fail(f"n_experts needs --model {models_with('experts')} (the model whose MLPs become experts)")
        if self.activation_checkpointing and not caps.activation_checkpointing:
            fail(f"activation_checkpointing needs --model {models_with('activation_checkpointing')} "
                 "(it recomputes blocks)")
        if self.fp8 and not caps.fp8:
            fail(f"fp8 needs --model {models_with('fp8')} (the model whose linears it swaps)")

    def _check_parallel_fits_model(self) -> None:
        """Every split dimension divides, every stage gets a block, every piece is equal."""
        for name in ("n_heads", "hidden_dim", "vocab_size", "seq_len"):
            if self.tp_degree > 1 and getattr(self, name) % self.tp_degree:
                fail(f"tp_degree ({self.tp_degree}) must divide {name} ({getattr(self, name)}): "
                     "tensor parallel splits it evenly")
        if self.pp_degree > 1:
            if self.pp_degree > self.n_layers:
                fail(f"pp_degree ({self.pp_degree}) must not exceed n_layers ({self.n_layers}): "
                     "every stage needs at least one block")
            stages = self.pp_degree * self.virtual_stages
            if self.pp_schedule == "interleaved-1f1b" and self.n_layers % stages:
                fail(f"n_layers ({self.n_layers}) must be a multiple of pp_degree x pp_virtual_stages ({stages}) "
                     "under interleaved-1f1b: every stage holds as many blocks")
            if self.micro_batch_size % self.pipeline_microbatches:
                fail(f"pp_microbatches ({self.pipeline_microbatches}) must divide micro_batch_size "
                     f"({self.micro_batch_size}): unequal pieces would weight samples unequally in the mean loss")
            if self.precision == "fp16":
                fail("pp_degree above 1 needs --precision fp32 or bf16: fp16's loss scaler would have to "
                     "agree on overflow across stages")
        if self.cp_degree > 1:
            if self.seq_len % (2 * self.cp_degree):
                fail(f"2 x cp_degree ({2 * self.cp_degree}) must divide seq_len ({self.seq_len})")
            if self.compile:
                fail("cp_degree above 1 runs without --compile (context-parallel attention is not tested compiled)")
            if self.cp_style == "ulysses" and self.n_heads % self.cp_degree:
                fail(f"cp_style ulysses needs cp_degree ({self.cp_degree}) to divide n_heads ({self.n_heads}): "
                     "each cp rank attends with whole heads")
        if self.fp8 and self.tp_degree > 1:
            fail("fp8 does not combine with tp_degree above 1 (its matmul takes plain tensors, not DTensors)")
        if self.compile and self.pp_degree > 1:
            fail("compile does not combine with pp_degree above 1 (pipeline stages run eagerly)")

    def _check_experts(self) -> None:
        """Mixture-of-experts blocks split over the expert-parallel ranks, on their own."""
        if self.ep_degree > 1 and not self.n_experts:
            fail("ep_degree above 1 needs --n-experts (the experts it splits)")
        if not self.n_experts:
            return
        if self.n_experts % self.ep_degree:
            fail(f"ep_degree ({self.ep_degree}) must divide n_experts ({self.n_experts})")
        if self.tp_degree > 1 or self.pp_degree > 1 or self.cp_degree > 1 or self.dp_replicate > 1:
            fail("n_experts runs with tp_degree, pp_degree, cp_degree and dp_replicate 1 "
                 "(only data parallel or expert parallel is combined with it here)")
        if self.compile or self.fp8 or self.activation_checkpointing:
            fail("n_experts runs without --compile, --fp8 and --activation-checkpointing (not tested with them)")

    def _check_run_plan(self) -> None:
        """The schedule, the batch, the checkpoints and the injected faults fit the run."""
        if self.warmup_steps > self.max_steps:
            fail(f"warmup_steps ({self.warmup_steps}) must not exceed max_steps ({self.max_steps})")
        if self.dataset_size < self.global_batch_size:
            fail(f"dataset_size ({self.dataset_size}) is smaller than one global batch "
                 f"({self.global_batch_size} = micro_batch_size x grad_accum_steps x data-parallel size)")
        if self.async_checkpoint and self.strategy != "fsdp":
            fail("async_checkpoint needs --strategy fsdp (DDP checkpoints are written with torch.save)")
        for step in self.fail_at_step:
            if not 1 <= step <= self.max_steps:
                fail(f"fail_at_step must be in [1, max_steps] (got {step})")
            if self.fail_mode in SAVE_FAULTS and not self.is_checkpoint_step(step):
                fail(f"fail_mode {self.fail_mode} needs fail_at_step on a checkpoint step (got {step})")
        for name in self.allow_config_change:
            if name not in {f.name for f in fields(self)}:
                fail(f"allow_config_change names an unknown field {name!r}")
        if self.fail_rank >= self.world_size:
            fail(f"fail_rank ({self.fail_rank}) must be < world_size ({self.world_size})")
        self._check_nonfinite_plan()

    def _check_nonfinite_plan(self) -> None:
        """The non-finite policy and the nan fault have what they need."""
        if self.nonfinite_policy == "rollback" and not self.checkpoint_dir:
            fail("nonfinite_policy rollback needs checkpoint_dir (the checkpoint it rolls back to)")
        if self.precision == "fp16" and (self.nonfinite_policy != "stop" or self.fail_mode == "nan"):
            fail("nonfinite_policy skip or rollback and fail_mode nan need --precision fp32 or bf16: "
                 "under fp16 the GradScaler skips non-finite steps itself")
        if self.pp_degree > 1 and (self.nonfinite_policy != "stop" or self.fail_mode == "nan"):
            fail("nonfinite_policy skip or rollback and fail_mode nan need pp_degree 1 "
                 "(the stages of a pipeline do not replay a step's forward)")

    @classmethod
    def from_cli(cls, argv: list[str] | None = None, environ: dict[str, str] | None = None) -> TrainConfig:
        """Build a config from command-line flags and torchrun's environment.

        Args:
            argv: Flags without the program name; defaults to `sys.argv[1:]`.
            environ: Environment to read `WORLD_SIZE` from; defaults to `os.environ`.

        Raises:
            ConfigError: A flag is unknown, malformed or inconsistent with the others.
        """
        env = os.environ if environ is None else environ
        namespace = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
        values = {k: v for k, v in vars(namespace).items() if v is not None}
        try:
            values["world_size"] = int(env.get("WORLD_SIZE", "1"))
        except ValueError:
            fail(f"WORLD_SIZE must be an integer (got {env['WORLD_SIZE']!r})")
        return cls(**values)


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one `ConfigError` line instead of usage text."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser generated from the fields of `TrainConfig`."""
    parser = OneLineParser(prog="python -m reference_impl.train",
                           description="Train the reference model with DDP or FSDP2 (run under torchrun).")
    hints = get_type_hints(TrainConfig)
    docs = field_docs()
    for f in fields(TrainConfig):
        if f.name == "world_size":
            continue
        flag = "--" + f.name.replace("_", "-")
        choices = choices_of(TrainConfig, f.name)
        help_text = f"{docs.get(f.name, '')} (default: {f.default})"
        if hints[f.name] is bool:
            parser.add_argument(flag, dest=f.name, action="store_true", default=None, help=help_text)
            continue
        kind = _parse_list(hints[f.name]) or {int: int, float: float}.get(_base_type(hints[f.name]), str)
        parser.add_argument(flag, dest=f.name, type=kind, choices=choices, default=None, help=help_text)
    return parser


def field_docs() -> dict[str, str]:
    """Map each `TrainConfig` field to the docstring written under it in its component's source."""
    docs: dict[str, str] = {}
    for component in COMPONENTS:
        docs.update(class_field_docs(component))
    return docs


def _parse_list(hint: Any) -> Any:
    """For tuple fields, a parser of comma-separated values; None for other fields."""
    if getattr(hint, "__origin__", None) is not tuple:
        return None
    item = get_args(hint)[0]

    def parse(text: str) -> tuple[Any, ...]:
        return tuple(item(part) for part in text.split(",") if part.strip())
    parse.__name__ = f"comma-separated {item.__name__} list"
    return parse


def _base_type(hint: Any) -> Any:
    args = [a for a in get_args(hint) if a is not type(None)]
    if args and all(isinstance(a, str) for a in args):
        return str
    return args[0] if args else hint

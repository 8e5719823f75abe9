"""The options that never change what a step computes: where it runs, how it is observed,
checkpointed, and failed on purpose."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal

from reference_impl.options.base import (
    Options,
    at_least,
    check_choices,
    fail,
    finite_non_negative,
    positive_finite,
    short_path_parts,
)

RESUMABLE_PARTS = ("rng", "data", "scheduler", "scaler")
SAVE_FAULTS = ("crash-mid-write", "crash-before-publish", "write-error")
# Fields that decide tensor shapes or the data order: no flag can allow changing them.
STRUCTURAL_FIELDS = ("model", "strategy", "optimizer", "input_dim", "hidden_dim", "num_classes",
                     "vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "n_experts", "dataset_size", "seed")


@dataclass(frozen=True)
class RuntimeOptions(Options):
    """How each step executes (recompute, compile, kernels, device) and is logged."""

    activation_checkpointing: bool = False
    """Recompute each transformer block in the backward pass instead of storing activations."""
    compile: bool = False
    """Compile each transformer block's forward (the MLP's whole forward) with torch.compile
    (inductor); hooks, parameter names and checkpoints stay those of the eager model. The
    first steps pay the compile time."""
    deterministic: bool = False
    """Deterministic kernels (torch.use_deterministic_algorithms, a fixed cuBLAS workspace):
    on a GPU the only way two runs, or a run and its resume, agree bit for bit; slower."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto picks CUDA + NCCL when a GPU is visible, else CPU + gloo."""
    pg_timeout_s: float = 120.0
    """Timeout of every collective; a hung peer fails the job after this long."""
    log_every: int = 10
    """Emit a progress event (and sync the device) every this many steps."""
    sample_log: str | None = None
    """Directory where each rank appends the dataset indices of every committed step."""

    def validate(self) -> None:
        """A known device, a usable collective timeout and log interval, a valid path."""
        check_choices(self, RuntimeOptions)
        at_least(self, 1, "log_every")
        positive_finite(self, "pg_timeout_s", most=threading.TIMEOUT_MAX)
        short_path_parts(self, "sample_log")


@dataclass(frozen=True)
class CheckpointOptions(Options):
    """Where and how often checkpoints are written, and what a resume may change or skip."""

    async_checkpoint: bool = False
    """FSDP: write checkpoints in the background on a separate gloo group."""
    checkpoint_dir: str | None = None
    """Directory for step-NNNNNNNN checkpoints; the newest valid one is resumed."""
    checkpoint_every: int = 0
    """Save every this many steps; 0 saves only at the end (when checkpoint_dir is set)."""
    keep_last: int = 2
    """Number of published checkpoints to retain."""
    allow_config_change: tuple[str, ...] = ()
    """Fields that may differ from the checkpoint's config on resume (e.g. lr,warmup_steps)."""
    resume_skip: tuple[str, ...] = ()
    """Demonstration only: leave these parts out of the restore (rng,data,scheduler,scaler)."""

    def validate(self) -> None:
        """A directory to save into, retention, and resume exceptions that can be honoured."""
        at_least(self, 0, "checkpoint_every")
        at_least(self, 1, "keep_last")
        short_path_parts(self, "checkpoint_dir")
        if self.checkpoint_every and not self.checkpoint_dir:
            fail("checkpoint_every needs checkpoint_dir")
        for part in self.resume_skip:
            if part not in RESUMABLE_PARTS:
                fail(f"resume_skip entries must be among {', '.join(RESUMABLE_PARTS)} (got {part!r})")
        for name in self.allow_config_change:
            if name in STRUCTURAL_FIELDS:
                fail(f"{name} decides tensor shapes or the data order and cannot change on resume")


@dataclass(frozen=True)
class FaultOptions(Options):
    """The watchdog, preemption, the faults a test injects, and how stragglers and non-finite
    losses are caught."""

    step_timeout_s: float = 0.0
    """Watchdog: fail the job if no step completes for this long; 0 disables it."""
    fail_at_step: tuple[int, ...] = ()
    """Fault injection: on restart attempt i, fail at step fail_at_step[i] (comma-separated)."""
    fail_rank: int = 0
    """Fault injection: the rank that fails."""
    fail_mode: Literal["sigkill", "sigterm", "hang", "crash-mid-write", "crash-before-publish",
                       "write-error", "slow", "nan"] = "sigkill"
    """Fault injection: SIGKILL or SIGTERM before the step, hang before it, fail while saving that
    step, sleep before it and every later step (slow), or turn an activation non-finite in it (nan)."""
    fail_slow_s: float = 0.2
    """Fault injection, fail_mode slow: seconds the failing rank sleeps before each step from
    fail_at_step on."""
    straggler_threshold: float = 2.0
    """A rank is slow in a window when the median of its step times (outside the gradient sync)
    is at least this many times the median of the other ranks'."""
    straggler_window: int = 5
    """Steps per straggler check: each check is one all_gather of every rank's step times."""
    straggler_patience: int = 3
    """Consecutive slow windows before a rank is reported as a straggler (once per run)."""
    nonfinite_policy: Literal["stop", "skip", "rollback"] = "stop"
    """What a non-finite loss on any rank does: stop the run (exit 1, nothing poisoned is
    saved), skip the step's update on every rank, or roll back to the last checkpoint."""
    preempt_grace_s: float = 25.0
    """On SIGTERM, save a checkpoint at the next step boundary and exit with status 75; if
    that takes longer than this many seconds, exit with status 1 (the last published
    checkpoint stands). Keep it below the scheduler's kill delay (torchrun: 30 s)."""

    def validate(self) -> None:
        """A known fault and policy, a rank index, usable timeouts and straggler bounds."""
        check_choices(self, FaultOptions)
        at_least(self, 0, "fail_rank")
        at_least(self, 1, "straggler_window", "straggler_patience")
        positive_finite(self, "fail_slow_s", most=3600.0)
        positive_finite(self, "straggler_threshold")
        if self.straggler_threshold <= 1:
            fail(f"straggler_threshold must be above 1 (got {self.straggler_threshold}): "
                 "a rank is slow when it takes longer than the others")
        positive_finite(self, "preempt_grace_s", most=threading.TIMEOUT_MAX)
        finite_non_negative(self, "step_timeout_s", most=threading.TIMEOUT_MAX)

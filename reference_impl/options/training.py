"""The options of the optimization itself: steps and batches, the optimizer, the precision."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from reference_impl.options.base import Options, at_least, check_choices, fail, finite_non_negative, positive_finite

# torch accepts seeds up to 2**64 - 1, and the sampler seeds each epoch with
# seed * SEED_STRIDE + epoch: the largest valid seed depends on how many epochs can run.
TORCH_SEED_MAX = 2**64 - 1
# --8<-- [start:seed_stride]
SEED_STRIDE = 1_000_003
# --8<-- [end:seed_stride]
# A checkpoint directory is `step-` and eight digits (DESIGN.md's checkpoint contract): a
# ninth digit would name a directory that restore never lists, so never resumes or prunes.
MAX_STEPS = 10**8 - 1
MAX_NUM_WORKERS = 64


@dataclass(frozen=True)
class RunOptions(Options):
    """How long the run is, how many samples a step takes, and the data they come from."""

    max_steps: int = 200
    """Optimizer steps to run in total, counted across restarts."""
    micro_batch_size: int = 32
    """Samples per rank per forward/backward pass."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimizer step; gradients sync only on the last."""
    seed: int = 0
    """Seeds model initialisation, data generation and the sampler's shuffles."""
    dataset_size: int = 4096
    """Number of synthetic samples generated from the seed."""
    num_workers: int = 0
    """DataLoader worker processes per rank."""

    def validate(self) -> None:
        """Positive counts, and a seed the sampler can still offset by every epoch."""
        at_least(self, 1, "max_steps", "micro_batch_size", "grad_accum_steps", "dataset_size")
        at_least(self, 0, "num_workers", "seed")
        if self.max_steps > MAX_STEPS:  # also keeps every seed below within torch's 64 bits
            fail(f"max_steps must be at most {MAX_STEPS} (got {self.max_steps}): a checkpoint is named "
                 "step- and eight digits")
        max_seed = (TORCH_SEED_MAX - self.max_steps) // SEED_STRIDE  # an epoch takes >= 1 step
        if self.seed > max_seed:
            fail(f"seed must be in [0, {max_seed}] (got {self.seed}): the sampler seeds torch with "
                 f"seed x {SEED_STRIDE} + epoch, which must stay below 2**64")
        if self.num_workers > MAX_NUM_WORKERS:
            fail(f"num_workers must be <= {MAX_NUM_WORKERS} per rank (got {self.num_workers})")


@dataclass(frozen=True)
class PrecisionOptions(Options):
    """The dtypes the forward and backward run in."""

    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Autocast dtype for forward and loss. fp16 adds a GradScaler; bf16 needs none."""
    fp16_init_scale: float = 65536.0
    """fp16 only: the GradScaler's first loss scale; it halves on every overflow."""
    fp8: bool = False
    """Transformer: run every Linear whose dimensions are multiples of 16 in float8 (e4m3
    inputs and weights, e5m2 gradients, per-tensor dynamic scales); weights stay full precision."""

    def validate(self) -> None:
        """A known autocast dtype and a usable first loss scale."""
        check_choices(self, PrecisionOptions)
        positive_finite(self, "fp16_init_scale")


@dataclass(frozen=True)
class OptimizerOptions(Options):
    """The optimizer, its learning-rate schedule and its regularization."""

    optimizer: Literal["adamw", "sgd"] = "adamw"
    """Optimizer. Plain SGD makes parameter-level equivalence tests exact."""
    lr: float = 3e-3
    """Peak learning rate, reached after warmup."""
    min_lr_ratio: float = 0.1
    """The cosine schedule decays to lr * min_lr_ratio at max_steps."""
    warmup_steps: int = 10
    """Linear warmup length in optimizer steps."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW) or L2 penalty (SGD)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""

    def validate(self) -> None:
        """A known optimizer and a schedule that stays in range."""
        check_choices(self, OptimizerOptions)
        at_least(self, 0, "warmup_steps")
        positive_finite(self, "lr")
        finite_non_negative(self, "weight_decay", "grad_clip")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            fail(f"min_lr_ratio must be in [0, 1] (got {self.min_lr_ratio})")

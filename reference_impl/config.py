"""Training configuration: one dataclass, validated on construction, with a stable digest.

The command line of `python -m reference_impl.train` is generated from the fields of
[`TrainConfig`][reference_impl.config.TrainConfig]: each field becomes a kebab-case flag
and its docstring becomes the flag's help text, so the documentation and the CLI cannot
drift apart.
"""

# --8<-- [start:imports]
from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import inspect
import json
import math
import os
import sys
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args, get_type_hints

# --8<-- [end:imports]

STRATEGIES = ("ddp", "fsdp")
MODELS = ("mlp", "transformer")
PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adamw", "sgd")
DEVICES = ("auto", "cpu", "cuda")
FAIL_MODES = ("sigkill", "sigterm", "hang", "crash-mid-write", "crash-before-publish", "write-error")
SAVE_FAULTS = ("crash-mid-write", "crash-before-publish", "write-error")
RESUMABLE_PARTS = ("rng", "data", "scheduler", "scaler")
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
                      "pp_degree", "pp_microbatches", "pp_schedule", "dp_replicate", "compile",
                      "deterministic", "cp_degree")
# --8<-- [end:operational_fields]
# Fields that decide tensor shapes or the data order: no flag can allow changing them.
STRUCTURAL_FIELDS = ("model", "strategy", "optimizer", "input_dim", "hidden_dim", "num_classes",
                     "vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "n_experts", "dataset_size", "seed")
# torch accepts seeds up to 2**64 - 1, and the sampler seeds each epoch with
# seed * SEED_STRIDE + epoch: the largest valid seed depends on how many epochs can run.
TORCH_SEED_MAX = 2**64 - 1
SEED_STRIDE = 1_000_003
MAX_NUM_WORKERS = 64
NAME_MAX = 255  # bytes per path component on Linux file systems


class ConfigError(ValueError):
    """A flag or a combination of flags that cannot describe a valid run."""


# --8<-- [start:train_config]
@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a training run. Invalid values raise `ConfigError`."""

    strategy: Literal["ddp", "fsdp"] = "ddp"
    """How the data-parallel ranks wrap the model: DDP replicates it, FSDP2 shards it."""
    dp_replicate: int = 1
    """HSDP (--strategy fsdp): FSDP2 shards within groups of data-parallel size / dp_replicate
    ranks and replicates across this many groups (gradients all-reduced between them)."""
    tp_degree: int = 1
    """Tensor-parallel ranks per model replica (transformer only): each splits every matmul
    and reads the same samples; the world size must be a multiple of it."""
    cp_degree: int = 1
    """Context-parallel ranks per model replica (transformer, dropout 0): each holds 2 of
    2 x cp_degree chunks of every sequence, ring attention passes keys and values between
    them, and they read the same samples; the world size must be a multiple of it."""
    n_experts: int = 0
    """Transformer: with E > 0 every block's MLP is a mixture of E experts (top-2 routing, top-1
    with one expert; capacity factor 1.25: a token over an expert's capacity skips it)."""
    ep_degree: int = 1
    """Expert-parallel ranks (needs n_experts, a multiple of it, and the world size equal to it):
    each holds n_experts / ep_degree experts, all-to-all sends it their tokens, and the ranks
    read the same samples."""
    moe_aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss (n_experts x sum_i f_i x P_i per block) added to the
    training loss when n_experts > 0."""
    pp_degree: int = 1
    """Pipeline stages per model replica (transformer only): the blocks are cut into this many
    consecutive stages, one per rank, and the ranks of one pipeline read the same samples."""
    pp_microbatches: int = 0
    """Pipeline micro-batches M each micro-batch is split into: at least pp_degree (0 means
    pp_degree); more shrink each stage's idle share (pp_degree-1)/(M+pp_degree-1)."""
    pp_schedule: Literal["gpipe", "1f1b"] = "1f1b"
    """Pipeline order: GPipe runs every forward, then every backward; 1F1B alternates them
    once the pipeline is full, so fewer activations are held (the same idle share)."""
    model: Literal["mlp", "transformer"] = "mlp"
    """Which synthetic task and model to train."""
    max_steps: int = 200
    """Optimizer steps to run in total, counted across restarts."""
    micro_batch_size: int = 32
    """Samples per rank per forward/backward pass."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimizer step; gradients sync only on the last."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Autocast dtype for forward and loss. fp16 adds a GradScaler; bf16 needs none."""
    fp16_init_scale: float = 65536.0
    """fp16 only: the GradScaler's first loss scale; it halves on every overflow."""
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
    seed: int = 0
    """Seeds model initialisation, data generation and the sampler's shuffles."""
    dataset_size: int = 4096
    """Number of synthetic samples generated from the seed."""
    num_workers: int = 0
    """DataLoader worker processes per rank."""
    input_dim: int = 32
    """MLP: input features."""
    hidden_dim: int = 128
    """MLP hidden width and transformer MLP width."""
    num_classes: int = 10
    """MLP: output classes."""
    vocab_size: int = 64
    """Transformer: vocabulary size."""
    seq_len: int = 32
    """Transformer: tokens per training sequence."""
    d_model: int = 64
    """Transformer: residual stream width."""
    n_layers: int = 2
    """Transformer: number of blocks (the units FSDP shards and checkpointing recomputes)."""
    n_heads: int = 4
    """Transformer: attention heads; must divide d_model."""
    dropout: float = 0.0
    """Transformer: dropout probability (exercises RNG state on resume)."""
    activation_checkpointing: bool = False
    """Recompute each transformer block in the backward pass instead of storing activations."""
    fp8: bool = False
    """Transformer: run every Linear whose dimensions are multiples of 16 in float8 (e4m3
    inputs and weights, e5m2 gradients, per-tensor dynamic scales); weights stay full precision."""
    compile: bool = False
    """Compile each transformer block's forward (the MLP's whole forward) with torch.compile
    (inductor); hooks, parameter names and checkpoints stay those of the eager model. The
    first steps pay the compile time."""
    deterministic: bool = False
    """Deterministic kernels (torch.use_deterministic_algorithms, a fixed cuBLAS workspace):
    on a GPU the only way two runs, or a run and its resume, agree bit for bit; slower."""
    fsdp_grad_sync: Literal["last", "every"] = "last"
    """FSDP with accumulation: reduce-scatter on the last micro-batch only (less traffic,
    unsharded gradients held in memory) or on every micro-batch (sharded, more traffic)."""
    async_checkpoint: bool = False
    """FSDP: write checkpoints in the background on a separate gloo group."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto picks CUDA + NCCL when a GPU is visible, else CPU + gloo."""
    pg_timeout_s: float = 120.0
    """Timeout of every collective; a hung peer fails the job after this long."""
    log_every: int = 10
    """Emit a progress event (and sync the device) every this many steps."""
    checkpoint_dir: str | None = None
    """Directory for step-NNNNNNNN checkpoints; the newest valid one is resumed."""
    checkpoint_every: int = 0
    """Save every this many steps; 0 saves only at the end (when checkpoint_dir is set)."""
    keep_last: int = 2
    """Number of published checkpoints to retain."""
    sample_log: str | None = None
    """Directory where each rank appends the dataset indices of every committed step."""
    allow_config_change: tuple[str, ...] = ()
    """Fields that may differ from the checkpoint's config on resume (e.g. lr,warmup_steps)."""
    step_timeout_s: float = 0.0
    """Watchdog: fail the job if no step completes for this long; 0 disables it."""
    fail_at_step: tuple[int, ...] = ()
    """Fault injection: on restart attempt i, fail at step fail_at_step[i] (comma-separated)."""
    fail_rank: int = 0
    """Fault injection: the rank that fails."""
    fail_mode: Literal["sigkill", "sigterm", "hang", "crash-mid-write", "crash-before-publish",
                       "write-error"] = "sigkill"
    """Fault injection: SIGKILL or SIGTERM before the step, hang before it, or fail while saving that step."""
    resume_skip: tuple[str, ...] = ()
    """Demonstration only: leave these parts out of the restore (rng,data,scheduler,scaler)."""
    preempt_grace_s: float = 25.0
    """On SIGTERM, save a checkpoint at the next step boundary and exit with status 75; if
    that takes longer than this many seconds, exit with status 1 (the last published
    checkpoint stands). Keep it below the scheduler's kill delay (torchrun: 30 s)."""
    world_size: int = 1
    """Number of processes; read from torchrun's WORLD_SIZE, not a flag."""

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step across all ranks: M x G x data-parallel size."""
        return self.micro_batch_size * self.grad_accum_steps * self.data_parallel_size

    @property
    def data_parallel_size(self) -> int:
        """Ranks that read different samples: the world size over the tensor and pipeline degrees."""
        return self.world_size // (self.tp_degree * self.pp_degree * self.cp_degree * self.ep_degree)

    @property
    def pipeline_microbatches(self) -> int:
        """Pipeline micro-batches per micro-batch: `pp_microbatches`, or `pp_degree` for 0."""
        return self.pp_microbatches or self.pp_degree

    def is_checkpoint_step(self, step: int) -> bool:
        """True when the loop saves a checkpoint after `step` (always after the last step)."""
        if not self.checkpoint_dir:
            return False
        return step == self.max_steps or bool(self.checkpoint_every and step % self.checkpoint_every == 0)

    def resume_fields(self) -> dict[str, Any]:
        """The fields that must match a checkpoint's, plus the global batch size."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in OPERATIONAL_FIELDS}
        return {**values, "global_batch_size": self.global_batch_size}

    def digest(self) -> str:
        """sha256 of the canonical JSON of every field: equal in every process and run."""
        canonical = json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()
    # --8<-- [end:train_config]

    def __post_init__(self) -> None:
        for f in fields(self):
            choices = _choices(f.name)
            if choices and getattr(self, f.name) not in choices:
                _fail(f"{f.name} must be one of {', '.join(choices)} (got {getattr(self, f.name)!r})")
        for name in ("max_steps", "micro_batch_size", "grad_accum_steps", "dataset_size",
                     "input_dim", "hidden_dim", "num_classes", "vocab_size", "seq_len",
                     "d_model", "n_layers", "n_heads", "log_every", "keep_last", "world_size", "tp_degree",
                     "pp_degree", "dp_replicate", "cp_degree", "ep_degree"):
            if getattr(self, name) < 1:
                _fail(f"{name} must be >= 1 (got {getattr(self, name)})")
        for name in ("warmup_steps", "num_workers", "checkpoint_every", "seed", "fail_rank", "pp_microbatches",
                     "n_experts"):
            if getattr(self, name) < 0:
                _fail(f"{name} must be >= 0 (got {getattr(self, name)})")
        for name in ("lr", "pg_timeout_s", "fp16_init_scale", "preempt_grace_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                _fail(f"{name} must be a positive finite number (got {value})")
        for name in ("weight_decay", "grad_clip", "moe_aux_loss_coef"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                _fail(f"{name} must be a finite number >= 0 (got {value})")
        max_seed = (TORCH_SEED_MAX - self.max_steps) // SEED_STRIDE  # an epoch takes >= 1 step
        if self.seed > max_seed:
            _fail(f"seed must be in [0, {max_seed}] (got {self.seed}): the sampler seeds torch with "
                  f"seed x {SEED_STRIDE} + epoch, which must stay below 2**64")
        if self.num_workers > MAX_NUM_WORKERS:
            _fail(f"num_workers must be <= {MAX_NUM_WORKERS} per rank (got {self.num_workers})")
        for name in ("checkpoint_dir", "sample_log"):
            path = getattr(self, name)
            if path and any(len(part.encode()) > NAME_MAX for part in path.split(os.sep)):
                _fail(f"{name} has a path component longer than {NAME_MAX} bytes")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            _fail(f"min_lr_ratio must be in [0, 1] (got {self.min_lr_ratio})")
        if not 0.0 <= self.dropout < 1.0:
            _fail(f"dropout must be in [0, 1) (got {self.dropout})")
        if self.warmup_steps > self.max_steps:
            _fail(f"warmup_steps ({self.warmup_steps}) must not exceed max_steps ({self.max_steps})")
        if self.d_model % self.n_heads:
            _fail(f"n_heads ({self.n_heads}) must divide d_model ({self.d_model})")
        self._check_tensor_parallel()
        self._check_pipeline()
        self._check_replicas()
        self._check_context_parallel()
        self._check_experts()
        if self.dataset_size < self.global_batch_size:
            _fail(f"dataset_size ({self.dataset_size}) is smaller than one global batch "
                  f"({self.global_batch_size} = micro_batch_size x grad_accum_steps x data-parallel size)")
        if self.activation_checkpointing and self.model != "transformer":
            _fail("activation_checkpointing needs --model transformer (it recomputes blocks)")
        if self.fp8 and self.model != "transformer":
            _fail("fp8 needs --model transformer (the model whose linears it swaps)")
        if self.fp8 and self.tp_degree > 1:
            _fail("fp8 does not combine with tp_degree above 1 (its matmul takes plain tensors, not DTensors)")
        if self.compile and self.pp_degree > 1:
            _fail("compile does not combine with pp_degree above 1 (pipeline stages run eagerly)")
        if self.fsdp_grad_sync == "every" and self.strategy != "fsdp":
            _fail("fsdp_grad_sync every needs --strategy fsdp (DDP always syncs on the last micro-batch)")
        if self.async_checkpoint and self.strategy != "fsdp":
            _fail("async_checkpoint needs --strategy fsdp (DDP checkpoints are written with torch.save)")
        if self.checkpoint_every and not self.checkpoint_dir:
            _fail("checkpoint_every needs checkpoint_dir")
        for step in self.fail_at_step:
            if not 1 <= step <= self.max_steps:
                _fail(f"fail_at_step must be in [1, max_steps] (got {step})")
            if self.fail_mode in SAVE_FAULTS and not self.is_checkpoint_step(step):
                _fail(f"fail_mode {self.fail_mode} needs fail_at_step on a checkpoint step (got {step})")
        if self.step_timeout_s < 0 or not math.isfinite(self.step_timeout_s):
            _fail(f"step_timeout_s must be a finite number >= 0 (got {self.step_timeout_s})")
        for part in self.resume_skip:
            if part not in RESUMABLE_PARTS:
                _fail(f"resume_skip entries must be among {', '.join(RESUMABLE_PARTS)} (got {part!r})")
        for name in self.allow_config_change:
            if name in STRUCTURAL_FIELDS:
                _fail(f"{name} decides tensor shapes or the data order and cannot change on resume")
            if name not in {f.name for f in fields(self)}:
                _fail(f"allow_config_change names an unknown field {name!r}")
        if self.fail_rank >= self.world_size:
            _fail(f"fail_rank ({self.fail_rank}) must be < world_size ({self.world_size})")

    def _check_tensor_parallel(self) -> None:
        """The mesh dp x tp must cover the world, and every split dimension must divide."""
        if self.tp_degree == 1:
            return
        if self.world_size % self.tp_degree:
            _fail(f"tp_degree ({self.tp_degree}) must divide the world size ({self.world_size}): "
                  "the ranks form a data-parallel x tensor-parallel mesh")
        if self.model != "transformer":
            _fail("tp_degree above 1 needs --model transformer (the model with a tensor-parallel plan)")
        for name in ("n_heads", "hidden_dim", "vocab_size", "seq_len"):
            if getattr(self, name) % self.tp_degree:
                _fail(f"tp_degree ({self.tp_degree}) must divide {name} ({getattr(self, name)}): "
                      "tensor parallel splits it evenly")
        if self.strategy == "ddp" and self.data_parallel_size > 1:
            _fail("tensor parallel with more than one data-parallel rank needs --strategy fsdp "
                  "(DDP does not wrap DTensor parameters)")

    def _check_context_parallel(self) -> None:
        """Ring attention splits every sequence into 2 x cp_degree chunks; the data-parallel
        wrapper spans the cp ranks too, and no other parallelism is combined with it here."""
        if self.cp_degree == 1:
            return
        if self.model != "transformer" or self.dropout:
            _fail("cp_degree above 1 needs --model transformer with dropout 0 (ring attention has no dropout)")
        if self.seq_len % (2 * self.cp_degree):
            _fail(f"2 x cp_degree ({2 * self.cp_degree}) must divide seq_len ({self.seq_len})")
        if self.world_size % self.cp_degree:
            _fail(f"cp_degree ({self.cp_degree}) must divide the world size ({self.world_size})")
        if self.tp_degree > 1 or self.pp_degree > 1 or self.dp_replicate > 1:
            _fail("cp_degree above 1 runs with tp_degree, pp_degree and dp_replicate 1 "
                  "(only data parallel is combined with it here)")
        if self.compile:
            _fail("cp_degree above 1 runs without --compile (ring attention is not tested compiled)")

    def _check_experts(self) -> None:
        """Mixture-of-experts blocks in the transformer; expert parallel as the whole mesh."""
        if self.ep_degree > 1 and not self.n_experts:
            _fail("ep_degree above 1 needs --n-experts (the experts it splits)")
        if not self.n_experts:
            return
        if self.model != "transformer":
            _fail("n_experts needs --model transformer (the model whose MLPs become experts)")
        if self.n_experts % self.ep_degree:
            _fail(f"ep_degree ({self.ep_degree}) must divide n_experts ({self.n_experts})")
        if self.world_size % self.ep_degree:
            _fail(f"ep_degree ({self.ep_degree}) must divide the world size ({self.world_size})")
        if self.tp_degree > 1 or self.pp_degree > 1 or self.cp_degree > 1 or self.dp_replicate > 1:
            _fail("n_experts runs with tp_degree, pp_degree, cp_degree and dp_replicate 1 "
                  "(only data parallel or expert parallel is combined with it here)")
        if self.ep_degree > 1 and self.world_size != self.ep_degree:
            _fail(f"ep_degree ({self.ep_degree}) must equal the world size ({self.world_size}): "
                  "expert parallel is not combined with data parallel here")
        if self.ep_degree > 1 and self.dropout:
            _fail("ep_degree above 1 needs dropout 0 (the expert-parallel ranks must compute alike)")
        if self.compile or self.fp8 or self.activation_checkpointing:
            _fail("n_experts runs without --compile, --fp8 and --activation-checkpointing (not tested with them)")

    def _check_replicas(self) -> None:
        """HSDP: whole replica groups of at least two FSDP2 shards each, and nothing else on the mesh."""
        if self.dp_replicate == 1:
            return
        if self.strategy != "fsdp":
            _fail("dp_replicate above 1 needs --strategy fsdp (HSDP shards within each replica group)")
        if self.data_parallel_size % self.dp_replicate:
            _fail(f"dp_replicate ({self.dp_replicate}) must divide the data-parallel size "
                  f"({self.data_parallel_size}): every replica group holds the same number of shards")
        if self.data_parallel_size == self.dp_replicate:
            _fail(f"dp_replicate ({self.dp_replicate}) equals the data-parallel size: each group would "
                  "hold one unsharded copy, which is DDP (--strategy ddp)")
        if self.tp_degree > 1 or self.pp_degree > 1:
            _fail("dp_replicate above 1 runs with tp_degree and pp_degree 1 (HSDP is tested on its own)")

    def _check_pipeline(self) -> None:
        """The stages must cover the blocks, and each micro-batch must split evenly."""
        if self.pp_degree == 1:
            if self.pp_microbatches > 1:
                _fail("pp_microbatches needs --pp-degree above 1")
            return
        if self.world_size % (self.pp_degree * self.tp_degree):
            _fail(f"pp_degree ({self.pp_degree}) x tp_degree ({self.tp_degree}) must divide the world size "
                  f"({self.world_size}): the ranks form a pipeline x data-parallel x tensor-parallel mesh")
        if self.model != "transformer":
            _fail("pp_degree above 1 needs --model transformer (the model cut into stages of blocks)")
        if self.tp_degree > 1:
            _fail("pp_degree and tp_degree cannot both be above 1: pipeline stages are not tensor-parallel here")
        if self.strategy == "ddp" and self.data_parallel_size > 1:
            _fail("pipeline stages with more than one data-parallel rank need --strategy fsdp "
                  "(torch's pipeline schedules break DDP's gradient buckets)")
        if self.pp_degree > self.n_layers:
            _fail(f"pp_degree ({self.pp_degree}) must not exceed n_layers ({self.n_layers}): "
                  "every stage needs at least one block")
        if self.pipeline_microbatches < self.pp_degree:
            _fail(f"pp_microbatches ({self.pp_microbatches}) must be at least pp_degree ({self.pp_degree}): "
                  "with fewer, some stage would idle for the whole step")
        if self.micro_batch_size % self.pipeline_microbatches:
            _fail(f"pp_microbatches ({self.pipeline_microbatches}) must divide micro_batch_size "
                  f"({self.micro_batch_size}): unequal pieces would weight samples unequally in the mean loss")
        if self.precision == "fp16":
            _fail("pp_degree above 1 needs --precision fp32 or bf16: fp16's loss scaler would have to "
                  "agree on overflow across stages")

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
            _fail(f"WORLD_SIZE must be an integer (got {env['WORLD_SIZE']!r})")
        return cls(**values)


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one `ConfigError` line instead of usage text."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser generated from the fields of `TrainConfig`."""
    parser = _Parser(prog="python -m reference_impl.train",
                     description="Train the reference model with DDP or FSDP2 (run under torchrun).")
    hints = get_type_hints(TrainConfig)
    docs = field_docs()
    for f in fields(TrainConfig):
        if f.name == "world_size":
            continue
        flag = "--" + f.name.replace("_", "-")
        choices = _choices(f.name)
        help_text = f"{docs.get(f.name, '')} (default: {f.default})"
        if hints[f.name] is bool:
            parser.add_argument(flag, dest=f.name, action="store_true", default=None, help=help_text)
            continue
        kind = _parse_list(hints[f.name]) or {int: int, float: float}.get(_base_type(hints[f.name]), str)
        parser.add_argument(flag, dest=f.name, type=kind, choices=choices, default=None, help=help_text)
    return parser


def field_docs() -> dict[str, str]:
    """Map each `TrainConfig` field to the docstring written under it in the source."""
    tree = ast.parse(inspect.getsource(TrainConfig))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
            docs[node.target.id] = str(nxt.value.value)
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


def _choices(name: str) -> tuple[str, ...] | None:
    return {"strategy": STRATEGIES, "model": MODELS, "precision": PRECISIONS,
            "optimizer": OPTIMIZERS, "device": DEVICES, "fail_mode": FAIL_MODES,
            "fsdp_grad_sync": ("last", "every"), "pp_schedule": ("gpipe", "1f1b")}.get(name)


def _fail(message: str) -> None:
    raise ConfigError(message)

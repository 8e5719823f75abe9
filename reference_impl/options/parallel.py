"""The parallelism options: how the world's ranks form a mesh, checked on the degrees alone.

What a degree needs from the model (a tensor-parallel plan, enough blocks, divisible
widths) is checked by `TrainConfig`, which sees the model's options too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from reference_impl.options.base import Options, at_least, check_choices, fail


@dataclass(frozen=True)
class ParallelOptions(Options):
    """The data-parallel wrapper and the degree of every mesh axis."""

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
    2 x cp_degree chunks of every sequence, attention (`cp_style`) communicates between
    them, and they read the same samples; the world size must be a multiple of it."""
    cp_style: Literal["ring", "ulysses"] = "ring"
    """How the cp ranks attend: ring attention passes keys and values around; Ulysses trades
    sequence shards for head shards with two all-to-alls (n_heads divisible by cp_degree)."""
    ep_degree: int = 1
    """Expert-parallel ranks (needs n_experts, a multiple of it, and must divide the data-parallel
    size): groups of this many consecutive data-parallel ranks, each reading its own samples and
    holding n_experts / ep_degree experts; all-to-all sends every rank's tokens to their experts."""
    pp_degree: int = 1
    """Pipeline stages per model replica (transformer only): the blocks are cut into this many
    consecutive stages, one per rank, and the ranks of one pipeline read the same samples."""
    pp_microbatches: int = 0
    """Pipeline micro-batches M each micro-batch is split into: at least pp_degree (0 means
    pp_degree); more shrink each stage's idle share (pp_degree-1)/(M+pp_degree-1)."""
    pp_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b"] = "1f1b"
    """Pipeline order: GPipe runs every forward, then every backward; 1F1B alternates them
    once the pipeline is full, so fewer activations are held (the same idle share);
    interleaved 1F1B gives each rank pp_virtual_stages smaller stages, which shrinks the idle
    share to (pp_degree-1)/(V x M+pp_degree-1) for V times the point-to-point messages."""
    pp_virtual_stages: int = 2
    """Stages V each rank holds under --pp-schedule interleaved-1f1b: the blocks are cut into
    pp_degree x V stages and rank r holds stages r, r+pp_degree, ... (n_layers must divide evenly)."""
    fsdp_grad_sync: Literal["last", "every"] = "last"
    """FSDP with accumulation: reduce-scatter on the last micro-batch only (less traffic,
    unsharded gradients held in memory) or on every micro-batch (sharded, more traffic)."""
    world_size: int = 1
    """Number of processes; read from torchrun's WORLD_SIZE, not a flag."""

    @property
    def virtual_stages(self) -> int:
        """Stages each rank holds: `pp_virtual_stages` under the interleaved schedule, else 1."""
        return self.pp_virtual_stages if self.pp_schedule == "interleaved-1f1b" else 1

    @property
    def data_parallel_size(self) -> int:
        """Ranks that read different samples: the world size over the tensor, pipeline and
        context degrees (expert-parallel ranks are data-parallel ranks)."""
        return self.world_size // (self.tp_degree * self.pp_degree * self.cp_degree)

    @property
    def pipeline_microbatches(self) -> int:
        """Pipeline micro-batches per micro-batch: `pp_microbatches`, or `pp_degree` for 0."""
        return self.pp_microbatches or self.pp_degree

    def validate(self) -> None:
        """Degrees that tile the world, and only the combinations that are tested together."""
        check_choices(self, ParallelOptions)
        at_least(self, 1, "world_size", "tp_degree", "pp_degree", "dp_replicate", "cp_degree", "ep_degree")
        at_least(self, 0, "pp_microbatches")
        at_least(self, 1, "pp_virtual_stages")
        if self.fsdp_grad_sync == "every" and self.strategy != "fsdp":
            fail("fsdp_grad_sync every needs --strategy fsdp (DDP always syncs on the last micro-batch)")
        self._check_tensor_parallel()
        self._check_pipeline()
        self._check_replicas()
        self._check_context_parallel()
        self._check_expert_parallel()

    def _check_tensor_parallel(self) -> None:
        """The mesh dp x tp must cover the world."""
        if self.tp_degree == 1:
            return
        if self.world_size % self.tp_degree:
            fail(f"tp_degree ({self.tp_degree}) must divide the world size ({self.world_size}): "
                 "the ranks form a data-parallel x tensor-parallel mesh")
        if self.strategy == "ddp" and self.data_parallel_size > 1:
            fail("tensor parallel with more than one data-parallel rank needs --strategy fsdp "
                 "(DDP does not wrap DTensor parameters)")

    def _check_pipeline(self) -> None:
        """The mesh pp x dp x tp must cover the world, with enough micro-batches to fill it."""
        if self.pp_virtual_stages != 2 and self.pp_schedule != "interleaved-1f1b":
            fail("pp_virtual_stages needs --pp-schedule interleaved-1f1b (the other schedules run one stage per rank)")
        if self.pp_degree == 1:
            if self.pp_microbatches > 1:
                fail("pp_microbatches needs --pp-degree above 1")
            return
        if self.world_size % (self.pp_degree * self.tp_degree):
            fail(f"pp_degree ({self.pp_degree}) x tp_degree ({self.tp_degree}) must divide the world size "
                 f"({self.world_size}): the ranks form a pipeline x data-parallel x tensor-parallel mesh")
        if self.tp_degree > 1:
            fail("pp_degree and tp_degree cannot both be above 1: pipeline stages are not tensor-parallel here")
        if self.strategy == "ddp" and self.data_parallel_size > 1:
            fail("pipeline stages with more than one data-parallel rank need --strategy fsdp "
                 "(torch's pipeline schedules break DDP's gradient buckets)")
        if self.pipeline_microbatches < self.pp_degree:
            fail(f"pp_microbatches ({self.pp_microbatches}) must be at least pp_degree ({self.pp_degree}): "
                 "with fewer, some stage would idle for the whole step")
        if self.pp_schedule == "interleaved-1f1b":
            self._check_interleaved()

    def _check_interleaved(self) -> None:
        """Whole rounds of micro-batches, and stages no data-parallel wrapper sits between.

        torch's ScheduleInterleaved1F1B accepts any M that splits into whole rounds of
        M // P; a multiple of P is what the bubble (P-1)/(V x M+P-1) assumes, and asked here.
        """
        if self.pipeline_microbatches % self.pp_degree:
            fail(f"pp_microbatches ({self.pipeline_microbatches}) must be a multiple of pp_degree "
                 f"({self.pp_degree}) under interleaved-1f1b: it runs micro-batches in rounds of pp_degree")
        if self.data_parallel_size > 1:
            fail("interleaved-1f1b runs with one data-parallel rank per stage (its stages are not wrapped "
                 "by DDP or FSDP2 here)")

    def _check_replicas(self) -> None:
        """HSDP: whole replica groups of at least two FSDP2 shards each, and nothing else on the mesh."""
        if self.dp_replicate == 1:
            return
        if self.strategy != "fsdp":
            fail("dp_replicate above 1 needs --strategy fsdp (HSDP shards within each replica group)")
        if self.data_parallel_size % self.dp_replicate:
            fail(f"dp_replicate ({self.dp_replicate}) must divide the data-parallel size "
                 f"({self.data_parallel_size}): every replica group holds the same number of shards")
        if self.data_parallel_size == self.dp_replicate:
            fail(f"dp_replicate ({self.dp_replicate}) equals the data-parallel size: each group would "
                 "hold one unsharded copy, which is DDP (--strategy ddp)")
        if self.tp_degree > 1 or self.pp_degree > 1:
            fail("dp_replicate above 1 runs with tp_degree and pp_degree 1 (HSDP is tested on its own)")

    def _check_context_parallel(self) -> None:
        """The cp ranks tile the world; no other parallelism is combined with them here."""
        if self.cp_degree == 1:
            if self.cp_style != "ring":
                fail(f"cp_style {self.cp_style} needs --cp-degree above 1")
            return
        if self.world_size % self.cp_degree:
            fail(f"cp_degree ({self.cp_degree}) must divide the world size ({self.world_size})")
        if self.tp_degree > 1 or self.pp_degree > 1 or self.dp_replicate > 1:
            fail("cp_degree above 1 runs with tp_degree, pp_degree and dp_replicate 1 "
                 "(only data parallel is combined with it here)")

    def _check_expert_parallel(self) -> None:
        """Expert-parallel groups carved out of the data-parallel ranks, which DDP's place it takes."""
        if self.ep_degree == 1:
            return
        if self.data_parallel_size % self.ep_degree:
            fail(f"ep_degree ({self.ep_degree}) must divide the data-parallel size ({self.data_parallel_size})")
        if self.strategy != "ddp":
            fail("ep_degree above 1 needs --strategy ddp (its gradient sync replaces DDP's)")

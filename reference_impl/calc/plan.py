"""Configuration search: which device mesh trains a given model fastest on a given cluster.

A candidate is a mesh of `dp_replicate x dp_shard x tp x pp` GPUs, laid out with the tensor
axis innermost, then the sharded data-parallel axis, then the replicated one, then the
pipeline (torchtitan's order), plus a micro-batch size and whether activations are
recomputed. Each candidate is priced with the calculators of `reference_impl.calc`:

- memory per GPU: `calc.memory`'s per-rank peak (`transients=True`) for the Llama shape
  under FSDP2 with the trainer's bf16 mixed precision (fp32 sharded weights, gradients and
  Adam moments: 16 bytes per parameter), sharded over `dp_shard`; the stage's share of the
  parameters (`1 / (tp x pp)`); activations split `tp` ways by sequence parallelism, for
  the `pp` micro-batches that 1F1B keeps in flight on the first stage (`calc.memory`
  counts `pp` even when a step has fewer micro-batches, erring high); the gathered root
  and blocks, the all-gather and reduce-scatter buffers and the logits' temporaries. With
  `tp = pp = 1` this is the figure certified against PyTorch's `FSDPMemTracker`
  (`docs/data/memory_grid.json`); the tensor- and pipeline-parallel terms are
  Megatron-LM's accounting, not certified;
- compute: `calc.step_time` at an assumed efficiency, a third more with recomputation;
- tensor parallel: `calc.tp_comm` per micro-batch (six all-reduces per layer instead of
  four when the forward is recomputed), on the critical path;
- the pipeline bubble: `calc.pipeline_bubble`, which stretches compute and TP alike;
- data parallel: `calc.fsdp_comm` per micro-batch (FSDP2 gathers for every forward and
  backward and reduce-scatters every micro-batch, so gradients stay sharded) and one
  `calc.ring_allreduce` of the shard's gradients over `dp_replicate` per step. These
  collectives overlap with compute, so they cost only what exceeds it.

A group whose ranks all sit in one node uses the intra-node bandwidth, any other the
network's. Not modelled: point-to-point pipeline transfers, kernel efficiency falling as
TP shrinks the matmuls, and the allocator's fragmentation and cached blocks beyond the
tracker's peak, so treat a fit within a few GB of the limit as a risk.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from reference_impl import calc
from reference_impl.calc.checks import count, flag, positive
from reference_impl.calc.shapes import LLAMA3_70B, Shape, fsdp2_memory, llama_params

PARAM_BYTES = 2  # bf16 parameters gathered by FSDP2's all-gathers
GRAD_BYTES = 2  # bf16 gradients reduced: the search's assumption (the trainer reduces in fp32)
GRAD_SYNCS = ("every", "last")
RECOMPUTE = 4 / 3  # activation checkpointing adds one forward: 2 of training's 6 FLOPs per parameter-token


@dataclass(frozen=True)
class Job:
    """A training job and its cluster: the model, the batch and the hardware.

    Defaults are Llama-3-70B (hidden 8192, 80 layers, 64 heads, 8 key/value heads, SwiGLU
    of 28672, vocabulary 128256, untied: 70.55B parameters) on 64 H100 SXM GPUs, eight per
    node: 989 TFLOP/s dense bf16 and 80 GB each, an assumed 400 GB/s per GPU inside a node
    and 50 GB/s (one 400 Gb/s port) per GPU between nodes, and 256 sequences of 4096 tokens
    per step.

    Attributes:
        shape: The model's sizes (a Llama block: RMSNorm, grouped-query attention, SwiGLU).
        seq_len: Tokens per sequence.
        global_batch: Sequences per optimizer step over all GPUs.
        n_gpus: GPUs in the job.
        gpus_per_node: GPUs that share the intra-node links.
        gpu_memory_bytes: Memory of one GPU.
        peak_flops_per_gpu: Dense bf16 peak of one GPU.
        compute_efficiency: MFU the job would reach with no communication, bubble or recomputation.
        intra_node_bandwidth: Bytes per second each GPU sends inside a node.
        inter_node_bandwidth: Bytes per second each GPU sends to other nodes.
        micro_batches: Micro-batch sizes (sequences per GPU per forward) to try.

    Raises:
        ValueError: A non-positive size, an efficiency above 1, or no micro-batch size.
    """

    shape: Shape = LLAMA3_70B
    seq_len: int = 4096
    global_batch: int = 256
    n_gpus: int = 64
    gpus_per_node: int = 8
    gpu_memory_bytes: float = 80e9
    peak_flops_per_gpu: float = 989e12
    compute_efficiency: float = 0.5
    intra_node_bandwidth: float = 400e9
    inter_node_bandwidth: float = 50e9
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)

    def __post_init__(self) -> None:
        for name in ("gpu_memory_bytes", "peak_flops_per_gpu", "intra_node_bandwidth", "inter_node_bandwidth"):
            positive(name, getattr(self, name))
        for name in ("seq_len", "global_batch", "n_gpus", "gpus_per_node"):
            count(name, getattr(self, name))
        if positive("compute_efficiency", self.compute_efficiency) > 1:
            raise ValueError(f"compute_efficiency is a fraction and must not exceed 1, got {self.compute_efficiency!r}")
        if not self.micro_batches:
            raise ValueError("micro_batches must name at least one micro-batch size")
        for size in self.micro_batches:
            count("micro_batches", size)

    @property
    def params(self) -> int:
        """The model's parameters, embedding and output projection included."""
        return llama_params(self.shape)

    @property
    def flops_per_sequence(self) -> float:
        """Training FLOPs of one sequence: `6 x params` per token plus attention's `12 x layers x hidden x seq_len`."""
        return self.seq_len * (6 * self.params + 12 * self.shape.n_layers * self.shape.hidden * self.seq_len)


def fsdp_hiding_tokens(job: Job, grad_sync: str = "every") -> float:
    """Tokens per micro-batch above which FSDP2's traffic across nodes takes no longer than
    the micro-batch's `6 x params` FLOPs (attention's FLOPs and the ring's `(N - 1) / N`
    left out), whatever the TP degree: `peak x efficiency / bandwidth x bytes / 6`.

    Per local parameter and micro-batch FSDP2 gathers `PARAM_BYTES` for the forward and
    again for the backward; with `grad_sync="every"` (what `search` prices: gradients stay
    sharded) it also reduce-scatters `GRAD_BYTES`, 6 bytes in all. With `"last"` (the
    trainer's default, `--fsdp-grad-sync last`) it reduce-scatters once per step, so as the
    micro-batches per step grow only the 4 bytes of gathers are left, and every rank holds
    its stage's unsharded gradients until the last micro-batch.

    Raises:
        ValueError: `grad_sync` is neither `every` nor `last`.
    """
    if grad_sync not in GRAD_SYNCS:
        raise ValueError(f"grad_sync must be one of {', '.join(GRAD_SYNCS)}, got {grad_sync!r}")
    bytes_per_param = 2 * PARAM_BYTES + (GRAD_BYTES if grad_sync == "every" else 0)
    return job.peak_flops_per_gpu * job.compute_efficiency / job.inter_node_bandwidth * bytes_per_param / 6


@dataclass(frozen=True)
class Plan:
    """One candidate configuration, priced; `rejected` says why it cannot run ('' if it can).

    Times are seconds per optimizer step; memory is bytes per GPU (0 where the mesh was
    rejected before memory was counted).
    """

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    micro_batch: int
    activation_checkpointing: bool
    rejected: str = ""
    microbatches: int = 0
    model_state_bytes: float = 0.0
    activation_bytes: float = 0.0
    memory_bytes: float = 0.0
    compute_s: float = 0.0
    tp_comm_s: float = 0.0
    bubble_fraction: float = 0.0
    dp_comm_s: float = 0.0
    step_time_s: float = 0.0
    mfu: float = 0.0

    @property
    def mesh(self) -> str:
        """The degrees as `replicate x shard x tp x pp`."""
        return f"{self.dp_replicate}x{self.dp_shard}x{self.tp}x{self.pp}"


def _bandwidth(job: Job, span: int) -> float:
    """Per-GPU bandwidth of a group whose ranks lie within `span` consecutive ranks."""
    return job.intra_node_bandwidth if span <= job.gpus_per_node else job.inter_node_bandwidth


def _layout_problem(job: Job, tp: int, pp: int, dp: int, micro_batch: int) -> str:
    if tp > job.gpus_per_node or job.gpus_per_node % tp:
        return f"TP {tp} does not fit in a node of {job.gpus_per_node} GPUs"
    shape = job.shape
    if shape.n_kv_heads % tp or job.seq_len % tp:
        return f"{shape.n_kv_heads} key/value heads and {job.seq_len} tokens do not split {tp} ways"
    if shape.n_layers % pp:
        return f"{shape.n_layers} layers do not split into {pp} stages"
    if job.global_batch % (dp * micro_batch):
        return f"{job.global_batch} sequences do not split into micro-batches of {micro_batch} on {dp} replicas"
    return ""


def evaluate(job: Job, *, dp_replicate: int, dp_shard: int, tp: int, pp: int, micro_batch: int,
             activation_checkpointing: bool) -> Plan:
    """Price one configuration of `job`: its memory per GPU, its communication and its step time.

    Args:
        job: The model, batch and cluster.
        dp_replicate: Data-parallel replicas that all-reduce gradients (HSDP's outer axis).
        dp_shard: Data-parallel ranks that shard the model state (FSDP).
        tp: Tensor-parallel degree, innermost in the mesh.
        pp: Pipeline stages, outermost in the mesh.
        micro_batch: Sequences per GPU per forward.
        activation_checkpointing: Recompute each layer in backward.

    Returns:
        The priced `Plan`; its `rejected` names the first reason it cannot run: TP beyond
        a node, heads, tokens or layers that do not split, a batch that does not divide,
        or more memory than the GPU has.

    Raises:
        ValueError: A degree below 1, degrees whose product is not `job.n_gpus`, or a
            non-boolean `activation_checkpointing`.
    """
    r, s = count("dp_replicate", dp_replicate), count("dp_shard", dp_shard)
    t, p, b = count("tp", tp), count("pp", pp), count("micro_batch", micro_batch)
    ac = flag("activation_checkpointing", activation_checkpointing)
    if r * s * t * p != job.n_gpus:
        raise ValueError(f"mesh {r}x{s}x{t}x{p} has {r * s * t * p} GPUs, the job has {job.n_gpus}")
    chosen = Plan(dp_replicate=r, dp_shard=s, tp=t, pp=p, micro_batch=b, activation_checkpointing=ac)
    problem = _layout_problem(job, t, p, r * s, b)
    if problem:
        return replace(chosen, rejected=problem)
    m = job.global_batch // (r * s * b)
    shape = job.shape
    stage_params, stage_layers = job.params / (t * p), shape.n_layers // p
    mem = fsdp2_memory(shape, params=job.params, world_size=s, seq_len=job.seq_len, micro_batch=b,
                       activation_checkpointing=ac, tp_degree=t, pp_degree=p, sequence_parallel=True)
    total = mem["total_bytes"]
    compute = calc.step_time(flops_per_sample=job.flops_per_sequence * (RECOMPUTE if ac else 1),
                             samples_per_step=job.global_batch, n_gpus=job.n_gpus,
                             peak_flops_per_gpu=job.peak_flops_per_gpu, mfu=job.compute_efficiency)["step_time_s"]
    tp_s = 0.0
    if t > 1:
        per_microbatch = calc.tp_comm(seq_len=job.seq_len, micro_batch=b, hidden=shape.hidden, n_layers=stage_layers,
                                      tp_degree=t, bandwidth_bytes_per_s=_bandwidth(job, t))["time_s"]
        tp_s = m * per_microbatch * (6 / 4 if ac else 1)  # recomputing the forward repeats its 2 all-reduces
    bubble = calc.pipeline_bubble(stages=p, microbatches=m)["bubble_fraction"]
    dp_s = 0.0
    if s > 1:
        dp_s += m * calc.fsdp_comm(params=stage_params, world_size=s,
                                   bandwidth_bytes_per_s=_bandwidth(job, t * s))["time_s"]
    if r > 1:
        dp_s += calc.ring_allreduce(size_bytes=stage_params / s * GRAD_BYTES, world_size=r,
                                    bandwidth_bytes_per_s=_bandwidth(job, t * s * r))["time_s"]
    step = max((compute + tp_s) / (1 - bubble), dp_s)
    mfu = calc.mfu(flops_per_sample=job.flops_per_sequence, samples_per_step=job.global_batch, step_time_s=step,
                   n_gpus=job.n_gpus, peak_flops_per_gpu=job.peak_flops_per_gpu)["mfu"]
    limit = job.gpu_memory_bytes
    rejected = f"needs {total / 1e9:.0f} GB per GPU, over {limit / 1e9:.0f} GB" if total > limit else ""
    return replace(chosen, rejected=rejected, microbatches=m, model_state_bytes=mem["model_state_bytes"],
                   activation_bytes=mem["activation_bytes"], memory_bytes=total, compute_s=compute,
                   tp_comm_s=tp_s, bubble_fraction=bubble, dp_comm_s=dp_s, step_time_s=step, mfu=mfu)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search(job: Job | None = None) -> list[Plan]:
    """Every mesh, micro-batch size and checkpointing choice for `job`, fastest first.

    Args:
        job: The model, batch and cluster (default: a 70B model on 64 H100s, `Job()`).

    Returns:
        Every candidate: those that run, by step time (ties: less data-parallel traffic, then
        less memory, first); then those that overrun memory, smallest overrun first; then
        those rejected for their layout.
    """
    job = Job() if job is None else job
    plans = [evaluate(job, dp_replicate=r, dp_shard=s, tp=t, pp=job.n_gpus // (r * s * t), micro_batch=b,
                      activation_checkpointing=ac)
             for r in _divisors(job.n_gpus) for s in _divisors(job.n_gpus // r)
             for t in _divisors(job.n_gpus // (r * s)) for b in job.micro_batches for ac in (False, True)]
    return sorted(plans, key=_rank)


def _rank(plan: Plan) -> tuple[int, float, float, float, str]:
    if plan.rejected:  # memory overruns, smallest first, then layout rejections (never priced)
        return 1, plan.memory_bytes == 0, plan.memory_bytes, 0.0, plan.mesh
    # Steps within a millisecond tie; then the plan with less data-parallel traffic to hide wins.
    return 0, round(plan.step_time_s, 3), plan.dp_comm_s, plan.memory_bytes, plan.mesh


def best_per_mesh(plans: list[Plan]) -> list[Plan]:
    """The best plan of each mesh, keeping the order of `plans` (from `search`, fastest first).

    A mesh none of whose settings runs is represented by its first rejected plan.
    """
    seen: dict[str, Plan] = {}
    for plan in plans:
        seen.setdefault(plan.mesh, plan)
    return list(seen.values())

"""Two small models, an MLP classifier and a causal transformer, and the registry of model specs.

Each model owns what is model-specific (`reference_impl.spec.ModelSpec`): the transformer's
blocks are the units that FSDP2 shards, `--compile` compiles and activation checkpointing
recomputes; its tensor-parallel plan and its pipeline stages are defined here, beside it.
"""

# --8<-- [start:imports]
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.utils.checkpoint import checkpoint
from torch.utils.data import Dataset

# --8<-- [end:imports]
from reference_impl.config import TrainConfig
from reference_impl.data import Sample, SyntheticClassification, SyntheticTokens
from reference_impl.fp8 import swap_linears
from reference_impl.parallel.experts import TOP_K, ExpertsMLP
from reference_impl.spec import ModelSpec


# --8<-- [start:mlp]
class MLP(nn.Module):
    """Three linear layers with GELU: the smallest model where DDP buckets matter."""

    def __init__(self, input_dim: int, hidden_dim: int, num_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(input_dim, hidden_dim), nn.GELU(),
            nn.Linear(hidden_dim, hidden_dim), nn.GELU(),
            nn.Linear(hidden_dim, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
# --8<-- [end:mlp]


# --8<-- [start:transformer]
class Block(nn.Module):
    """Pre-norm causal self-attention followed by an MLP, each with a residual."""

    def __init__(self, d_model: int, n_heads: int, hidden_dim: int, dropout: float) -> None:
        super().__init__()
        self.head_dim, self.dropout = d_model // n_heads, dropout
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, d_model))
        self.drop = nn.Dropout(dropout)
        # Set by context_parallel.parallelize: causal attention of this rank's slice of the
        # sequence over the whole sequence (None: the whole sequence is here).
        self.attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(self.norm1(x))
        # Rows of qkv are grouped by head (q, k, v of head 0, then of head 1, ...), so a
        # column-parallel split hands each rank whole heads; -1 is the heads this rank holds.
        b, t, _ = qkv.shape
        q, k, v = (part.transpose(1, 2) for part in qkv.view(b, t, -1, 3, self.head_dim).unbind(3))
        if self.attention is not None:
            attn = self.attention(q, k, v)
        else:
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                  dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(attn.transpose(1, 2).reshape(b, t, -1)))
        return x + self.drop(self.mlp(self.norm2(x)))


# --8<-- [start:run_blocks]
def run_blocks(blocks: Iterable[nn.Module], x: torch.Tensor, recompute: bool) -> torch.Tensor:
    """Apply `blocks` in order; with `recompute`, keep only each block's input and
    recompute its activations during backward (activation checkpointing)."""
    for block in blocks:
        # Non-reentrant checkpointing works with FSDP2's hooks and replays dropout's RNG.
        x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
    return x
# --8<-- [end:run_blocks]


class TinyTransformer(nn.Module):
    """A decoder-only language model; its `blocks` are the units `TRANSFORMER_SPEC` names."""

    def __init__(self, vocab_size: int, seq_len: int, d_model: int, n_layers: int,
                 n_heads: int, hidden_dim: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Parameter(torch.randn(seq_len, d_model) * 0.02)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, hidden_dim, dropout) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)
        self.checkpoint_blocks = False  # set by parallel.parallelize for --activation-checkpointing

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for `tokens`; `positions` are their places in the sequence when they are
        not 0..t-1 (a context-parallel rank's slice)."""
        x = self.embed(tokens) + (self.pos[: tokens.shape[1]] if positions is None else self.pos[positions])
        x = run_blocks(self.blocks, x, recompute=self.checkpoint_blocks and self.training)
        return self.head(self.norm(x))  # a view of a 2-D matmul: see parallel.data_parallel.fsdp
# --8<-- [end:transformer]


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of a `TinyTransformer` or of its pipeline `Stage`, in order."""
    return list(model.get_submodule("blocks").children())


# --8<-- [start:tp_plan]
def transformer_tp_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """How tensor parallel splits each submodule of a `TinyTransformer` (`reference_impl.parallel.tensor_parallel`).

    Between blocks the residual stream is split along the sequence (Shard(1)): the
    norms and dropout run on each rank's slice of tokens (sequence parallel). Entering
    attention or the MLP, the first matmul all-gathers the tokens and splits its output
    columns (heads, hidden units); the second splits its input rows and reduce-scatters
    the partial sums back to sequence slices. The logits are all-gathered whole.
    """
    seq = Shard(1)
    plan: dict[str, ParallelStyle] = {
        "blocks.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(seq,),
                                       use_local_output=True),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
    }
    for i in range(len(transformer_blocks(model))):
        plan |= {f"blocks.{i}.norm1": SequenceParallel(), f"blocks.{i}.norm2": SequenceParallel(),
                 f"blocks.{i}.qkv": ColwiseParallel(input_layouts=seq),
                 f"blocks.{i}.proj": RowwiseParallel(output_layouts=seq),
                 f"blocks.{i}.mlp.0": ColwiseParallel(input_layouts=seq),
                 f"blocks.{i}.mlp.2": RowwiseParallel(output_layouts=seq)}
    return plan
# --8<-- [end:tp_plan]


# --8<-- [start:stage]
def stage_layers(n_layers: int, pp_degree: int, stage: int) -> range:
    """The blocks of `stage`: contiguous, as even as possible, earlier stages one larger."""
    if not 1 <= pp_degree <= n_layers:
        raise ValueError(f"pp_degree must be in [1, n_layers={n_layers}] (got {pp_degree})")
    base, extra = divmod(n_layers, pp_degree)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


class Stage(nn.Module):
    """One pipeline stage: the first adds the embeddings, the last the norm and the head.

    Blocks keep their index in the whole model (`blocks.2` stays `blocks.2` on the second
    stage), so every stage's state dict uses the whole model's names: a checkpoint written
    by the stages together restores into any other number of stages, or none.
    """

    def __init__(self, model: TinyTransformer, stage: int, pp_degree: int,
                 autocast_dtype: torch.dtype | None = None) -> None:
        """Take stage `stage` of `pp_degree` from a `TinyTransformer` built on every rank."""
        super().__init__()
        self.first, self.last = stage == 0, stage == pp_degree - 1
        self.autocast_dtype, self.checkpoint_blocks = autocast_dtype, model.checkpoint_blocks
        # Shared modules, not copies: every rank built the same seeded model and keeps its part.
        self.embed: nn.Embedding | None = model.embed if self.first else None
        self.pos: nn.Parameter | None = model.pos if self.first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i]
                                     for i in stage_layers(len(model.blocks), pp_degree, stage)})
        self.norm: nn.LayerNorm | None = model.norm if self.last else None
        self.head: nn.Linear | None = model.head if self.last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Autocast here, not around the schedule: the schedule also runs the backward pass.
        with torch.autocast(x.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            if self.embed is not None and self.pos is not None:  # the first stage: x holds token ids
                x = self.embed(x) + self.pos[: x.shape[1]]
            x = run_blocks(self.blocks.values(), x, recompute=self.checkpoint_blocks and self.training)
            return self.head(self.norm(x)) if self.norm is not None and self.head is not None else x
# --8<-- [end:stage]


# --8<-- [start:interleaved_stages]
class InterleavedStages(nn.Module):
    """The stages one rank holds under an interleaved schedule: r, r+P, r+2P, ... of V x P.

    It registers their embeddings, blocks and head under the whole model's names, as a
    `Stage` does, so the optimizer, the checkpoint and the digest see one module. The
    schedule runs `chunks`, the `Stage`s themselves: they share these modules, and a tuple
    keeps them from being registered a second time under other names.
    """

    def __init__(self, chunks: list[Stage]) -> None:
        """Hold `chunks`, this rank's stages in pipeline order."""
        super().__init__()
        self.chunks = tuple(chunks)
        self.embed, self.pos = chunks[0].embed, chunks[0].pos  # set on rank 0 only: it holds stage 0
        self.blocks = nn.ModuleDict({name: block for chunk in chunks for name, block in chunk.blocks.items()})
        self.norm, self.head = chunks[-1].norm, chunks[-1].head  # set on the rank of the last stage only

    def train(self, mode: bool = True) -> InterleavedStages:
        """Also switch the unregistered stages: each decides on recomputation by its own flag."""
        for chunk in self.chunks:
            chunk.train(mode)
        return super().train(mode)
# --8<-- [end:interleaved_stages]


def transformer_stage(model: nn.Module, cfg: TrainConfig, pp_degree: int, stage: int) -> nn.Module:
    """What rank `stage` of `pp_degree` keeps of a `TinyTransformer`: its stage, or under
    `--pp-schedule interleaved-1f1b` its `InterleavedStages` (stages `stage`, `stage` +
    `pp_degree`, ... of `pp_degree` x V, the round-robin torch's interleaved schedules expect).
    Autocast to bf16 under `--precision bf16`.

    Raises:
        TypeError: `model` is not a `TinyTransformer`.
    """
    if not isinstance(model, TinyTransformer):
        raise TypeError(f"pipeline stages are cut from a TinyTransformer, not {type(model).__name__}")
    dtype = torch.bfloat16 if cfg.precision == "bf16" else None
    if cfg.pp_schedule != "interleaved-1f1b":
        return Stage(model, stage, pp_degree, autocast_dtype=dtype)
    n_stages = pp_degree * cfg.virtual_stages
    return InterleavedStages([Stage(model, s, n_stages, autocast_dtype=dtype)
                              for s in range(stage, n_stages, pp_degree)])


def build_mlp(cfg: TrainConfig) -> nn.Module:
    """The `--model mlp` classifier."""
    return MLP(cfg.input_dim, cfg.hidden_dim, cfg.num_classes)


def build_transformer(cfg: TrainConfig) -> nn.Module:
    """The `--model transformer` language model; with `--n-experts`, every MLP a mixture of experts."""
    model = TinyTransformer(cfg.vocab_size, cfg.seq_len, cfg.d_model, cfg.n_layers,
                            cfg.n_heads, cfg.hidden_dim, cfg.dropout)
    for block in model.blocks if cfg.n_experts else ():
        block.mlp = ExpertsMLP(cfg.d_model, cfg.hidden_dim, cfg.n_experts)
    return model


def mlp_flops(cfg: TrainConfig) -> float:
    """Training FLOPs per sample of the MLP: 6 x (matmul parameters)."""
    return 6.0 * (cfg.input_dim * cfg.hidden_dim + cfg.hidden_dim ** 2 + cfg.hidden_dim * cfg.num_classes)


def transformer_flops(cfg: TrainConfig) -> float:
    """Training FLOPs per sample of the transformer: 6 x (matmul parameters) per token, plus attention.

    The attention term is 12 x n_layers x d_model x seq_len per token (QK^T and AV,
    forward and backward), the usual dense-transformer accounting. With `--n-experts`
    a token passes through its top-k experts and the router: the FLOPs the model needs
    when no expert overflows (the block multiplies only the (token, expert) rows it keeps,
    so each dropped one saves 12 x d_model x hidden_dim; tests/test_traces_certified.py
    checks both against FlopCounterMode).
    """
    mlp = 2 * cfg.d_model * cfg.hidden_dim
    if cfg.n_experts:
        mlp = min(TOP_K, cfg.n_experts) * mlp + cfg.d_model * cfg.n_experts
    per_block = 4 * cfg.d_model ** 2 + mlp
    matmul = cfg.n_layers * per_block + cfg.d_model * cfg.vocab_size
    attention = 12 * cfg.n_layers * cfg.d_model * cfg.seq_len
    return (6.0 * matmul + attention) * cfg.seq_len


def _classification(cfg: TrainConfig) -> Dataset[Sample]:
    return SyntheticClassification(cfg.dataset_size, cfg.input_dim, cfg.num_classes, cfg.seed)


def _tokens(cfg: TrainConfig) -> Dataset[Sample]:
    return SyntheticTokens(cfg.dataset_size, cfg.seq_len, cfg.vocab_size, cfg.seed)


# --8<-- [start:specs]
MLP_SPEC = ModelSpec(build=build_mlp, dataset=_classification, flops_per_sample=mlp_flops,
                     repeated_units=lambda model: [])
TRANSFORMER_SPEC = ModelSpec(build=build_transformer, dataset=_tokens, flops_per_sample=transformer_flops,
                             repeated_units=transformer_blocks, tp_plan=transformer_tp_plan,
                             pipeline_stage=transformer_stage)
SPECS: dict[str, ModelSpec] = {"mlp": MLP_SPEC, "transformer": TRANSFORMER_SPEC}  # --model -> its spec


def spec_of(cfg: TrainConfig) -> ModelSpec:
    """The spec of the configured model (`--model`)."""
    return SPECS[cfg.model]
# --8<-- [end:specs]


def build_model(cfg: TrainConfig) -> nn.Module:
    """Construct the configured model on the CPU with weights drawn from `cfg.seed`.

    Every rank builds identical weights, which FSDP2 requires (DDP would broadcast them).
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = spec_of(cfg).build(cfg)
    if cfg.fp8:
        swap_linears(model)  # after the seeded init: the same weights as without fp8
    return model


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over samples (MLP) or tokens (transformer), computed in fp32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))


def flops_per_sample(cfg: TrainConfig) -> float:
    """Training FLOPs per sample of the configured model, as its spec counts them."""
    return spec_of(cfg).flops_per_sample(cfg)

"""Two small models: an MLP classifier and a causal transformer whose blocks are the
units that FSDP2 shards and activation checkpointing recomputes."""

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

# --8<-- [end:imports]
from reference_impl.config import TrainConfig
from reference_impl.experts import ExpertsMLP
from reference_impl.fp8 import swap_linears


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
    """A decoder-only language model; `blocks` is what parallelize.py wraps."""

    def __init__(self, vocab_size: int, seq_len: int, d_model: int, n_layers: int,
                 n_heads: int, hidden_dim: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Parameter(torch.randn(seq_len, d_model) * 0.02)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, hidden_dim, dropout) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)
        self.checkpoint_blocks = False  # set by parallel.wrap_model for --activation-checkpointing

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for `tokens`; `positions` are their places in the sequence when they are
        not 0..t-1 (a context-parallel rank's slice)."""
        x = self.embed(tokens) + (self.pos[: tokens.shape[1]] if positions is None else self.pos[positions])
        x = run_blocks(self.blocks, x, recompute=self.checkpoint_blocks and self.training)
        # Linear on 3-D input returns a view of a 2-D matmul's result. FSDP2 hooks the backward
        # pass onto the root module's output and warns on every forward that an in-place op
        # on a view would drop that hook. A copy of the logits (batch x seq x vocab, as small
        # as one block's activations here) is a tensor of its own; the values are unchanged.
        return self.head(self.norm(x)).clone()
# --8<-- [end:transformer]

    # --8<-- [start:tp_plan]
    def tp_plan(self) -> dict[str, ParallelStyle]:
        """How tensor parallel splits each submodule (`reference_impl.tensor_parallel`).

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
        for i in range(len(self.blocks)):
            plan |= {f"blocks.{i}.norm1": SequenceParallel(), f"blocks.{i}.norm2": SequenceParallel(),
                     f"blocks.{i}.qkv": ColwiseParallel(input_layouts=seq),
                     f"blocks.{i}.proj": RowwiseParallel(output_layouts=seq),
                     f"blocks.{i}.mlp.0": ColwiseParallel(input_layouts=seq),
                     f"blocks.{i}.mlp.2": RowwiseParallel(output_layouts=seq)}
        return plan
    # --8<-- [end:tp_plan]


def build_model(cfg: TrainConfig) -> nn.Module:
    """Construct the configured model on the CPU with weights drawn from `cfg.seed`.

    Every rank builds identical weights, which FSDP2 requires (DDP would broadcast them).
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        if cfg.model == "mlp":
            return MLP(cfg.input_dim, cfg.hidden_dim, cfg.num_classes)
        model = TinyTransformer(cfg.vocab_size, cfg.seq_len, cfg.d_model, cfg.n_layers,
                                cfg.n_heads, cfg.hidden_dim, cfg.dropout)
        for block in model.blocks if cfg.n_experts else ():  # --n-experts: every MLP a mixture of experts
            block.mlp = ExpertsMLP(cfg.d_model, cfg.hidden_dim, cfg.n_experts)
    if cfg.fp8:
        swap_linears(model)  # after the seeded init: the same weights as without fp8
    return model


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over samples (MLP) or tokens (transformer), computed in fp32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))


def flops_per_sample(cfg: TrainConfig) -> float:
    """Training FLOPs per sample: 6 x (matmul parameters) per token, plus attention.

    The attention term is 12 x n_layers x d_model x seq_len per token (QK^T and AV,
    forward and backward), the usual dense-transformer accounting.
    """
    if cfg.model == "mlp":
        matmul = cfg.input_dim * cfg.hidden_dim + cfg.hidden_dim ** 2 + cfg.hidden_dim * cfg.num_classes
        return 6.0 * matmul
    per_block = 4 * cfg.d_model ** 2 + 2 * cfg.d_model * cfg.hidden_dim
    matmul = cfg.n_layers * per_block + cfg.d_model * cfg.vocab_size
    attention = 12 * cfg.n_layers * cfg.d_model * cfg.seq_len
    return (6.0 * matmul + attention) * cfg.seq_len

"""Llama-style model shapes and their parameter counts, without torch.

The memory grid (`reference_impl.calc.memory_grid`) builds these shapes on fake tensors to
certify `calc.memory`; the configuration search (`reference_impl.calc.plan`) prices meshes for
them. Both count parameters with `llama_params` and price memory with `fsdp2_memory`, so
the search's model is, byte for byte, the one the tracker measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from reference_impl import calc


@dataclass(frozen=True)
class Shape:
    """A Llama-style model's sizes."""

    name: str
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    vocab_size: int


LLAMA_7B = Shape("Llama-2 7B", 4096, 32, 32, 32, 11008, 32000)
LLAMA_13B = Shape("Llama-2 13B", 5120, 40, 40, 40, 13824, 32000)
LLAMA3_70B = Shape("Llama-3 70B", 8192, 80, 64, 8, 28672, 128256)
LLAMA3_405B = Shape("Llama-3 405B", 16384, 126, 128, 8, 53248, 128256)


def llama_params(shape: Shape) -> int:
    """Parameters of a Llama model of `shape`: per block two RMSNorms, fused q/k/v, the
    attention output and SwiGLU's three matrices (no biases); untied embedding and output
    projection, and the final RMSNorm."""
    h, kv = shape.hidden, shape.hidden // shape.n_heads * shape.n_kv_heads
    block = 2 * h + h * (h + 2 * kv) + h * h + 3 * h * shape.ffn_hidden
    return shape.n_layers * block + 2 * shape.vocab_size * h + h


def fsdp2_memory(shape: Shape, **inputs: Any) -> dict[str, float]:
    """`calc.memory`'s per-rank peak for a Llama of `shape` as the trainer runs it under FSDP2:
    bf16 compute over fp32 sharded weights, gradients and Adam moments (no master copy).

    Args:
        shape: The model's sizes.
        **inputs: The rest of `calc.memory`'s inputs (`params`, `world_size`, the batch, the
            parallel degrees, recompute).
    """
    return calc.memory(strategy="fsdp", hidden=shape.hidden, n_heads=shape.n_heads, n_layers=shape.n_layers,
                       ffn_hidden=shape.ffn_hidden, gated_mlp=True, n_kv_heads=shape.n_kv_heads,
                       vocab_size=shape.vocab_size, param_bytes=4, grad_bytes=4, master_bytes=0, optimizer_bytes=8,
                       compute_bytes=2, transients=True, **inputs)

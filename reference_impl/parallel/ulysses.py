"""Context parallel, Ulysses style: all-to-all from sequence shards to head shards and back.

Each rank of a context-parallel group holds the same tokens as under ring attention
(`context_parallel.shard_sequence`), with every head. Before attention one all-to-all per
tensor trades them: rank r sends head group j (heads j*h/W .. (j+1)*h/W - 1) of its tokens
to rank j and receives head group r of every rank's tokens, so it then holds the whole
sequence for h/W heads. Attention is ordinary causal attention on whole sequences, local to
the rank, and a second all-to-all sends each head group's output back to the tokens' owners.
It needs the number of heads divisible by W; ring attention has no such limit.
"""

# --8<-- [start:imports]
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

# --8<-- [end:imports]
from reference_impl.config import TrainConfig
from reference_impl.parallel import context_parallel
from reference_impl.parallel.experts import AllToAll


# --8<-- [start:ulysses]
def _swap(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Send slice j of `x`'s dim 0 to rank j and stack, in rank order, what each rank sent
    here: the same shape. Its backward is the same exchange of the gradients (`AllToAll`)."""
    rows = [x.shape[0] // dist.get_world_size(group)] * dist.get_world_size(group)
    return AllToAll.apply(x, rows, rows, group)


def _to_heads(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """(batch, heads, tokens, dim) of this rank's tokens -> (batch, heads/W, W*tokens, dim) of
    every rank's tokens, rank after rank, for this rank's head group."""
    b, h, t, d = x.shape
    w = dist.get_world_size(group)
    received = _swap(x.reshape(b, w, h // w, t, d).transpose(0, 1), group)  # (source rank, b, h/W, t, d)
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // w, w * t, d)


def _to_tokens(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The inverse of `_to_heads`: every head of this rank's tokens."""
    b, hw, wt, d = x.shape
    w = dist.get_world_size(group)
    received = _swap(x.reshape(b, hw, w, wt // w, d).permute(2, 0, 1, 3, 4), group)  # (head group, b, h/W, t, d)
    return received.transpose(0, 1).reshape(b, w * hw, wt // w, d)


def sequence_order(world_size: int, load_balanced: bool) -> torch.Tensor:
    """The chunks gathered rank after rank (`chunk_ids` of rank 0, then of rank 1, ...)
    as sequence positions: `gathered[order]` puts the `2W` chunks in sequence order, and
    `ordered[argsort(order)]` undoes it."""
    held = [c for rank in range(world_size) for c in context_parallel.chunk_ids(rank, world_size, load_balanced)]
    return torch.tensor(held).argsort()


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      group: dist.ProcessGroup | None = None, load_balanced: bool = True) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys.

    The same contract as `context_parallel.ring_attention`: every rank of `group` passes its
    own tokens (`shard_sequence` with the same `load_balanced`) and gets its rows of full
    causal attention; the backward of the all-to-alls gives its rows of dq, dk and dv.

    Args:
        q: This rank's queries, (batch, heads, 2 * chunk, head_dim); heads divisible by W.
        k: This rank's keys, the same shape.
        v: This rank's values, the same shape.
        group: The context-parallel process group (the default group if None).
        load_balanced: The chunk assignment the tokens were sharded with.
    """
    w = dist.get_world_size(group)
    order = sequence_order(w, load_balanced).to(q.device)

    def whole(x: torch.Tensor) -> torch.Tensor:  # the full sequence, in order, for h/W heads
        gathered = _to_heads(x, group)
        b, hw, s, d = gathered.shape
        return gathered.reshape(b, hw, 2 * w, s // (2 * w), d)[:, :, order].reshape(b, hw, s, d)

    out = F.scaled_dot_product_attention(whole(q), whole(k), whole(v), is_causal=True)
    b, hw, s, d = out.shape
    gathered = out.reshape(b, hw, 2 * w, s // (2 * w), d)[:, :, order.argsort()].reshape(b, hw, s, d)
    return _to_tokens(gathered, group)
# --8<-- [end:ulysses]


# --8<-- [start:wrap]
def wrap(model: nn.Module, mesh: DeviceMesh, cfg: TrainConfig) -> nn.Module:
    """The trainer's `--cp-style ulysses`: context parallel (`context_parallel.parallelize`:
    the same load-balanced tokens, positions and gradient averaging as ring attention) with
    Ulysses attention in every block."""
    return context_parallel.parallelize(model, mesh.get_group(), attention=ulysses_attention)
# --8<-- [end:wrap]


# --8<-- [start:comm_volume]
def ulysses_bytes_per_layer(batch: int, seq_len: int, d_model: int, world_size: int,
                            bytes_per_element: int = 4) -> dict[str, int]:
    """Bytes one rank sends to other ranks for one attention layer, forward and backward.

    Forward: q, k and v go to the head owners and the output comes back, four all-to-alls
    of batch x seq_len/W x d_model elements, each keeping 1/W at home. Backward: the same
    four, carrying the gradients.
    """
    per_tensor = batch * (seq_len // world_size) * (d_model // world_size) * (world_size - 1) * bytes_per_element
    return {"forward": 4 * per_tensor, "backward": 4 * per_tensor}
# --8<-- [end:comm_volume]

"""Context parallel: causal ring attention over the sequence axis.

Each rank of a context-parallel group holds a slice of the sequence: its queries, keys and
values for those tokens only. Attention needs every earlier key, so the key/value chunks
travel around the ring (rank r sends to r+1 and receives from r-1) while each rank attends
its queries to the chunk it holds; after `world_size` steps every query has seen every key.
The partial results of the steps are merged with the log-sum-exp rule, so no rank ever holds
the full sequence's scores, keys or values. Backward runs the same ring: the key/value
chunks travel again, and the gradients of each chunk travel with it, accumulating every
rank's contribution, until they arrive back at the rank that owns the chunk.

The sequence is cut into `2 * world_size` equal chunks and each rank holds two of them: with
`load_balanced=False` the contiguous pair (2r, 2r+1), with `load_balanced=True` the pair
(r, 2W-1-r), one early and one late chunk, which gives every rank the same number of causal
score blocks at every ring step (`score_blocks_per_step`, `idle_share`).
"""

# --8<-- [start:imports]
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import Dataset

# --8<-- [end:imports]
from reference_impl.config import TrainConfig
from reference_impl.data import Sample
from reference_impl.model import Block, TinyTransformer
from reference_impl.parallel.mesh import ParallelDims


# --8<-- [start:layout]
def chunk_ids(rank: int, world_size: int, load_balanced: bool) -> tuple[int, int]:
    """The two chunks (of `2 * world_size`, in sequence order) that `rank` holds.

    Args:
        rank: The rank within the context-parallel group.
        world_size: The size of the context-parallel group.
        load_balanced: Take chunks r and 2W-1-r (one early, one late) instead of 2r, 2r+1.
    """
    if load_balanced:
        return rank, 2 * world_size - 1 - rank
    return 2 * rank, 2 * rank + 1


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, load_balanced: bool,
                   dim: int = 1) -> torch.Tensor:
    """This rank's tokens of `x`: its two chunks along `dim`, concatenated in chunk order.

    Args:
        x: A full-sequence tensor whose `dim` is divisible by `2 * world_size`.
        rank: The rank within the context-parallel group.
        world_size: The size of the context-parallel group.
        load_balanced: The chunk assignment of `chunk_ids`.
        dim: The sequence dimension.
    """
    chunks = x.chunk(2 * world_size, dim=dim)
    return torch.cat([chunks[c] for c in chunk_ids(rank, world_size, load_balanced)], dim=dim)


def _pairs(q_chunks: tuple[int, int], k_chunks: tuple[int, int]) -> list[tuple[int, int, bool]]:
    """The (local query half, local key half, diagonal) blocks the causal mask leaves.

    A key chunk after the query chunk is skipped whole: every score in it is masked.
    """
    return [(i, j, cq == ck) for i, cq in enumerate(q_chunks) for j, ck in enumerate(k_chunks) if ck <= cq]
# --8<-- [end:layout]


@dataclass
class CommStats:
    """Bytes this rank sent around the ring, counted as the messages are posted.

    Attributes:
        bytes_sent: The payload of every send: key/value chunks and their gradients.
    """

    bytes_sent: int = 0


# --8<-- [start:block_attention]
def _future(t: int, device: torch.device) -> torch.Tensor:
    """The causal mask of a diagonal block: True where the key comes after the query."""
    return torch.ones(t, t, dtype=torch.bool, device=device).triu(1)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    diagonal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of a query chunk over one key/value chunk, and its log-sum-exp.

    Args:
        q: Queries, (batch, heads, t, head_dim).
        k: Keys of one chunk, (batch, heads, t, head_dim).
        v: Values of the same chunk.
        diagonal: True when q and k are the same chunk of the sequence: query i then sees
            keys 0..i of the chunk only (the causal mask). A key chunk later than the query
            chunk is never passed here; an earlier one is seen whole.

    Returns:
        The chunk's attention output (normalised over this chunk's keys only) and the
        log of each row's softmax denominator, (batch, heads, t), which `merge_partials`
        needs to combine chunks.
    """
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if diagonal:
        scores = scores.masked_fill(_future(q.shape[-2], q.device), float("-inf"))
    # Subtracting the row maximum keeps exp() <= 1: without it, scores above ~88 overflow
    # fp32 to inf and the output becomes NaN.
    row_max = scores.amax(dim=-1, keepdim=True)
    weights = torch.exp(scores - row_max)
    denom = weights.sum(dim=-1, keepdim=True)
    return (weights @ v) / denom, (row_max + torch.log(denom)).squeeze(-1)
# --8<-- [end:block_attention]


# --8<-- [start:lse_merge]
def merge_partials(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                   block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint sets of keys into attention over their union.

    Each partial output is normalised by its own denominator exp(lse). The union's
    denominator is the sum of the two, so its log is logaddexp(lse, block_lse), and each
    partial is re-weighted by its share of it, exp(lse - new_lse). Starting from
    out = 0, lse = -inf, merging every key chunk's (block_out, block_lse) gives exactly
    softmax attention over all the keys.
    """
    new_lse = torch.logaddexp(lse, block_lse)
    out = torch.exp(lse - new_lse).unsqueeze(-1) * out \
        + torch.exp(block_lse - new_lse).unsqueeze(-1) * block_out
    return out, new_lse
# --8<-- [end:lse_merge]


class _Ring:
    """The ring neighbours of this rank in `group` and the sends to them."""

    def __init__(self, group: dist.ProcessGroup | None, stats: CommStats | None) -> None:
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.stats = stats

    def start_pass(self, tensor: torch.Tensor) -> tuple[torch.Tensor, list[dist.Work]]:
        """Post the send of `tensor` to the next rank and the receive from the previous one.

        The caller computes on what it holds while the transfer runs, then waits on the works.
        """
        received = torch.empty_like(tensor)
        nxt, prev = (self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size
        ops = [dist.P2POp(dist.isend, tensor.contiguous(), group=self.group, group_peer=nxt),
               dist.P2POp(dist.irecv, received, group=self.group, group_peer=prev)]
        if self.stats is not None:
            self.stats.bytes_sent += tensor.numel() * tensor.element_size()
        return received, dist.batch_isend_irecv(ops)

    def pass_on(self, tensor: torch.Tensor) -> torch.Tensor:
        """Send `tensor` to the next rank and return the previous rank's, blocking."""
        received, works = self.start_pass(tensor)
        for work in works:
            work.wait()
        return received


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's two chunks, split back apart along the sequence (the next-to-last dim)."""
    first, second = x.chunk(2, dim=-2)
    return first, second


# --8<-- [start:ring_forward]
class _RingAttention(torch.autograd.Function):
    """Causal ring attention with a ring backward (see the module docstring)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, group: dist.ProcessGroup | None, load_balanced: bool,
                stats: CommStats | None) -> torch.Tensor:
        ring = _Ring(group, stats)
        mine = chunk_ids(ring.rank, ring.world_size, load_balanced)
        qs = _halves(q)
        outs = [torch.zeros_like(half) for half in qs]
        lses = [torch.full(half.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device) for half in qs]
        kv = torch.stack([k, v])
        for step in range(ring.world_size):
            # The chunk held at `step` came from rank r - step; send it on while computing on it.
            owner = (ring.rank - step) % ring.world_size
            if step < ring.world_size - 1:
                incoming, works = ring.start_pass(kv)
            ks, vs = _halves(kv[0]), _halves(kv[1])
            for i, j, diagonal in _pairs(mine, chunk_ids(owner, ring.world_size, load_balanced)):
                block_out, block_lse = block_attention(qs[i], ks[j], vs[j], diagonal)
                outs[i], lses[i] = merge_partials(outs[i], lses[i], block_out, block_lse)
            if step < ring.world_size - 1:
                for work in works:
                    work.wait()
                kv = incoming
        out, lse = torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = (group, load_balanced, stats)  # type: ignore[attr-defined]
        return out
# --8<-- [end:ring_forward]

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx,
                 grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors  # type: ignore[attr-defined]
        group, lb, stats = ctx.options  # type: ignore[attr-defined]
        ring = _Ring(group, stats)
        mine = chunk_ids(ring.rank, ring.world_size, lb)
        scale = 1.0 / math.sqrt(q.shape[-1])
        # softmax backward: dS = P * (dP - rowsum(dO * O)), with P rebuilt from the saved lse.
        delta = (grad_out * out).sum(dim=-1)
        qs, dos, lses, deltas = _halves(q), _halves(grad_out), _halves(lse.unsqueeze(-1)), _halves(
            delta.unsqueeze(-1))
        dq = [torch.zeros_like(half) for half in qs]
        kv, dkv = torch.stack([k, v]), torch.zeros(2, *k.shape, dtype=k.dtype, device=k.device)
        for step in range(ring.world_size):
            owner = (ring.rank - step) % ring.world_size
            if step < ring.world_size - 1:
                incoming, works = ring.start_pass(kv)
            ks, vs = _halves(kv[0]), _halves(kv[1])
            dks, dvs = _halves(dkv[0]), _halves(dkv[1])
            for i, j, diagonal in _pairs(mine, chunk_ids(owner, ring.world_size, lb)):
                scores = (qs[i] @ ks[j].transpose(-2, -1)) * scale
                if diagonal:
                    scores = scores.masked_fill(_future(scores.shape[-1], q.device), float("-inf"))
                probs = torch.exp(scores - lses[i])
                dvs[j].add_(probs.transpose(-2, -1) @ dos[i])
                dscores = probs * (dos[i] @ vs[j].transpose(-2, -1) - deltas[i]) * scale
                dq[i].add_(dscores @ ks[j])
                dks[j].add_(dscores.transpose(-2, -1) @ qs[i])
            if step < ring.world_size - 1:
                for work in works:
                    work.wait()
                kv = incoming
            # The gradients follow their chunk: after world_size passes they are back home,
            # holding every rank's contribution.
            dkv = ring.pass_on(dkv)
        return torch.cat(dq, dim=-2), dkv[0], dkv[1], None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   group: dist.ProcessGroup | None = None, load_balanced: bool = True,
                   stats: CommStats | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys.

    Every rank of `group` calls this with its own tokens (`shard_sequence` with the same
    `load_balanced`); the result is this rank's rows of full causal softmax attention, and
    its backward gives this rank's rows of dq, dk and dv.

    Args:
        q: This rank's queries, (batch, heads, 2 * chunk, head_dim).
        k: This rank's keys, the same shape.
        v: This rank's values, the same shape.
        group: The context-parallel process group (the default group if None).
        load_balanced: The chunk assignment the tokens were sharded with.
        stats: If given, counts the bytes this rank sends, forward and backward.
    """
    out: torch.Tensor = _RingAttention.apply(q, k, v, group, load_balanced, stats)
    return out


# --8<-- [start:parallelize]
def parallelize(model: nn.Module, group: dist.ProcessGroup | None, load_balanced: bool = True,
                attention: Callable[..., torch.Tensor] = ring_attention) -> nn.Module:
    """Make `model` run on this rank's tokens of every sequence, attending over all of them.

    Every attention block attends with `attention` over `group` (ring attention, or any
    function of `ring_attention`'s signature and contract), and the model embeds
    its input at this rank's positions (`shard_sequence` of 0..t-1); every other layer
    treats tokens one at a time. The weights stay whole on every rank; each rank's loss
    covers its tokens, so the gradient of the mean loss is the mean of the ranks'.

    Raises:
        ValueError: The model uses dropout, whose masks would differ from one process's.
    """
    for module in model.modules():
        if isinstance(module, Block):
            if module.dropout:
                raise ValueError("context parallel needs dropout 0: its attention has no dropout")
            module.attention = partial(attention, group=group, load_balanced=load_balanced)
        if isinstance(module, TinyTransformer):
            module.register_forward_pre_hook(partial(_at_my_positions, group, load_balanced), with_kwargs=True)
    return model


def _at_my_positions(group: dist.ProcessGroup | None, load_balanced: bool, module: nn.Module,
                     args: tuple[torch.Tensor, ...], kwargs: dict[str, torch.Tensor]
                     ) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    """Pass the positions of this rank's tokens to the model's forward, unless given."""
    if "positions" not in kwargs and len(args) == 1:
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        whole = torch.arange(world_size * args[0].shape[1], device=args[0].device)
        kwargs = {**kwargs, "positions": shard_sequence(whole, rank, world_size, load_balanced, dim=0)}
    return args, kwargs


class SequenceShard(Dataset[Sample]):
    """A token dataset as one context-parallel rank sees it: its tokens of every sample.

    The ranks of a context-parallel group read the same samples (the sampler gives them
    one data-parallel shard) and each keeps its chunks of the inputs and of the targets.
    """

    def __init__(self, dataset: Dataset[Sample], rank: int, world_size: int, load_balanced: bool = True) -> None:
        self.dataset, self.rank, self.world_size, self.load_balanced = dataset, rank, world_size, load_balanced

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Sample:
        inputs, targets, index = self.dataset[index]
        return (shard_sequence(inputs, self.rank, self.world_size, self.load_balanced, dim=0),
                shard_sequence(targets, self.rank, self.world_size, self.load_balanced, dim=0), index)


def wrap(model: nn.Module, mesh: DeviceMesh, cfg: TrainConfig) -> nn.Module:
    """The trainer's context parallel (`--cp-degree`): `parallelize` over the cp axis's group,
    with load-balanced chunks. The data-parallel wrapper that follows spans the cp ranks
    too (`data_parallel.data_mesh`) and averages their gradients."""
    return parallelize(model, mesh.get_group())


def shard_data(dataset: Dataset[Sample], dims: ParallelDims, rank: int) -> Dataset[Sample]:
    """What global `rank` reads under context parallel: its chunks of every sample."""
    return SequenceShard(dataset, dims.coordinates(rank)["cp"], dims.cp)
# --8<-- [end:parallelize]


# --8<-- [start:balance]
def score_blocks_per_step(world_size: int, load_balanced: bool) -> list[list[int]]:
    """Chunk-pair score blocks each rank computes at each ring step, indexed by step, then rank.

    A rank attends its two query chunks to the two key chunks it holds at that step; the
    causal mask skips a key chunk later than the query chunk, so a pair costs one block
    (the diagonal, half masked, is counted whole: a blockwise kernel pays for all of it).
    """
    return [[len(_pairs(chunk_ids(rank, world_size, load_balanced),
                        chunk_ids((rank - step) % world_size, world_size, load_balanced)))
             for rank in range(world_size)] for step in range(world_size)]


def idle_share(world_size: int, load_balanced: bool) -> list[float]:
    """The fraction of the ring's time each rank waits, idle, for the busiest rank.

    The ring advances in lock step (a step ends when every chunk has been passed on), so a
    step lasts as long as its busiest rank's blocks.
    """
    steps = score_blocks_per_step(world_size, load_balanced)
    span = sum(max(blocks) for blocks in steps)
    return [1 - sum(blocks[rank] for blocks in steps) / span for rank in range(world_size)]
# --8<-- [end:balance]


# --8<-- [start:comm_volume]
def ring_bytes_per_layer(batch: int, seq_len: int, d_model: int, world_size: int,
                         bytes_per_element: int = 4) -> dict[str, int]:
    """Bytes one rank sends for one attention layer, forward and backward.

    Forward: its key and value chunk (2 x batch x seq_len/W x d_model elements) passes on
    W - 1 times. Backward: the key/value chunks go round again (W - 1 passes) and their
    gradients, the same size, make W passes to come home.
    """
    chunk = 2 * batch * (seq_len // world_size) * d_model * bytes_per_element
    return {"forward": (world_size - 1) * chunk, "backward": (2 * world_size - 1) * chunk}
# --8<-- [end:comm_volume]

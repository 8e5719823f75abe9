"""Mixture of experts and expert parallel: top-k routing with a capacity, all-to-all dispatch.

A mixture-of-experts (MoE) feed-forward block replaces one MLP with `n_experts` of them and
a router that sends each token to `top_k` of them. Every expert has a capacity per batch,
`ceil(capacity_factor x tokens x top_k / n_experts)` token slots; a token routed to a full
expert is dropped there: that expert adds nothing to it and the residual carries it
through. The router is trained to spread the load by the Switch/GShard auxiliary loss,
`n_experts x sum_i f_i x P_i`.

Expert parallel splits the experts over the `ep_degree` ranks of a process group; the
router and everything outside the block stay whole on every rank, and each rank routes
its own tokens. Two all-to-alls move the tokens: dispatch sends each (token, expert) row to
the rank that holds the expert, combine sends the expert's output back. The number of rows
each rank sends each other rank changes with every batch, so the ranks first exchange the
counts (a small all-to-all of integers), then the rows with `all_to_all_single` and those
split sizes, as torchtitan's expert parallel does (Megatron-LM's all-to-all dispatcher
all-gathers the counts instead).

Proven on gloo: tests/distributed/test_expert_parallel.py checks that 2 and 4 ranks compute
what one process holding every expert computes (outputs, auxiliary loss, dropped tokens and the
gradients), and that the bytes they pass to `all_to_all_single` are
`reference_impl.calc.moe_all_to_all`'s.

In the trainer (`--n-experts E`, `--ep-degree N`) every transformer block's MLP is a `MoE`
block, and `wrap` carves expert-parallel groups of `N` consecutive ranks out of the
data-parallel ranks: every rank reads its own samples, holds `E / N` experts (the ranks at one
position of every group hold the same ones) and the whole of everything else.
`ExpertGradients` averages the replicated parameters' gradients over all data ranks and each
expert's over the ranks that hold it, through the trainer's gradient sync (as DDP's are), so
the step is one process's on the global batch;
tests/distributed/test_expert_parallel.py checks that the losses are one process's (one and
two groups) and that a killed run resumes bit for bit.
"""

from __future__ import annotations

# --8<-- [start:imports]
import math
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

# --8<-- [end:imports]
from reference_impl.config import TrainConfig

TOP_K = 2  # the trainer's routing: each token to its two likeliest experts (GShard, Mixtral)
CAPACITY_FACTOR = 1.25  # the trainer's token slots per expert, over an even share


# --8<-- [start:route]
def expert_capacity(tokens: int, n_experts: int, top_k: int, capacity_factor: float) -> int:
    """Token slots per expert: `ceil(capacity_factor x tokens x top_k / n_experts)`."""
    return math.ceil(capacity_factor * tokens * top_k / n_experts)


@dataclass
class Routing:
    """Where a batch's tokens go. One entry per kept (token, expert) assignment, sorted by
    expert (so, with experts placed in order, by the rank that holds the expert)."""

    expert: torch.Tensor  # the expert of each kept assignment
    token: torch.Tensor  # the row of the batch it takes
    gate: torch.Tensor  # the weight of the expert's output in the token's sum
    counts: torch.Tensor  # kept assignments per expert, all experts
    aux_loss: torch.Tensor  # n_experts x sum_i f_i x P_i
    dropped: int  # assignments over capacity


def route(x: torch.Tensor, router: nn.Linear, top_k: int, capacity_factor: float) -> Routing:
    """Top-k routing of the tokens `x` (tokens x hidden) with softmax gates and a capacity."""
    tokens, n_experts = x.shape[0], router.out_features
    probs = F.softmax(router(x), dim=-1)
    top_p, top_e = probs.topk(top_k, dim=-1)
    # One expert: its probability is the gate (Switch), so the router learns through it.
    # Two: the pair is renormalised to sum to 1 (GShard).
    gates = top_p if top_k == 1 else top_p / top_p.sum(dim=-1, keepdim=True)
    # Choice-major order: every token's first choice queues for its expert before any
    # token's second choice, so overflow drops second choices first.
    expert, gate = top_e.t().reshape(-1), gates.t().reshape(-1)
    token = torch.arange(tokens, device=x.device).repeat(top_k)
    one_hot = F.one_hot(expert, n_experts)
    place = (one_hot.cumsum(dim=0) * one_hot).sum(dim=-1) - 1  # place in its expert's queue
    keep = place < expert_capacity(tokens, n_experts, top_k, capacity_factor)
    # f_i (the share of assignments, before dropping) carries no gradient; P_i (the mean
    # router probability) does, and is what the loss pushes towards balance.
    share = one_hot.sum(dim=0).to(probs.dtype) / (tokens * top_k)
    aux_loss = n_experts * (share * probs.mean(dim=0)).sum()
    order = torch.argsort(expert[keep], stable=True)
    kept = expert[keep][order]
    return Routing(kept, token[keep][order], gate[keep][order], torch.bincount(kept, minlength=n_experts),
                   aux_loss, int((~keep).sum()))
# --8<-- [end:route]


# --8<-- [start:dispatch]
class AllToAll(torch.autograd.Function):
    """`all_to_all_single` of rows, differentiable: the gradient goes back the way the rows
    came, so the backward is the same call with the split sizes swapped."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        received = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        dist.all_to_all_single(received, rows.contiguous(), out_splits, in_splits, group=group)
        return received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out_splits, in_splits = ctx.splits
        return AllToAll.apply(grad, in_splits, out_splits, ctx.group), None, None, None


def dispatch(x: torch.Tensor, routing: Routing, group: dist.ProcessGroup | None
             ) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    """Send every kept (token, expert) row to the rank that holds the expert.

    Returns:
        The rows this rank received, the local expert of each, and the split sizes (rows
        sent to, and received from, each rank) that `combine` reverses.
    """
    rows = x[routing.token]
    if group is None:  # one process holds every expert
        return rows, routing.expert, [rows.shape[0]], [rows.shape[0]]
    ep = dist.get_world_size(group)
    local = routing.counts.numel() // ep
    # The split sizes first: each rank learns how many rows of each of its experts every
    # rank will send it.
    received_counts = torch.empty_like(routing.counts)
    dist.all_to_all_single(received_counts, routing.counts, group=group)
    in_splits = routing.counts.view(ep, local).sum(dim=1).tolist()
    out_splits = received_counts.view(ep, local).sum(dim=1).tolist()
    received = AllToAll.apply(rows, out_splits, in_splits, group)
    # The rows come source rank after source rank, each sorted by expert.
    local_expert = torch.arange(local, device=x.device).repeat(ep)
    return received, local_expert.repeat_interleave(received_counts), in_splits, out_splits
# --8<-- [end:dispatch]


# --8<-- [start:combine]
def combine(x: torch.Tensor, expert_out: torch.Tensor, routing: Routing, splits: tuple[list[int], list[int]],
            group: dist.ProcessGroup | None) -> torch.Tensor:
    """Send the experts' outputs back to their tokens' ranks and add them, gated, to the
    residual `x`; a token whose every assignment was dropped comes out as it went in."""
    in_splits, out_splits = splits
    back = expert_out if group is None else AllToAll.apply(expert_out, in_splits, out_splits, group)
    return x.index_add(0, routing.token, back * routing.gate.unsqueeze(-1))
# --8<-- [end:combine]


# --8<-- [start:moe]
class MoEOutput(NamedTuple):
    """What a mixture-of-experts block returns for one rank's batch."""

    out: torch.Tensor  # the block's output, residual included
    aux_loss: torch.Tensor  # the load-balancing loss of this batch
    dropped: int  # (token, expert) assignments over capacity in this batch


class MoE(nn.Module):
    """A mixture-of-experts feed-forward block with a residual: `x + sum_k gate_k x E_k(x)`.

    Each expert is an MLP `gelu(x W1) W2`. With `group` None this process holds every
    expert; with a process group of `ep` ranks, rank r holds experts
    `r x n_experts / ep` to `(r + 1) x n_experts / ep - 1` and the router is whole on every
    rank (its gradient is a data-parallel one: all-reduce it with the rest of the model's).

    Raises:
        ValueError: `top_k` not 1 or 2, a non-positive capacity factor, or experts that
            do not divide evenly over the group.
    """

    def __init__(self, hidden: int, ffn_hidden: int, n_experts: int, top_k: int = 1,
                 capacity_factor: float = 1.25, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        ep = 1 if group is None else dist.get_world_size(group)
        if top_k not in (1, 2) or top_k > n_experts:
            raise ValueError(f"top_k must be 1 or 2 and at most n_experts ({n_experts}), got {top_k}")
        if capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be positive, got {capacity_factor}")
        if n_experts % ep:
            raise ValueError(f"n_experts ({n_experts}) must be a multiple of the expert-parallel degree ({ep})")
        self.top_k, self.capacity_factor, self.group = top_k, capacity_factor, group
        self.router = nn.Linear(hidden, n_experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(n_experts // ep, hidden, ffn_hidden) / math.sqrt(hidden))
        self.w2 = nn.Parameter(torch.randn(n_experts // ep, ffn_hidden, hidden) / math.sqrt(ffn_hidden))
        self.last_aux_loss: torch.Tensor | None = None  # the last forward's, read by the trainer
        self.dropped = 0  # assignments over capacity since the trainer last read it

    def forward(self, x: torch.Tensor, residual: bool = True) -> MoEOutput:
        """The block on tokens `x` (tokens x hidden); without `residual`, the experts' gated sum alone."""
        routing = route(x, self.router, self.top_k, self.capacity_factor)
        rows, expert, in_splits, out_splits = dispatch(x, routing, self.group)
        # In the trainer the expert weights are DTensors sharded over the ep ranks; the math
        # uses this rank's slice.
        w1, w2 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2))
        expert_out = torch.zeros_like(rows)
        for e in range(w1.shape[0]):
            index = (expert == e).nonzero().squeeze(1)
            expert_out = expert_out.index_copy(0, index, F.gelu(rows[index] @ w1[e]) @ w2[e])
        base = x if residual else torch.zeros_like(x)
        out = combine(base, expert_out, routing, (in_splits, out_splits), self.group)
        self.last_aux_loss, self.dropped = routing.aux_loss, self.dropped + routing.dropped
        return MoEOutput(out, routing.aux_loss, routing.dropped)
# --8<-- [end:moe]


def shard_experts(full: MoE, group: dist.ProcessGroup) -> MoE:
    """This rank's expert-parallel copy of `full`: the whole router and its slice of experts.

    Every rank builds the same seeded `full` block and keeps its slice, as pipeline stages
    keep their blocks, so the sharded block computes what `full` computes.
    """
    n_experts, hidden = full.router.out_features, full.router.in_features
    shard = MoE(hidden, full.w1.shape[2], n_experts, full.top_k, full.capacity_factor, group)
    shard.to(full.router.weight.dtype)
    local, rank = shard.w1.shape[0], dist.get_rank(group)
    with torch.no_grad():
        shard.router.weight.copy_(full.router.weight)
        shard.w1.copy_(full.w1[rank * local:(rank + 1) * local])
        shard.w2.copy_(full.w2[rank * local:(rank + 1) * local])
    return shard


class ExpertsMLP(nn.Module):
    """A transformer block's MLP as a mixture of experts (the trainer's `--n-experts`): tokens
    (batch x seq x hidden) in, their experts' gated sum out, routed as one group per batch
    with `TOP_K` (at most `n_experts`) and `CAPACITY_FACTOR`."""

    def __init__(self, hidden: int, ffn_hidden: int, n_experts: int) -> None:
        super().__init__()
        self.moe = MoE(hidden, ffn_hidden, n_experts, min(TOP_K, n_experts), CAPACITY_FACTOR)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x.reshape(-1, x.shape[-1]), residual=False).out.view_as(x)


def aux_loss(model: nn.Module) -> torch.Tensor:
    """The sum of the load-balancing losses of the model's MoE blocks in their last forward."""
    losses = [m.last_aux_loss for m in model.modules() if isinstance(m, MoE) and m.last_aux_loss is not None]
    return torch.stack(losses).sum()


def take_stats(model: nn.Module) -> dict[str, float | int]:
    """For the step log: the last forward's load-balancing loss and the (token, expert)
    assignments dropped on this rank since the last call, which resets the count."""
    blocks = [m for m in model.modules() if isinstance(m, MoE)]
    dropped = sum(m.dropped for m in blocks)
    for m in blocks:
        m.dropped = 0
    return {"aux_loss": float(aux_loss(model).detach()), "dropped_tokens": dropped}


def wrap(model: nn.Module, mesh: DeviceMesh, cfg: TrainConfig) -> nn.Module:
    """The trainer's expert parallel (`--ep-degree`) over the data-parallel ranks.

    `mesh` is the 2-D (ep_replicate, ep) mesh of the data ranks (a 1-D one is all ep).
    Every MoE block keeps its slice of the experts, as DTensors sharded on dim 0 over the
    ep ranks and replicated over the ep_replicate ones (so a checkpoint saves each slice
    once, under the whole tensor's name), and the model carries its `ExpertGradients`,
    which `gradient_sync` runs after each backward that synchronises.
    """
    ep_mesh = mesh["ep"] if mesh.ndim > 1 else mesh
    replicas = mesh["ep_replicate"].get_group() if mesh.ndim > 1 and mesh.shape[0] > 1 else None
    data = mesh._flatten().get_group() if mesh.ndim > 1 else mesh.get_group()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, MoE):
                setattr(parent, name, _sharded_block(child, ep_mesh, mesh))
    model.expert_gradients = ExpertGradients(model, ep_mesh.get_group(), data, replicas)  # type: ignore[assignment]
    return model


# --8<-- [start:gradient_sync]
class ExpertGradients:
    """Makes the data ranks' gradients those of one process holding every expert and
    training on their whole batch (the mean of the ranks' losses).

    Every data rank reads its own samples. The replicated parameters (everything outside
    the experts, routers included) get gradients from this rank's tokens only; they are
    averaged over `data_group`, all the data ranks, which also keeps the copies equal bit for
    bit. An expert's gradient on its rank already sums the contributions of the tokens of
    all ep ranks of `ep_group` (all-to-all carries them back), so it is divided by ep (a
    hook on each expert's gradient), then averaged over `replica_group`, the ranks that
    hold the same experts (none when the ep group is all the data ranks):
    sum / (ep x replicas) = sum / data ranks. Each average is one all-reduce of a flat
    buffer, not one collective per parameter, run by `average` once the backward is done.
    """

    def __init__(self, model: nn.Module, ep_group: dist.ProcessGroup, data_group: dist.ProcessGroup,
                 replica_group: dist.ProcessGroup | None = None) -> None:
        ep = dist.get_world_size(ep_group)
        self.replicated = [p for p in model.parameters() if not isinstance(p, DTensor) and p.requires_grad]
        self.sharded = [p for p in model.parameters() if isinstance(p, DTensor) and p.requires_grad]
        self.data_group, self.replica_group = data_group, replica_group
        for param in self.sharded:  # this rank's experts
            param.register_hook(lambda grad: grad / ep)

    def average(self) -> None:
        """Average the gradients the backward passes so far accumulated (see the class)."""
        with torch.no_grad():
            _average([p.grad for p in self.replicated if p.grad is not None], self.data_group)
            if self.replica_group is not None:
                _average([cast(DTensor, p.grad).to_local() for p in self.sharded if p.grad is not None],
                         self.replica_group)


def _average(grads: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Average `grads` over `group` in one all-reduce per dtype, in the same order on every rank."""
    for dtype in dict.fromkeys(g.dtype for g in grads):
        same = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=group)
        for g, averaged in zip(same, flat.split([g.numel() for g in same]), strict=True):
            g.copy_(averaged.view_as(g))


def gradient_sync(model: nn.Module, enabled: bool) -> AbstractContextManager[None] | None:
    """Expert parallel's entry in the trainer's gradient sync (`registry.gradient_sync`):
    around a micro-batch's forward and backward, average the gradients once the backward is
    done when `enabled`; on the micro-batches that only accumulate, nothing (averages are
    linear, so averaging the sum once equals averaging each part). None for a model without
    expert parallel."""
    gradients = getattr(model, "expert_gradients", None)
    return _average_after(gradients) if enabled and isinstance(gradients, ExpertGradients) else None


@contextmanager
def _average_after(gradients: ExpertGradients) -> Iterator[None]:
    yield  # not in a `finally`: a failed backward leaves the gradients alone
    gradients.average()
# --8<-- [end:gradient_sync]


def _sharded_block(full: MoE, ep_mesh: DeviceMesh, mesh: DeviceMesh) -> MoE:
    """`shard_experts` of `full` over `ep_mesh`, its expert weights as DTensors on `mesh`:
    Shard(0) of the stacked experts over ep, replicated over ep_replicate."""
    block = shard_experts(full, ep_mesh.get_group())
    placements = [Replicate(), Shard(0)] if mesh.ndim > 1 else [Shard(0)]
    for name in ("w1", "w2"):
        local = getattr(block, name).detach()
        setattr(block, name, nn.Parameter(DTensor.from_local(local, mesh, placements, run_check=False)))
    return block

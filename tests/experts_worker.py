"""A rank of the expert-parallel tests, in a module of its own: a spawned child imports only
this (torch and `reference_impl.parallel.experts`), not the test module's heavier imports.

Both sides build their inputs here, so the ranks and the one-process reference see the
same block and the same tokens.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from reference_impl.parallel import experts, registry
from reference_impl.parallel.experts import MoE, shard_experts

HIDDEN, FFN, TOKENS = 8, 16, 16  # tokens per rank
# name -> (n_experts per rank, top_k, capacity_factor, balanced); run on 2 and on 4 ranks.
CASES: dict[str, tuple[int, int, float, bool]] = {
    "top1_drops": (2, 1, 1.0, False),   # random routing at capacity factor 1: tokens dropped
    "top2_drops": (2, 2, 1.0, False),
    "top2_balanced": (2, 2, 1.0, True),  # every expert gets exactly its capacity: nothing dropped
    "top1_balanced": (1, 1, 1.0, True),
}


def full_block(case: str, ep: int) -> MoE:
    """The block of `case` with every expert, in float64 (so that sums in another order agree to 1e-12)."""
    per_rank, top_k, capacity_factor, _ = CASES[case]
    torch.manual_seed(0)
    return MoE(HIDDEN, FFN, per_rank * ep, top_k, capacity_factor).double()


def inputs(case: str, ep: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s tokens and the weights of its loss `(out x target).sum() + aux_loss`.

    Balanced cases send token t first to expert t mod E and second to expert t + 1 mod E,
    through a router that reads the first E features: every expert gets the same number of
    rows from every rank.
    """
    n_experts = CASES[case][0] * ep
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=gen, dtype=torch.float64)
    target = torch.randn(TOKENS, HIDDEN, generator=gen, dtype=torch.float64)
    if CASES[case][3]:
        t = torch.arange(TOKENS)
        x[:, :n_experts] *= 0.1
        x[t, t % n_experts] += 4.0
        x[t, (t + 1) % n_experts] += 2.0
    return x.requires_grad_(), target  # the block's input has a gradient, as inside a model


def balance(block: MoE) -> None:
    """The router of the balanced cases: logits are the first `n_experts` features."""
    with torch.no_grad():
        block.router.weight.zero_()
        block.router.weight.fill_diagonal_(1.0)


class Tiny(nn.Module):
    """A linear, an MoE block and a linear: replicated parameters on both sides of the experts."""

    def __init__(self, n_experts: int) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.moe = MoE(HIDDEN, FFN, n_experts, top_k=2, capacity_factor=2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, aux_loss, _ = self.moe(self.inp(x))
        return self.out(h).sum() + aux_loss


def gradient_sync(world_size: int) -> dict[str, Any]:
    """Two micro-batches of `Tiny` under the trainer's expert parallel (`experts.wrap`) and
    gradient sync (the first only accumulates, the second synchronises), counting the
    all-reduces issued; the same tokens on every rank."""
    torch.manual_seed(0)
    model = experts.wrap(Tiny(2 * world_size), init_device_mesh("cpu", (world_size,)), None)  # type: ignore[arg-type]
    count, real = [0], dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return real(*args, **kwargs)

    dist.all_reduce = counting  # type: ignore[assignment] - the module calls it through dist
    try:
        x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(7))
        for micro in range(2):  # two micro-batches: gradients accumulate, the last one syncs
            with registry.gradient_sync(model, enabled=micro == 1):
                model(x).backward()
    finally:
        dist.all_reduce = real
    replicated = {n: p.grad for n, p in model.named_parameters() if n.split(".")[0] in ("inp", "out")}
    return {"all_reduces": count[0], "replicated": replicated,
            "router": model.moe.router.weight.grad}


def ep_rank(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Run every case on this rank's tokens with its slice of the experts; save the outputs,
    the gradients (the router's summed over the ranks, as data parallel would) and every
    `all_to_all_single` this rank called."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    calls: list[dict[str, Any]] = []
    real = dist.all_to_all_single

    def recording(output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None = None,
                  input_split_sizes: list[int] | None = None, **kwargs: Any) -> Any:
        row = input[0].numel() * input.element_size() if input.numel() else 0
        own = (input_split_sizes[rank] if input_split_sizes is not None else input.shape[0] // world_size)
        own_in = (output_split_sizes[rank] if output_split_sizes is not None else output.shape[0] // world_size)
        calls.append({"dtype": str(input.dtype), "buffer": input.numel() * input.element_size(),
                      "sent": (input.shape[0] - own) * row, "received": (output.shape[0] - own_in) * row})
        return real(output, input, output_split_sizes, input_split_sizes, **kwargs)

    dist.all_to_all_single = recording  # type: ignore[assignment] - the module calls it through dist
    try:
        results = {}
        for case in CASES:
            full = full_block(case, world_size)
            if CASES[case][3]:
                balance(full)
            block = shard_experts(full, dist.group.WORLD)
            x, target = inputs(case, world_size, rank)
            calls.clear()
            out, aux_loss, dropped = block(x)
            ((out * target).sum() + aux_loss).backward()
            assert block.router.weight.grad is not None
            dist.all_reduce(block.router.weight.grad)
            results[case] = {"out": out.detach(), "aux_loss": aux_loss.detach(), "dropped": dropped,
                             "router": block.router.weight.grad, "w1": block.w1.grad, "w2": block.w2.grad, "x": x.grad,
                             "calls": list(calls)}
        results["gradient_sync"] = gradient_sync(world_size)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.all_to_all_single = real
        dist.destroy_process_group()

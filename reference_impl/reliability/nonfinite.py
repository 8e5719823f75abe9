"""Non-finite losses: every rank agrees that a step went bad, and the bad rank names the first
module whose output went non-finite, by replaying the step's forward with hooks."""

# --8<-- [start:imports]
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

# --8<-- [end:imports]
from reference_impl.config import TrainConfig
from reference_impl.distributed import DistContext
from reference_impl.metrics import EventLog
from reference_impl.model import loss_fn
from reference_impl.parallel.registry import unwrap
from reference_impl.step import autocast

Inputs = list[tuple[torch.Tensor, torch.Tensor]]  # a step's micro-batches: (inputs, targets)


class NonFiniteLoss(RuntimeError):
    """A loss became NaN or inf outside fp16 (where the GradScaler handles it)."""


class NonFiniteGuard:
    """Decides, on every rank alike, whether a step's update may be applied.

    After the backward and before the optimizer, each rank puts one flag (its loss is not
    finite) into one all_reduce (MAX), so all ranks skip, stop or roll back together; a rank
    that stepped alone would leave the replicas different. Only when the flag is up do the
    ranks learn which of them went bad (an all_gather) and replay the step's forward
    together with hooks on every module (`first_nonfinite`): a healthy step pays one scalar
    collective and one host read, and no hook. Each bad rank emits `nonfinite` with its
    rank, the step and the module.
    """

    def __init__(self, model: nn.Module, cfg: TrainConfig, ctx: DistContext, log: EventLog) -> None:
        self.model, self.cfg, self.ctx, self.log = model, cfg, ctx, log
        self.bad_ranks: list[int] = []  # of the last step checked; empty when it was applied
        self.module: str | None = None  # this rank's first non-finite output in that step

    # --8<-- [start:nonfinite_agree]
    def approve(self, loss: torch.Tensor, inputs: Inputs | None, step: int) -> bool:
        """True if every rank's `loss` is finite; else attribute the step and return False."""
        mine = (~loss.detach().isfinite()).float().reshape(1)
        flag = mine.clone()  # the all-reduce overwrites it with every rank's verdict
        if self.ctx.distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():  # the one host read of a healthy step
            self.bad_ranks, self.module = [], None
            return True
        self.bad_ranks = self._ranks_with(mine)
        self.module = self.first_nonfinite(inputs) if inputs is not None else None
        if self.ctx.rank in self.bad_ranks:
            self.log.emit("nonfinite", rank=self.ctx.rank, step=step, module=self.module,
                          loss=str(loss.item()))
        return False
    # --8<-- [end:nonfinite_agree]

    def _ranks_with(self, flag: torch.Tensor) -> list[int]:
        if not self.ctx.distributed:
            return [0]
        flags = [torch.empty_like(flag) for _ in range(self.ctx.world_size)]
        dist.all_gather(flags, flag)
        return [rank for rank, f in enumerate(flags) if f.item()]

    def first_nonfinite(self, inputs: Inputs) -> str | None:
        """The first module, in the order outputs are produced, whose output is not finite
        when this step's forward runs again; "loss" when only the loss is; None when the
        replay is finite (a fault that does not repeat).

        Every rank replays, so the collectives inside a sharded forward match. The replay
        draws dropout masks from a forked RNG stream: the training stream is left as it was.
        """
        names = {module: name or "(model)" for name, module in unwrap(self.model).named_modules()}
        found: list[str] = []

        def hook(module: nn.Module, args: object, output: object) -> None:
            if not found and not finite(output):
                found.append(names[module])

        handles = [module.register_forward_hook(hook) for module in names]
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        try:
            with (torch.no_grad(), torch.random.fork_rng(devices=devices),
                  autocast(inputs[0][0].device, self.cfg)):
                for x, y in inputs:
                    loss = loss_fn(self.model(x), y)
                    if not found and not finite(loss):
                        found.append("loss")
        finally:
            for handle in handles:
                handle.remove()
        return found[0] if found else None


def finite(output: object) -> bool:
    """True if every floating-point tensor in `output` (this rank's shard of a DTensor) is finite."""
    for leaf in tree_leaves(output):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            local = leaf.to_local() if isinstance(leaf, DTensor) else leaf
            if not bool(local.isfinite().all()):
                return False
    return True

"""Straggler detection: which rank makes the others wait, from every rank's own step times."""

# --8<-- [start:imports]
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

# --8<-- [end:imports]
from reference_impl.config import TrainConfig
from reference_impl.distributed import DistContext
from reference_impl.metrics import EventLog, PhaseTimer

# Phases in which a rank can block on a slower peer: DDP's gradient all-reduce finishes inside
# the backward, every rank agrees that the loss is finite after it, and a pipeline stage waits
# for its neighbours' activations. Time spent there is the straggler's time showing up on
# everyone else, so it is left out of a rank's own.
WAITING_PHASES = ("backward", "finite_check", "pipeline")


class StragglerMonitor:
    """Names the rank that holds the others back, once, from one small all_gather per window.

    A synchronous collective makes every rank's wall-clock step as long as the slowest
    rank's, so wall time cannot tell who is slow. Each rank therefore times its own work:
    the step minus the phases where it waits for peers (`WAITING_PHASES`). Every
    `straggler_window` steps the ranks all_gather these per-step times; a rank whose median
    is at least `straggler_threshold` times the median of the others' medians is slow in
    that window. Medians, not sums, so that a descheduled step on a loaded machine does not
    count; `straggler_patience` slow windows in a row make it a straggler, reported once
    (`straggler` event: its rank, the step, and its slowdown over the others). On CPU the
    phases are host-timed; on a GPU the waiting phases are timed by CUDA events, which this
    host clock cannot subtract, so there a rank's time is its whole step.
    """

    def __init__(self, cfg: TrainConfig, ctx: DistContext, log: EventLog, timer: PhaseTimer) -> None:
        self.ctx, self.log, self.timer = ctx, log, timer
        self.window, self.patience, self.threshold = (cfg.straggler_window, cfg.straggler_patience,
                                                      cfg.straggler_threshold)
        self.strikes = [0] * ctx.world_size
        self.reported: set[int] = set()
        self._times: list[float] = []
        # A gloo group even under NCCL: host floats travel without touching the device.
        self._group = dist.new_group(backend="gloo") if ctx.distributed and ctx.backend != "gloo" else None

    def start_step(self) -> tuple[float, float]:
        """What `end_step` needs: the clock and the seconds already spent waiting."""
        return time.perf_counter(), self._waited()

    def end_step(self, step: int, started: tuple[float, float]) -> None:
        """Record this rank's own time for `step`; at a window's end, compare all ranks'."""
        if not self.ctx.distributed:
            return
        clock, waited = started
        self._times.append(time.perf_counter() - clock - (self._waited() - waited))
        if len(self._times) == self.window:
            self._compare(step)

    def _waited(self) -> float:
        return sum(self.timer.host_seconds(name) for name in WAITING_PHASES)

    # --8<-- [start:straggler_rule]
    def _compare(self, step: int) -> None:
        mine = torch.tensor(self._times, dtype=torch.float64)
        self._times.clear()
        gathered = [torch.empty_like(mine) for _ in range(self.ctx.world_size)]
        dist.all_gather(gathered, mine, group=self._group)
        medians = [statistics.median(times.tolist()) for times in gathered]
        for rank, own in enumerate(medians):
            others = statistics.median(medians[:rank] + medians[rank + 1:])
            slowdown = own / max(others, 1e-9)
            self.strikes[rank] = self.strikes[rank] + 1 if slowdown >= self.threshold else 0
            if self.strikes[rank] >= self.patience and rank not in self.reported:
                self.reported.add(rank)
                self.log.progress("straggler", rank=rank, step=step, slowdown=round(slowdown, 2))
    # --8<-- [end:straggler_rule]

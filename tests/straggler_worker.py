"""A rank of the straggler-rule test, in a module of its own: a forked child imports only this
(torch and `reference_impl.reliability.stragglers`), not the test module's heavier imports."""

from __future__ import annotations

import io
import json
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from reference_impl.config import TrainConfig
from reference_impl.distributed import DistContext
from reference_impl.metrics import EventLog, PhaseTimer
from reference_impl.reliability.stragglers import StragglerMonitor

STEP_S, SLOW_S = 0.01, 0.1  # every step's work on both ranks; the extra of a slow step on rank 1
WINDOW = 5
# Which steps of rank 1 sleep, per case; rank 0 never does. Windows are steps 1-5, 6-10, ...
CASES = {
    "one_slow_step_per_window": [w * WINDOW + 3 for w in range(6)],
    "two_slow_windows": list(range(6, 16)),
    "three_slow_windows": list(range(6, 26)),
}
STEPS = 30


def monitored_ranks(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """One rank of a real gloo group: each case's steps through a fresh `StragglerMonitor`
    with the default threshold and patience; the straggler events of each case go to
    `rank{rank}.json`."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        ctx = DistContext(rank, rank, world_size, torch.device("cpu"), "gloo")
        cfg = TrainConfig(straggler_window=WINDOW, world_size=world_size)
        events = {}
        for case, slow_steps in CASES.items():
            log = io.StringIO()
            monitor = StragglerMonitor(cfg, ctx, EventLog(rank, log), PhaseTimer(ctx.device))
            for step in range(1, STEPS + 1):
                started = monitor.start_step()
                time.sleep(STEP_S + (SLOW_S if rank == 1 and step in slow_steps else 0.0))
                monitor.end_step(step, started)
            events[case] = [json.loads(line) for line in log.getvalue().splitlines()]
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(events))
    finally:
        dist.destroy_process_group()

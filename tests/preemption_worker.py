"""A rank of the preemption test, in a module of its own: a spawned child imports only this
(torch and `reference_impl.lifecycle`), not the test module's heavier imports."""

from __future__ import annotations

import io
import json
import os
import signal
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from reference_impl.distributed import DistContext
from reference_impl.lifecycle import Preemption
from reference_impl.metrics import EventLog


def signalled_ranks(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """One rank of a real gloo group: what `should_stop` answers with no signal, then after a
    real SIGTERM reached only rank 1, then (a fresh `Preemption`) only rank 0."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        ctx = DistContext(rank, rank, world_size, torch.device("cpu"), "gloo")
        answers = {}
        for signalled in (None, 1, 0):
            log = io.StringIO()
            with Preemption(60.0, ctx, EventLog(rank, log)) as stop:
                if rank == signalled:
                    os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next line
                answers[str(signalled)] = {"requested": stop.requested, "stop": stop.should_stop(),
                                           "logged": "sigterm_received" in log.getvalue()}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(answers))
    finally:
        dist.destroy_process_group()

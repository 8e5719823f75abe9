"""A rank of the preemption test, in a module of its own: a spawned child imports only this
(torch and `reference_impl.reliability.lifecycle`), not the test module's heavier imports."""

from __future__ import annotations

import io
import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from reference_impl.distributed import DistContext
from reference_impl.reliability.lifecycle import Preemption
from reference_impl.metrics import EventLog


STEP_S, GRACE_S, SIGNAL_AT, STEPS = 0.01, 3.0, 7, 100


def signalled_ranks(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """One rank of a real gloo group running `STEPS` steps of `STEP_S` seconds: the step at
    which `should_stop` first answers True and how many all-reduces it started, with no
    signal, then with a real SIGTERM to rank 1 only at step `SIGNAL_AT`, then (a fresh
    `Preemption`) to rank 0 only."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        ctx = DistContext(rank, rank, world_size, torch.device("cpu"), "gloo")
        answers = {}
        for signalled in (None, 1, 0):
            log = io.StringIO()
            stopped_at = None
            with Preemption(GRACE_S, ctx, EventLog(rank, log)) as stop:
                for step in range(1, STEPS + 1):
                    time.sleep(STEP_S)  # the step's work
                    if rank == signalled and step == SIGNAL_AT:
                        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next line
                    if stop.should_stop(step):
                        stopped_at = step
                        break
            answers[str(signalled)] = {"requested": stop.requested, "stopped_at": stopped_at,
                                       "steps": step, "agreements": stop.agreements,
                                       "logged": "sigterm_received" in log.getvalue()}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(answers))
    finally:
        dist.destroy_process_group()


BLOCKED_GRACE_S = 2.0


def blocked_in_a_collective(rank: int, port: int, out_dir: str) -> None:
    """One rank of two: rank 0 enters `Preemption(BLOCKED_GRACE_S)` and an all-reduce that
    rank 1 never joins; the group's timeout (600 s) is far beyond any grace. Rank 1 sleeps.
    The test sends rank 0 SIGTERM and times its exit; its events go to `rank0.jsonl`."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=600))
    if rank == 1:
        time.sleep(600)  # never joins the collective; the test kills it
        os._exit(0)
    ctx = DistContext(0, 0, 2, torch.device("cpu"), "gloo")
    with Path(out_dir, "rank0.jsonl").open("w") as events, Preemption(BLOCKED_GRACE_S, ctx, EventLog(0, events)):
        Path(out_dir, "blocked").write_text("")
        dist.all_reduce(torch.ones(1))  # blocks until the group's timeout: rank 1 is asleep
    os._exit(0)  # the collective returned: not what the test expects

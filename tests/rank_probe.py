"""A tiny `main` for the tests of `forked_ranks`: one rank exits with a chosen status, hangs,
or fails on the first attempt only, so the launcher's failure, timeout and restart paths
take a second, not a training run."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    """`exit RANK STATUS`: that rank returns STATUS; `hang RANK PIDFILE`: that rank writes
    its pid to PIDFILE and sleeps. Every other rank returns 0. `crash-once RANK STATUS`: on
    the first attempt that rank returns STATUS while the others wait for a SIGTERM (and
    report it); on later attempts every rank reports its attempt and returns 0. `crash-once`
    takes a fourth argument, a directory where the waiting ranks say they are ready, so
    the failing rank fails only once every other rank can report the SIGTERM."""
    action, rank = argv[0], argv[1]
    if action == "crash-once":
        return _crash_once(rank, int(argv[2]), Path(argv[3]))
    if os.environ["RANK"] != rank:
        return 0
    if action == "exit":
        print(f"rank {rank} fails on purpose", flush=True)
        return int(argv[2])
    Path(argv[2]).write_text(str(os.getpid()))
    time.sleep(600)
    return 0


def _crash_once(rank: str, status: int, ready: Path) -> int:
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    if attempt != "0":
        print(f"rank {os.environ['RANK']} runs attempt {attempt}", flush=True)
        return 0
    if os.environ["RANK"] == rank:
        while len(list(ready.iterdir())) < int(os.environ["WORLD_SIZE"]) - 1:
            time.sleep(0.05)
        return status

    def stopped(signum: int, _frame: object) -> None:
        print(f"rank {os.environ['RANK']} got signal {signum}", flush=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, stopped)
    (ready / os.environ["RANK"]).touch()
    time.sleep(600)
    return 0

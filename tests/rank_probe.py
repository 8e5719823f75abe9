"""A tiny `main` for the tests of `forked_ranks`: one rank exits with a chosen status or
hangs, so the launcher's failure and timeout paths take a second, not a training run."""

from __future__ import annotations

import os
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    """`exit RANK STATUS`: that rank returns STATUS; `hang RANK PIDFILE`: that rank writes
    its pid to PIDFILE and sleeps. Every other rank returns 0."""
    action, rank = argv[0], argv[1]
    if os.environ["RANK"] != rank:
        return 0
    if action == "exit":
        print(f"rank {rank} fails on purpose", flush=True)
        return int(argv[2])
    Path(argv[2]).write_text(str(os.getpid()))
    time.sleep(600)
    return 0

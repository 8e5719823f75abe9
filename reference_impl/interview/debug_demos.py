"""Two broken distributed jobs to practise debugging on, under torchrun with gloo.

    torchrun --standalone --nproc-per-node 2 -m reference_impl.interview.debug_demos mismatch
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc-per-node 2 \\
        -m reference_impl.interview.debug_demos mismatch
    torchrun --standalone --nproc-per-node 2 -m reference_impl.interview.debug_demos stuck
    TORCH_FR_BUFFER_SIZE=2000 torchrun --standalone --nproc-per-node 4 \\
        -m reference_impl.interview.debug_demos behind --timeout-s 5 --trace-dir /tmp/fr

The debugging page shows what each tool reports for them; tests/distributed/test_debugging.py
runs every recipe.
"""

from __future__ import annotations

import argparse
import signal
import sys
from datetime import timedelta

# isort: split
# --8<-- [start:imports]
import time

import torch
import torch.distributed as dist

# --8<-- [end:imports]
# isort: split
# --8<-- [start:fr_imports]
import json
import os
from pathlib import Path
from typing import Any

# --8<-- [end:fr_imports]


# --8<-- [start:mismatch]
def mismatched_collective() -> None:
    """Every rank all-reduces, but the shapes disagree: rank r sends 4 + r values.

    The same bug appears when a data-dependent branch makes one rank skip a parameter, or
    when ranks build buckets from differently ordered parameters.
    """
    rank = dist.get_rank()
    grads = torch.ones(4 + rank)
    dist.all_reduce(grads)  # ranks disagree: a crash, a hang, or silently wrong numbers
# --8<-- [end:mismatch]


# --8<-- [start:stuck]
def stuck_collective() -> None:
    """Rank 1 never reaches the all-reduce (a stuck data loader, say); rank 0 waits in it."""
    if dist.get_rank() == 1:
        while True:
            time.sleep(1)
    dist.all_reduce(torch.ones(4))  # rank 0 blocks here until the group's timeout
# --8<-- [end:stuck]


# --8<-- [start:behind]
TIMEOUT_S = 60.0  # the process group's timeout (main sets it from --timeout-s)


def rank_behind(steps: int = 3, late_rank: int = 2) -> None:
    """Every rank all-reduces once per step, but `late_rank` stops before its last step
    (a hung loader or file system): the others enter that all-reduce and time out."""
    for step in range(steps):
        if dist.get_rank() == late_rank and step == steps - 1:
            time.sleep(TIMEOUT_S + 2)  # outside any collective until the others have given up
            raise RuntimeError(f"rank {late_rank} was stuck before step {step}'s all-reduce")
        dist.all_reduce(torch.ones(4))
# --8<-- [end:behind]


# --8<-- [start:dump]
def dump_flight_recorder(trace_dir: str) -> None:
    """Write this rank's flight-recorder buffer, its recent collectives and, per process
    group, the sequence number of the last one it entered, to `<trace_dir>/rank_<r>.json`.
    NCCL's watchdog dumps every rank by itself on a timeout (TORCH_NCCL_DUMP_ON_TIMEOUT);
    gloo does not, so the demo dumps when its wait ends."""
    os.makedirs(trace_dir, exist_ok=True)
    with open(os.path.join(trace_dir, f"rank_{dist.get_rank()}.json"), "wb") as f:
        f.write(torch._C._distributed_c10d._dump_fr_trace_json())  # type: ignore[attr-defined]  # not in the stubs
# --8<-- [end:dump]


# --8<-- [start:behind_analysis]
def ranks_behind(trace_dir: str) -> dict[str, dict[str, Any]]:
    """Per process group: the newest collective any rank entered (its sequence number and
    operation) and the ranks whose last one is older: those never entered it."""
    last: dict[str, dict[int, int]] = {}
    ops: dict[tuple[str, int], str] = {}
    for path in sorted(Path(trace_dir).glob("rank_*.json")):
        rank = int(path.stem.removeprefix("rank_"))
        trace = json.loads(path.read_text(encoding="utf-8"))
        for pg, status in trace["pg_status"].items():
            last.setdefault(pg, {})[rank] = int(status["last_enqueued_collective"])  # a string in JSON
        for entry in trace["entries"]:
            ops[(str(entry["pg_id"]), int(entry["collective_seq_id"]))] = entry["profiling_name"]
    report = {}
    for pg, by_rank in last.items():
        newest = max(by_rank.values())
        report[pg] = {"seq": newest, "op": ops.get((pg, newest), "?"),
                      "missing": sorted(r for r, seq in by_rank.items() if seq < newest)}
    return report
# --8<-- [end:behind_analysis]


DEMOS = {"mismatch": mismatched_collective, "stuck": stuck_collective, "behind": rank_behind}


def main(argv: list[str] | None = None) -> int:
    """Run one demo inside a gloo group; exit 2 on a bad argument or outside torchrun."""
    parser = argparse.ArgumentParser(prog="python -m reference_impl.interview.debug_demos")
    parser.add_argument("demo", choices=sorted(DEMOS))
    parser.add_argument("--timeout-s", type=float, default=60.0, help="the process group's timeout")
    parser.add_argument("--trace-dir", help="dump each rank's flight recorder here when the demo ends")
    args = parser.parse_args(argv)
    global TIMEOUT_S
    TIMEOUT_S = args.timeout_s
    if "WORLD_SIZE" not in os.environ:
        print("reference_impl.interview.debug_demos: error: run it under torchrun with 2 ranks", file=sys.stderr)
        return 2
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout_s))
    print(f"rank {dist.get_rank()} pid {os.getpid()} running {args.demo}", flush=True)
    if args.trace_dir:
        # torchrun stops the other ranks (SIGTERM) once one fails; a rank stuck outside any
        # collective then dumps on its way out, as every rank does under NCCL's watchdog.
        def dump_and_exit(signum: int, _frame: object) -> None:
            dump_flight_recorder(args.trace_dir)
            os._exit(128 + signum)

        signal.signal(signal.SIGTERM, dump_and_exit)
    try:
        DEMOS[args.demo]()
        dist.barrier()
    finally:
        if args.trace_dir:
            dump_flight_recorder(args.trace_dir)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

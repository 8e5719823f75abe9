"""Two broken distributed jobs to practise debugging on, under torchrun with gloo.

    torchrun --standalone --nproc-per-node 2 -m reference_impl.debug_demos mismatch
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc-per-node 2 \\
        -m reference_impl.debug_demos mismatch
    torchrun --standalone --nproc-per-node 2 -m reference_impl.debug_demos stuck

The debugging page shows what each tool reports for them; tests/distributed/test_debugging.py
runs every recipe.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

# isort: split
# --8<-- [start:imports]
import time

import torch
import torch.distributed as dist

# --8<-- [end:imports]


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


DEMOS = {"mismatch": mismatched_collective, "stuck": stuck_collective}


def main(argv: list[str] | None = None) -> int:
    """Run one demo inside a gloo group; exit 2 on a bad argument or outside torchrun."""
    parser = argparse.ArgumentParser(prog="python -m reference_impl.debug_demos")
    parser.add_argument("demo", choices=sorted(DEMOS))
    parser.add_argument("--timeout-s", type=float, default=60.0, help="the process group's timeout")
    args = parser.parse_args(argv)
    if "WORLD_SIZE" not in os.environ:
        print("reference_impl.debug_demos: error: run it under torchrun with 2 ranks", file=sys.stderr)
        return 2
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout_s))
    print(f"rank {dist.get_rank()} pid {os.getpid()} running {args.demo}", flush=True)
    try:
        DEMOS[args.demo]()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

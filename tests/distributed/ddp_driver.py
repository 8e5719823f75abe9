"""Runs the real training loop under torchrun and records what the DDP tests assert.

Usage: torchrun ... tests/distributed/ddp_driver.py OUT_PREFIX [train flags]
Writes OUT_PREFIX.json (checks) and OUT_PREFIX.pt (final parameters) from rank 0.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from reference_impl.config import TrainConfig
from reference_impl.distributed import distributed
from reference_impl.metrics import EventLog
from reference_impl.parallel.registry import unwrap
from reference_impl.state import TrainState
from reference_impl.train import build_state, train


def main() -> None:
    out = sys.argv[1]
    cfg = TrainConfig.from_cli(sys.argv[2:])
    with distributed("cpu", cfg.pg_timeout_s) as ctx:
        state = build_state(cfg, ctx)
        calls = [0]

        def counting_allreduce(pg: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            calls[0] += 1  # one call per gradient bucket that DDP actually communicates
            return default_hooks.allreduce_hook(pg, bucket)

        state.model.register_comm_hook(None, counting_allreduce)
        identical, calls_per_step = [], []

        def after_step(s: TrainState) -> None:
            flat = torch.nn.utils.parameters_to_vector(s.model.parameters()).detach()
            gathered = [torch.empty_like(flat) for _ in range(ctx.world_size)]
            dist.all_gather(gathered, flat)
            identical.append(all(torch.equal(gathered[0], g) for g in gathered))
            calls_per_step.append(calls[0])
            calls[0] = 0

        train(cfg, ctx, EventLog(ctx.rank), state=state, on_step=after_step)
        # Calibrate: one synchronised backward outside no_sync communicates every bucket once.
        x, y, _ = next(iter(state.loader))
        state.model(x).float().sum().backward()
        if ctx.is_main:
            torch.save(unwrap(state.model).state_dict(), out + ".pt")
            with open(out + ".json", "w") as f:
                json.dump({"identical": identical, "calls_per_step": calls_per_step,
                           "buckets": calls[0], "world_size": ctx.world_size}, f)
        dist.barrier()
        # Skip interpreter teardown: destroying a DDP whose comm hook is a Python function
        # can deadlock (gloo's thread needs the GIL to drop the hook's callback while the
        # main thread holds it). The outputs are on disk; nothing else needs cleaning up.
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()

"""Trains one small transformer eagerly and with `--compile`, under DDP and then under
FSDP2, on the same two ranks, and records what test_compile_parallel.py asserts.

Usage: torchrun --nproc-per-node 2 tests/distributed/compile_worker.py OUT_DIR
Writes OUT_DIR/rank<r>.json. The last step of every run is profiled: the order in which
the compiled blocks, DDP's bucket all-reduces and FSDP2's hooks ran is read from the
profiler's events, which torch emits itself (no code of the trainer is replaced).
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.autograd.profiler_util import FunctionEvent
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.profiler import profile, record_function

from reference_impl.checkpoint import CheckpointManager
from reference_impl.config import TrainConfig
from reference_impl.distributed import DistContext, distributed
from reference_impl.launch import parse_events
from reference_impl.metrics import EventLog
from reference_impl.state import TrainState, state_digest
from reference_impl.train import build_state, train

STEPS, CHECKPOINT_STEP = 4, 2
# Each block holds 0.76 MiB of fp32 parameters, under the 1 MiB of DDP's first gradient
# bucket; the head (0.5 MiB) and one block together exceed it. So DDP fills a first bucket
# with the head's and the last block's gradients, and dynamo's DDPOptimizer has no reason
# to split a block's graph (the whole 2.5 MiB model compiled as one graph is split in two).
MODEL = dict(model="transformer", d_model=128, n_layers=2, n_heads=2, hidden_dim=512, seq_len=16,
             vocab_size=1024, dataset_size=256, micro_batch_size=8, warmup_steps=1, log_every=1,
             pg_timeout_s=60)
COMPILED_FORWARD, COMPILED_BACKWARD = "Torch-Compiled Region", "CompiledFunctionBackward"
BUCKET = "ddp bucket "


class DDPOptimizerLog(logging.Handler):
    """Keeps the bucket count of every graph dynamo's DDPOptimizer partitioned.

    DDPOptimizer logs "... created %d buckets" each time it receives a graph compiled
    inside DDP's forward, before it splits one graph into one subgraph per bucket.
    """

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.buckets: list[int] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "DDPOptimizer used bucket cap" in record.msg:
            self.buckets.append(int(record.args[1]))  # type: ignore[index]


def timeline(prof: profile) -> list[dict[str, Any]]:
    """The profiled step's compiled regions, bucket all-reduces and FSDP2 hook phases, in
    the order they started, each marked with whether it ran inside compiled code."""
    def named(event: FunctionEvent) -> str | None:
        if event.name.startswith(COMPILED_FORWARD):
            return "compiled forward"
        if event.name == COMPILED_BACKWARD:  # the node's own work; its tensor hooks run just before
            return "compiled backward"
        if event.name.startswith(("FSDP::", BUCKET)):
            return event.name
        return None

    def inside_compiled(event: FunctionEvent) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith(COMPILED_FORWARD) or parent.name == COMPILED_BACKWARD:
                return True
            parent = parent.cpu_parent
        return False

    kept = [(e.time_range.start, name, inside_compiled(e)) for e in prof.events() if (name := named(e))]
    return [{"name": name, "inside_compiled": inside} for _, name, inside in sorted(kept)]


def run(cfg: TrainConfig, ctx: DistContext, prepare: Callable[[TrainState], None] | None = None,
        ) -> tuple[dict[str, Any], TrainState]:
    """Train `cfg` with the last step under the profiler. Returns the losses, the dynamo
    counters, DDPOptimizer's bucket counts, the last step's timeline and the digest after
    CHECKPOINT_STEP; and the final state."""
    torch._dynamo.reset()  # each run traces and compiles afresh, so its counters are its own
    counters.clear()
    ddp_log, logger = DDPOptimizerLog(), logging.getLogger("torch._dynamo.backends.distributed")
    logger.addHandler(ddp_log)
    logger.setLevel(logging.INFO)
    stream, digest, prof = io.StringIO(), [], profile(activities=[torch.profiler.ProfilerActivity.CPU])
    state = build_state(cfg, ctx)
    if prepare:
        prepare(state)

    def on_step(s: TrainState) -> None:  # runs after each step, before its log line and checkpoint
        if s.step == CHECKPOINT_STEP:
            digest.append(state_digest(s.model, s.optimizer))
        if s.step == cfg.max_steps - 1:
            prof.start()
        if s.step == cfg.max_steps:
            prof.stop()

    train(cfg, ctx, EventLog(ctx.rank, stream), state=state, on_step=on_step)
    logger.removeHandler(ddp_log)
    return {"losses": [e["loss"] for e in parse_events(stream.getvalue()) if e["event"] == "step"],
            "graph_breaks": sum(counters["graph_break"].values()),
            "unique_graphs": counters["stats"]["unique_graphs"],
            "ddp_optimizer_buckets": ddp_log.buckets, "timeline": timeline(prof), "digest": digest[0]}, state


def count_buckets(state: TrainState, calls: list[list[int]]) -> None:
    """Record [step, bucket index, parameters in the bucket] for every bucket DDP
    all-reduces, and wrap each all-reduce's launch in a profiler range."""
    def hook(pg, bucket):  # unannotated: DDP checks the annotations, which are strings here
        calls.append([state.step + 1, bucket.index(), len(bucket.parameters())])
        with record_function(f"{BUCKET}{bucket.index()}"):
            return default_hooks.allreduce_hook(pg, bucket)

    state.model.register_comm_hook(None, hook)  # type: ignore[operator]


def ddp(ctx: DistContext) -> tuple[dict[str, Any], list[TrainState]]:
    """Eager and compiled DDP, each with the buckets it all-reduced; and both states, which
    must outlive the process group (see `main`)."""
    out, states = {}, []
    for mode in ("eager", "compiled"):
        calls: list[list[int]] = []
        cfg = TrainConfig(**MODEL, strategy="ddp", world_size=ctx.world_size, max_steps=STEPS,
                          compile=mode == "compiled")
        result, state = run(cfg, ctx, prepare=lambda s, calls=calls: count_buckets(s, calls))
        out[mode], states = {**result, "buckets": calls}, [*states, state]
    return out, states


def fsdp(ctx: DistContext, out_dir: Path) -> dict[str, Any]:
    """Eager and compiled FSDP2, then an eager run restored from the compiled run's checkpoint."""
    ckpt, copy = out_dir / "ckpt", out_dir / "copy"
    base = TrainConfig(**MODEL, strategy="fsdp", world_size=ctx.world_size, max_steps=STEPS)
    eager, _ = run(base, ctx)
    compiled, _ = run(dataclasses.replace(base, compile=True, checkpoint_dir=str(ckpt),
                                          checkpoint_every=CHECKPOINT_STEP), ctx)
    if ctx.is_main:  # only the checkpoint of CHECKPOINT_STEP: the eager run must restore that one
        name = f"step-{CHECKPOINT_STEP:08d}"
        shutil.copytree(ckpt / name, copy / name)
    dist.barrier()
    # The eager run restores the compiled checkpoint the way `train` does, then trains on.
    stream, eager_cfg = io.StringIO(), dataclasses.replace(base, checkpoint_dir=str(copy))
    restored = build_state(eager_cfg, ctx)
    CheckpointManager(copy, EventLog(ctx.rank, stream)).restore(restored, eager_cfg, ctx)
    restored_step, restored_digest = restored.step, state_digest(restored.model, restored.optimizer)
    train(base, ctx, EventLog(ctx.rank, stream), state=restored)  # base: no checkpoint to restore again
    losses = [e["loss"] for e in parse_events(stream.getvalue()) if e["event"] == "step"]
    return {"eager": eager, "compiled": compiled,
            "restored": {"step": restored_step, "digest": restored_digest, "losses": losses}}


def main() -> None:
    out_dir = Path(sys.argv[1])
    with distributed("cpu", 60) as ctx:
        under_ddp, _keep_alive = ddp(ctx)
        results = {"ddp": under_ddp, "fsdp": fsdp(ctx, out_dir)}
        (out_dir / f"rank{ctx.rank}.json").write_text(json.dumps(results))
        dist.barrier()
        # Skip teardown, as ddp_driver.py does: destroying a DDP whose comm hook is a Python
        # function can deadlock (hence `_keep_alive`), and an FSDP2 run's group is freed only at interpreter exit
        # (see reference_impl.distributed.exit_process). The results are on disk.
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()

"""Naive versions of the trainer's trickiest pieces, kept so the tests can show them failing.

Nothing here is used by the trainer. Each function or class is the tempting first
draft of something `reference_impl` does correctly; `tests/test_counterexamples.py`
runs each one against the real thing and shows the difference. The handbook's
Pitfalls page shows these sections next to the fixes.
"""

# --8<-- [start:imports]
from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Sampler

# --8<-- [end:imports]
from reference_impl.distributed import destroy


# --8<-- [start:naive_digest]
def naive_digest(fields: dict[str, Any]) -> str:
    """Config identity via the built-in hash(): salted per process."""
    payload = json.dumps(fields, sort_keys=True)
    return str(abs(hash(payload)))  # differs between runs (PYTHONHASHSEED)
# --8<-- [end:naive_digest]


# --8<-- [start:naive_sampler]
class CountingInIterSampler(Sampler[int]):
    """Counts progress while *yielding* indices; never resets it per epoch."""

    def __init__(self, num_samples: int, *, world_size: int, rank: int,
                 seed: int = 0) -> None:
        self.num_samples, self.seed = num_samples, seed
        self.world_size, self.rank = world_size, rank
        self.epoch, self.consumed = 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch  # bug 2: `consumed` carries over into the next epoch

    def __iter__(self) -> Iterator[int]:
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        perm = torch.randperm(self.num_samples, generator=gen)
        mine = perm[self.rank::self.world_size].tolist()
        for index in mine[self.consumed:]:
            yield index
            self.consumed += 1  # bug 1: counts what was fetched, not trained

    def __len__(self) -> int:
        return len(range(self.rank, self.num_samples, self.world_size))

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed}
# --8<-- [end:naive_sampler]


# --8<-- [start:naive_rng_checkpoint]
def naive_rng_state() -> dict[str, Any]:
    """Every RNG in its native form: NumPy's is a tuple holding an ndarray."""
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state()}


def naive_load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Relies on torch.load's default: weights_only=True since PyTorch 2.6."""
    return torch.load(path)
# --8<-- [end:naive_rng_checkpoint]


# --8<-- [start:naive_rank0_save]
def naive_rank0_save(path: str | os.PathLike[str], model: nn.Module) -> None:
    """Only rank 0 writes, so only rank 0's RNG stream is recorded."""
    if dist.get_rank() == 0:
        torch.save({"model": model.state_dict(), "rng": torch.get_rng_state()}, path)
    dist.barrier()


def naive_rank0_restore(path: str | os.PathLike[str], model: nn.Module) -> None:
    """Every rank loads the same file, and therefore rank 0's RNG state."""
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    torch.set_rng_state(state["rng"])
# --8<-- [end:naive_rank0_save]


# --8<-- [start:naive_in_place_save]
def naive_save(state: dict[str, Any], checkpoint_dir: str | os.PathLike[str],
               step: int) -> Path:
    """Writes straight to the final name: a crash mid-write leaves a torn file."""
    path = Path(checkpoint_dir) / f"step-{step:08d}.pt"
    torch.save(state, path)
    return path


def naive_latest(checkpoint_dir: str | os.PathLike[str]) -> Path | None:
    """Trusts the newest name, whatever is inside it."""
    candidates = sorted(Path(checkpoint_dir).glob("step-*.pt"))
    return candidates[-1] if candidates else None
# --8<-- [end:naive_in_place_save]


# --8<-- [start:naive_accumulation]
def naive_accumulating_step(model: nn.Module,
                            micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                            optimizer: torch.optim.Optimizer) -> None:
    """grad_accum_steps is on the config, but this steps after every micro-batch
    and never enters no_sync(), so DDP all-reduces every micro-batch."""
    for x, y in micro_batches:
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
# --8<-- [end:naive_accumulation]


# --8<-- [start:naive_amp]
def naive_amp(device_type: str, use_amp: bool) -> tuple[torch.dtype, bool]:
    """`autocast(device_type)` with its default dtype, plus a scaler on one flag.

    The dtype silently depends on the device (bf16 on CPU, fp16 on CUDA) and the
    scaler does not follow it: on CPU this scales bf16 losses that never underflow.
    """
    dtype = torch.get_autocast_dtype(device_type)  # what autocast(device_type) uses
    scaler = torch.amp.GradScaler(device_type, enabled=use_amp)
    return dtype, scaler.is_enabled()
# --8<-- [end:naive_amp]


# --8<-- [start:naive_timer]
def naive_time_ms(fn: Any) -> float:
    """Host clock around asynchronous device work: measures the launch only."""
    import time

    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000.0
# --8<-- [end:naive_timer]


# --8<-- [start:naive_item]
def naive_step_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                    optimizer: torch.optim.Optimizer) -> float:
    """Returns a Python float every step: `.item()` waits for the device."""
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()
# --8<-- [end:naive_item]


# --8<-- [start:naive_no_scheduler]
def naive_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer,
                     step: int) -> dict[str, Any]:
    """Claims to be complete, but the schedule's position is missing."""
    return {"step": step, "model": model.state_dict(),
            "optimizer": optimizer.state_dict()}
# --8<-- [end:naive_no_scheduler]


# --8<-- [start:naive_backend]
def naive_init() -> None:
    """Hard-codes NCCL: fails on any machine without CUDA, CPU notebooks included."""
    dist.init_process_group(backend="nccl", init_method="env://")
# --8<-- [end:naive_backend]


# ------------------------------------------------------------------ multi-process helpers
# Spawned workers must be importable (a test module's functions cannot be pickled by
# `spawn`), so the tests start these with torch.multiprocessing.

@contextmanager
def _gloo_group(rank: int, world_size: int, port: int) -> Iterator[None]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    clean = False
    try:
        yield
        clean = True
    finally:
        destroy(clean)


def rank0_rng_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Seed each rank differently, save, scramble, restore, draw: naive way, then ours."""
    import io

    from reference_impl.checkpoint import CheckpointManager
    from reference_impl.config import TrainConfig
    from reference_impl.distributed import DistContext
    from reference_impl.metrics import EventLog
    from reference_impl.train import build_state

    with _gloo_group(rank, world_size, port):
        result = {}
        torch.manual_seed(100 + rank)
        model = nn.Linear(2, 2)
        expected = torch.get_rng_state()
        naive_rank0_save(Path(out_dir) / "naive.pt", model)
        torch.manual_seed(999)  # the restart: a fresh process with an unrelated RNG
        naive_rank0_restore(Path(out_dir) / "naive.pt", model)
        result["naive"] = {"restored_own_stream": torch.equal(torch.get_rng_state(), expected),
                           "draw": torch.rand(4).tolist()}

        cfg = TrainConfig(world_size=world_size, dataset_size=256, checkpoint_dir=str(Path(out_dir) / "ours"))
        ctx = DistContext(rank, rank, world_size, torch.device("cpu"), "gloo")
        log = EventLog(rank, stream=io.StringIO())
        state = build_state(cfg, ctx)
        state.step = 1
        torch.manual_seed(100 + rank)
        expected = torch.get_rng_state()
        ckpt = CheckpointManager(Path(out_dir) / "ours", log)
        ckpt.save(state, cfg, ctx)
        torch.manual_seed(999)
        ckpt.restore(build_state(cfg, ctx), cfg, ctx)
        result["ours"] = {"restored_own_stream": torch.equal(torch.get_rng_state(), expected),
                          "draw": torch.rand(4).tolist()}
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))


def ddp_allreduce_count_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Count DDP's gradient all-reduces for one global step of 2 micro-batches, both ways."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from reference_impl.parallel import gradient_sync

    with _gloo_group(rank, world_size, port):
        result = {}
        for mode in ("naive", "ours"):
            torch.manual_seed(0)
            model = DDP(nn.Linear(8, 4))
            calls: list[int] = []

            def counting_hook(state, bucket, calls=calls):  # unannotated: DDP checks annotations
                calls.append(bucket.index())
                fut = dist.all_reduce(bucket.buffer().div_(world_size), async_op=True).get_future()
                return fut.then(lambda f: f.value()[0])

            model.register_comm_hook(None, counting_hook)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            gen = torch.Generator().manual_seed(rank)
            micro = [(torch.randn(4, 8, generator=gen), torch.randint(0, 4, (4,), generator=gen))
                     for _ in range(2)]
            if mode == "naive":
                naive_accumulating_step(model, micro, optimizer)
                steps = len(micro)
            else:
                for i, (x, y) in enumerate(micro):
                    with gradient_sync(model, enabled=i == len(micro) - 1):
                        (nn.functional.cross_entropy(model(x), y) / len(micro)).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                steps = 1
            result[mode] = {"allreduces": len(calls), "optimizer_steps": steps}
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
        # Skip teardown: gloo work launched from a Python comm hook keeps a Python object in
        # its thread-local state, and destroying the group can then deadlock on the GIL
        # (seen about 1 run in 25). The result is on disk; exit once every rank has written.
        dist.barrier()
        os._exit(0)

"""Answers to the timed drills for the graders' tests: the model solutions (the package's own cells,
or the smallest correct code where no cell has the drill's signature) and the wrong answers each
drill's rubric names."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import multiprocessing
import os
import random
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from reference_impl import interview_core as core
from reference_impl import notebook as nb

# Drill 1: the model solution is the notebook's config (Cell 1), whose digest leaves out these fields.
CONFIG = nb.Config
OPERATIONAL = {"micro_batch_size", "log_every", "checkpoint_dir", "checkpoint_every", "keep_last",
               "pg_timeout_s", "fail_at_step", "fail_rank"}


class SaltedHashConfig(nb.Config):
    """Wrong: Python's `hash()` of the fields, salted per process."""

    def digest(self) -> str:
        return format(hash(dataclasses.astuple(self)), "x")


class ModelFieldsDigestConfig(nb.Config):
    """Wrong: a digest of the model's shape alone, blind to the optimizer, the data and the seed."""

    def digest(self) -> str:
        return f"{self.input_dim}-{self.hidden_dim}-{self.num_classes}"


@dataclasses.dataclass(frozen=True)
class FreeAccumulationConfig(nb.Config):
    """Wrong: accumulation a free field, so a change of world size changes the global batch."""

    grad_accum: int = 4

    def grad_accum_steps(self, world_size: int) -> int:
        return self.grad_accum


class UnvalidatedConfig(nb.Config):
    """Wrong: accumulation derived with a floor division that nothing validates."""

    def grad_accum_steps(self, world_size: int) -> int:
        return self.global_batch_size // (self.micro_batch_size * world_size)


# Drill 2: the model solution is the notebook's rank wiring (Cell 2).
def setup() -> nb.Ranks:
    return nb.init_ranks(nb.Config())


def make_setup(backend: str = "", gpu_from: str = "LOCAL_RANK", timeout: bool = True) -> Callable[[], nb.Ranks]:
    """Drill 2: rank wiring with a hard-coded backend, the GPU picked by another variable, or no timeout."""

    def wrong_setup() -> nb.Ranks:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        cuda = torch.cuda.is_available()
        device = torch.device("cuda", int(os.environ.get(gpu_from, 0))) if cuda else torch.device("cpu")
        if world > 1:
            limit = {"timeout": datetime.timedelta(seconds=60)} if timeout else {}
            dist.init_process_group(backend or ("nccl" if cuda else "gloo"), **limit)
        return nb.Ranks(rank, int(os.environ.get("LOCAL_RANK", 0)), world, device)

    return wrong_setup

# Drill 3: the model solution is the notebook's sampler (Cell 4).
SAMPLER = nb.ResumableSampler


class SetEpochResetsSampler(nb.ResumableSampler):
    """Wrong: `set_epoch` always resets progress, also to the epoch just restored."""

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.consumed = epoch, 0


class CountsInIterSampler(nb.ResumableSampler):
    """Wrong: progress counted as indices are handed out, so worker prefetch runs it ahead."""

    def commit(self) -> None:
        pass

    def __iter__(self) -> Iterator[int]:
        start = self.consumed
        for k, index in enumerate(super().__iter__(), start=1):
            self.consumed = start + k * self.world  # every rank hands out its share of a global block
            yield index


class LiveStateSampler(nb.ResumableSampler):
    """Wrong: `state_dict` returns the sampler's own attributes, which later steps change."""

    def state_dict(self) -> dict:
        return vars(self)


class CarriesOffsetSampler(nb.ResumableSampler):
    """Wrong: the offset of the last epoch carried into the next one."""

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


def make_step(no_sync: bool = True, divide: bool = True, as_tensor: bool = True,
              last_loss: bool = False) -> Callable[..., Any]:
    """Drill 4: the model solution, or with one of its parts left out (`last_loss`: returns the
    last micro-batch's loss, undivided, for the mean)."""

    def step(model: nn.Module, micro_batches: list, optimizer: torch.optim.Optimizer,
             scheduler: torch.optim.lr_scheduler.LRScheduler) -> torch.Tensor | float:
        total = torch.zeros(())
        for i, (x, y) in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with contextlib.nullcontext() if last or not no_sync else model.no_sync():  # sync the last only
                with torch.autocast(x.device.type, dtype=torch.bfloat16):
                    loss = nn.functional.cross_entropy(model(x).float(), y)
                loss = loss / len(micro_batches) if divide else loss
                loss.backward()
            total += loss.detach()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if last_loss:
            total = loss.detach() * len(micro_batches) if divide else loss.detach()
        return total if as_tensor else total.item()

    return step


# Drill 5: the model solution is the notebook's timer (Cell 7).
TIMER = nb.PhaseTimer


class NoResetTimer(nb.PhaseTimer):
    """Wrong: `flush()` reports the totals but never starts a new window."""

    def flush(self) -> dict:
        return {name: round(s * 1e3, 3) for name, s in self.seconds.items()}


class LapTimer(nb.PhaseTimer):
    """Wrong: each phase is charged the time since the previous mark, taken when it starts, so the
    work of one phase lands on the next."""

    last: float | None = None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        now = time.perf_counter()
        self.seconds[name] += now - (self.last or now)
        self.last = now
        yield


# Drill 6: the model solution is the notebook's checkpoint (Cell 8), called as the grader calls it.
def _this_rank() -> nb.Ranks:
    return nb.Ranks(dist.get_rank(), dist.get_rank(), dist.get_world_size(), torch.device("cpu"))


def save(root: str, step: int, parts: dict) -> None:
    nb.save_checkpoint(step, parts, nb.Config(checkpoint_dir=root), _this_rank())


def restore(root: str, parts: dict) -> int:
    return nb.restore_checkpoint(parts, nb.Config(checkpoint_dir=root), _this_rank())


def restore_rank0_rng(root: str, parts: dict) -> int:
    """Wrong: every rank restores rank 0's RNG, so all ranks draw the same dropout masks."""
    return nb.restore_checkpoint(parts, nb.Config(checkpoint_dir=root), dataclasses.replace(_this_rank(), rank=0))


def restore_unverified(root: str, parts: dict) -> int:
    """Wrong: any published checkpoint is trusted; the manifest's hashes are never checked."""
    real = nb.verify
    nb.verify = lambda path: json.loads(Path(path, "manifest.json").read_text())  # this rank's module only
    try:
        return restore(root, parts)
    finally:
        nb.verify = real


def restore_unsafe(root: str, parts: dict) -> int:
    """Wrong: `torch.load(..., weights_only=False)`, which runs whatever code a checkpoint file holds."""
    real = torch.load
    torch.load = lambda *args, **kwargs: real(*args, **{**kwargs, "weights_only": False})
    try:
        return restore(root, parts)
    finally:
        torch.load = real


def save_in_place(root: str, step: int, parts: dict) -> None:
    """Wrong: `torch.save` straight to the final path; a crash mid-write leaves a torn newest file."""
    state = {"step": step, "rng": torch.get_rng_state(), "python_rng": list(random.getstate()),
             **{name: part.state_dict() for name, part in parts.items()}}
    torch.save(state, Path(root, f"ckpt-{step:08d}-rank{dist.get_rank()}.pt"))


def restore_newest(root: str, parts: dict) -> int:
    """Wrong with `save_in_place`: the newest file is loaded, whatever state it is in."""
    found = sorted(Path(root).glob(f"ckpt-*-rank{dist.get_rank()}.pt"))
    if not found:
        return 0
    state = torch.load(found[-1], weights_only=True)
    for name, part in parts.items():
        part.load_state_dict(state[name])
    torch.set_rng_state(state["rng"])
    random.setstate((state["python_rng"][0], tuple(state["python_rng"][1]), state["python_rng"][2]))
    return state["step"]


def core_save(root: str, step: int, parts: dict) -> None:
    """The interview core's `save`, called as the grader calls it."""
    core.save(root, step, parts, dist.get_rank())


def core_restore(root: str, parts: dict) -> int:
    """The interview core's `restore`: it checks the CRC32s and falls back, but keeps torch's RNG
    streams alone, not Python's `random` (the core draws from none but torch's)."""
    return core.restore(root, parts, dist.get_rank())


# Drill 7: the model solution is the interview core's `main`.
MAIN = core.main


def main_checkpointing_only_at_the_end(argv: list[str]) -> str:
    """Wrong: no checkpoint before the kill, so the restart trains from step 0 and the digests
    agree anyway; this is the kill test that proves nothing."""
    return core.main([*argv, "--checkpoint-every", "0"])


class CoreSetEpochResetsSampler(core.ResumableSampler):
    """Wrong (for the core's loop): `set_epoch` resets the position restored from the checkpoint."""

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.consumed = epoch, 0


# Drill 8: the model solution is the notebook's launcher (Cell 11), its ranks running `fn` in place of the trainer.
def launch(nprocs: int, fn: Callable[[], None]) -> None:
    real = nb.train
    nb.train = lambda cfg: fn()  # forked ranks inherit it
    try:
        nb.launch(nprocs, [])
    finally:
        nb.train = real


def make_launch(start_method: str = "fork", one_thread: bool = True, check: bool = True) -> Callable[..., None]:
    """Drill 8: a launcher that spawns, leaves each rank all the threads, or ignores a failed rank."""

    def wrong_launch(nprocs: int, fn: Callable[[], None]) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [multiprocessing.get_context(start_method).Process(
            target=_launched, args=(fn, rank, nprocs, port, one_thread)) for rank in range(nprocs)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if check and any(p.exitcode for p in procs):
            raise RuntimeError(f"exit statuses {[p.exitcode for p in procs]}")

    return wrong_launch


def _launched(fn: Callable[[], None], rank: int, nprocs: int, port: int, one_thread: bool) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if one_thread:
        torch.set_num_threads(1)
    fn()

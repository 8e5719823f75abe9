"""Rank wiring: one process per device, the backend that fits it, bounded timeouts and
a teardown that runs on every exit path."""

# --8<-- [start:imports]
from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

# --8<-- [end:imports]


# --8<-- [start:context]
@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the job.

    Attributes:
        rank: Global rank in [0, world_size): picks the data shard and owns the logs.
        local_rank: Rank within this node: picks the GPU. Differs from `rank` on node 2+.
        world_size: Number of processes in the job.
        device: The device this process trains on.
        backend: "nccl" on CUDA, "gloo" on CPU, "" when no process group was started.
        restart_count: How many times torchrun has restarted the worker group.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str = ""
    restart_count: int = 0

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the process that writes progress and shared files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """True when a process group is up and collectives are available."""
        return bool(self.backend)


def pick_device(preference: str, local_rank: int, local_world_size: int = 1) -> torch.device:
    """Return the GPU `cuda:<local_rank>` when CUDA is wanted and present, else the CPU.

    Args:
        preference: `--device`: "cuda", "cpu" or "auto" (a GPU when there is one).
        local_rank: This rank's place on its node (torchrun's LOCAL_RANK): its GPU.
        local_world_size: Ranks on this node (torchrun's LOCAL_WORLD_SIZE). Every rank
            checks the same count, so all refuse a node short of GPUs alike.

    Raises:
        RuntimeError: CUDA was asked for and no GPU is visible, or the node starts more
            ranks than it has GPUs (NCCL refuses two ranks of a group on one device).
    """
    if preference == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was requested but no GPU is visible")
    if preference != "cpu" and torch.cuda.is_available():
        ranks = max(local_rank + 1, local_world_size)
        if ranks > (gpus := torch.cuda.device_count()):
            raise RuntimeError(f"{ranks} ranks on this node but {gpus} GPU(s) visible: each rank needs a GPU "
                               f"of its own; start at most {gpus} per node, or pass --device cpu")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def env_count(name: str, default: str, low: int = 0) -> int:
    """A count from the environment (torchrun's RANK, LOCAL_RANK, LOCAL_WORLD_SIZE).

    Raises:
        RuntimeError: The variable is set to something other than a whole number of at least `low`.
    """
    text = os.environ.get(name, default)
    if not (text.isascii() and text.isdigit()) or int(text) < low:
        raise RuntimeError(f"{name}={text!r} in the environment is not a whole number of at least {low}")
    return int(text)


def node_ranks() -> tuple[int, int]:
    """This rank's (LOCAL_RANK, LOCAL_WORLD_SIZE) from torchrun's environment; (0, 1) outside it.

    Raises:
        RuntimeError: Either variable is set to something other than a count.
    """
    local_rank = env_count("LOCAL_RANK", "0")
    return local_rank, env_count("LOCAL_WORLD_SIZE", str(local_rank + 1), low=1)


def launch_env() -> tuple[int, int, int]:
    """(RANK, WORLD_SIZE, TORCHELASTIC_RESTART_COUNT) from torchrun's environment, checked.

    Raises:
        RuntimeError: One is not a count, or RANK is not below WORLD_SIZE (a rank that
            waits for peers that cannot exist would wait forever).
    """
    world_size, rank = env_count("WORLD_SIZE", "1", low=1), env_count("RANK", "0")
    if rank >= world_size:
        raise RuntimeError(f"RANK={rank} in the environment is not below WORLD_SIZE={world_size}")
    return rank, world_size, env_count("TORCHELASTIC_RESTART_COUNT", "0")


def rendezvous_address() -> tuple[str, int]:
    """torchrun's MASTER_ADDR and MASTER_PORT, where the ranks meet.

    Raises:
        RuntimeError: MASTER_ADDR is unset or empty, or MASTER_PORT is not a port number.
    """
    address = os.environ.get("MASTER_ADDR", "")
    if not address:
        raise RuntimeError("MASTER_ADDR is not set: start the ranks with torchrun (or unset WORLD_SIZE)")
    port = env_count("MASTER_PORT", "", low=1)
    if port > 65535:
        raise RuntimeError(f"MASTER_PORT={port} in the environment is not a port (1-65535)")
    return address, port
# --8<-- [end:context]


# --8<-- [start:init_distributed]
def init_distributed(device: str = "auto", timeout_s: float = 120.0) -> DistContext:
    """Start the process group described by torchrun's environment, if there is one.

    Plain `python -m ...` (no WORLD_SIZE) runs as a single process without a group.
    """
    if "WORLD_SIZE" not in os.environ:
        return DistContext(device=pick_device(device, 0))
    rank, world_size, restart_count = launch_env()
    rendezvous_address()  # checked here: torch's own message for a missing one is a traceback
    local_rank, local_world_size = node_ranks()
    dev = pick_device(device, local_rank, local_world_size)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # before init, so NCCL binds this rank to its own GPU
    backend = "nccl" if dev.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, store=_attempt_store(restart_count, world_size), rank=rank,
        world_size=world_size, timeout=timedelta(seconds=timeout_s),
        device_id=dev if dev.type == "cuda" else None)
    return DistContext(rank, local_rank, world_size, dev, backend, restart_count)


def _attempt_store(restart_count: int, world_size: int) -> dist.Store | None:
    """A store namespace per restart attempt.

    torchrun's agent keeps one TCPStore for the whole job. Without a per-attempt prefix
    a restarted rank can read the previous attempt's keys (a dead peer's address) and
    fail or hang while connecting; see pytorch/pytorch#135712.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None  # the default env:// rendezvous is fine outside torchrun
    base = dist.TCPStore(*rendezvous_address(), world_size, is_master=False)
    return dist.PrefixStore(f"attempt_{restart_count}", base)
# --8<-- [end:init_distributed]


# --8<-- [start:teardown]
@contextmanager
def distributed(device: str = "auto", timeout_s: float = 120.0) -> Iterator[DistContext]:
    """Run a block inside a process group and always destroy the group afterwards.

    Destroying the group on errors too matters: a rank that exits with a live NCCL
    communicator can leave its peers blocked until their collective timeout.
    """
    ctx = init_distributed(device, timeout_s)
    clean = False
    try:
        yield ctx
        clean = True
    finally:
        destroy(clean)


def destroy(clean: bool) -> None:
    """Destroy the default process group; after a clean run, meet the peers first.

    gloo's worker threads may still be releasing the tensors of finished collectives,
    which needs the GIL, while the group's destructor waits for those threads with the
    GIL held: a deadlock. A barrier waits with the GIL released, so the releases finish
    first. After a failure the peers may be gone, so then there is no barrier.
    """
    if not dist.is_initialized():
        return
    if clean:
        dist.barrier()
    dist.destroy_process_group()


def exit_process(status: int) -> NoReturn:
    """End a finished worker without interpreter finalization.

    DTensor (which FSDP2 and tensor parallel use) keeps device meshes in module-level
    caches, and a mesh holds its process groups, so after an FSDP or TP run the gloo
    group outlives `destroy_process_group` and is freed only while the interpreter shuts
    down. Freeing it there sometimes aborts the process after a successful run (SIGABRT,
    "terminate called without an active exception", about 1 run in 30 on a loaded 2-core
    machine), and torchrun then reports the job failed. Call this once `main` has
    returned: the group is destroyed and files are closed, so all that is left is to
    flush the output.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def exit_after(main: Callable[[], int | None]) -> NoReturn:
    """Run a worker's `main`, then end the process with its status (`exit_process`), also on a failure.

    A failure's traceback holds the run's frames, and through them its model, optimizer
    and process groups. The interpreter frees them once it has printed the traceback; a
    gloo group whose collective has just failed can then deadlock in its destructor (it
    waits for threads that need the GIL it holds), and the failed rank never exits, so
    its launcher waits forever. Here the traceback is printed and the process ends inside
    the handler, with nothing the traceback holds freed. `SystemExit` (argparse) ends the
    process as the interpreter would.
    """
    try:
        status = main() or 0
    except SystemExit as exc:
        if isinstance(exc.code, int) or exc.code is None:
            exit_process(exc.code or 0)
        print(exc.code, file=sys.stderr)
        exit_process(1)
    except BaseException:
        traceback.print_exc()
        exit_process(1)  # inside the handler: nothing the traceback holds is freed
    exit_process(status)
# --8<-- [end:teardown]

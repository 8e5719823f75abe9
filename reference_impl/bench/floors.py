"""What the machine itself needs for a save and a restart: the floors the checkpoint bench
divides by.

A checkpoint cannot be written faster than the disk writes and fsyncs the same bytes, and a
run cannot resume faster than torchrun restarts a process that imports torch and joins a
gloo group. Both are measured here, on the same disk and launcher as the run they bound.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from reference_impl.bench.common import BenchmarkError, launched
from reference_impl.launch import torchrun_command

CHUNK = 8 << 20  # bytes per write: large enough that the syscall count does not matter
ALIGN = 4096  # O_DIRECT wants the buffer, the offset and the length aligned to the block size

# A torchrun job doing nothing but what every restart must: start Python, import torch,
# form the gloo group (on a per-attempt store, as the trainer does). Attempt 0's rank 1
# kills itself once the group stands. Attempt 1 then also does what every DDP job does
# before its first step, on a tiny layer: wrap it in DDP, build a torch optimizer, step it.
# On torch 2.13 DDP's constructor and the first optimizer built in a process each import
# torch._dynamo (and with it sympy), about as long as `import torch` itself, so this is
# timed as a second floor.
# Every wait in it is bounded: forming the group (the store included) and each collective
# by GROUP_TIMEOUT_S, whichever rendezvous torchrun offers (its agent's store, or with
# TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 none, where rank 0 hosts one: the script used to wait
# there forever, as a client of a store nobody served); rank 0 of attempt 0 sleeps at most
# 120 s for torchrun to stop it.
GROUP_TIMEOUT_S = 60
RESTART_SCRIPT = '''
import json, os, signal, time
from datetime import timedelta
import torch
import torch.distributed as dist
attempt, rank, world = (int(os.environ[k]) for k in ("TORCHELASTIC_RESTART_COUNT", "RANK", "WORLD_SIZE"))
timeout = timedelta(seconds=GROUP_TIMEOUT_S)
if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
    # A store namespace per attempt, as the trainer uses: a restarted rank must not read the
    # dead attempt's addresses from the agent's store.
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                         timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt_{attempt}", base), rank=rank,
                            world_size=world, timeout=timeout)
else:  # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: no agent store; rank 0 hosts one at MASTER_PORT
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world, timeout=timeout)
if rank == 0:  # one writer: two ranks' lines on one pipe can interleave
    print(json.dumps({"event": "group_formed", "attempt": attempt, "time": time.time()}), flush=True)
if attempt == 0:
    dist.barrier()
    if rank == 1:
        print(json.dumps({"event": "killed", "time": time.time()}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)  # rank 0 waits for torchrun to tear the group down
layer = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
optimizer = torch.optim.AdamW(layer.parameters())
layer(torch.ones(1, 8)).sum().backward()
optimizer.step()
dist.barrier()  # both ranks ready to train
if rank == 0:
    print(json.dumps({"event": "ddp_stepped", "time": time.time()}), flush=True)
dist.destroy_process_group()
# Ended as the trainer ends (`distributed.exit_process`): DDP's gloo group freed during
# interpreter shutdown sometimes aborts the process, and torchrun would call the job failed.
os._exit(0)
'''.replace("GROUP_TIMEOUT_S", str(GROUP_TIMEOUT_S))


class RestartFloor(NamedTuple):
    """Seconds from the kill to the restarted group standing, and to its first DDP step."""

    group_s: float
    ddp_s: float


def disk_write_floor(directory: Path, nbytes: int) -> tuple[float, str]:
    """Seconds to write `nbytes` to a new file in `directory` and fsync it, and how.

    The write bypasses the page cache with `O_DIRECT` from an aligned buffer where the
    file system allows it (the disk's own speed); where it refuses (tmpfs, some overlay
    file systems) it falls back to buffered writes followed by the fsync, the closest
    portable equivalent. The file is removed afterwards.

    Returns:
        (seconds, "O_DIRECT" or "buffered").
    """
    size = -(-max(nbytes, 1) // ALIGN) * ALIGN
    path = directory / "floor.bin"
    fd, method = _open_for_floor(path)
    buffer = mmap.mmap(-1, CHUNK)  # page-aligned, which satisfies O_DIRECT
    buffer.write(os.urandom(ALIGN) * (CHUNK // ALIGN))  # incompressible, like weights
    view = memoryview(buffer)
    try:
        start = time.perf_counter()
        written = 0
        while written < size:
            written += os.write(fd, view[:min(CHUNK, size - written)])
        os.fsync(fd)
        return time.perf_counter() - start, method
    finally:
        view.release()
        buffer.close()
        os.close(fd)
        path.unlink(missing_ok=True)


def _open_for_floor(path: Path) -> tuple[int, str]:
    """A new file opened with `O_DIRECT` where the platform and file system allow it."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    if hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o600), "O_DIRECT"
        except OSError:  # EINVAL: this file system does not do direct I/O
            pass
    return os.open(path, flags, 0o600), "buffered"


def restart_floor(timeout: float) -> RestartFloor:
    """Seconds from a SIGKILLed rank to the restarted 2-rank group standing again, and to
    both ranks having wrapped a layer in DDP, built a torch optimizer and stepped it once.

    torchrun (`--max-restarts 1`) runs `RESTART_SCRIPT`. The first floor is the time from
    the kill to rank 0 of attempt 1 reporting its gloo group: process start, `import torch`
    and the rendezvous, which every resumed run pays before it can restore anything. The
    second adds what torch itself costs the first time a process builds DDP and an
    optimizer: the floor of a resumed DDP job.

    Raises:
        BenchmarkError: The job failed, timed out or printed no restart.
    """
    with tempfile.TemporaryDirectory(prefix="bench-restart-floor-") as root:
        script = Path(root, "restart_floor.py")
        script.write_text(RESTART_SCRIPT)
        run = launched(torchrun_command(2, str(script), [], max_restarts=1), timeout)
    killed = [e["time"] for e in run.of("killed")]
    formed = [e["time"] for e in run.of("group_formed") if e["attempt"] == 1]
    stepped = [e["time"] for e in run.of("ddp_stepped")]
    if run.returncode != 0 or not killed or not formed or not stepped:
        raise BenchmarkError(f"the restart floor run failed (exit {run.returncode}): "
                             f"{run.failure()}")
    return RestartFloor(min(formed) - killed[0], stepped[0] - killed[0])

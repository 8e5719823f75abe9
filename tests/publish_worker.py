"""Ranks of a real gloo group whose rank 0 alone fails part of a save (`tests/test_checkpoint.py`)."""

from __future__ import annotations

import errno
import io
import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from reference_impl.checkpoint.publish import Publication, finish_save
from reference_impl.distributed import DistContext
from reference_impl.reliability.faults import FaultInjector
from reference_impl.metrics import EventLog


class FullDiskPublication(Publication):
    """Fails where the manifest would be written, as a full disk would."""

    def _commit(self, written: dict[str, Any]) -> dict[str, Any]:
        raise OSError(errno.ENOSPC, "No space left on device")


def failed_publish(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Both ranks write their part of step 1, rank 0's publish fails; each rank records what
    `finish_save` raised and how long it took. The group's timeout (60 s) is longer than the
    test waits, so a rank left waiting for rank 0 fails the test instead of timing out here."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        ctx = DistContext(rank, rank, world_size, torch.device("cpu"), "gloo")
        tmp = Path(out_dir, ".tmp-step-00000001")
        if rank == 0:
            tmp.mkdir()
        dist.barrier()
        publication = FullDiskPublication(tmp, Path(out_dir, "step-00000001"), {"step": 1}, lambda final: None,
                                          EventLog(rank, io.StringIO()), FaultInjector.disabled(), time.perf_counter(),
                                          lambda: None)
        started = time.perf_counter()
        try:
            finish_save({f"rank-{rank:05d}.pt": {"rank": rank}}, publication, ctx)
            raised = {"error": None}
        except Exception as exc:
            raised = {"error": type(exc).__name__, "message": str(exc)}
        raised["seconds"] = time.perf_counter() - started
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(raised))
    finally:
        dist.destroy_process_group()



def _copy_without_memory(*args: Any) -> Any:
    raise MemoryError("no memory for the copy")


def _reraise(failure: BaseException | None) -> None:
    if failure is not None:
        raise failure


def failed_copy(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Three async saves; the second one's copy fails on rank 0 only. Each rank records what
    each save's `wait` raised and how long it took."""
    from reference_impl.checkpoint import staging
    from reference_impl.checkpoint.layouts import AsyncSaver

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        copy_all, state = staging._copy_all, {"model": torch.nn.Linear(16, 16).state_dict()}
        saver, results = AsyncSaver(timeout_s=60), []
        for save in range(3):
            staging._copy_all = _copy_without_memory if rank == 0 and save == 1 else copy_all
            started = time.perf_counter()
            saver.start(state, Path(out_dir, f"save{save}"))
            saver.then(_reraise)
            try:
                saver.wait()
                results.append({"error": None})
            except Exception as exc:
                results.append({"error": type(exc).__name__, "message": str(exc)})
            results[-1]["seconds"] = time.perf_counter() - started
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
        dist.barrier()
    finally:
        dist.destroy_process_group()

"""The test suite's launch helpers: `reference_impl.launch` with pytest's failure reporting.

Every subprocess and every torchrun job has a hard timeout; a job that outlives it is
killed with all its descendants and the test fails with what the job printed.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from reference_impl.launch import LaunchTimeout, Run, descendants, free_port, kill_tree, run, torchrun_command

__all__ = ["REPO", "Run", "alive", "descendants", "free_port", "kill_tree", "python_module", "run_command",
           "spawn", "torchrun", "train_ok"]

REPO = Path(__file__).resolve().parents[1]


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def run_command(cmd: list[str], timeout: float, env: dict[str, str] | None = None,
                cwd: Path | None = None) -> Run:
    """Run `cmd` from the repository root (or `cwd`); fail the test if it outlives `timeout`."""
    try:
        return run(cmd, timeout, env, cwd or REPO)
    except LaunchTimeout as exc:
        pytest.fail(f"{exc}\n{exc.stdout[-3000:]}\n{exc.stderr[-5000:]}")


def spawn(fn: Callable[..., None], args: tuple, nprocs: int = 2, timeout: float = 120) -> None:
    """torch.multiprocessing.spawn with a deadline: a hung worker is killed, not waited for.

    Plain `mp.spawn(join=True)` has no timeout, and a stuck non-daemon child would also
    block the interpreter's exit, holding the whole test session hostage.
    """
    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
                process.join(10)
            pytest.fail(f"spawned {getattr(fn, '__name__', fn)} did not finish within {timeout}s")


def torchrun(args: list[str], nproc: int = 2, timeout: float = 120, max_restarts: int = 0,
             env: dict[str, str] | None = None, module: str = "reference_impl.train") -> Run:
    """`torchrun --standalone` on a free port running `module` (or a script path) with `args`."""
    return run_command(torchrun_command(nproc, module, args, max_restarts), timeout, env)


def train_ok(args: list[str], ckpt: Path, *flags: str, nproc: int = 2, restarts: int = 0) -> Run:
    """The trainer under torchrun with `args`, checkpoints in `ckpt` and `flags`; the job must succeed."""
    run = torchrun([*args, "--checkpoint-dir", str(ckpt), *flags], nproc=nproc, max_restarts=restarts,
                   timeout=180)
    assert run.returncode == 0, run.stderr[-4000:]
    return run


def python_module(args: list[str], timeout: float = 120, module: str = "reference_impl.train",
                  env: dict[str, str] | None = None) -> Run:
    """Run `python -m module args` as a single process."""
    return run_command([sys.executable, "-m", module, *args], timeout, env)

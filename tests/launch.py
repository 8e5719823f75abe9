"""Shared launch helpers: every subprocess (and every torchrun job) has a hard timeout."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp

from reference_impl.bench import parse_events

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Run:
    """A finished subprocess with its JSON events parsed from stdout."""

    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    events: list[dict[str, Any]] = field(default_factory=list)

    def of(self, name: str) -> list[dict[str, Any]]:
        """All events with this name, in order."""
        return [e for e in self.events if e.get("event") == name]

    def digest(self) -> str:
        """The state_digest of the run_complete event (asserts the run completed)."""
        done = self.of("run_complete")
        assert done, f"no run_complete (rc={self.returncode})\n{self.stdout[-3000:]}\n{self.stderr[-5000:]}"
        return done[-1]["state_digest"]


def run_command(cmd: list[str], timeout: float, env: dict[str, str] | None = None,
                cwd: Path | None = None) -> Run:
    """Run `cmd` in its own process group; kill the whole group if it outlives `timeout`."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=full_env, cwd=cwd or REPO, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = _kill_tree(proc)
        pytest.fail(f"timed out after {timeout}s: {' '.join(cmd)}\n{out[-3000:]}\n{err[-5000:]}")
    return Run(proc.returncode, out, err, time.perf_counter() - t0, parse_events(out))


def _descendants(root: int) -> list[int]:
    """Every live descendant of `root` (torchrun puts its workers in their own sessions,
    so killing the launcher's process group alone would leave them running)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [root]
    while frontier:
        children = [pid for pid, ppid in parents.items() if ppid in frontier]
        found += children
        frontier = children
    return found


def _kill_tree(proc: subprocess.Popen) -> tuple[str, str]:
    """SIGKILL the launcher, its group and all its descendants; return what they printed."""
    for pid in [*_descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        return proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        return "", "(output lost: a process outside the tree still holds the pipes)"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    target = ["-m", module] if not module.endswith(".py") else [module]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts), *target, *args]
    return run_command(cmd, timeout, env)


def python_module(args: list[str], timeout: float = 120, module: str = "reference_impl.train",
                  env: dict[str, str] | None = None) -> Run:
    """Run `python -m module args` as a single process."""
    return run_command([sys.executable, "-m", module, *args], timeout, env)

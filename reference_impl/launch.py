"""Run commands and torchrun jobs with a hard deadline, and read the JSON events they print.

The benchmarks, `reference_impl.bench.measure` and the test suite all launch jobs through this
module, so all of them stop a hung job the same way: the launcher, its process group and
every descendant are killed (torchrun starts its workers in sessions of their own, so
killing the launcher's group alone would leave them running).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class LaunchTimeout(RuntimeError):
    """A command outlived its deadline; it and its descendants were killed."""

    def __init__(self, cmd: Sequence[str], timeout: float, stdout: str, stderr: str) -> None:
        super().__init__(f"timed out after {timeout:.0f}s: {' '.join(cmd)}")
        self.stdout, self.stderr = stdout, stderr


@dataclass
class Run:
    """A finished command with the JSON events parsed from its stdout."""

    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    events: list[dict[str, Any]] = field(default_factory=list)

    def of(self, name: str) -> list[dict[str, Any]]:
        """All events with this name, in order."""
        return [e for e in self.events if e.get("event") == name]

    def digest(self) -> str:
        """The `state_digest` of the last `run_complete` event.

        Raises:
            RuntimeError: The run printed no `run_complete`; the message ends with the
                tails of its output.
        """
        done = self.of("run_complete")
        if not done:
            raise RuntimeError(f"no run_complete (exit status {self.returncode})\n"
                               f"{self.stdout[-3000:]}\n{self.stderr[-5000:]}")
        return done[-1]["state_digest"]

    def failure(self) -> str:
        """Why the command failed, in one line: the last exception a process printed
        (torchrun's own `ChildFailedError` aside, whose report ends in a banner), else the
        exit code torchrun names as the root cause (`exitcode : -6 (pid: 5920) (SIGABRT)`),
        else the last line of stderr."""
        lines = [line.strip() for line in self.stderr.splitlines() if line.strip()]
        raised = [line for line in lines if _RAISED.match(line) and "ChildFailedError" not in line]
        exited = [line for line in lines if line.startswith("exitcode")]
        return (raised or exited or lines or ["(nothing on stderr)"])[-1][:400]


# `ValueError: ...`, `torch.distributed.DistBackendError: ...`, `[rank1]: RuntimeError: ...`
_RAISED = re.compile(r"^(\[rank\d+\]:\s*)?[\w.]*(Error|Exception|Interrupt|Exit)\b:")


def parse_events(text: str) -> list[dict[str, Any]]:
    """The JSON event lines in `text` (other lines, such as tables and warnings, skipped)."""
    events = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events


def torchrun_command(nproc: int, target: str, args: Sequence[str], max_restarts: int = 0) -> list[str]:
    """The command line of `torchrun --standalone` running a module or a script.

    Args:
        nproc: Processes to start.
        target: A module name (`reference_impl.train`) or the path of a `.py` script.
        args: The module's or script's arguments.
        max_restarts: How many times torchrun restarts the group after a failure.
    """
    program = [target] if target.endswith(".py") else ["-m", target]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "--max-restarts", str(max_restarts), *program, *args]


def run(cmd: Sequence[str], timeout: float, env: dict[str, str] | None = None, cwd: Path | None = None) -> Run:
    """Run `cmd` in a session of its own; kill it and every descendant if it outlives `timeout`.

    Output is unbuffered and each process gets one intra-op thread, unless `env` says
    otherwise.

    Raises:
        LaunchTimeout: The deadline passed; the exception holds what was printed.
    """
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    started = time.perf_counter()
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=full_env, cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = kill_tree(proc)
        raise LaunchTimeout(cmd, timeout, out, err) from None
    return Run(proc.returncode, out, err, time.perf_counter() - started, parse_events(out))


def descendants(root: int) -> list[int]:
    """Every live descendant of process `root`, read from /proc."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    return descendants_in(parents, root)


def descendants_in(parents: dict[int, int], root: int) -> list[int]:
    """The descendants of `root` in a snapshot of pid -> parent pid, nearest first.

    The snapshot is read one process at a time: a pid that ended and was reused meanwhile
    can make a loop in it, which ends here instead of going round forever.
    """
    found, frontier, seen = [], {root}, {root}
    while frontier:
        children = [pid for pid, ppid in parents.items() if ppid in frontier and pid not in seen]
        found += children
        seen.update(children)
        frontier = set(children)
    return found


def kill_descendants(root: int) -> None:
    """SIGKILL process `root` and every live descendant of it."""
    for pid in [*descendants(root), root]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_tree(proc: subprocess.Popen) -> tuple[str, str]:
    """SIGKILL a process, its group and all its descendants; return what they printed."""
    kill_descendants(proc.pid)
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

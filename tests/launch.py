"""The test suite's launch helpers: `reference_impl.launch` with pytest's failure reporting.

Every subprocess and every torchrun job has a hard timeout; a job that outlives it is
killed with all its descendants and the test fails with what the job printed.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import runpy
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.context import ForkServerContext
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from reference_impl.distributed import exit_after
from reference_impl.launch import (
    LaunchTimeout,
    Run,
    descendants,
    free_port,
    kill_descendants,
    kill_tree,
    parse_events,
    run,
    torchrun_command,
)

__all__ = ["REPO", "Run", "alive", "descendants", "forked_ranks", "free_port", "kill_tree", "python_module",
           "run_command", "run_ranks", "torchrun", "train_ok"]

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


def run_ranks(fn: Callable[..., None], args: tuple, nprocs: int = 2, timeout: float = 120) -> None:
    """`fn(rank, *args)` in `nprocs` processes forked from the warm forkserver (`_context`),
    as `torch.multiprocessing.start_processes` starts them, with a deadline: a hung rank is
    killed, not waited for.

    `fn` travels by reference, as under `mp.spawn`, but a child costs a fork instead of an
    interpreter importing torch. Plain `mp.spawn(join=True)` has no timeout, and a stuck
    non-daemon child would also block the interpreter's exit, holding the whole test
    session hostage.
    """
    _context()  # the forkserver starts with its preloaded modules
    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
                process.join(10)
            pytest.fail(f"ranks of {getattr(fn, '__name__', fn)} did not finish within {timeout}s")


def torchrun(args: list[str], nproc: int = 2, timeout: float = 120, max_restarts: int = 0,
             env: dict[str, str] | None = None, module: str = "reference_impl.train") -> Run:
    """`torchrun --standalone` on a free port running `module` (or a script path) with `args`."""
    return run_command(torchrun_command(nproc, module, args, max_restarts), timeout, env)


def train_ok(args: list[str], ckpt: Path, *flags: str, nproc: int = 2, restarts: int = 0) -> Run:
    """The trainer with `args`, checkpoints in `ckpt` and `flags`; the job must succeed.

    It runs on forked ranks (`forked_ranks`), restarted up to `restarts` times as torchrun's
    agent would, which skips the agent's and every rank's import of torch.
    """
    run = forked_ranks([*args, "--checkpoint-dir", str(ckpt), *flags], nproc=nproc, timeout=180,
                       max_restarts=restarts)
    assert run.returncode == 0, run.stderr[-4000:]
    return run


def python_module(args: list[str], timeout: float = 120, module: str = "reference_impl.train",
                  env: dict[str, str] | None = None, fresh: bool = False) -> Run:
    """`python -m module args` as a single process: `module.main(args)` in a process forked
    from the warm forkserver (`forked_ranks` without torchrun's environment), or with
    `fresh` a new interpreter, for what only one shows (its imports, its start-up)."""
    if fresh:
        return run_command([sys.executable, "-m", module, *args], timeout, env)
    return forked_ranks(args, nproc=1, timeout=timeout, env=env, module=module, torchrun_env=False)


# What every forked rank starts with already imported: torch alone costs ~2 s per process,
# and torch._dynamo (imported by the first optimizer step) ~2 s more.
FORKSERVER_PRELOAD = ["torch", "torch._dynamo", "reference_impl.train", "launch"]
_forkserver: ForkServerContext | None = None


def _context() -> ForkServerContext:
    """The forkserver of this test process, started on first use with one intra-op thread."""
    global _forkserver
    if _forkserver is None:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # read by torch's import in the server
        _forkserver = multiprocessing.get_context("forkserver")
        _forkserver.set_forkserver_preload(FORKSERVER_PRELOAD)
    return _forkserver


def _rank_main(module: str, argv: list[str], env: dict[str, str], out: str, err: str,
               without_package: bool = False) -> None:
    """One rank: its environment, output to files, `module.main(argv)` (or the script
    `module` run as `__main__`), then `os._exit`, as the trainer ends (`exit_after`).

    The descriptors themselves are redirected, so C++ output (gloo, c10d) lands in the
    files too. The process never returns into the forkserver's code. With
    `without_package`, `import reference_impl` fails in the rank, as in a blank notebook
    (tests/without_package.py; the forkserver's copy of the package is dropped first).
    """

    def rank() -> int:
        # A job that outlives its deadline asks each live rank for its threads' stacks first.
        faulthandler.register(STACKS_SIGNAL, file=sys.__stderr__, all_threads=True)
        if without_package:
            import without_package as blank

            blank.block()
        os.environ.update(env)
        os.chdir(REPO)  # where `run_command` starts its processes
        # A rank torchrun starts creates its DataLoader workers by fork, Linux's default;
        # a forkserver's child would otherwise start another forkserver that imports torch.
        multiprocessing.set_start_method("fork", force=True)
        for fd, path in ((1, out), (2, err)):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        if module.endswith(".py"):  # a script: what `python script.py argv` runs
            sys.argv = [module, *argv]
            runpy.run_path(module, run_name="__main__")
            return 0
        return importlib.import_module(module).main(argv) or 0

    exit_after(rank)


def forked_ranks(args: list[str], nproc: int = 2, timeout: float = 120, env: dict[str, str] | None = None,
                 module: str = "reference_impl.train", max_restarts: int = 0, torchrun_env: bool = True,
                 without_package: bool = False) -> Run:
    """Like `torchrun`: `nproc` ranks forked from a warm forkserver, restarted as its agent would.

    Each rank gets the environment torchrun would give it and calls `module.main(args)`
    in a real gloo process group. When a rank fails, its attempt ends as under torchrun's
    agent: the other ranks get SIGTERM, then SIGKILL after `STOP_GRACE_S`, and up to
    `max_restarts` new attempts start with `TORCHELASTIC_RESTART_COUNT` one higher (on a
    fresh port, where torchrun's agent would prefix its store per attempt). What stays
    torchrun's own (its agent's signals and its reporting) is tested under `torchrun`.
    A rank costs a fork instead of an interpreter importing torch. stdout and stderr are
    the ranks' in attempt and rank order; the return code is 0 if the last attempt
    succeeded, else the first failed rank's status (minus the signal number for a killed
    rank, as torchrun's `Popen` would show). Without `torchrun_env` the ranks get only
    `env`: one such rank is a plain single process. `module` may also be a script's path
    (`*.py`), run as `__main__` with `args` as its `sys.argv[1:]`; `without_package` hides
    `reference_impl` from the ranks.
    """
    # The first job of a test process starts the forkserver, which imports torch: on a loaded
    # machine that can take a minute, which is no part of the job's own time.
    _context()
    multiprocessing.forkserver.ensure_running()
    started, deadline = time.perf_counter(), time.monotonic() + timeout
    outputs: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        for attempt in range(max_restarts + 1):
            port = free_port()
            envs = [{**(_torchrun_env(rank, nproc, attempt, port) if torchrun_env else {}), **(env or {})}
                    for rank in range(nproc)]
            status, files = _attempt(module, args, envs, Path(tmp, str(attempt)), deadline, without_package)
            outputs += [(_read(out), _read(err)) for out, err in files]
            if status is None or status == 0:
                break
    stdout, stderr = ("".join(pair[i] for pair in outputs) for i in (0, 1))
    if status is None:
        pytest.fail(f"forked ranks of {module} {' '.join(args)} timed out after {timeout:.0f}s\n"
                    f"{stdout[-3000:]}\n{stderr[-5000:]}")
    return Run(status, stdout, stderr, time.perf_counter() - started, parse_events(stdout))


def _read(path: str) -> str:
    """What a rank wrote to `path`; empty if it was stopped before it opened the file."""
    try:
        return Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return ""


STOP_GRACE_S = 30.0  # torchrun's agent waits this long after SIGTERM before it sends SIGKILL


def _torchrun_env(rank: int, nproc: int, attempt: int, port: int) -> dict[str, str]:
    """The environment torchrun gives `rank` of `nproc` on one node in restart `attempt`."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": str(attempt),
            "TORCHELASTIC_RUN_ID": f"forked-{port}"}


def _attempt(module: str, args: list[str], envs: list[dict[str, str]], tmp: Path, deadline: float,
             without_package: bool) -> tuple[int | None, list[tuple[str, str]]]:
    """One attempt of a forked job: its status (None if it outlived `deadline`) and output files.

    The ranks are not daemons, because a rank's DataLoader starts worker processes; so
    whatever ends this attempt (its end, the deadline, a test's own timeout) kills every
    rank still alive, with its descendants, before it returns.
    """
    ctx = _context()
    tmp.mkdir()
    files = [(f"{tmp}/{rank}.out", f"{tmp}/{rank}.err") for rank in range(len(envs))]
    ranks: list[multiprocessing.process.BaseProcess] = []
    try:
        for rank, rank_env in enumerate(envs):
            process = ctx.Process(target=_rank_main,
                                  args=(module, list(args), rank_env, *files[rank], without_package))
            process.start()
            ranks.append(process)
        status = _wait(ranks, deadline)
        if status is None:
            _report_live(ranks, files)
        return status, files
    finally:
        for process in ranks:
            if process.exitcode is None:
                kill_descendants(process.pid)
                process.join(30)


STACKS_SIGNAL = signal.SIGUSR1


def _report_live(ranks: list[multiprocessing.process.BaseProcess], files: list[tuple[str, str]]) -> None:
    """Before a timed-out attempt is killed: each live rank's stacks, then its state as the
    kernel saw it (a `Z` is a rank that ended and was never reaped), in that rank's stderr."""
    live = [(rank, process, _kernel_state(process.pid)) for rank, process in enumerate(ranks)
            if process.exitcode is None]
    for _, process, _ in live:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, STACKS_SIGNAL)
    if live:
        time.sleep(2)  # faulthandler writes from the signal handler, at once, without the GIL
    for rank, process, state in live:  # after the stacks, which the rank writes at its own offset
        with open(files[rank][1], "a") as err:
            err.write(f"[forked_ranks] rank {rank} (pid {process.pid}) was still running at the deadline "
                      f"({state}); its threads' stacks are above\n")


def _kernel_state(pid: int) -> str:
    """The process's state letter and the kernel function it sleeps in, from /proc."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        wchan = Path(f"/proc/{pid}/wchan").read_text() or "-"
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    return f"state {state}, waiting in {wchan}"


def _wait(ranks: list[multiprocessing.process.BaseProcess], deadline: float) -> int | None:
    """Wait for the ranks as torchrun's agent does: 0 when all succeed; at the first failure,
    SIGTERM to the others and at most `STOP_GRACE_S` for them, then that failure's status.
    None if no rank failed and some are still running at `deadline`."""
    failed: int | None = None
    stop_at = deadline
    while (live := [p for p in ranks if p.exitcode is None]) and time.monotonic() < stop_at:
        multiprocessing.connection.wait([p.sentinel for p in live], max(0.0, stop_at - time.monotonic()))
        for process in ranks:
            process.join(0)
        if failed is None and (codes := [p.exitcode for p in ranks if p.exitcode]):
            failed, stop_at = codes[0], min(deadline, time.monotonic() + STOP_GRACE_S)
            for process in ranks:
                if process.exitcode is None:
                    with contextlib.suppress(ProcessLookupError):  # it may have died since the join
                        os.kill(process.pid, signal.SIGTERM)
    if failed is None and any(p.exitcode is None for p in ranks):
        return None
    return failed or 0

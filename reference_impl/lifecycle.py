"""The run's lifetime: death with the launcher, and a preemption (SIGTERM) that ends at a
step boundary with a checkpoint, which the DataLoader's workers leave to their rank. (One
writer per checkpoint directory is the checkpoint manager's lock:
`reference_impl.checkpoint.lock`.)"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from types import FrameType, TracebackType

import torch
import torch.distributed as dist

from reference_impl import STARTED_BY
from reference_impl.distributed import DistContext
from reference_impl.metrics import EventLog

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: stopped on request with a checkpoint; relaunch to resume
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Under torchrun, make this worker die with its agent, even one that died already.

    A SIGKILLed agent cannot stop its workers; they would keep training, orphaned, and
    race a relaunch for the checkpoint directory. On Linux the kernel delivers SIGKILL
    when the parent dies (PR_SET_PDEATHSIG); elsewhere a thread watches the parent pid.
    Both only see deaths from this call on, and the caller has spent seconds importing
    torch first, so the parent is the one `reference_impl` recorded when it was imported,
    before torch: an agent that died in between has left this worker with another parent.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    parent = _launcher()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
            if _orphaned(parent):  # the agent died before prctl took effect
                os.kill(os.getpid(), signal.SIGKILL)
            return
    threading.Thread(target=_watch_parent, args=(parent,), name="parent-watch", daemon=True).start()


def _launcher() -> int:
    """The pid of the process that started this one, as recorded before torch was imported."""
    pid, parent = STARTED_BY
    # A process forked after the import inherits its parent's record; its own parent,
    # alive when it forked, is the one to die with.
    return parent if pid == os.getpid() else os.getppid()


def _orphaned(parent: int) -> bool:
    """True if `parent` is gone: this process has been handed to a reaper."""
    if os.getppid() != parent:
        return True
    # pid 1 adopts orphans, so a worker whose agent died before `reference_impl` was even
    # imported recorded pid 1 as its parent. It is alive only where the agent itself is
    # pid 1, as when torchrun is the first process of a container.
    return parent == 1 and not _is_torch_launcher(1)


def _is_torch_launcher(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"torch" in f.read()  # torchrun, python -m torch.distributed.run
    except OSError:
        return False


def _watch_parent(parent: int) -> None:
    while not _orphaned(parent):
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)


def loader_worker_init(worker_id: int) -> None:
    """The trainer's DataLoader `worker_init_fn`: a loader worker takes SIGTERM only from its rank.

    torchrun, like most schedulers, sends SIGTERM to each worker's whole process group,
    so the loader's worker processes get it too. Dying of it, they would fail their rank
    with "DataLoader worker ... killed by signal" before it reaches the step boundary
    where it saves and exits. So a worker ignores a SIGTERM sent by any other process
    and serves batches until its rank shuts it down. It obeys its rank's: Python's exit
    terminates daemonic children and then waits for them, so a rank leaving on an error
    with its loader still open would wait forever on workers deaf to SIGTERM. A rank
    that dies outright is noticed by the DataLoader's own watchdog, which polls the
    parent pid and ends the worker within seconds.

    The DataLoader seeds each worker before calling this, and nothing here draws random
    numbers: the data order and every RNG stream are unchanged. Where
    `signal.sigwaitinfo` does not exist (macOS), the worker keeps the default.

    Args:
        worker_id: The worker's index within this rank's DataLoader (unused).
    """
    if not hasattr(signal, "sigwaitinfo"):
        return
    # Blocked before the handler changes: a SIGTERM arriving now waits for the filter.
    # Threads the worker starts later inherit the mask, so only the filter receives it.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # torch's worker handler, or an inherited one
    threading.Thread(target=_sigterm_from_rank_only, args=(os.getppid(),), name="sigterm-filter",
                     daemon=True).start()


def _sigterm_from_rank_only(rank: int) -> None:
    while signal.sigwaitinfo({signal.SIGTERM}).si_pid != rank:
        pass  # the group's signal: the rank decides when its loader stops
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    signal.raise_signal(signal.SIGTERM)  # die of it, as a worker without the filter would


# --8<-- [start:preemption]
class Preemption:
    """Turns SIGTERM into a stop at the next step boundary, agreed by every rank.

    The handler only sets a flag. At each step boundary the ranks all-reduce it (MAX),
    so a signal that reached one rank, or reached the ranks at different steps, still
    stops all of them after the same step: the caller saves that step and exits with
    `PREEMPTED_EXIT`. The flag travels on a gloo group (the default one when it is
    gloo), so the check never synchronizes a GPU. If the stop has not finished within
    `grace_s` of the signal, the process exits with status 1 instead.
    """

    def __init__(self, grace_s: float, ctx: DistContext, log: EventLog) -> None:
        self.grace_s, self.ctx, self.log = grace_s, ctx, log
        self.requested = False
        self._group = dist.new_group(backend="gloo") if ctx.distributed and ctx.backend != "gloo" else None
        self._timer: threading.Timer | None = None
        self._previous: object = None
        self._pid = os.getpid()

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():  # only it may set handlers
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)  # type: ignore[arg-type]
        if self._timer:
            self._timer.cancel()

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        # A forked DataLoader worker runs this inherited handler if a SIGTERM comes before
        # the DataLoader replaces it; a grace timer started there would kill the worker.
        if self.requested or os.getpid() != self._pid:
            return
        self.requested = True
        self.log.emit("sigterm_received", grace_s=self.grace_s)
        self._timer = threading.Timer(self.grace_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        self.log.emit("error", phase="preemption", error="PreemptionTimeout",
                      message=f"no checkpoint within the grace period of {self.grace_s}s after SIGTERM; "
                              "the last published checkpoint stands")
        os._exit(1)

    def should_stop(self) -> bool:
        """True on every rank once any rank has received SIGTERM (a collective).

        With several ranks this is a blocking all-reduce at every step boundary; a
        single process reads its own flag.
        """
        if not self.ctx.distributed:
            return self.requested
        flag = torch.tensor(float(self.requested))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())
# --8<-- [end:preemption]

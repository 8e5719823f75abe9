"""The run's lifetime: death with the launcher, and a preemption (SIGTERM) that ends at a
step boundary with a checkpoint. (One writer per checkpoint directory is the checkpoint
manager's lock: `reference_impl.checkpoint.lock`.)"""

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

from reference_impl.distributed import DistContext
from reference_impl.metrics import EventLog

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: stopped on request with a checkpoint; relaunch to resume
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Under torchrun, make this worker die with its agent.

    A SIGKILLed agent cannot stop its workers; they would keep training, orphaned, and
    race a relaunch for the checkpoint directory. On Linux the kernel delivers SIGKILL
    when the parent dies (PR_SET_PDEATHSIG); elsewhere a thread watches the parent pid.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
            if os.getppid() != parent:  # the agent died before prctl took effect
                os.kill(os.getpid(), signal.SIGKILL)
            return
    threading.Thread(target=_watch_parent, args=(parent,), name="parent-watch", daemon=True).start()


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)


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
        if self.requested:
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
        """True on every rank once any rank has received SIGTERM (a collective)."""
        flag = torch.tensor(float(self.requested))
        if self.ctx.distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())
# --8<-- [end:preemption]

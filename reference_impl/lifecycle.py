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
    if _sigkill_when_parent_dies():
        if _orphaned(parent):  # the agent died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)
        return
    threading.Thread(target=_watch_parent, args=(parent,), name="parent-watch", daemon=True).start()


def _sigkill_when_parent_dies() -> bool:
    """Have the kernel SIGKILL this process when its parent dies (Linux); False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0


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
    that dies outright takes its workers with it (SIGKILL on its death, on Linux): a
    worker holds a copy of its rank's gloo sockets, so while it lived the other ranks
    saw no connection close and waited, blocked in a collective, until the DataLoader's
    own watchdog noticed the dead parent at its next 5 s poll. (That watchdog still ends
    a worker whose rank died before this call.)

    The DataLoader seeds each worker before calling this, and nothing here draws random
    numbers: the data order and every RNG stream are unchanged. Where
    `signal.sigwaitinfo` does not exist (macOS), the worker keeps the default.

    Args:
        worker_id: The worker's index within this rank's DataLoader (unused).
    """
    _sigkill_when_parent_dies()
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
AGREE_AT_LEAST_EVERY = 10  # steps: bounds the work done after a signal on fast steps


class Preemption:
    """Turns SIGTERM into a stop at a step boundary, agreed by every rank.

    The handler only sets a flag. With several ranks the flag is agreed without blocking
    a step: at an agreement boundary each rank starts an asynchronous all-reduce (MAX) of
    its flag and of its seconds per step, and reads the result at the next boundary, one
    step later, when it has long arrived. Every rank reads the same result at the same
    step, so a signal that reached one rank, or reached the ranks at different steps,
    stops all of them after the same step: the caller saves that step and exits with
    `PREEMPTED_EXIT`. The agreed (slowest) step time sets the next agreement about
    `grace_s / 20` seconds later, and at most `AGREE_AT_LEAST_EVERY` steps later, so most
    steps pay for no collective at all and the stop still comes within a small part of
    the grace period and a few steps of the signal. The flag travels on a gloo
    group (the default one when it is gloo), so the check never synchronizes a GPU. If
    the stop has not finished within `grace_s` of the signal, the process exits with
    status 1 instead.
    """

    def __init__(self, grace_s: float, ctx: DistContext, log: EventLog) -> None:
        self.grace_s, self.ctx, self.log = grace_s, ctx, log
        self.requested = False
        self.agreements = 0  # all-reduces started
        self._group = dist.new_group(backend="gloo") if ctx.distributed and ctx.backend != "gloo" else None
        self._timer: threading.Timer | None = None
        self._previous: object = None
        self._pid = os.getpid()
        self._pending: tuple[dist.Work, torch.Tensor] | None = None
        self._next_agreement = 1  # the step boundary that starts the next all-reduce
        self._since: tuple[int, float] = (0, time.monotonic())  # boundary and time of the last start

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
        if self._pending and kind is None:  # every rank started it: it completes at once
            self._pending[0].wait()

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

    def should_stop(self, step: int) -> bool:
        """True on every rank at the same step once any rank has received SIGTERM.

        Args:
            step: The step just finished; every rank passes the same sequence.

        A single process reads its own flag. With several ranks the answer at `step` is
        the agreement started one boundary earlier, so it never waits on a peer that is
        still computing; the stop comes at most one agreement interval and two steps after
        the signal reached the last rank.
        """
        if not self.ctx.distributed:
            return self.requested
        stop = False
        if self._pending:
            work, flags = self._pending
            work.wait()  # started a whole step ago: already done
            self._pending = None
            stop = bool(flags[0] > 0)
            # The slowest rank's seconds per step, identical on every rank after the MAX.
            every = int(self.grace_s / 20 / max(float(flags[1]), 1e-6))
            every = min(max(every, 1), AGREE_AT_LEAST_EVERY)
            self._next_agreement = step - 1 + every
        if not stop and step >= self._next_agreement:
            last_step, last_time = self._since
            now = time.monotonic()
            flags = torch.tensor([float(self.requested), (now - last_time) / max(step - last_step, 1)])
            self._since = (step, now)
            work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
            assert work is not None  # async_op=True always returns the handle
            self._pending = (work, flags)
            self.agreements += 1
        return stop
# --8<-- [end:preemption]

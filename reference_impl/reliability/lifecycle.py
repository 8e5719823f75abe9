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
from contextlib import suppress
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


_WAKEUP_FDS: dict[int, int] = {}  # write end this process set as its wakeup fd -> the one it replaced


def _forget_wakeup_fd() -> None:
    """In a forked child: a signal here must not write into the parent's watcher pipe."""
    with suppress(ValueError):  # not the main thread: the fd is not ours to change
        current = signal.set_wakeup_fd(-1)
        signal.set_wakeup_fd(_WAKEUP_FDS.get(current, current))
    _WAKEUP_FDS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_wakeup_fd)


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
    status 1 instead, even from inside a collective that never returns: Python runs a
    signal's handler only on the main thread, between bytecodes, so a rank blocked in
    gloo would not run it until the collective timed out (minutes later). The grace
    clock therefore starts from a thread that reads the signal's byte from the
    interpreter's wakeup fd, which the C-level handler writes at once.
    """

    def __init__(self, grace_s: float, ctx: DistContext, log: EventLog) -> None:
        self.grace_s, self.ctx, self.log = grace_s, ctx, log
        self.requested = False
        self.agreements = 0  # all-reduces started
        self._group = dist.new_group(backend="gloo") if ctx.distributed and ctx.backend != "gloo" else None
        self._timer: threading.Timer | None = None
        self._grace_once = threading.Lock()  # taken once, by the first to see the signal; never released
        self._previous: object = None
        self._wakeup: tuple[int, int, int] | None = None  # read end, write end, the previous wakeup fd
        self._pid = os.getpid()
        self._pending: tuple[dist.Work, torch.Tensor] | None = None
        self._next_agreement = 1  # the step boundary that starts the next all-reduce
        self._since: tuple[int, float] = (0, time.monotonic())  # boundary and time of the last start

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():  # only it may set handlers
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._watch_wakeup_fd()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._wakeup:
            read_end, write_end, previous = self._wakeup
            signal.set_wakeup_fd(previous)
            _WAKEUP_FDS.pop(write_end, None)
            with suppress(OSError):  # a watcher that already ended has closed the read end
                os.write(write_end, b"\0")  # ends the watcher, which closes its read end
            os.close(write_end)
            self._wakeup = None
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)  # type: ignore[arg-type]
        if self._timer:
            self._timer.cancel()
        if self._pending and kind is None:  # every rank started it: it completes at once
            self._pending[0].wait()

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        # A forked DataLoader worker runs this inherited handler if a SIGTERM comes before
        # the DataLoader replaces it; a grace timer started there would kill the worker.
        if os.getpid() == self._pid:
            self._start_grace()

    def _start_grace(self) -> None:
        """Request the stop and start the grace clock, once: from the handler or the watcher."""
        self.requested = True
        if not self._grace_once.acquire(blocking=False):
            return
        self.log.emit("sigterm_received", grace_s=self.grace_s)
        self._timer = threading.Timer(self.grace_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _watch_wakeup_fd(self) -> None:
        """Start the grace clock from a thread when SIGTERM arrives, whatever the main thread does.

        The interpreter's C-level handler writes each signal's number to the wakeup fd as
        the signal arrives; the Python handler waits for the main thread. A forked child
        inherits the pipe, so it drops the wakeup fd at once (`_forget_wakeup_fd`): its own
        signals must not start its parent's clock. A wakeup fd set by someone else (an
        asyncio loop) still gets every byte.
        """
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)  # the C handler must never block on it
        previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        self._wakeup = (read_end, write_end, previous)
        _WAKEUP_FDS[write_end] = previous
        threading.Thread(target=self._watch, args=(read_end, previous), name="preemption-grace",
                         daemon=True).start()

    def _watch(self, read_end: int, previous: int) -> None:
        try:
            while (data := os.read(read_end, 64)) and b"\0" not in data:
                if previous >= 0:
                    with suppress(OSError):
                        os.write(previous, data)
                if signal.SIGTERM in data:
                    self._start_grace()
        finally:
            os.close(read_end)

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

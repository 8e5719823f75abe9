"""Fault injection and the stalled-step watchdog: how the tests make real failures."""

from __future__ import annotations

import errno
import faulthandler
import os
import signal
import sys
import threading
import time
from types import TracebackType

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from reference_impl.config import TrainConfig
from reference_impl.distributed import DistContext
from reference_impl.metrics import EventLog, PhaseTimer
from reference_impl.parallel.registry import unwrap


class FaultInjector:
    """Fires the configured fault once, on the configured rank, step and restart attempt.

    `--fail-at-step 15,25` fails at step 15 on the first attempt and at step 25 on the
    second, so one run can be killed several times.
    """

    def __init__(self, cfg: TrainConfig, ctx: DistContext) -> None:
        attempt = ctx.restart_count
        armed = ctx.rank == cfg.fail_rank and attempt < len(cfg.fail_at_step)
        self.step = cfg.fail_at_step[attempt] if armed else None
        self.mode = cfg.fail_mode
        self.slow_s = cfg.fail_slow_s
        self._poison: RemovableHandle | None = None

    @classmethod
    def disabled(cls) -> FaultInjector:
        """An injector that never fires."""
        injector = cls.__new__(cls)
        injector.step, injector.mode, injector._poison = None, "sigkill", None
        return injector

    def before_step(self, step: int, model: nn.Module | None = None) -> None:
        """SIGKILL or SIGTERM this process, hang it, slow it or poison `model`'s forward,
        before `step` runs."""
        if self._poison:  # the poisoned step is over (or was rolled back): the fault was transient
            self._poison.remove()
            self._poison = None
        if self.mode == "slow" and self.step is not None and step >= self.step:
            time.sleep(self.slow_s)  # a slow host: this rank's peers wait for it in the gradient sync
            return
        if step != self.step:
            return
        if self.mode == "nan" and model is not None:
            self.step = None  # once: a rollback that trains this step again finds it healthy
            _, target = poison_target(model)
            self._poison = target.register_forward_hook(_non_finite_output)
            return
        if self.mode == "sigkill":
            kill_self()
        elif self.mode == "sigterm":  # what a scheduler sends before preempting the node
            os.kill(os.getpid(), signal.SIGTERM)
        elif self.mode == "hang":
            while True:  # a stuck rank: its peers block in the next collective
                time.sleep(3600)

    def write_limit(self, step: int) -> int | None:
        """Bytes after which this rank's checkpoint write fails with ENOSPC, if armed."""
        return 4096 if step == self.step and self.mode == "write-error" else None

    def after_write(self, step: int, path: str) -> None:
        """Simulate a crash in the middle of writing `path`: tear it, then die."""
        if step == self.step and self.mode == "crash-mid-write":
            os.truncate(path, os.path.getsize(path) // 2)
            kill_self()

    def before_publish(self, step: int) -> None:
        """Simulate a crash after every file is written but before the atomic rename."""
        if step == self.step and self.mode == "crash-before-publish":
            kill_self()


def poison_target(model: nn.Module) -> tuple[str, nn.Module]:
    """The module whose output a `nan` fault poisons, with its name: the middle one of the
    modules that hold parameters themselves, so the first non-finite output is neither the
    model's first module nor its last."""
    holders = [(name, m) for name, m in unwrap(model).named_modules()
               if any(True for _ in m.parameters(recurse=False))]
    return holders[len(holders) // 2]


def _non_finite_output(module: nn.Module, args: tuple[object, ...], output: torch.Tensor) -> torch.Tensor:
    return output * float("nan")


def kill_self() -> None:
    """SIGKILL: no cleanup, no flush of anything but what we flush here. A real crash."""
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def enospc() -> OSError:
    """The error a full disk raises."""
    return OSError(errno.ENOSPC, "No space left on device (injected)")


class Watchdog:
    """Fails the job when no step completes within `timeout_s`, naming rank and phase.

    A collective with a dead peer raises after the process-group timeout; a rank that
    is stuck elsewhere (a deadlocked loader, a hung filesystem) would wait forever. The
    watchdog turns both into a bounded, reported failure: it prints every thread's stack
    (faulthandler), emits an `error` event and exits, so torchrun tears the job down.
    """

    def __init__(self, timeout_s: float, timer: PhaseTimer, log: EventLog) -> None:
        self.timeout_s, self.timer, self.log = timeout_s, timer, log
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        if self.timeout_s > 0:
            self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()

    def beat(self) -> None:
        """Record that a step completed."""
        self._last = time.monotonic()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            stalled = time.monotonic() - self._last
            if stalled > self.timeout_s:
                self.log.emit("error", phase=self.timer.current, error="StepTimeout",
                              message=f"no step completed for {stalled:.1f}s "
                                      f"(step_timeout_s={self.timeout_s})")
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                os._exit(3)

"""Phase timers that are right on GPU and CPU, and structured JSON events."""

# --8<-- [start:imports]
from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from typing import Any, TextIO

import torch

# --8<-- [end:imports]

PHASES = ("data", "h2d", "forward", "backward", "optimizer")


# --8<-- [start:phase_timer]
class PhaseTimer:
    """Accumulates time per training phase without syncing the device on every step.

    On CUDA, device phases are bracketed by CUDA events: the host only enqueues the
    events, and `flush` (called at log steps) waits once and reads the GPU time. A
    host clock around asynchronous kernels would measure launch time, not GPU time.
    On the CPU the work is synchronous, so `perf_counter` is exact. Data wait is always
    host time: it is the host that waits for the DataLoader.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.current = "startup"  # the phase a failure report names
        self._host: dict[str, float] = defaultdict(float)
        self._events: list[tuple[str, Any, Any]] = []
        self._phases: dict[str, _Phase] = {}

    def phase(self, name: str, host: bool = False) -> _Phase:
        """Time the enclosed block under `name`; `host=True` forces the host clock.

        One reusable context manager per phase name: a step enters five of them, so
        they cost an attribute write and a clock read each, not a generator apiece.
        """
        found = self._phases.get(name)
        if found is None or found.host != host:
            found = self._phases[name] = _Phase(self, name, host or not self.cuda)
        return found

    def host_seconds(self, name: str) -> float:
        """Host seconds spent in phase `name` since the last flush (0 for a device-timed phase)."""
        return self._host.get(name, 0.0)

    def flush(self) -> dict[str, float]:
        """Return seconds per phase since the last flush and reset (syncs CUDA once)."""
        totals = dict(self._host)
        if self._events:
            torch.cuda.synchronize()
            for name, start, end in self._events:
                totals[name] = totals.get(name, 0.0) + start.elapsed_time(end) / 1000.0
        self._host.clear()
        self._events.clear()
        return totals


class _Phase:
    """One phase of a `PhaseTimer`; a failure inside it leaves `current` naming it."""

    __slots__ = ("timer", "name", "host", "_start")

    def __init__(self, timer: PhaseTimer, name: str, host: bool) -> None:
        self.timer, self.name, self.host = timer, name, host
        self._start: Any = None

    def __enter__(self) -> None:
        self.timer.current = self.name
        if self.host:
            self._start = time.perf_counter()
        else:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if kind is not None:
            return  # the failure report names this phase; its time is not a measurement
        if self.host:
            self.timer._host[self.name] += time.perf_counter() - self._start
        else:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.timer._events.append((self.name, self._start, end))
        self.timer.current = f"after_{self.name}"
# --8<-- [end:phase_timer]


# --8<-- [start:events]
class EventLog:
    """One JSON object per line on stdout; progress from rank 0, errors from any rank."""

    def __init__(self, rank: int, stream: TextIO | None = None) -> None:
        self.rank = rank
        self.stream = stream

    def emit(self, event: str, **fields: Any) -> None:
        """Write an event from this rank, whatever the rank."""
        record = {"event": event, "rank": self.rank, "time": round(time.time(), 3), **fields}
        out = self.stream or sys.stdout
        out.write(json.dumps(record, default=str) + "\n")
        out.flush()

    def progress(self, event: str, **fields: Any) -> None:
        """Write an event from rank 0 only, so N ranks do not print N copies."""
        if self.rank == 0:
            self.emit(event, **fields)

    def error(self, phase: str, exc: BaseException, **fields: Any) -> None:
        """Report a failure with the rank and the phase it happened in."""
        self.emit("error", phase=phase, error=type(exc).__name__, message=str(exc), **fields)
# --8<-- [end:events]


class Throughput:
    """Samples per second over the window between two log steps."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()
        self._samples = 0

    def add(self, samples: int) -> None:
        """Count samples trained in this window."""
        self._samples += samples

    def rate(self) -> float:
        """Samples per second since the last call, then start a new window."""
        now = time.perf_counter()
        rate = self._samples / max(now - self._t0, 1e-9)
        self._t0, self._samples = now, 0
        return rate

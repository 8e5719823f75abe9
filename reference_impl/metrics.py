"""Phase timers that are right on GPU and CPU, and structured JSON events."""

# --8<-- [start:imports]
from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
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

    @contextmanager
    def phase(self, name: str, host: bool = False) -> Iterator[None]:
        """Time the enclosed block under `name`; `host=True` forces the host clock."""
        self.current = name
        if self.cuda and not host:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((name, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._host[name] += time.perf_counter() - t0
        self.current = f"after_{name}"

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

"""What every benchmark shares: the registry, the report, and timing helpers."""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from reference_impl.config import TrainConfig
from reference_impl.distributed import DistContext
from reference_impl.launch import LaunchTimeout, Run, run
from reference_impl.metrics import EventLog
from reference_impl.state import TrainState
from reference_impl.train import build_state, train

BenchFn = Callable[[argparse.Namespace, TrainConfig], dict[str, Any]]
T = TypeVar("T")


class BenchmarkError(RuntimeError):
    """A benchmark ran but its result is unusable (a run failed, the loss did not fall)."""


@dataclass(frozen=True)
class Benchmark:
    """A registered benchmark.

    Attributes:
        run: Runs the benchmark, prints its report and returns the JSON summary.
        help: One line for `--help`.
        train_defaults: TrainConfig flags applied before the user's own flags.
        add_arguments: Adds the benchmark's own options to its subparser.
        nproc: Default number of torchrun processes (the `--nproc` option); 0 runs in
            the calling process without torchrun.
        check: Raises `ConfigError` for options the benchmark cannot run with; called
            before a launch under torchrun, so a bad option is one line from the launcher.
    """

    run: BenchFn
    help: str
    train_defaults: tuple[str, ...]
    add_arguments: Callable[[argparse.ArgumentParser], None]
    nproc: int
    check: Callable[[argparse.Namespace, TrainConfig], None]


def _accept_all(args: argparse.Namespace, cfg: TrainConfig) -> None:
    """A benchmark's `check` when it has no options of its own to refuse."""


BENCHMARKS: dict[str, Benchmark] = {}


def benchmark(name: str, help: str, train_defaults: Sequence[str] = (),
              add_arguments: Callable[[argparse.ArgumentParser], None] = lambda parser: None,
              nproc: int = 0,
              check: Callable[[argparse.Namespace, TrainConfig], None] = _accept_all,
              ) -> Callable[[BenchFn], BenchFn]:
    """Register the decorated function as the subcommand `name`.

    Args:
        name: Subcommand name on the command line.
        help: One-line description shown by `--help`.
        train_defaults: TrainConfig flags the benchmark starts from; the user's flags
            come after them, so they win.
        add_arguments: Adds options specific to this benchmark.
        nproc: When positive, the function runs once per rank under torchrun, started
            with this many processes unless `--nproc` says otherwise.
        check: Refuses options the benchmark cannot run with (`ConfigError`), before any launch.
    """
    def register(fn: BenchFn) -> BenchFn:
        BENCHMARKS[name] = Benchmark(fn, help, tuple(train_defaults), add_arguments, nproc, check)
        return fn
    return register


def report(name: str, header: Sequence[str], rows: Sequence[Sequence[Any]],
           summary: dict[str, Any]) -> dict[str, Any]:
    """Print a result table, then the JSON line `{"benchmark": name, **summary}`.

    Args:
        name: The benchmark's name, first key of the JSON line.
        header: Column titles.
        rows: One sequence of cells per row; floats print with 3 decimals.
        summary: Fields of the JSON line.

    Returns:
        The JSON line's object.
    """
    cells = [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    for row in [list(map(str, header)), ["-" * w for w in widths], *cells]:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
    record = {"benchmark": name, **summary}
    print(json.dumps(record), flush=True)
    return record


# Shared timing helpers.


class Clock:
    """Wall and process CPU time since construction.

    CPU time is reported next to wall time because on a shared machine a descheduled
    process loses wall time that has nothing to do with the loop being measured.
    """

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def per_step(self, steps: int) -> tuple[float, float]:
        """(wall, CPU) seconds per step over `steps` steps."""
        return (time.perf_counter() - self.wall) / steps, (time.process_time() - self.cpu) / steps


def timed(fn: Callable[[], object]) -> float:
    """Call `fn` once and return the wall-clock seconds it took."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleave(rounds: int, cases: dict[str, Callable[[], T]]) -> dict[str, list[T]]:
    """Run every case once per round, alternating the order from round to round.

    Drift in machine load (and the disk's write-back of an earlier case) then lands on
    every case alike instead of on whichever always runs second.

    Args:
        rounds: Number of rounds.
        cases: Name to a zero-argument function returning one measurement.

    Returns:
        Name to its measurements, one per round, in round order.
    """
    results: dict[str, list[T]] = {name: [] for name in cases}
    for r in range(rounds):
        for name in list(cases) if r % 2 == 0 else list(reversed(cases)):
            results[name].append(cases[name]())
    return results


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def median_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """A confidence interval for the median of the distribution `values` were drawn from.

    Distribution-free: the j-th smallest and j-th largest value, with j the largest rank
    for which the chance that fewer than j of n draws fall below the median, a binomial
    tail with p = 1/2, is at most (1 - confidence) / 2. Timings on a shared machine have
    long, lopsided tails, which this assumes nothing about. Below six values no rank
    reaches 95% and the interval is the whole range.

    Args:
        values: Independent measurements, e.g. one ratio per interleaved round.
        confidence: The interval's coverage.

    Returns:
        (low, high).
    """
    ordered, n = sorted(values), len(values)
    tail, below, j = (1 - confidence) / 2, 0.0, 0
    while below + math.comb(n, j) / 2**n <= tail:
        below += math.comb(n, j) / 2**n
        j += 1
    return (ordered[j - 1], ordered[n - j]) if j else (ordered[0], ordered[-1])


def settle(ctx: DistContext) -> None:
    """Write back every dirty page (untimed), so one case's I/O is not charged to the next."""
    if ctx.is_main:
        os.sync()
    if ctx.distributed:
        dist.barrier()


def slowest(ctx: DistContext, *seconds: float) -> tuple[float, ...]:
    """Each value's maximum over the ranks: a collective step waits for the slowest rank."""
    if not ctx.distributed:
        return seconds
    values = torch.tensor(seconds, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return tuple(values.tolist())


def shared_tempdir(ctx: DistContext) -> Path:
    """A fresh scratch directory created by rank 0, its path sent to every rank."""
    path = [tempfile.mkdtemp(prefix="bench-") if ctx.is_main else None]
    if ctx.distributed:
        dist.broadcast_object_list(path, src=0)
    return Path(str(path[0]))


def remove_shared(path: Path, ctx: DistContext) -> None:
    """Rank 0 deletes `path` once every rank is done with it."""
    if ctx.distributed:
        dist.barrier()
    if ctx.is_main:
        shutil.rmtree(path, ignore_errors=True)


def trained_state(cfg: TrainConfig, ctx: DistContext) -> TrainState:
    """Build the run's state and train `cfg.max_steps` steps, so AdamW's moments exist.

    Events go to an in-memory stream and no checkpoint is written: this is set-up.
    """
    state = build_state(cfg, ctx)
    train(replace(cfg, checkpoint_dir=None, checkpoint_every=0), ctx, EventLog(ctx.rank, io.StringIO()),
          state=state)
    return state


def _at_least(low: int, text: str) -> int:
    value = int(text)  # argparse reports a ValueError as "invalid <type name> value"
    if value < low:
        raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1 (rounds, threads, sizes)."""
    return _at_least(1, text)


def count(text: str) -> int:
    """An argparse type: a whole number of at least 0, where 0 skips the measurement."""
    return _at_least(0, text)


def int_list(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated whole numbers of at least 1, one or more."""
    values = tuple(positive_int(part) for part in text.split(",") if part.strip())
    if not values:
        raise argparse.ArgumentTypeError("needs at least one number")
    return values


def add_rounds_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="timed rounds of a sync and an async save, alternating which goes first")


def launched(cmd: Sequence[str], timeout: float) -> Run:
    """Run `cmd` with a deadline ([`run`][reference_impl.launch.run]); a timeout is a `BenchmarkError`."""
    try:
        return run(cmd, timeout)
    except LaunchTimeout as exc:
        raise BenchmarkError(str(exc)) from None

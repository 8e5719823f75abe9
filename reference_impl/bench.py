"""Benchmarks: `python -m reference_impl.bench NAME [options] [train flags]`.

Each benchmark is one function registered with [`benchmark`][reference_impl.bench.benchmark].
Flags the benchmark does not define are `TrainConfig` flags (`--model`, `--hidden-dim`,
...), applied on top of the benchmark's own defaults. Every benchmark ends with
[`report`][reference_impl.bench.report]: a readable table, then one JSON line that
scripts read (`{"benchmark": NAME, ...}`).

    python -m reference_impl.bench overhead --rounds 5 --model mlp --hidden-dim 512
    python -m reference_impl.bench checkpoint --hidden-dims 4096,10000
    python -m reference_impl.bench async --rounds 3
    python -m reference_impl.bench gpu --nproc 1

A benchmark registered with `nproc` (`async`, `gpu`) runs once per rank under torchrun.
Started with plain `python -m`, it relaunches itself as
`torchrun --standalone --nproc-per-node NPROC -m reference_impl.bench NAME ...` and
exits with torchrun's status; started by torchrun directly it simply runs. Rank 0
prints the report.
"""

from __future__ import annotations

import argparse
import gc
import io
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from reference_impl.checkpoint import AsyncSaver, published, restore_checkpoint, save_checkpoint
from reference_impl.config import ConfigError, TrainConfig
from reference_impl.distributed import DistContext, distributed
from reference_impl.metrics import PHASES, EventLog
from reference_impl.model import build_model, flops_per_sample, loss_fn
from reference_impl.parallel import unwrap
from reference_impl.pipeline import SCHEDULES, measure_bubble
from reference_impl.step import build_optimizer
from reference_impl.train import TrainState, build_dataset, build_state, preflight, train

BenchFn = Callable[[argparse.Namespace, TrainConfig], dict[str, Any]]
T = TypeVar("T")

# Dense bf16 peak FLOP/s per GPU, matched by substring of the device name, first match
# first. An H100 whose name does not say PCIe ("NVIDIA H100 80GB HBM3") is the SXM part.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12), ("L40S", 362e12))
RECOVERY_TIMEOUT_S = 300.0


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
    """

    run: BenchFn
    help: str
    train_defaults: tuple[str, ...]
    add_arguments: Callable[[argparse.ArgumentParser], None]
    nproc: int = 0


BENCHMARKS: dict[str, Benchmark] = {}


def benchmark(name: str, help: str, train_defaults: Sequence[str] = (),
              add_arguments: Callable[[argparse.ArgumentParser], None] = lambda parser: None,
              nproc: int = 0) -> Callable[[BenchFn], BenchFn]:
    """Register the decorated function as the subcommand `name`.

    Args:
        name: Subcommand name on the command line.
        help: One-line description shown by `--help`.
        train_defaults: TrainConfig flags the benchmark starts from; the user's flags
            come after them, so they win.
        add_arguments: Adds options specific to this benchmark.
        nproc: When positive, the function runs once per rank under torchrun, started
            with this many processes unless `--nproc` says otherwise.
    """
    def register(fn: BenchFn) -> BenchFn:
        BENCHMARKS[name] = Benchmark(fn, help, tuple(train_defaults), add_arguments, nproc)
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
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    record = {"benchmark": name, **summary}
    print(json.dumps(record), flush=True)
    return record


# Shared timing helpers.

class _Clock:
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


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def _settle(ctx: DistContext) -> None:
    """Write back every dirty page (untimed), so one case's I/O is not charged to the next."""
    if ctx.is_main:
        os.sync()
    if ctx.distributed:
        dist.barrier()


def _slowest(ctx: DistContext, *seconds: float) -> tuple[float, ...]:
    """Each value's maximum over the ranks: a collective step waits for the slowest rank."""
    if not ctx.distributed:
        return seconds
    values = torch.tensor(seconds, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return tuple(values.tolist())


def _shared_tempdir(ctx: DistContext) -> Path:
    """A fresh scratch directory created by rank 0, its path sent to every rank."""
    path = [tempfile.mkdtemp(prefix="bench-") if ctx.is_main else None]
    if ctx.distributed:
        dist.broadcast_object_list(path, src=0)
    return Path(str(path[0]))


def _remove(path: Path, ctx: DistContext) -> None:
    """Rank 0 deletes `path` once every rank is done with it."""
    if ctx.distributed:
        dist.barrier()
    if ctx.is_main:
        shutil.rmtree(path, ignore_errors=True)


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


def trained_state(cfg: TrainConfig, ctx: DistContext) -> TrainState:
    """Build the run's state and train `cfg.max_steps` steps, so AdamW's moments exist.

    Events go to an in-memory stream and no checkpoint is written: this is set-up.
    """
    state = build_state(cfg, ctx)
    train(replace(cfg, checkpoint_dir=None, checkpoint_every=0), ctx, EventLog(ctx.rank, io.StringIO()),
          state=state)
    return state


def torchrun_command(nproc: int, module: str, args: Sequence[str], max_restarts: int = 0) -> list[str]:
    """The command line of `torchrun --standalone` running `python -m module args`.

    Args:
        nproc: Processes to start.
        module: Module each process runs.
        args: The module's arguments.
        max_restarts: How many times torchrun restarts the group after a failure.
    """
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "--max-restarts", str(max_restarts), "-m", module, *args]


# overhead

def _add_overhead_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=5,
                        help="timed rounds; each runs both loops, alternating which goes first")
    # One thread by default: on a small shared machine a spinning intra-op pool turns
    # other processes' load into noise far larger than the overhead being measured.
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")


def bare_loop(cfg: TrainConfig) -> tuple[float, float]:
    """Train `cfg.max_steps` steps with the plainest loop; return (wall, CPU) seconds per step.

    Same model, data, batch size and optimizer as the trainer, nothing else: no timers,
    events, schedule, clipping or accumulation. Setup is not timed.
    """
    dataset = build_dataset(cfg)
    loader = DataLoader(dataset, batch_size=cfg.micro_batch_size, shuffle=True, drop_last=True,
                        num_workers=cfg.num_workers, generator=torch.Generator().manual_seed(cfg.seed))
    model = build_model(cfg)
    optimizer = build_optimizer(model, cfg)
    model.train()
    steps = 0
    clock = _Clock()
    while steps < cfg.max_steps:
        for x, y, _ in loader:
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            steps += 1
            if steps == cfg.max_steps:
                break
    return clock.per_step(cfg.max_steps)


def trainer_loop(cfg: TrainConfig) -> tuple[float, float]:
    """Run `reference_impl.train.train` in this process on the CPU; return (wall, CPU) s/step.

    Events go to an in-memory stream so terminal speed is not measured. Building the
    model, data and optimizer is not timed, as in `bare_loop`.
    """
    ctx = DistContext()
    state = build_state(cfg, ctx)
    clock = _Clock()
    train(cfg, ctx, EventLog(ctx.rank, io.StringIO()), state=state)
    return clock.per_step(cfg.max_steps)


@benchmark("overhead", "the trainer's loop against a bare PyTorch loop (per-step time, ratio)",
           train_defaults=("--model", "mlp", "--hidden-dim", "512", "--micro-batch-size", "128",
                           "--max-steps", "50", "--warmup-steps", "0", "--device", "cpu",
                           # The bare loop does not clip; clipping is configured math, not loop overhead.
                           "--grad-clip", "0"),
           add_arguments=_add_overhead_arguments)
def overhead(args: argparse.Namespace, cfg: TrainConfig) -> dict[str, Any]:
    """Median per-step wall (and CPU) time of the trainer and a bare loop, interleaved.

    One untimed warm-up of each comes first (thread pools, allocator). Each round then
    runs both loops, alternating which goes first, so drift in machine load lands on
    both sides.

    Args:
        args: `--rounds` and `--threads`.
        cfg: The run both loops train; `max_steps` is the steps per loop and round.
    """
    if cfg.world_size != 1 or cfg.grad_accum_steps != 1:
        raise ConfigError("overhead compares single-process loops without accumulation")
    torch.set_num_threads(args.threads)
    loops = {"trainer": trainer_loop, "bare": bare_loop}
    for fn in loops.values():
        fn(cfg)
    timings = interleave(args.rounds, {name: partial(fn, cfg) for name, fn in loops.items()})
    wall = {name: [w for w, _ in t] for name, t in timings.items()}
    cpu = {name: [c for _, c in t] for name, t in timings.items()}
    ms = {name: _median(t) * 1e3 for name, t in wall.items()}
    cpu_ms = {name: _median(t) * 1e3 for name, t in cpu.items()}
    ratio, cpu_ratio = ms["trainer"] / ms["bare"], cpu_ms["trainer"] / cpu_ms["bare"]
    rows = [[name, ms[name], min(wall[name]) * 1e3, max(wall[name]) * 1e3, cpu_ms[name]] for name in loops]
    rows.append(["trainer/bare", ratio, "", "", cpu_ratio])
    return report("overhead", ["loop", "median ms/step", "min", "max", "cpu ms/step"], rows, {
        "ratio": round(ratio, 4), "cpu_ratio": round(cpu_ratio, 4),
        "trainer_ms_per_step": round(ms["trainer"], 4), "bare_ms_per_step": round(ms["bare"], 4),
        "rounds": args.rounds, "steps": cfg.max_steps, "model": cfg.model,
        "micro_batch_size": cfg.micro_batch_size, "threads": args.threads,
        "config_digest": cfg.digest(),
    })


# checkpoint

def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def _add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds per measurement (median reported), and SIGKILL recovery runs")
    parser.add_argument("--hidden-dims", type=_int_list, default=(4096, 10000),
                        help="model sizes: comma-separated --hidden-dim values, one measurement each "
                             "(MLP: 4096 is 16.9M parameters, 10000 is 100.4M)")


def _raw_state(state: TrainState) -> dict[str, Any]:
    return {"model": unwrap(state.model).state_dict(), "optimizer": state.optimizer.state_dict()}


def checkpoint_round_trip(cfg: TrainConfig, rounds: int) -> dict[str, Any]:
    """Time our save and restore of one model size against raw `torch.save`/`torch.load`.

    In one process on the CPU, a model trained `cfg.max_steps` steps (so AdamW's two
    moments exist) is saved, in interleaved rounds, three ways into one directory:

    * ours: `save_checkpoint` (DDP layout: `torch.save` of model, optimizer, schedule and
      sampler hashed while writing, fsync of every file, manifest, atomic rename);
    * raw: `torch.save({"model": ..., "optimizer": ...}, path)`, without fsync: the data
      may still be in the page cache when the clock stops;
    * raw+fsync: the same followed by `os.fsync` of the file, a durable baseline.

    Then the newest files are restored, in interleaved rounds: ours with
    `restore_checkpoint` (verify every file's sha256, load with `weights_only=True`,
    load the state dicts) and raw with `torch.load(weights_only=True)` and the same two
    `load_state_dict` calls. Every case starts after an untimed `os.sync()`; restores
    read files the page cache holds, for both sides.

    Args:
        cfg: The run whose state is saved; `hidden_dim` sets the size.
        rounds: Timed rounds per case; medians are reported.

    Returns:
        Parameter count, state bytes, median seconds per case and the ratios.
    """
    ctx, log = DistContext(), EventLog(0, io.StringIO())
    state = trained_state(cfg, ctx)
    root = Path(tempfile.mkdtemp(prefix="bench-checkpoint-"))
    ckpt_cfg, raw = replace(cfg, checkpoint_dir=str(root)), root / "raw.pt"

    def save_ours() -> float:
        for old in published(root):
            shutil.rmtree(old)
        _settle(ctx)
        return timed(lambda: save_checkpoint(state, ckpt_cfg, ctx, log))

    def save_raw(fsync: bool) -> float:
        raw.unlink(missing_ok=True)
        _settle(ctx)

        def save() -> None:
            torch.save(_raw_state(state), raw)
            if fsync:
                fd = os.open(raw, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        return timed(save)

    def load_raw() -> None:
        saved = torch.load(raw, map_location="cpu", weights_only=True)
        unwrap(state.model).load_state_dict(saved["model"])
        state.optimizer.load_state_dict(saved["optimizer"])

    def restore(fn: Callable[[], object]) -> float:
        gc.collect()  # the previous case's loaded copy is freed before, not during, the timing
        _settle(ctx)
        return timed(fn)

    try:
        saves = interleave(rounds, {"ours": save_ours, "raw": partial(save_raw, False),
                                    "raw_fsync": partial(save_raw, True)})
        restores = interleave(rounds, {"ours": partial(restore, lambda: restore_checkpoint(state, ckpt_cfg, ctx, log)),
                                       "raw": partial(restore, load_raw)})
        state_bytes = raw.stat().st_size
    finally:
        shutil.rmtree(root, ignore_errors=True)
    save_s = {name: _median(t) for name, t in saves.items()}
    restore_s = {name: _median(t) for name, t in restores.items()}
    return {
        "hidden_dim": cfg.hidden_dim, "params": sum(p.numel() for p in state.model.parameters()),
        "state_bytes": state_bytes,
        "save_ours_s": round(save_s["ours"], 4), "save_raw_s": round(save_s["raw"], 4),
        "save_raw_fsync_s": round(save_s["raw_fsync"], 4),
        "restore_ours_s": round(restore_s["ours"], 4), "restore_raw_s": round(restore_s["raw"], 4),
        "save_ratio": round(save_s["ours"] / save_s["raw"], 4),
        "save_ratio_fsync": round(save_s["ours"] / save_s["raw_fsync"], 4),
        "restore_ratio": round(restore_s["ours"] / restore_s["raw"], 4),
    }


def recovery_times(events: Sequence[dict[str, Any]]) -> tuple[float, float]:
    """Seconds from the kill to the restore, and to the first step after it.

    The kill is dated by attempt 0's last `step` event: with `--log-every 1` rank 0
    logs every step, and the failing rank dies just before the next one.

    Args:
        events: The run's events (rank 0's progress across both attempts), in order.

    Returns:
        (kill to `checkpoint_restored` of attempt 1, kill to attempt 1's first `step`).

    Raises:
        BenchmarkError: The events do not show a kill, a restore and a resumed step.
    """
    names = [(e.get("event"), e.get("restart_count")) for e in events]
    try:
        restart = names.index(("run_start", 1))
        killed = [e for e in events[:restart] if e["event"] == "step"][-1]["time"]
        restored = names.index(("checkpoint_restored", 1), restart)
        resumed = next(e for e in events[restored:] if e["event"] == "step")["time"]
    except (ValueError, IndexError, StopIteration):
        raise BenchmarkError("the recovery run did not show a kill, a restore and a resumed step") from None
    return events[restored]["time"] - killed, resumed - killed


def run_events(cmd: list[str], timeout: float) -> tuple[int, list[dict[str, Any]], str]:
    """Run `cmd`, return its exit status, the events on its stdout and its stderr.

    Args:
        cmd: The command line.
        timeout: Seconds before the command is stopped (SIGTERM, which torchrun passes
            on to its workers; SIGKILL if it is still alive a minute later).

    Raises:
        BenchmarkError: The command outlived `timeout`.
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise BenchmarkError(f"timed out after {timeout:.0f}s: {' '.join(cmd)}") from None
    return proc.returncode, parse_events(out), err


def recovery_run() -> tuple[float, float]:
    """Kill rank 1 of a 2-rank torchrun job at step 15, let torchrun restart it, time it.

    The job is the trainer's small default MLP, checkpointing every 10 steps, so the
    numbers are the restart machinery (process start, rendezvous, verified restore),
    not checkpoint I/O.

    Returns:
        (kill to restore, kill to the first resumed step) in seconds, from the events'
        wall-clock `time` fields.

    Raises:
        BenchmarkError: The job failed, timed out or did not resume.
    """
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as root:
        flags = ["--max-steps", "30", "--warmup-steps", "0", "--micro-batch-size", "8",
                 "--dataset-size", "512", "--device", "cpu", "--checkpoint-dir", root,
                 "--checkpoint-every", "10", "--fail-at-step", "15", "--fail-rank", "1", "--log-every", "1"]
        rc, events, err = run_events(torchrun_command(2, "reference_impl.train", flags, max_restarts=1),
                                     RECOVERY_TIMEOUT_S)
    if rc != 0:
        raise BenchmarkError(f"the recovery run failed (exit {rc}): {err.strip().splitlines()[-1:]}")
    return recovery_times(events)


@benchmark("checkpoint", "save/restore of our checkpoints against raw torch.save/torch.load, "
                         "and SIGKILL-to-resumed-step recovery under torchrun",
           train_defaults=("--model", "mlp", "--micro-batch-size", "8", "--dataset-size", "64",
                           "--max-steps", "1", "--warmup-steps", "0", "--device", "cpu", "--keep-last", "1"),
           add_arguments=_add_checkpoint_arguments)
def checkpoint(args: argparse.Namespace, cfg: TrainConfig) -> dict[str, Any]:
    """Checkpoint cost per model size ([`checkpoint_round_trip`][reference_impl.bench.checkpoint_round_trip])
    and restart latency ([`recovery_run`][reference_impl.bench.recovery_run]).

    Args:
        args: `--rounds` and `--hidden-dims`.
        cfg: The single-process run whose state is saved, one size per `--hidden-dims` entry.
    """
    if cfg.world_size != 1:
        raise ConfigError("checkpoint runs in one process (it starts its own torchrun job); "
                          "run it with python -m, not torchrun")
    sizes = []
    for hidden_dim in args.hidden_dims:
        sizes.append(checkpoint_round_trip(replace(cfg, hidden_dim=hidden_dim), args.rounds))
        gc.collect()
    restored, resumed = zip(*(recovery_run() for _ in range(args.rounds)))
    rows: list[list[Any]] = []
    for s in sizes:
        size = [f"{s['params'] / 1e6:.1f}M", f"{s['state_bytes'] / 1e6:.0f}"]
        rows.append([*size, "save", s["save_ours_s"], s["save_raw_s"], s["save_raw_fsync_s"],
                     s["save_ratio"], s["save_ratio_fsync"]])
        rows.append([*size, "restore", s["restore_ours_s"], s["restore_raw_s"], "", s["restore_ratio"], ""])
    rows.append(["2 ranks", "", "SIGKILL->restored", _median(restored), "", "", "", ""])
    rows.append(["2 ranks", "", "SIGKILL->1st step", _median(resumed), "", "", "", ""])
    return report("checkpoint", ["params", "MB", "operation", "ours s", "raw s", "raw+fsync s",
                                 "ours/raw", "ours/(raw+fsync)"], rows, {
        "sizes": sizes,
        "max_save_ratio": max(s["save_ratio"] for s in sizes),
        "max_save_ratio_fsync": max(s["save_ratio_fsync"] for s in sizes),
        "max_restore_ratio": max(s["restore_ratio"] for s in sizes),
        "recovery_restored_s": round(_median(restored), 3), "recovery_s": round(_median(resumed), 3),
        "recovery_s_all": [round(t, 3) for t in resumed], "raw_save_fsync": False,
        "rounds": args.rounds, "model": cfg.model, "config_digest": cfg.digest(),
    })


# async (and the stall measurement the gpu benchmark shares)

def _add_rounds_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=3,
                        help="timed rounds of a sync and an async save, alternating which goes first")


def checkpoint_stall(state: TrainState, cfg: TrainConfig, ctx: DistContext, rounds: int) -> dict[str, list[float]]:
    """Seconds training waits for a sync FSDP save and for an async one, in interleaved rounds.

    Each save is `save_checkpoint` of the same state into a fresh directory, timed
    from the call to its return; the async one (`saver=AsyncSaver()`) returns once DCP
    has staged a copy, and is then waited for (its `total`: staged, written and
    published). Every value is the slowest rank's. One untimed save of each kind comes
    first (DCP's planning, the saver's gloo group).

    Args:
        state: An FSDP state; every rank calls this.
        cfg: Its config (`checkpoint_dir` is replaced by a scratch directory).
        ctx: This rank's context.
        rounds: Timed rounds.

    Returns:
        `sync`, `blocked` (async, until `save_checkpoint` returned) and `async_total`
        seconds, one value per round.
    """
    root, saver, log = _shared_tempdir(ctx), AsyncSaver(), EventLog(ctx.rank, io.StringIO())
    saves = itertools.count()

    def save(background: bool) -> tuple[float, float]:
        path = root / str(next(saves))
        _settle(ctx)
        t0 = time.perf_counter()
        save_checkpoint(state, replace(cfg, checkpoint_dir=str(path)), ctx, log,
                        saver=saver if background else None)
        returned = time.perf_counter() - t0
        saver.wait()
        done = time.perf_counter() - t0
        _remove(path, ctx)
        returned, done = _slowest(ctx, returned, done)
        return returned, done

    try:
        save(False)
        save(True)
        times = interleave(rounds, {"sync": partial(save, False), "async": partial(save, True)})
    finally:
        _remove(root, ctx)
    return {"sync": [t for t, _ in times["sync"]], "blocked": [t for t, _ in times["async"]],
            "async_total": [t for _, t in times["async"]]}


def _stall_summary(stall: dict[str, list[float]]) -> dict[str, float]:
    """Medians of a `checkpoint_stall` result and the blocked/sync ratio."""
    medians = {name: _median(t) for name, t in stall.items()}
    return {"sync_s": round(medians["sync"], 4), "blocked_s": round(medians["blocked"], 4),
            "async_total_s": round(medians["async_total"], 4),
            "blocked_ratio": round(medians["blocked"] / medians["sync"], 4)}


@benchmark("async", "how long an async FSDP checkpoint blocks training against a sync save "
                    "(torchrun, CPU/gloo by default)",
           train_defaults=("--model", "transformer", "--strategy", "fsdp", "--d-model", "512",
                           "--n-layers", "8", "--n-heads", "8", "--hidden-dim", "2048",
                           "--micro-batch-size", "4", "--dataset-size", "64", "--max-steps", "1",
                           "--warmup-steps", "0", "--device", "cpu"),
           add_arguments=_add_rounds_argument, nproc=2)
def async_checkpoint(args: argparse.Namespace, cfg: TrainConfig) -> dict[str, Any]:
    """Async versus sync `save_checkpoint` of one FSDP state (25.2M parameters by default).

    Runs on every rank under torchrun; rank 0 reports. See
    [`checkpoint_stall`][reference_impl.bench.checkpoint_stall] for what is timed.

    Args:
        args: `--rounds` (and `--nproc`, used by the launcher).
        cfg: The FSDP run whose state is saved, after `max_steps` steps of training.
    """
    if cfg.strategy != "fsdp":
        raise ConfigError("async checkpoints are FSDP-only (--strategy fsdp)")
    with distributed(cfg.device, cfg.pg_timeout_s) as ctx:
        state = trained_state(cfg, ctx)
        params = sum(p.numel() for p in state.model.parameters())  # DTensors: global sizes
        stall = checkpoint_stall(state, cfg, ctx, args.rounds)
        if not ctx.is_main:
            return {}
        summary = _stall_summary(stall)
        rows = [["sync save", summary["sync_s"], min(stall["sync"]), max(stall["sync"])],
                ["async, blocked", summary["blocked_s"], min(stall["blocked"]), max(stall["blocked"])],
                ["async, until published", summary["async_total_s"], min(stall["async_total"]),
                 max(stall["async_total"])],
                ["blocked/sync", summary["blocked_ratio"], "", ""]]
        return report("async", ["save", "median s", "min", "max"], rows, {
            **summary, "params": params, "world_size": ctx.world_size, "device": str(ctx.device),
            "rounds": args.rounds, "config_digest": cfg.digest(),
        })


# gpu

def _add_gpu_arguments(parser: argparse.ArgumentParser) -> None:
    _add_rounds_argument(parser)
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the GPU's dense bf16 peak in TFLOP/s, when the built-in table "
                             "does not know the device")


def peak_bf16_flops(device_name: str) -> float | None:
    """The dense bf16 peak FLOP/s of a GPU from `PEAK_BF16_FLOPS`, or None if unknown.

    Args:
        device_name: As `torch.cuda.get_device_name` spells it.
    """
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in device_name), None)


def measured_training(cfg: TrainConfig, ctx: DistContext, peak_flops: float | None,
                      ) -> tuple[TrainState, dict[str, Any]]:
    """Train `cfg` on this GPU with the real loop; measure it from its own `step` events.

    The first log window (CUDA context, kernel selection, allocator growth) is left
    out. Throughput is the harmonic mean of the later windows' samples/s weighted by
    their steps (total samples over total time); tokens/s is that times `seq_len`.
    MFU is `flops_per_sample(cfg)` x samples/s over (world size x `peak_flops`):
    6 x matmul parameters per token plus the attention term, training FLOPs that do
    not count activation recomputation. Phases are the `phase_s` of those windows per step.

    Args:
        cfg: The run; `max_steps` must cover at least two log windows.
        ctx: This rank's context (a CUDA device).
        peak_flops: Dense bf16 peak FLOP/s per GPU; None leaves MFU out.

    Returns:
        The trained state, and on rank 0 the measurements (empty on other ranks).
    """
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(ctx.device)
    stream = io.StringIO()
    state = train(cfg, ctx, EventLog(ctx.rank, stream))
    if not ctx.is_main:
        return state, {}
    steps = [e for e in parse_events(stream.getvalue()) if e["event"] == "step"]
    windows = steps[1:]
    weights = [b["step"] - a["step"] for a, b in zip(steps, windows)]
    samples_per_s = statistics.harmonic_mean([e["samples_per_s"] for e in windows], weights=weights)
    phase_ms = {name: round(1e3 * sum(e["phase_s"].get(name, 0.0) for e in windows) / sum(weights), 3)
                for name in PHASES}
    mfu = flops_per_sample(cfg) * samples_per_s / (ctx.world_size * peak_flops) if peak_flops else None
    return state, {
        "tokens_per_s": round(samples_per_s * cfg.seq_len, 1),
        "mfu": None if mfu is None else round(mfu, 4),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(ctx.device) / 2 ** 30, 3),
        "phase_ms_per_step": phase_ms, "first_loss": steps[0]["loss"], "last_loss": steps[-1]["loss"],
        "loss_fell": steps[-1]["loss"] < steps[0]["loss"],
    }


@benchmark("gpu", "DDP and FSDP2 in bf16 on CUDA: tokens/s, MFU, peak memory, phases, "
                  "async-versus-sync checkpoint stall (needs a GPU)",
           train_defaults=("--model", "transformer", "--precision", "bf16", "--device", "cuda",
                           "--d-model", "1024", "--n-layers", "12", "--n-heads", "16", "--hidden-dim", "4096",
                           "--seq-len", "1024", "--vocab-size", "32768", "--micro-batch-size", "8",
                           "--dataset-size", "4096", "--max-steps", "100", "--warmup-steps", "10",
                           "--lr", "1e-3", "--log-every", "10"),
           add_arguments=_add_gpu_arguments, nproc=1)
def gpu(args: argparse.Namespace, cfg: TrainConfig) -> dict[str, Any]:
    """Train the same transformer under DDP, then FSDP2, and time FSDP checkpoint stalls.

    Runs on every rank under torchrun (one process per GPU; NCCL); rank 0 reports.
    Each strategy is measured by [`measured_training`][reference_impl.bench.measured_training];
    the FSDP state is then saved sync and async by
    [`checkpoint_stall`][reference_impl.bench.checkpoint_stall] (async saves are FSDP-only).

    Args:
        args: `--rounds` of checkpoint stall, `--peak-tflops`, `--nproc`.
        cfg: The run; `--strategy` is set to each strategy in turn.

    Raises:
        BenchmarkError: The loss did not fall under some strategy (after the report).
    """
    if cfg.device != "cuda" or cfg.max_steps < 2 * cfg.log_every:
        raise ConfigError("gpu needs --device cuda and --max-steps of at least 2 x --log-every "
                          "(the first log window is warm-up)")
    with distributed(cfg.device, cfg.pg_timeout_s) as ctx:
        device_name = torch.cuda.get_device_name(ctx.device)
        peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_bf16_flops(device_name)
        ddp = measured_training(replace(cfg, strategy="ddp"), ctx, peak)[1]  # its state freed here
        fsdp_cfg = replace(cfg, strategy="fsdp")
        state, fsdp = measured_training(fsdp_cfg, ctx, peak)
        stall = _stall_summary(checkpoint_stall(state, fsdp_cfg, ctx, args.rounds))
        if not ctx.is_main:
            return {}
        runs = {"ddp": ddp, "fsdp": fsdp}
        print(f"checkpoint stall (FSDP, median of {args.rounds}): sync {stall['sync_s']:.3f}s, "
              f"async blocked {stall['blocked_s']:.3f}s ({100 * stall['blocked_ratio']:.0f}% of sync)")
        rows = [[name, round(r["tokens_per_s"]), "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%",
                 r["peak_memory_gib"], *(r["phase_ms_per_step"][p] for p in PHASES),
                 f"{r['first_loss']:.3f}->{r['last_loss']:.3f}"] for name, r in runs.items()]
        record = report("gpu", ["strategy", "tokens/s", "MFU", "peak GiB", *(f"{p} ms" for p in PHASES), "loss"],
                        rows, {
            "device_name": device_name, "peak_bf16_flops": peak, "world_size": ctx.world_size, **runs,
            "checkpoint_stall": stall, "flops_per_sample": flops_per_sample(cfg), "seq_len": cfg.seq_len,
            "global_batch_size": cfg.global_batch_size, "steps": cfg.max_steps, "config_digest": cfg.digest(),
        })
        if failed := [name for name, r in runs.items() if not r["loss_fell"]]:
            raise BenchmarkError(f"the loss did not fall under {', '.join(failed)}")
        return record


# pipeline

def _add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--microbatches", type=_int_list, default=(2, 4, 8, 16),
                        help="micro-batches per step: comma-separated, one measurement each")
    parser.add_argument("--rounds", type=int, default=2, help="timed steps per case (the fastest counts)")


@benchmark("pipeline", "pipeline bubble: each stage's measured idle share vs (P-1)/(M+P-1), GPipe and 1F1B",
           train_defaults=("--device", "cpu"), add_arguments=_add_pipeline_arguments, nproc=2)
def pipeline_bubble(args: argparse.Namespace, cfg: TrainConfig) -> dict[str, Any]:
    """The pipeline bubble measured on stages whose work takes a known time.

    Runs on every rank under torchrun (one stage each); rank 0 reports. See
    [`measure_bubble`][reference_impl.pipeline.measure_bubble].

    Args:
        args: `--microbatches`, `--rounds` (and `--nproc`: the number of stages).
        cfg: Only the process-group timeout is used.
    """
    if min(args.microbatches) < args.nproc:
        raise ConfigError(f"every --microbatches value must be at least the number of stages ({args.nproc})")
    with distributed("cpu", cfg.pg_timeout_s) as ctx:
        cases = [measure_bubble(kind, m, rounds=args.rounds) for kind in SCHEDULES for m in args.microbatches]
        if not ctx.is_main:
            return {}
        rows = [[c["schedule"], c["microbatches"], c["step_s"], c["busy_s"], c["measured_idle"], c["formula_idle"]]
                for c in cases]
        return report("pipeline", ["schedule", "M", "step s", "busy s", "idle measured", "idle formula"], rows, {
            "pp_degree": ctx.world_size, "cases": cases, "rounds": args.rounds,
            "max_abs_error": round(max(abs(c["measured_idle"] - c["formula_idle"]) for c in cases), 4)})


def build_parser() -> argparse.ArgumentParser:
    """The command line: one subcommand per registered benchmark."""
    parser = argparse.ArgumentParser(
        prog="python -m reference_impl.bench",
        description="Benchmarks. Options a benchmark does not define are TrainConfig flags.")
    sub = parser.add_subparsers(dest="name", required=True, metavar="NAME")
    for name, bench in BENCHMARKS.items():
        subparser = sub.add_parser(name, help=bench.help, description=bench.help)
        bench.add_arguments(subparser)
        if bench.nproc:
            subparser.add_argument("--nproc", type=int, default=bench.nproc,
                                   help="processes torchrun starts, one per device")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark named on the command line; 2 on a bad flag, 1 on a failed run.

    A benchmark registered with `nproc`, started outside torchrun, is relaunched under
    torchrun with the same arguments; its exit status is torchrun's.
    """
    argv = sys.argv[1:] if argv is None else argv
    args, train_flags = build_parser().parse_known_args(argv)
    bench = BENCHMARKS[args.name]
    launch = bench.nproc > 0 and "WORLD_SIZE" not in os.environ
    try:
        # Validate with the world size the ranks will have, so a bad flag fails here, once.
        environ = {"WORLD_SIZE": str(args.nproc)} if launch else None
        cfg = TrainConfig.from_cli([*bench.train_defaults, *train_flags], environ)
        preflight(cfg)  # e.g. --device cuda without a GPU
        if launch:
            env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            return subprocess.run(torchrun_command(args.nproc, "reference_impl.bench", argv), env=env).returncode
        bench.run(args, cfg)
    except ConfigError as exc:
        print(f"reference_impl.bench {args.name}: error: {exc}", file=sys.stderr)
        return 2
    except BenchmarkError as exc:
        print(f"reference_impl.bench {args.name}: failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Measured data for the handbook's plots: `python -m reference_impl.bench.measure [--out docs/data]`.

One function per dataset, registered with [`dataset`][reference_impl.bench.measure.dataset],
returns the plot's `data`; [`main`][reference_impl.bench.measure.main] wraps it with
[`metadata`][reference_impl.bench.measure.metadata] (device, torch version, date, commit and the
command that regenerates it) and writes `NAME.json` into the output folder. The site's
build hook `docs/hooks/plots.py` renders each file to an SVG. Everything runs on the CPU
with gloo, two ranks, and takes a few minutes on a 2-core machine.

    python -m reference_impl.bench.measure                     # every dataset into docs/data
    python -m reference_impl.bench.measure --only allreduce    # one dataset
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, TypedDict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from reference_impl import calc
from reference_impl.bench.common import BenchmarkError, launched
from reference_impl.launch import torchrun_command
from reference_impl.metrics import PHASES

ROOT = Path(__file__).resolve().parents[2]
COMMAND = "python -m reference_impl.bench.measure"
TIMEOUT_S = 240.0
DatasetFn = Callable[[], dict[str, Any]]
DATASETS: dict[str, DatasetFn] = {}


def dataset(name: str) -> Callable[[DatasetFn], DatasetFn]:
    """Register the decorated function as the dataset `name` (written to `name.json`)."""
    def register(fn: DatasetFn) -> DatasetFn:
        DATASETS[name] = fn
        return fn
    return register


def describe_device() -> str:
    """The CPU model and core count that ran the measurements (every run here is CPU/gloo)."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU: {model}, {os.cpu_count()} cores (gloo)"


def git_commit() -> str:
    """The short hash of the repository's HEAD, or `unknown` outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def metadata(name: str) -> dict[str, str]:
    """Where and when a dataset was made: `device`, `torch`, `date` (UTC), `commit`, `command`."""
    return {"device": describe_device(), "torch": torch.__version__,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "commit": git_commit(),
            "command": f"{COMMAND} --only {name}"}


def _events(module: str, args: Sequence[str], max_restarts: int = 0) -> list[dict[str, Any]]:
    """Rank 0's events of a 2-rank torchrun job running `python -m module args`.

    Raises:
        BenchmarkError: The job failed or timed out.
    """
    run = launched(torchrun_command(2, module, args, max_restarts), TIMEOUT_S)
    if run.returncode != 0:
        raise BenchmarkError(f"{module} {' '.join(args)} failed (exit {run.returncode}): "
                             f"{run.failure()}")
    return run.events


def _losses(events: Sequence[dict[str, Any]]) -> list[list[float]]:
    """[[step, loss], ...] of the `step` events."""
    return [[e["step"], e["loss"]] for e in events if e.get("event") == "step"]


SMALL_RUN = ("--max-steps", "30", "--warmup-steps", "0", "--micro-batch-size", "8", "--dataset-size", "512",
             "--device", "cpu", "--log-every", "1", "--checkpoint-every", "10")


@dataset("resume")
def resume() -> dict[str, Any]:
    """Loss of a run whose rank 1 is SIGKILLed before step 15 and restarted by torchrun,
    next to the same run uninterrupted (both checkpoint every 10 steps).

    Returns:
        `uninterrupted` and each attempt's `[step, loss]` pairs, the step of the kill,
        the step restored, and both runs' final `state_digest`.
    """
    fail_at = 15
    runs = {}
    for name, faults in (("uninterrupted", ()), ("resumed", ("--fail-at-step", str(fail_at), "--fail-rank", "1"))):
        with tempfile.TemporaryDirectory(prefix="measure-resume-") as root:
            runs[name] = _events("reference_impl.train", [*SMALL_RUN, "--checkpoint-dir", root, *faults],
                                 max_restarts=1)
    events = runs["resumed"]
    restart = next(i for i, e in enumerate(events) if e["event"] == "run_start" and e["restart_count"] == 1)
    restored = next(e for e in events[restart:] if e["event"] == "checkpoint_restored")
    digests = {name: next(e for e in ev if e["event"] == "run_complete")["state_digest"] for name, ev in runs.items()}
    return {"fail_at_step": fail_at, "checkpoint_every": 10, "restored_step": restored["step"],
            "uninterrupted": _losses(runs["uninterrupted"]),
            "attempts": [_losses(events[:restart]), _losses(events[restart:])],
            "state_digests": digests, "world_size": 2}


PHASE_CASES = {"DDP": ("--strategy", "ddp", "--micro-batch-size", "16"),
               "FSDP": ("--strategy", "fsdp", "--micro-batch-size", "16"),
               "DDP, accumulation x4": ("--strategy", "ddp", "--micro-batch-size", "4", "--grad-accum-steps", "4")}


@dataset("phases")
def phases() -> dict[str, Any]:
    """Milliseconds per optimizer step in each phase for DDP, FSDP and DDP with 4
    accumulation micro-steps, all with the same global batch (32 sequences on 2 ranks).

    The phases are the `phase_s` of the `step` events after the first log window
    (start-up), divided by the steps they cover.
    """
    base = ["--model", "transformer", "--d-model", "128", "--n-layers", "4", "--n-heads", "4",
            "--max-steps", "20", "--log-every", "5", "--warmup-steps", "0", "--device", "cpu"]
    cases = {}
    for name, flags in PHASE_CASES.items():
        steps = [e for e in _events("reference_impl.train", [*base, *flags]) if e["event"] == "step"]
        covered = steps[-1]["step"] - steps[0]["step"]
        cases[name] = {p: round(1e3 * sum(e["phase_s"].get(p, 0.0) for e in steps[1:]) / covered, 3) for p in PHASES}
    return {"phases": list(PHASES), "cases": cases, "global_batch_size": 32, "world_size": 2}


def _bench(name: str, args: Sequence[str]) -> dict[str, Any]:
    """The JSON line of `python -m reference_impl.bench name args`."""
    run = launched([sys.executable, "-m", "reference_impl.bench", name, *args], TIMEOUT_S)
    record = next((e for e in run.events if e.get("benchmark") == name), None)
    if run.returncode != 0 or record is None:
        raise BenchmarkError(f"bench {name} failed (exit {run.returncode}): {run.failure()}")
    return record


@dataset("async_checkpoint")
def async_checkpoint() -> dict[str, Any]:
    """Median seconds training is blocked by a sync FSDP save and by an async one, and
    when the async one is published (`bench async`, 2-layer transformer, 2 ranks)."""
    record = _bench("async", ["--rounds", "3", "--n-layers", "2"])
    return {key: record[key] for key in ("sync_s", "blocked_s", "async_total_s", "params", "world_size", "rounds")}


# Dense decoder shapes: name, parameters, hidden, layers, heads. GPT-3's (Brown et al., 2020,
# table 2.1) to 6.7B, then 13B at 5120 x 40, OPT-30B's and Llama-2-70B's.
DENSE_SHAPES = (("125M", 125e6, 768, 12, 12), ("350M", 350e6, 1024, 24, 16), ("1.3B", 1.3e9, 2048, 24, 16),
        ("2.7B", 2.7e9, 2560, 32, 32), ("6.7B", 6.7e9, 4096, 32, 32), ("13B", 13e9, 5120, 40, 40),
        ("30B", 30e9, 7168, 48, 56), ("70B", 70e9, 8192, 80, 64))
ZERO_STAGES = ("ddp", "zero1", "zero2", "zero3")


class _MemoryInputs(TypedDict):
    """The `calc.memory` inputs every point of the memory plot shares."""

    world_size: int
    seq_len: int
    micro_batch: int
    activation_checkpointing: bool


MEMORY_INPUTS: _MemoryInputs = {"world_size": 8, "seq_len": 2048, "micro_batch": 1, "activation_checkpointing": True}


@dataset("memory")
def memory() -> dict[str, Any]:
    """Bytes per GPU by ZeRO stage for dense models of 125M to 70B on 8 GPUs, computed by
    [`calc.memory`][reference_impl.calc.memory] (mixed-precision Adam, 16 bytes per
    parameter, activation checkpointing); nothing is measured."""
    models = [{"name": n, "params": p, "hidden": h, "n_layers": layers, "n_heads": a}
              for n, p, h, layers, a in DENSE_SHAPES]
    curves = {s: [calc.memory(params=p, hidden=h, n_layers=layers, n_heads=a, strategy=s, **MEMORY_INPUTS)
                  for _, p, h, layers, a in DENSE_SHAPES] for s in ZERO_STAGES}
    return {"inputs": MEMORY_INPUTS, "models": models, "curves": curves}


ALLREDUCE_SIZES = tuple(2 ** k for k in range(10, 27, 2))  # 1 KiB to 64 MiB
ALLREDUCE_REPEATS = 5


def _allreduce_worker(rank: int, port: int, out: str) -> None:
    """One rank of the all-reduce timing: float32 all-reduces of every size after a barrier.

    A message under 4 MiB is timed over enough back-to-back calls to move 4 MiB (at most
    32), and the time divided: one call of a few hundred microseconds is smaller than the
    scheduling noise of a shared machine.
    """
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        times = {}
        for size in ALLREDUCE_SIZES:
            tensor, calls = torch.ones(size // 4), min(32, max(1, 2 ** 22 // size))
            dist.all_reduce(tensor)  # warm-up: the pair's buffers for this size
            runs = []
            for _ in range(ALLREDUCE_REPEATS):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    dist.all_reduce(tensor)
                runs.append((time.perf_counter() - t0) / calls)
            times[size] = runs
        if rank == 0:
            Path(out).write_text(json.dumps(times))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataset("allreduce")
def allreduce() -> dict[str, Any]:
    """All-reduce time against message size on 2 gloo ranks (median of 5 after a warm-up),
    next to [`calc.ring_allreduce`][reference_impl.calc.ring_allreduce].

    The formula's two constants, the bandwidth and the latency per ring step, are fitted
    to the medians by least squares on the relative error, so small messages (latency)
    weigh as much as large ones (bandwidth).

    Raises:
        BenchmarkError: The workers failed or hung, or the fit gave a non-positive constant.
    """
    with tempfile.TemporaryDirectory(prefix="measure-allreduce-") as root:
        out = str(Path(root) / "times.json")
        context = mp.start_processes(_allreduce_worker, args=(_free_port(), out), nprocs=2, join=False,
                                     start_method="spawn")
        deadline = time.monotonic() + TIMEOUT_S
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    for process in context.processes:
                        process.kill()
                    raise BenchmarkError(f"the all-reduce timing did not finish within {TIMEOUT_S:.0f}s")
        except ProcessException as exc:
            raise BenchmarkError(f"an all-reduce worker failed: {exc}") from None
        runs = {int(size): t for size, t in json.loads(Path(out).read_text()).items()}
    sizes = sorted(runs)
    median = [statistics.median(runs[s]) for s in sizes]
    ring = [calc.ring_allreduce(size_bytes=s, world_size=2, bandwidth_bytes_per_s=1.0) for s in sizes]
    # time = bytes_per_rank / bandwidth + steps x latency; each row divided by its median
    rows = torch.tensor([[r["bytes_per_rank"] / t, r["steps"] / t] for r, t in zip(ring, median, strict=True)],
                        dtype=torch.float64)
    inverse_bandwidth, latency = torch.linalg.lstsq(rows, torch.ones(len(sizes), 1, dtype=torch.float64)
                                                    ).solution.flatten().tolist()
    if inverse_bandwidth <= 0 or latency <= 0:
        raise BenchmarkError(f"the all-reduce fit failed (1/bandwidth {inverse_bandwidth}, latency {latency})")
    bandwidth = 1 / inverse_bandwidth
    return {"world_size": 2, "repeats": ALLREDUCE_REPEATS, "dtype": "float32", "sizes_bytes": sizes,
            "measured_s": [runs[s] for s in sizes], "median_s": median, "latency_s": latency,
            "bandwidth_bytes_per_s": bandwidth,
            "formula_s": [calc.ring_allreduce(size_bytes=s, world_size=2, bandwidth_bytes_per_s=bandwidth,
                                              latency_s=latency)["time_s"] for s in sizes]}


@dataset("pipeline")
def pipeline() -> dict[str, Any]:
    """Measured idle share of a 2-stage pipeline step against (P-1)/(M+P-1), GPipe and
    1F1B, for 2 to 16 micro-batches (`bench pipeline`: stages that sleep known times)."""
    record = _bench("pipeline", ["--microbatches", "2,4,8,16", "--rounds", "2"])
    return {"pp_degree": record["pp_degree"], "rounds": record["rounds"], "cases": record["cases"]}


def build_parser() -> argparse.ArgumentParser:
    """The command line: `--out` and `--only`."""
    parser = argparse.ArgumentParser(prog=COMMAND, description="Measure the handbook's plot data.")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "data", help="folder for NAME.json")
    parser.add_argument("--only", choices=sorted(DATASETS), action="append",
                        help="measure only this dataset (repeatable)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Measure the chosen datasets, write each to `OUT/NAME.json`; 2 if OUT is not a writable
    folder, 1 if a run failed."""
    args = build_parser().parse_args(argv)
    try:  # before the first measurement, which can take minutes
        args.out.mkdir(parents=True, exist_ok=True)
        probe = args.out / f".probe-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        print(f"{COMMAND}: error: --out {args.out} is not a writable folder: {exc.strerror}", file=sys.stderr)
        return 2
    for name in args.only or DATASETS:
        t0 = time.perf_counter()
        try:
            record = {**metadata(name), "data": DATASETS[name]()}
        except BenchmarkError as exc:
            print(f"{COMMAND}: {name} failed: {exc}", file=sys.stderr)
            return 1
        path = args.out / f"{name}.json"
        path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {path} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`bench goodput`: the trainer under a random fault process, its goodput against `calc.goodput`'s.

A torchrun job of the trainer (gloo, CPU, checkpointing every K steps, restarted by torchrun)
is watched through rank 0's events while a killer in this process SIGKILLs a random rank at
exponentially distributed moments of the time the job computes or saves, the process
`calc.goodput` models. Some restarts are also hit inside their restore. The events then cut
the wall time into training kept, saving, work lost and restarting; the model, fed the
measured save cost, restart cost, interval and failure rate, predicts the same split. The
final `state_digest` must equal an uninterrupted run's: nothing was lost or trained twice.
"""

from __future__ import annotations

import argparse
import math
import os
import queue
import random
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reference_impl import calc
from reference_impl.bench.common import BenchmarkError, benchmark, launched, positive_int, report
from reference_impl.config import ConfigError, TrainConfig
from reference_impl.launch import kill_tree, parse_events, torchrun_command

STALL_S = 180.0  # no event from the job for this long: it is stuck, and the run fails
EXIT_GRACE_S = 60.0  # torchrun closed its output: the longest it may take to exit


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--failures", type=positive_int, default=10,
                        help="failures the fault process is expected to cause while the job computes or saves "
                             "(the count is random, as in a real cluster)")
    parser.add_argument("--mtbf-s", type=float, default=5.0,
                        help="the job's mean time between failures in seconds of computing or saving")
    parser.add_argument("--restore-kills", type=float, default=0.2,
                        help="share of restarts that are killed again inside their restore")
    parser.add_argument("--checkpoint-every", type=positive_int, default=10, help="steps between saves")
    parser.add_argument("--nproc", type=positive_int, default=2, help="ranks of the job")
    parser.add_argument("--fault-seed", type=int, default=0, help="seed of the fault process")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="the longest the faulty run may take")


def _check(args: argparse.Namespace, cfg: TrainConfig) -> None:
    if cfg.world_size != 1:
        raise ConfigError("goodput runs in one process (it starts its own torchrun jobs); run it with python -m")
    if not (math.isfinite(args.mtbf_s) and args.mtbf_s > 0):
        raise ConfigError(f"--mtbf-s must be a positive number of seconds, got {args.mtbf_s}")
    if not 0 <= args.restore_kills <= 1:
        raise ConfigError(f"--restore-kills must be between 0 and 1, got {args.restore_kills}")


@dataclass
class Kill:
    """One SIGKILL: when, which attempt, which rank, and what the job was doing."""

    time: float
    attempt: int
    rank: int
    aimed: str  # "up" (the Poisson process) or "restore"
    during: str = ""  # filled by `account`: "compute", "save" or "restore"


@dataclass
class Attempt:
    """One start of the workers, seen through rank 0's events."""

    number: int
    started: float  # run_start
    up: float | None = None  # training began: the restore's end (or run_start without a checkpoint)
    restored_step: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)


def worker_pids(launcher: int) -> dict[int, int]:
    """Rank to pid of the launcher's live worker processes, newest attempt first."""
    found: dict[int, tuple[int, int]] = {}
    for task in Path(f"/proc/{launcher}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for pid in map(int, children):
            try:
                raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
                env = dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)
            except OSError:
                continue
            if "RANK" in env and env["RANK"].isdigit():
                attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
                rank = int(env["RANK"])
                if rank not in found or found[rank][0] < attempt:
                    found[rank] = (attempt, pid)
    return {rank: pid for rank, (_, pid) in found.items()}


class FaultyRun:
    """Run the trainer under torchrun and kill random ranks at random moments; bounded in time.

    The first draw from `rng` is the first arrival: seconds after attempt 0's `run_start`.
    """

    def __init__(self, cmd: Sequence[str], mtbf_s: float, restore_kills: float, rng: random.Random,
                 timeout_s: float, max_steps: int) -> None:
        self.cmd, self.mtbf_s, self.restore_kills, self.rng = list(cmd), mtbf_s, restore_kills, rng
        self.max_steps = max_steps
        self.timeout_s = timeout_s
        self.kills: list[Kill] = []
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stdout: list[str] = []

    def _read(self, stream: Any) -> None:
        for line in stream:
            self.lines.put(line)
        self.lines.put(None)

    def _kill(self, proc: subprocess.Popen, attempt: int, aimed: str) -> bool:
        """SIGKILL a random rank of the attempt; False if none was found alive."""
        pids = worker_pids(proc.pid)
        if not pids:
            return False
        rank = self.rng.choice(sorted(pids))
        try:
            os.kill(pids[rank], signal.SIGKILL)
        except ProcessLookupError:
            return False
        self.kills.append(Kill(time.time(), attempt, rank, aimed))
        return True

    def run(self) -> tuple[int, str, str, float]:
        """Returns (exit status, stdout, stderr, wall seconds)."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        started = time.perf_counter()
        proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
        err: list[str] = []
        threading.Thread(target=self._read, args=(proc.stdout,), daemon=True).start()
        threading.Thread(target=lambda: err.extend(proc.stderr or []), daemon=True).start()
        attempt, deadline, saved_any, last_event = -1, None, False, time.monotonic()
        finished = False
        try:
            while True:
                if time.perf_counter() - started > self.timeout_s:
                    raise BenchmarkError(f"the faulty run outlived --timeout-s {self.timeout_s:g} "
                                         f"after {len(self.kills)} kills")
                if time.monotonic() - last_event > STALL_S:
                    raise BenchmarkError(f"the faulty run printed no event for {STALL_S:g} s "
                                         f"after {len(self.kills)} kills")
                wait = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.time()))
                try:
                    line = self.lines.get(timeout=wait)
                except queue.Empty:
                    line = ""
                if line is None:
                    break
                if line:
                    self.stdout.append(line)
                    last_event = time.monotonic()
                    event = parse_events(line)
                    if event and event[0].get("event") == "step" and event[0].get("step", 0) >= self.max_steps:
                        finished, deadline = True, None  # training is over: a kill now would strike nothing
                    elif event and not finished:
                        name = event[0].get("event")
                        if name == "run_start":
                            attempt, deadline = int(event[0].get("restart_count", 0)), None
                            if attempt and saved_any and self.rng.random() < self.restore_kills:
                                self._kill(proc, attempt, "restore")
                                continue
                            if not saved_any:  # nothing to restore: training starts now
                                deadline = event[0]["time"] + self.rng.expovariate(1 / self.mtbf_s)
                        elif name == "checkpoint_restored" and deadline is None and attempt >= 0 \
                                and not self._killed(attempt):
                            deadline = event[0]["time"] + self.rng.expovariate(1 / self.mtbf_s)
                        elif name == "checkpoint_saved":
                            saved_any = True
                        elif name == "step" and deadline is None and attempt >= 0 and not self._killed(attempt):
                            deadline = event[0]["time"] + self.rng.expovariate(1 / self.mtbf_s)
                if deadline is not None and time.time() >= deadline and self._kill(proc, attempt, "up"):
                    deadline = None  # else no rank was found alive: try again at once
            try:
                proc.wait(timeout=EXIT_GRACE_S)
            except subprocess.TimeoutExpired:
                raise BenchmarkError(f"the faulty run closed its output but did not exit within {EXIT_GRACE_S:g} s "
                                     f"after {len(self.kills)} kills") from None
        except BaseException:
            kill_tree(proc)
            raise
        return proc.returncode, "".join(self.stdout), "".join(err), time.perf_counter() - started

    def _killed(self, attempt: int) -> bool:
        return any(k.attempt == attempt for k in self.kills)


@dataclass
class Account:
    """Wall time from the first moment of training to the last step, cut four ways."""

    kept_s: float = 0.0
    save_s: float = 0.0
    lost_s: float = 0.0
    restart_s: float = 0.0
    up_s: float = 0.0
    step_times: list[float] = field(default_factory=list)
    save_times: list[float] = field(default_factory=list)
    up_failures: int = 0
    kills: list[Kill] = field(default_factory=list)

    @property
    def wall_s(self) -> float:
        return self.kept_s + self.save_s + self.lost_s + self.restart_s


def attempts_of(events: Sequence[dict[str, Any]]) -> list[Attempt]:
    """Rank 0's events grouped by attempt (each begins with `run_start`)."""
    attempts: list[Attempt] = []
    for e in events:
        if e.get("rank", 0) != 0:
            continue
        if e.get("event") == "run_start":
            attempts.append(Attempt(int(e.get("restart_count", 0)), e["time"]))
        elif attempts:
            attempts[-1].events.append(e)
    return attempts


def account(events: Sequence[dict[str, Any]], kills: Sequence[Kill], every: int) -> Account:
    """Cut the faulty run's wall time into kept training, saves, lost work and restarts.

    Attempt a trains from the moment its restore ends (or its `run_start`, with nothing to
    restore). The steps it keeps are those up to the step the next attempt restores, and the
    saves it keeps are the completed ones among them; everything else it did before its kill
    is lost, and from the kill to the next attempt's first moment of training is restart. A
    step's time runs from the previous step's event (or the end of the save after it, or the
    start of training) to its own event; a save's from its step's event to `checkpoint_saved`.
    Each kill is filed under what rank 0 was doing: restoring, saving (after the event of a
    step that saves and before its `checkpoint_saved`) or computing.

    Args:
        events: Rank 0's events of the faulty run, in order.
        kills: The kills, one per attempt at most.
        every: Steps between saves.

    Raises:
        BenchmarkError: The events and kills do not fit together.
    """
    attempts = attempts_of(events)
    # A kill that landed on a rank already done (the job completed in that attempt) is no failure.
    completed = {a.number for a in attempts if any(e["event"] == "run_complete" for e in a.events)}
    kills = [k for k in kills if k.attempt not in completed]
    by_attempt = {k.attempt: k for k in kills}
    result = Account(kills=list(kills))
    for a in attempts:
        kill = by_attempt.get(a.number)
        before_kill = [e for e in a.events if kill is None or e["time"] <= kill.time]
        restored = next((e for e in before_kill if e["event"] == "checkpoint_restored"), None)
        a.restored_step = restored["step"] if restored else 0
        if restored is not None:
            a.up = restored["time"]
        elif not any(e["event"] == "checkpoint_saved" and e["time"] < a.started for e in events):
            a.up = a.started  # nothing to restore: training starts at once
        if kill is not None:
            kill.during = "restore" if a.up is None or kill.time < a.up else "compute"
    up_attempts = [a for a in attempts if a.up is not None]
    if not up_attempts:
        raise BenchmarkError("the faulty run never trained")
    for i, a in enumerate(up_attempts):
        assert a.up is not None
        kill = by_attempt.get(a.number)
        later = up_attempts[i + 1] if i + 1 < len(up_attempts) else None
        keep_to = later.restored_step if later is not None else math.inf
        boundary = stop = a.up
        saving: int | None = None  # the step whose save is under way
        kept = saves = 0.0
        for e in a.events:
            if kill is not None and e["time"] > kill.time:
                break
            if e["event"] == "step":
                dt = e["time"] - boundary
                result.step_times.append(dt)
                kept += dt if e["step"] <= keep_to else 0.0
                boundary = stop = e["time"]
                saving = e["step"] if e["step"] % every == 0 else None
            elif e["event"] == "checkpoint_saved" and e["step"] == saving:
                dt = e["time"] - boundary
                result.save_times.append(dt)
                saves += dt if e["step"] <= keep_to else 0.0
                boundary = stop = e["time"]
                saving = None
        if kill is not None:
            stop = kill.time
            if kill.during == "compute" and saving is not None:
                kill.during = "save"
        result.kept_s += kept
        result.save_s += saves
        result.lost_s += (stop - a.up) - kept - saves
        result.up_s += stop - a.up
        if kill is not None:
            result.up_failures += 1
            if later is None or later.up is None:
                raise BenchmarkError(f"attempt {a.number} was killed but no later attempt trained")
            result.restart_s += later.up - kill.time
    return result


def _digest(stdout: str) -> str | None:
    done = [e for e in parse_events(stdout) if e.get("event") == "run_complete"]
    return done[-1]["state_digest"] if done else None


def _flags(cfg: TrainConfig, root: Path, max_steps: int, every: int) -> list[str]:
    return ["--model", cfg.model, "--hidden-dim", str(cfg.hidden_dim), "--max-steps", str(max_steps),
            "--warmup-steps", "0", "--micro-batch-size", str(cfg.micro_batch_size),
            "--dataset-size", str(cfg.dataset_size), "--device", "cpu", "--checkpoint-dir", str(root),
            "--checkpoint-every", str(every), "--keep-last", str(cfg.keep_last),
            "--log-every", "1", "--seed", str(cfg.seed), "--deterministic", "--pg-timeout-s", "60"]


def segment_time(events: Sequence[dict[str, Any]], every: int) -> float:
    """Mean seconds of one interval of `every` steps plus its save, from an uninterrupted run."""
    account_ = account(events, [], every)
    if not account_.step_times or not account_.save_times:
        raise BenchmarkError("the calibration run logged no step or no save")
    return every * sum(account_.step_times) / len(account_.step_times) + \
        sum(account_.save_times) / len(account_.save_times)


@benchmark("goodput", "the trainer under random SIGKILLs (some inside saves and restores): measured goodput "
                      "against calc.goodput's prediction, and the final state against an uninterrupted run's",
           train_defaults=("--model", "mlp", "--micro-batch-size", "8", "--dataset-size", "512",
                           "--keep-last", "2", "--device", "cpu"),
           add_arguments=_add_arguments, check=_check)
def goodput(args: argparse.Namespace, cfg: TrainConfig) -> dict[str, Any]:
    """Calibrate, run uninterrupted, run under faults; compare goodput and the final digest.

    The number of steps is chosen so that `--failures` failures are expected: a calibration
    run measures an interval and its save (`T`), each interval then sees `e^(T/M) - 1`
    failures on average (`M` = `--mtbf-s`), and the run gets enough intervals for the target.
    """
    rng = random.Random(args.fault_seed)
    root = Path(tempfile.mkdtemp(prefix="bench-goodput-"))
    every = args.checkpoint_every
    try:
        calib = launched(torchrun_command(args.nproc, "reference_impl.train",
                                          _flags(cfg, root / "calibrate", 5 * every, every)), 600)
        if calib.returncode != 0:
            raise BenchmarkError(f"the calibration run failed: {calib.failure()}")
        segment = segment_time(calib.events, every)
        per_interval = math.expm1(segment / args.mtbf_s)
        max_steps = every * max(2, math.ceil(args.failures / per_interval))
        flags = _flags(cfg, root / "reference", max_steps, every)
        reference = launched(torchrun_command(args.nproc, "reference_impl.train", flags), args.timeout_s)
        expected = _digest(reference.stdout)
        if reference.returncode != 0 or expected is None:
            raise BenchmarkError(f"the uninterrupted run failed: {reference.failure()}")
        faulty = FaultyRun(torchrun_command(args.nproc, "reference_impl.train",
                                            _flags(cfg, root / "faulty", max_steps, every),
                                            max_restarts=10 * args.failures + 20),
                           args.mtbf_s, args.restore_kills, rng, args.timeout_s, max_steps)
        status, stdout, stderr, wall = faulty.run()
        got = _digest(stdout)
        if status != 0 or got is None:
            line = [ln for ln in stderr.splitlines() if ln.strip()][-1:] or ["(nothing on stderr)"]
            raise BenchmarkError(f"the faulty run failed (exit {status}) after {len(faulty.kills)} kills: "
                                 f"{line[0][:300]}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    acc = account(parse_events(stdout), faulty.kills, every)
    step_s = sum(acc.step_times) / len(acc.step_times)
    save_s = sum(acc.save_times) / len(acc.save_times)
    restart_s = acc.restart_s / max(acc.up_failures, 1)
    rate = acc.up_failures / acc.up_s  # failures per second of computing or saving
    predicted = calc.goodput(n_gpus=args.nproc, mtbf_gpu_hours=args.nproc / rate / 3600 if rate else 1e9,
                             save_s=save_s, restart_s=restart_s, interval_s=every * step_s)
    during = {kind: sum(k.during == kind for k in acc.kills) for kind in ("compute", "save", "restore")}
    measured = {"goodput": acc.kept_s / acc.wall_s, "save_fraction": acc.save_s / acc.wall_s,
                "lost_fraction": acc.lost_s / acc.wall_s, "restart_fraction": acc.restart_s / acc.wall_s}
    rows = [[key, measured[key], predicted[key]] for key in measured]
    return report("goodput", ["share of wall time", "measured", "predicted"], rows, {
        "failures": len(acc.kills), "failures_computing": during["compute"], "failures_saving": during["save"],
        "failures_restoring": during["restore"], "measured_goodput": round(measured["goodput"], 4),
        "predicted_goodput": round(predicted["goodput"], 4),
        "goodput_ratio": round(measured["goodput"] / predicted["goodput"], 4),
        **{f"measured_{k}": round(v, 4) for k, v in measured.items() if k != "goodput"},
        **{f"predicted_{k}": round(predicted[k], 4) for k in measured if k != "goodput"},
        "step_s": round(step_s, 5), "save_s": round(save_s, 4), "restart_s": round(restart_s, 3),
        "interval_s": round(every * step_s, 4), "job_mtbf_s": round(1 / rate, 3) if rate else None,
        "target_mtbf_s": args.mtbf_s, "checkpoint_every": every, "max_steps": max_steps, "nproc": args.nproc,
        "wall_s": round(wall, 1), "accounted_s": round(acc.wall_s, 1),
        "state_digest": got, "reference_digest": expected, "digest_equal": got == expected,
        "fault_seed": args.fault_seed, "config_digest": cfg.digest(),
    })

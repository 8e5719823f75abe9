"""`bench ft`: what a SIGKILL costs when survivors keep training, against the full restart.

Both jobs are the same small MLP on two ranks' worth of data (micro-batch 8, 512 samples), and
both lose rank 1 at step 15. The full restart is the trainer under torchrun, restarting every
rank from its checkpoint of step 10 ([`recovery_run`][reference_impl.bench.checkpoint.recovery_run]);
the replica job is `python -m reference_impl.ft` with two replicas of one rank, whose steps
last at least `--step-floor-s` so that the job outlasts the restart of the failed replica.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from reference_impl.bench.checkpoint import RECOVERY_TIMEOUT_S, recovery_run
from reference_impl.bench.common import BenchmarkError, benchmark, launched, median, positive_int, report
from reference_impl.config import ConfigError, TrainConfig

JOB = ["--model", "mlp", "--micro-batch-size", "8", "--dataset-size", "512", "--warmup-steps", "0",
       "--fail-at-step", "15", "--fail-rank", "1"]


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=positive_int, default=1, help="runs of each job (medians reported)")
    parser.add_argument("--steps", type=positive_int, default=200, help="steps of the replica job")
    parser.add_argument("--step-floor-s", type=float, default=0.1, help="the replica job's shortest step")


def replica_run(steps: int, step_floor_s: float) -> dict[str, Any]:
    """The replica job's `ft_complete` fields.

    Raises:
        BenchmarkError: The job failed, timed out, or the failed replica never rejoined.
    """
    cmd = [sys.executable, "-m", "reference_impl.ft", "--replicas", "2", "--nproc-per-replica", "1", *JOB,
           "--max-steps", str(steps), "--step-floor-s", str(step_floor_s)]
    run = launched(cmd, RECOVERY_TIMEOUT_S)
    done = run.of("ft_complete")
    if run.returncode != 0 or not done or done[-1]["recoveries"] != 1:
        raise BenchmarkError(f"the replica job failed (exit {run.returncode}): {run.failure()}")
    return done[-1]


def _check(args: argparse.Namespace, cfg: TrainConfig) -> None:
    if cfg.world_size != 1:
        raise ConfigError("ft starts its own jobs: run it with python -m, not torchrun")
    if not 0 <= args.step_floor_s <= 60:
        raise ConfigError("--step-floor-s must be in [0, 60]")


@benchmark("ft", "SIGKILL of one rank: survivors keep training (replicas) against a checkpoint restart",
           add_arguments=_add_arguments, check=_check)
def ft(args: argparse.Namespace, cfg: TrainConfig) -> dict[str, Any]:
    """Seconds from the kill until training goes on, and until every rank trains again."""
    replicas, restarts = [], []
    for _ in range(args.rounds):  # alternated, so drifting load reaches both alike
        replicas.append(replica_run(args.steps, args.step_floor_s))
        restarts.append(recovery_run())
    survivor = median([r["kill_to_survivor_step_s"] for r in replicas])
    rejoin = median([r["kill_to_contributing_s"] for r in replicas])
    restored, resumed = (median(list(t)) for t in zip(*restarts, strict=True))
    rows = [["replicas", "survivors' next step", survivor],
            ["replicas", "failed replica contributes again", rejoin],
            ["full restart", "checkpoint restored", restored],
            ["full restart", "first resumed step (every rank)", resumed]]
    return report("ft", ["job", "seconds from the SIGKILL to", "s"], rows, {
        "survivor_step_s": survivor, "rejoin_s": rejoin, "full_restart_restored_s": round(restored, 3),
        "full_restart_resumed_s": round(resumed, 3),
        "stall_ratio": round(resumed / survivor, 3),  # how much longer a full restart stops all training
        "outage_steps": [r["outage_steps"] for r in replicas],
        "samples_not_trained": [r["samples_not_trained"] for r in replicas],
        "survivor_step_s_all": [r["kill_to_survivor_step_s"] for r in replicas],
        "rejoin_s_all": [r["kill_to_contributing_s"] for r in replicas],
        "full_restart_resumed_s_all": [round(t[1], 3) for t in restarts],
    })

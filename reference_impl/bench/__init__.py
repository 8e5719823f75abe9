"""Benchmarks: `python -m reference_impl.bench NAME [options] [train flags]`.

Each benchmark is one module of this package whose function is registered with
[`benchmark`][reference_impl.bench.common.benchmark]. Flags the benchmark does not
define are `TrainConfig` flags (`--model`, `--hidden-dim`, ...), applied on top of the
benchmark's own defaults. Every benchmark ends with
[`report`][reference_impl.bench.common.report]: a readable table, then one JSON line that
scripts read (`{"benchmark": NAME, ...}`).

    python -m reference_impl.bench overhead --rounds 5 --model mlp --hidden-dim 512
    python -m reference_impl.bench checkpoint --hidden-dims 4096,10000
    python -m reference_impl.bench async --rounds 3
    python -m reference_impl.bench pipeline --microbatches 2,4,8
    python -m reference_impl.bench gpu --nproc 1
    python -m reference_impl.bench peers       # needs pip install -e ".[peers]"
    python -m reference_impl.bench compile
    python -m reference_impl.bench fp8 --compile   # on a GPU with FP8 tensor cores
    python -m reference_impl.bench goodput --failures 20
    python -m reference_impl.bench ft          # a SIGKILL: replicas keep training vs a full restart

A benchmark registered with `nproc` (`async`, `pipeline`, `gpu`) runs once per rank under
torchrun. Started with plain `python -m`, it relaunches itself as
`torchrun --standalone --nproc-per-node NPROC -m reference_impl.bench NAME ...` and
exits with torchrun's status; started by torchrun directly it simply runs. Rank 0
prints the report. A new benchmark is one new module here plus its import below.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

# Importing a benchmark module registers it.
from reference_impl.bench import (  # noqa: F401,E501
    async_save,
    checkpoint,
    compile_speed,
    fp8_speed,
    ft,
    goodput,
    gpu,
    overhead,
    peers,
    pipeline,
)
from reference_impl.bench.checkpoint import recovery_times
from reference_impl.bench.common import BENCHMARKS, Benchmark, BenchmarkError, benchmark, positive_int, report
from reference_impl.config import ConfigError, TrainConfig
from reference_impl.launch import kill_tree, torchrun_command
from reference_impl.train import preflight

# A relaunched torchrun job's deadline unless --launch-timeout-s says otherwise: above the
# longest published run here (the 255-failure goodput run, 77 minutes), so it only ends a
# job that hangs.
LAUNCH_TIMEOUT_S = 4 * 3600
LAUNCHER_FLAGS = ("--nproc", "--launch-timeout-s")  # read by the launcher, not passed to the ranks

__all__ = ["BENCHMARKS", "Benchmark", "BenchmarkError", "benchmark", "build_parser", "main", "recovery_times",
           "report"]


def build_parser() -> argparse.ArgumentParser:
    """The command line: one subcommand per registered benchmark."""
    parser = argparse.ArgumentParser(
        prog="python -m reference_impl.bench",
        description="Benchmarks. Options a benchmark does not define are TrainConfig flags.")
    sub = parser.add_subparsers(dest="name", required=True, metavar="NAME")
    for name, bench in BENCHMARKS.items():
        # No abbreviations: `--nproc` is dropped by its exact spelling before the relaunch.
        subparser = sub.add_parser(name, help=bench.help, description=bench.help, allow_abbrev=False)
        bench.add_arguments(subparser)
        if bench.nproc:
            subparser.add_argument("--nproc", type=positive_int, default=bench.nproc,
                                   help="processes torchrun starts, one per device")
            subparser.add_argument("--launch-timeout-s", type=positive_int, default=LAUNCH_TIMEOUT_S,
                                   help="seconds the relaunched torchrun job may take before it is killed")
    return parser


def _without_launcher_flags(argv: list[str]) -> list[str]:
    """`argv` less `--nproc N` and `--launch-timeout-s S` (or `--flag=value`), which only the
    launcher reads.

    torchrun's own parser scans the arguments meant for the module too, and (Python 3.12)
    rejects `--nproc` there as an ambiguous abbreviation of its `--nproc-per-node`.
    """
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in LAUNCHER_FLAGS:
            skip = True
        elif not arg.startswith(tuple(f"{flag}=" for flag in LAUNCHER_FLAGS)):
            kept.append(arg)
    return kept


def relaunch(cmd: list[str], env: dict[str, str], timeout_s: float) -> int:
    """Run the torchrun job `cmd`, its output streaming through, and return its status; past
    `timeout_s` kill it with every process it started (a rank stuck outside a collective,
    which no process-group timeout ends) and fail in one line."""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        raise BenchmarkError(f"the torchrun job did not end within --launch-timeout-s {timeout_s:.0f}; "
                             "it and every process it started were killed") from None


def check_scratch_only(cfg: TrainConfig) -> None:
    """Refuse the flags that would point a benchmark at the user's files or kill it midway.

    A benchmark writes its checkpoints into scratch directories of its own and times loops
    that must run to the end; with `--checkpoint-dir` a loop would restore, prune and write
    a real run's checkpoints (without its lock), and `--fail-at-step` would SIGKILL it.

    Raises:
        ConfigError: One of those flags is set.
    """
    given = [flag for flag, value in (("--checkpoint-dir", cfg.checkpoint_dir), ("--sample-log", cfg.sample_log),
                                      ("--fail-at-step", cfg.fail_at_step)) if value]
    if given:
        raise ConfigError(f"{', '.join(given)}: benchmarks write only to scratch directories of their own "
                          "and run every loop to the end")


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
        check_scratch_only(cfg)
        bench.check(args, cfg)
        preflight(cfg, args.nproc if launch else None)  # e.g. --device cuda without a GPU, or too few
        if launch:
            env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            ranks_argv = _without_launcher_flags(argv)
            return relaunch(torchrun_command(args.nproc, "reference_impl.bench", ranks_argv), env,
                            args.launch_timeout_s)
        bench.run(args, cfg)
    except ConfigError as exc:
        print(f"reference_impl.bench {args.name}: error: {exc}", file=sys.stderr)
        return 2
    except BenchmarkError as exc:
        print(f"reference_impl.bench {args.name}: failed: {exc}", file=sys.stderr)
        return 1
    return 0


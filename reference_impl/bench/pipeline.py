"""`bench pipeline`: the pipeline bubble measured against (P-1)/(V x M+P-1)."""

from __future__ import annotations

import argparse
from typing import Any

from reference_impl.bench.common import benchmark, int_list, positive_int, report
from reference_impl.config import ConfigError, TrainConfig
from reference_impl.distributed import distributed
from reference_impl.parallel.pipeline import SCHEDULES, measure_bubble


def _add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--microbatches", type=int_list, default=(2, 4, 8, 16),
                        help="micro-batches per step: comma-separated, one measurement each")
    parser.add_argument("--rounds", type=positive_int, default=2, help="timed steps per case (the fastest counts)")


def _check_pipeline(args: argparse.Namespace, cfg: TrainConfig) -> None:
    if min(args.microbatches) < args.nproc:
        raise ConfigError(f"every --microbatches value must be at least the number of stages ({args.nproc})")
    if any(m % args.nproc for m in args.microbatches):  # interleaved 1F1B runs them in rounds of P
        raise ConfigError(f"every --microbatches value must be a multiple of the number of stages ({args.nproc})")


@benchmark("pipeline", "pipeline bubble: each stage's measured idle share vs (P-1)/(V x M+P-1), GPipe, 1F1B and "
           "interleaved 1F1B (V = 2)",
           train_defaults=("--device", "cpu"), add_arguments=_add_pipeline_arguments, nproc=2,
           check=_check_pipeline)


def pipeline_bubble(args: argparse.Namespace, cfg: TrainConfig) -> dict[str, Any]:
    """The pipeline bubble measured on stages whose work takes a known time.

    Runs on every rank under torchrun (one stage each); rank 0 reports. See
    [`measure_bubble`][reference_impl.parallel.pipeline.measure_bubble].

    Args:
        args: `--microbatches`, `--rounds` (and `--nproc`: the number of stages).
        cfg: Only the process-group timeout is used.
    """
    with distributed("cpu", cfg.pg_timeout_s) as ctx:
        cases = [measure_bubble(kind, m, rounds=args.rounds) for kind in SCHEDULES for m in args.microbatches]
        if not ctx.is_main:
            return {}
        rows = [[c["schedule"], c["microbatches"], c["step_s"], c["busy_s"], c["measured_idle"], c["formula_idle"]]
                for c in cases]
        return report("pipeline", ["schedule", "M", "step s", "busy s", "idle measured", "idle formula"], rows, {
            "pp_degree": ctx.world_size, "cases": cases, "rounds": args.rounds,
            "max_abs_error": round(max(abs(c["measured_idle"] - c["formula_idle"]) for c in cases), 4)})

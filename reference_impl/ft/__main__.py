"""`python -m reference_impl.ft --replicas R --nproc-per-replica N [train flags]`.

The train flags are the trainer's (`python -m reference_impl.train --help`), for the whole
job: `--fail-rank` is a global rank (replica x N + rank in it). The last line is
`{"event": "ft_complete", "step": ..., "survivor_restarts": 0, "recoveries": k, ...}`.
"""

from __future__ import annotations

import argparse
import sys
import time

from reference_impl.config import ConfigError, OneLineParser, TrainConfig
from reference_impl.ft.launcher import Launcher, summarize


def parse(argv: list[str]) -> tuple[argparse.Namespace, TrainConfig, list[str]]:
    """The launcher's own flags, the job's config and the flags that go to every rank.

    Raises:
        ConfigError: A flag is malformed, or the job is one replicas cannot run.
    """
    parser = OneLineParser(prog="python -m reference_impl.ft")
    parser.add_argument("--replicas", type=int, required=True, help="replica groups (at least 2)")
    parser.add_argument("--nproc-per-replica", type=int, default=1, help="ranks in each replica")
    parser.add_argument("--max-replica-restarts", type=int, default=3, help="restarts allowed per replica")
    parser.add_argument("--step-floor-s", type=float, default=0.0,
                        help="each step lasts at least this long: gives a toy job a real step's length, "
                             "so that a restarted replica can rejoin before the last step")
    args, rest = parser.parse_known_args(argv)
    if args.replicas < 2:
        raise ConfigError(f"--replicas must be at least 2 (got {args.replicas}): one replica has no peer to survive")
    if args.nproc_per_replica < 1 or args.max_replica_restarts < 0 or not 0 <= args.step_floor_s <= 60:
        raise ConfigError("--nproc-per-replica must be at least 1, --max-replica-restarts at least 0 "
                          "and --step-floor-s in [0, 60]")
    cfg = TrainConfig.from_cli(rest, environ={"WORLD_SIZE": str(args.replicas * args.nproc_per_replica)})
    unsupported = {
        "--strategy fsdp": cfg.strategy != "ddp",
        "tensor, pipeline, context or expert parallel": cfg.world_size != cfg.data_parallel_size or cfg.n_experts,
        "--precision fp16 (its loss scale is per replica)": cfg.precision == "fp16",
        "--checkpoint-dir (a live replica is the checkpoint)": bool(cfg.checkpoint_dir),
        "--sample-log (untrained samples are reported as events)": bool(cfg.sample_log),
        "--num-workers above 0 (each step reads its samples afresh)": cfg.num_workers > 0,
        "--fail-mode other than sigkill": bool(cfg.fail_at_step) and cfg.fail_mode != "sigkill",
        "more than one --fail-at-step": len(cfg.fail_at_step) > 1,
    }
    for what, present in unsupported.items():
        if present:
            raise ConfigError(f"replicas do not run with {what}")
    return args, cfg, rest


def main(argv: list[str] | None = None) -> int:
    """Run the job; print `ft_complete` last. Returns 2 on bad flags, 1 if a replica gave up."""
    try:
        args, cfg, rest = parse(sys.argv[1:] if argv is None else argv)
    except ConfigError as exc:
        print(f"reference_impl.ft: error: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    launcher = Launcher(args.replicas, args.nproc_per_replica, rest, args.max_replica_restarts, args.step_floor_s)
    status = launcher.run()
    summary = summarize(launcher.events, launcher.replicas, args.nproc_per_replica,
                        cfg.fail_rank if cfg.fail_at_step else None)
    launcher.emit("ft_complete", **summary, replicas=args.replicas, nproc_per_replica=args.nproc_per_replica,
                  wall_s=round(time.perf_counter() - started, 3))
    return status if summary["state_digests_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())

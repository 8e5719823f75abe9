"""`bench compile`: the trainer's step eager and with `--compile`, on the same model."""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from functools import partial
from typing import Any

import torch

from reference_impl.bench.common import benchmark, interleave, median, positive_int, report
from reference_impl.bench.overhead import trainer_loop
from reference_impl.config import ConfigError, TrainConfig


def _add_compile_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=positive_int, default=5,
                        help="timed rounds, alternating which loop goes first")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch intra-op threads")


@benchmark("compile", "the trainer's step eager against --compile (inductor): speed-up, compile time, "
                      "graph breaks",
           train_defaults=("--model", "transformer", "--d-model", "256", "--n-layers", "4", "--n-heads", "4",
                           "--hidden-dim", "1024", "--seq-len", "128", "--vocab-size", "2048",
                           "--micro-batch-size", "8", "--dataset-size", "512", "--max-steps", "20",
                           "--warmup-steps", "0", "--device", "cpu"),
           add_arguments=_add_compile_arguments)


def compile_speed(args: argparse.Namespace, cfg: TrainConfig) -> dict[str, Any]:
    """Median per-step time of `train()` eager and compiled, in interleaved rounds.

    The compiled loop's first run compiles (timed and reported apart); later runs build a
    fresh model each, whose blocks reuse the compiled graph (parameters are graph inputs),
    so the rounds time steady-state steps. Graph breaks and distinct graphs are dynamo's
    own counters.

    Args:
        args: `--rounds`, `--threads`.
        cfg: The single-process run both loops train, for `max_steps` steps per round.
    """
    from torch._dynamo.utils import counters  # imported only by the benchmark that compiles

    if cfg.world_size != 1 or cfg.compile:
        raise ConfigError("compile compares one process eager and compiled; leave --compile out")
    torch.set_num_threads(args.threads)
    compiled_cfg = replace(cfg, compile=True)
    counters.clear()
    t0 = time.perf_counter()
    trainer_loop(compiled_cfg)  # compiles
    first_run_s = time.perf_counter() - t0
    trainer_loop(cfg)  # eager warm-up
    timings = interleave(args.rounds, {"eager": partial(trainer_loop, cfg),
                                       "compiled": partial(trainer_loop, compiled_cfg)})
    ms = {name: median([wall for wall, _ in t]) * 1e3 for name, t in timings.items()}
    ratios = [e[0] / c[0] for e, c in zip(timings["eager"], timings["compiled"], strict=True)]
    breaks, graphs = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
    rows = [["eager", ms["eager"], ""], ["compiled", ms["compiled"], ""],
            ["speed-up (eager / compiled)", ms["eager"] / ms["compiled"], f"{min(ratios):.3f}-{max(ratios):.3f}"],
            ["first compiled run, s", first_run_s, ""], ["graph breaks", breaks, ""], ["distinct graphs", graphs, ""]]
    return report("compile", ["loop", "median ms/step", "spread"], rows, {
        "eager_ms_per_step": round(ms["eager"], 4), "compiled_ms_per_step": round(ms["compiled"], 4),
        "speedup": round(ms["eager"] / ms["compiled"], 4), "speedup_min": round(min(ratios), 4),
        "speedup_max": round(max(ratios), 4), "first_compiled_run_s": round(first_run_s, 2),
        "graph_breaks": breaks, "unique_graphs": graphs, "rounds": args.rounds, "steps": cfg.max_steps,
        "threads": args.threads, "config_digest": cfg.digest(),
    })

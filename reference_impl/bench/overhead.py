"""`bench overhead`: the trainer's loop against a bare PyTorch loop."""

from __future__ import annotations

import argparse
import io
from collections.abc import Callable, Iterable
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from reference_impl.bench.common import (
    Clock,
    benchmark,
    count,
    interleave,
    median,
    median_interval,
    positive_int,
    report,
)
from reference_impl.config import ConfigError, TrainConfig
from reference_impl.distributed import DistContext
from reference_impl.metrics import EventLog
from reference_impl.model import build_model, loss_fn
from reference_impl.step import build_optimizer
from reference_impl.train import build_dataset, build_state, train


def _add_overhead_arguments(parser: argparse.ArgumentParser) -> None:
    # Many short rounds rather than a few long ones: each round's two loops run seconds
    # apart, so a change in the machine's load lands on both, and the rounds' ratios give
    # the median a confidence interval narrower than the effects worth reading.
    parser.add_argument("--rounds", type=positive_int, default=31,
                        help="timed rounds; each runs both loops, alternating which goes first")
    # One thread by default: on a small shared machine a spinning intra-op pool turns
    # other processes' load into noise far larger than the overhead being measured.
    parser.add_argument("--threads", type=positive_int, default=1, help="torch intra-op threads")
    parser.add_argument("--tiny-steps", type=count, default=500,
                        help="steps per loop and round on the tiny model that isolates the fixed "
                             "per-step cost (0 skips it)")


def bare_loop(cfg: TrainConfig) -> tuple[float, float]:
    """Train `cfg.max_steps` steps with the plainest loop; return (wall, CPU) seconds per step.

    Same model, data, batch size and optimizer as the trainer, nothing else: no timers,
    events, schedule, clipping or accumulation. Setup is not timed.
    """
    model = build_model(cfg)
    return timed_loop(cfg, model, build_optimizer(model, cfg), shuffled_loader(cfg), torch.Tensor.backward)


def shuffled_loader(cfg: TrainConfig) -> DataLoader:
    """The run's dataset in shuffled micro-batches, seeded, the last partial batch dropped."""
    return DataLoader(build_dataset(cfg), batch_size=cfg.micro_batch_size, shuffle=True, drop_last=True,
                      num_workers=cfg.num_workers, generator=torch.Generator().manual_seed(cfg.seed))


def timed_loop(cfg: TrainConfig, model: nn.Module, optimizer: torch.optim.Optimizer, loader: Iterable[Any],
               backward: Callable[[torch.Tensor], object]) -> tuple[float, float]:
    """`cfg.max_steps` steps of forward, `backward(loss)`, step and zero_grad over `loader`
    (a framework passes its own backward); (wall, CPU) seconds per step."""
    model.train()
    steps = 0
    clock = Clock()
    while steps < cfg.max_steps:
        for x, y, _ in loader:
            backward(loss_fn(model(x), y))
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
    clock = Clock()
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
    both sides. The per-round ratios give the spread, to read beside the effect, and their
    median a 95% confidence interval (`median_interval`): read a ratio as settled only when
    that interval is narrower than the difference in question.

    A second comparison on a tiny model (hidden size 8, micro-batch 2), where the math
    costs almost nothing, gives the trainer's fixed cost per step: its CPU time per step
    minus the bare loop's, in microseconds, with the spread over rounds.

    Args:
        args: `--rounds`, `--threads` and `--tiny-steps`.
        cfg: The run both loops train; `max_steps` is the steps per loop and round.
    """
    if cfg.world_size != 1 or cfg.grad_accum_steps != 1:
        raise ConfigError("overhead compares single-process loops without accumulation")
    # The tiny model's config is checked (built) before minutes of the main measurement.
    tiny_cfg = replace(cfg, hidden_dim=8, micro_batch_size=2, max_steps=args.tiny_steps) if args.tiny_steps else None
    torch.set_num_threads(args.threads)
    main = _compare(cfg, args.rounds)
    ratios = [t / b for t, b in zip(main["wall"]["trainer"], main["wall"]["bare"], strict=True)]
    rows = [[name, main["ms"][name], min(main["wall"][name]) * 1e3, max(main["wall"][name]) * 1e3,
             main["cpu_ms"][name]] for name in ("trainer", "bare")]
    ratio = main["ms"]["trainer"] / main["ms"]["bare"]
    cpu_ratio = main["cpu_ms"]["trainer"] / main["cpu_ms"]["bare"]
    rows.append(["trainer/bare", ratio, min(ratios), max(ratios), cpu_ratio])
    low, high = median_interval(ratios)
    rows.append(["per-round ratio: median, 95% CI", median(ratios), low, high, ""])
    extra: dict[str, Any] = {}
    if tiny_cfg is not None:
        tiny = _compare(tiny_cfg, args.rounds)
        fixed = [(t - b) * 1e6 for t, b in zip(tiny["cpu"]["trainer"], tiny["cpu"]["bare"], strict=True)]
        fixed_low, fixed_high = median_interval(fixed)
        rows.append(["tiny: trainer - bare (µs CPU)", median(fixed), min(fixed), max(fixed), ""])
        rows.append(["tiny: median, 95% CI", median(fixed), fixed_low, fixed_high, ""])
        extra = {"fixed_us_per_step": round(median(fixed), 1), "fixed_us_min": round(min(fixed), 1),
                 "fixed_us_max": round(max(fixed), 1), "fixed_us_ci": [round(fixed_low, 1), round(fixed_high, 1)],
                 "tiny_steps": args.tiny_steps}
    return report("overhead", ["loop", "median ms/step", "min", "max", "cpu ms/step"], rows, {
        "ratio": round(ratio, 4), "cpu_ratio": round(cpu_ratio, 4),
        "ratio_min": round(min(ratios), 4), "ratio_max": round(max(ratios), 4),
        "ratio_per_round": round(median(ratios), 4), "ratio_ci": [round(low, 4), round(high, 4)],
        "trainer_ms_per_step": round(main["ms"]["trainer"], 4), "bare_ms_per_step": round(main["ms"]["bare"], 4),
        **extra,
        "rounds": args.rounds, "steps": cfg.max_steps, "model": cfg.model,
        "micro_batch_size": cfg.micro_batch_size, "threads": args.threads,
        "config_digest": cfg.digest(),
    })


def _compare(cfg: TrainConfig, rounds: int) -> dict[str, dict[str, Any]]:
    """Both loops on `cfg`: one warm-up each, then `rounds` interleaved rounds; per-round
    wall and CPU seconds per step, and their medians in milliseconds."""
    loops = {"trainer": trainer_loop, "bare": bare_loop}
    for fn in loops.values():
        fn(cfg)
    timings = interleave(rounds, {name: partial(fn, cfg) for name, fn in loops.items()})
    wall = {name: [w for w, _ in t] for name, t in timings.items()}
    cpu = {name: [c for _, c in t] for name, t in timings.items()}
    return {"wall": wall, "cpu": cpu, "ms": {name: median(t) * 1e3 for name, t in wall.items()},
            "cpu_ms": {name: median(t) * 1e3 for name, t in cpu.items()}}

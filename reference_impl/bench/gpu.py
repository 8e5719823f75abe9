"""`bench gpu`: DDP and FSDP2 in bf16 on CUDA: tokens/s, MFU, peak memory, phases."""

from __future__ import annotations

import argparse
import gc
import io
import math
import statistics
from dataclasses import replace
from typing import Any

import torch

from reference_impl import calc
from reference_impl.bench.async_save import checkpoint_stall, stall_summary
from reference_impl.bench.common import BenchmarkError, add_rounds_argument, benchmark, report
from reference_impl.config import ConfigError, TrainConfig
from reference_impl.distributed import DistContext, distributed
from reference_impl.launch import parse_events
from reference_impl.metrics import PHASES, EventLog
from reference_impl.model import spec_of
from reference_impl.state import TrainState
from reference_impl.train import train

# Dense bf16 peak FLOP/s per GPU, matched by substring of the device name, first match
# first. An H100 whose name does not say PCIe ("NVIDIA H100 80GB HBM3") is the SXM part.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12), ("L40S", 362e12))


def _add_gpu_arguments(parser: argparse.ArgumentParser) -> None:
    add_rounds_argument(parser)
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the GPU's dense bf16 peak in TFLOP/s, when the built-in table "
                             "does not know the device")
    parser.add_argument("--strategies", type=strategy_list, default=STRATEGIES,
                        help="the strategies to train, comma-separated, in the order given "
                             "(default ddp,fsdp); the checkpoint stall is timed only with fsdp")


STRATEGIES = ("ddp", "fsdp")


def strategy_list(text: str) -> tuple[str, ...]:
    """An argparse type: comma-separated names from `STRATEGIES`, each once, one or more."""
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if not names or len(set(names)) < len(names) or not set(names) <= set(STRATEGIES):
        raise argparse.ArgumentTypeError(f"needs one or more of {', '.join(STRATEGIES)}, each once; got {text!r}")
    return names


def peak_bf16_flops(device_name: str) -> float | None:
    """The dense bf16 peak FLOP/s of a GPU from `PEAK_BF16_FLOPS`, or None if unknown.

    Args:
        device_name: As `torch.cuda.get_device_name` spells it.
    """
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in device_name), None)


def predicted_peak_gib(cfg: TrainConfig, params: int, world_size: int) -> dict[str, float]:
    """`calc.memory`'s answer for this run: steady state (model state plus activations) and
    the step's peak with transients, in GiB per GPU.

    The trainer keeps fp32 weights and gradients and two fp32 Adam moments (4 + 4 + 0 + 8
    bytes per parameter; bf16 only in compute), and its blocks are GPT blocks (LayerNorm,
    a two-matrix GELU MLP), so `gated_mlp` is off; `--compile` compiles the loss as well
    (`compiled_loss`: the logits and their gradient in bf16, no fp32 copies). `calc.memory`'s
    transients follow the Llama block FSDPMemTracker certified, so the peak is an estimate
    for this model.
    """
    answers = {name: calc.memory(
        params=params, world_size=world_size, strategy=cfg.strategy, seq_len=cfg.seq_len,
        micro_batch=cfg.micro_batch_size, hidden=cfg.d_model, n_heads=cfg.n_heads, n_layers=cfg.n_layers,
        ffn_hidden=cfg.hidden_dim, vocab_size=cfg.vocab_size, param_bytes=4, grad_bytes=4, master_bytes=0,
        optimizer_bytes=8, compute_bytes=2 if cfg.precision == "bf16" else 4,
        activation_checkpointing=cfg.activation_checkpointing, compiled_loss=cfg.compile,
        transients=transients)["total_bytes"]
        for name, transients in (("steady", False), ("peak", True))}
    return {name: round(value / 2 ** 30, 3) for name, value in answers.items()}


def measured_training(cfg: TrainConfig, ctx: DistContext, peak_flops: float | None,
                      ) -> tuple[TrainState, dict[str, Any]]:
    """Train `cfg` on this GPU with the real loop; measure it from its own `step` events.

    The first log window (CUDA context, kernel selection, allocator growth) is left
    out. Throughput is the harmonic mean of the later windows' samples/s weighted by
    their steps (total samples over total time); tokens/s is that times `seq_len`.
    MFU is the model spec's `flops_per_sample(cfg)` x samples/s over (world size x `peak_flops`):
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
    weights = [b["step"] - a["step"] for a, b in zip(steps, windows, strict=False)]
    samples_per_s = statistics.harmonic_mean([e["samples_per_s"] for e in windows], weights=weights)
    phase_ms = {name: round(1e3 * sum(e["phase_s"].get(name, 0.0) for e in windows) / sum(weights), 3)
                for name in PHASES}
    mfu = spec_of(cfg).flops_per_sample(cfg) * samples_per_s / (ctx.world_size * peak_flops) if peak_flops else None
    params = sum(p.numel() for p in state.model.parameters())  # an FSDP DTensor counts its global size
    return state, {
        "tokens_per_s": round(samples_per_s * cfg.seq_len, 1),
        "mfu": None if mfu is None else round(mfu, 4),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(ctx.device) / 2 ** 30, 3),
        "predicted_memory_gib": predicted_peak_gib(cfg, params, ctx.world_size),
        "graph_breaks": graph_breaks() if cfg.compile else None,
        "phase_ms_per_step": phase_ms, "first_loss": steps[0]["loss"], "last_loss": steps[-1]["loss"],
        "loss_finite": all(math.isfinite(e["loss"]) for e in steps),
    }


def graph_breaks() -> int:
    """Graph breaks dynamo has counted in this process (0: each compiled unit is one graph)."""
    from torch._dynamo.utils import counters  # imported only by runs that compile

    return sum(counters["graph_break"].values())


def _check_gpu(args: argparse.Namespace, cfg: TrainConfig) -> None:
    if cfg.device != "cuda" or cfg.max_steps < 2 * cfg.log_every:
        raise ConfigError("gpu needs --device cuda and --max-steps of at least 2 x --log-every "
                          "(the first log window is warm-up)")


@benchmark("gpu", "DDP and FSDP2 in bf16 on CUDA: tokens/s, MFU, peak memory, phases, "
                  "async-versus-sync checkpoint stall (needs a GPU)",
           train_defaults=("--model", "transformer", "--precision", "bf16", "--device", "cuda",
                           "--d-model", "1024", "--n-layers", "12", "--n-heads", "16", "--hidden-dim", "4096",
                           "--seq-len", "1024", "--vocab-size", "32768", "--micro-batch-size", "8",
                           "--dataset-size", "4096", "--max-steps", "100", "--warmup-steps", "10",
                           "--lr", "1e-3", "--log-every", "10"),
           add_arguments=_add_gpu_arguments, nproc=1, check=_check_gpu)


def gpu(args: argparse.Namespace, cfg: TrainConfig) -> dict[str, Any]:
    """Train the same transformer under each of `--strategies` (DDP, then FSDP2, by default),
    and time the FSDP state's checkpoint stalls.

    Runs on every rank under torchrun (one process per GPU; NCCL); rank 0 reports.
    Each strategy is measured by [`measured_training`][reference_impl.bench.gpu.measured_training];
    the FSDP state is then saved sync and async by
    [`checkpoint_stall`][reference_impl.bench.async_save.checkpoint_stall] (async saves are FSDP-only).

    Args:
        args: `--rounds` of checkpoint stall, `--peak-tflops`, `--strategies`, `--nproc`.
        cfg: The run; `--strategy` is set to each strategy in turn.

    Raises:
        BenchmarkError: The loss was not finite under some strategy (after the report).
    """
    with distributed(cfg.device, cfg.pg_timeout_s) as ctx:
        device_name = torch.cuda.get_device_name(ctx.device)
        peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_bf16_flops(device_name)
        runs, stall = {}, None
        for strategy in args.strategies:
            strategy_cfg = replace(cfg, strategy=strategy)
            state, runs[strategy] = measured_training(strategy_cfg, ctx, peak)
            if strategy == "fsdp":
                stall = stall_summary(checkpoint_stall(state, strategy_cfg, ctx, args.rounds))
            del state  # freed before the next strategy allocates its own
        if not ctx.is_main:
            return {}
        if stall:
            print(f"checkpoint stall (FSDP, median of {args.rounds}): sync {stall['sync_s']:.3f}s, "
                  f"async blocked {stall['blocked_s']:.3f}s ({100 * stall['blocked_ratio']:.0f}% of sync)")
        rows = [[name, round(r["tokens_per_s"]), "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%",
                 r["peak_memory_gib"], *(r["phase_ms_per_step"][p] for p in PHASES),
                 f"{r['first_loss']:.3f}->{r['last_loss']:.3f}"] for name, r in runs.items()]
        record = report("gpu", ["strategy", "tokens/s", "MFU", "peak GiB", *(f"{p} ms" for p in PHASES), "loss"],
                        rows, {
            "device_name": device_name, "peak_bf16_flops": peak, "world_size": ctx.world_size, **runs,
            "checkpoint_stall": stall, "flops_per_sample": spec_of(cfg).flops_per_sample(cfg), "seq_len": cfg.seq_len,
            "global_batch_size": cfg.global_batch_size, "steps": cfg.max_steps, "config_digest": cfg.digest(),
        })
        # A speed benchmark: 60 steps at this vocabulary barely move the loss (tests/test_gpu.py
        # shows that the GPU path learns); a non-finite loss means the numbers timed garbage.
        if failed := [name for name, r in runs.items() if not r["loss_finite"]]:
            raise BenchmarkError(f"the loss was not finite under {', '.join(failed)}")
        return record

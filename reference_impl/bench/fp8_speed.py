"""`bench fp8`: one float8 linear layer's forward and backward against bf16, by size.

FP8 halves the bytes each matmul reads and doubles the tensor cores' peak, but every
operand is first scaled and cast (a read of the wide tensor, an amax reduction and a
1-byte write). The benchmark times both, so the table shows at which size the matmuls'
saving outgrows the casts' cost. Only a GPU with FP8 tensor cores (H100 and later)
answers that; on a CPU `torch._scaled_mm` is an emulation and the timings say nothing
about FP8 hardware (the report says which device it ran on).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from reference_impl.bench.common import benchmark, int_list, interleave, median, positive_int, report
from reference_impl.config import ConfigError, TrainConfig
from reference_impl.fp8 import E4M3, Float8Linear, _mm, to_float8


def _add_fp8_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=int_list, default=(1024, 2048, 4096, 8192),
                        help="comma-separated K: each case is a K x K linear layer (multiples of 16)")
    parser.add_argument("--tokens", type=positive_int, default=8192, help="rows of the input (a multiple of 16)")
    parser.add_argument("--iters", type=positive_int, default=20, help="forward and backward passes per timed round")
    parser.add_argument("--rounds", type=positive_int, default=5,
                        help="timed rounds, alternating which case goes first")
    parser.add_argument("--compile", action="store_true",
                        help="also time both layers under torch.compile (the casts fuse into their producers)")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _per_iter(fn: Callable[[], object], iters: int, device: torch.device) -> Callable[[], float]:
    """A zero-argument timer: seconds per call of `fn`, over `iters` calls."""
    def measure() -> float:
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync(device)
        return (time.perf_counter() - t0) / iters
    return measure


def _training_pass(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor,
                   compiled: bool) -> Callable[[], object]:
    """One forward and backward of `layer` under bf16 autocast, as the trainer runs it."""
    def forward(inp: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            return layer(inp)
    fwd = torch.compile(forward) if compiled else forward

    def step() -> None:
        layer.weight.grad = None
        fwd(x).backward(grad)
    return step


@benchmark("fp8", "a float8 linear's forward and backward against bf16, by size: where the matmuls' "
                  "saving outgrows the casts (a GPU answers; a CPU only emulates)",
           add_arguments=_add_fp8_arguments)
def fp8_speed(args: argparse.Namespace, cfg: TrainConfig) -> dict[str, Any]:
    """Median time per forward and backward of a K x K layer, bf16 against fp8, per size.

    Each size also times the bare matmul, bf16 against `torch._scaled_mm` on operands
    already cast: the ceiling the hardware gives before any cast is paid.

    Args:
        args: `--sizes`, `--tokens`, `--iters`, `--rounds`, `--compile`.
        cfg: Only `device` is used (`auto`: the GPU if there is one).
    """
    device = torch.device("cuda" if cfg.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu")
    if cfg.device == "cuda" and device.type != "cuda":
        raise ConfigError("--device cuda was requested but no GPU is visible")
    if args.tokens % 16 or any(k % 16 for k in args.sizes) or min(args.iters, args.rounds) < 1:
        raise ConfigError("--tokens and every size must be multiples of 16; --iters and --rounds at least 1")
    modes = (False, True) if args.compile else (False,)
    rows, cases = [], []
    for k in args.sizes:
        torch.manual_seed(0)
        x = torch.randn(args.tokens, k, device=device, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(args.tokens, k, device=device, dtype=torch.bfloat16)
        bf16 = nn.Linear(k, k, bias=False, device=device)
        fp8 = Float8Linear(k, k, bias=False, device=device)
        fp8.weight = bf16.weight  # the same fp32 master weight, as `swap_linears` leaves it
        a8, a_inv = to_float8(x.detach(), E4M3)
        b8, b_inv = to_float8(bf16.weight.detach(), E4M3)
        w16 = bf16.weight.detach().to(torch.bfloat16)
        timers = {"matmul bf16": _per_iter(partial(torch.matmul, x.detach(), w16.t()), args.iters, device),
                  "matmul fp8": _per_iter(partial(_mm, a8, a_inv, b8.t(), b_inv, torch.bfloat16), args.iters,
                                          device)}
        for compiled in modes:
            tag = " compiled" if compiled else ""
            timers[f"layer bf16{tag}"] = _per_iter(_training_pass(bf16, x, grad, compiled), args.iters, device)
            timers[f"layer fp8{tag}"] = _per_iter(_training_pass(fp8, x, grad, compiled), args.iters, device)
        for warm in timers.values():  # compiles, and lets the allocator reach its steady state
            warm()
        ms = {name: median(t) * 1e3 for name, t in interleave(args.rounds, timers).items()}
        case: dict[str, Any] = {"k": k, "tokens": args.tokens, "ms": {n: round(v, 4) for n, v in ms.items()},
                                "matmul_speedup": round(ms["matmul bf16"] / ms["matmul fp8"], 4)}
        for compiled in modes:
            tag = " compiled" if compiled else ""
            case[f"layer_speedup{tag.replace(' ', '_')}"] = round(ms[f"layer bf16{tag}"] / ms[f"layer fp8{tag}"], 4)
            rows.append([k, "compiled" if compiled else "eager", ms[f"layer bf16{tag}"], ms[f"layer fp8{tag}"],
                         ms[f"layer bf16{tag}"] / ms[f"layer fp8{tag}"], case["matmul_speedup"]])
        cases.append(case)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (emulated fp8: no speed claim)"
    print(f"device: {name}; {args.tokens} tokens; median of {args.rounds} rounds of {args.iters} passes")
    return report("fp8", ["K", "mode", "bf16 ms", "fp8 ms", "speed-up", "matmul-only speed-up"], rows, {
        "device": name, "tokens": args.tokens, "iters": args.iters, "rounds": args.rounds, "cases": cases,
        "torch": torch.__version__,
    })

"""Profile the trainer's step on one GPU, one variant per process, for `bench gpu`'s questions.

Each variant trains `bench gpu`'s default transformer (219 M parameters, 8 x 1,024
tokens, bf16) with the real `train` loop on a one-rank NCCL group, the way `bench gpu`
does, and reports three views of the same steps:

- the trainer's own phase times (CUDA events) over ten warm, unprofiled steps;
- wall time per step, the sum of GPU kernel time per step and the launches per step
  (kernels, copies, memsets) over five profiled steps (kernel time well under wall time:
  the GPU waits for the host);
- the kernels and host operations that cost the most, written to OUT/NAME.txt.

    python scripts/gpu_profile.py OUT [VARIANT ...]      # default: every variant

A variant changes one thing against its baseline (see `VARIANTS`), so a difference
between two rows is that change's effect. The last line is a JSON record of every row.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SHAPE = ["--model", "transformer", "--precision", "bf16", "--device", "cuda", "--d-model", "1024",
         "--n-layers", "12", "--n-heads", "16", "--hidden-dim", "4096", "--seq-len", "1024",
         "--vocab-size", "32768", "--micro-batch-size", "8", "--dataset-size", "4096", "--warmup-steps", "10",
         "--lr", "1e-3", "--log-every", "5"]
WARM, MEASURED, PROFILE_WARMUP, PROFILED = 10, 10, 2, 5

# name: (train flags, what the variant patches; see `apply_patch`)
VARIANTS: dict[str, tuple[list[str], str]] = {
    "ddp-eager": (["--strategy", "ddp"], ""),
    "ddp-eager-copied-grads": (["--strategy", "ddp"], "copied-grads"),
    "ddp-compile": (["--strategy", "ddp", "--compile"], ""),
    "ddp-compile-copied-grads": (["--strategy", "ddp", "--compile"], "copied-grads"),
    "ddp-compile-cpp-wrapper": (["--strategy", "ddp", "--compile"], "cpp-wrapper"),
    "ddp-compile-cudagraphs": (["--strategy", "ddp", "--compile"], "cudagraphs"),
    "ddp-compile-loss-eager": (["--strategy", "ddp", "--compile"], "loss-eager"),
    "ddp-compile-whole": (["--strategy", "ddp", "--compile"], "whole-model"),
    "fsdp-eager": (["--strategy", "fsdp"], ""),
    "fsdp-eager-foreach": (["--strategy", "fsdp"], "foreach"),
    "fsdp-eager-keep": (["--strategy", "fsdp"], "no-reshard"),
}


def apply_patch(patch: str) -> None:
    """Change one thing in the package before the model is built."""
    import functools

    import torch

    from reference_impl import step, train
    from reference_impl.parallel import registry as parallel

    if patch == "loss-eager":
        step.compiled_loss = lambda loss: loss  # type: ignore[assignment]
    elif patch == "whole-model":
        def whole(model: torch.nn.Module, units: list[torch.nn.Module]) -> list[torch.nn.Module]:
            model.forward = torch.compile(model.forward)  # type: ignore[method-assign]
            return [model]
        parallel.compile_units = whole  # type: ignore[assignment]
    elif patch == "copied-grads":  # DDP as before `gradient_as_bucket_view`
        from dataclasses import replace

        from torch.nn.parallel import DistributedDataParallel

        def copied(model: torch.nn.Module, mesh: Any, cfg: Any) -> torch.nn.Module:
            on_cuda = mesh.device_type == "cuda"
            return DistributedDataParallel(model, process_group=mesh.get_group(),
                                           device_ids=[torch.cuda.current_device()] if on_cuda else None)
        parallel.PARALLELISMS["ddp"] = replace(parallel.PARALLELISMS["ddp"], wrap=copied)
    elif patch == "cpp-wrapper":
        import torch._inductor.config as inductor_config

        inductor_config.cpp_wrapper = True
    elif patch == "cudagraphs":
        def graphed(model: torch.nn.Module, units: list[torch.nn.Module]) -> list[torch.nn.Module]:
            units = units or [model]
            for unit in units:
                unit.forward = torch.compile(unit.forward, mode="reduce-overhead")  # type: ignore[method-assign]
            return units
        parallel.compile_units = graphed  # type: ignore[assignment]
    elif patch == "foreach":
        def foreach(model: torch.nn.Module, cfg: Any) -> torch.optim.Optimizer:
            return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=True)
        train.build_optimizer = foreach  # type: ignore[assignment]
    elif patch == "no-reshard":
        parallel.fully_shard = functools.partial(parallel.fully_shard, reshard_after_forward=False)  # type: ignore[assignment]
    elif patch:
        raise SystemExit(f"unknown patch {patch!r}")


def one_variant(name: str, out: Path) -> dict[str, Any]:
    """Train one variant in this process and measure it."""
    import io

    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from reference_impl.config import TrainConfig
    from reference_impl.distributed import distributed
    from reference_impl.launch import parse_events
    from reference_impl.metrics import EventLog
    from reference_impl.train import train

    flags, patch = VARIANTS[name]
    apply_patch(patch)
    total = WARM + MEASURED + PROFILE_WARMUP + PROFILED + 1
    cfg = TrainConfig.from_cli([*SHAPE, *flags, "--max-steps", str(total)])
    clock: dict[str, float] = {}
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                   schedule=schedule(wait=WARM + MEASURED, warmup=PROFILE_WARMUP, active=PROFILED, repeat=1))

    def on_step(state: Any) -> None:
        if state.step in (WARM + MEASURED + PROFILE_WARMUP, WARM + MEASURED + PROFILE_WARMUP + PROFILED):
            torch.cuda.synchronize()
            clock[str(state.step)] = time.perf_counter()
        prof.step()

    stream = io.StringIO()
    started = time.perf_counter()
    with distributed(cfg.device, cfg.pg_timeout_s) as ctx, prof:
        torch.cuda.reset_peak_memory_stats()
        train(cfg, ctx, EventLog(ctx.rank, stream), on_step=on_step)
    steps = [e for e in parse_events(stream.getvalue()) if e["event"] == "step"]
    measured = [e for e in steps if WARM < e["step"] <= WARM + MEASURED]
    phases = {k: round(1e3 * sum(e["phase_s"].get(k, 0.0) for e in measured) / MEASURED, 3)
              for k in ("forward", "backward", "optimizer")}
    events = prof.key_averages()
    by_device = events.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=70)
    # The table's own total of kernel time (it leaves out annotations such as ProfilerStep).
    total = re.search(r"Self CUDA time total: ([\d.]+)(ms|us|s)\b", by_device)
    kernel_ms = float(total[1]) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[total[2]] / PROFILED if total else float("nan")
    times = sorted(clock.values())
    wall_ms = 1e3 * (times[-1] - times[0]) / PROFILED if len(times) == 2 else float("nan")
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                          "cudaMemcpyAsync", "cudaMemsetAsync", "cudaGraphLaunch"))
    n_kernels = launches / PROFILED
    with (out / f"{name}.txt").open("w") as f:
        f.write(by_device)
        f.write("\n")
        f.write(events.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70))
    return {"variant": name, "phase_ms": phases, "step_ms_unprofiled": round(sum(phases.values()), 2),
            "tokens_per_s": round(sum(e["samples_per_s"] for e in measured[-1:]) * cfg.seq_len),
            "profiled_wall_ms": round(wall_ms, 2), "kernel_ms": round(kernel_ms, 2),
            "gpu_busy": round(kernel_ms / wall_ms, 3), "launches_per_step": round(n_kernels),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2 ** 30, 2),
            "seconds": round(time.perf_counter() - started, 1)}


def main() -> int:
    out = Path(sys.argv[1])
    names = sys.argv[2:] or list(VARIANTS)
    if os.environ.get("GPU_PROFILE_VARIANT"):  # the child: one variant
        row = one_variant(os.environ["GPU_PROFILE_VARIANT"], out)
        print("ROW " + json.dumps(row), flush=True)
        return 0
    out.mkdir(parents=True, exist_ok=True)
    rows, deadline = [], time.monotonic() + float(os.environ.get("GPU_PROFILE_BUDGET_S", "600"))
    for port, name in enumerate(names, start=29600):
        if time.monotonic() > deadline:
            print(f"{name}: skipped, GPU_PROFILE_BUDGET_S spent", flush=True)
            continue
        env = {**os.environ, "GPU_PROFILE_VARIANT": name, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
               "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        try:
            done = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True,
                                  timeout=240)
        except subprocess.TimeoutExpired:
            print(f"{name}: timed out", flush=True)
            continue
        (out / f"{name}.log").write_text(done.stdout[-20000:] + done.stderr[-20000:])
        found = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
        if not found:
            print(f"{name}: exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}", flush=True)
            continue
        rows.append(json.loads(found[0]))
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"profile": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

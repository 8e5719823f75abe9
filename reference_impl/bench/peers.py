"""`bench peers`: the trainer's loop and checkpoints beside HF Accelerate and Lightning Fabric.

An optional extra (`pip install -e '.[peers]'`): the two packages are imported only here,
and only when the benchmark runs.
"""

from __future__ import annotations

import argparse
import gc
import io
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from reference_impl.bench.common import benchmark, count, interleave, median, positive_int, report, timed, trained_state
from reference_impl.bench.overhead import bare_loop, shuffled_loader, timed_loop, trainer_loop
from reference_impl.checkpoint import CheckpointManager
from reference_impl.config import ConfigError, TrainConfig
from reference_impl.distributed import DistContext
from reference_impl.metrics import EventLog
from reference_impl.model import build_model
from reference_impl.parallel.registry import unwrap
from reference_impl.state import TrainState
from reference_impl.step import build_optimizer

PEERS = ("accelerate", "lightning")


def _add_peers_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=positive_int, default=5,
                        help="timed rounds, alternating the order of the cases")
    parser.add_argument("--tiny-steps", type=count, default=500,
                        help="steps per loop and round on the tiny model that isolates the fixed per-step cost")
    parser.add_argument("--checkpoint-hidden-dim", type=positive_int, default=4096,
                        help="the MLP's hidden size for the checkpoint cases (4096: 17 M parameters)")


# --8<-- [start:peer_loops]
def accelerate_loop(cfg: TrainConfig) -> tuple[float, float]:
    """The bare loop as HF Accelerate's documentation writes it: `prepare`, then
    `accelerator.backward` (CPU, one process)."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = build_model(cfg)
    model, optimizer, loader = accelerator.prepare(model, build_optimizer(model, cfg), shuffled_loader(cfg))
    return timed_loop(cfg, model, optimizer, loader, accelerator.backward)


def fabric_loop(cfg: TrainConfig) -> tuple[float, float]:
    """The bare loop under Lightning Fabric: `setup`, `setup_dataloaders`, `fabric.backward`."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
    model = build_model(cfg)
    model, optimizer = fabric.setup(model, build_optimizer(model, cfg))
    return timed_loop(cfg, model, optimizer, fabric.setup_dataloaders(shuffled_loader(cfg)), fabric.backward)
# --8<-- [end:peer_loops]


LOOPS: dict[str, Callable[[TrainConfig], tuple[float, float]]] = {
    "bare": bare_loop, "ours": trainer_loop, "accelerate": accelerate_loop, "fabric": fabric_loop}


@dataclass
class Saver:
    """One way of writing and reading back a model and its optimizer."""

    # Either may return something (Fabric's load returns what it did not restore); it is unused.
    save: Callable[[Path], object]
    load: Callable[[Path], object]


def savers(state: TrainState, cfg: TrainConfig) -> dict[str, Saver]:
    """Ours (`CheckpointManager`), Accelerate's `save_state`, Fabric's `save`, and raw
    `torch.save`, each of the same trained model and AdamW state."""
    from accelerate import Accelerator
    from lightning.fabric import Fabric

    model, optimizer = unwrap(state.model), state.optimizer
    ctx, log = DistContext(), EventLog(0, io.StringIO())
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(model, optimizer)  # the accelerator keeps what it prepared and saves it
    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
    fab_model, fab_optimizer = fabric.setup(model, optimizer)
    fab_state = {"model": fab_model, "optimizer": fab_optimizer}

    def ours_save(path: Path) -> None:
        CheckpointManager(path, log).save(state, replace(cfg, checkpoint_dir=str(path)), ctx)

    def ours_load(path: Path) -> None:
        if CheckpointManager(path, log).restore(state, replace(cfg, checkpoint_dir=str(path)), ctx) is None:
            raise RuntimeError("no usable checkpoint")

    def raw_load(path: Path) -> None:
        saved = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])

    return {
        "ours": Saver(ours_save, ours_load),
        "accelerate": Saver(lambda path: accelerator.save_state(str(path)),
                            lambda path: accelerator.load_state(str(path))),
        "fabric": Saver(lambda path: fabric.save(path / "state.ckpt", fab_state),
                        lambda path: fabric.load(path / "state.ckpt", fab_state)),
        "raw": Saver(lambda path: torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                                             path / "state.pt"), raw_load),
    }


@contextmanager
def _counting(module: Any, names: tuple[str, ...]) -> Iterator[list[str]]:
    """Count calls of `module.<name>` for each name (the calls still happen)."""
    calls: list[str] = []
    originals = {name: getattr(module, name) for name in names}

    def wrap(name: str) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return originals[name](*args, **kwargs)
        return counted

    for name in names:
        setattr(module, name, wrap(name))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(module, name, fn)


def guarantees(saver: Saver, root: Path) -> dict[str, bool]:
    """What a save promises, observed rather than read from documentation.

    * `fsync`: the save calls `os.fsync` or `os.fdatasync` (data on disk when it returns);
    * `atomic`: it publishes with `os.replace` or `os.rename` (a crash leaves the old
      checkpoint or the new one, never a half-written one under the final name);
    * `verified`: after one byte in the middle of its largest file is flipped, loading
      fails (raises or finds no usable checkpoint) instead of returning changed weights.
    """
    path = root / "guarantees"
    path.mkdir()
    with _counting(os, ("fsync", "fdatasync", "replace", "rename")) as calls:
        saver.save(path)
    largest = max((f for f in path.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    data = bytearray(largest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    largest.write_bytes(bytes(data))
    try:
        saver.load(path)
        verified = False
    except Exception:  # noqa: BLE001 - any refusal counts; what matters is that it did not load
        verified = True
    shutil.rmtree(path)
    return {"fsync": bool({"fsync", "fdatasync"} & set(calls)),
            "atomic": bool({"replace", "rename"} & set(calls)), "verified": verified}


def checkpoint_cases(cfg: TrainConfig, rounds: int) -> dict[str, dict[str, Any]]:
    """Median save and load seconds of each saver, interleaved, and its guarantees."""
    state = trained_state(cfg, DistContext())
    root = Path(tempfile.mkdtemp(prefix="bench-peers-"))
    try:
        cases = savers(state, cfg)
        found = {name: guarantees(s, root) for name, s in cases.items()}

        def fresh(name: str) -> Path:
            path = root / name
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            os.sync()  # untimed: one case's write-back is not charged to the next
            return path

        def save(name: str) -> float:
            path = fresh(name)
            return timed(lambda: cases[name].save(path))

        def load(name: str) -> float:
            gc.collect()
            return timed(lambda: cases[name].load(root / name))

        saves = interleave(rounds, {name: partial(save, name) for name in cases})
        loads = interleave(rounds, {name: partial(load, name) for name in cases})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {name: {"save_s": round(median(saves[name]), 4), "load_s": round(median(loads[name]), 4),
                   **found[name]} for name in cases}


@benchmark("peers", "the trainer's loop and checkpoints beside HF Accelerate and Lightning Fabric "
                    "(needs the optional extra: pip install -e '.[peers]')",
           train_defaults=("--model", "mlp", "--hidden-dim", "512", "--micro-batch-size", "128",
                           "--max-steps", "50", "--warmup-steps", "0", "--device", "cpu", "--grad-clip", "0"),
           add_arguments=_add_peers_arguments)


def peers(args: argparse.Namespace, cfg: TrainConfig) -> dict[str, Any]:
    """Per-step time of four loops on one model, the fixed per-step cost of each on a tiny
    model, and save/load time with the guarantees each save keeps.

    Loops: bare PyTorch, ours (`train()`), Accelerate, Fabric, in interleaved rounds after
    an untimed warm-up of each (one thread). The fixed cost is each loop's CPU time per
    step minus the bare loop's on an MLP of hidden size 8 and micro-batch 2.

    Args:
        args: `--rounds`, `--tiny-steps`, `--checkpoint-hidden-dim`.
        cfg: The single-process CPU run every loop trains.
    """
    missing = [name for name in PEERS if not _importable(name)]
    if missing:
        raise ConfigError(f"peers needs {', '.join(missing)}: pip install -e '.[peers]'")
    if cfg.world_size != 1 or cfg.grad_accum_steps != 1:
        raise ConfigError("peers compares single-process loops without accumulation")
    torch.set_num_threads(1)
    loops = _loops(cfg, args.rounds)
    tiny = _loops(replace(cfg, hidden_dim=8, micro_batch_size=2, max_steps=args.tiny_steps), args.rounds)
    fixed = {name: median([(t - b) * 1e6 for t, b in zip(tiny["cpu"][name], tiny["cpu"]["bare"], strict=True)])
             for name in LOOPS if name != "bare"}
    saves = checkpoint_cases(replace(cfg, max_steps=2, hidden_dim=args.checkpoint_hidden_dim), args.rounds)
    rows = [[name, loops["ms"][name], loops["ms"][name] / loops["ms"]["bare"], fixed.get(name, 0.0),
             *(saves[key][field] if key in saves else "" for key, field in ((name, "save_s"), (name, "load_s"))),
             *(("yes" if saves[name][g] else "no") if name in saves else "" for g in ("fsync", "atomic", "verified"))]
            for name in ("bare", "ours", "accelerate", "fabric")]
    rows.append(["raw torch.save", "", "", "", saves["raw"]["save_s"], saves["raw"]["load_s"],
                 *("yes" if saves["raw"][g] else "no" for g in ("fsync", "atomic", "verified"))])
    import accelerate
    import lightning

    return report("peers", ["loop", "ms/step", "/ bare", "fixed µs", "save s", "load s", "fsync", "atomic",
                            "verified"], rows, {
        "loop_ms": {k: round(v, 4) for k, v in loops["ms"].items()},
        "loop_ratio": {k: round(v / loops["ms"]["bare"], 4) for k, v in loops["ms"].items()},
        "fixed_us_per_step": {k: round(v, 1) for k, v in fixed.items()}, "checkpoint": saves,
        "versions": {"torch": torch.__version__, "accelerate": accelerate.__version__,
                     "lightning": lightning.__version__},
        "rounds": args.rounds, "steps": cfg.max_steps, "tiny_steps": args.tiny_steps,
        "checkpoint_hidden_dim": args.checkpoint_hidden_dim, "config_digest": cfg.digest(),
    })


def _loops(cfg: TrainConfig, rounds: int) -> dict[str, Any]:
    for fn in LOOPS.values():  # warm-up, untimed
        fn(cfg)
    timings = interleave(rounds, {name: partial(fn, cfg) for name, fn in LOOPS.items()})
    return {"cpu": {name: [c for _, c in t] for name, t in timings.items()},
            "ms": {name: median([w for w, _ in t]) * 1e3 for name, t in timings.items()}}


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None

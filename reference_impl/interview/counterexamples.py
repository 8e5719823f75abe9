"""Naive versions of the trainer's trickiest pieces, and a demonstration of each that fails.

Nothing here is used by the trainer. Each naive function or class is the tempting first
draft of something `reference_impl` does correctly. The handbook's Pitfalls page shows
each one in a block that runs where it is pasted (torch and numpy only): the `imports`
section, the naive version, the fix (the trainer's own section where it runs alone, else
the smallest fix that makes the point) and a `demo_*` that runs both and prints one line,
`naive: ...; fixed: ...`. `tests/test_counterexamples.py` proves each failure with the
package's real machinery; `tests/test_pitfall_blocks.py` runs every pasted block.
"""

from __future__ import annotations  # outside the section: a pasted block may start with a fix's imports

# --8<-- [start:imports]
import contextlib
import glob  # noqa: F401 - the checkpoint section of interview_core.py, shown with it, uses it
import hashlib
import json
import marshal
import os
import random
import resource
import shutil  # noqa: F401 - the checkpoint section of interview_core.py, shown with it, uses it
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile  # noqa: F401 - the checkpoint section of interview_core.py, shown with it, uses it
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Sampler, TensorDataset

# --8<-- [end:imports]
from reference_impl.data import ResumableDistributedSampler
from reference_impl.distributed import destroy, init_distributed
from reference_impl.interview_core import restore, save
from reference_impl.metrics import PhaseTimer
from reference_impl.state import rng_state, set_rng_state
from reference_impl.step import AUTOCAST_DTYPES, build_scaler, build_scheduler, lr_multiplier


# --8<-- [start:naive_digest]
def naive_digest(fields: dict[str, Any]) -> str:
    """Config identity via the built-in hash(): salted per process."""
    payload = json.dumps(fields, sort_keys=True)
    return str(abs(hash(payload)))  # differs between runs (PYTHONHASHSEED)
# --8<-- [end:naive_digest]


# --8<-- [start:naive_sampler]
class CountingInIterSampler(Sampler[int]):
    """Counts progress while *yielding* indices; never resets it per epoch."""

    def __init__(self, num_samples: int, *, world_size: int, rank: int,
                 seed: int = 0) -> None:
        self.num_samples, self.seed = num_samples, seed
        self.world_size, self.rank = world_size, rank
        self.epoch, self.consumed = 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch  # bug 2: `consumed` carries over into the next epoch

    def __iter__(self) -> Iterator[int]:
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        perm = torch.randperm(self.num_samples, generator=gen)
        mine = perm[self.rank::self.world_size].tolist()
        for index in mine[self.consumed:]:
            yield index
            self.consumed += 1  # bug 1: counts what was fetched, not trained

    def __len__(self) -> int:
        return len(range(self.rank, self.num_samples, self.world_size))

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed}
# --8<-- [end:naive_sampler]


# --8<-- [start:naive_rng_checkpoint]
def naive_rng_state() -> dict[str, Any]:
    """Every RNG in its native form: NumPy's is a tuple holding an ndarray."""
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state()}


def naive_load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Relies on torch.load's default: weights_only=True since PyTorch 2.6."""
    return torch.load(path)
# --8<-- [end:naive_rng_checkpoint]


# --8<-- [start:naive_rank0_save]
def naive_rank0_save(path: str | os.PathLike[str], model: nn.Module) -> None:
    """Only rank 0 writes, so only rank 0's RNG stream is recorded."""
    if dist.get_rank() == 0:
        torch.save({"model": model.state_dict(), "rng": torch.get_rng_state()}, path)
    dist.barrier()


def naive_rank0_restore(path: str | os.PathLike[str], model: nn.Module) -> None:
    """Every rank loads the same file, and therefore rank 0's RNG state."""
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    torch.set_rng_state(state["rng"])
# --8<-- [end:naive_rank0_save]


# --8<-- [start:naive_in_place_save]
def naive_save(state: dict[str, Any], checkpoint_dir: str | os.PathLike[str],
               step: int) -> Path:
    """Writes straight to the final name: a crash mid-write leaves a torn file."""
    path = Path(checkpoint_dir) / f"step-{step:08d}.pt"
    torch.save(state, path)
    return path


def naive_latest(checkpoint_dir: str | os.PathLike[str]) -> Path | None:
    """Trusts the newest name, whatever is inside it."""
    candidates = sorted(Path(checkpoint_dir).glob("step-*.pt"))
    return candidates[-1] if candidates else None
# --8<-- [end:naive_in_place_save]


# --8<-- [start:naive_accumulation]
def naive_accumulating_step(model: nn.Module,
                            micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                            optimizer: torch.optim.Optimizer) -> None:
    """grad_accum_steps is on the config, but this steps after every micro-batch
    and never enters no_sync(), so DDP all-reduces every micro-batch."""
    for x, y in micro_batches:
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
# --8<-- [end:naive_accumulation]


# --8<-- [start:naive_amp]
def naive_amp(device_type: str, use_amp: bool) -> tuple[torch.dtype, bool]:
    """`autocast(device_type)` with its default dtype, plus a scaler on one flag.

    The dtype silently depends on the device (bf16 on CPU, fp16 on CUDA) and the
    scaler does not follow it: on CPU this scales bf16 losses that never underflow.
    """
    dtype = torch.get_autocast_dtype(device_type)  # what autocast(device_type) uses
    scaler = torch.amp.GradScaler(device_type, enabled=use_amp)
    return dtype, scaler.is_enabled()
# --8<-- [end:naive_amp]


# --8<-- [start:naive_timer]
def naive_time_ms(fn: Any) -> float:
    """Host clock around asynchronous device work: measures the launch only."""
    import time

    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000.0
# --8<-- [end:naive_timer]


# --8<-- [start:naive_item]
def naive_step_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                    optimizer: torch.optim.Optimizer) -> float:
    """Returns a Python float every step: `.item()` waits for the device."""
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()
# --8<-- [end:naive_item]


# --8<-- [start:naive_no_scheduler]
def naive_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer,
                     step: int) -> dict[str, Any]:
    """Claims to be complete, but the schedule's position is missing."""
    return {"step": step, "model": model.state_dict(),
            "optimizer": optimizer.state_dict()}
# --8<-- [end:naive_no_scheduler]


# --8<-- [start:naive_backend]
def naive_init() -> None:
    """Hard-codes NCCL: fails on any machine without CUDA, CPU notebooks included."""
    dist.init_process_group(backend="nccl", init_method="env://")
# --8<-- [end:naive_backend]


# ------------------------------------------------------------------ demonstrations
# Each `demo_*` section ends a pasted block: it runs the naive version and the fix and
# prints one line, `naive: ...; fixed: ...`. Helpers shared by several demos have their own
# sections, shown in the blocks that need them.

# --8<-- [start:fixed_digest]
def fixed_digest(fields: dict[str, Any]) -> str:
    """sha256 of canonical JSON, as `TrainConfig.digest`: the same bytes in every process."""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def in_fresh_interpreter(fn: Callable[[Any], str], arg: Any, hash_seed: int) -> str:
    """`fn(arg)` in a new Python with its own hash salt (a forked child would share ours).

    The function travels as its compiled code, so a notebook's functions work too; it may
    use only builtins, `json` and `hashlib`.
    """
    child = ("import hashlib, json, marshal, sys, types\n"
             "fn = types.FunctionType(marshal.loads(sys.stdin.buffer.read()), globals())\n"
             "print(fn(json.loads(sys.argv[1])))\n")
    done = subprocess.run([sys.executable, "-c", child, json.dumps(arg)], input=marshal.dumps(fn.__code__),
                          capture_output=True, check=True, timeout=60,
                          env={**os.environ, "PYTHONHASHSEED": str(hash_seed)})
    return done.stdout.decode().strip()
# --8<-- [end:fixed_digest]


# --8<-- [start:demo_digest]
def demo_digest() -> None:
    """The same config's digest in two interpreters, as two launches of one job see it."""
    fields = {"model": "mlp", "lr": 0.003, "seed": 0, "max_steps": 200}
    naive = [in_fresh_interpreter(naive_digest, fields, seed)[:8] for seed in (1, 2)]
    fixed = [in_fresh_interpreter(fixed_digest, fields, seed)[:8] for seed in (1, 2)]
    verdict = {True: "equal", False: "differ"}
    print(f"naive: digests {naive[0]}.. and {naive[1]}.. ({verdict[naive[0] == naive[1]]}); "
          f"fixed: digests {fixed[0]}.. and {fixed[1]}.. ({verdict[fixed[0] == fixed[1]]})")


if __name__ == "__main__":
    demo_digest()
# --8<-- [end:demo_digest]


# --8<-- [start:demo_sampler]
def demo_sampler() -> None:
    """Train 3 batches of 4 under 2 workers that prefetch 2 batches each; read the progress."""
    naive = CountingInIterSampler(64, world_size=1, rank=0)
    fixed = ResumableDistributedSampler(64, world_size=1, rank=0, global_batch_size=4)
    for sampler in (naive, fixed):
        loader = DataLoader(TensorDataset(torch.arange(64)), batch_size=4, sampler=sampler,
                            num_workers=2, prefetch_factor=2)
        batches = iter(loader)
        for _ in range(3):
            next(batches)  # ... forward, backward, optimizer step ...
            if sampler is fixed:
                fixed.commit(4)  # only now are these 4 samples trained
        del batches
    print(f"naive: progress {naive.state_dict()['consumed']} after 12 trained samples; "
          f"fixed: progress {fixed.state_dict()['consumed']} after 12 trained samples")


if __name__ == "__main__":
    demo_sampler()
# --8<-- [end:demo_sampler]


# --8<-- [start:demo_rng_checkpoint]
def demo_rng_checkpoint() -> None:
    """Save the RNG states both ways, load each with torch.load's default, draw from NumPy."""
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(naive_rng_state(), f"{tmp}/naive.pt")
        try:
            naive_load(f"{tmp}/naive.pt")
            naive = "loaded"
        except Exception as exc:  # noqa: BLE001 - the error is the demonstration
            naive = f"{type(exc).__name__}: {str(exc).split('.')[0]}"
        np.random.seed(0)
        torch.save(rng_state(), f"{tmp}/fixed.pt")
        expected = np.random.rand(3)
        np.random.seed(1)  # the restart: another stream
        set_rng_state(torch.load(f"{tmp}/fixed.pt"))  # weights_only=True, the default
        same = bool(np.array_equal(np.random.rand(3), expected))
    print(f"naive: {naive}; fixed: loaded, NumPy stream restored: {same}")


if __name__ == "__main__":
    demo_rng_checkpoint()
# --8<-- [end:demo_rng_checkpoint]


# --8<-- [start:run_ranks]
def run_ranks(world_size: int, fn: Callable[[int], Any], timeout_s: float = 60.0) -> list[Any]:
    """Run `fn(rank)` on `world_size` forked ranks of one gloo group; return what each returned.

    Forked, not spawned: a spawned child imports its function by module name, and a
    notebook's functions live in no module. Each child uses one thread (forked ranks that
    share the parent's thread pool can hang), and a fresh FileStore per call is this
    attempt's own rendezvous, so nothing left by an earlier attempt is read as a peer.
    """
    with tempfile.TemporaryDirectory() as tmp:
        sys.stdout.flush()  # or each child would print what the parent had buffered
        pids = []
        for rank in range(world_size):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    torch.set_num_threads(1)
                    dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store", world_size),
                                            rank=rank, world_size=world_size)
                    Path(tmp, f"rank{rank}.json").write_text(json.dumps(fn(rank)))
                    dist.barrier()
                    code = 0
                except BaseException:  # noqa: BLE001 - reported, then the exit code says it
                    traceback.print_exc()
                finally:
                    sys.stdout.flush()
                    os._exit(code)  # no teardown, and not the parent's atexit handlers
            pids.append(pid)
        deadline = time.monotonic() + timeout_s
        failed = []
        for pid in pids:
            while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    continue
                time.sleep(0.01)
            if os.waitstatus_to_exitcode(done[1]) != 0:
                failed.append(pid)
        if failed:
            raise RuntimeError(f"{len(failed)} of {world_size} ranks failed")
        return [json.loads(Path(tmp, f"rank{rank}.json").read_text()) for rank in range(world_size)]
# --8<-- [end:run_ranks]


# --8<-- [start:demo_rank0_save]
def demo_rank0_save() -> None:
    """Two ranks seeded differently save, restart with another seed, restore and draw."""
    with tempfile.TemporaryDirectory() as root:
        def rank_draws(rank: int) -> list[float]:
            model, draws = nn.Linear(2, 2), []
            torch.manual_seed(100 + rank)  # each rank its own stream
            naive_rank0_save(f"{root}/naive.pt", model)
            torch.manual_seed(999)  # the restart: an unrelated stream
            naive_rank0_restore(f"{root}/naive.pt", model)
            draws.append(torch.rand(1).item())
            torch.manual_seed(100 + rank)
            save(f"{root}/fixed", 1, {"model": model}, rank)
            dist.barrier()  # rank 0 renames after the others have written: wait for it
            torch.manual_seed(999)
            restore(f"{root}/fixed", {"model": model}, rank)
            draws.append(torch.rand(1).item())
            return draws

        (naive0, fixed0), (naive1, fixed1) = run_ranks(2, rank_draws)
    same = {True: "the same stream", False: "each its own stream"}
    print(f"naive: rank 0 draws {naive0:.4f}, rank 1 draws {naive1:.4f} ({same[naive0 == naive1]}); "
          f"fixed: rank 0 draws {fixed0:.4f}, rank 1 draws {fixed1:.4f} ({same[fixed0 == fixed1]})")


if __name__ == "__main__":
    demo_rank0_save()
# --8<-- [end:demo_rank0_save]


# --8<-- [start:group_of_one]
@contextmanager
def group_of_one() -> Iterator[None]:
    """A gloo process group of one rank, so collectives and DDP run in this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
# --8<-- [end:group_of_one]


# --8<-- [start:demo_in_place_save]
@contextmanager
def file_size_limit(nbytes: int) -> Iterator[None]:
    """Writes past `nbytes` fail part-way (EFBIG), as on a full disk or a kill mid-write."""
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an error, not a killed kernel
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def demo_in_place_save() -> None:
    """Save step 1 whole, crash while saving step 2, then restart from the newest checkpoint."""
    model = nn.Linear(256, 256)  # 257 KiB of weights: step 2's write dies at 64 KiB
    with tempfile.TemporaryDirectory() as root, group_of_one():
        naive_save({"model": model.state_dict()}, root, 1)
        save(f"{root}/fixed", 1, {"model": model}, 0)
        with file_size_limit(64 * 1024):
            for write in (lambda: naive_save({"model": model.state_dict()}, root, 2),
                          lambda: save(f"{root}/fixed", 2, {"model": model}, 0)):
                with contextlib.suppress(Exception):  # the crash
                    write()
        newest = naive_latest(root)
        assert newest is not None
        try:
            torch.load(newest, weights_only=True)
            naive = f"{newest.name} loads"
        except Exception as exc:  # noqa: BLE001 - the error is the demonstration
            naive = f"newest {newest.name} is torn: {type(exc).__name__}: {str(exc).splitlines()[0][:60]}"
        step = restore(f"{root}/fixed", {"model": nn.Linear(256, 256)}, 0)
    print(f"naive: {naive}; fixed: step 2 never published, resumes from step {step}")


if __name__ == "__main__":
    demo_in_place_save()
# --8<-- [end:demo_in_place_save]


# --8<-- [start:demo_accumulation]
def accumulating_step(model: DDP, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                      optimizer: torch.optim.Optimizer) -> None:
    """One optimizer step over G micro-batches: loss / G, gradients synced on the last only."""
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            (nn.functional.cross_entropy(model(x), y) / len(micro_batches)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def demo_accumulation() -> None:
    """Count DDP's gradient all-reduces and the optimizer steps for 2 micro-batches."""
    results = {}
    with group_of_one():
        for name, step in (("naive", naive_accumulating_step), ("fixed", accumulating_step)):
            torch.manual_seed(0)
            model = DDP(nn.Linear(8, 4))
            allreduces: list[int] = []
            steps: list[int] = []

            def count(state, bucket, allreduces=allreduces):  # unannotated: DDP checks hooks' annotations
                allreduces.append(bucket.index())  # one rank: the all-reduce is the identity
                done = torch.futures.Future()
                done.set_result(bucket.buffer())
                return done

            model.register_comm_hook(None, count)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            optimizer.register_step_post_hook(lambda *_, steps=steps: steps.append(1))
            micro = [(torch.randn(4, 8), torch.randint(0, 4, (4,))) for _ in range(2)]
            step(model, micro, optimizer)
            results[name] = (f"{len(allreduces)} all-reduce{'s' * (len(allreduces) != 1)}, "
                             f"{len(steps)} optimizer step{'s' * (len(steps) != 1)}")
    print(f"naive: {results['naive']} for 2 micro-batches; fixed: {results['fixed']} for 2 micro-batches")


if __name__ == "__main__":
    demo_accumulation()
# --8<-- [end:demo_accumulation]


# --8<-- [start:demo_amp]
def demo_amp() -> None:
    """What autocast and the scaler do with one flag, and with an explicit precision."""
    here, other = ("cuda", "cpu") if torch.cuda.is_available() else ("cpu", "cuda")
    dtype, scaled = naive_amp(here, use_amp=True)
    fixed = []
    for precision in ("bf16", "fp16"):
        cfg = SimpleNamespace(precision=precision, fp16_init_scale=2.0**16)
        scaler = build_scaler(cfg, torch.device(here))  # type: ignore[arg-type]
        fixed.append(f"{precision} -> {AUTOCAST_DTYPES[precision]} scaler {scaler is not None}")
    print(f"naive: {here} -> {dtype} scaler {scaled} ({other} would give "
          f"{torch.get_autocast_dtype(other)}); fixed: {', '.join(fixed)}")


if __name__ == "__main__":
    demo_amp()
# --8<-- [end:demo_amp]


# --8<-- [start:demo_timer]
def demo_timer() -> None:
    """Time the same device work with the host clock and with events."""
    if torch.cuda.is_available():
        x = torch.randn(4096, 4096, device="cuda")
        torch.cuda.synchronize()
        naive_ms = naive_time_ms(lambda: [x @ x for _ in range(20)])
        timer = PhaseTimer(torch.device("cuda"))
        with timer.phase("forward"):
            _ = [x @ x for _ in range(20)]
        fixed_ms, how = timer.flush()["forward"] * 1000.0, "PhaseTimer, CUDA events"
    else:  # a CPU computes synchronously: simulate a stream, whose calls return once queued
        stream = ThreadPoolExecutor(max_workers=1)  # runs work in order, like a CUDA stream
        naive_ms = naive_time_ms(lambda: stream.submit(time.sleep, 0.2))
        stream.submit(lambda: None).result()  # synchronize
        start = stream.submit(time.perf_counter)  # an event: stamped when the stream reaches it
        stream.submit(time.sleep, 0.2)
        end = stream.submit(time.perf_counter)
        fixed_ms, how = (end.result() - start.result()) * 1000.0, "events on a simulated stream"
        stream.shutdown()
    print(f"naive: {naive_ms:.1f} ms (the launch); fixed: {fixed_ms:.1f} ms ({how})")


if __name__ == "__main__":
    demo_timer()
# --8<-- [end:demo_timer]


# --8<-- [start:demo_item]
HOST_READS = ("item", "tolist", "numpy", "__float__", "__int__", "__bool__")


@contextmanager
def counting_host_reads() -> Iterator[list[str]]:
    """Count every tensor method that copies a value to the host (a device sync on a GPU)."""
    calls: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counted(name: str) -> Any:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return originals[name](self, *args, **kwargs)
        return read

    for name in HOST_READS:
        setattr(torch.Tensor, name, counted(name))
    try:
        yield calls
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)


def step_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
              optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """Returns the loss on the device, without its graph: nothing waits for it."""
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def demo_item(steps: int = 10, log_every: int = 5) -> None:
    """Count host reads over `steps` steps: every step, or only on log steps."""
    x, y = torch.randn(8, 4), torch.arange(8) % 3
    model = nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with counting_host_reads() as naive:
        for _ in range(steps):
            naive_step_loss(model, x, y, optimizer)
    with counting_host_reads() as fixed:
        for step in range(1, steps + 1):
            loss = step_loss(model, x, y, optimizer)
            if step % log_every == 0:
                loss.item()  # the log line
    print(f"naive: {len(naive)} host syncs in {steps} steps; fixed: {len(fixed)} host syncs "
          f"in {steps} steps (one per log step)")


if __name__ == "__main__":
    demo_item()
# --8<-- [end:demo_item]


# --8<-- [start:demo_no_scheduler]
def demo_no_scheduler() -> None:
    """Train 5 steps of a 10-step warmup, checkpoint, restart, and read step 6's rate."""
    cfg = SimpleNamespace(warmup_steps=10, max_steps=100, min_lr_ratio=0.1)

    def fresh() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        model = nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        return model, optimizer, build_scheduler(optimizer, cfg)  # type: ignore[arg-type]

    model, optimizer, scheduler = fresh()
    for _ in range(5):
        optimizer.step()
        scheduler.step()
    checkpoint = naive_checkpoint(model, optimizer, step=5)
    rates = {}
    for name, scheduler_state in (("naive", None), ("fixed", scheduler.state_dict())):
        model, optimizer, resumed = fresh()  # the restart
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        if scheduler_state is not None:
            resumed.load_state_dict(scheduler_state)
        optimizer.step()
        resumed.step()
        rates[name] = resumed.get_last_lr()[0]
    expected = lr_multiplier(6, cfg)  # type: ignore[arg-type]
    print(f"naive: lr {rates['naive']:.2f} at step 6 (without a restart {expected:.2f}); "
          f"fixed: lr {rates['fixed']:.2f} at step 6")


if __name__ == "__main__":
    demo_no_scheduler()
# --8<-- [end:demo_no_scheduler]


# --8<-- [start:demo_backend]
def free_port() -> int:
    """A TCP port nobody listens on now, for this attempt's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def demo_backend() -> None:
    """Start a one-rank group the way torchrun describes it: NCCL always, then by device."""
    saved = dict(os.environ)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    try:
        try:
            naive_init()
            naive = f"started {dist.get_backend()}"
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - the error is the demonstration
            naive = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        os.environ["MASTER_PORT"] = str(free_port())
        ctx = init_distributed()
        fixed = f"started {ctx.backend} on {ctx.device}"
        dist.destroy_process_group()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    print(f"naive: {naive}; fixed: {fixed}")


if __name__ == "__main__":
    demo_backend()
# --8<-- [end:demo_backend]


# ------------------------------------------------------------------ multi-process helpers
# torch.multiprocessing sends a worker to its process by reference, so the workers live
# here, importable (a function defined inside a test or a notebook cell cannot be sent).

@contextmanager
def _gloo_group(rank: int, world_size: int, port: int) -> Iterator[None]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    clean = False
    try:
        yield
        clean = True
    finally:
        destroy(clean)


def rank0_rng_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Seed each rank differently, save, scramble, restore, draw: naive way, then ours."""
    import io

    from reference_impl.checkpoint import CheckpointManager
    from reference_impl.config import TrainConfig
    from reference_impl.distributed import DistContext
    from reference_impl.metrics import EventLog
    from reference_impl.train import build_state

    with _gloo_group(rank, world_size, port):
        result = {}
        torch.manual_seed(100 + rank)
        model = nn.Linear(2, 2)
        expected = torch.get_rng_state()
        naive_rank0_save(Path(out_dir) / "naive.pt", model)
        torch.manual_seed(999)  # the restart: a fresh process with an unrelated RNG
        naive_rank0_restore(Path(out_dir) / "naive.pt", model)
        result["naive"] = {"restored_own_stream": torch.equal(torch.get_rng_state(), expected),
                           "draw": torch.rand(4).tolist()}

        cfg = TrainConfig(world_size=world_size, dataset_size=256, checkpoint_dir=str(Path(out_dir) / "ours"))
        ctx = DistContext(rank, rank, world_size, torch.device("cpu"), "gloo")
        log = EventLog(rank, stream=io.StringIO())
        state = build_state(cfg, ctx)
        state.step = 1
        state.sampler.commit(cfg.global_batch_size)  # as one trained step leaves it: a restore checks
        torch.manual_seed(100 + rank)
        expected = torch.get_rng_state()
        ckpt = CheckpointManager(Path(out_dir) / "ours", log)
        ckpt.save(state, cfg, ctx)
        torch.manual_seed(999)
        ckpt.restore(build_state(cfg, ctx), cfg, ctx)
        result["ours"] = {"restored_own_stream": torch.equal(torch.get_rng_state(), expected),
                          "draw": torch.rand(4).tolist()}
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))


def ddp_allreduce_count_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Count DDP's gradient all-reduces for one global step of 2 micro-batches, both ways."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from reference_impl.parallel.registry import gradient_sync

    with _gloo_group(rank, world_size, port):
        result = {}
        for mode in ("naive", "ours"):
            torch.manual_seed(0)
            model = DDP(nn.Linear(8, 4))
            calls: list[int] = []

            def counting_hook(state, bucket, calls=calls):  # unannotated: DDP checks annotations
                calls.append(bucket.index())
                fut = dist.all_reduce(bucket.buffer().div_(world_size), async_op=True).get_future()
                return fut.then(lambda f: f.value()[0])

            model.register_comm_hook(None, counting_hook)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            gen = torch.Generator().manual_seed(rank)
            micro = [(torch.randn(4, 8, generator=gen), torch.randint(0, 4, (4,), generator=gen))
                     for _ in range(2)]
            if mode == "naive":
                naive_accumulating_step(model, micro, optimizer)
                steps = len(micro)
            else:
                for i, (x, y) in enumerate(micro):
                    with gradient_sync(model, enabled=i == len(micro) - 1):
                        (nn.functional.cross_entropy(model(x), y) / len(micro)).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                steps = 1
            result[mode] = {"allreduces": len(calls), "optimizer_steps": steps}
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
        # Skip teardown: gloo work launched from a Python comm hook keeps a Python object in
        # its thread-local state, and destroying the group can then deadlock on the GIL
        # (seen about 1 run in 25). The result is on disk; exit once every rank has written.
        dist.barrier()
        os._exit(0)

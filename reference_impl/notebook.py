"""The interview trainer in one file, in the cells a candidate types, importing only the
standard library, torch and numpy: it runs in a blank Colab notebook or under torchrun.
Each `--8<--` section is a notebook cell; the site's notebook is generated from them.

    python -m reference_impl.notebook --max-steps 40
    torchrun --standalone --nproc-per-node 2 -m reference_impl.notebook --checkpoint-dir /tmp/run

With the same settings its losses and final `state_digest` equal the package trainer's
(`python -m reference_impl.train --model mlp`): see tests/test_notebook.py.
"""

# --8<-- [start:config]
# Cell 1: configuration. The global batch is the hyper-parameter; accumulation is derived
# from it and the world size, so 2 GPUs and 8 GPUs optimise the same objective.
import argparse
import dataclasses
import hashlib
import json
import math
import os
import tempfile


@dataclasses.dataclass(frozen=True)
class Config:
    max_steps: int = 40            # optimizer steps in total, across restarts
    global_batch_size: int = 64    # samples per optimizer step, all ranks together
    micro_batch_size: int = 16     # samples per rank per forward/backward
    lr: float = 3e-3               # peak learning rate (AdamW), after linear warmup
    warmup_steps: int = 5
    min_lr_ratio: float = 0.1      # cosine decay ends at lr * min_lr_ratio
    grad_clip: float = 1.0         # global gradient-norm clip; 0 disables it
    precision: str = "bf16"        # bf16 autocast | fp16 autocast + GradScaler | fp32
    seed: int = 0
    dataset_size: int = 4096
    input_dim: int = 32
    hidden_dim: int = 128
    num_classes: int = 10
    log_every: int = 10
    checkpoint_dir: str = ""       # "" = a fresh temporary directory for this run
    checkpoint_every: int = 20     # 0 = only at the end
    keep_last: int = 2
    pg_timeout_s: float = 120.0    # a hung collective fails after this long, not never
    fail_at_step: int = 0          # fault injection: SIGKILL before this step (first attempt)
    fail_rank: int = 0

    def __post_init__(self):
        for name in ("max_steps", "global_batch_size", "micro_batch_size", "dataset_size",
                     "input_dim", "hidden_dim", "num_classes", "log_every", "keep_last"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.precision not in ("bf16", "fp16", "fp32"):
            raise ValueError(f"precision must be bf16, fp16 or fp32 (got {self.precision!r})")
        if not 0 <= self.seed < 2**31 or self.checkpoint_every < 0 or self.warmup_steps < 0:
            raise ValueError("seed must be in [0, 2**31); checkpoint_every, warmup_steps >= 0")
        if not (self.lr > 0 and math.isfinite(self.lr) and self.pg_timeout_s > 0):
            raise ValueError("lr and pg_timeout_s must be positive and finite")
        if not (0 <= self.min_lr_ratio <= 1 and 0 <= self.grad_clip < math.inf):  # NaN fails both
            raise ValueError("min_lr_ratio must be in [0, 1] and grad_clip a finite number >= 0")
        if self.dataset_size < self.global_batch_size:
            raise ValueError(f"dataset_size {self.dataset_size} is smaller than one global batch")

    def grad_accum_steps(self, world_size: int) -> int:
        per_pass = self.micro_batch_size * world_size
        if self.global_batch_size % per_pass:
            raise ValueError(f"global_batch_size {self.global_batch_size} is not a multiple of "
                             f"micro_batch_size x world size = {per_pass}")
        return self.global_batch_size // per_pass

    def digest(self) -> str:
        """sha256 of the fields that decide what a step computes (never Python's salted hash())."""
        operational = {"micro_batch_size", "log_every", "checkpoint_dir", "checkpoint_every",
                       "keep_last", "pg_timeout_s", "fail_at_step", "fail_rank"}
        math_fields = {k: v for k, v in dataclasses.asdict(self).items() if k not in operational}
        return hashlib.sha256(json.dumps(math_fields, sort_keys=True).encode()).hexdigest()


def parse_config(argv: list[str] | None = None) -> Config:
    """Flags named like the fields (--max-steps 80); unknown ones, like a kernel's, are ignored."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    for f in dataclasses.fields(Config):
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    cfg = Config(**vars(parser.parse_known_args(argv)[0]))
    if os.path.exists(cfg.checkpoint_dir) and not os.path.isdir(cfg.checkpoint_dir):
        raise ValueError(f"checkpoint_dir {cfg.checkpoint_dir} exists and is not a directory")
    cfg.grad_accum_steps(int(os.environ.get("WORLD_SIZE", 1)))  # fail before any group starts
    if not cfg.checkpoint_dir:  # torchrun's run id is the same on every rank and every restart
        run_id = os.environ.get("TORCHELASTIC_RUN_ID")
        path = (os.path.join(tempfile.gettempdir(), f"interview-{run_id}") if run_id
                else tempfile.mkdtemp(prefix="interview-"))
        cfg = dataclasses.replace(cfg, checkpoint_dir=path)
    return cfg
# --8<-- [end:config]


# --8<-- [start:rank_wiring]
# Cell 2: rank wiring. torchrun exports RANK, LOCAL_RANK and WORLD_SIZE; without them this is
# one process and no group. Rank picks the data shard, local rank picks the GPU.
import datetime

import torch
import torch.distributed as dist


@dataclasses.dataclass
class Ranks:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device


def init_ranks(cfg: Config) -> Ranks:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)  # before the group starts, so NCCL binds the right GPU
    if world > 1:
        store = None
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun keeps one store across restarts: a per-attempt prefix stops a restarted
            # rank from reading the address of a peer that died in the previous attempt.
            base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                 world, is_master=False)
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            store = dist.PrefixStore(f"attempt_{attempt}", base)
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=cfg.pg_timeout_s))
    return Ranks(rank, local_rank, world, device)
# --8<-- [end:rank_wiring]


# --8<-- [start:dataset]
# Cell 3: data that is a pure function of the seed. A resumed or resharded run sees exactly
# the samples an uninterrupted one would, and nothing is downloaded.
from torch.utils.data import DataLoader, Dataset, Sampler


class TeacherDataset(Dataset):
    """Gaussian inputs labelled by a fixed random linear teacher: learnable, not trivial."""

    def __init__(self, cfg: Config):
        gen = torch.Generator().manual_seed(cfg.seed)
        self.x = torch.randn(cfg.dataset_size, cfg.input_dim, generator=gen)
        teacher = torch.randn(cfg.input_dim, cfg.num_classes, generator=gen)
        self.y = (self.x @ teacher).argmax(dim=1)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]
# --8<-- [end:dataset]


# --8<-- [start:sampler]
# Cell 4: the sampler, where distributed correctness lives.
class ResumableSampler(Sampler):
    """One seeded permutation per epoch, the same on every rank. Optimizer step k trains the
    block perm[k*B:(k+1)*B] (B = global batch) and rank r takes every world_size-th index of
    it; the tail (N mod B) is dropped, so no sample repeats within an epoch. `consumed` moves
    only in commit(), after the optimizer step, never while the DataLoader prefetches."""

    def __init__(self, n: int, global_batch: int, rank: int, world_size: int, seed: int):
        self.n, self.batch, self.rank, self.world, self.seed = n, global_batch, rank, world_size, seed
        self.steps_per_epoch = n // global_batch
        self.epoch, self.consumed = 0, 0

    def set_epoch(self, epoch: int):
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0

    def commit(self):
        self.consumed += self.batch

    def __iter__(self):
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        perm = torch.randperm(self.n, generator=gen)
        return iter(perm[self.consumed + self.rank:self.steps_per_epoch * self.batch:self.world].tolist())

    def __len__(self):
        return (self.steps_per_epoch * self.batch - self.consumed) // self.world

    def state_dict(self):
        return {"epoch": self.epoch, "consumed": self.consumed}  # a copy, never a live view

    def load_state_dict(self, state):
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
# --8<-- [end:sampler]


# --8<-- [start:model]
# Cell 5: the model, identical on every rank, then the DDP wrap (gradients all-reduced in
# buckets that overlap the backward pass).
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class MLP(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        h = cfg.hidden_dim
        self.net = nn.Sequential(nn.Linear(cfg.input_dim, h), nn.GELU(), nn.Linear(h, h), nn.GELU(),
                                 nn.Linear(h, cfg.num_classes))

    def forward(self, x):
        return self.net(x)


def build_model(cfg: Config, ranks: Ranks) -> nn.Module:
    with torch.random.fork_rng(devices=[]):  # seeded weights; the global RNG stream is untouched
        torch.manual_seed(cfg.seed)
        model = MLP(cfg).to(ranks.device)
    if ranks.world_size == 1:
        return model
    return DDP(model, device_ids=[ranks.local_rank] if ranks.device.type == "cuda" else None)
# --8<-- [end:model]


# --8<-- [start:train_step]
# Cell 6: one optimizer step: G micro-batches, gradients synced once, clip, step, schedule.
import contextlib

import torch.nn.functional as F

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def lr_factor(step: int, cfg: Config) -> float:
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def train_step(model, batches, optimizer, scheduler, scaler, cfg, accum, device, timer):
    """Returns the step's mean loss as a device tensor: reading it would sync, so only log steps do."""
    total = torch.zeros((), device=device)
    for micro in range(accum):
        with timer.phase("data"):
            x, y = (t.to(device, non_blocking=True) for t in next(batches))
        last = micro == accum - 1  # only the last micro-batch all-reduces
        with contextlib.nullcontext() if last or not isinstance(model, DDP) else model.no_sync():
            with timer.phase("forward"), torch.autocast(device.type, dtype=AUTOCAST.get(cfg.precision),
                                                        enabled=cfg.precision != "fp32"):
                loss = F.cross_entropy(model(x).float(), y) / accum  # 1/G: the sum is the mean
            with timer.phase("backward"):
                scaler.scale(loss).backward()  # the scaler is a no-op unless fp16
        total += loss.detach()
    with timer.phase("optimizer"):
        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        scaler.step(optimizer)  # fp16: skipped when a gradient overflowed
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return total
# --8<-- [end:train_step]


# --8<-- [start:timing]
# Cell 7: where the time goes, without a device sync per step. On a GPU the host clock
# would time kernel launches, so CUDA events bracket each phase and flush() waits once.
import collections
import time


class PhaseTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.pending: list[tuple] = []  # (phase, start event, end event), read at flush

    @contextlib.contextmanager
    def phase(self, name: str):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.pending.append((name, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.seconds[name] += time.perf_counter() - t0

    def flush(self) -> dict:
        if self.pending:
            torch.cuda.synchronize()
            for name, start, end in self.pending:
                self.seconds[name] += start.elapsed_time(end) / 1e3
        out = {name: round(s * 1e3, 3) for name, s in self.seconds.items()}
        self.seconds.clear()
        self.pending.clear()
        return out
# --8<-- [end:timing]


# --8<-- [start:checkpoint]
# Cell 8: the checkpoint: everything the next step depends on, each rank's RNG included.
# Written under a temporary name, fsynced, hashed into a manifest, renamed into place: a
# crash leaves no checkpoint rather than a torn one. Restore verifies before it trusts.
import io
import random
import shutil

import numpy as np


def rng_state() -> dict:
    # NumPy's state holds an ndarray that weights_only loading refuses: store tensors and ints.
    _, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": [torch.from_numpy(np.asarray(keys, dtype=np.int64)), pos, has_gauss, cached]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict):
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state(("MT19937", keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _write(path: str, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename can publish it
    return hashlib.sha256(data).hexdigest()


def _fsync_dir(path: str):
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def barrier(ranks: Ranks):
    if ranks.world_size > 1:
        dist.barrier()


def save_checkpoint(step: int, parts: dict, cfg: Config, ranks: Ranks):
    root = cfg.checkpoint_dir
    tmp, final = os.path.join(root, f".tmp-step-{step:08d}"), os.path.join(root, f"step-{step:08d}")
    if ranks.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # debris of a crash during an earlier save
        os.makedirs(tmp)
    barrier(ranks)
    files: dict[str, dict] = {f"rank-{ranks.rank:05d}.pt": {"rng": rng_state()}}
    if ranks.rank == 0:
        files["train.pt"] = {"step": step, **{name: part.state_dict() for name, part in parts.items()}}
    hashes = {}
    for name, obj in files.items():
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        hashes[name] = _write(os.path.join(tmp, name), buffer.getvalue())
    gathered = [hashes] * ranks.world_size
    if ranks.world_size > 1:
        dist.all_gather_object(gathered, hashes)  # also a barrier: every rank's files are on disk
    if ranks.rank == 0:
        manifest = {"step": step, "world_size": ranks.world_size, "config_digest": cfg.digest(),
                    "files": {name: h for part in gathered for name, h in part.items()}}
        _write(os.path.join(tmp, "manifest.json"), json.dumps(manifest).encode())
        _fsync_dir(tmp)
        if os.path.islink(final) or os.path.isfile(final):
            os.unlink(final)
        elif os.path.isdir(final):  # only an invalid one can be here: a valid one was resumed
            shutil.rmtree(final)
        os.rename(tmp, final)  # the commit point
        _fsync_dir(root)
        steps = sorted(d for d in os.listdir(root) if d.startswith("step-") and os.path.isdir(
            os.path.join(root, d)) and not os.path.islink(os.path.join(root, d)))
        for old in steps[:-cfg.keep_last]:
            shutil.rmtree(os.path.join(root, old))
        log("checkpoint_saved", step=step, path=final)
    barrier(ranks)


def verify(path: str) -> dict:
    """The manifest of a complete, intact checkpoint; ValueError says why it is not one."""
    if os.path.islink(path):
        raise ValueError("a symlink, not a checkpoint directory")
    with open(os.path.join(path, "manifest.json"), "rb") as f:
        manifest = json.loads(f.read())
    if f"step-{manifest['step']:08d}" != os.path.basename(path):
        raise ValueError("the manifest's step does not match the directory name")
    files, world = manifest["files"], manifest["world_size"]
    if not {"train.pt", *(f"rank-{r:05d}.pt" for r in range(world))} <= set(files):
        raise ValueError("the manifest does not list every part")
    for name, expected in files.items():
        file = os.path.join(path, name)
        if os.path.basename(file) != name or os.path.islink(file) or not os.path.isfile(file):
            raise ValueError(f"{name!r} is not a file inside the checkpoint")
        with open(file, "rb") as f:
            if hashlib.sha256(f.read()).hexdigest() != expected:
                raise ValueError(f"{name} fails its sha256 check")
    return manifest


def restore_checkpoint(parts: dict, cfg: Config, ranks: Ranks) -> int:
    """Load the newest valid checkpoint into `parts` and return its step (0 if there is none)."""
    choice: list[dict] = [{}]
    if ranks.rank == 0 and os.path.isdir(cfg.checkpoint_dir):
        for name in sorted((d for d in os.listdir(cfg.checkpoint_dir) if d.startswith("step-")), reverse=True):
            path = os.path.join(cfg.checkpoint_dir, name)
            try:
                manifest = verify(path)
            except (OSError, ValueError, TypeError, KeyError) as exc:  # torn, corrupt, odd: fall back
                log("checkpoint_skipped", path=path, reason=f"{type(exc).__name__}: {exc}")
                continue
            choice = [{"path": path, "world_size": manifest["world_size"]}]
            if manifest.get("config_digest") != cfg.digest():  # never resume another run's state
                choice = [{"error": f"{path} was written with another config: use a new --checkpoint-dir"}]
            break
    if ranks.world_size > 1:
        dist.broadcast_object_list(choice, src=0)  # every rank restores the same step, or none
    if "error" in choice[0]:
        raise SystemExit(choice[0]["error"])
    if not choice[0]:
        return 0
    path = choice[0]["path"]
    saved = torch.load(os.path.join(path, "train.pt"), map_location="cpu", weights_only=True)
    for name, part in parts.items():
        part.load_state_dict(saved[name])
    if choice[0]["world_size"] == ranks.world_size:
        rank_file = os.path.join(path, f"rank-{ranks.rank:05d}.pt")
        set_rng_state(torch.load(rank_file, map_location="cpu", weights_only=True)["rng"])
    else:  # another world size: no saved stream belongs to this rank
        torch.manual_seed(cfg.seed + ranks.rank + 7919 * saved["step"])
    log("checkpoint_restored", step=saved["step"], path=path)
    return saved["step"]
# --8<-- [end:checkpoint]


# --8<-- [start:resume_loop]
# Cell 9: the loop. It resumes from the newest valid checkpoint, trains to max_steps, and
# ends with a digest of every weight and optimizer value: two runs that should be
# identical print the same one. torchrun --max-restarts reruns exactly this after a crash.
import signal

from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.optim.lr_scheduler import LambdaLR


def log(event: str, **fields):
    if int(os.environ.get("RANK", 0)) == 0:  # progress from rank 0 only: N ranks, one copy
        print(json.dumps({"event": event, **fields}), flush=True)


def state_digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))
    h = hashlib.sha256()

    def update(prefix, value):  # every value in sorted-key order, tensors as raw bytes
        if isinstance(value, dict):
            for key in sorted(value, key=str):
                update(f"{prefix}.{key}", value[key])
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                update(f"{prefix}.{i}", item)
        elif isinstance(value, torch.Tensor):
            flat = value.detach().cpu().contiguous().reshape(-1)
            h.update(f"{prefix}:{value.dtype}:{tuple(value.shape)}".encode())
            h.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
        else:
            h.update(f"{prefix}={json.dumps(value, default=str)}".encode())
    update("model", model_sd)
    update("optim", optim_sd)
    return h.hexdigest()


def train(cfg: Config) -> dict:
    ranks = init_ranks(cfg)
    try:
        accum = cfg.grad_accum_steps(ranks.world_size)
        torch.manual_seed(cfg.seed + ranks.rank)  # a per-rank stream (dropout); weights seed apart
        dataset = TeacherDataset(cfg)
        sampler = ResumableSampler(len(dataset), cfg.global_batch_size, ranks.rank, ranks.world_size, cfg.seed)
        loader = DataLoader(dataset, batch_size=cfg.micro_batch_size, sampler=sampler,
                            generator=torch.Generator().manual_seed(cfg.seed + ranks.rank))
        model = build_model(cfg, ranks)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
        scheduler = LambdaLR(optimizer, lambda s: lr_factor(s, cfg))
        scaler = torch.amp.GradScaler(ranks.device.type, enabled=cfg.precision == "fp16")
        parts = {"model": getattr(model, "module", model), "optimizer": optimizer,
                 "scheduler": scheduler, "scaler": scaler, "sampler": sampler}
        step, timer = restore_checkpoint(parts, cfg, ranks), PhaseTimer(ranks.device)
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        model.train()
        while step < cfg.max_steps:  # a restore at or past max_steps trains nothing more
            sampler.set_epoch(step // sampler.steps_per_epoch)
            batches = iter(loader)  # starts at the sampler's committed position
            for _ in range(min(len(sampler) // (cfg.micro_batch_size * accum), cfg.max_steps - step)):
                if step + 1 == cfg.fail_at_step and ranks.rank == cfg.fail_rank and first_attempt:
                    os.kill(os.getpid(), signal.SIGKILL)  # a real crash: no cleanup at all
                loss = train_step(model, batches, optimizer, scheduler, scaler, cfg, accum, ranks.device, timer)
                sampler.commit()  # trained, not merely prefetched
                step += 1
                if step % cfg.log_every == 0 or step == cfg.max_steps:
                    if ranks.world_size > 1:
                        dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # the global mean
                    if not math.isfinite(value := loss.item()):
                        raise FloatingPointError(f"loss is {value} at step {step}; not checkpointing it")
                    log("step", step=step, loss=value, lr=scheduler.get_last_lr()[0], phase_ms=timer.flush())
                if step == cfg.max_steps or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0):
                    save_checkpoint(step, parts, cfg, ranks)
        result: dict = {"event": "run_complete", "step": step, "state_digest": state_digest(model, optimizer)}
        log(**result)
        barrier(ranks)  # no rank tears down its group while another still trains
        return result
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
# --8<-- [end:resume_loop]


# --8<-- [start:run]
# Cell 10: run it. As a script the flags apply; in a notebook the Config defaults do.
import sys


def run(argv: list[str] | None = None) -> dict:
    try:
        cfg = parse_config(argv)
    except ValueError as exc:  # one line on stderr and exit status 2, not a traceback
        print(f"interview trainer: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    return train(cfg)


if __name__ == "__main__":  # true for a script and in a notebook; false on import
    result = run()
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:  # a torchrun rank: end here and free nothing.
        sys.stdout.flush()  # Freed now, DDP's gloo group waits for its threads, which may still hold
        os._exit(0)  # the last collective's tensors and wait for the GIL this thread holds: a hang
# --8<-- [end:run]


# --8<-- [start:launch]
# Cell 11: two ranks from a notebook that cannot shell out to torchrun. A spawned child
# imports its function by module name, and a notebook's functions live in no importable
# module, so the children are forked: they inherit every function defined above.
def launch(nprocs: int, argv: list[str] | None = None) -> dict:
    import socket

    import torch.multiprocessing as mp

    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA is initialised in this process and cannot be used after fork: "
                           "write the trainer to a file and run it with torchrun")
    cfg = parse_config(argv or [])  # resolved once, so every rank shares the checkpoint dir
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("fork").SimpleQueue()
    mp.start_processes(_launched_rank, args=(nprocs, port, cfg, results), nprocs=nprocs,
                       start_method="fork")  # joins; a failed rank raises here
    return results.get()


def _launched_rank(rank: int, nprocs: int, port: int, cfg: Config, results):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # N ranks on one machine: one core each, not N x all cores
    result = train(cfg)
    if rank == 0:
        results.put(result)
# --8<-- [end:launch]

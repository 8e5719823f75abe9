"""The interview core: DDP, a resumable sampler, accumulation, an atomic checkpoint and resume, in torch alone."""
# --8<-- [start:ddp]
import argparse
import collections
import contextlib
import glob
import hashlib
import json
import math
import os
import signal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

DATASET, GLOBAL_BATCH, MICRO_BATCH = 4096, 64, 16  # accumulation: 64 / (16 x world size), 1 to 4 ranks
def setup() -> tuple[int, int, torch.device]:
    """Join the group torchrun describes in the environment; alone, a group of one."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before the group starts, so NCCL binds this GPU
    store: dist.Store | None = dist.HashStore() if world == 1 else None  # alone: nobody to meet
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's store outlives restarts: a per-attempt prefix hides a dead peer's old address
        base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
        store = dist.PrefixStore(f"attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", base)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank, world_size=world)
    return rank, world, device
# --8<-- [end:ddp]
# --8<-- [start:step]
class ResumableSampler:
    """A seeded permutation per epoch, alike on every rank, each taking every world-th index of a step's block."""
    def __init__(self, rank: int, world: int, seed: int):
        self.rank, self.world, self.seed, self.epoch, self.consumed = rank, world, seed, 0, 0
    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:  # the same epoch again keeps a position restored within it
            self.epoch, self.consumed = epoch, 0
    def indices(self) -> torch.Tensor:
        perm = torch.randperm(DATASET, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch))
        return perm[self.consumed:self.consumed + GLOBAL_BATCH][self.rank::self.world]
    def commit(self) -> None:  # after the optimizer step: prefetched is not trained
        self.consumed += GLOBAL_BATCH
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed}
    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.consumed = state["epoch"], state["consumed"]

def train_step(model: DDP, micro_batches: list, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """One optimizer step over G micro-batches; gradients are all-reduced once, on the last."""
    for i, (x, y) in enumerate(micro_batches):
        with model.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():  # sync the last only
            with torch.autocast(x.device.type, dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(x).float(), y) / len(micro_batches)  # sums to the mean
            loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
# --8<-- [end:step]
# --8<-- [start:checkpoint]
def save(root: str, step: int, parts: dict, rank: int) -> None:
    """Publish `step-N/` whole or not at all: write a temporary directory, fsync, rename."""
    os.makedirs(tmp := os.path.join(root, f"tmp-step-{step:08d}"), exist_ok=True)
    state: dict = {"rng": [torch.get_rng_state(), torch.cuda.get_rng_state_all()]}  # each rank its own streams
    if rank == 0:  # the replicas are equal: one copy of the training state
        state.update(step=step, **{name: part.state_dict() for name, part in parts.items()})
    with open(os.path.join(tmp, f"rank-{rank}.pt"), "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename can publish it
    dist.barrier()  # every rank's file is on disk
    if rank == 0:
        os.rename(tmp, os.path.join(root, f"step-{step:08d}"))  # the commit point: before it, no step-N at all

def restore(root: str, parts: dict, rank: int) -> int:
    """Load the newest checkpoint into `parts`, weights only (no code runs); return its step, 0 if none."""
    for path in sorted(glob.glob(os.path.join(root, "step-*")))[-1:]:  # only whole ones are named step-N
        saved, mine = (torch.load(f"{path}/rank-{r}.pt", map_location="cpu", weights_only=True) for r in (0, rank))
        for name, part in parts.items():
            part.load_state_dict(saved[name])
        torch.set_rng_state(mine["rng"][0])
        torch.cuda.set_rng_state_all(mine["rng"][1])
        if rank == 0:
            print(json.dumps({"event": "checkpoint_restored", "step": saved["step"], "path": path}), flush=True)
        return saved["step"]
    return 0
# --8<-- [end:checkpoint]
# --8<-- [start:loop]
def state_digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """sha256 of every weight and optimizer value in sorted-key order, as the full trainer's."""
    h = hashlib.sha256()
    def update(prefix: str, value: object) -> None:
        if isinstance(value, (dict, list, tuple)):
            items = sorted(value.items(), key=lambda kv: str(kv[0])) if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                update(f"{prefix}.{key}", item)
        elif isinstance(value, torch.Tensor):
            h.update(f"{prefix}:{value.dtype}:{tuple(value.shape)}".encode())  # then the raw bytes
            h.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{prefix}={json.dumps(value, default=str)}".encode())
    for name, part in zip(("model", "optim"), get_state_dict(model, optimizer), strict=True):
        update(name, part)  # keyed by parameter name, as without the DDP wrapper
    return h.hexdigest()

def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser()
    for flag, default in dict(max_steps=40, checkpoint_every=20, seed=0, fail_at_step=0, fail_rank=0).items():
        parser.add_argument("--" + flag.replace("_", "-"), type=int, default=default)
    parser.add_argument("--checkpoint-dir", default=f"/tmp/core-{os.environ.get('TORCHELASTIC_RUN_ID', os.getpid())}")
    args = parser.parse_known_args(argv)[0]  # known only: a notebook kernel passes flags of its own
    rank, world, device = setup()
    try:
        x = torch.randn(DATASET, 32, generator=(gen := torch.Generator().manual_seed(args.seed)))
        y = (x @ torch.randn(32, 10, generator=gen)).argmax(dim=1)  # labelled by a random linear teacher
        torch.manual_seed(args.seed)  # the same weights on every rank, named as the full trainer's
        mlp = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10))
        model = DDP(nn.Sequential(collections.OrderedDict(net=mlp)).to(device))
        torch.manual_seed(args.seed + rank)  # after the weights: each rank its own stream
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: (s + 1) / 5 if s < 5 else  # warmup, then
            0.1 + 0.9 * (0.5 * (1.0 + math.cos(math.pi * min((s - 5) / max(1, args.max_steps - 5), 1.0)))))  # cosine
        sampler = ResumableSampler(rank, world, args.seed)
        parts = dict(model=model.module, optimizer=optimizer, scheduler=scheduler, sampler=sampler)
        step = restore(args.checkpoint_dir, parts, rank)
        while step < args.max_steps:
            if (step + 1, rank, os.getenv("TORCHELASTIC_RESTART_COUNT")) == (args.fail_at_step, args.fail_rank, "0"):
                os.kill(os.getpid(), signal.SIGKILL)  # a real crash, on torchrun's first attempt only
            sampler.set_epoch(step // (DATASET // GLOBAL_BATCH))
            micro = [(x[i].to(device), y[i].to(device)) for i in sampler.indices().split(MICRO_BATCH)]
            train_step(model, micro, optimizer, scheduler)
            sampler.commit()
            step += 1
            if step == args.max_steps or (args.checkpoint_every and step % args.checkpoint_every == 0):
                save(args.checkpoint_dir, step, parts, rank)
        digest = state_digest(model, optimizer)
        if rank == 0:  # one copy of the result, not one per rank
            print(json.dumps({"event": "run_complete", "step": step, "state_digest": digest}), flush=True)
        dist.barrier()  # meet before teardown: no rank leaves while a peer still sends
        return digest
    finally:
        dist.destroy_process_group()
if __name__ == "__main__":
    main()
# --8<-- [end:loop]

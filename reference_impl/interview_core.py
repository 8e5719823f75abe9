"""The interview core: DDP, a resumable sampler, accumulation, verified checkpoints; torch alone."""
# --8<-- [start:ddp]
import argparse
import collections
import contextlib
import ctypes
import glob
import hashlib
import json
import math
import os
import shutil
import signal
import zipfile

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

DATASET, GLOBAL_BATCH, MICRO_BATCH = 4096, 64, 16  # accumulation: 64 / (16 x world), 1 to 4 ranks
def setup() -> tuple[int, int, torch.device]:
    """Join the group torchrun describes in the environment; alone, a group of one."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a SIGKILLed torchrun cannot stop its ranks: the
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # kernel kills us as it dies (PR_SET_PDEATHSIG)
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if cuda else "cpu")
    torch.get_device_module(device).set_device(device)  # a GPU before the group, so NCCL binds it
    store: dist.Store | None = dist.HashStore() if world == 1 else None  # alone: nobody to meet
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # hides past attempts' dead peers
        base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world)
        store = dist.PrefixStore(f"attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", base)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world)
    return rank, world, device
# --8<-- [end:ddp]
# --8<-- [start:step]
class ResumableSampler:
    """A seeded permutation per epoch, alike on every rank; each takes every world-th index."""
    def __init__(self, rank: int, world: int, seed: int):
        self.rank, self.world, self.seed, self.epoch, self.consumed = rank, world, seed, 0, 0
    def set_epoch(self, epoch: int) -> None:  # the same epoch again keeps a restored position
        self.epoch, self.consumed = epoch, self.consumed if epoch == self.epoch else 0
    def indices(self) -> tuple[torch.Tensor, ...]:  # this rank's micro-batches of the next step
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        perm = torch.randperm(DATASET, generator=gen)[self.consumed:]
        return perm[:GLOBAL_BATCH][self.rank::self.world].split(MICRO_BATCH)
    def commit(self) -> None: self.consumed += GLOBAL_BATCH  # after the optimizer step, not before
    def state_dict(self) -> dict: return {"epoch": self.epoch, "consumed": self.consumed}
    def load_state_dict(self, s: dict): self.epoch, self.consumed = s["epoch"], s["consumed"]
def train_step(model: DDP, micro_batches: list, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """One optimizer step over G micro-batches; gradients are all-reduced once, on the last."""
    for i, (x, y) in enumerate(micro_batches):
        with model.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
            with torch.autocast(x.device.type, dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(x).float(), y) / len(micro_batches)
            loss.backward()  # each loss over G: the G gradients sum to the full batch's mean
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
# --8<-- [end:step]
# --8<-- [start:checkpoint]
def say(rank: int, **event: object) -> None:
    if rank == 0:  # one line per job, not one per rank
        print(json.dumps(event), flush=True)
def save(root: str, step: int, parts: dict, rank: int) -> None:
    """Publish `step-N/` whole or not at all: write a temporary directory, fsync, rename."""
    os.makedirs(tmp := os.path.join(root, f"tmp-step-{step:08d}"), exist_ok=True)
    state = {name: part.state_dict() for name, part in parts.items()} if rank == 0 else {}
    state.update(step=step, rng=[torch.get_rng_state(), torch.cuda.get_rng_state_all()])
    with open(os.path.join(tmp, f"rank-{rank}.pt"), "wb") as f:  # each rank its own RNG streams
        torch.save(state, f)  # rank 0's also holds the training state: the replicas are equal
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename can publish it
    dist.barrier()  # every rank's file is on disk
    if rank == 0:  # a step-N that restore skipped as damaged gives way; the rename commits
        shutil.rmtree(final := os.path.join(root, f"step-{step:08d}"), ignore_errors=True)
        os.rename(tmp, final)  # the commit point: before it, no step-N at all
def intact(path: str) -> bool:  # torch.save writes a CRC32 per record; torch.load never checks
    with contextlib.suppress(Exception):  # a torn file is no zip; a changed record fails its CRC
        return not any(zipfile.ZipFile(f).testzip() for f in glob.glob(f"{path}/rank-*.pt"))
    return False  # every rank checks every file, so all ranks fall back alike
def restore(root: str, parts: dict, rank: int) -> int:
    """Load the newest checkpoint that verifies into `parts`, weights only; return its step or 0."""
    for d in filter(intact, sorted(glob.glob(os.path.join(root, "step-*")), reverse=True)):
        saved, mine = (torch.load(f"{d}/rank-{r}.pt", "cpu", weights_only=True) for r in (0, rank))
        for name, part in parts.items():
            part.load_state_dict(saved[name])
        torch.set_rng_state(mine["rng"][0])
        torch.cuda.set_rng_state_all(mine["rng"][1])
        say(rank, event="checkpoint_restored", step=saved["step"], path=d)
        return saved["step"]
    return 0
# --8<-- [end:checkpoint]
# --8<-- [start:loop]
def state_digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """sha256 of every weight and optimizer value in sorted-key order, as the full trainer's."""
    def encode(prefix: str, value: object) -> bytes:
        if isinstance(value, (dict, list, tuple)):
            keys = sorted(value, key=str) if isinstance(value, dict) else range(len(value))
            return b"".join(encode(f"{prefix}.{key}", value[key]) for key in keys)
        if isinstance(value, torch.Tensor):  # dtype and shape, then the raw bytes (no numpy)
            data = bytes(value.detach().cpu().contiguous().view(-1).view(torch.uint8).tolist())
            return f"{prefix}:{value.dtype}:{tuple(value.shape)}".encode() + data
        return f"{prefix}={json.dumps(value, default=str)}".encode()
    model_state, optim_state = get_state_dict(model, optimizer)  # by parameter name, as without DDP
    return hashlib.sha256(encode("model", model_state) + encode("optim", optim_state)).hexdigest()
def main(argv: list[str] | None = None) -> str:
    parser, run = argparse.ArgumentParser(), os.environ.get("TORCHELASTIC_RUN_ID", os.getpid())
    for flag, default in dict(max_steps=40, checkpoint_every=20, seed=0, fail_at_step=0,
                              fail_rank=0, checkpoint_dir=f"/tmp/core-{run}").items():
        parser.add_argument("--" + flag.replace("_", "-"), type=type(default), default=default)
    args = parser.parse_known_args(argv)[0]  # known only: a notebook kernel passes flags of its own
    rank, world, device = setup()
    try:
        x = torch.randn(DATASET, 32, generator=(gen := torch.Generator().manual_seed(args.seed)))
        x, y = x.to(device), (x @ torch.randn(32, 10, generator=gen)).argmax(dim=1).to(device)
        torch.manual_seed(args.seed)  # the same weights on every rank, named as the full trainer's
        net = [nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10)]
        model = DDP(nn.Sequential(collections.OrderedDict(net=nn.Sequential(*net))).to(device))
        torch.manual_seed(args.seed + rank)  # after the weights: each rank its own stream
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        def lr(s: int) -> float:  # a linear warmup over 5 steps, then a cosine down to a tenth
            t = min((s - 5) / max(1, args.max_steps - 5), 1.0)
            return (s + 1) / 5 if s < 5 else 0.1 + 0.9 * (0.5 * (1.0 + math.cos(math.pi * t)))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr)
        sampler = ResumableSampler(rank, world, args.seed)
        parts = dict(model=model.module, optimizer=optimizer, scheduler=scheduler, sampler=sampler)
        start = restore(args.checkpoint_dir, parts, rank)
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
        for step in range(start + 1, args.max_steps + 1):  # nothing more past max_steps
            if first_attempt and (step, rank) == (args.fail_at_step, args.fail_rank):
                os.kill(os.getpid(), signal.SIGKILL)  # a real crash, on torchrun's first attempt
            sampler.set_epoch((step - 1) // (DATASET // GLOBAL_BATCH))
            train_step(model, [(x[i], y[i]) for i in sampler.indices()], optimizer, scheduler)
            sampler.commit()
            if step == args.max_steps or args.checkpoint_every and not step % args.checkpoint_every:
                save(args.checkpoint_dir, step, parts, rank)
        digest = state_digest(model, optimizer)
        say(rank, event="run_complete", step=max(start, args.max_steps), state_digest=digest)
        dist.barrier()  # meet before teardown: no rank leaves while a peer still sends
        return digest
    finally:
        dist.destroy_process_group()
if __name__ == "__main__":
    main()
# --8<-- [end:loop]

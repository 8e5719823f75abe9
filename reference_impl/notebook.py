"""The interview notebook: the trainer assembled in eight cells, top to bottom.

Each cell is a named section that the handbook's walkthrough page shows. The module runs
as it reads, on a CPU in a few seconds, alone or under torchrun:

    python -m reference_impl.notebook
    torchrun --standalone --nproc-per-node 2 -m reference_impl.notebook
"""

# --8<-- [start:cell1]
# Cell 1 - configuration. Batch semantics live on the config: the global batch is
# derived, so changing the number of GPUs can never silently change the optimisation.
import os
import tempfile

from reference_impl.config import TrainConfig

# Every rank must see the same checkpoint directory: torchrun's run id names it.
run_id = os.environ.get("TORCHELASTIC_RUN_ID", str(os.getpid()))
cfg = TrainConfig(max_steps=40, micro_batch_size=16, grad_accum_steps=2, warmup_steps=5,
                  log_every=10, checkpoint_dir=os.path.join(tempfile.gettempdir(), f"notebook-{run_id}"),
                  checkpoint_every=20, world_size=int(os.environ.get("WORLD_SIZE", "1")))
print("global batch", cfg.global_batch_size, "config digest", cfg.digest()[:12])
# --8<-- [end:cell1]

# --8<-- [start:cell2]
# Cell 2 - rank wiring. torchrun sets RANK, LOCAL_RANK and WORLD_SIZE; without them this
# is one process and no group. Rank picks the data shard, local rank picks the GPU.
from reference_impl.distributed import init_distributed

ctx = init_distributed(cfg.device, cfg.pg_timeout_s)
print(f"rank {ctx.rank}/{ctx.world_size} local_rank {ctx.local_rank} on {ctx.device} "
      f"backend {ctx.backend or 'none'}")
# --8<-- [end:cell2]

# --8<-- [start:cell3]
# Cell 3 - data and sampler: where distributed correctness lives. One permutation per
# epoch, disjoint shards, and progress that counts trained samples, not prefetched ones.
import torch
from torch.utils.data import DataLoader

from reference_impl.data import ResumableDistributedSampler, SyntheticClassification

dataset = SyntheticClassification(cfg.dataset_size, cfg.input_dim, cfg.num_classes, cfg.seed)
sampler = ResumableDistributedSampler(len(dataset), world_size=ctx.world_size, rank=ctx.rank,
                                      global_batch_size=cfg.global_batch_size, seed=cfg.seed)
loader = DataLoader(dataset, batch_size=cfg.micro_batch_size, sampler=sampler,
                    generator=torch.Generator().manual_seed(cfg.seed + ctx.rank))
print("samples this rank trains per epoch:", len(sampler))
# --8<-- [end:cell3]

# --8<-- [start:cell4]
# Cell 4 - model, optimizer, schedule, scaler, then the parallel wrapper (DDP by default).
from reference_impl.model import build_model
from reference_impl.parallel import wrap_model
from reference_impl.step import build_optimizer, build_scaler, build_scheduler
from reference_impl.train import TrainState

model = wrap_model(build_model(cfg), cfg, ctx)
optimizer = build_optimizer(model, cfg)
state = TrainState(model, optimizer, build_scheduler(optimizer, cfg), build_scaler(cfg, ctx.device),
                   sampler, loader)
print(type(model).__name__, sum(p.numel() for p in model.parameters()), "parameters")
# --8<-- [end:cell4]

# --8<-- [start:cell5]
# Cell 5 - one training step: accumulate, sync gradients once, clip, step, schedule.
from reference_impl.metrics import PhaseTimer
from reference_impl.step import train_step

timer = PhaseTimer(ctx.device)
sampler.set_epoch(0)
loss, _ = train_step(model, iter(loader), optimizer, state.scheduler, state.scaler, cfg,
                     ctx.device, timer)
sampler.commit(cfg.global_batch_size)  # only now does the step count as trained
state.step = 1
print("first loss", round(loss.item(), 4))
# --8<-- [end:cell5]

# --8<-- [start:cell6]
# Cell 6 - metrics: where the time went (data, h2d, forward, backward, optimizer) and one
# JSON event per line, so a dashboard or a test can read the run.
from reference_impl.metrics import EventLog

log = EventLog(ctx.rank)
log.progress("step", step=state.step, loss=loss.item(),
             phase_ms={k: round(v * 1e3, 3) for k, v in timer.flush().items()})
# --8<-- [end:cell6]

# --8<-- [start:cell7]
# Cell 7 - checkpoint adapter: weights alone are not a restart plan. Save everything the
# next step depends on, publish atomically, and prove the round trip is exact.
from reference_impl.checkpoint import restore_checkpoint, save_checkpoint
from reference_impl.state import state_digest
from reference_impl.train import build_state

save_checkpoint(state, cfg, ctx, log)
fresh = build_state(cfg, ctx)
restore_checkpoint(fresh, cfg, ctx, log)
assert state_digest(fresh.model, fresh.optimizer) == state_digest(model, optimizer)
assert fresh.sampler.state_dict() == sampler.state_dict() and fresh.step == state.step
# --8<-- [end:cell7]

# --8<-- [start:cell8]
# Cell 8 - launch and resume: the full loop restores the newest valid checkpoint (step 1
# here) and trains to max_steps; torchrun --max-restarts reruns exactly this on a crash.
from reference_impl.distributed import destroy
from reference_impl.train import train

final = train(cfg, ctx, log)
log.progress("run_complete", step=final.step, state_digest=state_digest(final.model, final.optimizer))
destroy(clean=True)  # barrier, then tear the group down
# --8<-- [end:cell8]

"""Run under torchrun: train a tiny transformer with one pipeline stage per rank, and, on
every rank, the whole model in one process on the same batches; rank 0 prints both losses.

    torchrun --nproc-per-node 2 tests/distributed/pp_driver.py SCHEDULE MICROBATCHES STEPS
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from reference_impl.config import TrainConfig
from reference_impl.data import SyntheticTokens
from reference_impl.model import build_model, loss_fn
from reference_impl.pipeline import Stage, build_schedule, clip_grad_norm_, pipeline_step, stage_parameters

CFG = TrainConfig(model="transformer", n_layers=4, d_model=32, n_heads=4, hidden_dim=64, seq_len=16,
                  vocab_size=32, dataset_size=256, micro_batch_size=8)
BATCH, LR, CLIP = 8, 1e-2, 1.0


def main(kind: str, microbatches: int, steps: int) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    stage = Stage(build_model(CFG), rank, world)
    optimizer = torch.optim.AdamW(stage_parameters(stage), lr=LR)
    schedule = build_schedule(stage, rank, world, microbatches, kind, torch.device("cpu"))
    reference = build_model(CFG)  # the same seeded weights, trained whole in this process
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)
    data = SyntheticTokens(CFG.dataset_size, CFG.seq_len, CFG.vocab_size, CFG.seed)
    for step in range(steps):
        tokens, targets = data.tokens[step * BATCH:(step + 1) * BATCH, :-1], data.tokens[step * BATCH:(step + 1) * BATCH, 1:]
        loss = pipeline_step(schedule, rank, world, tokens, targets)
        clip_grad_norm_(stage_parameters(stage), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        shared = loss.detach() if loss is not None else torch.zeros(())
        dist.broadcast(shared, src=world - 1)  # the last stage computed the loss
        ref_loss = loss_fn(reference(tokens), targets)
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
        ref_optimizer.step()
        ref_optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            print(json.dumps({"step": step + 1, "pipeline": shared.item(), "single": ref_loss.item()}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))

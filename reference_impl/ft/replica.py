"""One rank of one replica: the trainer's model, data and step, with gradients averaged across
the replicas that are alive. Started by `reference_impl.ft`, never by hand.

Inside a replica the N ranks are an ordinary DDP job (their own gloo group). Across replicas,
torchft's Manager asks the Lighthouse for a quorum every step, all-reduces the gradients over
the replicas in it, and commits the step only if that all-reduce succeeded everywhere.
A replica that comes back from a restart is healed inside its first quorum: it receives the
model, optimizer, schedule and step of a live replica and then steps with the others.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from datetime import timedelta

import torch
from torch import nn
from torchft import Manager, ProcessGroupGloo

from reference_impl.config import TrainConfig
from reference_impl.data import ResumableDistributedSampler
from reference_impl.distributed import DistContext, distributed, exit_after, rendezvous_address
from reference_impl.ft.transport import WeightsOnlyHTTPTransport
from reference_impl.metrics import EventLog, PhaseTimer
from reference_impl.reliability.faults import FaultInjector
from reference_impl.reliability.lifecycle import die_with_parent
from reference_impl.state import TrainState, state_digest
from reference_impl.step import accumulate_gradients, optimizer_step
from reference_impl.train import build_state

# Replicas that join an empty Lighthouse wait this long for each other at the first start.
START_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where this process sits among the replicas (from the launcher's environment)."""

    replica: int
    replicas: int
    lighthouse: str
    start_store_port: int
    step_floor_s: float

    @classmethod
    def from_env(cls) -> Slot:
        """Read FT_REPLICA, FT_REPLICAS, TORCHFT_LIGHTHOUSE, FT_START_PORT and FT_STEP_FLOOR_S."""
        return cls(int(os.environ["FT_REPLICA"]), int(os.environ["FT_REPLICAS"]),
                   os.environ["TORCHFT_LIGHTHOUSE"], int(os.environ["FT_START_PORT"]),
                   float(os.environ["FT_STEP_FLOOR_S"]))


def replica_config(job: TrainConfig, ctx: DistContext, slot: Slot) -> TrainConfig:
    """The job's config seen from one replica: its world is the replica's N ranks, and the
    fault flags (whose rank is global) are armed only on the rank they name."""
    global_rank = slot.replica * ctx.world_size + ctx.rank
    armed = global_rank == job.fail_rank
    return dataclasses.replace(job, world_size=ctx.world_size, fail_rank=ctx.rank if armed else 0,
                               fail_at_step=job.fail_at_step if armed else ())


def build_manager(state: TrainState, cfg: TrainConfig, ctx: DistContext, slot: Slot) -> Manager:
    """torchft's Manager for this rank: quorum, cross-replica all-reduce, commit, and healing.

    What a live replica sends to a recovering one is the whole training state; the step
    counter travels inside torchft's own part of it.
    """
    def save() -> dict[str, object]:
        return {"model": state.model.state_dict(), "optimizer": state.optimizer.state_dict(),
                "scheduler": state.scheduler.state_dict()}

    def load(sd: dict[str, object]) -> None:
        state.model.load_state_dict(sd["model"])  # type: ignore[arg-type]
        state.optimizer.load_state_dict(sd["optimizer"])  # type: ignore[arg-type]
        state.scheduler.load_state_dict(sd["scheduler"])  # type: ignore[arg-type]

    timeout = timedelta(seconds=cfg.pg_timeout_s)
    address, port = rendezvous_address()
    return Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load, state_dict=save,
                   min_replica_size=1, timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
                   rank=ctx.rank, world_size=ctx.world_size, store_addr=address, store_port=port,
                   lighthouse_addr=slot.lighthouse, replica_id=f"replica_{slot.replica}",
                   # Every replica builds the same weights from the seed: no copy at step 0.
                   init_sync=False, checkpoint_transport=WeightsOnlyHTTPTransport(timeout))


def wait_for_all_replicas(slot: Slot, ctx: DistContext) -> None:
    """At the job's first start, meet the other replicas before the first quorum.

    Otherwise the replica that finished importing first would form a quorum alone and train
    steps the others then skip. A restarted replica does not wait: it joins the live quorum.
    """
    if ctx.restart_count or ctx.rank:
        return
    store = torch.distributed.TCPStore("127.0.0.1", slot.start_store_port, is_master=False,
                                       timeout=timedelta(seconds=START_TIMEOUT_S))
    store.set(f"ready_{slot.replica}", "1")
    store.wait([f"ready_{r}" for r in range(slot.replicas)])


def position_data(state: TrainState, cfg: TrainConfig, step: int) -> None:
    """Point the sampler at optimizer step `step + 1`: every replica's data is a function of
    the step, so a replica that jumped ahead by healing reads from where its peers are."""
    sampler = state.sampler
    epoch, done = divmod(step, sampler.steps_per_epoch)
    sampler.set_epoch(epoch)
    sampler.load_state_dict({**sampler.state_dict(), "consumed": done * sampler.global_batch_size})


# --8<-- [start:average_across_replicas]
def average_across_replicas(model: nn.Module, manager: Manager, slot: Slot) -> torch.Tensor:
    """Average the gradients over the replicas in this step's quorum; return who contributed.

    One flat all-reduce carries every gradient plus a one-hot of this replica's id. torchft
    zeroes the buffer of a replica that is only healing this step and divides by the number
    that contribute, so afterwards entry r of the tail is above zero exactly when replica r's
    gradients are in the average.
    """
    params = list(model.parameters())
    who = torch.zeros(slot.replicas)
    who[slot.replica] = 1.0
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads] + [who])
    manager.allreduce(flat).wait()  # a dead peer fails it here; should_commit then says no
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p).to(p.dtype)
        offset += p.numel()
    return flat[offset:] > 0
# --8<-- [end:average_across_replicas]


def step_samples(sampler: ResumableDistributedSampler, step: int, slot: int) -> list[int]:
    """The dataset indices sampler slot `slot` trains in optimizer step `step` (1-based)."""
    epoch, done = divmod(step - 1, sampler.steps_per_epoch)
    other = ResumableDistributedSampler(sampler.num_samples, world_size=sampler.world_size, rank=slot,
                                        global_batch_size=sampler.global_batch_size, seed=sampler.seed)
    other.set_epoch(epoch)
    other.consumed = done * sampler.global_batch_size
    return list(iter(other))[:sampler.global_batch_size // sampler.world_size]


def report_missing(state: TrainState, ctx: DistContext, slot: Slot, step: int, present: torch.Tensor,
                   log: EventLog) -> None:
    """Log the samples of the replicas that were not in step `step`: they are not trained.

    Rank 0 of the lowest replica present reports it, once for the whole job, naming the
    indices of every rank of every missing replica.
    """
    alive = present.nonzero().flatten().tolist()
    if ctx.rank or not alive or alive[0] != slot.replica or len(alive) == slot.replicas:
        return
    missing = [r for r in range(slot.replicas) if r not in alive]
    indices = [i for r in missing for g in range(ctx.world_size)
               for i in step_samples(state.sampler, step, r * ctx.world_size + g)]
    log.progress("samples_not_trained", replica=slot.replica, step=step, replicas=missing, indices=indices)


def train_replica(state: TrainState, cfg: TrainConfig, ctx: DistContext, slot: Slot, manager: Manager,
                  log: EventLog) -> None:
    """Step with whichever replicas are alive until the job's step reaches `max_steps`."""
    timer, faults = PhaseTimer(ctx.device), FaultInjector(cfg, ctx)
    was_restarted, rejoined = ctx.restart_count > 0, False
    state.model.train()
    while (step := manager.current_step()) < cfg.max_steps:
        started = time.monotonic()
        if faults.step == step + 1:
            log.emit("fault_injected", replica=slot.replica, step=step + 1)
        faults.before_step(step + 1)
        manager.start_quorum()  # asynchronous: the forward pass runs while the quorum forms
        position_data(state, cfg, step)
        loss, _ = accumulate_gradients(state.model, iter(state.loader), None, cfg, ctx.device, timer)
        present = average_across_replicas(state.model, manager, slot)
        if not manager.should_commit():  # a replica died during the step: nobody applies it
            state.optimizer.zero_grad(set_to_none=True)
            log.progress("step_aborted", replica=slot.replica, step=step + 1)
            continue
        if was_restarted and not rejoined and present.nonzero().flatten().tolist() == [slot.replica]:
            # Its peers are gone (the job ended): stepping would train a model alone from step 0.
            raise RuntimeError("restarted replica found no live peer to recover from")
        optimizer_step(state.model, state.optimizer, state.scheduler, None, cfg, timer)
        state.step = manager.current_step()
        report_missing(state, ctx, slot, state.step, present, log)
        if was_restarted and not rejoined and bool(present[slot.replica]):
            rejoined = True
            log.progress("recovered", replica=slot.replica, step=state.step, attempt=ctx.restart_count)
        log.progress("ft_step", replica=slot.replica, step=state.step, loss=round(loss.item(), 6),
                     participants=present.nonzero().flatten().tolist())
        time.sleep(max(0.0, slot.step_floor_s - (time.monotonic() - started)))


def main(argv: list[str] | None = None) -> int:
    """Train this rank's part of its replica; print `replica_complete` with the state digest."""
    die_with_parent()
    slot = Slot.from_env()
    job = TrainConfig.from_cli(argv, environ={"WORLD_SIZE": os.environ["FT_JOB_WORLD_SIZE"]})
    with distributed(job.device, job.pg_timeout_s) as ctx:
        cfg = replica_config(job, ctx, slot)
        log = EventLog(ctx.rank)
        state = build_state(cfg, ctx, slot.replicas, slot.replica)
        manager = build_manager(state, cfg, ctx, slot)
        log.progress("replica_start", replica=slot.replica, attempt=ctx.restart_count, pid=os.getpid())
        try:
            wait_for_all_replicas(slot, ctx)
            train_replica(state, cfg, ctx, slot, manager, log)
        except Exception as exc:
            log.error("ft_step", exc, replica=slot.replica, step=manager.current_step())
            sys.stdout.flush()
            os._exit(1)  # the launcher restarts the replica; torchft's threads need no goodbye
        log.progress("replica_complete", replica=slot.replica, step=state.step,
                     state_digest=state_digest(state.model, state.optimizer))
        manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    exit_after(main)

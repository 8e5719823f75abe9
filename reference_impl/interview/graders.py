"""Graders for the timed drills: paste the grader cell after your answer and call it.

Each grader runs the drill's real checks (worker prefetch, a SIGKILL after a checkpoint and a
restart, collectives counted by a DDP comm hook on a real gloo group of forked ranks, a save
stopped midway by a file-size limit, a launcher handed a function no child can import), prints
PASS or FAIL per check with the reason, and returns `{check: (passed, reason)}`. The cell
needs torch and the standard library only, and works in a notebook because ranks are forked:
a forked child inherits the class or function you defined in the kernel. Drill 10 is done on
paper: its grader checks the four numbers against the formulas the calculators use.
"""

# --8<-- [start:common]
import collections
import contextlib
import importlib
import json
import multiprocessing
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

Results = dict[str, tuple[bool, str]]


def _grade(title: str, checks: dict[str, Callable[[], None]]) -> Results:
    """Run each check (an AssertionError's message is the reason) and print one line per check."""
    print(title)
    results: Results = {}
    for name, check in checks.items():
        try:
            check()
            results[name] = (True, "")
        except Exception as e:  # a crash in the answer is a failed check, with its message
            reason = str(e) if isinstance(e, AssertionError) else f"{type(e).__name__}: {e}"
            results[name] = (False, reason.strip().splitlines()[-1] if reason.strip() else "failed")
        ok, reason = results[name]
        print(f"  {'PASS' if ok else 'FAIL'}  {name}" + ("" if ok else f": {reason}"), flush=True)
    print(f"{sum(ok for ok, _ in results.values())} of {len(results)} checks pass", flush=True)
    return results


class RankRun(collections.namedtuple("RankRun", "exitcode stdout stderr value")):
    """One forked rank: exit status (-9: SIGKILL; None: stopped by `run_ranks`, still running at the
    deadline or after the grace period that followed another rank's failure), output, result."""

    def events(self, name: str) -> list[dict[str, Any]]:
        """The JSON lines with this `event` the rank printed."""
        found = []
        for line in self.stdout.splitlines():
            with contextlib.suppress(ValueError):
                if line.startswith("{") and (event := json.loads(line)).get("event") == name:
                    found.append(event)
        return found


def run_ranks(target: Callable[..., Any], nprocs: int, args: tuple = (), attempt: int = 0,
              timeout: float = 60.0) -> list[RankRun]:
    """Fork `nprocs` ranks running `target(*args)` in torchrun's environment and wait for them.

    Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, a fresh MASTER_PORT and
    TORCHELASTIC_RESTART_COUNT=`attempt`. As torchrun does, once one rank fails the others get
    a few seconds (a gloo peer notices the dead rank quickly) and are then killed, and so is
    every rank still running at the deadline.
    """
    importlib.import_module("torch._dynamo")  # DDP imports it on first use: once here, not in every rank
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mkdtemp(prefix="grader-")
    ctx = multiprocessing.get_context("fork")  # spawn cannot import what a notebook defines
    procs = [ctx.Process(target=_rank_entry, args=(target, args, r, nprocs, port, attempt, out))
             for r in range(nprocs)]
    for p in procs:
        p.start()
    deadline, grace = time.monotonic() + timeout, None
    while any(p.is_alive() for p in procs) and time.monotonic() < (grace or deadline):
        if grace is None and any(p.exitcode not in (None, 0) for p in procs):
            grace = min(deadline, time.monotonic() + 3)
        time.sleep(0.02)
    stopped = {r for r, p in enumerate(procs) if p.is_alive()}
    for r in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(procs[r].pid or 0, signal.SIGKILL)  # the rank's session: its DataLoader workers too
        procs[r].join()
    runs = []
    for r, p in enumerate(procs):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid or 0, signal.SIGKILL)  # orphaned workers of a rank that was SIGKILLed
        text = [open(f"{out}/{r}.{k}").read() if os.path.exists(f"{out}/{r}.{k}") else ""
                for k in ("out", "err", "json")]
        runs.append(RankRun(None if r in stopped else p.exitcode, text[0], text[1],
                            json.loads(text[2]) if text[2] else None))
    return runs


# What gloo says on a rank whose peer died first: a consequence, not the cause.
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "connectFullMesh failed")


def _last_line(run: RankRun) -> str:
    return run.stderr.strip().splitlines()[-1] if run.stderr.strip() else ""


def _exited_cleanly(runs: list[RankRun], what: str) -> None:
    """Fail with a failed rank's exit status and the last line it wrote to stderr: the first
    one with an error of its own, before one that only lost a peer (which of the two exits
    first is a race), before one that never ended and was stopped."""
    failed = [r for r in runs if r.exitcode != 0]
    bad = min(failed, default=None,  # min keeps rank order among equals
              key=lambda r: (r.exitcode is None, any(lost in _last_line(r) for lost in PEER_LOST)))
    if bad is None:
        return
    who = f"rank {runs.index(bad)}" if len(runs) > 1 else "the process"
    ended = ("did not end: stopped at the deadline, or after the grace period that followed another rank's "
             "failure" if bad.exitcode is None else f"exited with status {bad.exitcode}")
    raise AssertionError(f"{what}: {who} {ended}: {_last_line(bad)}")


def _rank_entry(target: Callable[..., Any], args: tuple, rank: int, nprocs: int, port: int,
                attempt: int, out: str) -> None:
    os.setsid()  # a session per rank, so a kill reaches the DataLoader workers it forks
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT=str(attempt))
    torch.set_num_threads(1)  # a forked child that reuses the parent's OpenMP pool can hang
    for fd, kind in ((1, "out"), (2, "err")):  # the rank's prints, not the notebook's
        os.dup2(os.open(f"{out}/{rank}.{kind}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    code = 0
    try:
        value = target(*args)
        with open(f"{out}/{rank}.json", "w") as f:
            json.dump(value, f, default=str)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)  # no atexit handlers of the kernel this rank was forked from
# --8<-- [end:common]


# --8<-- [start:dist]
import datetime

import torch.distributed as dist


def _gloo_group() -> None:
    """Join the group `run_ranks` describes in the environment; a dead peer fails a collective in
    30 s instead of never."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
# --8<-- [end:dist]


# --8<-- [start:drill_1]
import builtins
import dataclasses
from collections.abc import Iterable


def grade_drill_1(config_cls: type, operational: Iterable[str] = ()) -> Results:
    """Drill 1: `config_cls` is a dataclass whose fields all have defaults, `global_batch_size` and
    `micro_batch_size` among them, with `grad_accum_steps(world_size)` and `digest()`.
    `operational` names the fields that do not change what a step computes (logging, paths,
    timeouts), which the digest may leave out."""
    skip = set(operational)

    def digest_with_hash_salted(salt: int) -> str:
        real = builtins.hash  # another process salts str hashes another way: so does this
        builtins.hash = lambda obj: real((salt, obj))
        try:
            return config_cls().digest()
        finally:
            builtins.hash = real

    def stable_across_processes() -> None:
        assert config_cls().digest() == config_cls().digest(), "two equal configs get different digests"
        assert digest_with_hash_salted(1) == digest_with_hash_salted(2), (
            "the digest changes with hash()'s salt: Python salts it per process, so every start gets a new one")

    def every_field_changes_it() -> None:
        assert "global_batch_size" not in skip, "global_batch_size changes what a step computes"
        base = config_cls()
        same = [f.name for f in dataclasses.fields(base) if f.name not in skip
                and (other := _another_value(base, f.name)) is not None and other.digest() == base.digest()]
        assert not same, f"changing {', '.join(same)} leaves the digest as it was"

    def accumulation_is_derived() -> None:
        free = [f.name for f in dataclasses.fields(config_cls) if "accum" in f.name]
        assert not free, f"{free[0]} is a field: a change of world size would change the global batch"
        cfg = dataclasses.replace(config_cls(), global_batch_size=64, micro_batch_size=16)
        got = {world: cfg.grad_accum_steps(world) for world in (1, 2, 4)}
        assert got == {1: 4, 2: 2, 4: 1}, f"global batch 64, micro-batch 16: steps per world size {got}, want 4, 2, 1"

    def indivisible_batch_raises() -> None:
        try:
            dataclasses.replace(config_cls(), global_batch_size=48, micro_batch_size=16).grad_accum_steps(2)
        except ValueError as e:
            missing = [name for name in ("global_batch_size", "micro_batch_size") if name not in str(e)]
            assert not missing, f"the error does not name {', '.join(missing)}: {e}"
        else:
            raise AssertionError("global_batch_size 48, micro_batch_size 16 on 2 ranks (48 is not a multiple "
                                 "of 32) raises no ValueError")

    return _grade("drill 1: config with a stable digest", {
        "the digest does not depend on Python's salted hash()": stable_across_processes,
        "changing any field that a step depends on changes the digest": every_field_changes_it,
        "accumulation is derived from global batch, micro-batch and world size": accumulation_is_derived,
        "an indivisible global batch raises a ValueError naming both fields": indivisible_batch_raises,
    })


def _another_value(cfg: Any, name: str) -> Any:
    """`cfg` with field `name` changed to the first other value its validation accepts, or None."""
    value = getattr(cfg, name)
    if isinstance(value, bool):
        tries: list[Any] = [not value]
    elif isinstance(value, (int, float)):
        tries = [value * 2, value + 1, value / 2, value - 1]
    else:
        tries = ["fp32", "fp16", "bf16", f"{value}-other", "other"]
    for other in tries:
        with contextlib.suppress(Exception):  # the field's validation refuses this value: try the next
            if other != value:
                return dataclasses.replace(cfg, **{name: type(value)(other)})
    return None
# --8<-- [end:drill_1]


# --8<-- [start:drill_2]
def grade_drill_2(setup: Callable[[], Any], timeout: float = 60.0) -> Results:
    """Drill 2: `setup()` reads the environment torchrun sets, picks the device and the backend,
    starts the process group when there is more than one rank, and returns an object with
    `rank`, `local_rank`, `world_size` and `device`, as Cell 2's `init_ranks` does."""
    alone = run_ranks(_drill_2_alone, 1, (setup,), timeout=timeout)[0]
    pair = run_ranks(_drill_2_pair, 2, (setup,), timeout=timeout)
    gpu_node = run_ranks(_drill_2_gpu_node, 1, (setup,), timeout=timeout)[0]

    def ran(runs: list[RankRun], what: str) -> list[dict[str, Any]]:
        _exited_cleanly(runs, what)
        return [r.value for r in runs]

    def no_group_alone() -> None:
        got = ran([alone], "with no launcher")[0]
        rank, world = got["rank"], got["world_size"]
        assert (rank, world) == (0, 1), f"with no launcher: rank {rank} of {world}, want rank 0 of 1"
        assert not got["group"], "with no launcher a process group was started: one process needs none"

    def two_ranks_in_one_gloo_group() -> None:
        got = ran(pair, "2 ranks under torchrun's environment")
        seen = [(g["rank"], g["world_size"], g["group_rank"], g["group_size"]) for g in got]
        assert seen == [(0, 2, 0, 2), (1, 2, 1, 2)], f"(rank, world size, group rank, group size) per rank: {seen}"
        assert got[0]["sum"] == 1.0, f"an all-reduce of the ranks gives {got[0]['sum']}, want 1"
        assert torch.cuda.is_available() or got[0]["backend"] == "gloo", f"backend {got[0]['backend']} on a CPU"

    def a_timeout_is_set() -> None:
        calls = pair[0].events("init_process_group")  # printed before the group starts, or fails to
        assert calls, "init_process_group was not called through torch.distributed"
        assert calls[0]["timeout"] is not None, (
            "init_process_group has no timeout: a hung collective waits for the library's default instead of failing")

    def local_rank_picks_the_gpu() -> None:
        got = ran([gpu_node], "on a node of 8 GPUs as RANK 9, LOCAL_RANK 1")[0]
        device = got["device"] if ":" in got["device"] or not got["set_device"] else f"cuda:{got['set_device'][-1]}"
        assert device == "cuda:1", (f"RANK 9, LOCAL_RANK 1 on a node of 8 GPUs picks {device}, want cuda:1: "
                                    "LOCAL_RANK is the GPU on this node, RANK the index in the whole job")
        calls = gpu_node.events("init_process_group")
        assert calls, "WORLD_SIZE 16 started no process group"
        backend = calls[0]["backend"]
        assert backend is None or "nccl" in backend, f"backend {backend!r} on CUDA, want nccl"

    return _grade("drill 2: rank wiring", {
        "alone: rank 0 of 1 and no process group": no_group_alone,
        "2 CPU ranks: ranks 0 and 1 of one gloo group that all-reduces": two_ranks_in_one_gloo_group,
        "the group has a timeout": a_timeout_is_set,
        "on a GPU node (CUDA faked): LOCAL_RANK picks the GPU, NCCL the backend": local_rank_picks_the_gpu,
    })


def _recording(real: Callable[..., Any] | None) -> Callable[..., Any]:
    """`init_process_group` that prints its backend and timeout as an event, then starts the group
    (or, with no `real`, only prints them)."""
    def init(*args: Any, **kwargs: Any) -> Any:
        timeout = kwargs.get("timeout", args[2] if len(args) > 2 else None)
        print(json.dumps({"event": "init_process_group", "backend": kwargs.get("backend", args[0] if args else None),
                          "timeout": None if timeout is None else str(timeout)}), flush=True)
        return real(*args, **kwargs) if real else None
    return init


def _described(ranks: Any) -> dict[str, Any]:
    return {"rank": ranks.rank, "local_rank": ranks.local_rank, "world_size": ranks.world_size,
            "device": str(ranks.device), "group": dist.is_initialized()}


def _drill_2_alone(setup: Callable[[], Any]) -> dict[str, Any]:
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
        os.environ.pop(name, None)  # `python cell.py`: no launcher
    return _described(setup())


def _drill_2_pair(setup: Callable[[], Any]) -> dict[str, Any]:
    dist.init_process_group = _recording(dist.init_process_group)  # this forked rank's copy only
    got = _described(setup())
    total = torch.tensor([float(got["rank"])])
    dist.all_reduce(total)
    got.update(group_rank=dist.get_rank(), group_size=dist.get_world_size(), backend=dist.get_backend(),
               sum=float(total))
    dist.destroy_process_group()
    return got


def _drill_2_gpu_node(setup: Callable[[], Any]) -> dict[str, Any]:
    """Rank 9 of 16, the second GPU of the second node, with CUDA faked: what would it pick?"""
    os.environ.update(RANK="9", LOCAL_RANK="1", WORLD_SIZE="16")
    chosen: list[int | None] = []

    def set_device(device: Any) -> None:
        chosen.append(device if isinstance(device, int) else torch.device(device).index)

    torch.cuda.is_available, torch.cuda.device_count, torch.cuda.set_device = lambda: True, lambda: 8, set_device
    dist.init_process_group = _recording(None)  # nothing starts: there is no GPU
    return {**_described(setup()), "set_device": chosen}
# --8<-- [end:drill_2]


# --8<-- [start:drill_3]
from collections.abc import Iterator


def grade_drill_3(sampler_cls: type, timeout: float = 60.0) -> Results:
    """Drill 3: `sampler_cls(n, global_batch, rank, world_size, seed)` with `set_epoch`,
    `commit` (after each optimizer step), `__iter__` (this rank's indices still to train this
    epoch), `state_dict` and `load_state_dict`."""
    n, batch = 100, 12  # 8 steps of 12 per epoch, the last 4 samples dropped; 12 splits over 2 and 3 ranks

    def epoch(world: int, which: int) -> list[list[int]]:
        samplers = [sampler_cls(n, batch, r, world, 0) for r in range(world)]
        for s in samplers:
            s.set_epoch(which)
        return [[int(i) for i in s] for s in samplers]

    def disjoint_and_complete() -> None:
        for world in (2, 3):
            flat = [i for rank in epoch(world, 0) for i in rank]
            twice = len(flat) - len(set(flat))
            assert not twice and len(flat) == 96, (
                f"{world} ranks: {len(flat)} indices, {twice} repeated; want 96 distinct (8 steps x 12)")

    def reshuffles_alike_on_every_rank() -> None:
        first, second = epoch(2, 0), epoch(2, 1)
        assert first != second, "set_epoch(1) gives the same order as epoch 0"
        assert second == epoch(2, 1), "the same epoch gives another order in another process"
        flat = [i for rank in second for i in rank]
        assert len(set(flat)) == 96, "epoch 1 repeats samples across ranks: each rank shuffled on its own"

    def commit_moves_the_state() -> None:
        s = sampler_cls(n, batch, 0, 2, 0)
        before = json.dumps(s.state_dict(), sort_keys=True, default=str)
        s.commit()
        assert json.dumps(s.state_dict(), sort_keys=True, default=str) != before, (
            "commit() changes no state: a checkpoint saved after a step would resume before it")

    def state_dict_is_a_copy() -> None:
        s = sampler_cls(n, batch, 0, 2, 0)
        snapshot = s.state_dict()
        before = json.dumps(snapshot, sort_keys=True, default=str)
        s.commit()
        s.set_epoch(1)
        after = json.dumps(snapshot, sort_keys=True, default=str)
        assert after == before, "state_dict() is a live view: commit() and set_epoch() changed what it returned"

    def a_new_epoch_starts_at_its_beginning() -> None:
        s = sampler_cls(n, batch, 0, 2, 0)
        for _ in range(3):
            s.commit()
        s.set_epoch(1)
        got = len(list(s))
        assert got == 48, f"after 3 steps of epoch 0, epoch 1 yields {got} indices on rank 0, want 48"

    def exactly_once_over_a_kill_and_restart() -> None:
        ckpt = os.path.join(tempfile.mkdtemp(prefix="drill3-"), "sampler.pt")
        log = ckpt + ".log"
        run = run_ranks(_drill_3_killed_run, 1, (sampler_cls, n, batch, ckpt, log), timeout=timeout)[0]
        assert run.exitcode == -signal.SIGKILL, f"not killed (exit status {run.exitcode}): {run.stderr[-300:]}"
        assert os.path.exists(ckpt), "the kill came before the first checkpoint: the restart would not restore"
        trained = [json.loads(line) for line in open(log)]
        states = torch.load(ckpt, weights_only=True)
        assert len(trained) > states["step"], "no step ran between the checkpoint and the kill"
        seen = [i for step in trained[:states["step"]] for i in step]  # what the checkpoint holds
        samplers = [sampler_cls(n, batch, r, 2, 0) for r in range(2)]
        for s, state in zip(samplers, states["samplers"], strict=True):
            s.load_state_dict(state)
            s.set_epoch(0)  # a resume loop sets the epoch of the step it resumes at
        for step in _train_epoch(samplers, batch):
            seen += step
        counts = collections.Counter(seen)
        twice, missed = sum(c > 1 for c in counts.values()), 96 - len(counts)
        assert not twice and not missed, (
            f"after a SIGKILL at step 5 and a restore of step 3 (DataLoader, 2 workers): {twice} samples "
            f"trained twice, {missed} never")

    return _grade("drill 3: resumable sampler", {
        "disjoint and complete on 2 and 3 ranks": disjoint_and_complete,
        "set_epoch reshuffles, alike on every rank": reshuffles_alike_on_every_rank,
        "commit() moves the saved position": commit_moves_the_state,
        "state_dict returns a copy": state_dict_is_a_copy,
        "a new epoch starts at its beginning": a_new_epoch_starts_at_its_beginning,
        "exactly once over a SIGKILL and restore, with worker prefetch": exactly_once_over_a_kill_and_restart,
    })


def _train_epoch(samplers: list, batch: int) -> Iterator[list[int]]:
    """Yield the indices each optimizer step trains, all ranks together; commit after each step."""
    loaders: list[torch.utils.data.DataLoader] = [
        torch.utils.data.DataLoader(_Indices(), batch_size=batch // len(samplers), sampler=s, num_workers=2,
                                    prefetch_factor=2) for s in samplers]  # workers prefetch ahead of training
    for micro in zip(*loaders, strict=False):
        for s in samplers:
            s.commit()  # after the optimizer step
        yield [int(i) for b in micro for i in b]


class _Indices(torch.utils.data.Dataset[int]):
    """Sample i is i: what a step trains is the list of its indices."""

    def __getitem__(self, i: int) -> int:
        return i


def _drill_3_killed_run(sampler_cls: type, n: int, batch: int, ckpt: str, log: str) -> None:
    samplers = [sampler_cls(n, batch, r, 2, 0) for r in range(2)]
    for s in samplers:
        s.set_epoch(0)
    with open(log, "w") as f:
        for step, trained in enumerate(_train_epoch(samplers, batch), start=1):
            f.write(json.dumps(trained) + "\n")
            f.flush()
            if step == 3:  # checkpoint, published by an atomic rename
                torch.save({"step": step, "samplers": [s.state_dict() for s in samplers]}, ckpt + ".tmp")
                os.replace(ckpt + ".tmp", ckpt)
            if step == 5:
                os.kill(os.getpid(), signal.SIGKILL)  # a crash, two steps after the checkpoint
# --8<-- [end:drill_3]


# --8<-- [start:drill_4]
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP


def grade_drill_4(step_fn: Callable[..., Any], timeout: float = 60.0) -> Results:
    """Drill 4: `step_fn(model, micro_batches, optimizer, scheduler)` runs one optimizer step
    over the list of `(x, y)` micro-batches (cross-entropy) and returns the loss as a tensor.
    The grader runs it on two forked ranks with a real gloo group and a DDP model whose
    comm hook counts the all-reduces."""
    runs = run_ranks(_drill_4_rank, 2, (step_fn,), timeout=timeout)
    got = runs[0].value or {}

    def ran() -> None:
        _exited_cleanly(runs, "the step on two ranks")

    def one_optimizer_step() -> None:
        ran()
        assert got["steps"] == [1, 1], f"optimizer.step() ran {got['steps']} times for G=1 and G=4, want once each"

    def accumulated_gradient_equals_one_big_batch() -> None:
        ran()
        assert got["grad_rel_diff"] < 3e-2, (
            f"4 micro-batches of 8 give a gradient {got['grad_ratio']:.2f}x one batch of 32 "
            f"(relative difference {got['grad_rel_diff']:.3f})")

    def one_all_reduce_per_step() -> None:
        ran()
        once, accum = got["allreduce"]
        assert accum == once, f"{accum} all-reduces for a step of 4 micro-batches, {once} for one: want {once}"

    def ranks_agree() -> None:
        ran()
        assert got["ranks_differ"] == 0.0, f"the ranks' gradients differ by {got['ranks_differ']:.2e} after the step"

    def returns_the_loss_as_a_tensor() -> None:
        ran()
        assert got["loss_type"] == "Tensor", f"returns a {got['loss_type']}: reading it forced a device sync"
        one, four = got["losses"]
        # The mean of 4 equal micro-batches' mean losses is the batch's mean loss: only rounding
        # may differ. The last micro-batch's own loss is 4 % below it (see _drill_4_rank).
        assert got["loss_rel_diff"] < 1e-3, (
            f"the loss {four:.4f} is not the batch mean {one:.4f} (the micro-batches' losses: "
            + ", ".join(f"{loss:.4f}" for loss in got["micro_losses"]) + ")")

    return _grade("drill 4: train step with accumulation", {
        "the step runs on two ranks": ran,
        "one optimizer step per call": one_optimizer_step,
        "4 micro-batches of m give the gradient of one batch of 4m": accumulated_gradient_equals_one_big_batch,
        "one all-reduce per step (DDP comm hook)": one_all_reduce_per_step,
        "gradients equal on every rank": ranks_agree,
        "returns the mean loss as a tensor": returns_the_loss_as_a_tensor,
    })


def _drill_4_rank(step_fn: Callable[..., Any]) -> dict[str, Any]:
    _gloo_group()
    try:
        gen = torch.Generator().manual_seed(100 + dist.get_rank())  # each rank its own shard
        x, y = 0.1 * torch.randn(32, 16, generator=gen), torch.randint(0, 4, (32,), generator=gen)
        # Hardest samples first: the micro-batches' losses fall, so the last one's (the 8
        # easiest samples) is 4 % below the mean on rank 0 and cannot pass for it.
        with torch.no_grad():
            per_sample = nn.functional.cross_entropy(_drill_4_model()(x), y, reduction="none")
        order = per_sample.argsort(descending=True)
        x, y = x[order], y[order]
        one = _drill_4_step(step_fn, [(x, y)])
        four = _drill_4_step(step_fn, list(zip(x.split(8), y.split(8), strict=True)))
        out: dict[str, Any] = {key: [one[key], four[key]] for key in ("steps", "allreduce", "losses")}
        out["loss_type"] = four["loss_type"]
        out["micro_losses"] = [float(part.mean()) for part in per_sample[order].split(8)]
        out["loss_rel_diff"] = abs(four["losses"] - one["losses"]) / one["losses"]
        out["grad_rel_diff"] = float((four["grads"] - one["grads"]).norm() / one["grads"].norm())
        out["grad_ratio"] = float(four["grads"].norm() / one["grads"].norm())
        gathered = [torch.empty_like(four["grads"]) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, four["grads"])
        out["ranks_differ"] = float((gathered[0] - gathered[1]).abs().max())
        return out
    finally:
        dist.destroy_process_group()


def _drill_4_step(step_fn: Callable[..., Any], micro_batches: list) -> dict[str, Any]:
    """One call of the answer on a fresh DDP model; the model is freed here, while the group lives
    (a DDP reducer destroyed after its group can hang the process at exit)."""
    model = DDP(_drill_4_model())
    calls = [0]
    model.register_comm_hook(calls, _counting_allreduce)
    optimizer = _RecordingSGD(model.parameters(), lr=0.1)
    loss = step_fn(model, micro_batches, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0))
    value = float(loss) if isinstance(loss, (torch.Tensor, float)) else float("nan")
    return {"steps": optimizer.steps, "allreduce": calls[0], "losses": value,
            "loss_type": type(loss).__name__, "grads": optimizer.grads}


def _drill_4_model() -> nn.Module:
    torch.manual_seed(0)  # the same weights for every call and on every rank
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _counting_allreduce(calls: list[int], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's own all-reduce of a gradient bucket, counted."""
    calls[0] += 1
    return default_hooks.allreduce_hook(dist.distributed_c10d._get_default_group(), bucket)


class _RecordingSGD(torch.optim.SGD):
    """SGD that keeps the gradient it stepped with (the first step's) and counts its steps."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, lr=lr)
        self.steps, self.grads = 0, torch.zeros(0)

    def step(self, closure: Any = None) -> Any:
        if self.steps == 0:
            self.grads = torch.cat([p.grad.reshape(-1) for g in self.param_groups for p in g["params"]]).clone()
        self.steps += 1
        return super().step(closure)
# --8<-- [end:drill_4]


# --8<-- [start:drill_5]
def grade_drill_5(timer_cls: type) -> Results:
    """Drill 5: `timer_cls(device)` with a context manager `phase(name)` and `flush()`, which
    returns `{phase: time}` for the window and starts a new one. Checked on the CPU."""
    a = torch.randn(384, 384)

    def work() -> None:
        for _ in range(20):
            a @ a

    def window(timer: Any, busy: bool = True) -> dict[str, float]:
        with timer.phase("data"):
            pass
        with timer.phase("forward"):
            if busy:
                work()  # about 50 ms of CPU work
        with timer.phase("backward"):
            pass
        return {name: float(value) for name, value in timer.flush().items()}

    def forward_only() -> None:
        # Best of three windows: a busy machine may pause the process inside an empty phase
        # once, but a timer that books the work elsewhere misplaces it every time.
        tries = []
        for _ in range(3):
            got = window(timer_cls(torch.device("cpu")))
            forward = got.get("forward", 0.0)
            others = max((v for k, v in got.items() if k != "forward"), default=0.0)
            if forward > 0 and others < 0.2 * forward:
                return
            tries.append(got)
        raise AssertionError(
            f"a matrix multiply timed inside phase('forward') reads {tries[0]}: it belongs to forward alone")

    def flush_starts_a_new_window() -> None:
        timer = timer_cls(torch.device("cpu"))
        first = window(timer)
        empty = {k: v for k, v in timer.flush().items() if float(v) > 0}
        assert not empty, f"a flush right after a flush reports {empty}: the window was not reset"
        # A window with no work after one with the work: if flush() kept the first window's
        # time, the second reads at least as much, however fast the machine runs.
        second = window(timer, busy=False)
        assert sum(second.values()) < sum(first.values()), (
            f"the second window ({second}) includes the first ({first})")

    return _grade("drill 5: phase timer", {
        "a matrix multiply in phase('forward') counts under forward alone": forward_only,
        "flush() starts a new window": flush_starts_a_new_window,
    })
# --8<-- [end:drill_5]


# --8<-- [start:drill_6]
import random
import resource
import shutil


def grade_drill_6(save: Callable[[str, int, dict], None], restore: Callable[[str, dict], int],
                  timeout: float = 60.0) -> Results:
    """Drill 6: on each of two ranks of a gloo group the grader starts (`dist.get_rank()` is the
    rank), `save(root, step, parts)` checkpoints `parts` and this rank's RNG under the directory
    `root`, and `restore(root, parts)` loads the newest checkpoint that verifies into `parts` and
    returns its step, 0 if there is none. `parts` maps names to a model, an optimizer, a scheduler,
    a GradScaler and a sampler, each with `state_dict` and `load_state_dict`."""
    root = tempfile.mkdtemp(prefix="drill6-")
    os.makedirs(f"{root}/good")
    os.makedirs(f"{root}/empty")
    first = run_ranks(_drill_6_save_twice, 2, (save, restore, root), timeout=timeout)
    done = next((r for r in first if r.exitcode != 0), None)
    newest: list[tuple[int, str]] = []  # (size, path) of each file the save of step 20 added
    if done is None:
        newest = sorted((size, name) for name, size in first[0].value["files"][1].items()
                        if name not in first[0].value["files"][0])
        for case in ("torn", "changed", "crashed"):
            shutil.copytree(f"{root}/good", f"{root}/{case}", symlinks=True)
    if newest:
        size, name = newest[-1]
        os.truncate(f"{root}/torn/{name}", size // 2)
        with open(f"{root}/changed/{name}", "r+b") as f:  # one byte in the middle: a tensor's data
            f.seek(size // 2)
            byte = f.read(1)
            f.seek(size // 2)
            f.write(bytes([byte[0] ^ 0xFF]))
    loads: list[dict[str, Any]] = []

    def ran(runs: list[RankRun], what: str) -> dict[str, Any]:
        loads.extend(e for r in runs for e in r.events("torch_load"))
        _exited_cleanly(runs, what)
        return runs[0].value

    def restores_everything() -> None:
        got = ran(first, "saving steps 10 and 20, then restoring")
        assert got["empty"] == 0, f"restore from an empty directory returns {got['empty']}, want 0"
        assert got["step"] == 20, f"restore returns step {got['step']} after saves of 10 and 20, want 20"
        assert got["differs"] is None, f"after restore, {got['differs']} differs from what was saved"
        wrong = [f"rank {r.value['rank']}: {r.value['rng']}" for r in first if r.value["rng"]]
        assert not wrong, f"the RNG streams after restore are not the ones saved: {'; '.join(wrong)}"

    def falls_back(case: str, want: int, damage: str) -> Callable[[], None]:
        def check() -> None:
            assert newest, "the save of step 20 added no file: it overwrote the checkpoint of step 10 in place"
            if case == "crashed":
                limit = newest[-1][0] // 2
                runs = run_ranks(_drill_6_crash, 2, (save, f"{root}/crashed", limit), timeout=timeout)
                assert any(r.exitcode == -signal.SIGKILL for r in runs), (
                    f"the save of step 30 wrote no file over {limit} bytes, so it could not be stopped midway")
            got = ran(run_ranks(_drill_6_restore, 2, (restore, f"{root}/{case}", want), timeout=timeout),
                      f"restoring after {damage}")
            assert got["step"] == want, f"after {damage}, restore returns step {got['step']}, want {want}"
            assert got["differs"] is None, f"after {damage}, the restored {got['differs']} is not step {want}'s"
        return check

    def weights_only() -> None:
        unsafe = [e for e in loads if e["weights_only"] is False]
        assert not unsafe, "torch.load(..., weights_only=False): loading a checkpoint file can run any code in it"

    largest = f"{newest[-1][1]} of step 20" if newest else "the newest checkpoint"
    return _grade("drill 6: atomic checkpoint and restore", {
        "restore brings back the newest step, every part and each rank's RNG": restores_everything,
        "a truncated file in the newest checkpoint: restore falls back to the previous one": falls_back(
            "torn", 10, f"truncating {largest}"),
        "a byte changed in the newest checkpoint: restore falls back (it verifies hashes)": falls_back(
            "changed", 10, f"changing one byte of {largest}"),
        "a save killed midway leaves the previous checkpoint, which restore returns": falls_back(
            "crashed", 20, "a crash in the middle of the save of step 30"),
        "torch.load runs with weights_only=True": weights_only,
    })


class _Progress:
    """A sampler's progress, as the parts of a checkpoint see it."""

    def __init__(self, consumed: int = 0) -> None:
        self.epoch, self.consumed = 0, consumed

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.consumed = state["epoch"], state["consumed"]


def _drill_6_parts(step: int, seed: int = 0) -> dict[str, Any]:
    """The training state after `step` steps, the same in every process: built again to compare."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(256, 256)  # 260 kB of weights, 790 kB with Adam's moments
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(step):
        model(torch.randn(4, 256)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    scaler.scale(torch.ones(()))  # the scale exists from the first scaled loss on
    scaler.update(float(step + 1))
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler,
            "sampler": _Progress(64 * step)}


def _drill_6_seed(step: int) -> None:
    """Each rank's RNG streams at the save of `step`: another on each rank."""
    torch.manual_seed(1000 * step + dist.get_rank())
    random.seed(1000 * step + dist.get_rank())


def _drill_6_difference(restored: dict[str, Any], step: int) -> str | None:
    """The first part (and key) of `restored` that differs from the state after `step` steps."""
    def first(a: Any, b: Any, where: str) -> str | None:
        if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
            pairs = [(a[k], b[k], f"{where}.{k}") for k in a]
        elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
            pairs = [(x, y, f"{where}.{i}") for i, (x, y) in enumerate(zip(a, b, strict=True))]
        elif isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            return None if same and torch.equal(a, b) else where
        else:
            return None if a == b else where
        return next((d for x, y, w in pairs if (d := first(x, y, w))), None)
    want = _drill_6_parts(step)
    return next((d for name, part in want.items()
                 if (d := first(restored[name].state_dict(), part.state_dict(), name))), None)


def _drill_6_loading() -> None:
    """Print an event for each torch.load, with its weights_only, then load."""
    real = torch.load

    def load(*args: Any, **kwargs: Any) -> Any:
        print(json.dumps({"event": "torch_load", "weights_only": kwargs.get("weights_only")}), flush=True)
        return real(*args, **kwargs)
    torch.load = load


def _drill_6_save_twice(save: Callable[..., None], restore: Callable[..., int], root: str) -> dict[str, Any]:
    _gloo_group()
    _drill_6_loading()
    try:
        out: dict[str, Any] = {"rank": dist.get_rank(), "empty": restore(f"{root}/empty", _drill_6_parts(0, seed=1)),
                               "files": []}
        for step in (10, 20):
            parts = _drill_6_parts(step)
            _drill_6_seed(step)
            save(f"{root}/good", step, parts)
            dist.barrier()  # every rank's files are written before rank 0 lists them
            out["files"].append({os.path.relpath(path, f"{root}/good"): os.path.getsize(path)
                                 for d, _, files in os.walk(f"{root}/good") for path in (f"{d}/{f}" for f in files)})
        parts = _drill_6_parts(0, seed=1)  # fresh weights, no optimizer state
        torch.manual_seed(12345)
        random.seed(12345)
        out["step"] = restore(f"{root}/good", parts)
        drawn = {"torch": torch.rand(2).tolist(), "Python random": random.random()}
        _drill_6_seed(20)
        saved = {"torch": torch.rand(2).tolist(), "Python random": random.random()}
        out["rng"] = ", ".join(name for name in drawn if drawn[name] != saved[name])
        out["differs"] = _drill_6_difference(parts, 20)
        dist.barrier()
        return out
    finally:
        dist.destroy_process_group()


def _drill_6_crash(save: Callable[..., None], root: str, limit: int) -> None:
    """Save step 30 until a file grows past `limit` bytes, then die as a crash would."""
    _gloo_group()
    parts = _drill_6_parts(30)
    _drill_6_seed(30)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        save(root, 30, parts)  # Python ignores SIGXFSZ: the write past the limit raises instead
    except BaseException:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.destroy_process_group()


def _drill_6_restore(restore: Callable[..., int], root: str, want: int) -> dict[str, Any]:
    _gloo_group()
    _drill_6_loading()
    try:
        parts = _drill_6_parts(0, seed=1)
        step = restore(root, parts)
        return {"step": step, "differs": _drill_6_difference(parts, step if step in (10, 20) else want)}
    finally:
        dist.destroy_process_group()
# --8<-- [end:drill_6]


# --8<-- [start:drill_7]
def grade_drill_7(main: Callable[[list[str]], Any], nprocs: int = 2, timeout: float = 120.0) -> Results:
    """Drill 7: `main(argv)` trains with the flags `--max-steps`, `--checkpoint-every`,
    `--checkpoint-dir`, `--fail-at-step` and `--fail-rank` (SIGKILL itself before that step, on
    the first attempt only: TORCHELASTIC_RESTART_COUNT == "0"), prints
    `{"event": "checkpoint_restored", "step": N}` when it restores, and returns the final
    state digest on rank 0 (or a dict with `state_digest`). Runs on `nprocs` forked ranks as torchrun would."""
    root = tempfile.mkdtemp(prefix="drill7-")
    flags = ["--max-steps", "30", "--checkpoint-every", "10"]
    state: dict[str, Any] = {}

    def digest_of(runs: list[RankRun], what: str) -> str:
        _exited_cleanly(runs, what)
        value = runs[0].value  # rank 0's digest: the one a launcher prints
        return value["state_digest"] if isinstance(value, dict) else value

    def uninterrupted() -> None:
        runs = run_ranks(main, nprocs, ([*flags, "--checkpoint-dir", f"{root}/clean"],), timeout=timeout)
        state["clean"] = digest_of(runs, "the uninterrupted run")

    killed_dir = f"{root}/killed"
    killed = [*flags, "--checkpoint-dir", killed_dir, "--fail-at-step", "15", "--fail-rank", str(nprocs - 1)]

    def killed_after_a_checkpoint() -> None:
        runs = run_ranks(main, nprocs, (killed,), attempt=0, timeout=timeout)
        status = runs[-1].exitcode
        assert status == -signal.SIGKILL, f"--fail-at-step 15: rank {nprocs - 1} not SIGKILLed (exit status {status})"
        saved = [f for _, _, files in os.walk(killed_dir) for f in files]
        assert saved, ("no checkpoint existed when the rank died at step 15 (--checkpoint-every 10): "
                       "a restart would train from step 0, and that proves nothing about restore")

    def restart_restores() -> None:
        runs = run_ranks(main, nprocs, (killed,), attempt=1, timeout=timeout)
        state["resumed"] = digest_of(runs, "the restart")
        steps = [e.get("step") for r in runs for e in r.events("checkpoint_restored")]
        assert steps and 0 < (steps[0] or 0) < 15, (
            f"the restart printed checkpoint_restored steps {steps}: want one step in 1..14, from the checkpoint "
            "before the kill; none means it started over")

    def resumed_digest_equals_uninterrupted() -> None:
        assert "clean" in state and "resumed" in state, "an earlier check failed"
        assert state["resumed"] == state["clean"], "the resumed run ends with another digest than the uninterrupted one"

    def restore_at_the_end_trains_nothing() -> None:
        runs = run_ranks(main, nprocs, (killed,), attempt=2, timeout=timeout)
        again = digest_of(runs, "a run restarted after the end")
        assert again == state.get("resumed"), "restarting a finished run changed its final state"

    return _grade("drill 7: resume loop and a kill test", {
        "the uninterrupted run finishes": uninterrupted,
        "a rank is SIGKILLed at step 15, after a checkpoint": killed_after_a_checkpoint,
        "the restart restores that checkpoint": restart_restores,
        "the resumed run ends with the uninterrupted digest": resumed_digest_equals_uninterrupted,
        "a restart at max_steps trains nothing more": restore_at_the_end_trains_nothing,
    })
# --8<-- [end:drill_7]


# --8<-- [start:drill_8]
def grade_drill_8(launch: Callable[[int, Callable[[], None]], Any], timeout: float = 60.0) -> Results:
    """Drill 8: `launch(nprocs, fn)` starts `nprocs` ranks on this machine with torchrun's
    environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), runs `fn()` in each,
    waits for them, and raises if one failed. The grader's `fn` is defined inside it: like a
    function of a notebook, no child process can import it by name."""
    out = tempfile.mkdtemp(prefix="drill8-")

    def train() -> None:
        _gloo_group()
        try:
            torch.manual_seed(0)  # the same weights on every rank
            model = torch.nn.Linear(8, 2)
            data = torch.Generator().manual_seed(dist.get_rank())  # each rank its own samples
            for _ in range(3):
                loss = model(torch.randn(16, 8, generator=data)).square().mean()
                for p, grad in zip(model.parameters(), torch.autograd.grad(loss, list(model.parameters())),
                                   strict=True):
                    dist.all_reduce(grad)  # summed over the ranks: their mean, as DDP takes it
                    p.data -= 0.1 * grad / dist.get_world_size()
            with open(f"{out}/rank-{dist.get_rank()}.json", "w") as f:
                json.dump({"rank": dist.get_rank(), "world_size": dist.get_world_size(), "threads":
                           torch.get_num_threads(), "weights": [p.tolist() for p in model.parameters()]}, f)
        finally:
            dist.destroy_process_group()

    def fail_on_rank_1() -> None:
        if os.environ.get("RANK") == "1":
            raise RuntimeError("rank 1 fails on purpose")

    threads = torch.get_num_threads()  # what this kernel's children would inherit
    good = run_ranks(_drill_8_launch, 1, (launch, train, threads), timeout=timeout)
    bad = run_ranks(_drill_8_launch, 1, (launch, fail_on_rank_1, threads), timeout=timeout)[0]

    def ranks() -> list[dict[str, Any]]:
        _exited_cleanly(good, "launch(2, fn)")
        found = sorted(os.listdir(out))
        assert found == ["rank-0.json", "rank-1.json"], f"launch(2, fn) returned; ranks that ran fn: {found}"
        return [json.load(open(f"{out}/{name}")) for name in found]

    def two_ranks_same_weights() -> None:
        got = ranks()
        assert [g["world_size"] for g in got] == [2, 2], f"the ranks saw world sizes {[g['world_size'] for g in got]}"
        assert got[0]["weights"] == got[1]["weights"], "the two ranks end with different weights"

    def one_thread_per_rank() -> None:
        counts = [g["threads"] for g in ranks()]
        assert counts == [1, 1], (
            f"the ranks run torch on {counts} threads: torch.set_num_threads(1) in each, since a forked child that "
            "reuses the parent's OpenMP pool can hang and 2 ranks x all cores oversubscribe the machine")

    def a_failed_rank_is_reported() -> None:
        assert bad.exitcode is not None, f"launch did not return within {timeout:.0f} s after rank 1 failed"
        assert bad.exitcode != 0, "launch returned normally although rank 1 raised: a failed rank goes unnoticed"

    return _grade("drill 8: two ranks from a notebook", {
        "a function defined in the notebook runs on 2 ranks, which end with the same weights": two_ranks_same_weights,
        "each rank runs torch on one thread": one_thread_per_rank,
        "launch raises when a rank fails": a_failed_rank_is_reported,
    })


def _drill_8_launch(launch: Callable[[int, Callable[[], None]], Any], fn: Callable[[], None], threads: int) -> None:
    """Call the launcher as a notebook kernel would: no launcher's variables, the kernel's threads."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
        os.environ.pop(name, None)
    torch.set_num_threads(threads)
    launch(2, fn)
# --8<-- [end:drill_8]


# --8<-- [start:drill_10]
import math


def grade_drill_10(replicated_gb: float, sharded_gb: float, allreduce_gb: float, young_minutes: float,
                   tolerance: float = 0.02) -> Results:
    """Drill 10: your four numbers, in GB (1e9 bytes) and minutes, each within `tolerance` (2 %)."""
    params, gpus, grads_gb, save_s, mtbf_s = 7e9, 8, 4.0, 30.0, 3.09 * 3600

    def check(got: float, want: float, formula: str, slips: dict[float, str]) -> Callable[[], None]:
        def run() -> None:
            near = [why for value, why in slips.items() if abs(got - value) <= tolerance * value]
            assert abs(got - want) <= tolerance * want, (
                f"{got:g}, want {want:.3g} = {formula}" + (f"; {near[0]}" if near else ""))
        return run

    return _grade("drill 10: numbers without a calculator", {
        "7B model state, replicated (GB per GPU)": check(
            replicated_gb, params * 16 / 1e9, "7e9 x 16 bytes (bf16 weights 2 + grads 2 + fp32 master 4 + Adam 8)",
            {params * 4 / 1e9: "4 bytes per parameter counts the weights alone",
             params * 2 / 1e9: "2 bytes per parameter counts the bf16 weights alone"}),
        "sharded over 8 GPUs (GB per GPU)": check(
            sharded_gb, params * 16 / gpus / 1e9, "7e9 x 16 bytes / 8",
            {params * 4 / gpus / 1e9: "4 bytes per parameter counts the weights alone"}),
        "ring all-reduce of 4 GB over 8 GPUs (GB sent per GPU)": check(
            allreduce_gb, 2 * (gpus - 1) / gpus * grads_gb, "2 (N - 1) / N x S",
            {grads_gb: "the ring's reduce-scatter and its all-gather each send (N - 1) / N x S",
             (gpus - 1) / gpus * grads_gb: "that is the reduce-scatter alone; the all-gather sends as much"}),
        "Young's interval, 30 s save, 3.09 h MTBF (minutes)": check(
            young_minutes, math.sqrt(2 * save_s * mtbf_s) / 60, "sqrt(2 C M), C and M in seconds",
            {math.sqrt(save_s * mtbf_s) / 60: "sqrt(C M) leaves out the 2"}),
    })
# --8<-- [end:drill_10]

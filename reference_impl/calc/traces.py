"""What PyTorch itself does at scale, logged on one CPU: collectives, pipeline schedules, FLOPs.

Three recorders, each the ground truth one of the calculators in `reference_impl.calc` is
tested against (`tests/test_traces_certified.py`):

- `CollectiveLog`, a `TorchDispatchMode` that records every collective a model issues (the
  `c10d` ops behind `torch.distributed` and the `_c10d_functional` ops behind DTensor) with
  its full size and group size. Under the fake process group
  (`torch.testing._internal.distributed.fake_pg`) a world of 1,024 ranks costs one process,
  so DDP, FSDP2, HSDP and tensor parallel can be logged at the sizes they run at.
- `schedule_order` and `replay`: the per-rank action order that each schedule of
  `torch.distributed.pipelining` builds (its `pipeline_order`, computed without ranks or
  tensors from stub stages), replayed with the dependencies between stages to find the
  share of the step each rank waits.
- `training_flops`: `FlopCounterMode` over one forward and backward, with the math
  attention backend (the CPU flash kernel is missing from the counter's registry).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# --------------------------------------------------------------------------- collectives


@dataclass(frozen=True)
class Collective:
    """One collective as a rank issues it: `size_bytes` is the full (gathered, unreduced)
    tensor's size, `group_size` the ranks it spans."""

    kind: str
    size_bytes: int
    group_size: int

    @property
    def bytes_per_rank(self) -> float:
        """Bytes each rank sends in a ring: `(N - 1) / N` of the size for an all-gather or a
        reduce-scatter, twice that for an all-reduce (a reduce-scatter then an all-gather)."""
        share = (self.group_size - 1) / self.group_size
        return share * self.size_bytes * (2 if self.kind == "all_reduce" else 1)


def _nbytes(tensors: Any) -> int:
    """Bytes of a tensor or of a (nested) list of tensors."""
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


def _size_of_group(group: Any) -> int:
    """Ranks in a process group passed to a c10d op (a boxed `ProcessGroup`) or named by a
    functional collective (its registered name)."""
    if isinstance(group, str):
        return dist.distributed_c10d._resolve_process_group(group).size()  # type: ignore[arg-type]
    return dist.ProcessGroup.unbox(group).size()


# op name -> (kind, how to read (full size, group size) from its arguments)
_READERS: dict[str, tuple[str, Callable[[tuple[Any, ...]], tuple[int, int]]]] = {
    # torch.distributed (c10d): the in-place ops FSDP2 and DDP issue
    "c10d._allgather_base_": ("all_gather", lambda a: (_nbytes(a[0]), _size_of_group(a[2]))),
    "c10d.allgather_": ("all_gather", lambda a: (_nbytes(a[0]), _size_of_group(a[2]))),
    "c10d._reduce_scatter_base_": ("reduce_scatter", lambda a: (_nbytes(a[1]), _size_of_group(a[2]))),
    "c10d.reduce_scatter_": ("reduce_scatter", lambda a: (_nbytes(a[1]), _size_of_group(a[2]))),
    "c10d.allreduce_": ("all_reduce", lambda a: (_nbytes(a[0]), _size_of_group(a[1]))),
    "c10d.broadcast_": ("broadcast", lambda a: (_nbytes(a[0]), _size_of_group(a[1]))),
    # functional collectives (DTensor): the group is named, the output allocated by the op
    "_c10d_functional.all_gather_into_tensor": ("all_gather", lambda a: (_nbytes(a[0]) * a[1], a[1])),
    "_c10d_functional.reduce_scatter_tensor": ("reduce_scatter", lambda a: (_nbytes(a[0]), a[2])),
    "_c10d_functional.all_reduce": ("all_reduce", lambda a: (_nbytes(a[0]), _size_of_group(a[2]))),
}
# Ops that move nothing themselves (waiting on a functional collective's result).
_SILENT = {"_c10d_functional.wait_tensor", "c10d.barrier"}


class CollectiveLog(TorchDispatchMode):
    """Records each collective issued inside `with CollectiveLog() as log:` into `log.calls`.

    A collective this log cannot read raises, so a new kind of traffic is never dropped
    from the totals unnoticed.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Collective] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        name = func.overloadpacket._qualified_op_name.replace("::", ".")
        if name in _READERS:
            kind, read = _READERS[name]
            self.calls.append(Collective(kind, *read(args)))
        elif name.split(".")[0] in ("c10d", "_c10d_functional") and name not in _SILENT:
            raise NotImplementedError(f"CollectiveLog cannot read {name}")
        return func(*args, **(kwargs or {}))

    def count(self, kind: str) -> int:
        """How many collectives of `kind` ("all_gather", "reduce_scatter", "all_reduce") ran."""
        return sum(call.kind == kind for call in self.calls)

    def bytes_per_rank(self, kind: str, group_size: int | None = None) -> float:
        """Ring bytes each rank sent in collectives of `kind` (over groups of `group_size`)."""
        return sum(call.bytes_per_rank for call in self.calls
                   if call.kind == kind and group_size in (None, call.group_size))


def ddp_comm_hook(group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default all-reduce of one gradient bucket, completed at once.

    The built-in hook returns the collective's future, which the fake process group leaves
    empty (DDP's reducer then asserts); this issues the same all-reduce over the same
    bucket and hands back the bucket itself, which is all the reducer reads.
    """
    dist.all_reduce(bucket.buffer(), group=group)
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


# DDP checks the hook's annotations against the real classes; postponed annotations are strings.
ddp_comm_hook.__annotations__.update(bucket=dist.GradBucket, **{"return": torch.futures.Future[torch.Tensor]})


# --------------------------------------------------------------------- pipeline schedules

# Time of each action, in units of one forward: F, I (backward for inputs) and W (backward
# for weights) take one unit each, as the zero-bubble paper assumes; a full backward B is I + W.
COST = {"F": 1, "I": 1, "W": 1, "B": 2}
# V-shaped schedules place chunk 0 and chunk 2p - 1 (the first and last stages) on rank 0.
_V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")


def schedules() -> list[str]:
    """Names of the training schedules `torch.distributed.pipelining` ships."""
    import torch.distributed.pipelining.schedules as shipped

    return sorted(name for name in dir(shipped) if name.startswith("Schedule")
                  and isinstance(getattr(shipped, name), type))


def schedule_order(name: str, stages: int, microbatches: int, interleave: int = 1) -> dict[int, list[Any]]:
    """The per-rank action order (`pipeline_order`) schedule `name` builds for `stages` ranks,
    `microbatches` micro-batches and `interleave` model chunks per rank.

    The schedule is built for rank 0 from stub stages: it computes every rank's order
    without touching a process group or a tensor. Single-stage schedules (GPipe, 1F1B)
    take one chunk per rank.
    """
    import torch.distributed.pipelining.schedules as shipped

    cls = getattr(shipped, name)
    n = stages * interleave

    def stub(index: int) -> Any:
        return SimpleNamespace(stage_index=index, num_stages=n, group_size=stages, group_rank=0,
                               is_first=index == 0, is_last=index == n - 1, submod=None,
                               stage_index_to_group_rank={})

    if issubclass(cls, shipped.PipelineScheduleSingle):
        if interleave != 1:
            raise ValueError(f"{name} runs one chunk per rank, got interleave={interleave}")
        return dict(cls(stub(0), microbatches).pipeline_order)
    chunks = [0, n - 1] if name in _V_SHAPED else [k * stages for k in range(interleave)]
    return dict(cls([stub(index) for index in chunks], microbatches).pipeline_order)


def _compute_actions(action: Any) -> list[tuple[str, int, int]]:
    """The compute steps (kind, stage, micro-batch) inside one entry of a pipeline order:
    none for an idle slot or a communication step, the parts of an overlapped F and B in turn."""
    if action is None:
        return []
    if action.sub_actions:
        return [step for sub in action.sub_actions for step in _compute_actions(sub)]
    kind = action.computation_type.value
    return [(kind, action.stage_index, action.microbatch_index)] if kind in COST else []


def replay(order: dict[int, Iterable[Any]]) -> float:
    """Idle share of a step that runs `order`: 1 - busy time / (ranks x step time).

    Each rank runs its actions in order (skipping idle slots: the runtime waits on the
    messages instead), each as soon as the rank is free and what it needs is done: a
    forward needs the previous stage's forward of that micro-batch; a backward (B or I)
    needs this stage's forward and the next stage's backward; W needs this stage's I.
    Transfers take no time. Actions cost `COST` units.

    Raises:
        ValueError: The order deadlocks (names each rank's first action that cannot run).
    """
    steps = {rank: [s for action in actions for s in _compute_actions(action)] for rank, actions in order.items()}
    last_stage = max(stage for rank_steps in steps.values() for _, stage, _ in rank_steps)

    def needs(kind: str, stage: int, mb: int) -> list[tuple[str, int, int]]:
        if kind == "F":
            return [("F", stage - 1, mb)] if stage else []
        if kind == "W":
            return [("I", stage, mb)]
        return [("F", stage, mb)] + ([("grad", stage + 1, mb)] if stage < last_stage else [])

    finished: dict[tuple[str, int, int], int] = {}
    free: dict[int, int] = defaultdict(int)
    position: dict[int, int] = defaultdict(int)
    progressed = True
    while progressed:  # sweep the ranks until none can start its next action
        progressed = False
        for rank, rank_steps in steps.items():
            while position[rank] < len(rank_steps):
                kind, stage, mb = rank_steps[position[rank]]
                before = needs(kind, stage, mb)
                if any(b not in finished for b in before):
                    break
                end = max([free[rank]] + [finished[b] for b in before]) + COST[kind]
                finished[(kind, stage, mb)] = free[rank] = end
                if kind in "BI":  # the input gradient the previous stage waits for
                    finished[("grad", stage, mb)] = end
                position[rank] += 1
                progressed = True
    stuck = {rank: f"{stage}{kind}{mb}" for rank, (kind, stage, mb) in
             ((r, steps[r][position[r]]) for r in steps if position[r] < len(steps[r]))}
    if stuck:
        raise ValueError(f"the order deadlocks; first actions that cannot run, by rank: {stuck}")
    busy = sum(COST[kind] for rank_steps in steps.values() for kind, _, _ in rank_steps)
    return 1 - busy / (len(steps) * max(free.values()))


def runtime_1f1b_order(order: dict[int, list[Any]]) -> dict[int, list[Any]]:
    """`Schedule1F1B.pipeline_order` as its runtime executes it.

    In torch 2.13 the order numbers the last rank's forwards 1 to m where
    `Schedule1F1B._step_microbatches` runs micro-batches 0 to m - 1 (the last rank has no
    warm-up forward, and the counter is bumped before its first use), so replayed as
    shipped the order deadlocks. This renumbers those forwards.
    """
    last = max(order)
    fixed = [a._replace(microbatch_index=a.microbatch_index - 1)
             if a is not None and a.computation_type.value == "F" else a for a in order[last]]
    return {**order, last: fixed}


# ------------------------------------------------------------------------------- FLOPs


def training_flops(model: torch.nn.Module, loss: Callable[[torch.Tensor], torch.Tensor], *inputs: Any) -> int:
    """FLOPs of one forward and backward of `model(*inputs)`, as `FlopCounterMode` counts them.

    Attention runs on the math backend: the CPU flash kernel is not in the counter's
    registry and would count as zero.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        loss(model(*inputs)).backward()
    return int(counter.get_total_flops())

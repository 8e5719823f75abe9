"""The site's tensor-parallel, sequence-parallel and collective snippets at 8 simulated ranks.

`torch.distributed._local_tensor.LocalTensorMode` holds the tensors of all 8 ranks in one
process and runs every collective that DTensor or `torch.distributed` issues with real
numbers on them, over a process group of the "fake" backend (the group only supplies a
world size and rank layout; the mode does the arithmetic). So a snippet runs as at 8 ranks,
with every shape at 64, in seconds, and each rank's result is compared with one device.

Run here, each rank within 1e-6 of one device:
- `model.py:tp_plan` applied by `parallel/tensor_parallel.py:apply_plan` (tensor parallel with
  sequence-parallel norms, on the parallelism page): logits and every gradient.
- `parallel/mesh.py:axes` through `ParallelDims` and the `parallel/registry.py:registry` entry for tensor
  parallel: on a 2 x 4 (data x tensor) mesh each tensor-parallel group reads one data shard.
- The collectives the pages rely on: all-reduce (sum and the mean that
  `notebook.py:resume_loop` logs), and an all-reduce as a reduce-scatter plus an all-gather.

Kept on gloo processes, because they cannot run under LocalTensorMode in torch 2.13:
- FSDP2 (`parallel/data_parallel.py:data_parallel`'s `fsdp`): `fully_shard` fails with "resize_() on an
  invalid python storage" (pinned below); tests/distributed/test_fsdp.py and
  tests/distributed/test_eight_ranks.py prove it on real ranks.
- DDP (`parallel/data_parallel.py:data_parallel`'s `ddp`, `interview_core.py`, `notebook.py:model`, the
  accumulation pitfall in `counterexamples.py`): DDP's C++ reducer needs real storage ("its
  data is not allocated yet", pinned below); tests/distributed/test_ddp.py.
- `debug_demos.py:mismatch` and `:stuck`: their bug is one process differing from the
  others (another shape, a rank that never arrives), which one process simulating every
  rank cannot express; tests/distributed/test_debugging.py.
- The whole programs of `interview_core.py` and `notebook.py` (their own gloo group, files on
  disk, object collectives) run under torchrun in their own tests.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from reference_impl.config import TrainConfig
from reference_impl.model import build_model, loss_fn
from reference_impl.parallel import data_parallel, tensor_parallel
from reference_impl.parallel import registry as parallel

WORLD = 8
TOL = 1e-6
BATCH = 4  # sequences per data-parallel shard


@pytest.fixture(scope="module")
def world() -> Iterator[None]:
    """One fake process group of 8 ranks for the whole module: LocalTensorMode needs a
    default group for the world size and meshes, and does every collective itself."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=WORLD, store=FakeStore())
    yield
    dist.destroy_process_group()


def _config(**overrides: object) -> TrainConfig:
    """The trainer's transformer with every dimension at 64, checked for tensor parallel."""
    fields: dict[str, object] = dict(model="transformer", world_size=WORLD, vocab_size=64, seq_len=64,
                                     d_model=64, n_heads=8, hidden_dim=64, n_layers=2)
    return TrainConfig(**(fields | overrides))  # type: ignore[arg-type]


def _per_rank(t: torch.Tensor) -> dict[int, torch.Tensor]:
    """Each simulated rank's whole value of `t` (a DTensor is gathered first)."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    assert isinstance(t, LocalTensor), type(t)
    return dict(t._local_tensors)


def _max_error(sim: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest difference from one device over every rank and element."""
    ranks = _per_rank(sim)
    assert sorted(ranks) == list(range(WORLD))
    return max((v - ref).abs().max().item() for v in ranks.values())


class _Collectives(TorchDispatchMode):
    """Counts the collectives issued inside it, by name (all_gather_into_tensor, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = func.__name__.split(".")[0]
        # The namespace also holds waits and autograd wrappers, which move no data.
        if func.namespace == "_c10d_functional" and name != "wait_tensor" and not name.startswith("_"):
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def _tokens(cfg: TrainConfig, n: int) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (n, cfg.seq_len), generator=torch.Generator().manual_seed(1))


def test_tensor_and_sequence_parallel_at_eight_ranks_equal_one_device(world: None) -> None:
    """The model's TP plan over 8 ranks: every matmul split 8 ways, the residual stream
    split along the sequence between them, logits and every gradient as on one device.

    DTensor redistributes between any two layouts, so a plan that swaps column- and
    row-parallel still computes the right numbers with other collectives; the count pins
    the plan's own: per block an all-gather into each first matmul and a reduce-scatter out
    of each second, two all-gathers around the head, no all-reduce."""
    cfg = _config(tp_degree=WORLD)
    ref, tokens = build_model(cfg), _tokens(cfg, BATCH)
    logits = ref(tokens)
    loss_fn(logits, tokens).backward()
    with LocalTensorMode(WORLD):
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
        model = tensor_parallel.parallelize(build_model(cfg), mesh, cfg)
        qkv = model.get_submodule("blocks.0.qkv").weight
        assert qkv.to_local().shape[0] == 3 * cfg.d_model // WORLD, "each rank holds one head"
        with _Collectives() as comm:
            out = model(tokens)
        loss_fn(out, tokens).backward()
        assert _max_error(out, logits) < TOL
        assert comm.counts == {"all_gather_into_tensor": 2 * cfg.n_layers + 2,
                               "reduce_scatter_tensor": 2 * cfg.n_layers}
        for (name, p), p_ref in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert p.grad is not None and p_ref.grad is not None
            assert _max_error(p.grad, p_ref.grad) < TOL, name


def test_each_tensor_parallel_group_of_the_mesh_reads_one_data_shard(world: None) -> None:
    """8 ranks as 2 data shards x 4 tensor-parallel ranks, laid out by `ParallelDims` and
    split by the registry's tensor-parallel wrap: every rank's logits equal one device's on
    the data shard its `dp_rank` names, which holds only if each tp group shares its samples."""
    cfg = _config(tp_degree=4, strategy="fsdp", n_layers=1)  # the layout, not the plan: one block
    dims = parallel.dims_of(cfg)
    assert (dims.dp_size, dims.tp) == (2, 4)
    ref, tokens = build_model(cfg), _tokens(cfg, dims.dp_size * BATCH)
    shards = tokens.split(BATCH)
    with LocalTensorMode(WORLD) as mode, torch.no_grad():
        wrap = parallel.PARALLELISMS["tp"].wrap
        model = wrap(build_model(cfg), dims.device_mesh["tp"], cfg)
        out = _per_rank(model(mode.rank_map(lambda r: shards[dims.dp_rank(r)])))
        for rank, logits in out.items():
            assert (logits - ref(shards[dims.dp_rank(rank)])).abs().max().item() < TOL, rank


@pytest.mark.parametrize("op", [dist.ReduceOp.SUM, dist.ReduceOp.AVG], ids=["sum", "avg"])
def test_all_reduce_equals_one_device_and_a_reduce_scatter_plus_all_gather(
        world: None, op: dist.ReduceOp) -> None:
    """Each rank contributes its own 64 x 64 tensor: the all-reduce leaves the sum (or
    mean) of all 8 on every rank, and a reduce-scatter followed by an all-gather gives the
    same bytes, the identity behind the tensor-parallel communication count."""
    inputs = torch.randn(WORLD, 64, 64, generator=torch.Generator().manual_seed(2))
    expected = inputs.sum(0) if op == dist.ReduceOp.SUM else inputs.mean(0)
    with LocalTensorMode(WORLD) as mode:
        reduced = mode.rank_map(lambda r: inputs[r].clone())
        dist.all_reduce(reduced, op=op)
        shard = mode.rank_map(lambda r: torch.empty(64 // WORLD, 64))
        dist.reduce_scatter_single(shard, mode.rank_map(lambda r: inputs[r].clone()), op=op)
        gathered = mode.rank_map(lambda r: torch.empty(64, 64))
        dist.all_gather_single(gathered, shard)
        assert _max_error(reduced, expected) < TOL
        assert _max_error(gathered, expected) < TOL


def _fsdp2(model: nn.Module, cfg: TrainConfig) -> None:
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp_shard",))
    data_parallel.fsdp(model, mesh, cfg)
    # It fails where FSDP2 frees the gathered parameters: here, after the root's backward.
    model(torch.zeros(1, cfg.input_dim)).sum().backward()


def _ddp(model: nn.Module, cfg: TrainConfig) -> None:
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp_replicate",))
    data_parallel.ddp(model, mesh, cfg)


@pytest.mark.parametrize(("wrap", "error"), [(_fsdp2, "resize_"), (_ddp, "data is not allocated")],
                         ids=["fsdp2", "ddp"])
def test_data_parallel_wrappers_still_need_real_processes(
        world: None, wrap: Callable[[nn.Module, TrainConfig], None], error: str) -> None:
    """Why FSDP2 and DDP stay on gloo processes: under LocalTensorMode they fail. When a
    torch release lifts this, this test fails and they can join the ones above."""
    cfg = TrainConfig(model="mlp", world_size=WORLD)  # the smallest model: only the failure matters
    with LocalTensorMode(WORLD), pytest.raises(RuntimeError, match=error):
        wrap(build_model(cfg), cfg)

"""PyTorch's own memory accounting for Llama-shaped models under FSDP2, against `calc.memory`.

`python -m reference_impl.calc.memory_grid` builds each configuration of the grid on fake
tensors (`FakeTensorMode`: shapes and dtypes, no storage) with a fake process group of the
configuration's world size (`torch.testing._internal.distributed.fake_pg`), applies FSDP2
`fully_shard` to every block and to the root with the trainer's bf16
`MixedPrecisionPolicy` (fp32 gradient reduction), runs two AdamW steps under PyTorch's
`FSDPMemTracker`, and records the tracker's per-rank peak by category next to
[`calc.memory`][reference_impl.calc.memory]'s answer for the same inputs. The full grid is
written to `docs/data/memory_grid.json`, the reduced one to `memory_grid_reduced.json`, each
after every configuration; a 7B configuration takes one to three minutes on one CPU core
and a few hundred MB of memory, since no tensor has real storage, and larger ones longer.

    python -m reference_impl.calc.memory_grid                 # the full grid into docs/data
    python -m reference_impl.calc.memory_grid --reduced       # the test suite's grid, in a minute
    python -m reference_impl.calc.memory_grid --out /tmp      # somewhere else
    python -m reference_impl.calc.memory_grid --only "405B"   # re-run matching rows, keep the rest

The model is Llama's block without rotary embeddings (which add no parameters and, under
`torch.compile`, no stored activations): RMSNorm, a fused bias-free q/k/v projection with
grouped-query attention through `scaled_dot_product_attention`, the output projection,
RMSNorm, SwiGLU; untied input embedding and output projection around the blocks, a final
RMSNorm, and a cross-entropy loss.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from reference_impl.calc.shapes import LLAMA3_70B, LLAMA3_405B, LLAMA_7B, LLAMA_13B, Shape, fsdp2_memory, llama_params

COMMAND = "python -m reference_impl.calc.memory_grid"
DEFAULT_OUT = Path(__file__).resolve().parents[2] / "docs" / "data"

# The tracker's category names, mapped to the calculator's outputs that predict them.
CATEGORIES = {"Sharded Param": "sharded_params_bytes", "Unsharded Param": "unsharded_params_bytes",
              "Sharded Grad": "sharded_grads_bytes", "OptState": "optimizer_state_bytes",
              "All Gather": "all_gather_bytes", "Reduce Scatter": "reduce_scatter_bytes",
              "Activation": "activation_bytes", "Temp": "temporary_bytes", "Total": "total_bytes"}


@dataclass(frozen=True)
class Config:
    """One point of the grid: a shape, its FSDP world (the ranks that shard), its batch, whether
    blocks recompute, and the replicas of that world (HSDP when more than one)."""

    shape: Shape
    world_size: int
    activation_checkpointing: bool
    seq_len: int = 4096
    micro_batch: int = 1
    replicas: int = 1
    tp: int = 1
    sequence_parallel: bool = False

    @property
    def label(self) -> str:
        """A short name for tables: model, ranks, recompute."""
        sharding = f"HSDP {self.replicas} x {self.world_size}" if self.replicas > 1 else f"FSDP {self.world_size}"
        if self.tp > 1:
            sharding += f" x TP {self.tp}{' + SP' if self.sequence_parallel else ''}"
        return (f"{self.shape.name}, {self.shape.n_layers} layers, {sharding}, "
                f"seq {self.seq_len}, AC {'on' if self.activation_checkpointing else 'off'}")


class Block(nn.Module):
    """A Llama decoder block (no rotary embedding)."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = shape.n_heads, shape.n_kv_heads
        self.head_dim = shape.hidden // shape.n_heads
        kv = self.n_kv_heads * self.head_dim
        self.attention_norm = nn.RMSNorm(shape.hidden)
        self.qkv = nn.Linear(shape.hidden, shape.hidden + 2 * kv, bias=False)
        self.wo = nn.Linear(shape.hidden, shape.hidden, bias=False)
        self.ffn_norm = nn.RMSNorm(shape.hidden)
        self.w1 = nn.Linear(shape.hidden, shape.ffn_hidden, bias=False)
        self.w3 = nn.Linear(shape.hidden, shape.ffn_hidden, bias=False)
        self.w2 = nn.Linear(shape.ffn_hidden, shape.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attention and SwiGLU, each behind RMSNorm and a residual connection."""
        # Head counts are this rank's (tensor parallel divides them); the sequence length is
        # the projection's (sequence parallel gathers it there), hence -1.
        b, q_width, kv = x.shape[0], self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = self.qkv(self.attention_norm(x)).split([q_width, kv, kv], dim=-1)
        q = q.view(b, -1, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, -1, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, -1, self.n_kv_heads, self.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        x = x + self.wo(o.transpose(1, 2).reshape(b, -1, q_width))
        y = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(y)) * self.w3(y))


class Llama(nn.Module):
    """Untied embedding, decoder blocks, final RMSNorm, output projection."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.embedding = nn.Embedding(shape.vocab_size, shape.hidden)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.n_layers))
        self.norm = nn.RMSNorm(shape.hidden)
        self.output = nn.Linear(shape.hidden, shape.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits for every position."""
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.output(self.norm(x))


@contextmanager
def fake_world(world_size: int, replicas: int = 1) -> Iterator[DeviceMesh]:
    """A fake process group of `replicas x world_size` ranks (this process is rank 0), its mesh
    (2-D, replicate by shard, for HSDP), and fake tensors (the mesh is built first: it reads
    its rank map, which fake tensors lack)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=replicas * world_size, store=FakeStore())
    try:
        mesh = (init_device_mesh("cpu", (replicas, world_size), mesh_dim_names=("replicate", "shard"))
                if replicas > 1 else init_device_mesh("cpu", (world_size,)))
        with FakeTensorMode():
            yield mesh
    finally:
        dist.destroy_process_group()


def fsdp2(model: Llama, mesh: DeviceMesh, activation_checkpointing: bool) -> None:
    """Shard `model` as the trainer does: every block (recomputed in backward when asked), then
    the root, under the bf16 `MixedPrecisionPolicy` with fp32 gradient reduction."""
    from torch.distributed._composable.checkpoint_activation import checkpoint
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        if activation_checkpointing:
            checkpoint(block)
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def track(config: Config) -> dict[str, int]:
    """The tracker's per-rank peak bytes by category for one training step of `config`.

    Two steps run; the tracker's statistics are reset after the first, so the peak is that
    of a steady-state step, with the optimizer state allocated.
    """
    if config.tp > 1:
        return track_tensor_parallel(config)
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    shape = config.shape
    with fake_world(config.world_size, config.replicas) as mesh:
        with torch.device("meta"):
            model = Llama(shape)
        fsdp2(model, mesh, config.activation_checkpointing)
        model.to_empty(device="cpu")
        # foreach=False: under fake tensors the tracker counts the foreach kernels' temporaries
        # at the unsharded size (megabytes where a real run allocates kilobytes); the per-tensor
        # loop allocates what a real run does.
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        tokens = torch.randint(0, shape.vocab_size, (config.micro_batch, config.seq_len))
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs((tokens,))
        with tracker:
            _steps(model, optimizer, tokens, tracker.reset_mod_stats, nullcontext)
        (peak,) = tracker.get_tracker_snapshot("peak").values()
    return {getattr(key, "value", str(key)): int(value) for key, value in peak.items()}


def _steps(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor,
           reset: Callable[[], None], loss_context: Callable[[], AbstractContextManager[Any]]) -> None:
    """Two training steps, the tracker's statistics reset after the first."""
    for step in range(2):
        with loss_context():
            # No name holds the bf16 logits: they are freed once the fp32 copy exists.
            F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 0:
            reset()


def tensor_parallel(model: Llama, mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Megatron's tensor parallelism with PyTorch's `parallelize_module`, as torchtitan applies
    it to Llama: q/k/v, w1 and w3 column-parallel, the attention output and w2 row-parallel,
    the embedding row-parallel, the output projection column-parallel with its logits left
    sharded over the vocabulary for `loss_parallel`; with `sequence_parallel`, the norms and
    the residual stream sharded over the sequence between them. Each block's head counts
    become this rank's (the fused q/k/v weight is taken as laid out rank by rank)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    between = Shard(1) if sequence_parallel else Replicate()
    root: dict[str, ParallelStyle] = {
        "embedding": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "output": ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False)}
    block: dict[str, ParallelStyle] = {
        "qkv": ColwiseParallel(input_layouts=between), "wo": RowwiseParallel(output_layouts=between),
        "w1": ColwiseParallel(input_layouts=between), "w3": ColwiseParallel(input_layouts=between),
        "w2": RowwiseParallel(output_layouts=between)}
    if sequence_parallel:
        root["norm"] = SequenceParallel()
        block |= {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
    parallelize_module(model, mesh, root)
    for layer in model.blocks:
        assert isinstance(layer, Block)
        parallelize_module(layer, mesh, block)
        layer.n_heads //= mesh.size()
        layer.n_kv_heads //= mesh.size()


def track_tensor_parallel(config: Config) -> dict[str, int]:
    """`track` for tensor parallel inside FSDP2 (a data-parallel by tensor-parallel mesh):
    PyTorch's `MemTracker`, which follows DTensor parameters (`FSDPMemTracker` does not take
    a 2-D mesh), so its categories are coarser: parameters (sharded and gathered), gradients,
    activations, temporaries, optimizer state.

    The model is parallelized and sharded on the meta device before fake tensors exist (FSDP2
    builds the 2-D mesh's rank map from a real tensor), then materialized under fake tensors.
    DTensor derives each output's global shape by running the op on fake tensors in the
    active fake mode; in a real run that is a mode of its own, which the tracker skips, but
    here it would be the grid's, and the tracker would count global-sized tensors no rank
    allocates (twice the fp32 logits in the loss's backward). Propagation gets its own mode,
    as in a real run.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.tensor import _sharding_prop
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    shape = config.shape
    dist.init_process_group("fake", rank=0, world_size=config.world_size * config.tp, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (config.world_size, config.tp), mesh_dim_names=("shard", "tp"))
        with torch.device("meta"):
            model = Llama(shape)
        tensor_parallel(model, mesh["tp"], config.sequence_parallel)
        fsdp2(model, mesh["shard"], config.activation_checkpointing)
        # The meta parameters are not the fake mode's own tensors: it may read their metadata.
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)  # as in `track`
            tokens = torch.randint(0, shape.vocab_size, (config.micro_batch, config.seq_len))
            tracker = MemTracker()
            tracker.track_external(model, optimizer, tokens)
            with tracker, mock.patch.object(_sharding_prop, "detect_fake_mode", lambda *_: None):
                _steps(model, optimizer, tokens, tracker.reset_mod_stats, loss_parallel)
            (peak,) = tracker.get_tracker_snapshot("peak").values()
    finally:
        dist.destroy_process_group()
    return {getattr(key, "value", str(key)): int(value) for key, value in peak.items()}


def predict(config: Config) -> dict[str, float]:
    """`calc.memory` for `config` as the trainer runs it: FSDP2, bf16 compute, fp32 state."""
    return fsdp2_memory(config.shape, params=llama_params(config.shape), world_size=config.world_size,
                        seq_len=config.seq_len, micro_batch=config.micro_batch,
                        activation_checkpointing=config.activation_checkpointing, tp_degree=config.tp,
                        sequence_parallel=config.sequence_parallel)


def grid() -> list[Config]:
    """The full grid: four shapes, FSDP worlds of 8 to 2,048 ranks, HSDP at 405B, recompute off
    and on; tensor parallel (with and without sequence parallel) inside FSDP at 7B and 70B."""
    worlds = {LLAMA_7B: (8, 64, 256), LLAMA_13B: (16, 128, 512), LLAMA3_70B: (64, 512, 1024),
              LLAMA3_405B: (256, 2048)}
    fsdp = [Config(shape, n, ac) for shape, sizes in worlds.items() for n in sizes for ac in (False, True)]
    # 405B as Llama 3 trained it: 8 replicas of a 256-rank shard group, 2,048 ranks in all.
    hsdp = [Config(LLAMA3_405B, 256, ac, replicas=8) for ac in (False, True)]
    tensor_parallel = [Config(LLAMA_7B, 8, False, tp=4), Config(LLAMA_7B, 8, False, tp=4, sequence_parallel=True),
                       Config(LLAMA3_70B, 64, True, tp=8, sequence_parallel=True)]
    return fsdp + hsdp + tensor_parallel


def reduced_grid() -> list[Config]:
    """Llama proportions at sizes that run in seconds (the test suite's grid): FFN 2.75-3.5 x
    hidden, grouped-query attention, tokens per rank from a quarter of the hidden size (as at
    405B) to twice it, two to four blocks, FSDP over 8 and 64 ranks and HSDP (4 replicas of 8
    and of 16), recompute off and on; tensor parallel of 4 inside FSDP of 8 with and without
    sequence parallel, and of 2 with recompute."""
    like_8b, like_70b = Shape("8B-like", 1024, 3, 16, 4, 2816, 4096), Shape("70B-like", 1024, 3, 16, 4, 3584, 4096)
    like_405b = Shape("405B-like", 2048, 3, 16, 2, 6656, 4096)
    two_blocks = Shape("2 blocks", 1024, 2, 16, 4, 2816, 8000)
    small_vocab = Shape("small vocabulary", 512, 4, 8, 2, 1792, 1024)
    tensor_parallel = Shape("tensor parallel", 512, 2, 8, 4, 1408, 4096)
    return [Config(like_8b, 8, False, 1024), Config(like_8b, 8, True, 1024), Config(like_70b, 64, True, 512),
            Config(like_405b, 64, False, 512), Config(like_405b, 64, True, 512), Config(two_blocks, 8, True, 1024),
            Config(small_vocab, 64, False, 1024), Config(like_8b, 8, True, 1024, replicas=4),
            Config(like_405b, 16, False, 512, replicas=4), Config(tensor_parallel, 8, False, 1024, tp=4),
            Config(tensor_parallel, 8, False, 1024, tp=4, sequence_parallel=True),
            Config(tensor_parallel, 8, True, 1024, tp=2)]


def row(config: Config) -> dict[str, Any]:
    """One grid point: its inputs, the tracker's peak by category, the calculator's and the error."""
    start = time.perf_counter()
    measured = track(config)
    predicted = predict(config)
    return {"config": config.label, "shape": asdict(config.shape), "world_size": config.world_size,
            "replicas": config.replicas, "activation_checkpointing": config.activation_checkpointing,
            "seq_len": config.seq_len, "micro_batch": config.micro_batch, "tp": config.tp,
            "sequence_parallel": config.sequence_parallel, "tracker": measured,
            "calculator": {key: predicted[key] for key in CATEGORIES.values()},
            "error": predicted["total_bytes"] / measured["Total"] - 1,
            "seconds": round(time.perf_counter() - start, 1)}


def config_of(row: dict[str, Any]) -> Config:
    """The configuration a committed row (as `row` writes it) was measured for."""
    return Config(Shape(**row["shape"]), row["world_size"], row["activation_checkpointing"], row["seq_len"],
                  row["micro_batch"], row.get("replicas", 1), row.get("tp", 1), row.get("sequence_parallel", False))


def main(argv: list[str] | None = None) -> int:
    """Run the grid and write `memory_grid.json` (or `memory_grid_reduced.json`) into `--out`.

    With `--only`, the configurations whose label contains one of the given texts run and
    replace their rows in the file already there; the other rows are kept as measured.
    """
    from reference_impl.bench.measure import metadata

    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the JSON file")
    parser.add_argument("--reduced", action="store_true", help="the test suite's small grid (under a minute)")
    parser.add_argument("--only", action="append", default=[], metavar="TEXT",
                        help="run only configurations whose label contains TEXT (repeatable); keep the other rows")
    args = parser.parse_args(argv)
    configs = reduced_grid() if args.reduced else grid()
    name = "memory_grid_reduced" if args.reduced else "memory_grid"
    path = args.out / f"{name}.json"
    selected = [c for c in configs if not args.only or any(text in c.label for text in args.only)]
    if not selected:
        parser.error(f"no configuration's label contains {' or '.join(map(repr, args.only))}")
    record: dict[str, Any] = {**metadata(name), "command": COMMAND + (" --reduced" if args.reduced else ""),
              "data": {"grid": "reduced" if args.reduced else "full", "rows": []}}
    args.out.mkdir(parents=True, exist_ok=True)
    measured: dict[str, dict[str, Any]] = {}
    for config in selected:
        last = measured[config.label] = row(config)
        print(f"{last['config']}: tracker {last['tracker']['Total'] / 2**30:.2f} GiB, "
              f"error {last['error']:+.2%} ({last['seconds']} s)", file=sys.stderr, flush=True)
        # The file as it is now (another `--only` run may have added rows), this run's rows
        # replacing theirs, in the grid's order (rows it does not know last); written after
        # every configuration, so a long grid leaves what it has measured.
        kept = {r["config"]: r for r in json.loads(path.read_text(encoding="utf-8"))["data"]["rows"]} \
            if args.only and path.exists() else {}
        kept.update(measured)
        order = [c.label for c in configs if c.label in kept]
        record["data"]["rows"] = [kept[label] for label in order + [k for k in kept if k not in order]]
        path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return 0

if __name__ == "__main__":
    sys.exit(main())

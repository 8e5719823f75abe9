"""The communication, bubble and FLOP calculators against PyTorch's own traces.

Collectives are logged under the fake process group at up to 1,024 ranks
(`reference_impl.calc.traces.CollectiveLog`), pipeline bubbles come from replaying the action
order `torch.distributed.pipelining` builds for each schedule it ships, and FLOPs from
`FlopCounterMode`. Where PyTorch does something the formula does not, the difference is
named and asserted exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.testing._internal.distributed.fake_pg import FakeStore

from reference_impl import calc
from reference_impl.calc import traces
from reference_impl.config import TrainConfig
from reference_impl.parallel.experts import MoE
from reference_impl.calc.memory_grid import Llama, Shape, fake_world, llama_params
from reference_impl.model import build_model, flops_per_sample, loss_fn
from reference_impl.parallel.tensor_parallel import parallelize

BANDWIDTH = 1e9  # any: only the bytes are compared
# Every dimension 0 a multiple of 1,024, so FSDP2 shards without padding at 1,024 ranks.
SHAPE = Shape("1,024-divisible", 1024, 1, 16, 8, 3072, 4096)
TOKENS = 256


def _fsdp_step(world_size: int, replicas: int = 1) -> traces.CollectiveLog:
    """One forward and backward of `SHAPE` under FSDP2 (HSDP with replicas), the trainer's bf16 policy."""
    with fake_world(world_size, replicas) as mesh:
        with torch.device("meta"):
            model = Llama(SHAPE)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        model.to_empty(device="cpu")
        tokens = torch.randint(0, SHAPE.vocab_size, (1, TOKENS))
        with traces.CollectiveLog() as log:
            F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten()).backward()
    return log


def _root_params(shape: Shape) -> int:
    """Parameters the root FSDP unit holds: embedding, final norm, output projection."""
    return 2 * shape.vocab_size * shape.hidden + shape.hidden


@pytest.mark.parametrize(("world_size", "replicas"), [(256, 1), (128, 8)], ids=["fsdp-256", "hsdp-8x128"])
def test_fsdp2_and_hsdp_bytes_equal_fsdp_comm_less_the_root_regather(world_size: int, replicas: int) -> None:
    """FSDP2 gathers in bf16 and reduce-scatters in fp32, as `fsdp_comm(param_bytes=2, grad_bytes=4)`
    says, except that the root unit is not resharded after forward, so backward does not
    gather it again: exactly one root gather less. HSDP adds one all-reduce of the sharded
    fp32 gradients across the replicas, which `ring_allreduce` prices."""
    log = _fsdp_step(world_size, replicas)
    params = llama_params(SHAPE)
    want = calc.fsdp_comm(params=params, world_size=world_size, bandwidth_bytes_per_s=BANDWIDTH,
                          param_bytes=2, grad_bytes=4)
    root_gather = (world_size - 1) / world_size * _root_params(SHAPE) * 2
    units = SHAPE.n_layers + 1
    assert (log.count("all_gather"), log.count("reduce_scatter")) == (2 * units - 1, units)
    assert log.bytes_per_rank("all_gather", world_size) == pytest.approx(want["all_gather_bytes"] - root_gather,
                                                                          rel=1e-12)
    assert log.bytes_per_rank("reduce_scatter", world_size) == pytest.approx(want["reduce_scatter_bytes"], rel=1e-12)
    if replicas == 1:
        assert log.count("all_reduce") == 0
    else:
        across = calc.ring_allreduce(size_bytes=params * 4 / world_size, world_size=replicas,
                                     bandwidth_bytes_per_s=BANDWIDTH)
        assert log.count("all_reduce") == units
        assert log.bytes_per_rank("all_reduce", replicas) == pytest.approx(across["bytes_per_rank"], rel=1e-12)


def test_ddp_all_reduce_bytes_equal_ring_allreduce_of_the_gradients_at_1024_ranks() -> None:
    """DDP all-reduces every fp32 gradient once, in buckets: `ring_allreduce` of params x 4 bytes.
    (The fake process group leaves DDP's built-in hook a future without a value, so
    `traces.ddp_comm_hook` issues the same all-reduce per bucket.)"""
    cfg = TrainConfig(model="transformer", vocab_size=512, seq_len=32, d_model=128, n_layers=2, n_heads=4,
                      hidden_dim=512)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    dist.init_process_group("fake", rank=0, world_size=1024, store=FakeStore())
    try:
        model = DistributedDataParallel(build_model(cfg), bucket_cap_mb=0.5)
        model.register_comm_hook(None, traces.ddp_comm_hook)
        with traces.CollectiveLog() as log:
            loss_fn(model(tokens), tokens).backward()
    finally:
        dist.destroy_process_group()
    params = sum(p.numel() for p in model.parameters())
    want = calc.ring_allreduce(size_bytes=params * 4, world_size=1024, bandwidth_bytes_per_s=BANDWIDTH)
    assert log.bytes_per_rank("all_reduce") == pytest.approx(want["bytes_per_rank"], rel=1e-12)


def _tp_step(tp_degree: int, n_layers: int) -> traces.CollectiveLog:
    cfg = TrainConfig(model="transformer", vocab_size=1024, seq_len=1024, d_model=2048, n_layers=n_layers,
                      n_heads=64, hidden_dim=4096)
    with fake_world(tp_degree) as mesh:
        with torch.device("meta"):
            model = build_model(cfg)
        parallelize(model, mesh, cfg)
        model.to_empty(device="cpu")
        tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
        with traces.CollectiveLog() as log:
            loss_fn(model(tokens), tokens).backward()
    return log


def test_tensor_parallel_bytes_per_layer_equal_tp_comm() -> None:
    """The trainer's plan (sequence parallel) turns each of Megatron's 4 all-reduces per layer
    into an all-gather and a reduce-scatter: the same bytes, 4 + 4 per layer. Outside the
    layers: the output projection gathers its input (and reduce-scatters its gradient) and
    gathers the logits, and backward gathers the gradient of the first block's input (split
    by sequence) back to the replicated embedding."""
    t, seq, batch, hidden, vocab = 32, 1024, 2, 2048, 1024
    one, two = _tp_step(t, 1), _tp_step(t, 2)
    per_layer = calc.tp_comm(seq_len=seq, micro_batch=batch, hidden=hidden, n_layers=1, tp_degree=t,
                             bandwidth_bytes_per_s=BANDWIDTH, activation_bytes=4)["bytes_per_layer"]
    layer = {kind: two.bytes_per_rank(kind) - one.bytes_per_rank(kind) for kind in ("all_gather", "reduce_scatter")}
    assert [two.count(kind) - one.count(kind) for kind in ("all_gather", "reduce_scatter")] == [4, 4]
    assert two.count("all_reduce") == 0
    assert layer["all_gather"] + layer["reduce_scatter"] == pytest.approx(per_layer, rel=1e-12)
    share = (t - 1) / t * 4
    head = share * seq * batch * hidden
    logits = share * seq * batch * vocab
    assert one.bytes_per_rank("all_gather") - layer["all_gather"] == pytest.approx(2 * head + logits)
    assert one.bytes_per_rank("reduce_scatter") - layer["reduce_scatter"] == pytest.approx(head)


# ---------------------------------------------------------------------- pipeline bubble

FAMILY = {"ScheduleGPipe": "1f1b", "Schedule1F1B": "1f1b", "ScheduleInterleaved1F1B": "1f1b",
          "ScheduleLoopedBFS": "1f1b", "ScheduleInterleavedZeroBubble": "zero_bubble",
          "ScheduleZBVZeroBubble": "zbv", "ScheduleDualPipeV": "zbv"}
SINGLE = ("ScheduleGPipe", "Schedule1F1B")


def test_every_shipped_schedule_has_a_bubble_formula() -> None:
    assert traces.schedules() == sorted(FAMILY)


def _grid(name: str) -> list[tuple[int, int, int]]:
    """(stages, microbatches, interleave) where both torch and the calculator accept the input."""
    if name in SINGLE:
        return [(p, m, 1) for p in (2, 4, 8, 16) for m in (p, 2 * p + 1, 4 * p)]
    if name == "ScheduleZBVZeroBubble":  # from 1 micro-batch: the V fills from about 1.5 p on
        return [(p, m, 2) for p in (1, 2, 4, 8, 16) for m in sorted({1, p, p + 1, 3 * p // 2, 2 * p, 4 * p + 1})]
    if name == "ScheduleDualPipeV":  # torch needs m >= 2 p
        return [(p, m, 2) for p in (2, 4, 8, 16) for m in (2 * p, 2 * p + 1, 4 * p)]
    chunks = (1, 2, 3) if name == "ScheduleInterleavedZeroBubble" else (2, 3)
    return [(p, m, v) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p) for v in chunks]


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_bubble_equals_a_replay_of_the_schedule_torch_builds(name: str) -> None:
    for p, m, v in _grid(name):
        order = traces.schedule_order(name, p, m, v)
        if name == "Schedule1F1B":
            order = traces.runtime_1f1b_order(order)
        want = calc.pipeline_bubble(stages=p, microbatches=m, interleave=v, schedule=FAMILY[name])
        idle = traces.replay(order)
        assert want["bubble_fraction"] == pytest.approx(idle, rel=1e-12, abs=1e-15), (name, p, m, v)
        assert want["bubble_over_ideal"] == pytest.approx(idle / (1 - idle), rel=1e-12, abs=1e-15), (name, p, m, v)


def test_1f1b_order_as_shipped_numbers_the_last_ranks_forwards_from_one() -> None:
    """torch 2.13's `Schedule1F1B.pipeline_order` (not its runtime) is off by one on the last
    rank; replayed as shipped it deadlocks. If torch fixes it, drop `runtime_1f1b_order`."""
    p, m = 4, 8
    order = traces.schedule_order("Schedule1F1B", p, m)
    forwards = [a.microbatch_index for a in order[p - 1] if a is not None and a.computation_type.value == "F"]
    assert forwards == list(range(1, m + 1))
    with pytest.raises(ValueError, match="deadlocks"):
        traces.replay(order)


def test_zero_bubble_schedules_idle_a_third_of_1f1b_or_less() -> None:
    """At p = 8, m = 32: 1F1B idles 17.9%, interleaved zero bubble (2 chunks) 3.5%, ZBV 3.5%."""
    got = {s: calc.pipeline_bubble(stages=8, microbatches=32, interleave=1 if s == "1f1b" else 2, schedule=s)
           for s in calc.PIPELINE_SCHEDULES}
    assert [round(100 * got[s]["bubble_fraction"], 1) for s in ("1f1b", "zero_bubble", "zbv")] == [17.9, 3.5, 3.5]


# ------------------------------------------------------------------------------- FLOPs


def test_training_flops_equal_flops_per_sample() -> None:
    """The trainer's transformer: `model.flops_per_sample` (6 x matmul parameters per token,
    plus 12 x layers x d_model x seq_len for attention) equals FlopCounterMode exactly."""
    cfg = TrainConfig(model="transformer", vocab_size=128, seq_len=64, d_model=64, n_layers=2, n_heads=4,
                      hidden_dim=256)
    tokens = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len))
    got = traces.training_flops(build_model(cfg), lambda logits: loss_fn(logits, tokens), tokens)
    assert got == 3 * flops_per_sample(cfg)


@pytest.mark.parametrize("n_experts", [1, 4])
def test_moe_training_flops_equal_flops_per_sample_less_the_dropped_tokens(n_experts: int) -> None:
    """With `--n-experts`, FlopCounterMode counts what `flops_per_sample` counts (top-k experts
    per token and the router) less 12 x d_model x hidden_dim for every (token, expert)
    assignment dropped over capacity: the block multiplies only the rows it keeps."""
    cfg = TrainConfig(model="transformer", vocab_size=128, seq_len=64, d_model=64, n_layers=2, n_heads=4,
                      hidden_dim=256, n_experts=n_experts)
    model, tokens = build_model(cfg), torch.randint(0, cfg.vocab_size, (3, cfg.seq_len))
    blocks = [m for m in model.modules() if isinstance(m, MoE)]
    for block in blocks:  # a tight capacity, so that experts overflow and drop tokens
        block.capacity_factor = 0.5 if n_experts > 1 else block.capacity_factor
    got = traces.training_flops(model, lambda logits: loss_fn(logits, tokens), tokens)
    dropped = sum(block.dropped for block in blocks)
    assert got == 3 * flops_per_sample(cfg) - 12 * cfg.d_model * cfg.hidden_dim * dropped
    assert (dropped > 0) is (n_experts > 1), "with several experts, the check covers drops"


def test_llama_training_flops_equal_6nt_plus_attention() -> None:
    """A Llama shape (grouped-query attention, SwiGLU): 6 x N x T + 12 x L x h x T^2, with N the
    matmul parameters (no embedding lookup, no norms); the math kernel expands the shared
    key/value heads, so attention costs as many FLOPs as with full heads."""
    shape, seq = Shape("small Llama", 128, 2, 8, 2, 384, 256), 64
    tokens = torch.randint(0, shape.vocab_size, (2, seq))
    got = traces.training_flops(Llama(shape), lambda out: F.cross_entropy(out.flatten(0, 1), tokens.flatten()),
                                tokens)
    matmul = llama_params(shape) - shape.vocab_size * shape.hidden - (2 * shape.n_layers + 1) * shape.hidden
    assert got == 2 * seq * (6 * matmul + 12 * shape.n_layers * shape.hidden * seq)

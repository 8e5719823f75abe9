"""The calculators of reference_impl.calc against real tensors, the pages' numbers and hand values.

Memory is checked against what PyTorch really allocates after an AdamW step, sharded by
FSDP2's own `fully_shard` on every rank of a fake process group (shapes without
communication); the formulas for communication, bubble, checkpoint interval and MFU are
checked against hand-computed values and small independent models of them.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.distributed as dist
from torch import nn

from reference_impl import calc
from reference_impl.config import TrainConfig
from reference_impl.model import MLP, Stage, TinyTransformer, build_model, flops_per_sample

GB = 1e9
# A 7B-class transformer shape (the playbook's activation example).
SHAPE = {"seq_len": 2048, "micro_batch": 1, "hidden": 4096, "n_heads": 32, "n_layers": 32}
AUTOCAST_BYTES = {"param_bytes": 4, "grad_bytes": 4, "master_bytes": 0, "optimizer_bytes": 8}


def _models() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {"mlp": MLP(12, 24, 5), "transformer": TinyTransformer(50, 8, 16, 2, 2, 32, 0.0)}


def _loss(model: nn.Module) -> torch.Tensor:
    if isinstance(model, MLP):
        return model(torch.randn(4, 12)).square().mean()
    return model(torch.randint(0, 50, (2, 8))).float().square().mean()


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _adam_state_bytes(optimizer: torch.optim.Optimizer, local=lambda t: t) -> int:
    # The 0-d `step` counter is one scalar per tensor, not per parameter: not in the formula.
    return _bytes(local(v) for state in optimizer.state.values() for k, v in state.items() if k != "step")


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_model_state_matches_real_tensors_after_an_adamw_step(name: str) -> None:
    """fp32 training (autocast's accounting): 4 + 4 + 0 + 8 bytes per parameter, all real."""
    model = _models()[name]
    optimizer = torch.optim.AdamW(model.parameters())
    _loss(model).backward()
    optimizer.step()
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    got = calc.memory(params=n, world_size=1, strategy="ddp", **SHAPE, **AUTOCAST_BYTES)
    assert got["params_bytes"] == _bytes(params)
    assert got["grads_bytes"] == _bytes(p.grad for p in params)
    assert got["optimizer_bytes"] == _adam_state_bytes(optimizer)
    assert got["master_bytes"] == 0
    assert got["model_state_bytes"] == 16 * n


def test_mixed_precision_model_state_is_16_bytes_per_parameter_in_real_tensors() -> None:
    """bf16 working weights and gradients, an fp32 master copy with AdamW: 2 + 2 + 4 + 8."""
    model = _models()["transformer"].to(torch.bfloat16)
    master = [p.detach().float().requires_grad_() for p in model.parameters()]
    optimizer = torch.optim.AdamW(master)
    _loss(model).backward()
    for w, p in zip(master, model.parameters()):
        w.grad = p.grad.float()
    optimizer.step()
    n = sum(p.numel() for p in master)
    got = calc.memory(params=n, world_size=1, strategy="ddp", **SHAPE)  # default bytes: 2, 2, 4, 8
    assert got["params_bytes"] == _bytes(model.parameters())
    assert got["grads_bytes"] == _bytes(p.grad for p in model.parameters())
    assert got["master_bytes"] == _bytes(master)
    assert got["optimizer_bytes"] == _adam_state_bytes(optimizer)
    assert got["model_state_bytes"] == 16 * n


def _fsdp_rank_bytes(name: str, rank: int, world_size: int) -> dict[str, int]:
    """Bytes that FSDP2 really leaves on `rank` after an AdamW step (fake process group)."""
    # The fake backend gives every collective the right shapes and no data: FSDP2 shards,
    # gathers and reduce-scatters as on a real job, in one process and in milliseconds.
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        model = _models()[name]
        for module in getattr(model, "blocks", []):
            fully_shard(module)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters())
        _loss(model).backward()
        optimizer.step()
        params = list(model.parameters())
        return {"params_bytes": _bytes(p.to_local() for p in params),
                "grads_bytes": _bytes(p.grad.to_local() for p in params),
                "optimizer_bytes": _adam_state_bytes(optimizer, lambda t: t.to_local()),
                "padded": sum(math.ceil(p.shape[0] / world_size) * p[0].numel() * p.element_size()
                              for p in params)}
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")  # the model's logits are a view; no in-place op follows
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_fsdp_per_rank_bytes_match_fully_shard_on_every_rank(name: str, world_size: int) -> None:
    """FSDP2 shards dim 0 of every tensor: the ranks together hold exactly N times the
    calculator's per-GPU bytes, and no rank more than its padded chunk."""
    n = sum(p.numel() for p in _models()[name].parameters())
    ranks = [_fsdp_rank_bytes(name, r, world_size) for r in range(world_size)]
    for strategy in ("fsdp", "zero3"):
        got = calc.memory(params=n, world_size=world_size, strategy=strategy, **SHAPE, **AUTOCAST_BYTES)
        for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
            assert sum(r[key] for r in ranks) == pytest.approx(world_size * got[key], rel=1e-12), key
            assert max(r[key] for r in ranks) >= got[key] - 1e-6
        assert all(r["params_bytes"] <= r["padded"] for r in ranks)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_zero1_and_zero2_per_rank_bytes_match_a_flat_partition(strategy: str, world_size: int) -> None:
    """ZeRO partitions the flattened fp32 state: each rank runs AdamW on its 1/N slice."""
    model = _models()["transformer"]
    _loss(model).backward()
    flat_params = torch.cat([p.detach().flatten() for p in model.parameters()])
    flat_grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    n = flat_params.numel()
    got = calc.memory(params=n, world_size=world_size, strategy=strategy, **SHAPE, **AUTOCAST_BYTES)
    held = []
    for rank in range(world_size):
        shard = flat_params.tensor_split(world_size)[rank].clone().requires_grad_()
        shard.grad = flat_grads.tensor_split(world_size)[rank].clone()
        optimizer = torch.optim.AdamW([shard])
        optimizer.step()
        grads = shard.grad if strategy == "zero2" else flat_grads  # zero1 keeps full gradients
        held.append({"params_bytes": _bytes(model.parameters()), "grads_bytes": _bytes([grads]),
                     "optimizer_bytes": _adam_state_bytes(optimizer)})
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert sum(h[key] for h in held) == pytest.approx(world_size * got[key], rel=1e-12), key
        assert max(h[key] for h in held) - min(h[key] for h in held) <= 8 * 4  # one element of 2 moments


def test_zero_stages_reproduce_figure_1_of_the_zero_paper() -> None:
    """7.5B parameters on 64 GPUs: 120, 31.4, 16.6 and 1.9 GB of model state per GPU."""
    totals = {s: calc.memory(params=7.5e9, world_size=64, strategy=s, **SHAPE)["model_state_bytes"] / GB
              for s in calc.STRATEGIES}
    assert totals["ddp"] == pytest.approx(120.0)
    assert round(totals["zero1"], 1) == 31.4
    assert round(totals["zero2"], 1) == 16.6
    assert round(totals["zero3"], 1) == 1.9
    assert totals["fsdp"] == totals["zero3"]


def test_activations_follow_korthikanti_with_and_without_checkpointing() -> None:
    """Per layer s·b·h·(34 + 5·a·s/h) bytes; checkpointing keeps 2·s·b·h per layer plus one layer."""
    s, b, h, layers = 2048, 1, 4096, 32
    unfused = calc.memory(params=7e9, world_size=8, strategy="fsdp", stores_attention_scores=True, **SHAPE)
    fused = calc.memory(params=7e9, world_size=8, strategy="fsdp", **SHAPE)
    assert round(unfused["activation_bytes_per_layer"] / GB, 2) == 0.96
    assert round(unfused["activation_bytes"] / GB, 1) == 30.6
    assert round(fused["activation_bytes"] / GB, 1) == 9.1
    assert fused["activation_bytes_per_layer"] == 34 * s * b * h
    checkpointed = calc.memory(params=7e9, world_size=8, strategy="fsdp", activation_checkpointing=True, **SHAPE)
    assert checkpointed["activation_bytes"] == layers * 2 * s * b * h + 34 * s * b * h
    assert checkpointed["total_bytes"] == checkpointed["model_state_bytes"] + checkpointed["activation_bytes"]
    assert fused["model_state_bytes"] == 16 * 7e9 / 8


def test_selective_recompute_drops_the_attention_scores_and_nothing_else() -> None:
    """Korthikanti's selective recompute: 34·s·b·h per layer, plus one layer's scores while recomputed."""
    s, b, h, a, layers = 2048, 1, 4096, 32, 32
    scores = 5 * a * s * s * b
    for transients in (False, True):
        common = {"params": 7e9, "world_size": 8, "strategy": "fsdp", "transients": transients, **SHAPE}
        unfused = calc.memory(stores_attention_scores=True, **common)
        selective = calc.memory(stores_attention_scores=True, selective_recompute=True, **common)
        fused = calc.memory(**common)
        assert selective["activation_bytes_per_layer"] == unfused["activation_bytes_per_layer"]
        if not transients:
            assert selective["activation_bytes"] == layers * 34 * s * b * h + scores
        # Fused attention already recomputes its scores: selective recompute saves nothing more.
        assert calc.memory(selective_recompute=True, **common) == fused
        assert fused["total_bytes"] < selective["total_bytes"] < unfused["total_bytes"]


@pytest.mark.parametrize("t", [2, 4, 8])
def test_tensor_and_sequence_parallel_follow_korthikanti_table_2(t: int) -> None:
    """Korthikanti et al. (2022), Table 2, bytes per layer: sbh(10 + 24/t + 5as/(ht)) with
    tensor parallel, sbh(34/t + 5as/(ht)) with sequence parallel too, sbh(34/t) with selective
    recompute on top, 2sbh/t with full recompute: each what one more layer adds."""
    s, b, h, a = 2048, 1, 12288, 96
    shape = {"params": 175e9, "world_size": 1, "strategy": "ddp", "seq_len": s, "micro_batch": b,
             "hidden": h, "n_heads": a, "stores_attention_scores": True}

    def one_more_layer(**options) -> float:
        return (calc.memory(**shape, n_layers=2, **options)["activation_bytes"]
                - calc.memory(**shape, n_layers=1, **options)["activation_bytes"])

    sbh, scores = s * b * h, 5 * a * s * s * b
    sp = {"tp_degree": t, "sequence_parallel": True}
    assert one_more_layer() == 34 * sbh + scores
    assert one_more_layer(tp_degree=t) == pytest.approx((10 + 24 / t) * sbh + scores / t, rel=1e-12)
    assert one_more_layer(**sp) == pytest.approx(34 / t * sbh + scores / t, rel=1e-12)
    assert one_more_layer(**sp, selective_recompute=True) == pytest.approx(34 / t * sbh, rel=1e-12)
    assert one_more_layer(**sp, activation_checkpointing=True) == pytest.approx(2 / t * sbh, rel=1e-12)


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_divides_the_attention_scores_by_cp_squared(cp: int) -> None:
    """A rank of a context-parallel group holds s/cp queries, each scored against one ring
    step's s/cp keys at a time: 5·a·(s/cp)²·b bytes of scores per layer, 1/cp² of one rank's."""
    s, b, a = 2048, 1, 32

    def score_bytes(cp_degree: int) -> float:
        common = {"params": 7e9, "world_size": 8, "strategy": "fsdp", "cp_degree": cp_degree, **SHAPE}
        unfused = calc.memory(stores_attention_scores=True, **common)["activation_bytes_per_layer"]
        return unfused - calc.memory(**common)["activation_bytes_per_layer"]

    assert score_bytes(1) == 5 * a * s * s * b
    assert score_bytes(cp) == 5 * a * (s // cp) * (s // cp) * b == score_bytes(1) / cp**2


def test_offloading_the_optimizer_moves_master_and_moments_to_host_memory() -> None:
    for strategy, world in (("ddp", 1), ("zero1", 8), ("fsdp", 64)):
        for transients in (False, True):
            common = {"params": 7e9, "world_size": world, "strategy": strategy, "transients": transients,
                      "gated_mlp": True, "vocab_size": 32_000, **SHAPE}
            on_gpu, offloaded = calc.memory(**common), calc.memory(offload_optimizer=True, **common)
            moved = on_gpu["master_bytes"] + on_gpu["optimizer_bytes"]
            assert moved == 12 * 7e9 / world and on_gpu["offloaded_bytes"] == 0
            assert offloaded["offloaded_bytes"] == moved
            assert offloaded["master_bytes"] == offloaded["optimizer_bytes"] == offloaded["optimizer_state_bytes"] == 0
            assert offloaded["total_bytes"] == pytest.approx(on_gpu["total_bytes"] - moved, rel=1e-12)


@pytest.mark.parametrize("transients", [False, True])
def test_gradient_accumulation_changes_only_the_gradients_held_between_micro_batches(transients: bool) -> None:
    """Activations are per micro-batch; a deferred reduce-scatter holds every gradient unsharded."""
    for strategy in calc.STRATEGIES:
        common = {"params": 7e9, "world_size": 64, "strategy": strategy, "transients": transients, **SHAPE}
        one = calc.memory(**common)
        every = calc.memory(grad_accum_steps=8, fsdp_grad_sync="every", **common)
        last = calc.memory(grad_accum_steps=8, fsdp_grad_sync="last", **common)
        assert every == one and calc.memory(fsdp_grad_sync="every", **common) == one
        assert last["activation_bytes"] == one["activation_bytes"]
        assert last["params_bytes"] == one["params_bytes"]
        assert last["optimizer_bytes"] == one["optimizer_bytes"]
        if strategy in ("ddp", "zero1"):  # gradients are whole on every rank anyway
            assert last == one
        else:
            assert last["grads_bytes"] == 2 * 7e9 == 64 * one["grads_bytes"]
            assert last["total_bytes"] > one["total_bytes"] + 0.9 * last["grads_bytes"]


def _saved_activation_bytes(n_layers: int, seq_len: int, batch: int, d_model: int) -> int:
    """Bytes autograd saves for backward in a bf16 TinyTransformer with activation checkpointing."""
    torch.manual_seed(0)
    model = TinyTransformer(50, seq_len, d_model, n_layers, 4, 2 * d_model, 0.0).to(torch.bfloat16)
    model.checkpoint_blocks = True
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randint(0, 50, (batch, seq_len)))
    return saved[0]


def test_a_compiled_loss_holds_the_logits_and_their_gradient_at_compute_bytes() -> None:
    """GPT-2 small at 96 sequences (the GPU check's MFU run): eager keeps the fp32
    log-softmax and two fp32 gradients (12 bytes per logit), the compiled loss the bf16
    logits and their bf16 gradient (4); the loss moment stays the peak, 36.8 GiB lower.
    Tensor parallel's `loss_parallel` is eager either way."""
    shape = dict(params=124e6, world_size=1, strategy="ddp", seq_len=1024, micro_batch=96, hidden=768,
                 n_heads=12, n_layers=12, vocab_size=50_304, param_bytes=4, grad_bytes=4, master_bytes=0,
                 optimizer_bytes=8, compute_bytes=2, transients=True)
    logits = 96 * 1024 * 50_304
    eager, compiled = calc.memory(**shape), calc.memory(**shape, compiled_loss=True)
    assert eager["total_bytes"] - compiled["total_bytes"] == (12 - 4) * logits
    assert compiled["temporary_bytes"] == 2 * logits
    tp = {**shape, "n_heads": 12, "tp_degree": 2}
    assert calc.memory(**tp, compiled_loss=True) == calc.memory(**tp)
    steady = {**shape, "transients": False}
    assert calc.memory(**steady, compiled_loss=True) == calc.memory(**steady)


def test_activation_checkpointing_keeps_each_layers_16_bit_input_in_real_tensors() -> None:
    """Each extra checkpointed block costs exactly its bf16 input: the calculator's 2·s·b·h."""
    s, b, h = 16, 3, 32
    real = _saved_activation_bytes(4, s, b, h) - _saved_activation_bytes(2, s, b, h)
    shape = {"seq_len": s, "micro_batch": b, "hidden": h, "n_heads": 4}
    predicted = [calc.memory(params=1e6, world_size=1, strategy="ddp", n_layers=layers,
                             activation_checkpointing=True, **shape)["activation_bytes"] for layers in (2, 4)]
    assert real == predicted[1] - predicted[0] == 2 * (2 * s * b * h)


def test_ring_allreduce_sends_2_n_minus_1_over_n_of_the_size() -> None:
    grads = 2e9  # 1B parameters, bf16 gradients
    sent = {n: calc.ring_allreduce(size_bytes=grads, world_size=n, bandwidth_bytes_per_s=50e9)["bytes_per_rank"]
            for n in (2, 8, 64, 1024)}
    assert sent == {n: 2 * (n - 1) / n * grads for n in sent}
    assert [round(v / GB, 2) for v in sent.values()] == [2.00, 3.50, 3.94, 4.00]
    eight = calc.ring_allreduce(size_bytes=grads, world_size=8, bandwidth_bytes_per_s=50e9)
    assert eight["time_s"] == pytest.approx(0.070)
    assert eight["steps"] == 14
    assert eight["bus_bandwidth"] == pytest.approx(50e9)  # nccl-tests' busbw is the link bandwidth
    slow = calc.ring_allreduce(size_bytes=grads, world_size=8, bandwidth_bytes_per_s=50e9, latency_s=1e-3)
    assert slow["time_s"] == pytest.approx(0.070 + 14e-3)
    assert slow["bus_bandwidth"] < 50e9


def test_fsdp_sends_one_and_a_half_times_ddp() -> None:
    got = calc.fsdp_comm(params=1e9, world_size=8, bandwidth_bytes_per_s=50e9)
    share = 7 / 8
    assert got["all_gather_bytes"] == pytest.approx(2 * share * 2e9)
    assert got["reduce_scatter_bytes"] == pytest.approx(share * 2e9)
    assert got["ddp_bytes_per_rank"] == pytest.approx(
        calc.ring_allreduce(size_bytes=2e9, world_size=8, bandwidth_bytes_per_s=50e9)["bytes_per_rank"])
    assert got["ratio_to_ddp"] == pytest.approx(1.5)
    assert got["time_s"] == pytest.approx(got["bytes_per_rank"] / 50e9)
    kept = calc.fsdp_comm(params=1e9, world_size=8, bandwidth_bytes_per_s=50e9, reshard_after_forward=False)
    assert kept["ratio_to_ddp"] == pytest.approx(1.0)


def test_tp_all_reduces_match_the_playbook() -> None:
    """s=4096, b=1, h=8192, bf16, TP 8, 80 layers: 64 MiB per all-reduce, 0.47 GB per layer, 37.6 GB."""
    got = calc.tp_comm(seq_len=4096, micro_batch=1, hidden=8192, n_layers=80, tp_degree=8,
                       bandwidth_bytes_per_s=400e9)
    assert got["allreduce_bytes"] == 64 * 2 ** 20
    assert got["allreduces_per_layer"] == 4
    assert round(got["bytes_per_layer"] / GB, 2) == 0.47
    assert round(got["bytes_per_microbatch"] / GB, 1) == 37.6
    assert round(got["time_s"] * 1e3) == 94
    assert got["bytes_per_layer"] == 4 * calc.ring_allreduce(
        size_bytes=got["allreduce_bytes"], world_size=8, bandwidth_bytes_per_s=1.0)["bytes_per_rank"]


def test_moe_all_to_all_sends_four_times_the_off_rank_rows() -> None:
    """8192 tokens per rank, h=4096, top-2, bf16, EP 8: one all-to-all takes in 128 MiB of
    rows, 7/8 of them leave the rank; four per layer (dispatch and combine, forward and
    backward) send 448 MiB per rank, as many received, 9.4 ms at 50 GB/s."""
    got = calc.moe_all_to_all(tokens=8192, hidden=4096, top_k=2, ep_degree=8, bandwidth_bytes_per_s=50e9)
    assert got["buffer_bytes"] == 128 * 2 ** 20
    assert got["all_to_alls_per_layer"] == 4
    assert got["bytes_per_all_to_all"] == 112 * 2 ** 20
    assert got["bytes_sent_per_layer"] == got["bytes_received_per_layer"] == 448 * 2 ** 20
    assert round(got["time_s"] * 1e3, 1) == 9.4


def _simulated_gpipe_idle_fraction(stages: int, microbatches: int) -> float:
    """Idle share of a GPipe step, by scheduling unit-time tasks on stages one by one."""
    free = [0] * stages  # when each stage is next free
    done: dict[tuple[int, int], int] = {}
    for j in range(microbatches):  # forward: stage i needs micro-batch j from stage i-1
        for i in range(stages):
            start = max(free[i], done.get((i - 1, j), 0))
            done[(i, j)] = free[i] = start + 1
    forward_end = max(free)
    back: dict[tuple[int, int], int] = {}
    for j in range(microbatches):  # backward runs from the last stage to the first
        for i in reversed(range(stages)):
            start = max(free[i], forward_end if i == stages - 1 else back.get((i + 1, j), 0))
            back[(i, j)] = free[i] = start + 1
    step = max(free)
    busy = 2 * microbatches * stages
    return 1 - busy / (stages * step)


def test_pp_comm_is_the_activation_a_trainer_stage_hands_on() -> None:
    """The bytes across one boundary are the first stage's outputs for one micro-batch (all
    its pipeline micro-batches together), and the gradient coming back has the same size."""
    cfg = TrainConfig(model="transformer", n_layers=4, d_model=32, n_heads=4, seq_len=16, vocab_size=32)
    first = Stage(build_model(cfg), 0, 2)
    micro_batch, pieces = 8, 4
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len))
    sent = [first(piece) for piece in tokens.chunk(pieces)]
    grads = torch.autograd.grad(sum(a.sum() for a in sent), sent)
    got = calc.pp_comm(seq_len=cfg.seq_len, micro_batch=micro_batch, hidden=cfg.d_model, stages=2,
                       bandwidth_bytes_per_s=1e9, activation_bytes=4)
    assert sum(a.numel() * a.element_size() for a in sent) == got["boundary_bytes"]
    assert sum(g.numel() * g.element_size() for g in grads) == got["boundary_bytes"]
    assert got["bytes_per_rank"] == got["boundary_bytes"] and got["total_bytes"] == 2 * got["boundary_bytes"]


def test_pp_comm_is_small_beside_tp_for_the_playbook_model() -> None:
    """s=4096, b=1, h=8192, bf16: 64 MiB per boundary each way; TP over 8 moves 37.6 GB for
    80 layers per micro-batch: 280 times what a middle pipeline stage sends."""
    pp = calc.pp_comm(seq_len=4096, micro_batch=1, hidden=8192, stages=8, bandwidth_bytes_per_s=50e9)
    tp = calc.tp_comm(seq_len=4096, micro_batch=1, hidden=8192, n_layers=80, tp_degree=8,
                      bandwidth_bytes_per_s=400e9)
    assert pp["boundary_bytes"] == 64 * 2 ** 20 and pp["bytes_per_rank"] == 128 * 2 ** 20
    assert round(pp["time_s"] * 1e3, 1) == 2.7
    assert round(tp["bytes_per_microbatch"] / pp["bytes_per_rank"]) == 280


@pytest.mark.parametrize(("p", "m"), [(2, 1), (4, 4), (4, 16), (8, 32), (3, 7)])
def test_pipeline_bubble_matches_a_simulated_gpipe_schedule(p: int, m: int) -> None:
    got = calc.pipeline_bubble(stages=p, microbatches=m)
    assert got["bubble_fraction"] == pytest.approx((p - 1) / (m + p - 1))
    assert got["bubble_fraction"] == pytest.approx(_simulated_gpipe_idle_fraction(p, m))
    assert got["bubble_over_ideal"] == pytest.approx((p - 1) / m)
    assert got["efficiency"] == pytest.approx(1 - got["bubble_fraction"])


def _simulated_interleaved_idle_fraction(stages: int, microbatches: int, chunks: int) -> float:
    """Idle share of an interleaved step, by scheduling every chunk's forward and backward.

    The model is cut into `stages x chunks` pieces of one tick each (a stage's share of a
    micro-batch takes `chunks` ticks); piece c lives on stage `c mod stages`. Each stage
    runs its pieces in Megatron's depth-first order (micro-batches in groups of `stages`,
    chunk by chunk), all forwards before all backwards, each piece as soon as the piece it
    depends on has finished. With `chunks` = 1 this is the GPipe schedule above.
    """
    pieces = stages * chunks
    groups = [range(g, min(g + stages, microbatches)) for g in range(0, microbatches, stages)]
    order = {i: [("F", k * stages + i, j) for g in groups for k in range(chunks) for j in g]
             + [("B", k * stages + i, j) for g in groups for k in reversed(range(chunks)) for j in g]
             for i in range(stages)}

    def needs(task: tuple[str, int, int]) -> tuple[str, int, int] | None:
        kind, piece, j = task
        if kind == "F":
            return ("F", piece - 1, j) if piece else None
        return ("F", piece, j) if piece == pieces - 1 else ("B", piece + 1, j)

    done: dict[tuple[str, int, int], int] = {}
    free, position = [0] * stages, [0] * stages
    progressed = True
    while progressed:  # sweep the stages until none can start its next piece
        progressed = False
        for i in range(stages):
            while position[i] < len(order[i]):
                task = order[i][position[i]]
                before = needs(task)
                if before is not None and before not in done:
                    break
                done[task] = free[i] = max(free[i], done[before] if before else 0) + 1
                position[i] += 1
                progressed = True
    assert position == [len(order[i]) for i in range(stages)], "the schedule deadlocked"
    busy = 2 * microbatches * chunks  # ticks of work per stage
    return 1 - busy / max(free)


@pytest.mark.parametrize(("p", "m", "v"), [(2, 2, 2), (4, 8, 2), (4, 8, 3), (2, 6, 4), (8, 16, 2), (3, 9, 3),
                                           (4, 4, 1), (3, 7, 1)])
def test_interleaved_bubble_matches_a_simulated_interleaved_schedule(p: int, m: int, v: int) -> None:
    """v chunks per stage cut the bubble's ticks to 1/v: (p - 1) / (v m + p - 1) of the step."""
    got = calc.pipeline_bubble(stages=p, microbatches=m, interleave=v)
    idle = _simulated_interleaved_idle_fraction(p, m, v)
    assert got["bubble_fraction"] == pytest.approx(idle)
    assert got["bubble_over_ideal"] == pytest.approx(idle / (1 - idle))  # idle time over busy time
    assert got["bubble_over_ideal"] == pytest.approx((p - 1) / (v * m))
    assert got["efficiency"] == pytest.approx(1 - idle)
    if v == 1:
        assert idle == pytest.approx(_simulated_gpipe_idle_fraction(p, m))


def test_pipeline_bubble_matches_the_playbook_and_interleaving_shrinks_it() -> None:
    assert [round(calc.pipeline_bubble(stages=p, microbatches=m)["bubble_fraction"], 3)
            for p, m in ((4, 4), (4, 16), (8, 32))] == [0.429, 0.158, 0.179]
    assert calc.pipeline_bubble(stages=1, microbatches=8)["bubble_fraction"] == 0
    plain = calc.pipeline_bubble(stages=4, microbatches=8)["bubble_over_ideal"]
    assert calc.pipeline_bubble(stages=4, microbatches=8, interleave=2)["bubble_over_ideal"] == plain / 2


LLAMA3_MTBF_S = 54 * 24 * 3600 / 419  # 419 interruptions in 54 days (Llama 3 paper, §3.3.4)


def test_young_and_daly_intervals_match_hand_computed_values() -> None:
    """C = 30 s, M = 11,135 s. Young: sqrt(2·30·11135.08) = 817.38 s. Daly: with
    r = C/(2M) = 0.00134709, 817.38 × (1 + sqrt(r)/3 + r/9) − 30 = 797.50 s."""
    got = calc.checkpoint_interval(checkpoint_cost_s=30, mtbf_s=LLAMA3_MTBF_S)
    assert got["young_interval_s"] == pytest.approx(817.377, abs=1e-3)
    assert got["daly_interval_s"] == pytest.approx(797.499, abs=1e-3)
    assert round(got["young_overhead_fraction"], 3) == 0.073  # the checkpointing page's 7.3%
    assert round(calc.checkpoint_interval(checkpoint_cost_s=3, mtbf_s=LLAMA3_MTBF_S)["young_interval_s"]) == 258
    # Daly's rule past its range: a save longer than 2 MTBFs checkpoints every MTBF.
    assert calc.checkpoint_interval(checkpoint_cost_s=50, mtbf_s=20)["daly_interval_s"] == 20


def _daly_expected_overhead(tau: float, c: float, m: float, r: float) -> float:
    """Daly (2006) eq. 20: wall time per unit of work, minus 1, for exponential failures."""
    return m * math.exp(r / m) * (math.exp((tau + c) / m) - 1) / tau - 1


@pytest.mark.parametrize("cost_over_mtbf", [1e-4, 1e-2, 0.1, 0.5])
def test_daly_interval_is_nearer_the_true_optimum_than_young(cost_over_mtbf: float) -> None:
    m, r = 10_000.0, 120.0
    c = cost_over_mtbf * m
    got = calc.checkpoint_interval(checkpoint_cost_s=c, mtbf_s=m, restart_s=r)
    # The true optimum of Daly's complete model, by a fine search on a log grid.
    grid = [math.sqrt(2 * c * m) * math.exp(k / 20_000) for k in range(-20_000, 20_001)]
    best = min(grid, key=lambda tau: _daly_expected_overhead(tau, c, m, r))
    assert abs(got["daly_interval_s"] - best) < abs(got["young_interval_s"] - best)
    assert got["daly_overhead_fraction"] == pytest.approx(_daly_expected_overhead(got["daly_interval_s"], c, m, r))
    assert got["daly_overhead_fraction"] <= _daly_expected_overhead(got["young_interval_s"], c, m, r)


def test_goodput_matches_hand_computed_values() -> None:
    """One GPU, MTBF 1 h (M = 3600 s), C = R = 360 s, tau = 720 s: lambda T = 0.3,
    N = e^0.3 - 1 = 0.349859, E = (3600 + 360) N = 1385.44 s; goodput 720 / E = 0.519690,
    saves 360 / E = 0.259845, restarts N R / E = R / (M + R) = 1/11, lost the rest."""
    got = calc.goodput(n_gpus=1, mtbf_gpu_hours=1, save_s=360, restart_s=360, interval_s=720)
    assert got["goodput"] == pytest.approx(0.5196901660927, abs=1e-12)
    assert got["save_fraction"] == pytest.approx(0.2598450830464, abs=1e-12)
    assert got["restart_fraction"] == pytest.approx(1 / 11, abs=1e-12)
    assert got["lost_fraction"] == pytest.approx(0.1295556599518, abs=1e-12)
    assert got["failures_per_checkpoint"] == pytest.approx(math.expm1(0.3), rel=1e-12)
    assert got["job_mtbf_s"] == 3600 and got["failures_per_day"] == 24
    # The optimum solves (1 - y) e^(y + 0.1) = 1: y = 0.383183 (by bisection), tau = 1379.46 s;
    # Daly's formula lands 0.55 s short of it, Young's 230 s long.
    best = calc.goodput(n_gpus=1, mtbf_gpu_hours=1, save_s=360, restart_s=360)
    assert best["interval_s"] == best["optimal_interval_s"] == pytest.approx(1379.45940555, abs=1e-6)
    assert best["goodput"] == got["optimal_goodput"] == pytest.approx(0.5607425743561, abs=1e-12)
    assert best["daly_interval_s"] == pytest.approx(1378.9132157, abs=1e-6)
    assert best["young_interval_s"] == pytest.approx(math.sqrt(2 * 360 * 3600))
    # Sixteen GPUs with a 16-hour MTBF each are the same job: M = 1 h.
    assert calc.goodput(n_gpus=16, mtbf_gpu_hours=16, save_s=360, restart_s=360, interval_s=720) == \
        pytest.approx(got, rel=1e-12)


@pytest.mark.parametrize("cost_over_mtbf", [1e-6, 1e-3, 0.05, 0.5, 3.0, 40.0])
def test_goodput_optimum_is_the_best_interval(cost_over_mtbf: float) -> None:
    m, r = 10_000.0, 300.0
    c = cost_over_mtbf * m
    got = calc.goodput(n_gpus=1, mtbf_gpu_hours=m / 3600, save_s=c, restart_s=r)
    tau = got["interval_s"]
    y = tau / m  # the optimality condition, (1 - y) e^(y + c/M) = 1, held to rounding
    if c / m < 20:
        assert math.log1p(-y) + y + c / m == pytest.approx(0, abs=1e-12 * max(1.0, c / m))
    else:  # 1 - y = e^-(1 + c/M) rounds away: checkpoint about once per MTBF, as Daly says past C = 2M
        assert y == pytest.approx(1, abs=1e-9)
    for factor in (0.9, 0.99, 1.01, 1.1):
        assert calc.goodput(n_gpus=1, mtbf_gpu_hours=m / 3600, save_s=c, restart_s=r,
                            interval_s=tau * factor)["goodput"] <= got["goodput"]
    shares = ("goodput", "save_fraction", "lost_fraction", "restart_fraction")
    assert sum(got[k] for k in shares) == pytest.approx(1, abs=1e-12)
    assert all(got[k] >= 0 for k in shares)


def _simulated_goodput(rng: random.Random, mtbf: float, save: float, restart: float, interval: float,
                       cycles: int) -> dict[str, float]:
    """The process calc.goodput models, played out: compute `interval`, save for `save`, fail at
    exponential times while doing either, lose the cycle's time so far, pay `restart`, retry."""
    kept = saving = lost = restarting = 0.0
    for _ in range(cycles):
        while True:
            up = rng.expovariate(1 / mtbf)
            if up >= interval + save:
                kept, saving = kept + interval, saving + save
                break
            lost, restarting = lost + up, restarting + restart
    total = kept + saving + lost + restarting
    return {"goodput": kept / total, "save_fraction": saving / total, "lost_fraction": lost / total,
            "restart_fraction": restarting / total}


@pytest.mark.parametrize(("save", "restart", "interval"), [(600, 900, 1800), (60, 300, None), (30, 0, 7200)])
def test_goodput_matches_a_monte_carlo_run_of_the_same_process(save: float, restart: float,
                                                               interval: float | None) -> None:
    """100,000 cycles, seeded. Over 20 independent batches of 2,000 cycles the first case's
    goodput had a standard error of 0.0075 per batch, so 0.0012 over 100,000 cycles:
    a tolerance of 0.005 on each share is about 4 standard errors."""
    got = calc.goodput(n_gpus=4, mtbf_gpu_hours=4, save_s=save, restart_s=restart, interval_s=interval)
    simulated = _simulated_goodput(random.Random(f"goodput-{save}-{restart}"), got["job_mtbf_s"], save, restart,
                                   got["interval_s"], 100_000)
    for key, value in simulated.items():
        assert got[key] == pytest.approx(value, abs=0.005), key


LLAMA3_GPUS = 16_384


def test_goodput_reproduces_llama3_interruptions_and_effective_time() -> None:
    """Llama 3 405B (Llama 3 paper, §3.3.4): 466 interruptions (419 unexpected) in 54 days on
    16,384 GPUs, and more than 90% effective training time. The per-GPU MTBF that gives 466
    in 54 days is 16,384 x 54 x 24 / 466 = 45,567 GPU-hours. The paper gives neither save nor
    restart cost: with a 3 s blocking save (an asynchronous one) and 10-minute restarts the
    model keeps 92.1%; and the published >90% bounds the restart, since a restart of 16 min
    leaves under 90% at any interval even with a 1 s save."""
    per_gpu = LLAMA3_GPUS * 54 * 24 / 466
    got = calc.goodput(n_gpus=LLAMA3_GPUS, mtbf_gpu_hours=per_gpu, save_s=3, restart_s=600)
    assert got["failures_per_day"] * 54 == pytest.approx(466)
    unexpected = calc.goodput(n_gpus=LLAMA3_GPUS, mtbf_gpu_hours=LLAMA3_GPUS * LLAMA3_MTBF_S / 3600, save_s=3,
                              restart_s=600)
    assert round(unexpected["failures_per_day"] * 54) == 419
    assert round(unexpected["job_mtbf_s"] / 3600, 2) == 3.09  # "one per ~3.1 h"
    assert round(got["goodput"], 3) == 0.921
    assert calc.goodput(n_gpus=LLAMA3_GPUS, mtbf_gpu_hours=per_gpu, save_s=1, restart_s=16 * 60)["goodput"] < 0.9


def test_goodput_job_mtbf_scales_as_meta_projects() -> None:
    """Meta (Kokolis et al., HPCA 2025) projects a job MTTF of 1.8 h at 16,384 GPUs and about
    14 min at 131,072. A job fails when any GPU does, so its MTBF is the per-GPU MTBF over
    n_gpus: 1.8 h x 16,384 = 29,491 GPU-hours per GPU, and that over 131,072 is 13.5 min,
    about 14 to the minute; 1.8's own precision (1.75-1.85 h) spans 13.1-13.9 min."""
    per_gpu = 1.8 * LLAMA3_GPUS
    small = calc.goodput(n_gpus=LLAMA3_GPUS, mtbf_gpu_hours=per_gpu, save_s=30, restart_s=600)
    large = calc.goodput(n_gpus=8 * LLAMA3_GPUS, mtbf_gpu_hours=per_gpu, save_s=30, restart_s=600)
    assert small["job_mtbf_s"] / 3600 == pytest.approx(1.8)
    assert abs(large["job_mtbf_s"] / 60 - 14) <= 0.5
    assert large["failures_per_day"] == pytest.approx(8 * small["failures_per_day"])
    # Eight times the failures: the optimal interval shrinks by a little more than Young's sqrt(8)
    # (a 30 s save is no longer small beside a 13.5 min MTBF) and goodput falls.
    assert math.sqrt(8) < small["interval_s"] / large["interval_s"] < 3.1
    assert large["goodput"] < small["goodput"]


def test_mfu_is_consistent_with_the_models_flop_count() -> None:
    """MFU from flops_per_sample equals the benchmark's formula; step_time inverts it."""
    cfg = TrainConfig(model="transformer")
    fps = flops_per_sample(cfg)
    samples_per_step, step_s, gpus, peak = 256, 0.05, 4, 312e12
    got = calc.mfu(flops_per_sample=fps, samples_per_step=samples_per_step, step_time_s=step_s,
                   n_gpus=gpus, peak_flops_per_gpu=peak)
    samples_per_s = samples_per_step / step_s
    assert got["samples_per_s"] == pytest.approx(samples_per_s)
    assert got["mfu"] == pytest.approx(fps * samples_per_s / (gpus * peak))  # as bench.measured_training
    assert got["ideal_step_time_s"] == pytest.approx(step_s * got["mfu"])
    back = calc.step_time(flops_per_sample=fps, samples_per_step=samples_per_step, n_gpus=gpus,
                          peak_flops_per_gpu=peak, mfu=got["mfu"])
    assert back["step_time_s"] == pytest.approx(step_s)
    assert back["achieved_flops_per_gpu"] == pytest.approx(got["achieved_flops_per_gpu"])


def test_mfu_reproduces_the_performance_page() -> None:
    """7B parameters at 3,000 tokens/s per GPU on an H100 (989 TFLOP/s): 126 TFLOP/s, 12.7%."""
    got = calc.mfu(flops_per_sample=6 * 7e9, samples_per_step=3000, step_time_s=1.0, n_gpus=1,
                   peak_flops_per_gpu=989e12)
    assert round(got["achieved_flops_per_gpu"] / 1e12) == 126
    assert round(got["mfu"], 3) == 0.127


# Each bad input, and the start of the message that must name it.
BAD_INPUTS = [
    ("memory", {"params": 0, "world_size": 8, "strategy": "fsdp", **SHAPE}, "params must be positive"),
    ("memory", {"params": 1e9, "world_size": 0, "strategy": "fsdp", **SHAPE}, "world_size must be a whole number >= 1"),
    ("memory", {"params": 1e9, "world_size": 2.5, "strategy": "fsdp", **SHAPE}, "world_size must be a whole number"),
    ("memory", {"params": 1e9, "world_size": 8, "strategy": "zero4", **SHAPE}, "strategy must be one of"),
    ("memory", {"params": 1e9, "world_size": 8, "strategy": "ddp", **{**SHAPE, "n_heads": 3}},
     "hidden (4096) must be a multiple of n_heads (3)"),
    ("memory", {"params": 1e9, "world_size": 8, "strategy": "ddp", "master_bytes": -4, **SHAPE},
     "master_bytes must not be negative"),
    ("memory", {"params": True, "world_size": 8, "strategy": "ddp", **SHAPE}, "params must be a finite number"),
    ("memory", {"params": 1e9, "world_size": 8, "strategy": "ddp", "activation_checkpointing": 1, **SHAPE},
     "activation_checkpointing must be true or false"),
    ("memory", {"params": 1e9, "world_size": 8, "strategy": "fsdp", "n_kv_heads": 5, **SHAPE},
     "Attention heads (32) must be a multiple of key/value heads (5)"),
    ("memory", {"params": 1e9, "world_size": 8, "strategy": "fsdp", "tp_degree": 3, **SHAPE},
     "Attention heads (32) and key/value heads (32) must be multiples of the tensor-parallel degree (3)"),
    ("memory", {"params": 1e9, "world_size": 8, "strategy": "fsdp", "pp_degree": 5, **SHAPE},
     "Layers (32) must be a multiple of the pipeline stages (5)"),
    ("memory", {"params": 1e9, "world_size": 8, "strategy": "fsdp", "cp_degree": 3, **SHAPE},
     "Sequence length (2048) must be a multiple of the context-parallel degree (3)"),
    ("memory", {"params": 1e9, "world_size": 8, "strategy": "fsdp", "vocab_size": -1, **SHAPE},
     "vocab_size must be a whole number >= 0"),
    ("memory", {"params": 1e9, "world_size": 8, "strategy": "fsdp", "ffn_hidden": 0, **SHAPE},
     "ffn_hidden must be a whole number >= 1"),
    ("memory", {"params": 1e9, "world_size": 8, "strategy": "fsdp", "transients": "yes", **SHAPE},
     "transients must be true or false"),
    ("memory", {"params": 1e9, "world_size": 8, "strategy": "fsdp", "activation_checkpointing": True,
                "selective_recompute": True, **SHAPE},
     "activation_checkpointing and selective_recompute exclude each other"),
    ("memory", {"params": 1e9, "world_size": 8, "strategy": "fsdp", "offload_optimizer": "yes", **SHAPE},
     "offload_optimizer must be true or false"),
    ("memory", {"params": 1e9, "world_size": 8, "strategy": "fsdp", "grad_accum_steps": 0, **SHAPE},
     "grad_accum_steps must be a whole number >= 1"),
    ("memory", {"params": 1e9, "world_size": 8, "strategy": "fsdp", "fsdp_grad_sync": "first", **SHAPE},
     "fsdp_grad_sync must be one of last, every"),
    ("ring_allreduce", {"size_bytes": 1e9, "world_size": 1, "bandwidth_bytes_per_s": 1e9},
     "world_size must be a whole number >= 2"),
    ("ring_allreduce", {"size_bytes": 1e9, "world_size": 4, "bandwidth_bytes_per_s": float("inf")},
     "bandwidth_bytes_per_s must be a finite number"),
    ("fsdp_comm", {"params": -1, "world_size": 4, "bandwidth_bytes_per_s": 1e9}, "params must be positive"),
    ("tp_comm", {"seq_len": 4096, "micro_batch": 1, "hidden": 8192, "n_layers": 80, "tp_degree": 1,
                 "bandwidth_bytes_per_s": 1e9}, "tp_degree must be a whole number >= 2"),
    ("pp_comm", {"seq_len": 4096, "micro_batch": 1, "hidden": 8192, "stages": 1, "bandwidth_bytes_per_s": 1e9},
     "stages must be a whole number >= 2"),
    ("moe_all_to_all", {"tokens": 4096, "hidden": 4096, "top_k": 2, "ep_degree": 1, "bandwidth_bytes_per_s": 1e9},
     "ep_degree must be a whole number >= 2"),
    ("moe_all_to_all", {"tokens": 4096, "hidden": 4096, "top_k": 0, "ep_degree": 8, "bandwidth_bytes_per_s": 1e9},
     "top_k must be a whole number >= 1"),
    ("pipeline_bubble", {"stages": 4, "microbatches": 6, "interleave": 2},
     "an interleaved schedule needs microbatches (6) to be a multiple of stages (4)"),
    ("pipeline_bubble", {"stages": 0, "microbatches": 6}, "stages must be a whole number >= 1"),
    ("pipeline_bubble", {"stages": 4, "microbatches": 8, "schedule": "zb"},
     "schedule must be one of 1f1b, zero_bubble, zbv, got 'zb'"),
    ("pipeline_bubble", {"stages": 4, "microbatches": 8, "schedule": "zbv"},
     "the zbv schedule runs 2 chunks per stage: interleave must be 2, got 1"),
    ("pipeline_bubble", {"stages": 4, "microbatches": 6, "schedule": "zero_bubble"},
     "the zero_bubble schedule needs microbatches (6) to be a multiple of stages (4)"),
    ("checkpoint_interval", {"checkpoint_cost_s": 0, "mtbf_s": 100}, "checkpoint_cost_s must be positive"),
    ("checkpoint_interval", {"checkpoint_cost_s": 1, "mtbf_s": 100, "restart_s": 20_000},
     "checkpoint_cost_s and restart_s must not exceed 100 x mtbf_s"),
    ("goodput", {"n_gpus": 0, "mtbf_gpu_hours": 1e4, "save_s": 30, "restart_s": 600},
     "n_gpus must be a whole number >= 1"),
    ("goodput", {"n_gpus": 8, "mtbf_gpu_hours": 0, "save_s": 30, "restart_s": 600}, "mtbf_gpu_hours must be positive"),
    ("goodput", {"n_gpus": 8, "mtbf_gpu_hours": 1e4, "save_s": 0, "restart_s": 600}, "save_s must be positive"),
    ("goodput", {"n_gpus": 8, "mtbf_gpu_hours": 1e4, "save_s": 30, "restart_s": -1}, "restart_s must not be negative"),
    ("goodput", {"n_gpus": 8, "mtbf_gpu_hours": 1e4, "save_s": 30, "restart_s": 600, "interval_s": 0},
     "interval_s must be positive"),
    ("goodput", {"n_gpus": 8, "mtbf_gpu_hours": 1, "save_s": 30, "restart_s": 600, "interval_s": 1e6},
     "save_s, restart_s and interval_s must not exceed 100 x the job's MTBF"),
    ("mfu", {"flops_per_sample": 1e12, "samples_per_step": 8, "step_time_s": 0, "n_gpus": 1,
             "peak_flops_per_gpu": 1e15}, "step_time_s must be positive"),
    ("step_time", {"flops_per_sample": 1e12, "samples_per_step": 8, "n_gpus": 1, "peak_flops_per_gpu": 1e15,
                   "mfu": 1.5}, "mfu must be at most 1"),
]


@pytest.mark.parametrize(("name", "inputs", "message"), BAD_INPUTS,
                         ids=[f"{n}-{m[:30]}" for n, _, m in BAD_INPUTS])
def test_bad_inputs_raise_a_value_error_naming_the_input(name: str, inputs: dict, message: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        getattr(calc, name)(**inputs)
    assert str(excinfo.value).startswith(message)

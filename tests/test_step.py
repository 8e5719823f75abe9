"""The optimizer step in one process: accumulation, precision, clipping, schedule, timers."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.utils.data import default_collate

from reference_impl.config import TrainConfig
from reference_impl.metrics import PhaseTimer
from reference_impl.model import build_model, loss_fn
from reference_impl.step import build_optimizer, build_scaler, build_scheduler, lr_multiplier, train_step
from reference_impl.train import build_dataset

CPU = torch.device("cpu")


def run_steps(cfg: TrainConfig, steps: int) -> tuple[list[float], torch.nn.Module]:
    data = build_dataset(cfg)
    model = build_model(cfg)
    opt = build_optimizer(model, cfg)
    sched = build_scheduler(opt, cfg)
    per_step = cfg.micro_batch_size * cfg.grad_accum_steps
    micro = (default_collate([data[j] for j in range(i, i + cfg.micro_batch_size)])
             for i in range(0, steps * per_step, cfg.micro_batch_size))
    losses = []
    for _ in range(steps):
        loss, _ = train_step(model, micro, opt, sched, build_scaler(cfg, CPU), cfg, CPU, PhaseTimer(CPU))
        losses.append(loss.item())
    return losses, model


@pytest.mark.parametrize("accum", [2, 4])
def test_accumulating_g_micro_batches_equals_one_batch_of_g_times_m(accum: int) -> None:
    base = TrainConfig(optimizer="sgd", lr=0.1, warmup_steps=0, grad_clip=0.0, micro_batch_size=8 * accum)
    accumulated = dataclasses.replace(base, micro_batch_size=8, grad_accum_steps=accum)
    ref_losses, ref = run_steps(base, 5)
    acc_losses, acc = run_steps(accumulated, 5)
    assert ref_losses == pytest.approx(acc_losses, abs=1e-6)
    for (name, p), q in zip(ref.named_parameters(), acc.parameters()):
        assert (p - q).abs().max().item() < 1e-6, name


def test_without_loss_scaling_accumulation_would_multiply_the_gradient() -> None:
    """The test above can fail: summing unscaled micro-losses gives G times the gradient.
    With SGD at lr 1 and no clipping, train_step's update over G = 2 micro-batches is
    minus the gradient of the mean loss over the whole batch, half the naive sum's."""
    cfg = TrainConfig(micro_batch_size=8, grad_accum_steps=2, optimizer="sgd", lr=1.0, warmup_steps=0,
                      grad_clip=0.0)
    data = build_dataset(cfg)
    model = build_model(cfg)
    before = [p.detach().clone() for p in model.parameters()]
    for i in range(2):  # the naive sum of unscaled micro-batch losses
        loss_fn(model(data.x[i * 8:(i + 1) * 8]), data.y[i * 8:(i + 1) * 8]).backward()
    summed = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    loss_fn(model(data.x[:16]), data.y[:16]).backward()
    full_batch = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    opt = build_optimizer(model, cfg)
    micro = iter([(data.x[i * 8:(i + 1) * 8], data.y[i * 8:(i + 1) * 8], 0) for i in range(2)])
    train_step(model, micro, opt, build_scheduler(opt, cfg), None, cfg, CPU, PhaseTimer(CPU))
    for p, b, g, naive in zip(model.parameters(), before, full_batch, summed):
        update = (b - p.detach())
        assert torch.allclose(update, g, atol=1e-6), "the step follows the full-batch gradient"
        assert torch.allclose(naive, 2 * g, atol=1e-6), "the naive sum is twice that"


def test_scaler_exists_only_for_fp16() -> None:
    assert build_scaler(TrainConfig(precision="fp16"), CPU) is not None
    assert build_scaler(TrainConfig(precision="bf16"), CPU) is None
    assert build_scaler(TrainConfig(precision="fp32"), CPU) is None


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_steps_train_and_stay_finite(precision: str) -> None:
    """12 steps suffice: the mean loss of the last 3 is well below that of the first 3."""
    cfg = TrainConfig(model="transformer", precision=precision, micro_batch_size=16, lr=1e-2,
                      warmup_steps=2, max_steps=12)
    losses, model = run_steps(cfg, 12)
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) < 0.8 * sum(losses[:3]), "loss falls"
    assert all(p.dtype == torch.float32 for p in model.parameters()), "master weights stay fp32"


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_fp16_scaler_skips_a_step_with_infinite_gradients() -> None:
    cfg = TrainConfig(precision="fp16", micro_batch_size=4)
    model = build_model(cfg)
    opt, scaler = build_optimizer(model, cfg), build_scaler(cfg, CPU)
    sched = build_scheduler(opt, cfg)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.full((4, cfg.input_dim), 1e30)  # overflows in fp16
    train_step(model, iter([(x, torch.zeros(4, dtype=torch.long), 0)]), opt, sched, scaler, cfg, CPU,
               PhaseTimer(CPU))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "the step was skipped"
    assert scaler.get_scale() < 65536.0, "and the scale backed off"


def test_gradient_clipping_bounds_the_update() -> None:
    cfg = TrainConfig(optimizer="sgd", lr=1.0, warmup_steps=0, grad_clip=1e-3, micro_batch_size=8)
    model = build_model(cfg)
    before = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    opt = build_optimizer(model, cfg)
    data = build_dataset(cfg)
    train_step(model, iter([(data.x[:8] * 100, data.y[:8], 0)]), opt, build_scheduler(opt, cfg), None,
               cfg, CPU, PhaseTimer(CPU))
    moved = torch.nn.utils.parameters_to_vector(model.parameters()) - before
    assert moved.norm().item() == pytest.approx(1e-3, rel=1e-3)


def test_schedule_warms_up_linearly_then_decays_by_cosine_to_the_floor() -> None:
    cfg = TrainConfig(max_steps=110, warmup_steps=10, min_lr_ratio=0.1)
    mult = [lr_multiplier(s, cfg) for s in range(cfg.max_steps + 1)]
    assert mult[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert mult[10] == pytest.approx(1.0)
    assert mult[60] == pytest.approx(0.55)  # halfway through the cosine
    assert mult[110] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(mult[10:], mult[11:])), "monotone after warmup"


def test_phase_timer_on_cpu_attributes_time_to_the_right_phase() -> None:
    timer = PhaseTimer(CPU)
    with timer.phase("forward"):
        torch.randn(300, 300) @ torch.randn(300, 300)
    with timer.phase("data", host=True):
        pass
    totals = timer.flush()
    assert set(totals) == {"forward", "data"} and totals["forward"] > 0
    assert timer.flush() == {}, "flush resets the window"


def test_a_failure_inside_a_phase_leaves_the_timer_naming_that_phase() -> None:
    timer = PhaseTimer(CPU)
    with pytest.raises(ZeroDivisionError), timer.phase("backward"):
        1 / 0
    assert timer.current == "backward", "the error report names the phase that failed"
    assert timer.flush() == {}, "a failed phase is not a measurement"
    with timer.phase("backward"):  # the same phase object is reused and times again
        pass
    assert timer.current == "after_backward" and set(timer.flush()) == {"backward"}


def test_adamw_on_the_cpu_keeps_pytorchs_default_kernels() -> None:
    """The fused kernel is chosen for CUDA parameters only (`tests/test_gpu.py` checks it there)."""
    cfg = TrainConfig(model="mlp", device="cpu")
    assert not build_optimizer(build_model(cfg), cfg).defaults["fused"]

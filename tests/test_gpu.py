"""The trainer on a real GPU: NCCL, bf16, compile, float8, and a bit-exact resume.

Everything here needs CUDA and is skipped without it; `scripts/gpu_check.sh` runs it on a
GPU machine with the rest of the GPU check. Each job runs under torchrun with one process
per visible GPU, as a user would start it.
"""

from __future__ import annotations

import pytest
import torch
from launch import Run, torchrun

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GPUS = torch.cuda.device_count()
# A small transformer in bf16 on NCCL: seconds per run, big enough for real kernels
# (flash attention, cuBLAS bf16 GEMMs, fused Adam paths) to be the ones that run.
BASE = ["--model", "transformer", "--device", "cuda", "--precision", "bf16", "--d-model", "256",
        "--n-layers", "4", "--n-heads", "4", "--hidden-dim", "1024", "--seq-len", "256", "--vocab-size", "4096",
        "--micro-batch-size", "8", "--dataset-size", "2048", "--max-steps", "20", "--warmup-steps", "2",
        "--log-every", "5", "--lr", "1e-3", "--pg-timeout-s", "60"]


def job(*flags: str, restarts: int = 0) -> Run:
    run = torchrun([*BASE, *flags], nproc=GPUS, max_restarts=restarts, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    return run


def losses(run: Run) -> list[float]:
    return [e["loss"] for e in run.of("step")]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_bf16_training_on_nccl_learns(strategy: str) -> None:
    run = job("--strategy", strategy)
    assert run.of("run_start")[0]["backend"] == "nccl"
    assert run.of("run_start")[0]["device"].startswith("cuda")
    curve = losses(run)  # every 5 steps; on H100 8.31, 8.25, 8.21, 8.05
    assert curve == sorted(curve, reverse=True) and curve[-1] < curve[0] - 0.1, curve


@pytest.mark.parametrize(("strategy", "saving"), [("ddp", ()), ("fsdp", ()), ("fsdp", ("--async-checkpoint",))])
def test_a_sigkill_on_cuda_resumes_to_the_uninterrupted_digest(strategy: str, saving: tuple[str, ...],
                                                               tmp_path) -> None:
    """Deterministic kernels make the GPU run repeatable; the checkpoint makes it resumable.
    An async save's copy runs on a side stream while the next step computes: equal digests
    say it copied the state of its own step."""
    flags = ["--strategy", strategy, "--deterministic", "--checkpoint-every", "5", *saving]
    reference = job(*flags, "--checkpoint-dir", str(tmp_path / "reference"))
    killed = job(*flags, "--checkpoint-dir", str(tmp_path / "killed"), "--fail-at-step", "13",
                 "--fail-rank", "0", restarts=1)
    assert [e["step"] for e in killed.of("checkpoint_restored")] == [10]
    assert killed.digest() == reference.digest()


@pytest.mark.skipif(GPUS < 2 or GPUS % 2, reason="tensor parallel on NCCL needs an even number of GPUs, at least two "
                                                  "(NCCL will not put two ranks on one)")
def test_tensor_parallel_bf16_on_nccl_learns() -> None:
    """Sequence-parallel TP pairs (FSDP2 across the pairs when there are more than two GPUs)."""
    curve = losses(job("--strategy", "fsdp", "--tp-degree", "2"))
    assert curve == sorted(curve, reverse=True) and curve[-1] < curve[0] - 0.1, curve


@pytest.mark.skipif(GPUS < 4 or GPUS % 2, reason="HSDP needs two replicas of at least two shards: four GPUs")
def test_hsdp_bf16_on_nccl_learns() -> None:
    curve = losses(job("--strategy", "fsdp", "--dp-replicate", "2"))
    assert curve == sorted(curve, reverse=True) and curve[-1] < curve[0] - 0.1, curve


def test_one_rank_more_than_the_gpus_is_refused_in_one_line() -> None:
    """Every rank counts the node's ranks against its GPUs in preflight; before, nothing did, and
    the extra rank asked `torch.cuda.set_device` for a GPU that is not there."""
    run = torchrun(BASE, nproc=GPUS + 1, timeout=120)
    assert run.returncode != 0
    refusal = (f"reference_impl.train: error: {GPUS + 1} ranks on this node but {GPUS} GPU(s) visible: each rank "
               f"needs a GPU of its own; start at most {GPUS} per node, or pass --device cpu")
    assert refusal in run.stderr, run.stderr[-3000:]


def test_compile_matches_eager_and_compiles_each_block_whole() -> None:
    eager, compiled = losses(job()), losses(job("--compile"))
    # bf16 matmuls fused differently: equal to a few bf16 ulps of the loss, not bit for bit.
    assert compiled == pytest.approx(eager, rel=2e-2), (eager, compiled)


def test_float8_training_stays_near_bf16() -> None:
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        pytest.skip("float8 matmuls need compute capability 8.9 (Ada, Hopper) or later")
    bf16, fp8 = losses(job()), losses(job("--fp8"))
    assert fp8 == pytest.approx(bf16, rel=3e-2), (bf16, fp8)


def test_adamw_on_cuda_is_the_fused_kernel_and_steps_as_the_default_does() -> None:
    """The fused kernel is a speed choice only: from the same gradients it takes the step the
    multi-tensor default takes, to fp32 rounding."""
    from reference_impl.config import TrainConfig
    from reference_impl.model import build_model
    from reference_impl.step import build_optimizer

    cfg = TrainConfig(model="transformer", device="cuda", d_model=64, n_layers=2, n_heads=4, hidden_dim=128,
                      seq_len=32, vocab_size=256, weight_decay=0.1)
    torch.manual_seed(0)
    fused_model = build_model(cfg).cuda()
    default_model = build_model(cfg).cuda()
    default_model.load_state_dict(fused_model.state_dict())
    fused = build_optimizer(fused_model, cfg)
    default = torch.optim.AdamW(default_model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    assert fused.defaults["fused"] is True and not default.defaults["fused"]
    for _ in range(3):
        grads = [torch.randn_like(p) for p in fused_model.parameters()]
        for model, optimizer in ((fused_model, fused), (default_model, default)):
            for p, g in zip(model.parameters(), grads, strict=True):
                p.grad = g.clone()
            optimizer.step()
    for a, b in zip(fused_model.parameters(), default_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


"""Each naive version in reference_impl/interview/counterexamples.py fails; the real code passes.

These tests back the handbook's Pitfalls page: every test shows the failure with real
machinery (DataLoader worker processes, real gloo process groups, subprocesses with
different hash seeds, a kernel-enforced file size limit), then the fix.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from launch import Run, forked_ranks, free_port, run_ranks
from reference_impl.interview import counterexamples as naive
from reference_impl.config import TrainConfig
from reference_impl.data import ResumableDistributedSampler
from reference_impl.step import AUTOCAST_DTYPES, build_optimizer, build_scaler, build_scheduler, lr_multiplier

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=120)


def _own_process(code: str, script: Path, **env: str) -> Run:
    """`code` run as the script `script`, with `env` added to its environment, in a process
    of its own forked from the suite's warm forkserver: for a limit that holds per process
    or a process group, where a new interpreter's start (and `PYTHONHASHSEED`) would change
    nothing."""
    script.write_text(textwrap.dedent(code))
    return forked_ranks([], nproc=1, timeout=120, module=str(script), torchrun_env=False, env=env)


# 1 ------------------------------------------------------------------------------------
def test_naive_digest_differs_between_processes() -> None:
    code = """
        import dataclasses
        from reference_impl.config import TrainConfig
        from reference_impl.interview.counterexamples import naive_digest
        cfg = TrainConfig()
        print(naive_digest(dataclasses.asdict(cfg)), cfg.digest())
    """
    runs = [_python(code, PYTHONHASHSEED=seed) for seed in ("1", "2")]
    for run in runs:
        assert run.returncode == 0, run.stderr
    (naive_a, ours_a), (naive_b, ours_b) = (run.stdout.split() for run in runs)
    assert naive_a != naive_b, "hash() of the same config differs between two processes"
    assert ours_a == ours_b and len(ours_a) == 64, "the sha256 digest is the same everywhere"


def test_hash_seed_salts_str_and_bytes_not_numbers() -> None:
    """PYTHONHASHSEED salts the hashes of str and bytes, and of whatever hashes them (a
    tuple holding a str, a frozen dataclass with a str field); int and float hash the same
    in every process (an int to itself)."""
    code = """
        import dataclasses, json

        @dataclasses.dataclass(frozen=True)
        class Config:
            name: str
            steps: int

        values = {"str": "lr", "bytes": b"lr", "tuple with a str": ("lr", 3), "frozen config": Config("lr", 3),
                  "int": 12345, "big int": 2**70, "float": 0.25, "tuple of ints": (1, 2)}
        print(json.dumps({name: hash(value) for name, value in values.items()}))
    """
    runs = [_python(code, PYTHONHASHSEED=seed) for seed in ("1", "2")]
    for run in runs:
        assert run.returncode == 0, run.stderr
    first, second = (json.loads(run.stdout) for run in runs)
    salted = {name for name in first if first[name] != second[name]}
    assert salted == {"str", "bytes", "tuple with a str", "frozen config"}
    assert first["int"] == 12345


def test_the_pasted_fixed_digest_is_the_configs_digest() -> None:
    """The Pitfalls block's `fixed_digest` is `TrainConfig.digest`, written for a fresh interpreter."""
    cfg = TrainConfig(lr=0.01, seed=3)
    assert naive.fixed_digest(cfg.digest_fields()) == cfg.digest()


# 2 ------------------------------------------------------------------------------------
def test_counting_in_iter_overcounts_with_workers() -> None:
    """The naive sampler reports every index the loader has *pulled*, and a resume from
    that state skips exactly the samples pulled but not trained; ours reports what was
    trained and resumes with every sample exactly once."""
    data = TensorDataset(torch.arange(64))
    batch, workers, prefetch, trained_batches = 4, 2, 2, 3

    counting = naive.CountingInIterSampler(64, world_size=1, rank=0, seed=0)
    order = list(naive.CountingInIterSampler(64, world_size=1, rank=0, seed=0))
    loader = DataLoader(data, batch_size=batch, sampler=counting, num_workers=workers,
                        prefetch_factor=prefetch)
    it = iter(loader)
    seen_naive = []
    for _ in range(trained_batches):
        seen_naive += next(it)[0].tolist()
    reported = counting.state_dict()["consumed"]
    del it
    trained = trained_batches * batch
    assert seen_naive == order[:trained], "training itself saw the right samples"
    # The main process keeps workers x prefetch batches requested beyond those returned,
    # so it has pulled (trained + in flight) batches of indices from the sampler. The
    # generator counts an index when it resumes after yielding it: the last one pulled
    # is not counted yet.
    in_flight = workers * prefetch * batch
    assert reported == trained + in_flight - 1
    restarted = naive.CountingInIterSampler(64, world_size=1, rank=0, seed=0)
    restarted.consumed = reported  # what a resume from its state_dict() sets
    skipped = set(range(64)) - set(seen_naive) - set(restarted)
    assert skipped == set(order[trained:reported]), "the pulled-but-untrained samples are lost"
    assert len(skipped) == in_flight - 1

    ours = ResumableDistributedSampler(64, world_size=1, rank=0, global_batch_size=batch, seed=0)
    loader = DataLoader(data, batch_size=batch, sampler=ours, num_workers=workers,
                        prefetch_factor=prefetch)
    it = iter(loader)
    seen = []
    for _ in range(trained_batches):
        seen += next(it)[0].tolist()
        ours.commit(batch)  # after the optimizer step
    del it
    assert ours.state_dict()["consumed"] == trained

    resumed = ResumableDistributedSampler(64, world_size=1, rank=0, global_batch_size=batch, seed=0)
    resumed.load_state_dict(ours.state_dict())
    rest = list(resumed)
    assert sorted(seen + rest) == list(range(64)), "every sample exactly once across the restart"


def test_counting_sampler_carries_progress_into_the_next_epoch() -> None:
    counting = naive.CountingInIterSampler(16, world_size=1, rank=0)
    assert len(list(counting)) == 16
    counting.set_epoch(1)
    assert list(counting) == [], "the naive sampler trains nothing in epoch 1"

    ours = ResumableDistributedSampler(16, world_size=1, rank=0, global_batch_size=4)
    for _ in range(4):
        ours.commit(4)
    ours.set_epoch(1)
    assert sorted(ours) == list(range(16))
    ours.commit(4)
    ours.set_epoch(1)  # called again after a mid-epoch restore: keeps the position
    assert len(list(ours)) == 12


# 3 ------------------------------------------------------------------------------------
def test_numpy_rng_state_fails_default_torch_load(tmp_path: Path) -> None:
    import numpy as np

    from reference_impl.state import rng_state, set_rng_state

    path = tmp_path / "rng.pt"
    torch.save(naive.naive_rng_state(), path)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        naive.naive_load(path)
    # The fix stores every generator as tensors and ints, which the safe default loads.
    np.random.seed(7)
    torch.save(rng_state(), path)
    expected = np.random.rand(3)
    set_rng_state(torch.load(path))  # default weights_only=True
    assert np.array_equal(np.random.rand(3), expected)


# 4 ------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_rank0_only_rng_gives_every_rank_the_same_stream(tmp_path: Path) -> None:
    run_ranks(naive.rank0_rng_worker, (2, free_port(), str(tmp_path)))
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["naive"]["restored_own_stream"] is True
    assert r1["naive"]["restored_own_stream"] is False, "rank 1 got rank 0's RNG state"
    assert r0["naive"]["draw"] == r1["naive"]["draw"], "both ranks now draw identical numbers"
    # save_checkpoint / restore_checkpoint: one RNG file per rank, each restores its own.
    assert r0["ours"]["restored_own_stream"] and r1["ours"]["restored_own_stream"]
    assert r0["ours"]["draw"] != r1["ours"]["draw"]


# 5 ------------------------------------------------------------------------------------
def test_in_place_save_leaves_a_torn_latest_checkpoint(tmp_path: Path) -> None:
    naive.naive_save({"w": torch.zeros(4)}, tmp_path, step=1)
    # Crash mid-write for real: the kernel refuses writes beyond 64 KiB (RLIMIT_FSIZE).
    crash = _own_process(f"""
        import resource, torch
        from reference_impl.interview.counterexamples import naive_save
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
        naive_save({{"w": torch.zeros(1_000_000)}}, {str(tmp_path)!r}, step=2)
    """, tmp_path / "naive_crash.py")
    assert crash.returncode != 0, "the save must have died part-way"
    latest = naive.naive_latest(tmp_path)
    assert latest is not None and latest.name == "step-00000002.pt", "the torn file is 'latest'"
    assert 0 < latest.stat().st_size <= 64 * 1024
    with pytest.raises(Exception):  # noqa: B017 - any load error: the restart would crash-loop
        torch.load(latest, weights_only=True)

    # The same crash during save_checkpoint publishes nothing; restore takes step 1. Only the
    # crashing save needs its own process (the file size limit is per process).
    from checkpoints import manager, published
    from reference_impl.distributed import DistContext
    from reference_impl.train import build_state

    ours = tmp_path / "ours"
    cfg = TrainConfig(hidden_dim=2048, dataset_size=256, checkpoint_dir=str(ours))
    state = build_state(cfg, DistContext())
    state.step = 1
    state.sampler.commit(cfg.global_batch_size)  # as a trained step leaves it: a restore checks
    manager(ours).save(state, cfg, DistContext())
    crash = _own_process(f"""
        import io, resource
        from pathlib import Path
        from reference_impl.checkpoint import CheckpointManager
        from reference_impl.config import TrainConfig
        from reference_impl.distributed import DistContext
        from reference_impl.metrics import EventLog
        from reference_impl.train import build_state
        cfg = TrainConfig(hidden_dim=2048, dataset_size=256, checkpoint_dir={str(ours)!r})
        state = build_state(cfg, DistContext())
        state.step = 2
        state.sampler.commit(2 * cfg.global_batch_size)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
        CheckpointManager(Path(cfg.checkpoint_dir), EventLog(0, io.StringIO())).save(state, cfg, DistContext())
    """, tmp_path / "our_crash.py")
    assert crash.returncode != 0, "the save must have died part-way"
    assert [p.name for p in published(ours)] == ["step-00000001"]
    restored = manager(ours).restore(build_state(cfg, DistContext()), cfg, DistContext())
    assert restored == 1


# 6 ------------------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_accumulation_without_no_sync_allreduces_every_micro_batch(tmp_path: Path) -> None:
    run_ranks(naive.ddp_allreduce_count_worker, (2, free_port(), str(tmp_path)))
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["naive"] == {"allreduces": 2, "optimizer_steps": 2}
        assert result["ours"] == {"allreduces": 1, "optimizer_steps": 1}


# 7 ------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:.*CUDA is not available.*:UserWarning")
def test_autocast_default_dtype_depends_on_the_device() -> None:
    """The naive version runs bf16 on CPU with a loss scaler on, and the same code picks
    fp16 for CUDA. The trainer's step runs the forward in the configured dtype and has a
    scaler (that really scales the loss) for fp16 only."""
    dtype, scaler_on = naive.naive_amp("cpu", use_amp=True)
    assert dtype == torch.bfloat16 and scaler_on, "a loss scaler on bf16, which never needs one"
    assert naive.naive_amp("cuda", use_amp=True)[0] == torch.float16, "same code, fp16 on a GPU"

    from reference_impl.metrics import PhaseTimer
    from reference_impl.step import train_step

    cpu = torch.device("cpu")
    for precision, expected in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        cfg = TrainConfig(precision=precision, micro_batch_size=8, dataset_size=64, optimizer="sgd")
        torch.manual_seed(0)
        model = nn.Linear(cfg.input_dim, cfg.num_classes)
        forward_dtypes = []
        model.register_forward_hook(lambda _m, _i, out: forward_dtypes.append(out.dtype))
        opt, scaler = build_optimizer(model, cfg), build_scaler(cfg, cpu)
        scaled = []
        if scaler is not None:
            model.weight.register_hook(lambda g: scaled.append(g.abs().max().item()))
        x, y = torch.randn(8, cfg.input_dim), torch.randint(0, cfg.num_classes, (8,))
        train_step(model, iter([(x, y, torch.arange(8))]), opt, build_scheduler(opt, cfg), scaler, cfg, cpu,
                   PhaseTimer(cpu))
        assert forward_dtypes == [expected], precision
        assert (scaler is not None) == (precision == "fp16"), precision
        if scaler is not None:
            torch.manual_seed(0)
            reference = nn.Linear(cfg.input_dim, cfg.num_classes)
            nn.functional.cross_entropy(reference(x), y).backward()
            ratio = scaled[0] / reference.weight.grad.abs().max().item()
            assert ratio == pytest.approx(cfg.fp16_init_scale, rel=1e-2), "backward saw the scaled loss"
    assert AUTOCAST_DTYPES == {"bf16": torch.bfloat16, "fp16": torch.float16}


# 8 ------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="asynchronous kernels need a GPU")
def test_host_timer_measures_launch_not_device_time() -> None:
    from reference_impl.metrics import PhaseTimer

    a = torch.randn(8192, 8192, device="cuda")
    a @ a  # the first matmul creates cuBLAS's handle and picks a kernel, blocking the host
    torch.cuda.synchronize()
    launch_ms = naive.naive_time_ms(lambda: [a @ a for _ in range(20)])
    timer = PhaseTimer(torch.device("cuda"))
    with timer.phase("forward"):
        for _ in range(20):
            a @ a
    device_ms = timer.flush()["forward"] * 1000
    assert device_ms > 5 * launch_ms, (device_ms, launch_ms)


# 9 ------------------------------------------------------------------------------------
def test_naive_step_returns_a_float_ours_a_tensor() -> None:
    """The naive step reads the loss to the host every step (one `.item()`, a device sync on
    a GPU); the trainer's step reads nothing and returns the same loss as a device tensor
    that holds no autograd graph."""
    from reference_impl.metrics import PhaseTimer
    from reference_impl.step import train_step

    x, y = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)), torch.arange(8) % 3
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = nn.functional.cross_entropy(model(x), y).item()
    with naive.counting_host_reads() as reads:
        value = naive.naive_step_loss(model, x, y, opt)
    assert reads == ["item"] and value == pytest.approx(expected)

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    cfg = TrainConfig(micro_batch_size=8, dataset_size=64, input_dim=4, num_classes=3, optimizer="sgd")
    opt = build_optimizer(model, cfg)
    with naive.counting_host_reads() as reads:
        loss, _ = train_step(model, iter([(x, y, torch.arange(8))]), opt, build_scheduler(opt, cfg), None,
                             cfg, torch.device("cpu"), PhaseTimer(torch.device("cpu")))
    assert reads == [], f"the step read {reads} to the host"
    assert loss.device.type == "cpu" and loss.grad_fn is None and not loss.requires_grad
    assert loss.item() == pytest.approx(expected)


# 10 -----------------------------------------------------------------------------------
def test_missing_scheduler_state_restarts_the_schedule() -> None:
    cfg = TrainConfig(max_steps=20, warmup_steps=10)

    def fresh():
        torch.manual_seed(0)
        model = nn.Linear(2, 2)
        opt = build_optimizer(model, cfg)
        return model, opt, build_scheduler(opt, cfg)

    model, opt, sched = fresh()
    for _ in range(5):
        opt.step()
        sched.step()
    ckpt = naive.naive_checkpoint(model, opt, step=5)
    sched.step()
    uninterrupted = sched.get_last_lr()[0]
    assert uninterrupted == pytest.approx(cfg.lr * lr_multiplier(6, cfg))

    model2, opt2, sched2 = fresh()
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["optimizer"])
    opt2.step()
    sched2.step()
    assert sched2.get_last_lr()[0] == pytest.approx(cfg.lr * lr_multiplier(1, cfg))
    assert sched2.get_last_lr()[0] != pytest.approx(uninterrupted), "back in warmup"

    model3, opt3, sched3 = fresh()
    opt3.load_state_dict(ckpt["optimizer"])
    sched3.load_state_dict(sched.state_dict() | {"last_epoch": 5, "_step_count": 6})
    opt3.step()
    sched3.step()
    assert sched3.get_last_lr()[0] == pytest.approx(uninterrupted)


# 11 -----------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="demonstrates the CPU-only failure")
def test_nccl_default_fails_on_a_cpu_machine(tmp_path: Path) -> None:
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    bad = _own_process("from reference_impl.interview.counterexamples import naive_init; naive_init()",
                       tmp_path / "naive_init.py", **env)
    assert bad.returncode != 0 and "nccl" in bad.stderr.lower()

    env["MASTER_PORT"] = str(free_port())
    good = _own_process("""
        from reference_impl.distributed import distributed
        with distributed() as ctx:
            print(ctx.backend, ctx.device)
    """, tmp_path / "our_init.py", **env)
    assert good.returncode == 0, good.stderr
    assert good.stdout.split() == ["gloo", "cpu"]

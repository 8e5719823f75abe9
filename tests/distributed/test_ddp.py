"""DDP on gloo (CPU), under real torchrun and on forked ranks: replicas stay identical, the
math matches one process, accumulation skips communication, loss falls and runs are
reproducible.

Every launch goes through `tests/launch.py`, so each one has a hard timeout. Runs are
cached per module: several assertions read the same launch instead of paying 5-7 s for
another torchrun.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

import launch

pytestmark = pytest.mark.distributed

DRIVER = str(Path(__file__).resolve().parent / "ddp_driver.py")
STEPS = 4
TOL = 1e-6
# SGD makes parameters comparable to 1e-6 (Adam amplifies rounding noise on near-zero
# gradients); no warmup and a large lr so four steps move the weights measurably.
EXACT = ["--max-steps", str(STEPS), "--warmup-steps", "0", "--log-every", "1",
         "--optimizer", "sgd", "--lr", "0.1", "--dataset-size", "512"]

# name -> (processes, flags). Every configuration trains 32 samples per optimizer step.
DRIVER_RUNS: dict[str, tuple[int, list[str]]] = {
    "ddp": (2, ["--micro-batch-size", "16"]),
    "single": (1, ["--micro-batch-size", "32"]),
    "accum4": (2, ["--micro-batch-size", "4", "--grad-accum-steps", "4"]),
    "accum2_workers": (2, ["--micro-batch-size", "8", "--grad-accum-steps", "2", "--num-workers", "2"]),
}
TWO_RANK = [name for name, (nproc, _) in DRIVER_RUNS.items() if nproc == 2]
ACCUMULATING = ["accum4", "accum2_workers"]

# 30 Adam steps take the synthetic tasks from ~2-3 nats to about a third of that.
LEARN = ["--max-steps", "30", "--warmup-steps", "0", "--log-every", "5", "--lr", "1e-2",
         "--micro-batch-size", "16"]
TRAIN_RUNS: dict[str, list[str]] = {
    "mlp": ["--model", "mlp"],
    "mlp_again": ["--model", "mlp"],
    "mlp_seed1": ["--model", "mlp", "--seed", "1"],
    "transformer": ["--model", "transformer"],
}

T = TypeVar("T")


@dataclass
class DriverResult:
    """One ddp_driver.py launch: its events, its per-step checks and rank 0's final weights."""

    run: launch.Run
    checks: dict[str, Any]
    params: dict[str, torch.Tensor]

    @property
    def losses(self) -> list[float]:
        """Global mean loss of every step, in step order."""
        return [e["loss"] for e in self.run.of("step")]


def _cached(launcher: Callable[[str], T]) -> Callable[[str], T]:
    """Memoise `launcher` by run name, so each configuration launches once per module."""
    cache: dict[str, T] = {}

    def get(name: str) -> T:
        if name not in cache:
            cache[name] = launcher(name)
        return cache[name]
    return get


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], DriverResult]:
    """Launch a DRIVER_RUNS entry the first time a test asks for it."""
    out_dir = tmp_path_factory.mktemp("ddp_driver")

    def launch_driver(name: str) -> DriverResult:
        nproc, flags = DRIVER_RUNS[name]
        prefix = str(out_dir / name)
        # "ddp" under torchrun keeps the launcher path of a DDP job covered; the others run on
        # forked ranks (torchrun's environment, without an interpreter start per rank).
        start = launch.torchrun if name == "ddp" else launch.forked_ranks
        run = start([prefix, *EXACT, *flags], nproc=nproc, timeout=90, module=DRIVER)
        assert run.returncode == 0, f"{name}: rc={run.returncode}\n{run.stderr[-5000:]}"
        checks = json.loads(Path(prefix + ".json").read_text())
        params = torch.load(prefix + ".pt", weights_only=True)
        return DriverResult(run, checks, params)
    return _cached(launch_driver)


@pytest.fixture(scope="module")
def trained() -> Callable[[str], launch.Run]:
    """Launch a TRAIN_RUNS entry (2 forked ranks, `reference_impl.train`) the first time it is needed.

    The DRIVER's "ddp" run stays under real torchrun, so the launcher path of a DDP job stays covered.
    """
    def launch_train(name: str) -> launch.Run:
        run = launch.forked_ranks([*LEARN, *TRAIN_RUNS[name]], nproc=2, timeout=90)
        assert run.returncode == 0, f"{name}: rc={run.returncode}\n{run.stderr[-5000:]}"
        return run
    return _cached(launch_train)


def _max_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _assert_close(actual: list[float], expected: list[float]) -> None:
    assert len(actual) == len(expected) == STEPS
    diffs = [abs(x - y) for x, y in zip(actual, expected)]
    assert max(diffs) <= TOL, f"loss diffs {diffs}"


@pytest.mark.slow
@pytest.mark.parametrize("name", TWO_RANK)
def test_ranks_hold_identical_parameters_after_every_step(
        driver: Callable[[str], DriverResult], name: str) -> None:
    checks = driver(name).checks
    assert checks["world_size"] == 2
    assert checks["identical"] == [True] * STEPS


def test_two_ranks_match_one_process_with_twice_the_batch(driver: Callable[[str], DriverResult]) -> None:
    # The reference runs the driver under torchrun with one process, not plain python:
    # the driver needs a process group for its all_gather and comm hook, and the loop
    # code path (DDP wrapper, loss all-reduce at log steps) stays the same, so the only
    # difference left is how the 32 samples of each step are split across ranks.
    ddp, single = driver("ddp"), driver("single")
    assert single.checks["world_size"] == 1
    _assert_close(ddp.losses, single.losses)
    assert _max_param_diff(ddp.params, single.params) <= TOL


@pytest.mark.parametrize("name", ACCUMULATING)
def test_accumulation_matches_one_large_micro_batch(driver: Callable[[str], DriverResult], name: str) -> None:
    accumulated, reference = driver(name), driver("ddp")
    _assert_close(accumulated.losses, reference.losses)
    assert _max_param_diff(accumulated.params, reference.params) <= TOL


@pytest.mark.parametrize("name", ["ddp", *ACCUMULATING])
def test_only_the_last_micro_batch_communicates(driver: Callable[[str], DriverResult], name: str) -> None:
    checks = driver(name).checks
    assert checks["buckets"] >= 1
    # Without no_sync each of the G micro-batches would all-reduce every bucket.
    assert checks["calls_per_step"] == [checks["buckets"]] * STEPS


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_loss_falls_and_run_completes(trained: Callable[[str], launch.Run], name: str) -> None:
    run = trained(name)
    losses = [e["loss"] for e in run.of("step")]
    assert len(losses) == 6
    assert losses[-1] < 0.75 * losses[0], losses
    last = json.loads(run.stdout.strip().splitlines()[-1])
    assert last["event"] == "run_complete" and last["step"] == 30
    assert re.fullmatch(r"[0-9a-f]{64}", last["state_digest"])


@pytest.mark.slow
def test_same_config_same_digest_other_seed_other_digest(trained: Callable[[str], launch.Run]) -> None:
    assert trained("mlp").digest() == trained("mlp_again").digest()
    assert trained("mlp_seed1").digest() != trained("mlp").digest()


def test_ddp_gradients_are_views_into_its_all_reduce_buckets() -> None:
    """`data_parallel.ddp` keeps one copy of the gradients: each is a view into a bucket, so DDP
    launches no per-parameter copy into the bucket and back (host time that a GPU profile
    of small batches found in every step). A real one-rank gloo group, in this process."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from reference_impl.config import TrainConfig
    from reference_impl.parallel.data_parallel import ddp

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        model = ddp(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), init_device_mesh("cpu", (1,)), TrainConfig())
        model(torch.randn(4, 8)).sum().backward()
        grads = [p.grad for p in model.parameters()]
        assert all(g is not None for g in grads)
        assert len({g.untyped_storage().data_ptr() for g in grads if g is not None}) == 1  # one bucket holds all four
    finally:
        dist.destroy_process_group()

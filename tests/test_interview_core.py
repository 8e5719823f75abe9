"""The interview core (`reference_impl/interview_core.py`) trains exactly as the interview trainer
and the package do.

The core is 150 lines a candidate can type; these tests prove it is not a sketch: on one process
and on two ranks (the core under torchrun) it ends with the same `state_digest` (a sha256 over every
weight and optimizer value) as `reference_impl.notebook` with its defaults and as the package trainer
with the notebook's settings, and a rank SIGKILLed after a checkpoint resumes to that same digest.
"""

from __future__ import annotations

import ast
import io
import shutil
import sys
from pathlib import Path

import pytest
import torch

import reference_impl.train as package_train
from launch import REPO, Run, forked_ranks, torchrun
from reference_impl import interview_core as core
from reference_impl import notebook as nb
from reference_impl.config import TrainConfig
from reference_impl.distributed import DistContext
from reference_impl.metrics import EventLog
from reference_impl.state import state_digest

CORE = REPO / "reference_impl" / "interview_core.py"
NOTEBOOK = REPO / "reference_impl" / "notebook.py"
STEPS = 70  # past the end of the first epoch (4096 samples / 64 per step = 64 steps)


def test_fits_in_150_lines_and_imports_only_the_standard_library_and_torch() -> None:
    lines = CORE.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150, f"the core has {len(lines)} lines"
    tree = ast.parse("\n".join(lines))
    roots = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names}
    roots |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert roots - sys.stdlib_module_names == {"torch"}


def core_in_process(args: list[str]) -> str:
    """The core's `main` in this process (one rank: a group of one), its global RNG put back after."""
    with torch.random.fork_rng(devices=[]):
        return core.main(args)


def test_one_process_ends_with_the_notebooks_and_the_packages_digest(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ours = core_in_process(["--max-steps", str(STEPS), "--checkpoint-dir", str(tmp_path / "core")])
    printed = capsys.readouterr().out.splitlines()
    with torch.random.fork_rng(devices=[]):
        notebook = nb.train(nb.Config(max_steps=STEPS, checkpoint_dir=str(tmp_path / "notebook")))["state_digest"]
    cfg = TrainConfig(model="mlp", max_steps=STEPS, micro_batch_size=16, grad_accum_steps=4, warmup_steps=5,
                      precision="bf16")
    with torch.random.fork_rng(devices=[]):
        state = package_train.train(cfg, DistContext(), EventLog(0, io.StringIO()))
    package = state_digest(state.model, state.optimizer, state.mesh.group("pp"))
    assert capsys.readouterr().out.splitlines()[-1] == printed[-1], "the same run_complete line"
    assert ours == notebook == package


def test_a_resume_mid_epoch_keeps_the_sampler_position_and_ends_with_the_same_digest(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Step 20 is a third of the way into epoch 0: a sampler whose set_epoch(0) forgot the
    restored position would retrain samples 0-1279 and end elsewhere than the notebook."""
    flags = ["--max-steps", "30", "--checkpoint-every", "10", "--checkpoint-dir", str(tmp_path / "core")]
    with torch.random.fork_rng(devices=[]):
        notebook = nb.train(nb.Config(max_steps=30, checkpoint_dir=str(tmp_path / "notebook")))["state_digest"]
    assert core_in_process(flags) == notebook
    shutil.rmtree(tmp_path / "core" / "step-00000030")
    capsys.readouterr()
    assert core_in_process(flags) == notebook
    assert '"event": "checkpoint_restored", "step": 20' in capsys.readouterr().out


def test_each_rank_gets_back_the_rng_state_its_checkpoint_holds(tmp_path: Path) -> None:
    """The restore loads the RNG state from the file (weights only), not from the seed: a state
    planted in the checkpoint is the process's state after the resumed run."""
    flags = ["--max-steps", "20", "--checkpoint-every", "10", "--checkpoint-dir", str(tmp_path)]
    core_in_process(flags)
    shutil.rmtree(tmp_path / "step-00000020")
    rank_file = tmp_path / "step-00000010" / "rank-0.pt"
    saved = torch.load(rank_file, weights_only=True)
    planted = torch.Generator().manual_seed(1234).get_state()
    saved["rng"][0] = planted
    torch.save(saved, rank_file)
    with torch.random.fork_rng(devices=[]):
        core.main(flags)
        after = torch.get_rng_state()  # nothing in this MLP draws from it while training
    assert torch.equal(after, planted)


def core_flags(ckpt: Path) -> list[str]:
    return ["--max-steps", "30", "--checkpoint-every", "10", "--checkpoint-dir", str(ckpt)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """Uninterrupted two-rank runs of the core under torchrun (the page's command), and of the
    notebook (its defaults: global batch 64 of micro-batches of 16) and the package with the
    notebook's settings on forked ranks, which train exactly as under torchrun
    (tests/distributed/test_forked_ranks.py; the notebook's own torchrun cells run in
    tests/test_notebook_kernel.py)."""
    root = tmp_path_factory.mktemp("two-ranks")
    package_flags = ["--model", "mlp", "--max-steps", "30", "--micro-batch-size", "16", "--grad-accum-steps", "2",
                     "--warmup-steps", "5", "--precision", "bf16", "--checkpoint-dir", str(root / "package"),
                     "--checkpoint-every", "10"]
    runs = {"core": torchrun(core_flags(root / "core"), module=str(CORE)),
            "notebook": forked_ranks(core_flags(root / "notebook"), module=str(NOTEBOOK)),
            "package": forked_ranks(package_flags)}
    for name, run in runs.items():
        assert run.returncode == 0, f"{name}: {run.stderr[-4000:]}"
    return runs


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_under_torchrun_end_with_the_notebooks_and_the_packages_digest(two_ranks: dict[str, Run]) -> None:
    assert two_ranks["core"].digest() == two_ranks["notebook"].digest() == two_ranks["package"].digest()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_sigkilled_after_a_checkpoint_resumes_to_the_uninterrupted_digest(
        rank: int, tmp_path: Path, two_ranks: dict[str, Run]) -> None:
    """Killed before step 15 with a checkpoint at step 10: both ranks restart, and must restore
    step 10 (not start over) and end where the uninterrupted run ended. torchrun's agent
    restarts rank 1's case, the page's command; forked ranks, which restart as the agent
    does (tests/distributed/test_forked_ranks.py), restart rank 0's."""
    launch = torchrun if rank == 1 else forked_ranks
    run = launch([*core_flags(tmp_path), "--fail-at-step", "15", "--fail-rank", str(rank)], module=str(CORE),
                 max_restarts=1, timeout=180)
    assert run.returncode == 0, run.stderr[-4000:]
    assert [e["step"] for e in run.of("checkpoint_restored")] == [10]
    assert run.digest() == two_ranks["core"].digest()

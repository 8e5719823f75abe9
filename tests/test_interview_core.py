"""The interview core (`reference_impl/interview_core.py`) trains exactly as the interview trainer
and the package do.

The core is 150 lines a candidate can type; these tests prove it is not a sketch: on one process
and on two ranks (the core under torchrun) it ends with the same `state_digest` (a sha256 over every
weight and optimizer value) as `reference_impl.notebook` with its defaults and as the package trainer
with the notebook's settings, and a rank SIGKILLed after a checkpoint resumes to that same digest.
It runs where numpy cannot be imported, its ranks die with a SIGKILLed torchrun, and a torn or
changed newest checkpoint is skipped for the one before it.
"""

from __future__ import annotations

import ast
import io
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import reference_impl.train as package_train
from launch import REPO, Run, alive, descendants, forked_ranks, kill_tree, run_command, torchrun
from reference_impl import interview_core as core
from reference_impl import notebook as nb
from reference_impl.config import TrainConfig
from reference_impl.distributed import DistContext
from reference_impl.launch import torchrun_command
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


def test_no_line_is_over_100_characters() -> None:
    wide = {n: len(line) for n, line in enumerate(CORE.read_text(encoding="utf-8").splitlines(), 1)
            if len(line) > 100}
    assert not wide, f"lines over 100 characters (line: length): {wide}"


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
def two_ranks_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("two-ranks")


@pytest.fixture(scope="module")
def two_ranks(two_ranks_root: Path) -> dict[str, Run]:
    """Uninterrupted two-rank runs of the core under torchrun (the page's command), and of the
    notebook (its defaults: global batch 64 of micro-batches of 16) and the package with the
    notebook's settings on forked ranks, which train exactly as under torchrun
    (tests/distributed/test_forked_ranks.py; the notebook's own torchrun cells run in
    tests/test_notebook_kernel.py)."""
    root = two_ranks_root
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


# A Python with torch alone: `import numpy` fails (a None in sys.modules halts the import, as
# if numpy were not installed), and so does `import reference_impl` (tests/without_package.py).
TORCH_ALONE = f"""
import runpy, sys
sys.modules["numpy"] = None
sys.path.insert(0, {str(REPO / "tests")!r})
import without_package
without_package.block()
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
try:
    import numpy
except ImportError as error:
    print("numpy:", error)
"""


def test_runs_saves_and_restores_in_a_python_with_torch_alone(tmp_path: Path) -> None:
    """The core pasted into a blank Colab that has torch and nothing else: the run trains,
    checkpoints, digests without numpy, and a second run restores and prints the same line."""
    flags = ["--max-steps", "20", "--checkpoint-every", "10", "--checkpoint-dir", str(tmp_path / "alone")]
    runs = [run_command([sys.executable, "-c", TORCH_ALONE, str(CORE), *flags], timeout=120, cwd=tmp_path)
            for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
        assert "numpy: import of numpy halted" in run.stdout, "numpy was importable: the test proves nothing"
    assert [e["step"] for e in runs[1].of("checkpoint_restored")] == [20]
    assert runs[0].digest() == runs[1].digest() == core_in_process([*flags[:4], "--checkpoint-dir",
                                                                    str(tmp_path / "with-numpy")])


@pytest.mark.parametrize("damage", ["torn", "changed"])
def test_a_torn_or_changed_newest_checkpoint_is_skipped_for_the_previous_one(
        damage: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Truncated (a crash, a full disk) or one byte flipped (a bad disk; torch.load itself would
    load it): the restart must restore step 20, not 30, and still end at the uninterrupted digest."""
    flags = ["--max-steps", "30", "--checkpoint-every", "10", "--checkpoint-dir", str(tmp_path)]
    clean = core_in_process(flags)
    newest = tmp_path / "step-00000030" / "rank-0.pt"
    size = newest.stat().st_size
    if damage == "torn":
        os.truncate(newest, size // 2)
    else:
        data = bytearray(newest.read_bytes())
        data[size // 2] ^= 0xFF  # in the middle: a tensor's bytes
        newest.write_bytes(bytes(data))
    capsys.readouterr()
    assert core_in_process(flags) == clean
    assert '"event": "checkpoint_restored", "step": 20' in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.distributed
def test_every_rank_falls_back_when_one_ranks_file_is_damaged(
        tmp_path: Path, two_ranks: dict[str, Run], two_ranks_root: Path) -> None:
    """Rank 1's own file of step 30 changed: rank 0's files are intact, yet both ranks must skip
    step 30 (each checks every rank's file), or they would train from different steps."""
    shutil.copytree(two_ranks_root / "core", tmp_path / "core")
    damaged = tmp_path / "core" / "step-00000030" / "rank-1.pt"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    run = forked_ranks(core_flags(tmp_path / "core"), module=str(CORE), timeout=180)
    assert run.returncode == 0, run.stderr[-4000:]
    assert [e["step"] for e in run.of("checkpoint_restored")] == [20]
    assert run.digest() == two_ranks["core"].digest()


@pytest.mark.timeout(240)
def test_both_ranks_die_with_a_sigkilled_torchrun(tmp_path: Path) -> None:
    """A SIGKILLed launcher cannot stop its workers: the ranks must notice and die, not train on
    orphaned (racing a relaunch for the checkpoint directory)."""
    cmd = torchrun_command(2, str(CORE), ["--max-steps", "1000000", "--checkpoint-every", "20",
                                          "--checkpoint-dir", str(tmp_path)])
    agent = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 180  # both ranks are in the loop once step 20 is published
        while not (tmp_path / "step-00000020").exists() and time.monotonic() < deadline:
            assert agent.poll() is None, "torchrun ended before training"
            time.sleep(0.2)
        ranks = descendants(agent.pid)
        assert len(ranks) == 2, f"expected the two ranks under torchrun, found {ranks}"
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait(10)
        deadline = time.monotonic() + 20
        while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = [pid for pid in ranks if alive(pid)]
    finally:
        for pid in ranks:  # orphans are outside the agent's process group
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        kill_tree(agent)
    assert survivors == [], "the ranks kept training without their launcher"

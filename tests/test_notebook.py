"""The interview trainer (`reference_impl/notebook.py`) is the package trainer, in one file.

The short version is proven to be the long version: with matching settings the two print
the same loss at every step and the same final `state_digest` (a sha256 over every weight
and optimizer value), on one process and on two ranks, and a killed rank resumes to the
digest of the uninterrupted run. The short version runs where the package is absent.
"""

from __future__ import annotations

import ast
import io
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

import reference_impl.train as package_train
from launch import REPO, Run, forked_ranks, python_module, run_command
from reference_impl import notebook as nb
from reference_impl import step as step_module
from reference_impl.config import TrainConfig
from reference_impl.data import ResumableDistributedSampler, SyntheticClassification
from reference_impl.distributed import DistContext
from reference_impl.metrics import EventLog, PhaseTimer
from reference_impl.model import build_model
from reference_impl.state import state_digest

NOTEBOOK = REPO / "reference_impl" / "notebook.py"
WITHOUT_PACKAGE = Path(__file__).with_name("without_package.py")


def notebook(args: list[str], tmp_path: Path, timeout: float = 120, fresh: bool = False) -> Run:
    """Run a copy of the file, outside the repository, where `import reference_impl` fails:
    in a new interpreter with `fresh`, else forked from the suite's warm forkserver with the
    package dropped and blocked there (an interpreter's start is most of a short run)."""
    script = tmp_path / "interview_trainer.py"
    shutil.copy(NOTEBOOK, script)
    if fresh:
        return run_command([sys.executable, str(WITHOUT_PACKAGE), str(script), *args], timeout, cwd=tmp_path)
    return forked_ranks(args, nproc=1, timeout=timeout, module=str(script), torchrun_env=False,
                        without_package=True)


def notebook_flags(ckpt: Path, global_batch: int, micro: int = 16, steps: int = 30) -> list[str]:
    return ["--max-steps", str(steps), "--global-batch-size", str(global_batch),
            "--micro-batch-size", str(micro), "--checkpoint-dir", str(ckpt),
            "--checkpoint-every", "10", "--log-every", "1"]


def package_flags(ckpt: Path, global_batch: int, world: int, micro: int = 16, steps: int = 30) -> list[str]:
    """The package's flags for the notebook's Config defaults (bf16, warmup 5, the MLP)."""
    return ["--model", "mlp", "--max-steps", str(steps), "--micro-batch-size", str(micro),
            "--grad-accum-steps", str(global_batch // (micro * world)), "--warmup-steps", "5",
            "--precision", "bf16", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "10",
            "--log-every", "1"]


def losses(run: Run) -> list[tuple[int, float]]:
    assert run.returncode == 0, run.stderr[-4000:]
    return [(e["step"], e["loss"]) for e in run.of("step")]


def assert_same_run(short: Run, package: Run, steps: int) -> None:
    ours, theirs = losses(short), losses(package)
    assert [s for s, _ in ours] == [s for s, _ in theirs] == list(range(1, steps + 1))
    worst = max(abs(a - b) for (_, a), (_, b) in zip(ours, theirs))
    assert worst <= 1e-6, f"per-step losses differ by up to {worst}"
    assert short.digest() == package.digest(), "the final weights and optimizer state differ"


def test_imports_only_the_standard_library_torch_and_numpy() -> None:
    tree = ast.parse(NOTEBOOK.read_text(encoding="utf-8"))
    roots = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names}
    roots |= {node.module.split(".")[0] for node in ast.walk(tree)
              if isinstance(node, ast.ImportFrom) and node.module}
    assert roots - sys.stdlib_module_names == {"torch", "numpy"}


SEEDS = [0, 1, 7, 123_457]


@pytest.mark.parametrize("seed", SEEDS)
def test_the_data_order_equals_the_packages_at_every_seed_rank_and_epoch(seed: int) -> None:
    """The sampler's per-epoch shuffle is seeded from (seed, epoch) exactly as the package's,
    so every rank of every world size reads the same indices in the same order."""
    for world in (1, 2, 4):
        for rank in range(world):
            ours = nb.ResumableSampler(200, 32, rank, world, seed)
            theirs = ResumableDistributedSampler(200, world_size=world, rank=rank, global_batch_size=32, seed=seed)
            for epoch in range(3):
                ours.set_epoch(epoch)
                theirs.set_epoch(epoch)
                assert list(ours) == list(theirs), (world, rank, epoch)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_data_and_the_initial_weights_equal_the_packages_at_every_seed(seed: int) -> None:
    cfg = nb.Config(seed=seed, dataset_size=256)
    ours = nb.TeacherDataset(cfg)
    theirs = SyntheticClassification(256, cfg.input_dim, cfg.num_classes, seed)
    assert torch.equal(ours.x, theirs.x) and torch.equal(ours.y, theirs.y)
    weights = nb.build_model(cfg, nb.Ranks(0, 0, 1, torch.device("cpu"))).state_dict()
    package = build_model(TrainConfig(model="mlp", seed=seed)).state_dict()
    assert list(weights) == list(package)
    assert all(torch.equal(weights[k], package[k]) for k in weights)


STEPS = 6  # three epochs of two steps: the data is 64 samples, the global batch 32


def _notebook_in_process(seed: int, ckpt: Path) -> str:
    """Train the notebook's trainer in this process (one rank); return its final digest."""
    cfg = nb.Config(seed=seed, max_steps=STEPS, global_batch_size=32, micro_batch_size=16, dataset_size=64,
                    checkpoint_dir=str(ckpt), checkpoint_every=0, log_every=STEPS)
    return nb.train(cfg)["state_digest"]


def _package_in_process(seed: int) -> str:
    """Train the package's trainer in this process (one rank) with the notebook's settings."""
    cfg = TrainConfig(model="mlp", seed=seed, max_steps=STEPS, micro_batch_size=16, grad_accum_steps=2,
                      warmup_steps=5, precision="bf16", dataset_size=64, log_every=STEPS)
    state = package_train.train(cfg, DistContext(), EventLog(0, io.StringIO()))
    return state_digest(state.model, state.optimizer, state.mesh.group("pp"))


@pytest.mark.parametrize("seed", SEEDS)
def test_the_per_rank_streams_equal_the_packages_at_every_seed(
        seed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Both trainers seed the same per-rank generators from --seed: the global stream (dropout)
    and the loader's own generator (its workers' seeds); after the same steps both streams
    stand at the same state and the weights and optimizer agree bit for bit."""
    class Recorded(torch.utils.data.DataLoader):
        seeds: list[int] = []

        def __init__(self, *args, generator: torch.Generator, **kwargs) -> None:
            Recorded.seeds.append(generator.initial_seed())
            super().__init__(*args, generator=generator, **kwargs)

    monkeypatch.setattr(nb, "DataLoader", Recorded)
    monkeypatch.setattr(package_train, "DataLoader", Recorded)
    runs = []
    for trainer in (lambda: _notebook_in_process(seed, tmp_path), lambda: _package_in_process(seed)):
        Recorded.seeds = []
        with torch.random.fork_rng(devices=[]):
            digest = trainer()
            runs.append({"digest": digest, "loader_seeds": Recorded.seeds, "global_seed": torch.initial_seed(),
                         "global_state": torch.get_rng_state()})
    ours, theirs = runs
    assert ours["loader_seeds"] == theirs["loader_seeds"] == [seed]  # rank 0 of one
    assert ours["global_seed"] == theirs["global_seed"] == seed
    assert torch.equal(ours["global_state"], theirs["global_state"])
    assert ours["digest"] == theirs["digest"]
    capsys.readouterr()  # the notebook's JSON events


def test_clipping_sees_the_unscaled_gradients_under_fp16_loss_scaling() -> None:
    """With a GradScaler at 2**16 and a max-norm far below the gradient's norm, an SGD step
    moves the weights by exactly lr x max-norm along the true gradient, as the package's step
    does. Clipping before unscaling would measure a norm 65536 times too large and shrink
    the step 65536-fold."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    gradient = [p.grad.clone() for p in model.parameters()]
    norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in gradient]))
    max_norm, lr = 1e-3, 0.5
    assert norm > 100 * max_norm, "the clip must bite"

    def one_step(step) -> list[torch.Tensor]:
        """The weights after `step` trained a copy of the model on (x, y) once."""
        copy = torch.nn.Linear(8, 3)
        copy.load_state_dict(model.state_dict())
        optimizer = torch.optim.SGD(copy.parameters(), lr=lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
        step(copy, optimizer, scheduler, scaler)
        assert scaler.get_scale() == 2.0 ** 16, "no overflow: the step was taken"
        return [p.detach() for p in copy.parameters()]

    cpu = torch.device("cpu")
    ours = one_step(lambda m, o, s, scaler: nb.train_step(
        m, iter([(x, y)]), o, s, scaler, nb.Config(precision="fp32", grad_clip=max_norm), 1, cpu, nb.PhaseTimer(cpu)))
    theirs = one_step(lambda m, o, s, scaler: step_module.train_step(
        m, iter([(x, y, torch.arange(16))]), o, s, scaler, TrainConfig(precision="fp32", grad_clip=max_norm),
        cpu, PhaseTimer(cpu)))
    for before, g, a, b in zip(model.parameters(), gradient, ours, theirs, strict=True):
        expected = before.detach() - lr * max_norm / norm * g
        torch.testing.assert_close(a, expected, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_equals_the_package_on_one_process(tmp_path: Path) -> None:
    short = notebook(notebook_flags(tmp_path / "short", 32), tmp_path, fresh=True)
    package = python_module(package_flags(tmp_path / "package", 32, world=1))
    assert_same_run(short, package, 30)


@pytest.mark.slow
@pytest.mark.distributed
def test_equals_the_package_on_two_ranks(two_rank_reference: dict[str, Run]) -> None:
    assert_same_run(two_rank_reference["short"], two_rank_reference["package"], 30)


@pytest.fixture(scope="module")
def two_rank_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """Uninterrupted two-rank runs of both trainers (global batch 64: 16 x 2 micro x 2 ranks),
    on forked ranks, which train exactly as under torchrun (tests/distributed/test_forked_ranks.py);
    the notebook's own cells run the notebook under torchrun (tests/test_notebook_kernel.py)."""
    root = tmp_path_factory.mktemp("two-ranks")
    return {"short": forked_ranks(notebook_flags(root / "short", 64), module=str(NOTEBOOK)),
            "package": forked_ranks(package_flags(root / "package", 64, world=2))}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("rank", [0, 1])
def test_a_sigkilled_rank_resumes_to_the_uninterrupted_digest(
        rank: int, tmp_path: Path, two_rank_reference: dict[str, Run]) -> None:
    """Forked ranks restart the job as torchrun's agent does (tests/distributed/test_forked_ranks.py);
    the notebook's own cell kills rank 1 under torchrun itself (tests/test_notebook_kernel.py)."""
    run = forked_ranks([*notebook_flags(tmp_path, 64), "--fail-at-step", "15", "--fail-rank", str(rank)],
                       module=str(NOTEBOOK), max_restarts=1, timeout=180)
    assert run.returncode == 0, run.stderr[-4000:]
    assert [e["step"] for e in run.of("checkpoint_restored")] == [10], "resumed from step 10"
    assert run.digest() == two_rank_reference["short"].digest()


@pytest.fixture(scope="module")
def twenty_steps(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A finished 20-step run (checkpoints at 10 and 20) and its final digest."""
    root = tmp_path_factory.mktemp("twenty")
    run = notebook(notebook_flags(root / "ckpt", 32, steps=20), root)
    return root / "ckpt", run.digest()


def copy_of(run: tuple[Path, str], tmp_path: Path) -> tuple[list[str], str]:
    """The flags that resume a private copy of that run's checkpoints, and its digest."""
    shutil.copytree(run[0], tmp_path / "ckpt")
    return notebook_flags(tmp_path / "ckpt", 32, steps=20), run[1]


def test_a_corrupt_newest_checkpoint_is_skipped(twenty_steps: tuple[Path, str], tmp_path: Path) -> None:
    flags, digest = copy_of(twenty_steps, tmp_path)
    newest = tmp_path / "ckpt" / "step-00000020" / "train.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit
    newest.write_bytes(bytes(data))
    again = notebook(flags, tmp_path)
    skipped = again.of("checkpoint_skipped")
    assert len(skipped) == 1 and "step-00000020" in skipped[0]["path"] and "sha256" in skipped[0]["reason"]
    assert [e["step"] for e in again.of("checkpoint_restored")] == [10]
    assert again.digest() == digest, "steps 11-20 were retrained to the same state"


@pytest.mark.parametrize("damage", ["not json", "[]", '{"step": 20}', "symlink", "escape"])
def test_an_untrusted_checkpoint_directory_falls_back_without_a_traceback(
        damage: str, twenty_steps: tuple[Path, str], tmp_path: Path) -> None:
    flags, digest = copy_of(twenty_steps, tmp_path)
    newest = tmp_path / "ckpt" / "step-00000020"
    manifest = newest / "manifest.json"
    if damage == "symlink":
        shutil.rmtree(newest)
        newest.symlink_to(tmp_path / "ckpt" / "step-00000010")
    elif damage == "escape":
        entry = json.loads(manifest.read_text())
        entry["files"]["../outside.pt"] = entry["files"]["train.pt"]
        manifest.write_text(json.dumps(entry))
    else:
        manifest.write_text(damage)
    again = notebook(flags, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Traceback" not in again.stderr
    assert [e["step"] for e in again.of("checkpoint_restored")] == [10]
    assert again.digest() == digest
    assert (tmp_path / "ckpt" / "step-00000010").is_dir(), "the valid checkpoint survives"


def test_a_checkpoint_of_another_config_is_refused(twenty_steps: tuple[Path, str], tmp_path: Path) -> None:
    flags, _ = copy_of(twenty_steps, tmp_path)
    other = notebook([*flags, "--lr", "0.01"], tmp_path)
    assert other.returncode != 0 and "another config" in other.stderr
    assert "Traceback" not in other.stderr
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-00000010", "step-00000020"], \
        "nothing was deleted"


@pytest.mark.parametrize("flag", [["--max-steps", "0"], ["--precision", "fp8"], ["--global-batch-size", "40"],
                                  ["--min-lr-ratio", "nan"], ["--grad-clip", "-1"]])
def test_a_bad_flag_is_one_line_and_exit_status_2(flag: list[str], tmp_path: Path) -> None:
    run = notebook(flag, tmp_path)
    assert run.returncode == 2
    assert len(run.stderr.strip().splitlines()) == 1 and "error" in run.stderr, run.stderr


def test_the_walkthrough_line_budget_matches_the_file() -> None:
    """The page's table counts each cell's lines of code: it must count the file as it is."""
    source = NOTEBOOK.read_text(encoding="utf-8")
    counted = [sum(1 for line in m["body"].splitlines() if line.strip() and not line.strip().startswith("#"))
               for m in re.finditer(r"^# --8<-- \[start:(?P<name>\w+)\]\n(?P<body>.*?)^# --8<-- \[end:(?P=name)\]",
                                    source, re.S | re.M)]
    page = (REPO / "docs" / "practice" / "notebook-walkthrough.md").read_text(encoding="utf-8")
    stated = [int(m[1]) for m in re.finditer(r"^\| \d+\. [^|]+\| (\d+) \|", page, re.M)]
    assert stated == counted, f"the page says {stated}, the file has {counted}"

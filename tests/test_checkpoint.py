"""The checkpoint contract in one process: verification, fallback, refusal and write errors."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch

import publish_worker
from launch import Run, free_port, python_module, run_command, run_ranks
from checkpoints import RunsCode, published, verify
from reference_impl.checkpoint import CheckpointError
from reference_impl.checkpoint.publish import write_file

FLAGS = ["--max-steps", "30", "--checkpoint-every", "10", "--keep-last", "3", "--warmup-steps", "5",
         "--log-every", "10", "--micro-batch-size", "8", "--dataset-size", "512"]


def train(ckpt: Path, *extra: str) -> Run:
    return python_module([*FLAGS, "--checkpoint-dir", str(ckpt), *extra], timeout=120)


def test_every_rank_learns_that_rank_0_failed_to_publish(tmp_path: Path) -> None:
    """Only rank 0 publishes; when that fails, the other ranks raise too, at once, instead of
    waiting out the group's timeout for a rank 0 that has already left."""
    run_ranks(publish_worker.failed_publish, (2, free_port(), str(tmp_path)), timeout=30)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["error"] for r in ranks] == ["CheckpointError", "CheckpointError"], ranks
    assert "No space left on device" in ranks[0]["message"]
    assert "rank 0 failed to publish the checkpoint of step 1" in ranks[1]["message"]
    assert max(r["seconds"] for r in ranks) < 20, ranks
    assert not list(tmp_path.glob("*step-00000001*")), "neither published nor left behind"


def test_every_rank_learns_that_rank_0_failed_to_copy_its_state_for_an_async_save(tmp_path: Path) -> None:
    """The failing rank skips DCP's collectives; its peers learn of the failure before
    entering them, instead of waiting there for the group's timeout, and the next save works."""
    run_ranks(publish_worker.failed_copy, (2, free_port(), str(tmp_path)), timeout=40)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [[save["error"] for save in r] for r in ranks] == [[None, "CheckpointError", None]] * 2, ranks
    assert "no memory for the copy" in ranks[0][1]["message"]
    assert "another rank failed to copy its state" in ranks[1][1]["message"]
    assert max(save["seconds"] for r in ranks for save in r) < 20, ranks
    assert (tmp_path / "save2" / ".metadata").is_file()


def snapshot(root: Path) -> dict[str, str]:
    """Every file under root with its sha256: proves a failed start overwrote nothing."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def three_checkpoints(tmp_path: Path) -> Path:
    """A finished 30-step run with checkpoints at 10, 20, 30; its digest in `digest.txt`."""
    ckpt = tmp_path / "ckpt"
    run = train(ckpt)
    assert run.returncode == 0, run.stderr
    assert [p.name for p in published(ckpt)] == ["step-00000030", "step-00000020", "step-00000010"]
    (tmp_path / "digest.txt").write_text(run.digest())
    return ckpt


def rewrite_manifest_entry(ckpt: Path, name: str) -> None:
    """Make the manifest agree with a replaced file, so only the loader can object."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    data = (ckpt / name).read_bytes()
    manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def test_published_checkpoints_verify_and_hold_every_part(three_checkpoints: Path) -> None:
    newest = published(three_checkpoints)[0]
    manifest = verify(newest)
    assert set(manifest["files"]) == {"train.pt", "rank-00000.pt"}
    assert manifest["step"] == 30 and manifest["world_size"] == 1
    assert manifest["resume_fields"]["global_batch_size"] == 8
    saved = torch.load(newest / "train.pt", weights_only=True)
    assert set(saved) == {"step", "model", "optimizer", "scheduler", "scaler", "sampler"}
    assert saved["sampler"]["consumed"] == 30 * 8
    rng = torch.load(newest / "rank-00000.pt", weights_only=True)["rng"]
    assert set(rng) >= {"python", "numpy", "torch"}


@pytest.mark.parametrize("damage,reason", [
    ("truncate", "bytes, the manifest says"),
    ("bitflip", "fails its xxh3_128 check"),
    ("no_manifest", "no manifest"),
])
def test_damaged_newest_checkpoint_is_skipped_with_its_reason(
        damage: str, reason: str, three_checkpoints: Path) -> None:
    newest = three_checkpoints / "step-00000030"
    target = newest / "train.pt"
    if damage == "truncate":
        os.truncate(target, target.stat().st_size // 2)
    elif damage == "bitflip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
    else:
        (newest / "manifest.json").unlink()
    run = train(three_checkpoints)  # same 30 steps: falls back to 20 and replays 21..30
    skipped = run.of("checkpoint_skipped")
    assert len(skipped) == 1 and skipped[0]["path"].endswith("step-00000030")
    assert reason in skipped[0]["reason"]
    assert run.of("checkpoint_restored")[0]["step"] == 20
    assert run.digest() == (three_checkpoints.parent / "digest.txt").read_text(), "replay is bit-exact"
    verify(three_checkpoints / "step-00000030")  # the damaged one was replaced by a valid save


@pytest.mark.parametrize("setting", [True, False])
def test_checkpoint_files_skip_the_zip_crc32_and_leave_the_setting_as_it_was(
        setting: bool, tmp_path: Path) -> None:
    """Several threads write at once: each writes without CRC32, and the setting comes back."""
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(setting)
    try:
        payload = {"w": torch.arange(1000.0)}
        threads = [threading.Thread(target=write_file, args=(tmp_path / f"{i}.pt", payload)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with pytest.raises(OSError):
            write_file(tmp_path / "full.pt", payload, fail_after=10)
        assert torch.serialization.get_crc32_options() is setting
    finally:
        torch.serialization.set_crc32_options(previous)
    for i in range(4):
        with zipfile.ZipFile(tmp_path / f"{i}.pt") as archive:
            assert {info.CRC for info in archive.infolist()} == {0}
        assert torch.equal(torch.load(tmp_path / f"{i}.pt", weights_only=True)["w"], payload["w"])


def test_a_malicious_pickle_is_refused_and_never_executed(three_checkpoints: Path) -> None:
    marker = three_checkpoints.parent / "code-ran"
    newest = three_checkpoints / "step-00000030"
    buffer = io.BytesIO()
    torch.save({"step": 30, "payload": RunsCode(str(marker))}, buffer, pickle_module=pickle)
    (newest / "train.pt").write_bytes(buffer.getvalue())
    rewrite_manifest_entry(newest, "train.pt")
    run = train(three_checkpoints, "--max-steps", "40", "--allow-config-change", "max_steps")
    assert run.returncode == 0, run.stderr
    assert not marker.exists(), "the pickle's code must never run"
    assert "refused by the weights-only loader" in run.of("checkpoint_skipped")[0]["reason"]
    assert run.of("checkpoint_restored")[0]["step"] == 20


@pytest.mark.parametrize("flags,field", [
    (["--hidden-dim", "64"], "hidden_dim"),
    (["--micro-batch-size", "16"], "global_batch_size"),
    (["--lr", "0.01"], "lr"),
    (["--model", "transformer"], "model"),
])
def test_an_incompatible_config_exits_2_and_overwrites_nothing(
        flags: list[str], field: str, three_checkpoints: Path) -> None:
    before = snapshot(three_checkpoints)
    run = train(three_checkpoints, "--max-steps", "40", *flags)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{field}: checkpoint" in lines[0] and "incompatible" in lines[0]
    assert snapshot(three_checkpoints) == before


def test_an_incompatible_fallback_exits_2_and_overwrites_nothing(tmp_path: Path) -> None:
    """The newest checkpoint is compatible but corrupt; the one before it was saved with another
    learning rate. The refusal comes at the restore, not at the start: still one line, exit 2."""
    assert train(tmp_path, "--max-steps", "10").returncode == 0
    resumed = train(tmp_path, "--max-steps", "20", "--lr", "0.01", "--allow-config-change", "lr,max_steps")
    assert resumed.returncode == 0, resumed.stderr
    newest = tmp_path / "step-00000020" / "train.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    before = snapshot(tmp_path)
    run = train(tmp_path, "--max-steps", "20", "--lr", "0.01")
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "checkpoint at step 10 is incompatible (lr: checkpoint" in lines[0], lines
    after = snapshot(tmp_path)
    assert after.pop(".lock") and before.pop(".lock"), "the run held the directory's lock"
    assert after == before


def test_a_documented_flag_allows_a_deliberate_change(three_checkpoints: Path) -> None:
    run = train(three_checkpoints, "--max-steps", "40", "--lr", "0.01", "--allow-config-change", "lr,max_steps")
    assert run.returncode == 0, run.stderr
    assert run.of("checkpoint_restored")[0]["step"] == 30
    assert run.of("step")[-1]["lr"] < 0.01


def test_shape_fields_cannot_be_allowed_to_change() -> None:
    run = python_module(["--allow-config-change", "hidden_dim"], timeout=60)
    assert run.returncode == 2 and "cannot change on resume" in run.stderr


def test_injected_enospc_stops_with_a_clear_error_and_keeps_earlier_checkpoints(tmp_path: Path) -> None:
    run = train(tmp_path, "--fail-mode", "write-error", "--fail-at-step", "20")
    assert run.returncode != 0
    error = run.of("error")[0]
    assert error["phase"] == "checkpoint" and error["error"] == "CheckpointError"
    assert "No space left on device" in error["message"] and "step 20" in error["message"]
    assert [p.name for p in published(tmp_path)] == ["step-00000010"]
    verify(tmp_path / "step-00000010")
    resumed = train(tmp_path)
    assert resumed.of("checkpoint_restored")[0]["step"] == 10 and resumed.returncode == 0


def test_a_real_file_size_limit_fails_the_save_and_keeps_earlier_checkpoints(tmp_path: Path) -> None:
    """The kernel, not an injection, refuses the write (EFBIG): same guarantees."""
    assert train(tmp_path, "--max-steps", "10").returncode == 0
    size = (tmp_path / "step-00000010" / "train.pt").stat().st_size
    limit_kb = size // 1024 // 2  # room for small files, not for a second train.pt
    cmd = ["bash", "-c", f'ulimit -f {limit_kb}; exec "$0" -m reference_impl.train "$@"', sys.executable,
           *FLAGS, "--checkpoint-dir", str(tmp_path), "--allow-config-change", "max_steps"]
    run = run_command(cmd, timeout=120)
    assert run.returncode != 0
    assert "File too large" in run.of("error")[0]["message"]
    assert [p.name for p in published(tmp_path)] == ["step-00000010"]
    verify(tmp_path / "step-00000010")


@pytest.mark.parametrize("log_every", ["1", "1000"])  # the check runs every step, not at log steps
def test_a_non_finite_loss_halts_before_it_is_checkpointed(log_every: str, tmp_path: Path) -> None:
    """A learning rate of 1e30 blows the weights up in the first update: step 2 is the first
    non-finite one, and the run stops there, whatever the log interval."""
    run = train(tmp_path, "--optimizer", "sgd", "--lr", "1e30", "--grad-clip", "0", "--warmup-steps", "0",
                "--log-every", log_every)
    assert run.returncode == 1
    error = run.of("error")[0]
    assert error["error"] == "NonFiniteLoss"
    assert run.stderr.strip().splitlines() == [f"reference_impl.train: error: {error['message']}"], "no traceback"
    assert "non-finite loss on rank 0 at step 2;" in error["message"], error["message"]
    assert [e["step"] for e in run.of("nonfinite")] == [2]
    assert published(tmp_path) == [], "no checkpoint holds the poisoned weights"


def test_unpublished_and_foreign_directories_are_never_candidates(tmp_path: Path) -> None:
    for name in (".tmp-step-00000050", "step-50", "notes", "step-00000007"):
        (tmp_path / name).mkdir()
    assert [p.name for p in published(tmp_path)] == ["step-00000007"]
    with pytest.raises(CheckpointError, match="no manifest"):
        verify(tmp_path / "step-00000007")


def test_retention_keeps_only_the_last_n(tmp_path: Path) -> None:
    run = train(tmp_path, "--keep-last", "1")
    assert [e["step"] for e in run.of("checkpoint_saved")] == [10, 20, 30]
    assert [p.name for p in published(tmp_path)] == ["step-00000030"]


def test_the_checkpoint_modules_import_only_those_beneath_them() -> None:
    """The package is layered (files -> ... -> manager): no module imports a later one, so
    no import circle can come back."""
    import ast

    order = ["files", "integrity", "dcp_safe", "staging", "fit", "layouts", "manifest", "publish", "lock", "manager"]
    package = Path(__file__).resolve().parents[1] / "reference_impl" / "checkpoint"
    assert sorted(p.stem for p in package.glob("*.py") if p.stem != "__init__") == sorted(order)
    for position, name in enumerate(order):
        tree = ast.parse((package / f"{name}.py").read_text())
        imported = {node.module.rsplit(".", 1)[-1] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                    and node.module and node.module.startswith("reference_impl.checkpoint.")}
        imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                     and node.module == "reference_impl.checkpoint" for alias in node.names}
        assert imported <= set(order[:position]), f"{name} imports {sorted(imported - set(order[:position]))}"


def test_the_optimizer_step_waits_for_an_async_saves_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DCP copies the state on a thread of its own while training goes on; the next
    optimizer step must wait for that copy, or the checkpoint holds the step after."""
    import time

    import torch.distributed.checkpoint as dcp

    from reference_impl.checkpoint import staging
    from reference_impl.checkpoint.layouts import AsyncSaver

    copy_all = staging._copy_all
    monkeypatch.setattr(staging, "_copy_all", lambda *a: (time.sleep(0.5), copy_all(*a))[1])
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model(torch.randn(4, 64)).sum().backward()
    saved = model.weight.detach().clone()
    saver = AsyncSaver()
    saver.guard(optimizer)
    saver.start({"model": model.state_dict()}, tmp_path / "dcp")
    saver.then(lambda failure: None)  # nothing to publish: a bare DCP directory
    optimizer.step()  # changes the weight, after the copy
    saver.wait()
    assert not torch.equal(model.weight, saved), "the step ran"
    loaded = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(loaded, checkpoint_id=tmp_path / "dcp")
    assert torch.equal(loaded["model"]["weight"], saved), "the checkpoint holds the weights it was asked to save"


def test_a_run_releases_its_async_saver(tmp_path: Path) -> None:
    """The optimizer's step hook would keep the saver, its copying thread and a host copy of
    the state alive after `train` returns, one more of each per call."""
    from reference_impl.config import TrainConfig
    from reference_impl.distributed import DistContext
    from reference_impl.metrics import EventLog
    from reference_impl.train import train as run_train

    cfg = TrainConfig.from_cli(["--model", "mlp", "--strategy", "fsdp", "--async-checkpoint", "--checkpoint-dir",
                                str(tmp_path), "--checkpoint-every", "2", "--max-steps", "4", "--warmup-steps", "0",
                                "--device", "cpu", "--micro-batch-size", "8", "--dataset-size", "64"])
    state = None
    for _ in range(2):  # the second call restores step 4 and trains nothing, but still starts a saver
        state = run_train(cfg, DistContext(), EventLog(0, io.StringIO()), state=state)
        assert not state.optimizer._optimizer_step_pre_hooks, "the saver's hook outlived the run"
        deadline = time.monotonic() + 10
        while any(t.name.startswith("checkpoint-staging") for t in threading.enumerate()):
            assert time.monotonic() < deadline, "the stager's thread outlived the run"
            time.sleep(0.01)
    assert published(tmp_path)[0].name == "step-00000004"


def test_waiting_on_an_async_save_given_no_end_waits_for_its_write(tmp_path: Path) -> None:
    """`then` attaches the save's end; without it, `wait` still returns once the write does."""
    from reference_impl.checkpoint.layouts import AsyncSaver

    saver = AsyncSaver()
    saver.start({"model": torch.nn.Linear(8, 8).state_dict()}, tmp_path / "dcp")
    waiter = threading.Thread(target=saver.wait, daemon=True)
    waiter.start()
    waiter.join(30)
    assert not waiter.is_alive(), "wait() never returned"
    assert (tmp_path / "dcp" / ".metadata").is_file()


def test_one_host_stager_serves_every_async_save(tmp_path: Path) -> None:
    """Its buffers from the first save are refilled by the next, not allocated again."""
    from reference_impl.checkpoint.layouts import AsyncSaver
    from reference_impl.checkpoint.staging import HostStager

    model, saver, stagers = torch.nn.Linear(8, 8), AsyncSaver(), []
    for save in range(2):
        saver.start({"model": model.state_dict()}, tmp_path / str(save))
        saver.then(lambda failure: None)
        saver.wait()
        stagers.append(saver._stager)
    assert isinstance(stagers[0], HostStager) and stagers[1] is stagers[0]

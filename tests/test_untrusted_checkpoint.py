"""The checkpoint directory is untrusted input: any damage is skipped with a reason.

One small 20-step run (checkpoints at 10 and 20) is made once; each case damages a copy
of its step-20 directory and checks that the chooser, preflight and export all fall back
to step 10 without a traceback and without following a link.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from launch import python_module
from reference_impl.checkpoint import CheckpointError, CheckpointManager
from reference_impl.config import ConfigError, TrainConfig
from reference_impl.export import export
from reference_impl.export import main as export_main
from reference_impl.metrics import EventLog
from reference_impl.train import preflight

FLAGS = ["--max-steps", "20", "--checkpoint-every", "10", "--keep-last", "3", "--warmup-steps", "2",
         "--log-every", "10", "--micro-batch-size", "8", "--dataset-size", "256", "--hidden-dim", "32"]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ckpt = tmp_path_factory.mktemp("pristine") / "ckpt"
    run = python_module([*FLAGS, "--checkpoint-dir", str(ckpt)], timeout=60)
    assert run.returncode == 0, run.stderr
    return ckpt


def edit_manifest(step: Path, change: Callable[[dict], object]) -> None:
    manifest = json.loads((step / "manifest.json").read_text())
    change(manifest)  # mutates in place
    (step / "manifest.json").write_text(json.dumps(manifest))


def relist(step: Path, name: str) -> None:
    data = (step / name).read_bytes()
    edit_manifest(step, lambda m: m["files"].__setitem__(
        name, {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}))


def write_text(name: str, text: str) -> Callable[[Path], None]:
    return lambda step: (step / name).write_text(text)


def symlink_dir(step: Path) -> None:
    target = step.parent.parent / "elsewhere"
    shutil.move(step, target)
    step.symlink_to(target, target_is_directory=True)


def symlink_file(step: Path) -> None:
    outside = step.parent.parent / "outside-train.pt"
    shutil.move(step / "train.pt", outside)
    (step / "train.pt").symlink_to(outside)  # same bytes, same hash: still refused


def rename_dir(step: Path) -> None:
    step.rename(step.with_name("step-00000015"))


def other_step_inside(step: Path) -> None:
    saved = torch.load(step / "train.pt", weights_only=True)
    torch.save({**saved, "step": 21}, step / "train.pt")
    relist(step, "train.pt")


def entry(name: str) -> Callable[[Path], None]:
    return lambda step: edit_manifest(step, lambda m: m["files"].__setitem__(
        name, {"sha256": "0" * 64, "bytes": 1}))


def replace_with(name: str, kind: str) -> Callable[[Path], None]:
    """Put a FIFO (opening it for reading would block forever), a directory, or a sparse
    file larger than any manifest may be, where `name` was."""
    def damage(step: Path) -> None:
        (step / name).unlink()
        if kind == "fifo":
            os.mkfifo(step / name)
        elif kind == "directory":
            (step / name).mkdir()
        else:
            with (step / name).open("wb") as f:
                f.truncate(100 << 20)
    return damage


def field(key: str, value: object) -> Callable[[Path], None]:
    return lambda step: edit_manifest(step, lambda m: m.__setitem__(key, value))


CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "not_json": (write_text("manifest.json", "{not json"), "unreadable manifest"),
    "a_list": (write_text("manifest.json", "[1, 2]"), "not an object"),
    "deep_nesting": (write_text("manifest.json", "[" * 100000), "unreadable manifest"),
    "older_format": (lambda s: edit_manifest(s, lambda m: m.__setitem__("format", 1)),
                     "unknown checkpoint format 1"),
    "missing_files_key": (lambda s: edit_manifest(s, lambda m: m.pop("files")), "no 'files'"),
    "step_is_a_string": (lambda s: edit_manifest(s, lambda m: m.__setitem__("step", "20")), "'step' is invalid"),
    "files_is_a_list": (lambda s: edit_manifest(s, lambda m: m.__setitem__("files", [])), "'files' is invalid"),
    "empty_file_list": (lambda s: edit_manifest(s, lambda m: m.__setitem__("files", {})), "'files' is invalid"),
    "entry_not_a_dict": (lambda s: edit_manifest(s, lambda m: m["files"].__setitem__("train.pt", "x")),
                         "is not {'xxh3_128' (or 'sha256')"),
    "huge_world_size": (lambda s: edit_manifest(s, lambda m: m.__setitem__("world_size", 10**12)),
                        "exceeds the files listed"),
    "dotdot_path": (entry("../step-00000010/train.pt"), "outside the checkpoint directory"),
    "absolute_path": (entry("/etc/passwd"), "outside the checkpoint directory"),
    "symlinked_step_dir": (symlink_dir, "symbolic link"),
    "symlinked_file": (symlink_file, "symbolic link"),
    "name_and_manifest_disagree": (rename_dir, "holds a manifest of step 20"),
    "contents_disagree": (other_step_inside, "holds step 21"),
    "required_part_unlisted": (lambda s: edit_manifest(s, lambda m: m["files"].pop("rank-00000.pt")),
                               "required part rank-00000.pt is not listed"),
    "layout_is_a_list": (field("layout", ["dcp"]), "'layout' is invalid"),
    "layout_is_an_object": (field("layout", {"dcp": 1}), "'layout' is invalid"),
    "world_size_is_true": (field("world_size", True), "'world_size' is invalid"),
    "format_is_a_float": (field("format", 2.0), "unknown checkpoint format"),
    "a_listed_name_with_a_newline": (lambda s: edit_manifest(s, lambda m: m["files"].__setitem__("a\nb", {})),
                                "outside the checkpoint directory"),
    "manifest_is_a_fifo": (replace_with("manifest.json", "fifo"), "not a regular file"),
    "manifest_is_a_directory": (replace_with("manifest.json", "directory"), "not a regular file"),
    "manifest_is_too_large": (replace_with("manifest.json", "sparse"), "more than the 67108864 allowed"),
    "train_pt_is_a_fifo": (replace_with("train.pt", "fifo"), "train.pt is not a regular file"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(CASES))
def test_any_damage_is_skipped_with_a_reason_and_restore_falls_back(
        case: str, pristine: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(pristine, ckpt, symlinks=True)
    damage, reason = CASES[case]
    damage(ckpt / "step-00000020")
    stream = io.StringIO()
    chosen = CheckpointManager(ckpt, EventLog(0, stream)).choose()
    assert chosen is not None and chosen[1]["step"] == 10
    skipped = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [e["event"] for e in skipped] == ["checkpoint_skipped"]
    assert reason in skipped[0]["reason"], skipped[0]["reason"]
    cfg = TrainConfig.from_cli([*FLAGS, "--checkpoint-dir", str(ckpt)], environ={})
    try:
        preflight(cfg)  # survives any manifest shape: passes, or refuses with one line
    except ConfigError:
        pass
    out = tmp_path / "out" / "model.pt"
    out.parent.mkdir()
    before = os.stat(ckpt).st_mtime_ns
    assert export(ckpt, out).name == "step-00000010"
    assert os.stat(ckpt).st_mtime_ns == before, "export wrote nothing inside the checkpoint directory"


@pytest.mark.timeout(60)
def test_a_symlinked_step_directory_is_never_deleted_through(pristine: Path, tmp_path: Path) -> None:
    """Resume from 10 trains to 20 and publishes over the link: the link goes, its target stays."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(pristine, ckpt)
    victim = tmp_path / "victim"
    shutil.move(ckpt / "step-00000020", victim)
    (ckpt / "step-00000020").symlink_to(victim, target_is_directory=True)
    files = sorted(p.name for p in victim.iterdir())
    run = python_module([*FLAGS, "--checkpoint-dir", str(ckpt)], timeout=60)
    assert run.returncode == 0, run.stderr
    assert "symbolic link" in run.of("checkpoint_skipped")[0]["reason"]
    assert run.of("checkpoint_restored")[0]["step"] == 10
    assert sorted(p.name for p in victim.iterdir()) == files, "the link's target is untouched"
    assert not (ckpt / "step-00000020").is_symlink()


@pytest.mark.timeout(90)
def test_export_of_a_sharded_checkpoint_writes_no_scratch_files_inside_it(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run = python_module(["--strategy", "fsdp", "--model", "transformer", "--max-steps", "2",
                         "--warmup-steps", "1", "--micro-batch-size", "4", "--dataset-size", "64",
                         "--checkpoint-dir", str(ckpt)], timeout=60)
    assert run.returncode == 0, run.stderr
    before = {p: os.stat(p).st_mtime_ns for p in (ckpt, ckpt / "step-00000002")}
    out = tmp_path / "model.pt"
    assert export(ckpt, out).name == "step-00000002"
    assert {p: os.stat(p).st_mtime_ns for p in before} == before, "no scratch file created and removed there"
    assert torch.load(out, weights_only=True)["step"] == 2


def test_export_refuses_an_output_it_would_damage_and_names_a_failed_write(
        pristine: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An output inside the checkpoint directory used to overwrite the newest checkpoint's own
    file (and exit 0); a directory or an unwritable path ended in a traceback."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(pristine, ckpt)
    (tmp_path / "afile").write_text("not a directory")
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in ckpt.rglob("*") if p.is_file()}
    cases = {ckpt / "step-00000020" / "train.pt": "is inside", ckpt: "is a directory",
             tmp_path / "afile" / "model.pt": "failed: Not a directory"}
    for out, message in cases.items():
        assert export_main([str(ckpt), str(out)]) == 2, out
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith("reference_impl.export: error: ") and message in last, last
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in ckpt.rglob("*") if p.is_file()} == before
    assert not list(tmp_path.rglob("*.tmp")), "no scratch file left behind"
    assert export_main([str(ckpt), str(tmp_path / "model.pt")]) == 0
    assert torch.load(tmp_path / "model.pt", weights_only=True)["step"] == 20


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", ["torch_save", "dcp"])
def test_export_racing_retention_always_exports_a_checkpoint_that_was_valid(layout: str, tmp_path: Path) -> None:
    """A run saving every step under --keep-last 1 prunes the checkpoint an export has just
    listed. Export used to read half-deleted directories: "no valid checkpoint" while one
    existed, and under DCP a raw CheckpointException. Now it pins what it reads and lists
    again when a newer one appeared: every export succeeds."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "model.pt"
    extra = (["--strategy", "fsdp", "--model", "transformer", "--dataset-size", "64", "--micro-batch-size", "4"]
             if layout == "dcp" else FLAGS[8:])
    args = ["--max-steps", "40", "--warmup-steps", "1", "--checkpoint-every", "1", "--keep-last", "1",
            "--log-every", "1000", "--checkpoint-dir", str(ckpt), *extra]
    runs: list = []
    trainer = threading.Thread(target=lambda: runs.append(python_module(args, timeout=150)))
    trainer.start()
    exported, failures = [], []
    while trainer.is_alive():
        if not list(ckpt.glob("step-*")):
            time.sleep(0.05)
            continue
        try:
            exported.append(export(ckpt, out, EventLog(0, io.StringIO())).name)
        except CheckpointError as exc:
            failures.append(str(exc))
    trainer.join()
    assert runs and runs[0].returncode == 0, runs[0].stderr[-3000:] if runs else "the trainer failed"
    assert not failures, failures[:3]
    assert len(exported) >= 3, exported
    assert torch.load(out, weights_only=True)["step"] == int(exported[-1][5:])


def test_export_never_replaces_a_link_a_fifo_or_a_device(
        pristine: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`export DIR /dev/stdout` as root renamed the model file over the /dev/stdout link (and
    `/dev/full` over the device). The same kinds of file, made here rather than in /dev: each
    is refused in one line, exit 2, and stays what it was."""
    target = tmp_path / "target.pt"
    target.write_bytes(b"the link's target")
    outs = {tmp_path / "link.pt": "a symbolic link", tmp_path / "fifo": "a FIFO"}
    (tmp_path / "link.pt").symlink_to(target)
    os.mkfifo(tmp_path / "fifo")
    with contextlib.suppress(PermissionError):  # only root may make a device node
        os.mknod(tmp_path / "full", 0o600 | stat.S_IFCHR, os.makedev(1, 7))  # /dev/full's numbers
        outs[tmp_path / "full"] = "a device"
    kinds = {out: stat.S_IFMT(out.lstat().st_mode) for out in outs}
    for out, what in outs.items():
        assert export_main([str(pristine), str(out)]) == 2, out
        lines = capsys.readouterr().err.strip().splitlines()
        assert lines[-1] == f"reference_impl.export: error: {out} is {what}; export replaces only a regular file"
    assert {out: stat.S_IFMT(out.lstat().st_mode) for out in outs} == kinds, "nothing was replaced"
    assert target.read_bytes() == b"the link's target"
    assert not list(tmp_path.glob(".*.tmp")), "no scratch file left behind"


def rewrite(name: str, change: Callable[[dict], object]) -> Callable[[Path], None]:
    """Edit what `name` holds and list its new checksum: intact, but no longer fitting."""
    def damage(step: Path) -> None:
        saved = torch.load(step / name, weights_only=True)
        change(saved)
        torch.save(saved, step / name)
        relist(step, name)
    return damage


def rename_parameter(saved: dict) -> None:
    first = next(iter(saved["model"]))
    saved["model"][f"renamed.{first}"] = saved["model"].pop(first)


MISFITS: dict[str, tuple[Callable[[Path], None], str]] = {
    "renamed_parameter": (rewrite("train.pt", rename_parameter), "train.pt's model does not fit this model"),
    "optimizer_moment_of_another_shape": (rewrite("train.pt", lambda s: s["optimizer"]["state"][0].__setitem__(
        "exp_avg", torch.zeros(3))), "train.pt's optimizer exp_avg of parameter 0"),
    "torch_rng_of_another_size": (rewrite("rank-00000.pt", lambda s: s["rng"].__setitem__(
        "torch", torch.zeros(7, dtype=torch.uint8))), "rank-00000.pt's RNG state does not fit"),
    "numpy_rng_of_another_size": (rewrite("rank-00000.pt", lambda s: s["rng"]["numpy"].__setitem__(
        "keys", torch.zeros(3, dtype=torch.int64))), "rank-00000.pt's RNG state does not fit"),
    "negative_progress": (rewrite("train.pt", lambda s: s["sampler"].__setitem__("consumed", -64)),
                          "saved progress -64 is not an optimizer-step boundary"),
    "epoch_far_ahead": (rewrite("train.pt", lambda s: s["sampler"].__setitem__("epoch", 10**6)),
                        "saved epoch 1000000 cannot follow step 20"),
    "progress_past_its_step": (rewrite("train.pt", lambda s: s["sampler"].__setitem__("consumed", 256)),
                               "saved progress 256 cannot follow step 20"),
    "scheduler_garbage": (rewrite("train.pt", lambda s: s.__setitem__("scheduler", {"last_epoch": "x"})),
                          "train.pt's scheduler holds ['last_epoch']"),
    "scheduler_without_rates": (rewrite("train.pt", lambda s: s["scheduler"].__setitem__("base_lrs", [])),
                                "train.pt's scheduler.base_lrs"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(MISFITS))
def test_intact_content_that_does_not_fit_is_a_reason_to_fall_back(case: str, pristine: Path, tmp_path: Path) -> None:
    """Correct checksums over content this run cannot load used to end every restart in a
    traceback (or, for a far-ahead epoch, in a silently wrong data order). Each is now checked
    against the live objects before anything is loaded: skipped with its reason, step 10 used."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(pristine, ckpt)
    damage, reason = MISFITS[case]
    damage(ckpt / "step-00000020")
    run = python_module([*FLAGS, "--max-steps", "25", "--allow-config-change", "max_steps",
                         "--checkpoint-dir", str(ckpt)], timeout=60)
    assert run.returncode == 0, run.stderr[-3000:]
    skipped = run.of("checkpoint_skipped")
    assert [e["path"] for e in skipped] == [str(ckpt / "step-00000020")]
    assert reason in skipped[0]["reason"], skipped[0]["reason"]
    assert run.of("checkpoint_restored")[0]["step"] == 10

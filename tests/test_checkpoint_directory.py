"""The checkpoint directory as the manager owns it: retention that never costs a valid
checkpoint, step names that are ASCII or nothing, a lock that writes through no link,
permissions that no umask widens, and odd files that are reasons, not hangs."""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from checkpoints import manager, published, verify
from launch import REPO, Run, python_module, run_command
from reference_impl.checkpoint.files import CheckpointError
from reference_impl.checkpoint.lock import DirectoryLock
from reference_impl.checkpoint.publish import Publication
from reference_impl.distributed import DistContext
from reference_impl.metrics import EventLog
from reference_impl.reliability.faults import FaultInjector

pytestmark = pytest.mark.timeout(120)

FLAGS = ["--warmup-steps", "2", "--log-every", "10", "--micro-batch-size", "8", "--dataset-size", "256",
         "--hidden-dim", "32"]


def train(ckpt: Path, steps: int, every: int, keep: int, *extra: str) -> Run:
    run = python_module([*FLAGS, "--max-steps", str(steps), "--checkpoint-every", str(every),
                         "--keep-last", str(keep), "--checkpoint-dir", str(ckpt), *extra], timeout=60)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def files_of(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def forty(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 40-step run with checkpoints at 20, 30 and 40."""
    ckpt = tmp_path_factory.mktemp("forty") / "ckpt"
    train(ckpt, 40, 10, 3)
    assert [p.name for p in published(ckpt)] == ["step-00000040", "step-00000030", "step-00000020"]
    return ckpt


def test_a_corrupt_newer_directory_never_costs_a_valid_checkpoint(forty: Path, tmp_path: Path) -> None:
    """A corrupt step 48 above everything: saving 45 under --keep-last 1 keeps 45, deletes 40 and
    older, and leaves 48 alone; a relaunch resumes from 45."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(forty, ckpt)
    corrupt = ckpt / "step-00000048"
    shutil.copytree(ckpt / "step-00000040", corrupt)
    (corrupt / "train.pt").write_bytes(b"garbage")
    before = files_of(corrupt)
    run = train(ckpt, 45, 5, 1, "--allow-config-change", "max_steps")
    assert run.of("checkpoint_restored")[0]["step"] == 40
    assert [p.name for p in published(ckpt)] == ["step-00000048", "step-00000045"]
    verify(ckpt / "step-00000045")
    assert files_of(corrupt) == before, "the invalid directory is left for inspection"
    again = train(ckpt, 45, 5, 1)
    assert again.of("checkpoint_restored")[0]["step"] == 45


IMPOSTORS = ["step-٠٠٠٠٠٠٣٠", "step-00000050\n", "step-０００００００５０", "step-0000005"]


def test_only_ascii_step_names_count_and_others_are_ignored_with_a_reason(forty: Path, tmp_path: Path) -> None:
    """Copies of step 30 under names that are not ASCII `step-` + eight digits (Arabic-Indic
    digits sort above every real step; a trailing newline; full-width digits; seven digits)
    are never restored and never push out a real one."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(forty, ckpt)
    for name in IMPOSTORS:
        shutil.copytree(ckpt / "step-00000030", ckpt / name)
    run = train(ckpt, 45, 5, 1, "--allow-config-change", "max_steps")
    assert run.of("checkpoint_restored")[0]["step"] == 40
    assert sorted(e["path"] for e in run.of("checkpoint_ignored")) == sorted(str(ckpt / n) for n in IMPOSTORS)
    assert [p.name for p in published(ckpt)] == ["step-00000045"]
    assert all((ckpt / name).is_dir() for name in IMPOSTORS), "a name that is not ours is never deleted"


def test_the_lock_never_writes_through_a_planted_link(forty: Path, tmp_path: Path) -> None:
    ckpt, victim = tmp_path / "ckpt", tmp_path / "victim"
    shutil.copytree(forty, ckpt)
    victim.write_text("precious")
    (ckpt / ".lock").unlink(missing_ok=True)
    (ckpt / ".lock").symlink_to(victim)
    train(ckpt, 40, 10, 3)
    assert victim.read_text() == "precious", "the link's target was opened"
    assert stat.S_ISREG((ckpt / ".lock").lstat().st_mode), "the link was replaced by a file of our own"


def test_a_forked_child_does_not_inherit_the_lock(tmp_path: Path) -> None:
    """A DataLoader worker (a fork) outliving its rank must not keep a relaunch out: a record
    lock (`lockf`) is not inherited across fork, an `flock` would be."""
    lock = DirectoryLock(tmp_path).__enter__()
    child = os.fork()
    if child == 0:  # the child keeps the descriptor open, as a worker would
        import time
        time.sleep(5)
        os._exit(0)
    try:
        lock.__exit__(None, None, None)
        probe = [sys.executable, "-c", "import sys; from pathlib import Path; "
                 "from reference_impl.checkpoint.lock import DirectoryLock; "
                 "DirectoryLock(Path(sys.argv[1])).__enter__()", str(tmp_path)]
        result = subprocess.run(probe, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr[-2000:]
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)


@pytest.mark.parametrize("layout", ["torch_save", "dcp"])
def test_checkpoints_are_never_world_writable_even_under_umask_000(layout: str, tmp_path: Path) -> None:
    ckpt = tmp_path / "new" / "ckpt"
    extra = ["--strategy", "fsdp", "--model", "transformer", "--dataset-size", "64"] if layout == "dcp" else []
    cmd = ["bash", "-c", 'umask 000; exec "$0" -m reference_impl.train "$@"', sys.executable, *FLAGS,
           "--max-steps", "2", "--checkpoint-every", "1", "--checkpoint-dir", str(ckpt), *extra]
    run = run_command(cmd, timeout=90)
    assert run.returncode == 0, run.stderr[-3000:]
    modes = {str(p.relative_to(tmp_path)): stat.S_IMODE(p.lstat().st_mode)
             for p in [tmp_path / "new", ckpt, *ckpt.rglob("*")]}
    assert any("dcp/" in name for name in modes) == (layout == "dcp")
    wrong = {name: oct(mode) for name, mode in modes.items()
             if mode != (0o755 if (tmp_path / name).is_dir() else 0o644)}
    assert not wrong, wrong


def users_own(kind: str, path: Path) -> None:
    """Put something of the user's at `path`: a FIFO, a directory with a file in it, or a file."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
        (path / "notes.txt").write_text("the user's")
    else:
        path.write_text("the user's")


@pytest.mark.parametrize("name,kind", [("progress.json", "fifo"), ("progress.json", "directory"),
                                       ("progress.json", "file"), (".lock", "file")])
def test_what_the_trainer_did_not_write_is_refused_never_deleted_or_overwritten(
        name: str, kind: str, forty: Path, tmp_path: Path) -> None:
    """A progress.json directory used to be deleted with its contents by the debris cleanup,
    and a user's progress.json or .lock file overwritten. Now the run refuses the directory:
    exit 2, one line, and everything stays as it was."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(forty, ckpt)
    (ckpt / name).unlink()
    users_own(kind, ckpt / name)
    (ckpt / ".tmp-step-notes").mkdir()  # a prefix of a save's temporary name, but not one
    before = {p: stat.S_IFMT(p.lstat().st_mode) for p in ckpt.rglob("*")}
    ours = ".lock" if name != ".lock" else None  # the lock's holder record is the trainer's to rewrite
    contents = {k: v for k, v in files_of(ckpt).items() if k != ours}
    run = python_module([*FLAGS, "--max-steps", "45", "--checkpoint-every", "5", "--keep-last", "3",
                         "--allow-config-change", "max_steps", "--checkpoint-dir", str(ckpt)], timeout=60)
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stderr.strip().splitlines() == [f"reference_impl.train: error: checkpoint_dir {ckpt} holds "
                                               + run.stderr.split(" holds ", 1)[1].strip()]
    assert f"{name}" in run.stderr and "this trainer did not write" in run.stderr
    assert {p: stat.S_IFMT(p.lstat().st_mode) for p in ckpt.rglob("*")} == before
    assert {k: v for k, v in files_of(ckpt).items() if k != ours} == contents


def test_a_progress_note_a_crash_left_empty_is_the_trainers_own(forty: Path, tmp_path: Path) -> None:
    """The note is written without fsync: after a power loss it may be empty, and is still ours."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(forty, ckpt)
    (ckpt / "progress.json").write_text("")
    run = train(ckpt, 45, 5, 3, "--allow-config-change", "max_steps")
    assert run.of("checkpoint_restored")[0]["steps_replayed"] == 0
    assert json.loads((ckpt / "progress.json").read_text()) == {"step": 45}


@pytest.mark.parametrize("path", ["/proc/sample-log", "{file}/sub"])
def test_an_unwritable_sample_log_exits_2_with_one_line_before_training(path: str, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    run = python_module([*FLAGS, "--max-steps", "2", "--sample-log", path.format(file=tmp_path / "file")],
                        timeout=60)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "sample_log" in lines[0], run.stderr[-2000:]
    assert run.of("run_start") == [], "refused before any process group or model"


def test_retention_counts_only_checkpoints_that_verify(forty: Path, tmp_path: Path) -> None:
    """A corrupt step 30 between valid ones: keeping 2 below step 40 keeps 40 and 20, removes 30."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(forty, ckpt)
    (ckpt / "step-00000030" / "train.pt").write_bytes(b"garbage")
    manager(ckpt, keep_last=2).retain(ckpt / "step-00000040")
    assert [p.name for p in published(ckpt)] == ["step-00000040", "step-00000020"]


def background_train(ckpt: Path, log: Path, max_steps: int, *extra: str) -> subprocess.Popen:
    """The trainer in its own interpreter, saving every step, its output in `log`.{out,err}."""
    cmd = [sys.executable, "-m", "reference_impl.train", *FLAGS, "--max-steps", str(max_steps),
           "--checkpoint-every", "1", "--keep-last", "2", "--checkpoint-dir", str(ckpt), *extra]
    with open(f"{log}.out", "w") as out, open(f"{log}.err", "w") as err:
        return subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=err, env={**os.environ, "OMP_NUM_THREADS": "1"})


def wait_for(process: subprocess.Popen, timeout: float) -> int | None:
    """The exit status, or None (and the process killed) if it is still running at `timeout`."""
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(30)
        return None


def first_checkpoint(ckpt: Path, holder: subprocess.Popen) -> None:
    """Wait (generously: a loaded machine) until the holder has published a checkpoint."""
    for _ in range(1200):
        if published(ckpt) or holder.poll() is not None:
            break
        time.sleep(0.1)
    assert published(ckpt), "the holder published nothing"


@pytest.mark.parametrize("removed", ["directory", "lock_file"])
def test_a_run_whose_lock_is_deleted_stops_with_one_line_and_never_shares_the_directory(
        removed: str, tmp_path: Path) -> None:
    """`rm -rf` of the directory under a run, or of its .lock only: the holder used to go on,
    recreating the directory without a lock, while a second run took a new lock and both wrote
    (one died in retain(), one lost its in-flight save to the other's debris cleanup). Now the
    holder compares .lock's inode with its own before every write: it stops with one line and
    status 1 and writes nothing more; the second run owns the directory alone."""
    ckpt = tmp_path / "ckpt"
    holder = background_train(ckpt, tmp_path / "holder", 10**6)  # never ends by itself
    second = None
    try:
        first_checkpoint(ckpt, holder)
        if removed == "directory":
            while ckpt.exists():  # `rm -rf` again when a save in flight added a file meanwhile
                shutil.rmtree(ckpt, ignore_errors=True)
        else:
            (ckpt / ".lock").unlink()
            second = background_train(ckpt, tmp_path / "second", 40, "--allow-config-change", "max_steps")
        status = wait_for(holder, 90)
        assert status == 1, f"the holder is still running or ended otherwise ({status})"
        if removed == "directory":
            assert not ckpt.exists(), "the holder made the deleted directory again"
        else:
            assert second is not None and wait_for(second, 120) == 0, (tmp_path / "second.err").read_text()[-3000:]
            for path in published(ckpt):
                verify(path)
    finally:
        for process in (holder, second):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(30)
    lines = (tmp_path / "holder.err").read_text().strip().splitlines()
    assert len(lines) == 1 and "lost its lock" in lines[0], lines[-5:]


@pytest.mark.parametrize("vanished", ["its_own_manifest", "a_file_it_did_not_write"])
def test_a_file_of_its_own_save_that_vanishes_is_reported_as_the_directory_lost(vanished: str, tmp_path: Path) -> None:
    """`rm -rf` of the directory reaches a step's files before `.lock`: the save that finds its
    own manifest gone says the run lost its directory, as the lock check would a moment later
    (before, the line named the missing file, 1 run in many of the test above). A missing file
    that is not the save's own is reported as it is."""
    tmp, final = tmp_path / ".tmp-step-00000001", tmp_path / "step-00000001"
    tmp.mkdir()
    elsewhere = tmp_path / "elsewhere.json"

    def retain(published: Path) -> None:  # retention reading a manifest that went meanwhile
        gone = published / "manifest.json" if vanished == "its_own_manifest" else elsewhere
        gone.unlink(missing_ok=True)
        gone.stat()

    publication = Publication(tmp, final, {"step": 1}, retain, EventLog(0, io.StringIO()), FaultInjector.disabled(),
                              time.perf_counter(), lambda: None)
    with pytest.raises(CheckpointError) as failed:
        publication({})
    if vanished == "its_own_manifest":
        said = f"checkpoint_dir {tmp_path} lost its lock: manifest.json, written by this save, vanished"
        assert said in str(failed.value), failed.value
    else:
        assert "lost its lock" not in str(failed.value) and "elsewhere.json" in str(failed.value)


@pytest.mark.parametrize("error", [errno.ENOENT, errno.ENOSPC])
def test_a_progress_note_that_vanishes_mid_write_is_the_directory_lost(
        error: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same race on the progress note: its temporary file gone before the rename (an
    `rm -rf` under way) marks the lock lost, and the next save stops every rank, instead of
    rank 0 alone dying on the missing file. A full disk is still a failure of its own."""
    import reference_impl.checkpoint.manager as manager_module

    def write_private(path: Path, data: bytes, durable: bool = True) -> None:
        raise OSError(error, os.strerror(error), str(path))

    monkeypatch.setattr(manager_module, "write_private", write_private)
    events = io.StringIO()
    owner = manager_module.CheckpointManager(tmp_path, EventLog(0, events))
    if error == errno.ENOSPC:
        with pytest.raises(CheckpointError, match="recording progress .step 3. .* No space left"):
            owner.record_progress(3, DistContext())
        return
    owner.record_progress(3, DistContext())
    lost = [json.loads(line) for line in events.getvalue().splitlines() if "checkpoint_lock_lost" in line]
    assert len(lost) == 1 and lost[0]["step"] == 3, events.getvalue()
    reason = lost[0]["reason"]
    assert "lost its lock: .progress.json." in reason and "written by this run, vanished" in reason, reason
    owner.record_progress(4, DistContext())
    assert events.getvalue().count("checkpoint_lock_lost") == 1, "nothing more is written once the lock is lost"

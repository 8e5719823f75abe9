"""Operational safety in one process: the end of the run, the directory lock, SIGTERM,
the sample log, a full disk and bad input. Each run is a small MLP (a few seconds); the
ranks' agreement on SIGTERM is checked on a two-process gloo group, without torchrun."""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from multiprocessing.synchronize import Event
from pathlib import Path

import pytest

import preemption_worker
from checkpoints import manager, published
from launch import REPO, Run, alive, free_port, python_module, run_ranks
from reference_impl.checkpoint import CheckpointError
from reference_impl.config import TrainConfig
from reference_impl.distributed import DistContext
from reference_impl.reliability.lifecycle import AGREE_AT_LEAST_EVERY, Preemption, loader_worker_init
from reference_impl.metrics import EventLog
from reference_impl.options.training import SEED_STRIDE
from reference_impl.step import lr_multiplier
from reference_impl.train import train as run_train

pytestmark = pytest.mark.timeout(120)

FLAGS = ["--checkpoint-every", "10", "--keep-last", "3", "--warmup-steps", "2", "--log-every", "10",
         "--micro-batch-size", "8", "--dataset-size", "256", "--hidden-dim", "32"]


def train(ckpt: Path, steps: int, *extra: str, timeout: float = 60, env: dict[str, str] | None = None) -> Run:
    return python_module([*FLAGS, "--max-steps", str(steps), "--checkpoint-dir", str(ckpt), *extra],
                         timeout=timeout, env=env)


def tree(root: Path) -> dict[str, bytes]:
    """Every file under root with its bytes (the lock file aside: it names its holder)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != ".lock"}


def error_line(run: Run) -> str:
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, (run.returncode, run.stderr[-3000:])
    return lines[0]


@pytest.fixture(scope="module")
def twenty(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A finished 20-step run with checkpoints at 10, 15 and 20, and its digest."""
    ckpt = tmp_path_factory.mktemp("twenty") / "ckpt"
    run = train(ckpt, 20, "--checkpoint-every", "5")
    assert run.returncode == 0, run.stderr
    assert [p.name for p in published(ckpt)] == ["step-00000020", "step-00000015", "step-00000010"]
    return ckpt, run.digest()


# Item 1: the end of the run.

def test_a_smaller_max_steps_is_refused_with_one_line_and_touches_nothing(
        twenty: tuple[Path, str], tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(twenty[0], ckpt)
    before = tree(ckpt)
    line = error_line(train(ckpt, 10, "--checkpoint-every", "5", timeout=30))
    assert "max_steps: checkpoint 20, now 10" in line and "--allow-config-change max_steps" in line
    assert tree(ckpt) == before


def test_a_restore_at_or_past_max_steps_finishes_at_once_and_deletes_nothing(
        twenty: tuple[Path, str], tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(twenty[0], ckpt)
    before = tree(ckpt)
    for steps, extra in ((10, ["--allow-config-change", "max_steps"]), (20, [])):
        run = train(ckpt, steps, "--checkpoint-every", "5", "--keep-last", "1", *extra, timeout=30)
        assert run.returncode == 0, run.stderr
        assert run.of("checkpoint_restored")[0]["step"] == 20
        assert run.of("step") == [] and run.of("checkpoint_saved") == []
        assert run.of("run_complete")[0]["step"] == 20 and run.digest() == twenty[1], "the restored state"
        assert tree(ckpt) == before, "no checkpoint written or deleted"


def test_an_allowed_max_steps_change_reports_and_applies_the_new_schedule(
        twenty: tuple[Path, str], tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(twenty[0], ckpt)
    resumed = train(ckpt, 30, "--log-every", "1", "--allow-config-change", "max_steps")
    assert resumed.returncode == 0, resumed.stderr
    change = resumed.of("lr_schedule_changed")[0]
    cfg20, cfg30 = (TrainConfig(max_steps=n, warmup_steps=2) for n in (20, 30))
    assert change["step"] == 20 and change["changed"] == ["max_steps"]
    assert change["old_lr"] == pytest.approx(cfg20.lr * lr_multiplier(20, cfg20))
    assert change["new_lr"] == pytest.approx(cfg30.lr * lr_multiplier(20, cfg30))
    straight = train(tmp_path / "straight", 30, "--log-every", "1")
    lrs = {e["step"]: e["lr"] for e in straight.of("step")}
    assert {e["step"]: e["lr"] for e in resumed.of("step")} == {s: lrs[s] for s in range(21, 31)}, \
        "from the resume step on, the schedule of a 30-step run"


# Item 3: one writer per checkpoint directory.

def test_a_second_run_on_a_locked_directory_exits_2_naming_the_holder(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "reference_impl.train", *FLAGS, "--max-steps", "1000000",
           "--checkpoint-every", "0", "--checkpoint-dir", str(ckpt)]
    holder = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        for line in holder.stdout:  # type: ignore[union-attr]
            if '"event": "step"' in line:
                break
        line = error_line(train(ckpt, 20, timeout=30))
        assert f"pid {holder.pid}" in line and socket.gethostname() in line
    finally:
        holder.kill()
        holder.wait(30)
    assert train(ckpt, 20, timeout=30).returncode == 0, "the lock died with its holder"


# Item 5: preemption.

def test_sigterm_saves_at_the_next_step_and_the_resume_is_bit_exact(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    stopped = train(ckpt, 20, "--fail-mode", "sigterm", "--fail-at-step", "7")
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    assert stopped.of("preempted")[0]["step"] == 7 and stopped.of("run_complete") == []
    assert [p.name for p in published(ckpt)] == ["step-00000007"]
    resumed = train(ckpt, 20)
    assert resumed.of("checkpoint_restored")[0]["step"] == 7
    assert resumed.digest() == train(tmp_path / "straight", 20).digest()


def test_sigterm_past_the_grace_period_exits_without_a_torn_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run = train(ckpt, 20, "--fail-mode", "sigterm", "--fail-at-step", "12", "--preempt-grace-s", "0.001")
    assert run.returncode == 1 and run.of("run_complete") == []
    assert "grace" in run.of("error")[0]["message"]
    assert [p.name for p in published(ckpt)] == ["step-00000010"]


def _loader_worker(ready: Event) -> None:
    loader_worker_init(0)
    ready.set()
    time.sleep(60)


def test_a_loader_worker_ignores_the_groups_sigterm_but_not_its_ranks() -> None:
    fork = multiprocessing.get_context("fork")  # as the DataLoader starts its workers; this process is the rank
    ready = fork.Event()
    worker = fork.Process(target=_loader_worker, args=(ready,), daemon=True)
    worker.start()
    try:
        assert ready.wait(30)
        outsider = f"import os, signal; os.kill({worker.pid}, signal.SIGTERM)"  # as torchrun's killpg
        subprocess.run([sys.executable, "-c", outsider], check=True, timeout=30)
        worker.join(1.0)
        assert worker.is_alive(), "a SIGTERM from outside ended a loader worker"
        worker.terminate()  # from the rank, as Python's exit does to daemonic workers
        worker.join(10)
        assert worker.exitcode == -signal.SIGTERM
    finally:
        worker.kill()
        worker.join(10)


def _rank_with_a_loader_worker(worker_pid) -> None:
    fork = multiprocessing.get_context("fork")
    ready = fork.Event()
    worker = fork.Process(target=_loader_worker, args=(ready,), daemon=True)
    worker.start()
    ready.wait(30)
    worker_pid.value = worker.pid
    time.sleep(60)


def test_a_loader_worker_dies_with_its_rank_at_once() -> None:
    """A loader worker holds a copy of its rank's gloo sockets: while it lives, the peers of
    a rank that died see no connection close. torch's own watchdog would end it only at its
    next poll of the parent pid, every 5 s; this rank has no such watchdog at all."""
    fork = multiprocessing.get_context("fork")
    worker_pid = fork.Value("i", 0)
    rank = fork.Process(target=_rank_with_a_loader_worker, args=(worker_pid,))
    rank.start()
    try:
        deadline = time.monotonic() + 30
        while not worker_pid.value and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker_pid.value, "the loader worker did not start"
        os.kill(rank.pid, signal.SIGKILL)
        rank.join(10)
        deadline = time.monotonic() + 2
        while alive(worker_pid.value) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(worker_pid.value), "a loader worker outlived its SIGKILLed rank"
    finally:
        rank.kill()
        if worker_pid.value and alive(worker_pid.value):
            os.kill(worker_pid.value, signal.SIGKILL)


GRACE_S = 0.3


def _inherits_the_preemption_handler(stop: Preemption, ready: Event) -> None:
    ready.set()
    time.sleep(5 * GRACE_S)  # the grace period passes, several times over
    os._exit(3 if stop.requested else 0)


def test_a_forked_child_that_gets_sigterm_leaves_the_stop_and_the_grace_timer_to_its_rank() -> None:
    """A DataLoader worker forked while the rank's SIGTERM handler is installed inherits it.
    torchrun signals the whole process group, so the worker may get SIGTERM before the
    DataLoader replaces the handler: the inherited handler must do nothing there. A grace
    timer started in the child would end it with status 1 once the grace period passed."""
    fork = multiprocessing.get_context("fork")  # as the DataLoader starts its workers; this process is the rank
    ready = fork.Event()
    with Preemption(GRACE_S, DistContext(), EventLog(0, io.StringIO())) as stop:
        child = fork.Process(target=_inherits_the_preemption_handler, args=(stop, ready), daemon=True)
        child.start()
        try:
            assert ready.wait(30)
            os.kill(child.pid, signal.SIGTERM)  # as torchrun's killpg reaches a loader worker
            child.join(30)
            assert child.exitcode == 0, (
                f"the child exited with {child.exitcode}: 1 is its own grace timer, 3 its own stop request")
        finally:
            child.kill()
            child.join(10)
        assert not stop.requested, "the rank got no signal"


def test_a_sigterm_on_one_rank_stops_every_rank_after_the_same_step_without_a_collective_per_step(
        tmp_path: Path) -> None:
    """Two gloo ranks: a signal that reached only one of them (either) makes `should_stop`
    True on both at the same step, soon after the signal; with no signal both go on. The
    agreement is an all-reduce every few steps, not one per step."""
    run_ranks(preemption_worker.signalled_ranks, (2, free_port(), str(tmp_path)))
    answers = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    worker = preemption_worker
    # One agreement interval of steps, plus the step it is read one boundary later.
    bound = worker.SIGNAL_AT + min(int(worker.GRACE_S / 20 / worker.STEP_S), AGREE_AT_LEAST_EVERY) + 2
    for signalled in ("None", "0", "1"):
        first, second = answers[0][signalled], answers[1][signalled]
        assert first["stopped_at"] == second["stopped_at"], (signalled, first, second)
        assert first["agreements"] == second["agreements"], "every rank takes part in every all-reduce"
        for rank, answer in enumerate((first, second)):
            assert answer["requested"] == answer["logged"] == (signalled == str(rank)), (rank, answer)
            assert answer["agreements"] * 3 <= answer["steps"], f"an all-reduce nearly every step: {answer}"
        if signalled == "None":
            assert first["stopped_at"] is None and first["steps"] == worker.STEPS
        else:
            assert worker.SIGNAL_AT <= first["stopped_at"] <= bound, first


def test_sigterm_to_a_rank_blocked_in_a_collective_ends_it_within_the_grace_period(tmp_path: Path) -> None:
    """The grace period holds while the main thread sits in a gloo collective whose peer
    never joins: Python would run the SIGTERM handler (and start the grace clock) only once
    the collective returned, at the group's timeout (600 s here). The clock starts from a
    thread reading the interpreter's wakeup fd, so the rank exits with status 1 and the
    grace error soon after the grace period. Generous margin: a loaded 2-core machine."""
    context = multiprocessing.get_context("spawn")  # a clean interpreter: no signal state from pytest
    port = free_port()
    ranks = [context.Process(target=preemption_worker.blocked_in_a_collective, args=(rank, port, str(tmp_path)),
                             daemon=True) for rank in (0, 1)]
    for rank in ranks:
        rank.start()
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / "blocked").exists() and time.monotonic() < deadline:
            assert ranks[0].exitcode is None, f"rank 0 exited with {ranks[0].exitcode} before blocking"
            time.sleep(0.1)
        assert (tmp_path / "blocked").exists(), "rank 0 never reached the collective"
        time.sleep(1.0)  # well inside the all-reduce
        signalled = time.monotonic()
        os.kill(ranks[0].pid, signal.SIGTERM)
        bound = preemption_worker.BLOCKED_GRACE_S + 30  # far below the group's 600 s timeout
        ranks[0].join(bound)
        waited = time.monotonic() - signalled
        assert ranks[0].exitcode == 1, f"rank 0 still blocked {waited:.0f}s after SIGTERM (exit {ranks[0].exitcode})"
        assert waited >= preemption_worker.BLOCKED_GRACE_S * 0.9, f"exited after {waited:.2f}s, before the grace"
        events = [json.loads(line) for line in (tmp_path / "rank0.jsonl").read_text().splitlines()]
        assert [e["event"] for e in events] == ["sigterm_received", "error"], events
        assert events[1]["error"] == "PreemptionTimeout" and "grace" in events[1]["message"]
    finally:
        for rank in ranks:
            rank.kill()
            rank.join(10)


def test_a_failure_is_reported_while_sigterm_is_still_the_runs_to_handle(tmp_path: Path) -> None:
    """A launcher stops the survivors of a failed rank with SIGTERM, often as their own
    collective fails with "closed by peer". Reported after the run let go of SIGTERM, such a
    rank's error line was lost to the default action (1 run in 6 of the watchdog test). The
    report must come while the run's handler is still installed."""
    handlers: list[object] = []

    class Log(EventLog):
        def error(self, phase: str, exc: BaseException, **fields: object) -> None:
            handlers.append(signal.getsignal(signal.SIGTERM))
            super().error(phase, exc, **fields)

    def fail(state: object) -> None:
        raise RuntimeError("Connection closed by peer")

    cfg = TrainConfig.from_cli(["--model", "mlp", "--max-steps", "3", "--warmup-steps", "0", "--device", "cpu",
                                *FLAGS[-6:]])
    with pytest.raises(RuntimeError, match="closed by peer"):
        run_train(cfg, DistContext(), Log(0, io.StringIO()), on_step=fail)
    assert len(handlers) == 1 and handlers[0] not in (signal.SIG_DFL, signal.SIG_IGN, None), handlers
    assert signal.getsignal(signal.SIGTERM) is not handlers[0], "the run restores SIGTERM's handler when it ends"

# Item 6: the sample log on a restart before the first checkpoint.

def test_the_sample_log_is_exact_after_a_restart_before_the_first_checkpoint(tmp_path: Path) -> None:
    log = tmp_path / "samples"
    killed = train(tmp_path / "ckpt", 12, "--sample-log", str(log), "--fail-at-step", "5")
    assert killed.returncode == -signal.SIGKILL
    assert train(tmp_path / "ckpt", 12, "--sample-log", str(log)).returncode == 0
    steps = [json.loads(line)["step"] for line in (log / "rank0.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 13)), "steps 1-4 logged once, not twice"


# Item 7: a full disk.

def test_a_full_disk_leaves_no_debris_and_a_smaller_keep_last_frees_room(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    full = ["--fail-mode", "write-error", "--fail-at-step", "30"]
    failed = train(ckpt, 30, *full)
    assert failed.returncode == 1 and "No space left" in failed.of("error")[0]["message"]
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith(".tmp")) == [], "temporary dir removed"
    assert [p.name for p in published(ckpt)] == ["step-00000020", "step-00000010"]
    still_full = train(ckpt, 30, "--keep-last", "1", *full)  # the disk is still full at step 30
    assert still_full.of("checkpoint_restored")[0]["step"] == 20
    assert [p.name for p in published(ckpt)] == ["step-00000020"], "step 10 pruned before the save"
    freed = train(ckpt, 30, "--keep-last", "1")
    assert freed.returncode == 0 and freed.of("checkpoint_restored")[0]["step"] == 20
    assert [p.name for p in published(ckpt)] == ["step-00000030"]


def test_progress_bookkeeping_failures_raise_the_checkpoint_error(tmp_path: Path) -> None:
    (tmp_path / "progress.json").mkdir()  # os.replace onto it fails like a full disk would
    with pytest.raises(CheckpointError, match="recording progress .* failed"):
        manager(tmp_path).record_progress(3, DistContext())


# Item 8: bad input is one line and exit 2, before any work.

@pytest.mark.parametrize("flags,message", [
    (["--seed", str(2**64)], "seed must be in"),
    (["--seed", str((2**64 - 1 - 2) // SEED_STRIDE + 1)], "seed must be in"),  # epoch 2 would overflow
    (["--num-workers", "1000000"], "num_workers"),
    (["--checkpoint-dir", "x" * 256], "longer than 255 bytes"),
    (["--max-steps", str(10**8)], "max_steps must be at most 99999999"),  # step-NNNNNNNN has eight digits
])
def test_out_of_range_values_exit_2_with_one_line(flags: list[str], message: str, tmp_path: Path) -> None:
    run = python_module(["--max-steps", "2", "--warmup-steps", "0", *flags], timeout=30)
    assert message in error_line(run)


def test_a_path_that_is_not_utf_8_is_a_path_like_any_other(tmp_path: Path) -> None:
    """Linux names are bytes; Python hands undecodable ones to the program as surrogates, which
    `str.encode` refuses (this ended in a UnicodeEncodeError traceback). The run trains,
    checkpoints and resumes there, and the length check counts the name's bytes."""
    from reference_impl.config import ConfigError, TrainConfig

    ckpt = os.fsdecode(bytes(tmp_path) + b"/\xffckpt")
    assert train(Path(ckpt), 10).returncode == 0
    resumed = train(Path(ckpt), 20, "--allow-config-change", "max_steps")
    assert resumed.returncode == 0 and resumed.of("checkpoint_restored")[0]["step"] == 10, resumed.stderr
    with pytest.raises(ConfigError, match="longer than 255 bytes"):
        TrainConfig(checkpoint_dir=os.fsdecode(b"\xff" * 256))


def test_a_checkpoint_path_that_is_a_file_exits_2(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    for path in (blocker, blocker / "ckpt"):
        assert "is not a directory" in error_line(train(path, 2, timeout=30))


def test_a_checkpoint_path_that_is_no_directory_is_named_for_what_it_is(tmp_path: Path) -> None:
    (tmp_path / "dangling").symlink_to(tmp_path / "missing")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    os.mkfifo(tmp_path / "fifo")
    for name, what in (("dangling", "a link that leads nowhere"), ("loop", "a link that leads nowhere"),
                       ("fifo", "a FIFO")):
        line = error_line(train(tmp_path / name, 2, timeout=30))
        assert line.endswith(f"is not a directory ({tmp_path / name} is {what})"), line


@pytest.mark.parametrize("flags,env,expected,unexpected", [
    (["--model", "transformer"], {}, "cannot change on resume", "--allow-config-change"),
    (["--hidden-dim", "64"], {}, "cannot change on resume", "--allow-config-change"),
    (["--lr", "0.01"], {}, "--allow-config-change lr", "hidden_dim"),
    ([], {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"},
     "--micro-batch-size 4 --grad-accum-steps 1", "--allow-config-change"),
])
def test_incompatibility_messages_suggest_only_what_works(
        flags: list[str], env: dict[str, str], expected: str, unexpected: str, twenty: tuple[Path, str]) -> None:
    line = error_line(train(twenty[0], 20, "--checkpoint-every", "5", *flags, env=env, timeout=30))
    assert expected in line and unexpected not in line, line


def test_only_local_rank_0_prints_the_error() -> None:
    env = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}
    run = python_module(["--seed", "-1"], timeout=30, env=env)
    assert run.returncode == 2 and run.stderr == ""


def _fifo(path: Path) -> None:
    os.mkfifo(path)


@pytest.mark.parametrize(("plant", "message"), [
    (lambda path: path.write_text("garbage\n"), "holds a line that is not a sample log entry: 'garbage'"),
    (lambda path: path.write_text('{"x": 1}\n'), "holds a line that is not a sample log entry"),
    (lambda path: path.mkdir(), "holds rank0.jsonl, which is not a regular file"),
    (_fifo, "holds rank0.jsonl, which is not a regular file"),
])
def test_a_sample_log_with_foreign_entries_is_one_line_and_exit_2(
        tmp_path: Path, plant: Callable[[Path], None], message: str) -> None:
    """Garbage, a directory or a FIFO where a rank's file belongs used to end in a traceback,
    or, for the FIFO, in a run that waited forever for a writer."""
    log = tmp_path / "samples"
    log.mkdir()
    plant(log / "rank0.jsonl")
    run = train(tmp_path / "ckpt", 2, "--sample-log", str(log))
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reference_impl.train: error: sample_log ") and message in lines[0]

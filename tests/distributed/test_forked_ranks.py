"""`forked_ranks`, the suite's fast launcher, against torchrun: the same training, the same
failure reporting, the same restarts after a kill, the same hard deadline."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from launch import alive, forked_ranks, python_module, torchrun

pytestmark = pytest.mark.distributed

FLAGS = ["--max-steps", "6", "--warmup-steps", "0", "--log-every", "2", "--micro-batch-size", "8",
         "--dataset-size", "256"]


def test_forked_ranks_train_exactly_like_torchrun() -> None:
    under_torchrun, forked = torchrun(FLAGS), forked_ranks(FLAGS)
    assert under_torchrun.returncode == forked.returncode == 0, forked.stderr[-3000:]
    assert forked.digest() == under_torchrun.digest()
    losses = [[(e["step"], e["loss"]) for e in run.of("step")] for run in (under_torchrun, forked)]
    assert losses[0] == losses[1] and len(losses[0]) == 3


def test_a_forked_single_process_prints_and_exits_as_a_fresh_interpreter(tmp_path: Path) -> None:
    """`python_module` forks the trainer's main for the suite's single-process runs: the
    same digest for a run, the same exit status and last line for a bad value and for a
    flag argparse refuses."""
    for args in (FLAGS, ["--micro-batch-size", "0"], ["--no-such-flag"]):
        fresh = python_module([*args, "--checkpoint-dir", str(tmp_path / "fresh")], fresh=True)
        forked = python_module([*args, "--checkpoint-dir", str(tmp_path / "forked")])
        assert forked.returncode == fresh.returncode, forked.stderr[-3000:]
        assert forked.stderr.strip().splitlines()[-1:] == fresh.stderr.strip().splitlines()[-1:]
        if fresh.returncode == 0:
            assert forked.digest() == fresh.digest()
        else:
            assert fresh.returncode == 2 and "Traceback" not in forked.stderr


def test_a_forked_script_runs_as_main_and_can_be_kept_from_the_package(tmp_path: Path) -> None:
    """A script's path runs as `__main__` with the flags as `sys.argv[1:]`, its exit status
    is the job's, and `without_package` drops the forkserver's copy of the package and
    refuses a new import, as a blank notebook would."""
    script = tmp_path / "probe.py"
    script.write_text("import sys\n"
                      "try:\n    import reference_impl.config\nexcept ModuleNotFoundError as exc:\n"
                      "    print('refused:', exc)\n"
                      "print(__name__, sys.argv[1:], 'reference_impl' in sys.modules)\n"
                      "sys.exit(int(sys.argv[1]) if sys.argv[1].isdigit() else sys.argv[1])\n")
    blank = forked_ranks(["3", "x"], nproc=1, module=str(script), torchrun_env=False, without_package=True)
    assert blank.returncode == 3, blank.stderr[-3000:]
    assert "refused:" in blank.stdout and "blank notebook" in blank.stdout
    assert "__main__ ['3', 'x'] False" in blank.stdout
    with_package = forked_ranks(["0"], nproc=1, module=str(script), torchrun_env=False)
    assert with_package.returncode == 0 and "refused" not in with_package.stdout
    assert "__main__ ['0'] True" in with_package.stdout
    message = forked_ranks(["stopped: one line"], nproc=1, module=str(script), torchrun_env=False)
    assert message.returncode == 1 and message.stderr == "stopped: one line\n", "as `sys.exit(text)` does"


def test_a_rank_that_fails_fails_the_job() -> None:
    run = forked_ranks(["exit", "1", "3"], module="rank_probe", timeout=60)
    assert run.returncode == 3
    assert "rank 1 fails on purpose" in run.stdout


def test_a_failed_rank_stops_the_others_with_sigterm_and_the_job_restarts(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    run = forked_ranks(["crash-once", "1", "7", str(tmp_path / "a")], module="rank_probe", timeout=60,
                       max_restarts=1)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"rank 0 got signal {signal.SIGTERM.value}" in run.stdout, "the agent stops the survivors"
    assert "rank 0 runs attempt 1" in run.stdout and "rank 1 runs attempt 1" in run.stdout
    out_of_restarts = forked_ranks(["crash-once", "1", "7", str(tmp_path / "b")], module="rank_probe", timeout=60)
    assert out_of_restarts.returncode == 7 and "attempt 1" not in out_of_restarts.stdout


def test_a_killed_rank_resumes_exactly_as_under_torchrun(tmp_path: Path) -> None:
    """The restart path the suite's kill tests take, against torchrun's agent with the same faults."""
    flags = [*FLAGS, "--max-steps", "12", "--checkpoint-every", "5", "--fail-at-step", "8", "--fail-rank", "1"]
    runs = [launch([*flags, "--checkpoint-dir", str(tmp_path / name)], max_restarts=1, timeout=120)
            for name, launch in (("torchrun", torchrun), ("forked", forked_ranks))]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    restored = [[(e["step"], e["restart_count"]) for e in run.of("checkpoint_restored")] for run in runs]
    assert restored[0] == restored[1] == [(5, 1)]
    assert runs[0].digest() == runs[1].digest()


def test_a_hung_rank_is_killed_at_the_deadline(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    with pytest.raises(pytest.fail.Exception, match="timed out after 3s"):
        forked_ranks(["hang", "0", str(pidfile)], module="rank_probe", timeout=3)
    assert not alive(int(pidfile.read_text()))

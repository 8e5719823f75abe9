"""Restart safety under real faults: every killed run resumes to the uninterrupted state.

Each test runs real gloo jobs. The proof of exactness is the `state_digest` of
`run_complete`: a sha256 over every parameter and optimizer tensor. One kill test (a kill
of rank 0) runs under `torchrun` itself, which restarts the ranks; the other cases, three
kills in one run among them, restart forked ranks exactly as torchrun's agent does
(`launch.forked_ranks`, held equal to torchrun by tests/distributed/test_forked_ranks.py),
so each case pays for its training and not for six interpreters importing torch.
"""

from __future__ import annotations

import json

import pytest

from launch import Run, forked_ranks, torchrun

pytestmark = pytest.mark.distributed

BASE = ["--max-steps", "30", "--checkpoint-every", "10", "--warmup-steps", "5", "--log-every", "10",
        "--dataset-size", "512", "--micro-batch-size", "8", "--pg-timeout-s", "60"]
_REFERENCES: dict[tuple[str, ...], str] = {}


def reference_digest(flags: list[str], tmp_path_factory: pytest.TempPathFactory) -> str:
    """Digest of the uninterrupted run with these flags (computed once per flag set)."""
    key = tuple(flags)
    if key not in _REFERENCES:
        ckpt = tmp_path_factory.mktemp("reference")
        _REFERENCES[key] = forked_ranks([*BASE, *flags, "--checkpoint-dir", str(ckpt)]).digest()
    return _REFERENCES[key]


# The case whose kill torchrun's own agent restarts; the others restart forked ranks.
UNDER_TORCHRUN = ("rank0_killed",)


def killed_run(flags: list[str], fault: list[str], ckpt: str, restarts: int = 1, under_torchrun: bool = False) -> Run:
    launch = torchrun if under_torchrun else forked_ranks
    run = launch([*BASE, *flags, *fault, "--checkpoint-dir", ckpt], max_restarts=restarts, timeout=180)
    assert run.returncode == 0, run.stderr[-4000:]
    return run


CASES = {
    "mlp": ([], ["--fail-at-step", "15", "--fail-rank", "1"]),
    "num_workers_2": (["--num-workers", "2"], ["--fail-at-step", "15", "--fail-rank", "1"]),
    "grad_accum": (["--grad-accum-steps", "2"], ["--fail-at-step", "15", "--fail-rank", "1"]),
    "transformer_dropout": (["--model", "transformer", "--dropout", "0.1"], ["--fail-at-step", "15", "--fail-rank", "1"]),
    "bf16_autocast": (["--model", "transformer", "--precision", "bf16"], ["--fail-at-step", "15", "--fail-rank", "1"]),
    # 256 samples / 16 per step = 16 steps per epoch: restore at 10, replay across step 16.
    "epoch_boundary": (["--dataset-size", "256"], ["--fail-at-step", "19", "--fail-rank", "1"]),
    "rank0_killed": ([], ["--fail-at-step", "15", "--fail-rank", "0"]),
}


# The quick loop (-m "not slow") keeps one restart case, on forked ranks (a restart under
# torchrun, with its agent's and four interpreters' start-up, takes 15-30 s there); the
# suite runs them all.
@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c == "mlp" else pytest.mark.slow)
                                  for c in CASES])
def test_sigkill_and_restart_is_bit_exact(case: str, tmp_path, tmp_path_factory) -> None:
    flags, fault = CASES[case]
    run = killed_run(flags, fault, str(tmp_path), under_torchrun=case in UNDER_TORCHRUN)
    restored = run.of("checkpoint_restored")
    assert [e["step"] for e in restored] == [10], "resumed from the last checkpoint before the kill"
    assert restored[0]["restart_count"] == 1
    assert restored[0]["steps_replayed"] == int(fault[1]) - 1 - 10
    assert run.digest() == reference_digest(flags, tmp_path_factory)


@pytest.mark.slow
def test_three_kills_in_one_run_are_bit_exact(tmp_path, tmp_path_factory) -> None:
    run = killed_run([], ["--fail-at-step", "12,17,26", "--fail-rank", "1"], str(tmp_path), restarts=3)
    assert [e["step"] for e in run.of("checkpoint_restored")] == [10, 10, 20]
    assert [e["restart_count"] for e in run.of("run_start")] == [0, 1, 2, 3]
    assert run.digest() == reference_digest([], tmp_path_factory)


def test_sample_log_shows_every_sample_trained_exactly_once_across_a_restart(tmp_path) -> None:
    log = tmp_path / "samples"
    flags = ["--dataset-size", "256", "--sample-log", str(log)]
    killed_run(flags, ["--fail-at-step", "19", "--fail-rank", "1"], str(tmp_path / "ckpt"))
    per_step: dict[int, list[int]] = {}
    for rank in (0, 1):
        for line in (log / f"rank{rank}.jsonl").read_text().splitlines():
            entry = json.loads(line)
            per_step.setdefault(entry["step"], []).extend(entry["indices"])
    assert sorted(per_step) == list(range(1, 31)), "each committed step logged once, replays included once"
    epoch0 = [i for step in range(1, 17) for i in per_step[step]]
    assert sorted(epoch0) == list(range(256)), "epoch 0 trained every sample exactly once"


# A first loss scale of 2**24 overflows in the first steps, so the scaler's state (the
# backed-off scale) differs from a fresh scaler's by the time of the checkpoint.
NECESSARY = ["--model", "transformer", "--dropout", "0.1", "--precision", "fp16",
             "--fp16-init-scale", "16777216"]


@pytest.mark.slow
@pytest.mark.parametrize("part", [None, "rng", "data", "scheduler", "scaler"])
def test_each_part_of_the_checkpoint_is_necessary(part: str | None, tmp_path, tmp_path_factory) -> None:
    """Restoring without any one of these parts makes the resumed run diverge."""
    skip = ["--resume-skip", part] if part else []
    run = killed_run(NECESSARY, ["--fail-at-step", "15", "--fail-rank", "1", *skip], str(tmp_path))
    assert run.of("checkpoint_restored")[0]["skipped_parts"] == ([part] if part else [])
    same = run.digest() == reference_digest(NECESSARY, tmp_path_factory)
    assert same is (part is None)


@pytest.mark.parametrize("mode,rank", [("crash-before-publish", 0),
                                       pytest.param("crash-mid-write", 1, marks=pytest.mark.slow)])
def test_a_crash_during_a_save_never_leaves_a_checkpoint_restore_picks(
        mode: str, rank: int, tmp_path, tmp_path_factory) -> None:
    run = killed_run([], ["--fail-mode", mode, "--fail-at-step", "20", "--fail-rank", str(rank)], str(tmp_path))
    assert [e["step"] for e in run.of("checkpoint_restored")] == [10], "the torn step-20 save was ignored"
    assert run.of("checkpoint_skipped") == [], "it was never published, so never even a candidate"
    assert run.digest() == reference_digest([], tmp_path_factory)


@pytest.mark.slow
def test_a_rank_blocked_in_a_collective_fails_the_job_within_the_timeout(tmp_path) -> None:
    # The hung rank gets SIGTERM once rank 0 fails (from forked_ranks as from torchrun's agent),
    # and would spend the default 25 s preemption grace trying to reach a step boundary: 2 s
    # is enough to show it.
    run = forked_ranks([*BASE, "--fail-mode", "hang", "--fail-at-step", "5", "--fail-rank", "1",
                        "--pg-timeout-s", "5", "--preempt-grace-s", "2", "--checkpoint-dir", str(tmp_path)],
                       timeout=90)
    assert run.returncode != 0
    errors = sorted(run.of("error"), key=lambda e: e["time"])  # forked ranks' output comes rank by rank
    assert errors and errors[0]["rank"] == 0 and errors[0]["phase"] == "backward"
    assert "Timed out" in errors[0]["message"] and errors[0]["step"] == 4


@pytest.mark.slow
@pytest.mark.parametrize("rank0_watchdog", ["3", "60"])
def test_the_watchdog_reports_a_stalled_step_on_every_rank(rank0_watchdog: str, tmp_path) -> None:
    """Rank 1 hangs before step 5 and rank 0 waits for it in the gradient all-reduce; each
    rank's 3 s watchdog reports the stall. Their clocks start together, but a loaded machine
    can delay rank 0's: then rank 1's watchdog ends rank 1 first, its sockets close, and rank
    0's all-reduce fails at once with gloo's "closed by peer", which is rank 0's report of the
    same stall (at load 3-9 the old assertion, StepTimeout on both ranks, failed this way).
    The "60" case makes that order certain: rank 0's watchdog waits 60 s. The ranks are forked
    (torchrun's agent stops them the same way: SIGTERM to the survivors of a failed rank)."""
    run = forked_ranks([*BASE, "--fail-mode", "hang", "--fail-at-step", "5", "--fail-rank", "1",
                        "--step-timeout-s", "3", "--checkpoint-dir", str(tmp_path)], timeout=120,
                       module="tests/per_rank_flags.py", env={"RANK0_FLAGS": f"--step-timeout-s {rank0_watchdog}"})
    assert run.returncode != 0
    first: dict[int, dict] = {}
    for error in run.of("error"):
        first.setdefault(error["rank"], error)
    hung, waiting = first[1], first[0]
    assert hung["error"] == "StepTimeout", hung
    assert waiting["phase"] == "backward", "rank 0 waits in the gradient all-reduce"
    if waiting["error"] != "StepTimeout":  # rank 1's watchdog came first and ended it
        assert waiting["time"] >= hung["time"] and "closed by peer" in waiting["message"], (hung, waiting)
    if rank0_watchdog == "60":
        assert waiting["error"] == "RuntimeError", "rank 1 reported first, and rank 0 learned of it from gloo"
    assert "Thread" in run.stderr, "faulthandler printed the stacks"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("half", [0, 1])  # two halves of five; one worker runs the file, so one reference serves both
def test_soak_ten_consecutive_kill_and_restart_runs_recover_bit_exactly(half: int, tmp_path,
                                                                        tmp_path_factory) -> None:
    expected = reference_digest(["--num-workers", "2"], tmp_path_factory)
    for attempt in range(5 * half, 5 * half + 5):
        rank, step = attempt % 2, 11 + attempt * 2  # vary the victim and the point of death
        run = killed_run(["--num-workers", "2"], ["--fail-at-step", str(step), "--fail-rank", str(rank)],
                         str(tmp_path / f"run{attempt}"))
        assert run.digest() == expected, f"soak run {attempt} (rank {rank} killed at {step}) diverged"

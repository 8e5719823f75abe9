"""Survivors keep training: `python -m reference_impl.ft` on real processes and gloo.

One job per layout (two replicas of one rank, two replicas of two ranks), SIGKILLed at
step 5 on a rank of replica 1. The claims: the other replica's processes are never
restarted and go on committing steps while replica 1 is down; replica 1 comes back, copies
a live peer's state and contributes again; at the end both replicas hold bit-identical
parameters and optimizer state; every sample the dead replica did not train is named in an
event. The step floor gives the toy job enough steps to outlast a restart at load 8.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from launch import REPO, Run, run_command
from reference_impl.data import ResumableDistributedSampler
from reference_impl.ft.__main__ import main as ft_main

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(420)]

STEPS = 300
FLAGS = ["--model", "mlp", "--max-steps", str(STEPS), "--micro-batch-size", "8", "--dataset-size", "1024",
         "--warmup-steps", "0", "--pg-timeout-s", "60", "--step-floor-s", "0.1", "--fail-at-step", "5"]
CONTRACT_KEYS = {"event", "step", "survivor_restarts", "recoveries"}


def ft_job(replicas: int, nproc: int, fail_rank: int) -> Run:
    cmd = [sys.executable, "-m", "reference_impl.ft", "--replicas", str(replicas), "--nproc-per-replica",
           str(nproc), *FLAGS, "--fail-rank", str(fail_rank)]
    return run_command(cmd, timeout=400)


@pytest.fixture(scope="module", params=[(2, 1, 1), (2, 2, 3)], ids=["1_rank_per_replica", "2_ranks_per_replica"])
def killed(request: pytest.FixtureRequest) -> tuple[Run, int]:
    """The job with global rank `fail_rank` SIGKILLed at step 5; (run, ranks per replica)."""
    replicas, nproc, fail_rank = request.param
    return ft_job(replicas, nproc, fail_rank), nproc


def test_last_line_is_ft_complete_with_the_contract_keys(killed: tuple[Run, int]) -> None:
    run, _ = killed
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    last = run.events[-1]
    assert last["event"] == "ft_complete" and CONTRACT_KEYS <= last.keys(), last
    assert (last["step"], last["survivor_restarts"], last["recoveries"]) == (STEPS, 0, 1), last
    assert run.stdout.rstrip().splitlines()[-1].startswith('{"event": "ft_complete"')


def test_only_the_failed_replica_restarts(killed: tuple[Run, int]) -> None:
    """Replica 0's processes start once, by pid; replica 1's start twice."""
    run, nproc = killed
    starts = {r: [(e["attempt"], e["pid"]) for e in run.of("replica_start") if e["replica"] == r] for r in (0, 1)}
    assert [attempt for attempt, _ in starts[0]] == [0], starts
    assert [attempt for attempt, _ in starts[1]] == [0, 1], starts
    assert [e["replica"] for e in run.of("replica_restarted")] == [1]


def test_survivors_keep_stepping_while_the_failed_replica_is_down(killed: tuple[Run, int]) -> None:
    """Between the kill and replica 1's first contribution, replica 0 commits new steps alone."""
    run, _ = killed
    kill = run.of("fault_injected")[0]["time"]
    back = next(e["time"] for e in run.of("ft_step") if e["time"] > kill and 1 in e["participants"])
    alone = [e["step"] for e in run.of("ft_step") if e["replica"] == 0 and kill < e["time"] < back]
    assert len(alone) >= 3 and alone == sorted(set(alone)), alone
    assert run.events[-1]["outage_steps"] == len(alone)


def test_the_rejoined_replica_holds_the_survivors_exact_state(killed: tuple[Run, int]) -> None:
    """The sha256 over every parameter and optimizer tensor is the same in both replicas."""
    run, _ = killed
    digests = [e["state_digest"] for e in run.of("replica_complete")]
    assert len(digests) == 2 and len(set(digests)) == 1, digests
    assert run.events[-1]["state_digests_equal"] is True
    recovered = run.of("recovered")
    assert [e["replica"] for e in recovered] == [1] and recovered[0]["step"] > 5


def test_every_sample_the_dead_replica_missed_is_reported(killed: tuple[Run, int]) -> None:
    """Each step committed without replica 1 names exactly replica 1's share of that step."""
    run, nproc = killed
    reported = {e["step"]: e["indices"] for e in run.of("samples_not_trained")}
    assert len(reported) == len(run.of("samples_not_trained")), "a step reported twice"
    without = sorted({e["step"] for e in run.of("ft_step") if e["replica"] == 0 and 1 not in e["participants"]})
    assert without and sorted(reported) == without
    world, batch = 2 * nproc, 8 * 2 * nproc
    for step in without:
        expected = []
        for slot in range(nproc, 2 * nproc):  # replica 1's ranks
            sampler = ResumableDistributedSampler(1024, world_size=world, rank=slot, global_batch_size=batch)
            sampler.set_epoch((step - 1) // sampler.steps_per_epoch)
            sampler.consumed = (step - 1) % sampler.steps_per_epoch * batch
            expected += list(sampler)[:8]
        assert reported[step] == expected, step
    assert run.events[-1]["samples_not_trained"] == 8 * nproc * len(without)


# Imported by every Python process that has it on its path: holds back the restarted replica.
LATE_RESTART = """import os, time
if os.environ.get("FT_REPLICA") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "1":
    time.sleep(8)
"""


@pytest.mark.timeout(300)
def test_a_replica_back_after_the_others_finished_does_not_train_alone(tmp_path: Path) -> None:
    """The restarted replica starts 8 s late, when the survivor has finished: it finds no peer to
    copy from, says so and stops, and the job fails instead of ending on a model trained alone."""
    (tmp_path / "sitecustomize.py").write_text(LATE_RESTART)
    cmd = [sys.executable, "-m", "reference_impl.ft", "--replicas", "2", "--model", "mlp", "--max-steps", "20",
           "--micro-batch-size", "8", "--dataset-size", "1024", "--warmup-steps", "0", "--pg-timeout-s", "60",
           "--fail-at-step", "5", "--fail-rank", "1"]
    run = run_command(cmd, timeout=280, env={"PYTHONPATH": str(tmp_path)})
    assert run.returncode == 1
    restarted = next(e["time"] for e in run.of("replica_start") if e["replica"] == 1 and e["attempt"] == 1)
    assert restarted > next(e["time"] for e in run.of("replica_complete") if e["replica"] == 0)
    errors = [e for e in run.of("error") if e.get("replica") == 1]
    assert [e["message"] for e in errors] == ["restarted replica found no live peer to recover from"], errors
    assert not [e for e in run.of("ft_step") if e["replica"] == 1 and e["time"] > restarted]
    last = run.events[-1]
    assert (last["event"], last["recoveries"], last["state_digests_equal"]) == ("ft_complete", 0, False)


@pytest.mark.parametrize("flags", [
    ["--replicas", "1"],
    ["--replicas", "two"],
    ["--replicas", "2", "--strategy", "fsdp"],
    ["--replicas", "2", "--fail-at-step", "3", "--fail-rank", "2"],
    ["--replicas", "2", "--checkpoint-dir", "/tmp/never-written"],
    ["--replicas", "2", "--step-floor-s", "-1"],
    ["--replicas", "2", "--max-steps", "0"],
], ids=["one_replica", "not_a_number", "fsdp", "fail_rank_outside_job", "checkpoint_dir", "negative_floor",
        "zero_steps"])
def test_a_bad_flag_is_one_line_and_status_2(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert ft_main(flags) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and err.startswith("reference_impl.ft: error: "), err


@pytest.mark.timeout(120)
def test_a_bad_flag_exits_2_from_the_command_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "reference_impl.ft", "--replicas", "2", "--no-such-flag"],
                          cwd=REPO, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.strip().splitlines() == ["reference_impl.ft: error: unrecognized arguments: --no-such-flag"]

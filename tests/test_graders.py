"""Each drill's grader passes the drill's model solution and fails the wrong answers its rubric names.

The graders run real checks: forked ranks on a real gloo group, a DDP comm hook that counts
all-reduces, DataLoader workers that prefetch, a SIGKILL after a checkpoint and a restart. These
tests hold them to the answers in `tests/drill_answers.py`: the model solution passes every
check, and each wrong answer fails exactly the checks that catch its mistake.
"""

from __future__ import annotations

import ast
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import drill_answers as answers
import pytest
import torch

from reference_impl import calc
from reference_impl.interview import graders
from reference_impl import interview_core as core
from reference_impl import notebook as nb

GRADERS = Path(graders.__file__)


def failing(results: graders.Results) -> set[str]:
    return {name for name, (ok, _) in results.items() if not ok}


def assert_fails_exactly(results: graders.Results, printed: str, expected: dict[str, str]) -> None:
    """The checks that fail are the expected ones, each printed with a reason that contains its text."""
    assert failing(results) == set(expected), printed
    for check, reason in expected.items():
        assert reason in results[check][1] and f"FAIL  {check}: " in printed, printed


def test_the_grader_cells_import_only_the_standard_library_and_torch() -> None:
    tree = ast.parse(GRADERS.read_text(encoding="utf-8"))
    roots = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names}
    roots |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert roots - sys.stdlib_module_names == {"torch"}


EXACTLY_ONCE = "exactly once over a SIGKILL and restore, with worker prefetch"
DRILL_3: dict[str, tuple[type, dict[str, str]]] = {  # answer: the checks it fails, each with part of its reason
    "model solution": (answers.SAMPLER, {}),
    "set_epoch resets a restored position": (
        answers.SetEpochResetsSampler, {EXACTLY_ONCE: "36 samples trained twice, 0 never"}),  # steps 1-3 again
    "progress counted in __iter__": (
        answers.CountsInIterSampler, {"commit() moves the saved position": "commit() changes no state",
                                      EXACTLY_ONCE: "0 samples trained twice, 48 never"}),  # prefetched, skipped
    "state_dict() hands out the live state": (
        answers.LiveStateSampler, {"state_dict returns a copy": "state_dict() is a live view"}),
    "offset carried into the next epoch": (
        answers.CarriesOffsetSampler, {"a new epoch starts at its beginning": "yields 30 indices on rank 0, want 48"}),
}


@pytest.mark.parametrize("answer", list(DRILL_3))
def test_drill_3_grader(answer: str, capsys: pytest.CaptureFixture[str]) -> None:
    sampler, expected = DRILL_3[answer]
    results = graders.grade_drill_3(sampler)
    assert_fails_exactly(results, capsys.readouterr().out, expected)


DRILL_4: dict[str, tuple[Callable[..., Any], dict[str, str]]] = {
    "model solution": (answers.make_step(), {}),
    "every micro-batch all-reduces (no no_sync)": (
        answers.make_step(no_sync=False), {"one all-reduce per step (DDP comm hook)": "4 all-reduces for a step of 4"}),
    "each loss not divided by G": (
        answers.make_step(divide=False), {"4 micro-batches of m give the gradient of one batch of 4m": "4.00x",
                                          "returns the mean loss as a tensor": "is not the batch mean"}),
    "the loss returned as a float": (
        answers.make_step(as_tensor=False), {"returns the mean loss as a tensor": "returns a float"}),
    "the last micro-batch's loss returned as the mean": (
        answers.make_step(last_loss=True), {"returns the mean loss as a tensor": "is not the batch mean"}),
}


@pytest.mark.parametrize("answer", list(DRILL_4))
def test_drill_4_grader(answer: str, capsys: pytest.CaptureFixture[str]) -> None:
    step, expected = DRILL_4[answer]
    results = graders.grade_drill_4(step)
    printed = capsys.readouterr().out
    assert failing(results) == set(expected), printed
    for check, reason in expected.items():
        assert reason in results[check][1], printed


DRILL_5: dict[str, tuple[type, set[str]]] = {
    "model solution": (answers.TIMER, set()),
    "flush() keeps the window": (answers.NoResetTimer, {"flush() starts a new window"}),
    "each phase charged the time since the last mark": (
        answers.LapTimer, {"a matrix multiply in phase('forward') counts under forward alone"}),
}


@pytest.mark.parametrize("answer", list(DRILL_5))
def test_drill_5_grader(answer: str, capsys: pytest.CaptureFixture[str]) -> None:
    timer, expected = DRILL_5[answer]
    assert failing(graders.grade_drill_5(timer)) == expected, capsys.readouterr().out


def test_drill_7_grader_passes_the_interview_core(capsys: pytest.CaptureFixture[str]) -> None:
    assert failing(graders.grade_drill_7(answers.MAIN)) == set(), capsys.readouterr().out


def test_drill_7_grader_fails_a_kill_before_the_first_checkpoint(capsys: pytest.CaptureFixture[str]) -> None:
    """Without a checkpoint before the kill the restart trains from step 0 and the digests agree
    anyway: the grader fails the kill itself and the restore, not the digest."""
    results = graders.grade_drill_7(answers.main_checkpointing_only_at_the_end)
    assert failing(results) == {"a rank is SIGKILLed at step 15, after a checkpoint",
                                "the restart restores that checkpoint"}, capsys.readouterr().out
    assert results["the resumed run ends with the uninterrupted digest"][0], "the digest alone is fooled"


def test_drill_7_grader_fails_set_epoch_resetting_a_restored_position(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The notebook's loop calls `set_epoch` once per pass over the loader, so a reset is harmless
    in an uninterrupted run and replays the epoch's first steps after a restore."""
    monkeypatch.setattr(nb, "ResumableSampler", answers.SetEpochResetsSampler)  # forked ranks inherit it
    results = graders.grade_drill_7(nb.run)
    assert failing(results) == {"the resumed run ends with the uninterrupted digest"}, capsys.readouterr().out


def test_drill_7_grader_fails_a_restore_that_leaves_out_the_sampler(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    real = core.restore
    monkeypatch.setattr(core, "restore", lambda root, parts, rank: real(
        root, {name: part for name, part in parts.items() if name != "sampler"}, rank))
    results = graders.grade_drill_7(answers.MAIN)
    assert failing(results) == {"the resumed run ends with the uninterrupted digest"}, capsys.readouterr().out


ALL_FIELDS = "changing any field that a step depends on changes the digest"
DERIVED = "accumulation is derived from global batch, micro-batch and world size"
RAISES = "an indivisible global batch raises a ValueError naming both fields"
DRILL_1: dict[str, tuple[type, dict[str, str]]] = {
    "model solution": (answers.CONFIG, {}),
    "hash() of the fields": (answers.SaltedHashConfig, {
        "the digest does not depend on Python's salted hash()": "changes with hash()'s salt"}),
    "a digest of the model's shape alone": (answers.ModelFieldsDigestConfig, {ALL_FIELDS: "changing max_steps, "}),
    "accumulation a free field": (
        answers.FreeAccumulationConfig, {DERIVED: "grad_accum is a field", RAISES: "raises no ValueError"}),
    "no validation": (answers.UnvalidatedConfig, {RAISES: "raises no ValueError"}),
}


@pytest.mark.parametrize("answer", list(DRILL_1))
def test_drill_1_grader(answer: str, capsys: pytest.CaptureFixture[str]) -> None:
    config, expected = DRILL_1[answer]
    results = graders.grade_drill_1(config, operational=answers.OPERATIONAL)
    assert_fails_exactly(results, capsys.readouterr().out, expected)


GPU_NODE = "on a GPU node (CUDA faked): LOCAL_RANK picks the GPU, NCCL the backend"
DRILL_2: dict[str, tuple[Callable[[], Any], dict[str, str]]] = {
    "model solution": (answers.setup, {}),
    "backend='nccl' hard-coded": (
        answers.make_setup(backend="nccl"),
        {"2 CPU ranks: ranks 0 and 1 of one gloo group that all-reduces": "NCCL"}),
    "RANK as the GPU index": (answers.make_setup(gpu_from="RANK"), {GPU_NODE: "picks cuda:9, want cuda:1"}),
    "no timeout": (answers.make_setup(timeout=False), {"the group has a timeout": "has no timeout"}),
}


@pytest.mark.parametrize("answer", list(DRILL_2))
def test_drill_2_grader(answer: str, capsys: pytest.CaptureFixture[str]) -> None:
    setup, expected = DRILL_2[answer]
    results = graders.grade_drill_2(setup)
    assert_fails_exactly(results, capsys.readouterr().out, expected)


def _drill_10_answers() -> list[float]:
    """The drill's four numbers from the handbook's calculators, in GB and minutes."""
    shape = {"seq_len": 2048, "micro_batch": 1, "hidden": 4096, "n_heads": 32, "n_layers": 32}
    state = {s: calc.memory(params=7e9, world_size=8, strategy=s, **shape)["model_state_bytes"]
             for s in ("ddp", "fsdp")}
    ring = calc.ring_allreduce(size_bytes=4e9, world_size=8, bandwidth_bytes_per_s=1e9)["bytes_per_rank"]
    young = calc.checkpoint_interval(checkpoint_cost_s=30, mtbf_s=3.09 * 3600)["young_interval_s"]
    return [state["ddp"] / 1e9, state["fsdp"] / 1e9, ring / 1e9, young / 60]


def test_drill_10_grader_accepts_the_calculators_numbers_within_2_percent(capsys: pytest.CaptureFixture[str]) -> None:
    exact = _drill_10_answers()
    assert exact == pytest.approx([112, 14, 7, 13.6], rel=2e-3)  # the numbers the page gives
    for scale in (1.0, 0.985, 1.015):
        assert failing(graders.grade_drill_10(*(scale * x for x in exact))) == set(), capsys.readouterr().out
    for i, name in enumerate(graders.grade_drill_10(*exact)):
        off = [x * (1.03 if j == i else 1) for j, x in enumerate(exact)]  # one arithmetic slip of 3 %
        assert failing(graders.grade_drill_10(*off)) == {name}, capsys.readouterr().out


DRILL_10: dict[str, tuple[list[float], dict[str, str]]] = {  # the rubric's weak answers
    "4 bytes per parameter (weights only)": ([28, 3.5, 7, 13.6], {
        "7B model state, replicated (GB per GPU)": "4 bytes per parameter counts the weights alone",
        "sharded over 8 GPUs (GB per GPU)": "4 bytes per parameter counts the weights alone"}),
    "an all-reduce that sends S": ([112, 14, 4, 13.6], {
        "ring all-reduce of 4 GB over 8 GPUs (GB sent per GPU)": "each send (N - 1) / N x S"}),
    "Young's interval without the 2": ([112, 14, 7, 9.6], {
        "Young's interval, 30 s save, 3.09 h MTBF (minutes)": "sqrt(C M) leaves out the 2"}),
}


@pytest.mark.parametrize("answer", list(DRILL_10))
def test_drill_10_grader(answer: str, capsys: pytest.CaptureFixture[str]) -> None:
    numbers, expected = DRILL_10[answer]
    results = graders.grade_drill_10(*numbers)
    assert_fails_exactly(results, capsys.readouterr().out, expected)


RESTORES = "restore brings back the newest step, every part and each rank's RNG"
TORN = "a truncated file in the newest checkpoint: restore falls back to the previous one"
CHANGED = "a byte changed in the newest checkpoint: restore falls back (it verifies hashes)"
CRASHED = "a save killed midway leaves the previous checkpoint, which restore returns"
DRILL_6: dict[str, tuple[Callable[..., None], Callable[..., int], dict[str, str]]] = {
    "model solution": (answers.save, answers.restore, {}),
    "rank 0's RNG restored on every rank": (
        answers.save, answers.restore_rank0_rng, {RESTORES: "rank 1: torch, Python random"}),
    "no hash check": (answers.save, answers.restore_unverified, {
        TORN: "failed finding central directory", CHANGED: "restore returns step 20, want 10"}),
    "weights_only=False": (
        answers.save, answers.restore_unsafe, {"torch.load runs with weights_only=True": "weights_only=False"}),
    "the interview core, which keeps no Python random state": (
        answers.core_save, answers.core_restore, {RESTORES: "rank 1: Python random"}),
    "torch.save straight to the final path": (answers.save_in_place, answers.restore_newest, {
        TORN: "failed finding central directory", CHANGED: "restore returns step 20, want 10",
        CRASHED: "failed finding central directory"}),
}


@pytest.mark.parametrize("answer", list(DRILL_6))
def test_drill_6_grader(answer: str, capsys: pytest.CaptureFixture[str]) -> None:
    save, restore, expected = DRILL_6[answer]
    results = graders.grade_drill_6(save, restore)
    assert_fails_exactly(results, capsys.readouterr().out, expected)


RUNS = "a function defined in the notebook runs on 2 ranks, which end with the same weights"
ONE_THREAD = "each rank runs torch on one thread"
DRILL_8: dict[str, tuple[Callable[..., None], dict[str, str]]] = {
    "model solution": (answers.launch, {}),
    "spawn, which cannot start a notebook's function": (
        answers.make_launch(start_method="spawn"), {RUNS: "Can't pickle local object", ONE_THREAD: "pickle"}),
    "no torch.set_num_threads(1) in the ranks": (
        answers.make_launch(one_thread=False), {ONE_THREAD: "run torch on [2, 2] threads"}),
    "a failed rank ignored": (
        answers.make_launch(check=False), {"launch raises when a rank fails": "a failed rank goes unnoticed"}),
}


@pytest.mark.parametrize("answer", list(DRILL_8))
def test_drill_8_grader(answer: str, capsys: pytest.CaptureFixture[str]) -> None:
    launch, expected = DRILL_8[answer]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # a kernel with more than one thread, which forked ranks inherit
    try:
        results = graders.grade_drill_8(launch)
    finally:
        torch.set_num_threads(threads)
    assert_fails_exactly(results, capsys.readouterr().out, expected)


@pytest.mark.parametrize("peer_lost_on", [0, 1])
def test_a_failed_run_is_reported_by_its_cause_not_by_the_rank_that_lost_a_peer(peer_lost_on: int) -> None:
    """Rank 1 dies on a torn file; rank 0, still connecting, reports only that its peer left.
    Which of the two the grader sees first is a race; the reason names the torn file either way."""
    cause = graders.RankRun(1, "", "Traceback ...\nRuntimeError: failed finding central directory\n", None)
    consequence = graders.RankRun(1, "", "RuntimeError: Gloo connectFullMesh failed ... Connection closed by peer\n",
                                  None)
    runs = [consequence, cause] if peer_lost_on == 0 else [cause, consequence]
    with pytest.raises(AssertionError, match=r"restoring: rank \d exited with status 1: .*central directory$"):
        graders._exited_cleanly(runs, "restoring")
    with pytest.raises(AssertionError, match="rank 0 exited with status 1: .*Connection closed by peer"):
        graders._exited_cleanly([consequence, graders.RankRun(0, "", "", None)], "restoring")


def test_a_rank_the_grader_stopped_is_blamed_after_one_that_failed_on_its_own() -> None:
    """A rank still waiting on a collective when the grader stops it says nothing of the cause;
    the rank whose own error ended the run does."""
    stopped = graders.RankRun(None, "", "", None)
    cause = graders.RankRun(1, "", "Traceback ...\nRuntimeError: failed finding central directory\n", None)
    with pytest.raises(AssertionError, match=r"rank 1 exited with status 1: .*central directory$"):
        graders._exited_cleanly([stopped, cause], "restoring")
    with pytest.raises(AssertionError, match="rank 0 did not end: stopped at the deadline"):
        graders._exited_cleanly([stopped, graders.RankRun(0, "", "", None)], "restoring")


def _hang_on_rank_1_or_kill_self() -> None:
    rank = int(os.environ["RANK"])
    if rank == 1:
        time.sleep(60)
    elif rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)


def test_run_ranks_tells_a_rank_it_stopped_from_one_killed_by_a_signal() -> None:
    """Both end by SIGKILL; only the one that was still running at the deadline reads as stopped."""
    started = time.monotonic()
    runs = graders.run_ranks(_hang_on_rank_1_or_kill_self, 3, timeout=2.0)
    assert [r.exitcode for r in runs] == [0, None, -signal.SIGKILL]
    assert time.monotonic() - started < 30

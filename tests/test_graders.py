"""Each drill's grader passes the drill's model solution and fails the wrong answers its rubric names.

The graders run real checks: forked ranks on a real gloo group, a DDP comm hook that counts
all-reduces, DataLoader workers that prefetch, a SIGKILL after a checkpoint and a restart. These
tests hold them to the answers in `tests/drill_answers.py`: the model solution passes every
check, and each wrong answer fails exactly the checks that catch its mistake.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import drill_answers as answers
import pytest

from reference_impl import graders
from reference_impl import interview_core as core
from reference_impl import notebook as nb

GRADERS = Path(graders.__file__)


def failing(results: graders.Results) -> set[str]:
    return {name for name, (ok, _) in results.items() if not ok}


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
        answers.CountsInIterSampler, {"state_dict returns a copy": "commit() changes no state",
                                      EXACTLY_ONCE: "0 samples trained twice, 48 never"}),  # prefetched, skipped
    "offset carried into the next epoch": (
        answers.CarriesOffsetSampler, {"a new epoch starts at its beginning": "yields 30 indices on rank 0, want 48"}),
}


@pytest.mark.parametrize("answer", list(DRILL_3))
def test_drill_3_grader(answer: str, capsys: pytest.CaptureFixture[str]) -> None:
    sampler, expected = DRILL_3[answer]
    results = graders.grade_drill_3(sampler)
    printed = capsys.readouterr().out
    assert failing(results) == set(expected), printed
    for check, reason in expected.items():
        assert reason in results[check][1] and f"FAIL  {check}: " in printed, printed


DRILL_4: dict[str, tuple[Callable[..., Any], dict[str, str]]] = {
    "model solution": (answers.make_step(), {}),
    "every micro-batch all-reduces (no no_sync)": (
        answers.make_step(no_sync=False), {"one all-reduce per step (DDP comm hook)": "4 all-reduces for a step of 4"}),
    "each loss not divided by G": (
        answers.make_step(divide=False), {"4 micro-batches of m give the gradient of one batch of 4m": "4.00x",
                                          "returns the mean loss as a tensor": "is not the batch mean"}),
    "the loss returned as a float": (
        answers.make_step(as_tensor=False), {"returns the mean loss as a tensor": "returns a float"}),
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

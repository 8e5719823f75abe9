"""The walkthrough's notebook runs top to bottom, alone and under torchrun."""

import pytest

from launch import python_module, torchrun


def test_notebook_runs_top_to_bottom_on_one_cpu_process() -> None:
    run = python_module([], module="reference_impl.notebook", timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "backend none" in run.stdout
    restored = run.of("checkpoint_restored")
    assert [e["step"] for e in restored] == [1, 1], "cell 7 round-trips, cell 8 resumes from it"
    assert run.of("run_complete")[-1]["step"] == 40


@pytest.mark.distributed
def test_notebook_runs_under_torchrun_with_two_ranks() -> None:
    run = torchrun([], module="reference_impl.notebook", timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "rank 1/2 local_rank 1 on cpu backend gloo" in run.stdout
    assert run.of("run_complete")[-1]["step"] == 40

"""The benchmark command line runs and ends with its JSON line (no timing assertions)."""

from __future__ import annotations

import json

import launch
import pytest
import torch

from reference_impl.bench import BenchmarkError, recovery_times


def last_json(run: launch.Run, name: str) -> dict:
    """The benchmark's final JSON line, after checking the run succeeded."""
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == name
    return result


def test_overhead_bench_runs() -> None:
    run = launch.python_module(["overhead", "--rounds", "1", "--max-steps", "3", "--hidden-dim", "16",
                                "--micro-batch-size", "8", "--dataset-size", "64"],
                               timeout=60, module="reference_impl.bench")
    result = last_json(run, "overhead")
    assert result["ratio"] > 0 and result["cpu_ratio"] > 0
    assert result["trainer_ms_per_step"] > 0 and result["bare_ms_per_step"] > 0
    assert result["rounds"] == 1 and result["steps"] == 3


def test_checkpoint_bench_runs() -> None:
    run = launch.python_module(["checkpoint", "--rounds", "1", "--hidden-dims", "16,32"],
                               timeout=180, module="reference_impl.bench")
    result = last_json(run, "checkpoint")
    assert [s["hidden_dim"] for s in result["sizes"]] == [16, 32]
    for size in result["sizes"]:
        assert size["params"] > 0 and size["state_bytes"] > 0
        assert size["save_ratio"] > 0 and size["save_ratio_fsync"] > 0 and size["restore_ratio"] > 0
    assert 0 < result["recovery_restored_s"] <= result["recovery_s"]
    assert result["raw_save_fsync"] is False


def test_async_bench_relaunches_under_torchrun() -> None:
    run = launch.python_module(["async", "--rounds", "1", "--d-model", "32", "--n-layers", "1",
                                "--n-heads", "2", "--hidden-dim", "64"],
                               timeout=180, module="reference_impl.bench")
    result = last_json(run, "async")
    assert result["world_size"] == 2 and result["params"] > 0
    assert result["sync_s"] > 0 and result["blocked_s"] > 0 and result["blocked_ratio"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without a GPU gets")
def test_gpu_bench_refuses_without_a_gpu() -> None:
    run = launch.python_module(["gpu"], timeout=60, module="reference_impl.bench")
    assert run.returncode == 2
    assert run.stdout == ""
    assert run.stderr.strip().splitlines() == [
        "reference_impl.bench gpu: error: --device cuda was requested but no GPU is visible"]


def test_recovery_times_from_events() -> None:
    events = [{"event": "run_start", "restart_count": 0, "time": 100.0},
              {"event": "step", "step": 14, "time": 101.0},
              {"event": "error", "time": 101.5},
              {"event": "run_start", "restart_count": 1, "time": 102.5},
              {"event": "checkpoint_restored", "restart_count": 1, "step": 10, "time": 103.0},
              {"event": "step", "step": 11, "time": 103.25}]
    assert recovery_times(events) == (2.0, 2.25)
    with pytest.raises(BenchmarkError, match="did not show a kill"):
        recovery_times(events[:3])

"""The benchmark command line runs and ends with its JSON line (no timing assertions)."""

from __future__ import annotations

import json

import launch


def test_overhead_bench_runs() -> None:
    run = launch.python_module(["overhead", "--rounds", "1", "--max-steps", "3", "--hidden-dim", "16",
                                "--micro-batch-size", "8", "--dataset-size", "64"],
                               timeout=60, module="reference_impl.bench")
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "overhead"
    assert result["ratio"] > 0 and result["cpu_ratio"] > 0
    assert result["trainer_ms_per_step"] > 0 and result["bare_ms_per_step"] > 0
    assert result["rounds"] == 1 and result["steps"] == 3

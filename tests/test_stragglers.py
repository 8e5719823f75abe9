"""The straggler rule on a real two-rank gloo group, with sleeps in chosen steps of rank 1:
a slow step now and then is noise (medians), two slow windows are not enough (patience),
three make rank 1 a straggler, reported once, by rank 0 alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import straggler_worker as worker
from launch import free_port, run_ranks
from reference_impl.config import TrainConfig

pytestmark = pytest.mark.timeout(120)


def test_the_straggler_rule_ignores_noise_and_needs_patience(tmp_path: Path) -> None:
    run_ranks(worker.monitored_ranks, (2, free_port(), str(tmp_path)))
    events = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert all(case == [] for case in events[1].values()), "only rank 0 reports"
    seen = events[0]
    assert seen["one_slow_step_per_window"] == [], "one slow step in five moves no median"
    assert seen["two_slow_windows"] == [], "patience: two slow windows are not a straggler"
    defaults = TrainConfig()
    assert defaults.straggler_patience == 3
    [event] = seen["three_slow_windows"]
    assert (event["rank"], event["step"]) == (1, 20), "named at the end of its third slow window"
    assert event["slowdown"] >= defaults.straggler_threshold

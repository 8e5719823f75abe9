"""`python -m reference_impl.bench.measure`: what it writes, without running the slow measurements."""

from __future__ import annotations

import json
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch

from reference_impl.bench import measure
from reference_impl.bench import BenchmarkError
from reference_impl.metrics import PHASES


def test_main_writes_one_json_per_dataset_with_its_metadata(tmp_path: Path) -> None:
    assert measure.main(["--out", str(tmp_path), "--only", "memory"]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["memory.json"]
    record = json.loads((tmp_path / "memory.json").read_text())
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=measure.ROOT, capture_output=True,
                          text=True).stdout.strip()
    assert record["torch"] == torch.__version__
    assert record["date"] == datetime.now(timezone.utc).strftime("%Y-%m-%d")
    assert record["commit"] == head
    assert record["command"] == "python -m reference_impl.bench.measure --only memory"
    assert record["device"].startswith("CPU: ")
    assert record["data"] == measure.memory()


def test_every_dataset_is_registered() -> None:
    assert set(measure.DATASETS) == {"resume", "phases", "async_checkpoint", "memory", "allreduce", "pipeline"}


def test_a_failed_measurement_exits_1_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    def fail() -> dict:
        raise BenchmarkError("the run died")

    monkeypatch.setitem(measure.DATASETS, "memory", fail)
    assert measure.main(["--out", str(tmp_path), "--only", "memory"]) == 1
    assert not list(tmp_path.iterdir())
    assert "memory failed: the run died" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["file", "under a file"])
def test_an_out_that_is_no_writable_folder_is_one_line_before_any_measurement(
        where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """It used to measure for minutes, then end in a traceback when it came to write."""
    monkeypatch.setitem(measure.DATASETS, "memory", lambda: pytest.fail("measured before checking --out"))
    (tmp_path / "afile").write_text("")
    out = tmp_path / "afile" if where == "file" else tmp_path / "afile" / "data"
    assert measure.main(["--out", str(out), "--only", "memory"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"python -m reference_impl.bench.measure: error: --out {out} is not a "
                                               "writable folder: "), err


def test_phases_are_milliseconds_per_step_after_the_first_log_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each `step` event's `phase_s` sums its window since the last log (here 5, 5, 5 and 3
    steps); the start-up window is dropped and the rest divided by the 13 steps it covers."""
    per_step_ms = {"data": 1.0, "forward": 4.0, "backward": 6.0, "optimizer": 2.0}  # no h2d on the CPU
    windows = [(5, 5), (10, 5), (15, 5), (18, 3)]
    events = [{"event": "run_start"}]
    for step, length in windows:
        startup = 1.0 if step == 5 else 0.0  # seconds of warm-up in the first window only
        events.append({"event": "step", "step": step,
                       "phase_s": {p: length * ms / 1e3 + startup for p, ms in per_step_ms.items()}})
    events.append({"event": "run_complete", "step": 18})
    launched: list[list[str]] = []

    def fake_events(module: str, args: list[str], max_restarts: int = 0) -> list[dict]:
        launched.append(args)
        return events

    monkeypatch.setattr(measure, "_events", fake_events)
    data = measure.phases()
    assert len(launched) == len(measure.PHASE_CASES)
    assert list(data["cases"]) == list(measure.PHASE_CASES) and data["phases"] == list(PHASES)
    for case in data["cases"].values():
        assert case == pytest.approx({"h2d": 0.0, **per_step_ms}), case


def test_an_unknown_dataset_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exc:
        measure.main(["--only", "nonesuch"])
    assert exc.value.code == 2

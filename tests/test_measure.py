"""`python -m reference_impl.measure`: what it writes, without running the slow measurements."""

from __future__ import annotations

import json
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch

from reference_impl import measure
from reference_impl.bench import BenchmarkError


def test_main_writes_one_json_per_dataset_with_its_metadata(tmp_path: Path) -> None:
    assert measure.main(["--out", str(tmp_path), "--only", "memory"]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["memory.json"]
    record = json.loads((tmp_path / "memory.json").read_text())
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=measure.ROOT, capture_output=True,
                          text=True).stdout.strip()
    assert record["torch"] == torch.__version__
    assert record["date"] == datetime.now(timezone.utc).strftime("%Y-%m-%d")
    assert record["commit"] == head
    assert record["command"] == "python -m reference_impl.measure --only memory"
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


def test_an_unknown_dataset_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exc:
        measure.main(["--only", "nonesuch"])
    assert exc.value.code == 2

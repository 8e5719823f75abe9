"""Which launcher passes `--local-rank` to the script, and which only sets LOCAL_RANK; a local
rank without a GPU of its own.

The interview trainer reads LOCAL_RANK from the environment, which works under both.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from launch import python_module, run_command

pytestmark = pytest.mark.distributed

# Both ranks share one stdout pipe: each writes its whole line in one call (print would write
# the text and the newline separately, and two ranks' lines could arrive glued together).
SHOW = ("import json, os, sys; "
        "sys.stdout.write(json.dumps({'argv': sys.argv[1:], 'env': os.environ['LOCAL_RANK']}) + '\\n')\n")


def launched(launcher: str, tmp_path: Path) -> list[dict]:
    script = tmp_path / "show.py"
    script.write_text(SHOW)
    run = run_command([sys.executable, "-m", launcher, "--standalone", "--nproc-per-node", "2", str(script)],
                      timeout=90, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    return sorted((json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")),
                  key=lambda seen: seen["env"])


def test_torchrun_sets_local_rank_in_the_environment_and_passes_no_flag(tmp_path: Path) -> None:
    assert launched("torch.distributed.run", tmp_path) == [{"argv": [], "env": "0"}, {"argv": [], "env": "1"}]


def test_the_legacy_launcher_passes_the_local_rank_flag_as_well(tmp_path: Path) -> None:
    assert launched("torch.distributed.launch", tmp_path) == [
        {"argv": ["--local-rank=0"], "env": "0"}, {"argv": ["--local-rank=1"], "env": "1"}]


def test_a_node_with_fewer_gpus_than_ranks_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """LOCAL_RANK picks the GPU, so a second rank on a one-GPU node would ask for a device that
    is not there (and NCCL will not share one between ranks). Every rank of the node refuses
    alike in preflight, before any group forms, so local rank 0 prints the line for all;
    `tests/test_gpu.py` starts one rank too many on a real GPU."""
    from reference_impl.config import ConfigError, TrainConfig
    from reference_impl.distributed import pick_device
    from reference_impl.train import preflight

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert pick_device("auto", 0) == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for local_rank in ("0", "1"):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        for device in ("auto", "cuda"):
            with pytest.raises(ConfigError) as refused:
                preflight(TrainConfig(device=device))
            assert str(refused.value) == ("2 ranks on this node but 1 GPU(s) visible: each rank needs a GPU of "
                                          "its own; start at most 1 per node, or pass --device cpu")
        assert preflight(TrainConfig(device="cpu")) is None


@pytest.mark.parametrize(("name", "value"), [("LOCAL_RANK", "one"), ("LOCAL_RANK", "-1"), ("LOCAL_WORLD_SIZE", "0"),
                                            ("RANK", "x")])
def test_a_malformed_rank_variable_in_the_environment_is_one_line(monkeypatch: pytest.MonkeyPatch, name: str,
                                                                value: str) -> None:
    from reference_impl.config import ConfigError, TrainConfig
    from reference_impl.train import preflight

    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=rf"^{name}='{value}' in the environment is not a whole number"):
        preflight(TrainConfig())


def test_the_trainer_prints_a_malformed_local_rank_instead_of_waiting_silently() -> None:
    """Only local rank 0 prints a bad config (one line per node); a LOCAL_RANK that is no
    number is no other rank's to print, so this process prints it itself."""
    run = python_module([], env={"LOCAL_RANK": "one"}, timeout=60)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "reference_impl.train: error: LOCAL_RANK='one' in the environment is not a whole number of at least 0"]


TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE")
MEETING_POINT = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29512"}


@pytest.mark.parametrize(("env", "message"), [
    ({"WORLD_SIZE": "1", "RANK": "3", **MEETING_POINT}, "RANK=3 in the environment is not below WORLD_SIZE=1"),
    ({"WORLD_SIZE": "1", "TORCHELASTIC_RESTART_COUNT": "abc", **MEETING_POINT},
     "TORCHELASTIC_RESTART_COUNT='abc' in the environment is not a whole number of at least 0"),
    ({"WORLD_SIZE": "1"}, "MASTER_ADDR is not set: start the ranks with torchrun (or unset WORLD_SIZE)"),
    ({"WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "abc"},
     "MASTER_PORT='abc' in the environment is not a whole number of at least 1"),
    ({"WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "99999"},
     "MASTER_PORT=99999 in the environment is not a port (1-65535)"),
])
def test_torchruns_variables_are_checked_before_a_rank_waits_for_its_peers(
        monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str) -> None:
    """Each used to end in a traceback from deep inside torch, and RANK=3 of 1 in a silent hang."""
    from reference_impl.config import ConfigError, TrainConfig
    from reference_impl.train import preflight

    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as refused:
        preflight(TrainConfig())
    assert str(refused.value) == message


def test_a_rank_outside_its_world_exits_2_with_one_line_instead_of_hanging() -> None:
    run = python_module([], env={"WORLD_SIZE": "1", "RANK": "3", **MEETING_POINT}, timeout=60)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "reference_impl.train: error: RANK=3 in the environment is not below WORLD_SIZE=1"]

"""Which launcher passes `--local-rank` to the script, and which only sets LOCAL_RANK.

The interview trainer reads LOCAL_RANK from the environment, which works under both.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from launch import run_command

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

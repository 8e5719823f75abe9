"""The set-up scripts say what they are doing: `scripts/serve.sh` (through `scripts/env.sh`)
prints one line before each step that takes a while, instead of 40 s of silence while it
installs. The venv here is a fake whose programs only report that they ran, so the order of
the lines is checked in a fraction of a second, without installing anything."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from launch import REPO

FAKE = '#!/usr/bin/env bash\necho "ran: {name} $*" >&2\n{extra}exit 0\n'


def fake_venv(root: Path) -> Path:
    venv = root / "venv"
    (venv / "bin").mkdir(parents=True)
    programs = {"python": 'case "$*" in *sys.version_info*) echo 311;; esac\n', "uv": "", "mkdocs": ""}
    for name, extra in programs.items():
        path = venv / "bin" / name
        path.write_text(FAKE.format(name=name, extra=extra))
        path.chmod(0o755)
    return venv


def serve(venv: Path, links: Path) -> list[str]:
    """serve.sh's output, stderr and stdout in the order written."""
    env = {**os.environ, "VENV": str(venv), "PIP_FIND_LINKS": str(links)}
    done = subprocess.run(["bash", str(REPO / "scripts" / "serve.sh")], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=60, check=True)
    return done.stdout.splitlines()


def before(lines: list[str], said: str, ran: str) -> bool:
    """Whether the script's last line before the first line containing `ran` starts with `said`."""
    at = next(i for i, line in enumerate(lines) if ran in line)
    return [line for line in lines[:at] if line.startswith("serve.sh:")][-1].startswith(said)


@pytest.mark.parametrize("wheel", [True, False], ids=["uv", "pip"])
def test_serve_says_what_it_is_doing_before_each_long_step(wheel: bool, tmp_path: Path) -> None:
    links = tmp_path / "wheels"
    links.mkdir()
    if wheel:
        (links / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    venv = fake_venv(tmp_path)
    lines = serve(venv, links)
    if wheel:
        assert before(lines, "serve.sh: installing uv", "ran: python -m pip install --quiet"), lines
        assert before(lines, "serve.sh: installing uv", "ran: uv pip install"), lines
    else:
        assert before(lines, "serve.sh: installing torch 2.13.0", "torch==2.13.0"), lines
    assert before(lines, "serve.sh: checking that torch", "ran: python -c import torch, reference_impl"), lines
    assert before(lines, "serve.sh: building the handbook", "ran: mkdocs serve"), lines
    again = serve(venv, links)  # installed: the stamp says so
    assert [line for line in again if line.startswith("serve.sh:")] == [
        "serve.sh: building the handbook, then serving it on http://127.0.0.1:8000 (Ctrl-C stops)"], again

"""A trainer rank whose flags differ from its peers': torchrun gives every rank the same
arguments, and this script, run by torchrun in place of `-m reference_impl.train`, appends
the flags in the environment variable `RANK<r>_FLAGS` (r: the global rank; shell-quoted) to
rank r's, where the last occurrence of a flag wins.

Used to simulate what one machine cannot show directly: node-local disks mounted at one
path (each rank its own `--checkpoint-dir`: the paths differ and the disk is one, which to
the trainer is the same as one path on different disks, since no rank sees a file another
rank writes in "its" directory), and a loaded machine delaying one rank's watchdog (a
longer `--step-timeout-s` on that rank).
"""

from __future__ import annotations

import os
import shlex
import sys

from reference_impl.distributed import exit_after
from reference_impl.train import main

if __name__ == "__main__":
    exit_after(lambda: main([*sys.argv[1:], *shlex.split(os.environ.get(f"RANK{os.environ['RANK']}_FLAGS", ""))]))

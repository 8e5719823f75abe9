"""A trainer rank on a simulated node of its own: `--checkpoint-dir D` becomes `D/nodeR` (R is
the global rank), as if each rank's node mounted a disk of its own at the same path D.

Run it as torchrun's script in place of `-m reference_impl.train`. On a real cluster the
path is identical and the disks differ; here the paths differ and the disk is one, which
is the same to the trainer: no rank can see a file another rank writes in "its"
checkpoint directory.
"""

from __future__ import annotations

import os
import sys

from reference_impl.distributed import exit_process
from reference_impl.train import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    at = argv.index("--checkpoint-dir") + 1
    argv[at] = os.path.join(argv[at], f"node{os.environ['RANK']}")
    exit_process(main(argv))

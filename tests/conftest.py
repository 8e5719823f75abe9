"""Shared set-up for every test folder.

- The helpers in tests/launch.py are importable everywhere.
- One intra-op thread per test process, unless the caller chose otherwise. The suite runs
  on two xdist workers on a 2-core machine, and each torchrun job it starts adds more
  processes; with torch's default of one OpenMP thread per core, the workers' threads
  spin-wait against each other (the fp16 step test took 8.3 s with two threads and
  2.5 s with one, measured side by side on the loaded CI-sized machine). This must run
  before anything imports torch.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

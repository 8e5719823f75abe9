"""A small, tested reference trainer for data-parallel PyTorch (DDP and FSDP2).

Every module holds one concern; the handbook shows named sections of these files,
so what a reader copies is exactly what the tests run.
"""

import os

__version__ = "0.1.0"

# This process and the one that started it, read before anything slow is imported. A
# torchrun worker spends seconds importing torch before it can ask to die with its agent;
# an agent SIGKILLed in that time has already left it re-parented, and `os.getppid()`
# read then would name the reaper. `lifecycle.die_with_parent` compares against this.
# Keep this file free of heavy imports: it runs first in every worker.
STARTED_BY = (os.getpid(), os.getppid())

"""Shared set-up for every test folder.

- The helpers in tests/launch.py are importable everywhere.
- One intra-op thread per test process, unless the caller chose otherwise. The suite runs
  on two xdist workers on a 2-core machine, and each torchrun job it starts adds more
  processes; with torch's default of one OpenMP thread per core, the workers' threads
  spin-wait against each other (the fp16 step test took 8.3 s with two threads and
  2.5 s with one, measured side by side on the loaded CI-sized machine). This must run
  before anything imports torch.
- Under xdist, the order in which the workers receive the test files (see
  `pytest_collection_modifyitems`), and a scheduler under which a run whose worker died
  still ends (`pytest_xdist_make_scheduler`).
"""

import os
import sys
from pathlib import Path

import pytest

from scheduling import pytest_xdist_make_scheduler  # noqa: F401 - a hook: pytest finds it here

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

# Rough seconds on the loaded 2-core machine: a test marked slow takes over ~12 s, one in a
# module that starts processes several (each pays for a Python start and `import torch`), and
# most others under one.
SLOW_S, PROCESSES_S, QUICK_S = 12, 5, 1
# Names by which a test module starts processes: the tests/launch.py helpers and the modules.
STARTS_PROCESSES = {"subprocess", "mp", "multiprocessing", "run_command", "python_module", "run_ranks", "torchrun",
                    "forked_ranks", "train_ok"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On an xdist worker, order the test files longest first (by a rough estimate).

    scripts/test.sh hands out whole files (`--dist loadfile`, so that a module's shared
    set-up, such as a reference run or a browser, is built once) in collection order
    (`--no-loadscope-reorder`). Longest first, a long file starts while the other worker
    still has work, and the run ends on short files, so neither worker idles through the
    other's long tail. The tests within a file keep their order; without xdist (`-n 0`)
    nothing moves.
    """
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    estimate = {name: sum(map(_seconds, tests)) for name, tests in files.items()}
    longest_first = sorted(files, key=lambda name: -estimate[name])  # stable: ties keep collection order
    items[:] = [item for name in longest_first for item in files[name]]


def _seconds(item: pytest.Item) -> int:
    if item.get_closest_marker("slow"):
        return SLOW_S
    module = getattr(item, "module", None)
    starts_processes = item.get_closest_marker("distributed") or (
        module is not None and not STARTS_PROCESSES.isdisjoint(vars(module)))
    return PROCESSES_S if starts_processes else QUICK_S

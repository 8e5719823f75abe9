"""Whole files to xdist workers (`--dist loadfile`), and a run that still ends when a worker dies.

A worker dies when a test takes its process down: a crash in native code, the kernel's
out-of-memory killer, or the faulthandler deadline (`faulthandler_exit_on_timeout`) that
ends a test no Python timeout could stop. xdist 3.8's file scheduler then puts back every
file that worker had ever been given, finished ones included: a finished file goes out
again as an empty batch that no worker ever reports on, the workers wait for each other,
and the run never ends (pytest-xdist issues 1323 and 1378). It also runs the test the
worker died in again, which takes the replacement down too. Here only the unfinished tests
go back, less the one the worker died in (xdist has already reported it as failed).
"""

from __future__ import annotations

import pytest
from xdist.dsession import WorkerController
from xdist.remote import Producer
from xdist.scheduler import LoadFileScheduling


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> LoadFileScheduling | None:
    """`--dist loadfile` (scripts/test.sh's) as `LoadFileThatSurvivesACrash`; others as xdist's."""
    return LoadFileThatSurvivesACrash(config, log) if config.getvalue("dist") == "loadfile" else None


class LoadFileThatSurvivesACrash(LoadFileScheduling):
    """`--dist loadfile` whose run ends, red, when a worker dies, instead of hanging."""

    def remove_node(self, node: WorkerController) -> str | None:
        """Forget `node`; if it died mid-file, return the test it died in and requeue the rest."""
        workload = self.assigned_work.pop(node)
        unfinished = [(scope, nodeid) for scope, unit in workload.items()
                      for nodeid, done in unit.items() if not done]
        if not unfinished:
            return None  # an orderly shutdown
        scope, crashed = unfinished[0]  # a worker runs its tests in order: the first not done
        workload[scope][crashed] = True
        for name, unit in workload.items():
            if not all(unit.values()):
                self.workqueue[name] = unit
        for other in self.assigned_work:
            self._reschedule(other)
        return crashed

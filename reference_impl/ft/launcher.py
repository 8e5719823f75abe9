"""Start the Lighthouse and R replicas of N ranks; restart a replica that loses a rank.

The launcher is the only thing that restarts anything, and it restarts one replica at a
time: the others keep their processes and keep stepping. Every worker's JSON events are
echoed on stdout and kept, so the run's figures (`summarize`) come from what the ranks
themselves reported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from torch.distributed import TCPStore
from torchft.coordination import LighthouseServer

from reference_impl.launch import free_port, kill_descendants

# A replica whose heartbeat stopped this long ago is out of the quorum: how long survivors
# wait for a dead replica. The heartbeat comes every 100 ms from a thread that does not need
# the GIL, so 2 s leaves room for a loaded machine.
HEARTBEAT_TIMEOUT_MS = 2000
# How long a quorum waits for a replica that heartbeats but has not asked to join yet.
JOIN_TIMEOUT_MS = 10_000
POLL_S = 0.05


@dataclass
class Replica:
    """The processes of one replica and how often they were started again."""

    index: int
    procs: list[subprocess.Popen[str]] = field(default_factory=list)
    restarts: int = 0
    done: bool = False


class Launcher:
    """Runs the replicas to completion, restarting each failed one up to `max_restarts` times."""

    def __init__(self, replicas: int, nproc: int, train_args: list[str], max_restarts: int,
                 step_floor_s: float = 0.0) -> None:
        self.nproc, self.train_args, self.max_restarts = nproc, train_args, max_restarts
        self.step_floor_s = step_floor_s
        self.replicas = [Replica(r) for r in range(replicas)]
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._readers: list[threading.Thread] = []

    def emit(self, event: str, **fields: Any) -> None:
        """Print and keep an event of the launcher's own."""
        self._record(json.dumps({"event": event, "rank": "launcher", "time": round(time.time(), 3), **fields}))

    def _record(self, line: str) -> None:
        with self._lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
            if line.startswith("{"):
                try:
                    self.events.append(json.loads(line))
                except json.JSONDecodeError:
                    pass

    def _read(self, stream: Any) -> None:
        for line in stream:
            self._record(line.rstrip("\n"))

    def start(self, replica: Replica, lighthouse: str, start_port: int) -> None:
        """Start the N ranks of `replica`, with a fresh store of their own for this attempt."""
        port = free_port()
        job_env = {"FT_REPLICA": str(replica.index), "FT_REPLICAS": str(len(self.replicas)),
                   "FT_JOB_WORLD_SIZE": str(len(self.replicas) * self.nproc), "FT_START_PORT": str(start_port),
                   "FT_STEP_FLOOR_S": str(self.step_floor_s),
                   "TORCHFT_LIGHTHOUSE": lighthouse, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "WORLD_SIZE": str(self.nproc), "LOCAL_WORLD_SIZE": str(self.nproc),
                   "TORCHELASTIC_RESTART_COUNT": str(replica.restarts), "TORCHELASTIC_RUN_ID": "ft",
                   "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        replica.procs = []
        for rank in range(self.nproc):
            env = {**os.environ, **job_env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            proc = subprocess.Popen([sys.executable, "-m", "reference_impl.ft.replica", *self.train_args],
                                    env=env, stdout=subprocess.PIPE, text=True)
            reader = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
            reader.start()
            self._readers.append(reader)
            replica.procs.append(proc)

    def run(self) -> int:
        """Run the job; return 0 when every replica finished, 1 when one gave up."""
        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=JOIN_TIMEOUT_MS,
                                      heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
        start_port = free_port()
        start_store = TCPStore("127.0.0.1", start_port, is_master=True, wait_for_workers=False)
        try:
            for replica in self.replicas:
                self.start(replica, lighthouse.address(), start_port)
            status = self._supervise(lighthouse.address(), start_port)
        finally:
            for replica in self.replicas:
                for proc in replica.procs:
                    kill_descendants(proc.pid)
            for reader in self._readers:
                reader.join(timeout=10)
            lighthouse.shutdown()
            del start_store
        return status

    def _supervise(self, lighthouse: str, start_port: int) -> int:
        while not all(r.done for r in self.replicas):
            time.sleep(POLL_S)
            for replica in self.replicas:
                if replica.done:
                    continue
                codes = [proc.poll() for proc in replica.procs]
                if all(code == 0 for code in codes):
                    replica.done = True
                    continue
                failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
                if not failed:
                    continue
                rank, code = failed[0]
                self.emit("replica_failed", replica=replica.index, global_rank=replica.index * self.nproc + rank,
                          exit_code=code)
                for proc in replica.procs:  # its other ranks would only wait for the dead one
                    kill_descendants(proc.pid)
                    proc.wait()
                # Nothing to rejoin once a replica has finished: the job is over.
                finished = any(r.done for r in self.replicas)
                if replica.restarts >= self.max_restarts or finished:
                    self.emit("replica_abandoned", replica=replica.index, restarts=replica.restarts,
                              reason="the other replicas finished first" if finished else "out of restarts")
                    return 1
                replica.restarts += 1
                self.emit("replica_restarted", replica=replica.index, attempt=replica.restarts)
                self.start(replica, lighthouse, start_port)
        return 0


def summarize(events: list[dict[str, Any]], replicas: list[Replica], nproc: int,
              fail_rank: int | None) -> dict[str, Any]:
    """The `ft_complete` fields: the step, restarts, recoveries, and the outage's timings.

    `kill_to_survivor_step_s`: from the injected kill to the first step a surviving replica
    committed after it. `kill_to_contributing_s`: to the first committed step whose average
    includes the failed replica again. `outage_steps`: the steps committed in between.
    """
    failed = fail_rank // nproc if fail_rank is not None else None
    done = [e for e in events if e.get("event") == "replica_complete"]
    digests = {e["state_digest"] for e in done}
    summary: dict[str, Any] = {
        "step": min((e["step"] for e in done), default=0),
        "survivor_restarts": sum(r.restarts for r in replicas if r.index != failed),
        "recoveries": len([e for e in events if e.get("event") == "recovered"]),
        "replica_restarts": [r.restarts for r in replicas],
        "state_digests_equal": len(digests) == 1 and len(done) == len(replicas),
        "state_digest": next(iter(digests)) if len(digests) == 1 else None,
        "samples_not_trained": sum(len(e["indices"]) for e in events if e.get("event") == "samples_not_trained"),
    }
    kills = [e["time"] for e in events if e.get("event") == "fault_injected"]
    if failed is None or not kills:
        return summary
    kill = kills[0]
    steps = [e for e in events if e.get("event") == "ft_step" and e["time"] > kill]
    survivor = [e["time"] for e in steps if e["replica"] != failed]
    back = [e for e in steps if failed in e["participants"]]
    summary["kill_to_survivor_step_s"] = round(min(survivor) - kill, 3) if survivor else None
    summary["kill_to_contributing_s"] = round(back[0]["time"] - kill, 3) if back else None
    until = back[0]["time"] if back else float("inf")
    summary["outage_steps"] = len({e["step"] for e in steps if e["replica"] != failed and e["time"] < until})
    return summary

"""What a run imports: a run whose parameters are whole never imports DCP, and a run
without pipeline stages never imports `torch.distributed.pipelining`.

A restarted job pays its imports again before its first resumed step. DCP
(`torch.distributed.checkpoint`) serves only runs with sharded parameters, so the package
imports it where such a run uses it (`reference_impl.checkpoint.layouts`), not at start-up;
likewise the pipelining package, where a pipeline is built (`reference_impl.parallel.pipeline`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# Train 4 steps with a checkpoint at 2 and 4, then resume from 4 to 6: the path of a restart.
SCRIPT = """
import io, json, sys
from reference_impl.config import TrainConfig
from reference_impl.distributed import DistContext
from reference_impl.metrics import EventLog
from reference_impl.train import train

flags = ["--micro-batch-size", "8", "--dataset-size", "64", "--warmup-steps", "0", "--device", "cpu",
         "--checkpoint-dir", sys.argv[1], "--checkpoint-every", "2", "--allow-config-change", "max_steps"]
log = io.StringIO()
for steps in ("4", "6"):
    train(TrainConfig.from_cli([*flags, "--max-steps", steps]), DistContext(), EventLog(0, log))
restored = [json.loads(line) for line in log.getvalue().splitlines() if '"checkpoint_restored"' in line]
print(json.dumps({"restored": [e["step"] for e in restored],
                  "dcp": sorted(m for m in sys.modules if m.startswith("torch.distributed.checkpoint")),
                  "pipelining": sorted(m for m in sys.modules if m.startswith("torch.distributed.pipelining"))}))
"""


def test_a_single_process_run_and_its_resume_never_import_dcp_or_pipelining(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["restored"] == [4], "the second run resumed from the first one's checkpoint"
    assert result["dcp"] == []
    assert result["pipelining"] == []

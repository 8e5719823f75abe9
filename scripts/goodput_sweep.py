"""Goodput against failure rate and checkpoint interval, measured: `python scripts/goodput_sweep.py`.

Runs `python -m reference_impl.bench goodput` once per point of two sweeps and writes
`docs/data/goodput_sweep.json`, which the site plots beside `calc.goodput`'s curves:

- the job's mean time between failures at a fixed checkpoint interval (a job of more GPUs
  fails more often: the rate is the GPU count times each GPU's rate), and
- the checkpoint interval at a fixed failure rate.

Each point is a real trainer under random SIGKILLs (see `reference_impl/bench/goodput.py`);
a point takes a few minutes on a 2-core machine, the whole sweep about half an hour.
`--out` writes elsewhere; `--failures` trades time for precision.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

from reference_impl.bench.measure import describe_device

ROOT = Path(__file__).resolve().parents[1]

COMMAND = "python scripts/goodput_sweep.py"
# (job MTBF in seconds, steps between checkpoints): four failure rates at one interval,
# then three more intervals at the second rate.
POINTS = ((16.0, 20), (8.0, 20), (4.0, 20), (2.0, 20), (8.0, 5), (8.0, 80), (8.0, 320))


def run_point(mtbf_s: float, every: int, failures: int, seed: int) -> dict[str, object]:
    """One `bench goodput` run; its command and its JSON line."""
    flags = ["--failures", str(failures), "--mtbf-s", f"{mtbf_s:g}", "--checkpoint-every", str(every),
             "--fault-seed", str(seed), "--timeout-s", "1500"]
    try:
        done = subprocess.run([sys.executable, "-m", "reference_impl.bench", "goodput", *flags], cwd=ROOT,
                              capture_output=True, text=True, timeout=1800, check=False)
    except subprocess.TimeoutExpired:
        sys.exit(f"goodput_sweep: the run {' '.join(flags)} did not end within 1800 s")
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    try:
        result = json.loads(last)
    except json.JSONDecodeError:
        sys.exit(f"goodput_sweep: the run {' '.join(flags)} ended without its JSON line: "
                 f"{(done.stderr.strip().splitlines() or ['no output'])[-1]}")
    if result.get("benchmark") != "goodput":
        sys.exit(f"goodput_sweep: the run {' '.join(flags)} failed: {result}")
    return {"command": "python -m reference_impl.bench goodput " + " ".join(flags), "result": result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--failures", type=int, default=12, help="failures each point aims for")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "data" / "goodput_sweep.json")
    args = parser.parse_args()
    if args.failures < 1:
        parser.error("--failures must be at least 1")
    if not args.out.parent.is_dir():
        parser.error(f"--out: {args.out.parent} is not a directory")
    runs = [run_point(mtbf, every, args.failures, seed=11 + i) for i, (mtbf, every) in enumerate(POINTS)]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=False).stdout.strip() or "unknown"
    record = {"device": describe_device(), "torch": torch.__version__,
              "date": datetime.now(timezone.utc).date().isoformat(), "commit": commit, "command": COMMAND,
              "data": {"runs": runs}}
    args.out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({"benchmark": "goodput_sweep", "points": len(runs), "out": str(args.out)}))


if __name__ == "__main__":
    main()

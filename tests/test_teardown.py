"""How a finished worker leaves: why the trainer skips interpreter finalization, that
skipping it loses no output, and that a rank of the interview trainer skips it too.

Each runs in a subprocess: the first leaves a process group alive on purpose, which must
not happen in the pytest worker itself.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from launch import REPO, torchrun

GROUP_OUTLIVES_DESTROY = textwrap.dedent("""
    import gc, os, weakref
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = weakref.ref(dist.group.WORLD)

    def train_briefly():
        model = fully_shard(torch.nn.Linear(8, 8), mesh=init_device_mesh("cpu", (1,)))
        model(torch.randn(2, 8)).sum().backward()

    train_briefly()  # the model, its mesh and its gradients are garbage afterwards
    dist.destroy_process_group()
    gc.collect()
    print("alive" if group() is not None else "freed", flush=True)
    os._exit(0)
""")


INTERVIEW_TRAINER_ENDS = textwrap.dedent("""
    import atexit, runpy, sys, weakref
    import torch.distributed as dist
    path = sys.argv.pop(1)  # reference_impl/notebook.py, run as the script torchrun starts
    atexit.register(sys.stdout.write, "finalized\\n")
    init = dist.init_process_group
    def recording(*args, **kwargs):
        init(*args, **kwargs)
        weakref.finalize(dist.group.WORLD, sys.stdout.write, "freed\\n")
    dist.init_process_group = recording
    sys.argv[0] = path
    runpy.run_path(path, run_name="__main__")
    sys.stdout.write("returned\\n")
""")


def python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env={"OMP_NUM_THREADS": "1", "PATH": ""})


def test_an_fsdp_models_group_outlives_destroy_process_group() -> None:
    """The premise of `exit_process`: after FSDP2 has run, DTensor's caches keep the mesh
    and its gloo group alive past `destroy_process_group` and a full collection, so the
    group would be freed during interpreter shutdown. If a torch upgrade frees it, this
    fails, and the hard exit can be reconsidered."""
    done = python(GROUP_OUTLIVES_DESTROY)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "alive"


def test_exit_process_flushes_both_streams_and_keeps_the_status() -> None:
    """`os._exit` alone would drop what is still buffered: stdout to a pipe is block-buffered,
    so the last event line (`run_complete`) would be lost."""
    done = python("import sys\n"
                  "from reference_impl.distributed import exit_process\n"
                  "print('{\"event\": \"run_complete\"}')\n"
                  "sys.stderr.write('last words')\n"
                  "exit_process(3)\n")
    assert done.returncode == 3
    assert done.stdout == '{"event": "run_complete"}\n'
    assert done.stderr == "last words"


FAILED_RUN = textwrap.dedent("""
    import atexit, runpy, sys
    import reference_impl.step as step

    class Held:  # what a failing run's frames hold: its model, optimizer, process groups
        def __del__(self):
            print("freed", flush=True)

    def fail(*args, **kwargs):
        held = Held()
        raise RuntimeError("Connection closed by peer")

    step.train_step = fail
    atexit.register(print, "finalized", flush=True)
    sys.argv = ["train", "--model", "mlp", "--max-steps", "3", "--warmup-steps", "0", "--device", "cpu",
                "--micro-batch-size", "8", "--dataset-size", "64", "--hidden-dim", "16"]
    runpy.run_module("reference_impl.train", run_name="__main__")
""")


def test_a_failed_run_ends_with_its_traceback_and_frees_nothing_it_held() -> None:
    """A failed rank's traceback holds its run, and its gloo group; the interpreter would free
    them after printing it, and a group whose collective has just failed can deadlock in
    its destructor, leaving a failed rank that never exits (the runs that showed it are
    counted on the process-topology page). The trainer prints the traceback and ends inside
    the handler: nothing is freed and no exit handler runs."""
    done = python(FAILED_RUN)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "RuntimeError: Connection closed by peer" in done.stderr
    assert '"error": "RuntimeError"' in done.stdout, "the error event comes first"
    assert "finalized" not in done.stdout and "freed" not in done.stdout, done.stdout[-2000:]


@pytest.mark.distributed
def test_a_rank_of_the_interview_trainer_ends_without_freeing_its_gloo_group(tmp_path: Path) -> None:
    """Freed right after the last collective, DDP's gloo group waits for its threads while
    holding the GIL, and a thread still freeing that collective's tensors waits for the GIL:
    one rank of a finished job then never exits (seen in the notebook-kernel test's torchrun
    cell). So a rank of a torchrun job ends the script with `os._exit(0)`, as the package's
    trainer does: the run completes on both ranks, and nothing is freed, no exit handler
    runs and the script never returns."""
    script = tmp_path / "ends.py"
    script.write_text(INTERVIEW_TRAINER_ENDS)
    done = torchrun([str(REPO / "reference_impl" / "notebook.py"), "--max-steps", "2", "--global-batch-size", "64",
                     "--micro-batch-size", "16", "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every",
                     "0"], module=str(script))
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(done.of("run_complete")) == 1, done.stdout[-2000:]  # rank 0 logs for both
    assert re.findall(r"finalized|freed|returned", done.stdout) == [], done.stdout[-2000:]

"""FSDP2 under real torchrun (gloo): the math, restart exactness, async saves, resharding.

Run as a script on each of two ranks (see `block_calls_on_each_rank`), this file is also
the driver that counts the transformer blocks' forward calls inside the real training loop.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

import fsdp_sync_worker
from checkpoints import published, verify
from launch import Run, forked_ranks, free_port, python_module, run_ranks, torchrun, train_ok
from reference_impl.config import TrainConfig
from reference_impl.data import ResumableDistributedSampler
from reference_impl.export import export
from reference_impl.model import build_model
from sample_logs import losses, trained_by_step

pytestmark = pytest.mark.distributed

FSDP = ["--strategy", "fsdp", "--model", "transformer", "--dataset-size", "512", "--warmup-steps", "2",
        "--log-every", "1", "--checkpoint-every", "10", "--pg-timeout-s", "60"]
TWO = ["--micro-batch-size", "8"]   # 2 ranks x 8 = 16 per step
ONE = ["--micro-batch-size", "16"]  # 1 rank x 16: the same global batch


def fsdp_run(tmp: Path, *flags: str, nproc: int = 2, restarts: int = 0, steps: int = 20) -> Run:
    """A 2-rank FSDP run that must succeed (`train_ok`: under torchrun only when it is to restart)."""
    return train_ok([*FSDP, *TWO, "--max-steps", str(steps)], tmp, *flags, nproc=nproc, restarts=restarts)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Path]:
    """An uninterrupted 2-rank FSDP run of 20 steps, checkpointed at 10 and 20."""
    ckpt = tmp_path_factory.mktemp("fsdp_reference")
    return fsdp_run(ckpt), ckpt


def test_fsdp_two_ranks_match_one_process(reference: tuple[Run, Path], tmp_path: Path) -> None:
    single = python_module([*FSDP, *ONE, "--max-steps", "20", "--checkpoint-dir", str(tmp_path)], timeout=120)
    assert single.returncode == 0, single.stderr[-3000:]
    assert losses(reference[0]) == pytest.approx(losses(single), abs=1e-6)


def test_the_root_module_returns_no_view_so_fsdp_does_not_warn(reference: tuple[Run, Path]) -> None:
    """FSDP2 warns on every forward whose root output is a view (an in-place op on it would
    skip the pre-backward hook); the transformer returns its logits as their own tensor."""
    assert "returned a view tensor" not in reference[0].stderr


# Plain SGD: AdamW divides each gradient by its own scale and would hide a wrong one.
ACCUM = ["--strategy", "fsdp", "--model", "transformer", "--dataset-size", "512", "--warmup-steps", "1",
         "--log-every", "1", "--max-steps", "4", "--pg-timeout-s", "60", "--optimizer", "sgd", "--lr", "0.5"]
ACCUM_LAYOUTS = {  # 16 samples per step: ranks x micro-batch x 2 accumulated micro-batches; (replicas, shards)
    "fsdp": (2, ["--micro-batch-size", "4"], (1, 2)),
    "hsdp": (4, ["--dp-replicate", "2", "--micro-batch-size", "2"], (2, 2)),
}


@pytest.fixture(scope="module")
def one_process_without_accumulation(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run = python_module([*ACCUM, "--micro-batch-size", "16", "--checkpoint-dir",
                         str(tmp_path_factory.mktemp("accum_one"))], timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.mark.parametrize("layout", list(ACCUM_LAYOUTS))
def test_accumulated_micro_batches_under_fsdp_and_hsdp_match_one_process(
        layout: str, one_process_without_accumulation: Run, tmp_path: Path) -> None:
    """FSDP2 (2 ranks) and HSDP (2 replicas x 2 shards) with 2 micro-batches accumulated:
    the reduce-scatter skipped on the first runs on the last, so each step trains on the
    whole global batch's gradient, as one process that takes it in one batch."""
    nproc, flags, (replicas, shards) = ACCUM_LAYOUTS[layout]
    run = train_ok([*ACCUM, *flags, "--grad-accum-steps", "2"], tmp_path, nproc=nproc)
    mesh = run.of("run_start")[0]["mesh"]
    assert (mesh["dp_replicate"], mesh["dp_shard"]) == (replicas, shards), mesh
    single = losses(one_process_without_accumulation)
    assert len(single) == 4 and single[-1] < single[0], "it learns, so a step that skipped its update shows"
    assert losses(run) == pytest.approx(single, abs=1e-6)


@pytest.mark.slow
def test_activation_checkpointing_leaves_the_math_unchanged(reference: tuple[Run, Path], tmp_path: Path) -> None:
    """Same losses with and without AC; that AC is really on is proven by the next test."""
    run = fsdp_run(tmp_path, "--activation-checkpointing")
    assert losses(run) == pytest.approx(losses(reference[0]), abs=1e-6)


AC_PROBE = ["--strategy", "fsdp", "--model", "transformer", "--dataset-size", "512", "--warmup-steps", "1",
            "--micro-batch-size", "4", "--grad-accum-steps", "2", "--max-steps", "2", "--n-layers", "3",
            "--pg-timeout-s", "60"]


def block_calls_on_each_rank() -> None:
    """Driver (rank code): train the FSDP2 transformer with the real loop, with and without
    --activation-checkpointing, and print one `block_calls` event per rank and step: the
    block indices called during the forward pass and, separately, after the root module
    returned (that is, recomputed during backward)."""
    from reference_impl.distributed import distributed
    from reference_impl.metrics import EventLog
    from reference_impl.train import TrainState, build_state, train

    base = TrainConfig.from_cli(sys.argv[1:])
    with distributed("cpu", base.pg_timeout_s) as ctx:
        log = EventLog(ctx.rank)
        for checkpointing in (False, True):
            cfg = dataclasses.replace(base, activation_checkpointing=checkpointing)
            state = build_state(cfg, ctx)
            calls: dict[str, list[int]] = {"forward": [], "recomputed": []}
            phase = ["forward"]

            def count(index: int) -> None:
                calls[phase[0]].append(index)

            for i, block in enumerate(state.model.blocks):
                block.register_forward_pre_hook(lambda *_, i=i: count(i))
            state.model.register_forward_pre_hook(lambda *_: phase.__setitem__(0, "forward"))
            state.model.register_forward_hook(lambda *_: phase.__setitem__(0, "recomputed"))

            def report(s: TrainState) -> None:
                log.emit("block_calls", step=s.step, activation_checkpointing=checkpointing,
                         forward=list(calls["forward"]), recomputed=list(calls["recomputed"]))
                calls["forward"].clear()
                calls["recomputed"].clear()

            train(cfg, ctx, log, state=state, on_step=report)


def test_activation_checkpointing_recomputes_every_block_during_backward() -> None:
    """--activation-checkpointing reaches the FSDP2-wrapped model: on every rank and step,
    each block runs once per micro-batch in the forward pass and once more, in reverse
    order, during backward (its activations were not kept). Without the flag, no block
    runs during backward. A wrapper that dropped the flag would pass the loss test above."""
    run = forked_ranks(AC_PROBE, nproc=2, timeout=120, module=str(Path(__file__)))  # this file's __main__
    assert run.returncode == 0, run.stderr[-4000:]
    events = run.of("block_calls")
    n_layers, micro_batches = 3, 2
    forward = list(range(n_layers)) * micro_batches
    recomputed = list(reversed(range(n_layers))) * micro_batches
    for checkpointing in (False, True):
        seen = sorted((e["rank"], e["step"]) for e in events if e["activation_checkpointing"] is checkpointing)
        assert seen == [(r, s) for r in (0, 1) for s in (1, 2)], "every rank reported every step"
    for e in events:
        assert e["forward"] == forward, e
        assert e["recomputed"] == (recomputed if e["activation_checkpointing"] else []), e


@pytest.mark.slow
def test_sigkill_and_resume_under_fsdp_is_bit_exact(reference: tuple[Run, Path], tmp_path: Path) -> None:
    run = fsdp_run(tmp_path, "--fail-at-step", "15", "--fail-rank", "1", restarts=1)
    assert [e["step"] for e in run.of("checkpoint_restored")] == [10]
    assert run.digest() == reference[0].digest()


def restored_digest(ckpt: Path, tmp: Path, *flags: str, step: int = 10) -> str:
    """Digest of the checkpoint of `step` in `ckpt`, restored by a 1-process run (no training)."""
    copy = tmp / f"copy{step}"
    copy.mkdir(parents=True)
    name = f"step-{step:08d}"
    shutil.copytree(ckpt / name, copy / name)  # a symlinked step is refused
    run = python_module([*FSDP, *ONE, "--max-steps", str(step), "--allow-config-change", "max_steps",
                         "--checkpoint-dir", str(copy), *flags], timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.of("checkpoint_restored")[0]["step"] == step
    return run.digest()


@pytest.mark.slow
def test_an_async_checkpoint_loads_to_the_same_tensors_as_a_sync_one(
        reference: tuple[Run, Path], tmp_path: Path) -> None:
    run = fsdp_run(tmp_path / "async", "--async-checkpoint")
    saved = run.of("checkpoint_saved")
    assert [e["step"] for e in saved] == [10, 20] and all("blocked_s" in e for e in saved)
    assert run.digest() == reference[0].digest()
    # The second save reuses the first one's staging buffers: it must hold step 20, not 10.
    for step in (10, 20):
        assert (restored_digest(tmp_path / "async", tmp_path / "a", step=step)
                == restored_digest(reference[1], tmp_path / "s", step=step)), step


@pytest.mark.slow
def test_a_kill_during_an_async_save_never_publishes_a_torn_checkpoint(
        reference: tuple[Run, Path], tmp_path: Path) -> None:
    run = fsdp_run(tmp_path, "--async-checkpoint", "--fail-mode", "crash-before-publish",
                   "--fail-at-step", "20", "--fail-rank", "0", restarts=1)
    assert [e["step"] for e in run.of("checkpoint_restored")] == [10]
    assert run.of("checkpoint_skipped") == []
    assert run.digest() == reference[0].digest()


@pytest.mark.slow
def test_a_full_disk_on_one_rank_fails_an_async_save_everywhere_and_keeps_the_last_checkpoint(
        tmp_path: Path) -> None:
    """The end of an async save (small files, agreement, publish) runs on the saver's
    thread; rank 1's failed write there must still fail the save on both ranks, cleanly."""
    run = forked_ranks([*FSDP, *TWO, "--max-steps", "20", "--checkpoint-dir", str(tmp_path), "--async-checkpoint",
                        "--fail-mode", "write-error", "--fail-at-step", "20", "--fail-rank", "1"], timeout=180)
    assert run.returncode != 0
    error = run.of("error")[0]  # rank 0's event: it learns of rank 1's failure
    assert error["error"] == "CheckpointError" and "step 20" in error["message"], error
    assert "another rank failed to write its part" in error["message"], error
    assert [p.name for p in published(tmp_path)] == ["step-00000010"]
    verify(tmp_path / "step-00000010")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-step-")], "no debris is left"


def test_a_two_rank_checkpoint_restores_on_one_rank_with_equal_state(
        reference: tuple[Run, Path], tmp_path: Path) -> None:
    under_torchrun = torchrun([*FSDP, *ONE, "--max-steps", "20", "--checkpoint-dir", str(reference[1])],
                              nproc=1, timeout=120)
    plain = python_module([*FSDP, *ONE, "--max-steps", "20", "--checkpoint-dir", str(reference[1])], timeout=120)
    for run in (under_torchrun, plain):
        assert run.of("checkpoint_restored")[0]["step"] == 20
        assert run.digest() == reference[0].digest(), "parameters and Adam state equal bit for bit"


@pytest.mark.slow
def test_every_sample_is_trained_exactly_once_across_a_two_to_one_change(tmp_path: Path) -> None:
    log = tmp_path / "samples"
    fsdp_run(tmp_path / "ckpt", "--sample-log", str(log), steps=10)
    run = python_module([*FSDP, *ONE, "--max-steps", "20", "--allow-config-change", "max_steps",
                         "--checkpoint-dir", str(tmp_path / "ckpt"), "--sample-log", str(log)], timeout=120)
    assert run.of("checkpoint_restored")[0]["step"] == 10
    by_step = trained_by_step(log)
    assert sorted(by_step) == list(range(1, 21))
    trained = [i for step in sorted(by_step) for i in by_step[step]]
    assert len(trained) == len(set(trained)) == 20 * 16, "no sample twice, none skipped"
    perm = ResumableDistributedSampler(512, world_size=1, rank=0, global_batch_size=16).epoch_permutation()
    assert sorted(trained) == sorted(perm[:320].tolist()), "the first 20 global batches of the epoch"


def test_export_writes_a_consolidated_weights_only_file(reference: tuple[Run, Path], tmp_path: Path) -> None:
    out = tmp_path / "model.pt"
    source = export(reference[1], out)
    assert source.name == "step-00000020"
    payload = torch.load(out, weights_only=True)
    fields = {k: v for k, v in payload["resume_fields"].items() if k != "global_batch_size"}
    model = build_model(TrainConfig(**fields))
    model.load_state_dict(payload["model"])  # strict: every key, full shapes
    assert all(not hasattr(t, "placements") for t in payload["model"].values()), "plain tensors, no DTensor"


if __name__ == "__main__":
    from reference_impl.distributed import exit_process

    block_calls_on_each_rank()
    exit_process(0)  # see exit_process: an FSDP run's group must not be freed at shutdown


def test_an_accumulating_micro_batch_reduce_scatters_nothing(tmp_path: Path) -> None:
    """`gradient_sync` as `train_step` enters it, on a 2-rank FSDP2 model: after the first
    micro-batch's backward no sharded parameter holds a gradient (FSDP2 kept the unsharded
    one and sent nothing); after the last, every one holds the mean over the ranks of both
    micro-batches' gradients. A sync that stayed on would pass the loss comparison above,
    paying one reduce-scatter per micro-batch; one that never came on would not."""
    run_ranks(fsdp_sync_worker.accumulate, (2, free_port(), str(tmp_path)), timeout=90)
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert not any(seen["after_accumulating"]), f"rank {rank} reduce-scattered an accumulating micro-batch"
        assert all(seen["after_last"]) and seen["max_error"] < 1e-5, seen

"""The interleaved 1F1B schedule (`--pp-schedule interleaved-1f1b`): each rank holds V stages.

With P ranks and V stages each, the blocks are cut into V x P stages and rank r holds
stages r, r+P, ...; the schedule runs them all, and the rank's module registers them under
the whole model's names. Two ranks with two stages each train the same steps as one process,
resume a SIGKILL bit for bit, hand their checkpoint on to one process, and idle less per
step than 1F1B at the same number of micro-batches.
"""

from __future__ import annotations

import json
import shutil
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from launch import Run, free_port, python_module, run_ranks, train_ok
from reference_impl.config import TrainConfig
from reference_impl.model import InterleavedStages, build_model, stage_layers, transformer_stage
from reference_impl.parallel.pipeline import measure_bubble
from sample_logs import losses

# 4 blocks over 2 ranks x 2 stages (one block each); 8 samples per micro-batch in 4 pipeline
# micro-batches, 2 micro-batches accumulated; clipping on every step, as in test_pipeline.py.
BASE = ["--model", "transformer", "--n-layers", "4", "--dataset-size", "512", "--warmup-steps", "2",
        "--log-every", "1", "--grad-clip", "0.05", "--pg-timeout-s", "60", "--micro-batch-size", "8",
        "--grad-accum-steps", "2", "--checkpoint-every", "6", "--max-steps", "12"]
INTERLEAVED = [*BASE, "--pp-degree", "2", "--pp-microbatches", "4", "--pp-schedule", "interleaved-1f1b",
               "--pp-virtual-stages", "2"]
TOL = 1e-5  # the tolerance of tests/distributed/test_pipeline.py
CFG = TrainConfig(model="transformer", n_layers=8, d_model=32, n_heads=4, hidden_dim=64, seq_len=16,
                  vocab_size=32, dataset_size=256, micro_batch_size=8, pp_schedule="interleaved-1f1b",
                  pp_virtual_stages=2)


def test_rank_r_holds_stages_r_and_r_plus_p_under_the_whole_models_names() -> None:
    """pp=2, V=2 over 8 blocks: rank 0 holds stages 0 and 2 (blocks 0-1, 4-5) with the
    embeddings, rank 1 stages 1 and 3 (blocks 2-3, 6-7) with the head; together they hold
    every parameter once, under the name it has in the whole model."""
    model = build_model(CFG)
    ranks = [transformer_stage(model, CFG, 2, r) for r in range(2)]
    assert all(isinstance(rank, InterleavedStages) for rank in ranks)
    assert [list(rank.blocks) for rank in ranks] == [["0", "1", "4", "5"], ["2", "3", "6", "7"]]
    assert [[list(chunk.blocks) for chunk in rank.chunks] for rank in ranks] == [
        [[str(i) for i in stage_layers(8, 4, s)] for s in (r, r + 2)] for r in range(2)]
    assert ranks[0].embed is model.embed and ranks[0].head is None
    assert ranks[1].head is model.head and ranks[1].embed is None
    owned = [id(p) for rank in ranks for p in rank.parameters()]
    assert sorted(owned) == sorted(id(p) for p in model.parameters()), "each parameter in exactly one rank"
    assert sorted(name for rank in ranks for name in rank.state_dict()) == sorted(model.state_dict())


def test_the_stages_in_pipeline_order_compute_the_whole_model() -> None:
    """Stage 0 (rank 0), 1 (rank 1), 2 (rank 0), 3 (rank 1): the path the schedule sends each
    micro-batch along gives the whole model's output, and `train()` reaches every stage."""
    model = build_model(CFG)
    ranks = [transformer_stage(model, CFG, 2, r) for r in range(2)]
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    x = tokens
    for chunk in (ranks[0].chunks[0], ranks[1].chunks[0], ranks[0].chunks[1], ranks[1].chunks[1]):
        x = chunk(x)
    assert torch.equal(x, model(tokens))
    ranks[0].eval()
    assert not any(chunk.training for chunk in ranks[0].chunks)


def test_a_bad_interleaving_is_one_line_and_exit_2() -> None:
    """6 blocks do not cut into 2 x 2 equal stages: the trainer says so in one line and exits
    2 before any process group forms."""
    run = python_module([*INTERLEAVED, "--n-layers", "6", "--checkpoint-dir", "unused"], env={"WORLD_SIZE": "2"})
    assert run.returncode == 2, run.stderr[-2000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "n_layers (6) must be a multiple of pp_degree x pp_virtual_stages (4)" in lines[0]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Path]:
    """An uninterrupted interleaved run on 2 ranks x 2 stages, 12 steps (checkpoints at 6 and 12)."""
    root = tmp_path_factory.mktemp("interleaved_reference")
    return train_ok(INTERLEAVED, root / "ckpt"), root / "ckpt"


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The same 12 steps in one process."""
    run = python_module([*BASE, "--checkpoint-dir", str(tmp_path_factory.mktemp("interleaved_single"))],
                        timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.mark.distributed
def test_two_ranks_of_two_stages_match_one_process(reference: tuple[Run, Path], single: Run) -> None:
    assert reference[0].of("run_start")[0]["mesh"]["pp"] == 2
    assert len(losses(reference[0])) == 12
    assert losses(reference[0]) == pytest.approx(losses(single), abs=TOL)
    assert losses(single)[-1] < losses(single)[0], "and it learns"


@pytest.mark.distributed
@pytest.mark.slow
def test_sigkill_under_interleaving_resumes_bit_exactly(reference: tuple[Run, Path], tmp_path: Path) -> None:
    """Every stage of both ranks saves and restores: the resumed run ends on the
    uninterrupted run's digest, which covers all four stages."""
    run = train_ok(INTERLEAVED, tmp_path, "--fail-at-step", "9", "--fail-rank", "1", restarts=1)
    assert [e["step"] for e in run.of("checkpoint_restored")] == [6]
    assert run.digest() == reference[0].digest()


@pytest.mark.distributed
def test_an_interleaved_checkpoint_restores_in_one_process(reference: tuple[Run, Path], tmp_path: Path) -> None:
    """The step-6 checkpoint of the four stages resumes in one process, which repeats the
    pipeline's last six losses: DCP found every block under its whole-model name."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copytree(reference[1] / "step-00000006", ckpt / "step-00000006")
    one = python_module([*BASE, "--checkpoint-dir", str(ckpt)], timeout=120)
    assert one.returncode == 0, one.stderr[-3000:]
    assert one.of("checkpoint_restored")[0]["step"] == 6
    assert losses(one) == pytest.approx(losses(reference[0])[6:], abs=TOL)


# Sleeps long beside the schedule's own overhead (a few ms per action on a quiet CPU, tens at a
# load of 9 on two cores, twice as many actions under interleaving): at 20 ms and 40 ms the
# overhead hid the gain, and at 100 ms and 200 ms a load of 9 put interleaving's idle share at
# 0.177 against the formula's 0.111 (0.14 at 200 ms and 400 ms and a load of 7).
FORWARD_S, BACKWARD_S, MICROBATCHES, ROUNDS = 0.3, 0.6, 4, 2
BUBBLE_TOL = 0.05  # idle share above the formula that point-to-point latency may add


def bubbles(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """A rank of a real gloo pipeline measuring 1F1B's and interleaved 1F1B's idle shares."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        cases = [measure_bubble(kind, MICROBATCHES, FORWARD_S, BACKWARD_S, rounds=ROUNDS)
                 for kind in ("1f1b", "interleaved-1f1b")]
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(cases))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # about 25 s, nearly all of it the stages' sleeps
@pytest.mark.distributed
def test_interleaving_idles_less_than_1f1b_as_the_formula_says(tmp_path: Path) -> None:
    """Stages that sleep known times, 2 ranks, M = 4: interleaved 1F1B (V = 2) idles less than
    1F1B, and close to (P-1)/(V x M+P-1) = 1/9 (1F1B's formula: 1/5). A rank's work per step is
    the same under both; interleaving only cuts it into V stages."""
    run_ranks(bubbles, (2, free_port(), str(tmp_path)), timeout=120)
    one_f_one_b, interleaved = json.loads((tmp_path / "rank0.json").read_text())
    assert interleaved["virtual_stages"] == 2 and interleaved["busy_s"] == one_f_one_b["busy_s"]
    assert interleaved["formula_idle"] == round(1 / 9, 4) and one_f_one_b["formula_idle"] == 0.2
    assert interleaved["measured_idle"] < one_f_one_b["measured_idle"]
    formula = interleaved["formula_idle"]
    assert formula - 0.01 <= interleaved["measured_idle"] <= formula + BUBBLE_TOL

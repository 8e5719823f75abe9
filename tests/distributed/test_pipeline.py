"""Pipeline parallelism in the trainer (`--pp-degree`), under real torchrun on gloo.

The stages of one pipeline read the same samples and each steps only its own blocks, so
two stages on two ranks train the same global batch as one process: the same losses up to
rounding, under GPipe and 1F1B, with gradient accumulation and clipping active.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from launch import Run, free_port, python_module, run_ranks, train_ok
from reference_impl.config import TrainConfig
from reference_impl.export import export
from reference_impl.model import Stage, build_model, stage_layers
from reference_impl.state import _update, full_state, merge_stages, state_digest
from sample_logs import assert_trained_once_in_order, losses, rank_log

# 3 blocks over 2 stages (2 + 1); 8 samples per micro-batch in 4 pipeline micro-batches, 2
# micro-batches accumulated; a clipping threshold low enough to clip every step.
BASE = ["--model", "transformer", "--n-layers", "3", "--dataset-size", "512", "--warmup-steps", "2",
        "--log-every", "1", "--grad-clip", "0.05", "--pg-timeout-s", "60"]
COMMON = [*BASE, "--micro-batch-size", "8", "--grad-accum-steps", "2"]
PP2 = [*COMMON, "--pp-degree", "2", "--pp-microbatches", "4", "--checkpoint-every", "6", "--max-steps", "12"]
ONE = [*COMMON, "--checkpoint-every", "6", "--max-steps", "12"]  # the same global batch of 16
TOL = 1e-5
CFG = TrainConfig(model="transformer", n_layers=4, d_model=32, n_heads=4, hidden_dim=64, seq_len=16,
                  vocab_size=32, dataset_size=256, micro_batch_size=8)


@pytest.mark.parametrize("n_layers,pp_degree", [(4, 2), (5, 2), (7, 3), (4, 4), (3, 1)])
def test_stages_cover_every_block_once_in_order(n_layers: int, pp_degree: int) -> None:
    blocks = [i for s in range(pp_degree) for i in stage_layers(n_layers, pp_degree, s)]
    sizes = [len(stage_layers(n_layers, pp_degree, s)) for s in range(pp_degree)]
    assert blocks == list(range(n_layers)) and max(sizes) - min(sizes) <= 1


def test_the_stages_partition_the_parameters_under_the_whole_models_names() -> None:
    model = build_model(CFG)
    stages = [Stage(model, s, 3) for s in range(3)]
    owned = [id(p) for stage in stages for p in stage.parameters()]
    assert sorted(owned) == sorted(id(p) for p in model.parameters()), "each parameter in exactly one stage"
    names = [name for stage in stages for name in stage.state_dict()]
    assert names == list(model.state_dict()), "a stage's names are the whole model's, in its order"


def test_one_stage_is_the_whole_model() -> None:
    model = build_model(CFG)
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    assert torch.equal(Stage(model, 0, 1)(tokens), model(tokens))


def test_a_bf16_stage_computes_what_the_autocast_model_does() -> None:
    model = build_model(CFG)
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(tokens)
    got = Stage(model, 0, 1, autocast_dtype=torch.bfloat16)(tokens)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)


def test_the_stages_states_merge_into_the_whole_models() -> None:
    """What `state_digest` hashes under pipeline parallel: the stages' model and optimizer
    states, merged, are the whole model's (names, values, param-group order)."""
    model = build_model(CFG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    model(tokens).sum().backward()
    optimizer.step()
    parts = []
    for s in range(2):
        stage = Stage(model, s, 2)  # the same Parameter objects, so the same Adam state
        stage_optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-2)
        for p in stage.parameters():
            stage_optimizer.state[p] = optimizer.state[p]
        parts.append(get_state_dict(stage, stage_optimizer, options=StateDictOptions(full_state_dict=True)))
    whole, merged = hashlib.sha256(), hashlib.sha256()
    for h, (model_sd, optim_sd) in ((whole, full_state(model, optimizer)), (merged, merge_stages(parts))):
        _update(h, "model", model_sd)
        _update(h, "optim", optim_sd)
    assert merged.hexdigest() == whole.hexdigest()


def stage_digests(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """A rank of a real gloo pipeline holding its stage of one seeded, once-stepped model:
    `state_digest` of its stage over the pipeline group, and (rank 0) of the whole model in
    one piece, before and after the last stage's head weight changes. Writes rank<r>.json."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        model = build_model(CFG)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))).sum().backward()
        optimizer.step()
        stage = Stage(model, rank, world_size)  # the same Parameter objects, so the same Adam state
        stage_optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-2)
        for p in stage.parameters():
            stage_optimizer.state[p] = optimizer.state[p]
        digests = {}
        for when in ("before", "after"):
            if when == "after":
                with torch.no_grad():
                    model.head.weight[0, 0] += 1.0  # held by the last stage alone
            digests[when] = state_digest(stage, stage_optimizer, dist.group.WORLD)
            # The whole model without a pipeline group (the full state is rank 0's).
            digests[f"whole_{when}"] = state_digest(model, optimizer)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(digests))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_the_digest_under_pipeline_parallel_covers_every_stage(tmp_path: Path) -> None:
    """On every rank of two stages, the digest is the whole model's (computed in one piece,
    without the pipeline), and a change to one weight of the last stage alone changes it on
    the first stage's rank too. A digest of each rank's own stage would compare two runs'
    first stages only."""
    run_ranks(stage_digests, (2, free_port(), str(tmp_path)), timeout=90)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for when in ("before", "after"):
        assert ranks[0][when] == ranks[1][when] == ranks[0][f"whole_{when}"], when
    assert ranks[0]["after"] != ranks[0]["before"], "the last stage's weight is part of rank 0's digest"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Path, Path]:
    """An uninterrupted 1F1B run on 2 stages, 12 steps (checkpoints at 6 and 12), with its sample log."""
    root = tmp_path_factory.mktemp("pp_reference")
    run = train_ok(PP2, root / "ckpt", "--sample-log", str(root / "samples"))
    return run, root / "ckpt", root / "samples"


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The same 12 steps in one process."""
    run = python_module([*ONE, "--checkpoint-dir", str(tmp_path_factory.mktemp("pp_single"))], timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.mark.distributed
def test_two_stages_under_1f1b_match_one_process(reference: tuple[Run, Path, Path], single: Run) -> None:
    assert reference[0].of("run_start")[0]["mesh"] == {"pp": 2, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1,
                                                       "ep": 1}
    assert len(losses(reference[0])) == 12
    assert losses(reference[0]) == pytest.approx(losses(single), abs=TOL)
    assert losses(single)[-1] < losses(single)[0], "and it learns"


@pytest.mark.distributed
def test_two_stages_under_gpipe_match_one_process(single: Run, tmp_path: Path) -> None:
    run = train_ok(PP2, tmp_path, "--pp-schedule", "gpipe")
    assert losses(run) == pytest.approx(losses(single), abs=TOL)


@pytest.mark.distributed
def test_the_stages_of_one_pipeline_read_the_same_samples(reference: tuple[Run, Path, Path]) -> None:
    rank0, rank1 = rank_log(reference[2], 0), rank_log(reference[2], 1)
    assert sorted(rank0) == list(range(1, 13))
    assert rank0 == rank1, "the first stage's tokens and the last stage's targets come from the same samples"
    assert all(len(indices) == 16 for indices in rank0.values()), "each reads the whole global batch"


@pytest.mark.distributed
@pytest.mark.slow
def test_sigkill_under_pp_resumes_bit_exactly(reference: tuple[Run, Path, Path], tmp_path: Path) -> None:
    run = train_ok(PP2, tmp_path, "--fail-at-step", "9", "--fail-rank", "1", restarts=1)
    assert [e["step"] for e in run.of("checkpoint_restored")] == [6]
    assert run.digest() == reference[0].digest()


@pytest.mark.distributed
def test_a_pp_checkpoint_restores_on_one_rank_with_exactly_once_data(
        reference: tuple[Run, Path, Path], tmp_path: Path) -> None:
    """Resume the two stages' step-6 checkpoint in one process: DCP finds every block under
    its whole-model name, the next 6 steps repeat the pipeline's losses, and the 12 steps
    trained every sample of the first 12 global batches exactly once."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "samples"
    ckpt.mkdir()
    shutil.copytree(reference[1] / "step-00000006", ckpt / "step-00000006")
    shutil.copytree(reference[2], log)
    one = python_module([*ONE, "--checkpoint-dir", str(ckpt), "--sample-log", str(log)], timeout=120)
    assert one.returncode == 0, one.stderr[-3000:]
    assert one.of("checkpoint_restored")[0]["step"] == 6
    assert losses(one) == pytest.approx(losses(reference[0])[6:], abs=TOL)
    assert_trained_once_in_order(log, [0], steps=12, global_batch=16, dataset_size=512)  # rank 1: the other stage
    assert sorted(rank_log(log, 1)) == list(range(1, 7)), "the departed rank's replayed steps were cut"


@pytest.mark.distributed
def test_a_pp_checkpoint_exports_to_one_whole_model(reference: tuple[Run, Path, Path], tmp_path: Path) -> None:
    """`python -m reference_impl.export` merges the stages' DCP files into one state dict
    that loads, strictly, into the whole model."""
    source = export(reference[1], tmp_path / "model.pt")
    assert source.name == "step-00000012"
    model = build_model(TrainConfig.from_cli(ONE[:-4]))
    model.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True)["model"], strict=True)


PP_FSDP = [*BASE, "--micro-batch-size", "4", "--grad-accum-steps", "2", "--pp-degree", "2",
           "--pp-microbatches", "2", "--strategy", "fsdp", "--max-steps", "8"]
# 2 pipelines x 2 data-parallel ranks x 4 samples x 2 micro-batches: 16, as in ONE


@pytest.mark.distributed
@pytest.mark.slow
def test_pipelines_of_fsdp_stages_on_a_two_by_two_mesh(tmp_path: Path) -> None:
    """pp=2 x dp_shard=2 (4 ranks): each stage sharded by FSDP2 over its data-parallel pair;
    the losses of one process within 1e-5, stages of a pipeline share samples and the two
    pipelines read disjoint ones. (A SIGKILL under pipeline parallel and under FSDP2 is
    each tested on two ranks, where it costs a third of the time.)"""
    run = train_ok(PP_FSDP, tmp_path / "ckpt", "--sample-log", str(tmp_path / "samples"), nproc=4)
    assert run.of("run_start")[0]["mesh"] == {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1, "ep": 1}
    one_flags = [*COMMON, "--max-steps", "8", "--checkpoint-dir", str(tmp_path / "one")]
    one = python_module(one_flags, timeout=120)
    assert one.returncode == 0, one.stderr[-3000:]
    assert losses(run) == pytest.approx(losses(one), abs=TOL)
    logs = [rank_log(tmp_path / "samples", r) for r in range(4)]
    assert logs[0] == logs[2] and logs[1] == logs[3], "ranks r and r+2 are one pipeline's two stages"
    assert all(not set(logs[0][s]) & set(logs[1][s]) and len(logs[0][s]) == 8 for s in logs[0])

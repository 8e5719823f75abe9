"""Ring attention (`reference_impl.parallel.context_parallel`) against full causal attention.

The distributed tests start real gloo process groups of 2 and 4 ranks; every rank checks
its rows of the output and of dq, dk, dv against full attention computed in one process,
with contiguous and with load-balanced chunks. The pure functions (the log-sum-exp merge,
the causal block counts, the bytes on the wire) are checked in this process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import cp_worker
from launch import free_port, python_module, run_ranks, train_ok
from reference_impl.parallel.context_parallel import (
    block_attention,
    idle_share,
    merge_partials,
    parallelize,
    ring_bytes_per_layer,
    score_blocks_per_step,
    shard_sequence,
)
from reference_impl.model import TinyTransformer
from sample_logs import losses, rank_log

# Relative to the largest entry of the float64 reference: float64 leaves only a different
# summation order; float32 with scores of ±100 (a near-one-hot softmax) loses digits of dq
# to cancellation, and a missing max-subtraction gives inf and NaN, which fail any bound.
TOL = {torch.float64: 1e-12, torch.float32: 1e-3}
TRAIN = ["--model", "transformer", "--dataset-size", "512", "--warmup-steps", "2", "--log-every", "1",
         "--pg-timeout-s", "60", "--max-steps", "10", "--micro-batch-size", "16"]


def _ring_results(world_size: int, tmp_path: Path) -> list[dict[str, dict[str, float]]]:
    run_ranks(cp_worker.compare_with_full_attention, (world_size, free_port(), str(tmp_path)),
          nprocs=world_size, timeout=120)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]


def _assert_equal_to_full_attention(world_size: int, tmp_path: Path) -> None:
    model_dim = cp_worker.HEADS * cp_worker.HEAD_DIM
    volume = ring_bytes_per_layer(cp_worker.BATCH, 2 * world_size * cp_worker.CHUNK, model_dim, world_size,
                                  bytes_per_element=1)
    for rank, cases in enumerate(_ring_results(world_size, tmp_path)):
        assert set(cases) == set(cp_worker.CASES)
        for case, result in cases.items():
            dtype = cp_worker.CASES[case][2]
            for name in ("out", "dq", "dk", "dv"):
                assert result[name] < TOL[dtype], f"rank {rank}, {case}: {name} differs by {result[name]:.2e}"
            size = dtype.itemsize
            assert result["forward_bytes"] == size * volume["forward"], (rank, case)
            assert result["total_bytes"] == size * (volume["forward"] + volume["backward"]), (rank, case)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_ring_attention_forward_and_backward_on_two_ranks_in_float64(tmp_path: Path) -> None:
    """The quick loop's ring-attention check: one float64 case (load-balanced chunks) on two
    ranks, whose forward merges two key chunks per query chunk by log-sum-exp and whose
    backward rebuilds the softmax from the merged log-sum-exp. Out, dq, dk and dv equal full
    attention within 1e-12; a wrong merge, or a wrong log-sum-exp handed to the backward,
    is off by far more."""
    run_ranks(cp_worker.compare_with_full_attention, (2, free_port(), str(tmp_path), ("load_balanced",)),
              timeout=90)
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())["load_balanced"]
        for name in ("out", "dq", "dk", "dv"):
            assert result[name] < TOL[torch.float64], f"rank {rank}: {name} differs by {result[name]:.2e}"


@pytest.mark.distributed
@pytest.mark.slow  # 13-21 s for 2 ranks, 23-36 s for 4, on the loaded 2-core machine
@pytest.mark.timeout(180)
def test_ring_attention_on_two_ranks_equals_full_attention(tmp_path: Path) -> None:
    """Outputs and dq, dk, dv of every rank's tokens equal one process's full attention
    (within 1e-12 in float64), with contiguous and with load-balanced chunks, and within 1e-3
    in float32 with scores of ±100; the bytes sent are `ring_bytes_per_layer`'s."""
    _assert_equal_to_full_attention(2, tmp_path)


@pytest.mark.distributed
@pytest.mark.slow  # 13-21 s for 2 ranks, 23-36 s for 4, on the loaded 2-core machine
@pytest.mark.timeout(180)
def test_ring_attention_on_four_ranks_equals_full_attention(tmp_path: Path) -> None:
    """As on two ranks, with four: keys arrive from three other ranks, some from later in
    the sequence (skipped by the causal mask) and some from earlier."""
    _assert_equal_to_full_attention(4, tmp_path)


@pytest.mark.distributed
@pytest.mark.slow  # like the two-rank attention test
@pytest.mark.timeout(180)
def test_transformer_on_two_context_parallel_ranks_equals_one_process(tmp_path: Path) -> None:
    """The reference transformer with ring attention (`parallelize`), and with Ulysses
    attention, on each rank's tokens and positions: the mean of the ranks' losses, and of
    their gradients for every parameter, equal one process's over the whole sequence within
    1e-12 (float64)."""
    run_ranks(cp_worker.compare_transformer_with_one_process, (2, free_port(), str(tmp_path)), timeout=120)
    for rank in range(2):
        results = json.loads((tmp_path / f"model{rank}.json").read_text())
        assert set(results) == set(cp_worker.MODEL_CASES)
        for case, result in results.items():
            assert result["parameters"] == 30, "every parameter: 12 per block, embed, pos, norm and head"
            assert result["loss"] < 1e-12 and result["grad"] < 1e-12, (rank, case, result)


def test_context_parallel_refuses_dropout() -> None:
    model = TinyTransformer(vocab_size=8, seq_len=8, d_model=8, n_layers=1, n_heads=2, hidden_dim=8,
                            dropout=0.1)
    with pytest.raises(ValueError, match="dropout 0"):
        parallelize(model, None)


def test_merging_chunks_with_log_sum_exp_equals_attention_over_all_keys() -> None:
    """Attention of a late query chunk over the three chunks up to it, merged chunk by chunk,
    equals full causal attention for those queries, also when scores reach ±100."""
    gen = torch.Generator().manual_seed(1)
    for sharpness in (1.0, 100.0):
        q, k, v = (torch.randn(1, 2, 12, 8, generator=gen) for _ in range(3))
        q = q * sharpness
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)[..., 8:, :]
        out, lse = torch.zeros(1, 2, 4, 8), torch.full((1, 2, 4), float("-inf"))
        for chunk in range(3):
            keys = slice(4 * chunk, 4 * chunk + 4)
            block = block_attention(q[..., 8:, :], k[..., keys, :], v[..., keys, :], diagonal=chunk == 2)
            out, lse = merge_partials(out, lse, *block)
        assert (out - want).abs().max() < 1e-5, sharpness


def test_shard_sequence_gives_every_token_to_exactly_one_rank() -> None:
    tokens = torch.arange(16).unsqueeze(0)
    for balanced in (False, True):
        held = torch.cat([shard_sequence(tokens, r, 4, balanced) for r in range(4)], dim=1)
        assert sorted(held.flatten().tolist()) == list(range(16))
    assert shard_sequence(tokens, 0, 4, True).flatten().tolist() == [0, 1, 14, 15]
    assert shard_sequence(tokens, 0, 4, False).flatten().tolist() == [0, 1, 2, 3]


def test_load_balancing_gives_every_rank_the_same_blocks_at_every_step() -> None:
    """Contiguous chunks: rank r computes 3 + 4r causal blocks, the last rank 4W - 1, and the
    others idle for the rest (80 % for rank 0 at W = 4); balanced chunks: 3 blocks at the
    first step and 2 at every other for every rank, no idle time, and the ring takes
    2W + 1 block-times instead of 4W - 1."""
    for world_size in (2, 4, 8):
        contiguous = score_blocks_per_step(world_size, load_balanced=False)
        balanced = score_blocks_per_step(world_size, load_balanced=True)
        total = world_size * (2 * world_size + 1)  # (2W)(2W+1)/2 causal chunk pairs
        assert sum(map(sum, contiguous)) == sum(map(sum, balanced)) == total
        assert [sum(col) for col in zip(*contiguous, strict=True)] == [3 + 4 * r for r in range(world_size)]
        assert balanced == [[3] * world_size] + [[2] * world_size] * (world_size - 1)
        assert sum(max(step) for step in contiguous) == 4 * world_size - 1
        assert sum(max(step) for step in balanced) == 2 * world_size + 1
        assert idle_share(world_size, load_balanced=True) == [0.0] * world_size
    assert idle_share(4, load_balanced=False) == pytest.approx([12 / 15, 8 / 15, 4 / 15, 0.0])


def test_ring_bytes_per_layer_by_hand() -> None:
    """Llama-8B-like layer (d_model 4096), 128k tokens on 8 ranks, bf16: each rank's K and V
    chunk is 2 x 16384 x 4096 x 2 B = 256 MiB; forward sends it 7 times, backward 15."""
    volume = ring_bytes_per_layer(1, 131072, 4096, 8, bytes_per_element=2)
    assert volume == {"forward": 7 * 2 ** 28, "backward": 15 * 2 ** 28}


@pytest.mark.distributed
@pytest.mark.slow  # three trainer runs
@pytest.mark.timeout(400)
def test_the_trainer_with_cp_degree_2_matches_one_process(tmp_path: Path) -> None:
    """`--cp-degree 2` on 2 ranks (ring attention, DDP over the two cp ranks): the losses of
    one process on the same global batch within 1e-5, and both ranks read the same samples;
    a SIGKILL at step 7 resumes from step 5 to the uninterrupted run's state bit for bit."""
    cp = [*TRAIN, "--cp-degree", "2", "--checkpoint-every", "5"]
    run = train_ok(cp, tmp_path / "cp", "--sample-log", str(tmp_path / "samples"))
    assert run.of("run_start")[0]["mesh"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 2, "tp": 1, "ep": 1}
    single = python_module([*TRAIN, "--checkpoint-dir", str(tmp_path / "one")], timeout=120)
    assert single.returncode == 0, single.stderr[-3000:]
    assert len(losses(run)) == 10
    assert losses(run) == pytest.approx(losses(single), abs=1e-5)
    assert rank_log(tmp_path / "samples", 0) == rank_log(tmp_path / "samples", 1)
    killed = train_ok(cp, tmp_path / "killed", "--fail-at-step", "7", "--fail-rank", "1", restarts=1)
    assert [e["step"] for e in killed.of("checkpoint_restored")] == [5]
    assert killed.digest() == run.digest()


@pytest.mark.distributed
@pytest.mark.slow  # a 4-rank job
@pytest.mark.timeout(400)
def test_fsdp_over_two_data_shards_and_two_cp_ranks_matches_one_process(tmp_path: Path) -> None:
    """`--strategy fsdp --cp-degree 2` on 4 ranks: FSDP2 shards over all four (the two data
    shards and their two cp ranks, one flat axis) and the losses are one process's within
    1e-5; the ranks of a cp pair read the same samples, the two pairs disjoint ones."""
    flags = ["--strategy", "fsdp", *TRAIN[:-2]]
    run = train_ok([*flags, "--cp-degree", "2", "--micro-batch-size", "8"], tmp_path / "cp",
                   "--sample-log", str(tmp_path / "samples"), nproc=4)
    assert run.of("run_start")[0]["mesh"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 1, "ep": 1}
    single = python_module([*flags, "--micro-batch-size", "16", "--checkpoint-dir", str(tmp_path / "one")],
                           timeout=120)
    assert single.returncode == 0, single.stderr[-3000:]
    assert losses(run) == pytest.approx(losses(single), abs=1e-5)
    logs = [rank_log(tmp_path / "samples", r) for r in range(4)]
    assert logs[0] == logs[1] and logs[2] == logs[3]
    assert all(not set(logs[0][s]) & set(logs[2][s]) and len(logs[0][s]) == 8 for s in logs[0])

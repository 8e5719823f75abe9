"""Ulysses attention (`reference_impl.parallel.ulysses`) against full causal attention and one process.

The distributed tests start real gloo process groups of 2 and 4 ranks: every rank checks
its rows of the output and of dq, dk, dv against full attention computed in one process,
and counts the bytes it hands to the all-to-all; the trainer with `--cp-style ulysses`
trains to one process's losses and resumes bit for bit after a SIGKILL.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import cp_worker
from launch import free_port, python_module, run_ranks, train_ok
from reference_impl.config import TrainConfig
from reference_impl.parallel.context_parallel import ring_attention
from reference_impl.model import TinyTransformer
from reference_impl.parallel.registry import chosen
from reference_impl.parallel.ulysses import sequence_order, ulysses_attention, ulysses_bytes_per_layer
from sample_logs import losses
from test_context_parallel import TOL, TRAIN


def _assert_equal_to_full_attention(world_size: int, tmp_path: Path) -> None:
    run_ranks(cp_worker.compare_ulysses_with_full_attention, (world_size, free_port(), str(tmp_path)),
              nprocs=world_size, timeout=150)
    model_dim = cp_worker.ULYSSES_HEADS * cp_worker.HEAD_DIM
    volume = ulysses_bytes_per_layer(cp_worker.BATCH, 2 * world_size * cp_worker.CHUNK, model_dim, world_size,
                                     bytes_per_element=1)
    for rank in range(world_size):
        cases = json.loads((tmp_path / f"ulysses{rank}.json").read_text())
        assert set(cases) == set(cp_worker.CASES)
        for case, result in cases.items():
            dtype = cp_worker.CASES[case][2]
            for name in ("out", "dq", "dk", "dv"):
                assert result[name] < TOL[dtype], f"rank {rank}, {case}: {name} differs by {result[name]:.2e}"
            # Each all-to-all keeps 1/W of what it is handed at home and sends the rest.
            def leaving(handed: int, w: int = world_size) -> int:
                return handed * (w - 1) // w

            assert result["calls"] == 8, "q, k, v and the output, forward; their gradients, backward"
            assert leaving(result["forward_bytes"]) == dtype.itemsize * volume["forward"], (rank, case)
            assert leaving(result["total_bytes"]) == dtype.itemsize * (volume["forward"] + volume["backward"])


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_ulysses_attention_on_two_ranks_equals_full_attention(tmp_path: Path) -> None:
    """Out, dq, dk and dv of every rank's tokens equal one process's full causal attention
    within 1e-12 in float64 (contiguous and load-balanced chunks) and within 1e-3 in float32
    with scores of ±100; eight all-to-alls carry `ulysses_bytes_per_layer`'s bytes."""
    _assert_equal_to_full_attention(2, tmp_path)


@pytest.mark.distributed
@pytest.mark.slow  # a 4-rank job
@pytest.mark.timeout(180)
def test_ulysses_attention_on_four_ranks_equals_full_attention(tmp_path: Path) -> None:
    """As on two ranks, with four: each rank attends with one of four heads over all 32 tokens."""
    _assert_equal_to_full_attention(4, tmp_path)


def test_sequence_order_puts_the_gathered_chunks_in_sequence_order() -> None:
    """Rank after rank, the load-balanced chunks of 2 ranks arrive as 0, 3, 1, 2; the order
    puts them back as 0, 1, 2, 3, and its inverse undoes it. Contiguous chunks already are."""
    gathered = torch.tensor([0, 3, 1, 2])
    order = sequence_order(2, load_balanced=True)
    assert gathered[order].tolist() == [0, 1, 2, 3]
    assert gathered[order][order.argsort()].tolist() == gathered.tolist()
    assert sequence_order(4, load_balanced=False).tolist() == list(range(8))


class _GroupOnly:
    """What a context-parallel wrap reads of its mesh: the group (None: the default one)."""

    def get_group(self) -> None:
        return None


def test_cp_style_picks_the_attention_of_every_block() -> None:
    """`--cp-style` chooses the registry entry that gives every block its attention."""
    for style, attention in (("ring", ring_attention), ("ulysses", ulysses_attention)):
        cfg = TrainConfig(model="transformer", cp_degree=2, cp_style=style, world_size=2)  # type: ignore[arg-type]
        model = TinyTransformer(vocab_size=8, seq_len=8, d_model=8, n_layers=2, n_heads=2, hidden_dim=8, dropout=0.0)
        [entry] = [p for p in chosen(cfg) if p.axis == "cp"]
        entry.wrap(model, _GroupOnly(), cfg)  # type: ignore[arg-type]
        assert [block.attention.func for block in model.blocks] == [attention, attention], style


def test_ulysses_bytes_per_layer_by_hand() -> None:
    """Llama-8B-like layer (d_model 4096), 128k tokens on 8 ranks, bf16: q, k, v and the output
    of a rank's 16384 tokens are 128 MiB each, 7/8 of which leave the rank: 4 x 112 MiB forward,
    as much backward; ring attention sends 7 x 256 MiB forward."""
    volume = ulysses_bytes_per_layer(1, 131072, 4096, 8, bytes_per_element=2)
    assert volume == {"forward": 4 * 7 * 2 ** 24, "backward": 4 * 7 * 2 ** 24}


@pytest.mark.distributed
@pytest.mark.slow  # three trainer runs
@pytest.mark.timeout(400)
def test_the_trainer_with_ulysses_on_two_cp_ranks_matches_one_process(tmp_path: Path) -> None:
    """`--cp-style ulysses --cp-degree 2` on 2 ranks: the losses of one process on the same
    global batch within 1e-5 (as for ring attention); a SIGKILL at step 7 resumes from step 5
    to the uninterrupted run's state bit for bit."""
    cp = [*TRAIN, "--cp-degree", "2", "--cp-style", "ulysses", "--checkpoint-every", "5"]
    run = train_ok(cp, tmp_path / "cp")
    assert run.of("run_start")[0]["mesh"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 2, "tp": 1, "ep": 1}
    single = python_module([*TRAIN, "--checkpoint-dir", str(tmp_path / "one")], timeout=120)
    assert single.returncode == 0, single.stderr[-3000:]
    assert len(losses(run)) == 10
    assert losses(run) == pytest.approx(losses(single), abs=1e-5)
    killed = train_ok(cp, tmp_path / "killed", "--fail-at-step", "7", "--fail-rank", "1", restarts=1)
    assert [e["step"] for e in killed.of("checkpoint_restored")] == [5]
    assert killed.digest() == run.digest()

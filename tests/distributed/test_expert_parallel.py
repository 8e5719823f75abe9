"""Expert parallel on 2 and 4 real gloo ranks against one process that holds every expert.

Each rank routes its own 16 tokens and holds its slice of the experts; dispatch and combine
are `all_to_all_single` calls with split sizes exchanged first. One process holding every
expert runs the same block on each rank's tokens in turn (a rank's tokens are its own
routing group: capacity is counted per rank, as each rank drops before it sends). Both
must give the same outputs, auxiliary losses, dropped counts and gradients, in float64 to
1e-12, and the bytes the ranks hand to `all_to_all_single` must be `calc.moe_all_to_all`'s.

The trainer's `--n-experts 4 --ep-degree 2` on two ranks (one expert-parallel group) and on
four (two groups, so every expert has two replicas) reads a different sample of each global
batch on every rank and trains as one process holding every expert on that global batch
(micro-batches accumulated, one per data rank), drops over capacity included; the two-rank run
resumes after a SIGKILL to the uninterrupted run's state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from experts_worker import CASES, HIDDEN, TOKENS, balance, ep_rank, full_block, inputs
from launch import Run, free_port, python_module, run_ranks, train_ok
from sample_logs import losses, rank_log

from reference_impl import calc

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

TOL = 1e-12
# Plain SGD: AdamW divides each gradient by its own scale, which would hide a wrong one.
# Two experts, top-2: every token goes to both, so no expert is ever over capacity and the
# losses do not depend on how the global batch is cut into routing groups (a data rank takes
# every world_size-th sample of it, one process's micro-batches consecutive runs of it).
TRAIN = ["--model", "transformer", "--n-experts", "4", "--optimizer", "sgd", "--lr", "0.5", "--dataset-size",
         "512", "--warmup-steps", "2", "--log-every", "1", "--pg-timeout-s", "60", "--max-steps", "10"]
EP = [*TRAIN, "--ep-degree", "2", "--checkpoint-every", "5"]
# World size: micro-batch size per rank. One sample per rank, so that a rank routes the
# tokens of the same sample that one process's micro-batch holds (capacity is per batch).
LAYOUTS = {2: 1, 4: 1}


def _ranks(world_size: int, root: Path) -> list[dict[str, Any]]:
    run_ranks(ep_rank, (world_size, free_port(), str(root)), nprocs=world_size, timeout=120)
    return [torch.load(root / f"rank{r}.pt") for r in range(world_size)]


# Starting the ranks dominates: on two shared cores 4 ranks took 20-45 s, 2 ranks 10 s (up to 30 s under heavy load).
@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=["ep2", "ep4"])
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> tuple[int, list[dict[str, Any]]]:
    """What every rank of an expert-parallel run of every case saved (2 or 4 ranks)."""
    world_size = request.param
    return world_size, _ranks(world_size, tmp_path_factory.mktemp(f"ep{world_size}"))


def _one_process(case: str, world_size: int) -> tuple[Any, list[tuple[torch.Tensor, ...]]]:
    """The whole block in one process, run on each rank's tokens as its own group; the
    gradients are those of the sum of the ranks' losses."""
    full = full_block(case, world_size)
    if CASES[case][3]:
        balance(full)
    per_rank = []
    for rank in range(world_size):
        x, target = inputs(case, world_size, rank)
        out, aux_loss, dropped = full(x)
        ((out * target).sum() + aux_loss).backward()
        per_rank.append((out.detach(), aux_loss.detach(), dropped, x.grad))
    return full, per_rank


@pytest.mark.parametrize("case", sorted(CASES))
def test_expert_parallel_equals_one_process_holding_every_expert(
        ranks: tuple[int, list[dict[str, Any]]], case: str) -> None:
    world_size, saved = ranks
    full, expected = _one_process(case, world_size)
    local = full.w1.shape[0] // world_size
    for rank, (out, aux_loss, dropped, x_grad) in enumerate(expected):
        got = saved[rank][case]
        torch.testing.assert_close(got["out"], out, rtol=0, atol=TOL)
        torch.testing.assert_close(got["aux_loss"], aux_loss, rtol=0, atol=TOL)
        assert got["dropped"] == dropped
        torch.testing.assert_close(got["x"], x_grad, rtol=0, atol=TOL)
        torch.testing.assert_close(got["router"], full.router.weight.grad, rtol=0, atol=TOL)
        mine = slice(rank * local, (rank + 1) * local)
        torch.testing.assert_close(got["w1"], full.w1.grad[mine], rtol=0, atol=TOL)
        torch.testing.assert_close(got["w2"], full.w2.grad[mine], rtol=0, atol=TOL)
    drops = sum(d for _, _, d, _ in expected)
    assert (drops > 0) == case.endswith("_drops"), f"{case}: {drops} assignments dropped"


@pytest.mark.parametrize("case", sorted(c for c in CASES if c.endswith("_drops")))
def test_dropped_tokens_never_travel(ranks: tuple[int, list[dict[str, Any]]], case: str) -> None:
    """Capacity is applied before dispatch: the rows a rank hands to dispatch (and, in
    backward, their gradients from combine) are exactly its kept assignments; the rows its
    experts process and send back in combine (and their gradients in backward) are what the
    others sent it, so over all ranks no more rows move than were kept."""
    world_size, saved = ranks
    row, kept_total, processed_total = HIDDEN * 8, 0, 0
    for rank in range(world_size):
        got = saved[rank][case]
        dispatch, combine, combine_back, dispatch_back = (c["buffer"] for c in got["calls"][1:])
        kept = TOKENS * CASES[case][1] - got["dropped"]
        assert dispatch == combine_back == kept * row
        assert combine == dispatch_back
        kept_total, processed_total = kept_total + kept, processed_total + combine // row
    assert processed_total == kept_total


@pytest.mark.parametrize("case", sorted(c for c in CASES if c.endswith("_balanced")))
def test_all_to_all_bytes_equal_the_calculator(ranks: tuple[int, list[dict[str, Any]]], case: str) -> None:
    """With every expert equally loaded, each rank passes `all_to_all_single` exactly
    `calc.moe_all_to_all`'s bytes: four row all-to-alls of `buffer_bytes`, of which it sends
    and receives `bytes_sent_per_layer` in all; one all-to-all of counts comes before them."""
    world_size, saved = ranks
    expected = calc.moe_all_to_all(tokens=TOKENS, hidden=HIDDEN, top_k=CASES[case][1], ep_degree=world_size,
                                   bandwidth_bytes_per_s=1.0, activation_bytes=8)
    for rank in range(world_size):
        calls = saved[rank][case]["calls"]
        assert [c["dtype"] for c in calls] == ["torch.int64"] + ["torch.float64"] * 4  # counts, then rows
        rows = calls[1:]
        assert len(rows) == expected["all_to_alls_per_layer"]
        assert all(c["buffer"] == expected["buffer_bytes"] for c in rows)
        assert sum(c["sent"] for c in rows) == expected["bytes_sent_per_layer"]
        assert sum(c["received"] for c in rows) == expected["bytes_received_per_layer"]
        assert saved[rank][case]["dropped"] == 0


def test_replicated_gradients_are_averaged_by_one_all_reduce_per_synchronised_step(
        ranks: tuple[int, list[dict[str, Any]]]) -> None:
    """Expert parallel's gradient sync averages every parameter outside the experts (here 4
    of them, and the router) in one flat all-reduce after the backward of the micro-batch
    that synchronises, none on the one that only accumulates (as DDP's `no_sync`), not one
    collective per parameter; the replicas stay equal bit for bit."""
    _, saved = ranks
    syncs = [rank["gradient_sync"] for rank in saved]
    assert [s["all_reduces"] for s in syncs] == [1] * len(saved), "one synchronised micro-batch, one all-reduce"
    for s in syncs[1:]:
        assert s["replicated"].keys() == syncs[0]["replicated"].keys() and len(s["replicated"]) == 4
        for name, grad in s["replicated"].items():
            assert torch.equal(grad, syncs[0]["replicated"][name]), name
        assert torch.equal(s["router"], syncs[0]["router"])


def _trainer_run(world_size: int, root: Path) -> tuple[Run, Path]:
    """An uninterrupted `--ep-degree 2` run of 10 steps on `world_size` ranks (checkpoints at
    5 and 10), with its sample log."""
    args = [*EP, "--micro-batch-size", str(LAYOUTS[world_size])]
    return train_ok(args, root / "ckpt", "--sample-log", str(root / "samples"), nproc=world_size), root / "samples"


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Path]:
    """The two-rank run: one expert-parallel group of two data ranks."""
    return _trainer_run(2, tmp_path_factory.mktemp("ep_trainer"))


@pytest.mark.slow  # two trainer runs (the ranks' and one process): 22-48 s on the loaded 2-core machine
@pytest.mark.timeout(400)
@pytest.mark.parametrize("world_size", [2, 4], ids=["world2_ep2", "world4_ep2"])
def test_the_trainer_with_ep_degree_2_matches_one_process(ep_run: tuple[Run, Path], world_size: int,
                                                          tmp_path: Path) -> None:
    """`--n-experts 4 --ep-degree 2` (two experts per rank, all-to-all between the two ranks of
    a group; at world 4 two groups, each expert's gradient averaged over its two replicas):
    every rank reads its own samples, and the losses (load-balancing term included) are those
    of one process holding every expert on the same global batch (one micro-batch per data
    rank, accumulated) within 1e-5, with assignments dropped over capacity on the way."""
    run, samples = ep_run if world_size == 2 else _trainer_run(world_size, tmp_path / "ranks")
    assert run.of("run_start")[0]["mesh"] == {"pp": 1, "dp_replicate": world_size, "dp_shard": 1, "cp": 1, "tp": 1,
                                              "ep": 2}
    micro = str(LAYOUTS[world_size])
    single = python_module([*TRAIN, "--micro-batch-size", micro, "--grad-accum-steps", str(world_size),
                            "--checkpoint-dir", str(tmp_path / "one")], timeout=120)
    assert single.returncode == 0, single.stderr[-3000:]
    assert len(losses(run)) == 10
    assert losses(run) == pytest.approx(losses(single), abs=1e-5)
    logs = [rank_log(samples, r) for r in range(world_size)]
    for step in range(1, 11):
        trained = [index for log in logs for index in log[step]]
        assert len(set(trained)) == len(trained) == world_size, f"step {step}: two ranks trained the same samples"
    # The logged loss includes 0.01 x the load-balancing loss (each step event's `aux_loss` is
    # the last micro-batch's: rank 0's sample here, the last sample in the one process).
    assert sum(e["dropped_tokens"] for e in single.of("step")) > 0, "routing overflowed: the check covers drops"


@pytest.mark.slow  # a trainer run killed and restarted: 22-63 s
@pytest.mark.timeout(400)
def test_sigkill_under_expert_parallel_resumes_bit_exactly(ep_run: tuple[Run, Path], tmp_path: Path) -> None:
    """Rank 1 is killed before step 7; both ranks restart, each restores its own experts
    from step 5 (DTensor shards in DCP) and they end on the uninterrupted run's state bit
    for bit."""
    killed = train_ok([*EP, "--micro-batch-size", str(LAYOUTS[2])], tmp_path, "--fail-at-step", "7", "--fail-rank", "1",
                      restarts=1)
    assert [e["step"] for e in killed.of("checkpoint_restored")] == [5]
    assert killed.digest() == ep_run[0].digest()

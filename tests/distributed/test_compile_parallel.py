"""`--compile` under DDP and FSDP2 on two gloo ranks: the losses of the eager runs, the
same communication at the same points of the step, the wrappers' hooks outside the compiled
code, and checkpoints that move from compiled to eager.

One job (`compile_worker.py`) trains eager and compiled DDP, eager and compiled FSDP2, and an
eager FSDP2 run restored from the compiled run's checkpoint, on the same two ranks: one launch
for all of it, a compilation per compiled run. The ranks are forked with torchrun's environment
(`launch.forked_ranks`, held equal to torchrun by tests/distributed/test_forked_ranks.py), so
neither an agent nor the ranks import torch again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import launch
import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKER = str(Path(__file__).resolve().parent / "compile_worker.py")
STEPS = 4
REL = 1e-5  # as tests/test_compile.py: inductor fuses and reorders float math


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Both ranks' results of one compile_worker.py job."""
    out = tmp_path_factory.mktemp("compile_parallel")
    run = launch.forked_ranks([str(out)], nproc=2, timeout=240, module=WORKER)
    assert run.returncode == 0, run.stderr[-5000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def names(timeline: list[dict[str, Any]], prefix: str = "") -> list[str]:
    return [event["name"] for event in timeline if event["name"].startswith(prefix)]


def assert_compiled_like_eager(eager: dict[str, Any], compiled: dict[str, Any], rank: int) -> None:
    """Equal losses to rounding (rank 0 logs them, averaged over the ranks); on every rank,
    one graph for both blocks and one for the loss, with no graph break."""
    if rank == 0:
        assert len(compiled["losses"]) == STEPS
        assert compiled["losses"] == pytest.approx(eager["losses"], rel=REL)
    assert compiled["graph_breaks"] == 0
    assert compiled["unique_graphs"] == 2, "one graph, traced once, serves both blocks; the loss has its own"


def test_compiled_ddp_matches_eager_and_all_reduces_a_bucket_while_a_block_is_still_in_backward(
        ranks: list[dict[str, Any]]) -> None:
    for i, rank in enumerate(ranks):
        eager, compiled = rank["ddp"]["eager"], rank["ddp"]["compiled"]
        assert_compiled_like_eager(eager, compiled, i)
        # The block runs inside DDP's forward, so dynamo hands its graph to DDPOptimizer,
        # which would split a graph holding more than a bucket's parameters; a block holds less.
        assert compiled["ddp_optimizer_buckets"] == [1]
        # As many buckets as eager, every step; from step 2 on, two. (DDP rebuilds its buckets
        # in the order gradients arrive, so which parameters share one differs.)
        assert [b[:2] for b in compiled["buckets"]] == [b[:2] for b in eager["buckets"]]
        assert [b[:2] for b in compiled["buckets"] if b[0] == STEPS] == [[STEPS, 0], [STEPS, 1]]
        # The loss's compiled forward and backward come between the blocks'. Block 1's compiled
        # backward fills bucket 0 (the head and block 1), whose all-reduce starts before block
        # 0's compiled backward: communication overlaps the backward.
        assert names(compiled["timeline"]) == ["compiled forward", "compiled forward", "compiled forward",
                                               "compiled backward", "compiled backward", "ddp bucket 0",
                                               "compiled backward", "ddp bucket 1"]
        assert names(eager["timeline"]) == ["ddp bucket 0", "ddp bucket 1"]


def test_compiled_fsdp2_matches_eager_with_its_hooks_around_the_compiled_blocks(
        ranks: list[dict[str, Any]]) -> None:
    for i, rank in enumerate(ranks):
        eager, compiled = rank["fsdp"]["eager"], rank["fsdp"]["compiled"]
        assert_compiled_like_eager(eager, compiled, i)
        assert compiled["ddp_optimizer_buckets"] == []
        # FSDP2's all-gathers, reduce-scatters and their hooks: the same, in the same order,
        # and none of them inside compiled code.
        assert names(compiled["timeline"], "FSDP::") == names(eager["timeline"], "FSDP::")
        assert not [event for event in compiled["timeline"] if event["inside_compiled"]]
        # Each block's all-gather (pre-forward, pre-backward) before its compiled code runs,
        # its reshard (post-forward) and reduce-scatter (post-backward) after.
        hooks = ("FSDP::pre_forward (blocks", "FSDP::post_forward (blocks", "FSDP::pre_backward (blocks",
                 "FSDP::post_backward_reduce (blocks")
        around = [n for n in names(compiled["timeline"]) if n.startswith(("compiled", *hooks))]
        assert around == ["FSDP::pre_forward (blocks.0)", "compiled forward", "FSDP::post_forward (blocks.0)",
                          "FSDP::pre_forward (blocks.1)", "compiled forward", "FSDP::post_forward (blocks.1)",
                          "compiled forward", "compiled backward",  # the loss
                          "FSDP::pre_backward (blocks.1)", "compiled backward", "FSDP::post_backward_reduce (blocks.1)",
                          "FSDP::pre_backward (blocks.0)", "compiled backward", "FSDP::post_backward_reduce (blocks.0)"]


def test_a_checkpoint_written_compiled_under_fsdp2_restores_into_an_eager_run(
        ranks: list[dict[str, Any]]) -> None:
    assert [rank["fsdp"]["restored"]["step"] for rank in ranks] == [2, 2]
    # Rank 0 gathers the whole state for the digest, and logs the losses.
    compiled, restored = ranks[0]["fsdp"]["compiled"], ranks[0]["fsdp"]["restored"]
    assert restored["digest"] == compiled["digest"], "every weight, Adam moment and the schedule, bit for bit"
    assert len(restored["losses"]) == STEPS - 2
    assert restored["losses"] == pytest.approx(compiled["losses"][2:], rel=REL)

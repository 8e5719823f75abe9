"""The configuration search of reference_impl.calc.plan: the known facts of a 70B model on 64 H100s,
hand-computed terms, the directions every term must move in, and its input checks."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from reference_impl import calc
from reference_impl.calc.plan import Job, Plan, _bandwidth, best_per_mesh, evaluate, fsdp_hiding_tokens, search
from reference_impl.calc.shapes import LLAMA3_70B, llama_params

GB = 1e9
ROOT = Path(__file__).resolve().parents[1]
JOB = Job()
PLANS = search(JOB)
P = JOB.params  # Llama-3-70B: 70.55B


def _plan(mesh: str, micro_batch: int = 1, activation_checkpointing: bool = False, job: Job = JOB) -> Plan:
    r, s, t, p = (int(d) for d in mesh.split("x"))
    return evaluate(job, dp_replicate=r, dp_shard=s, tp=t, pp=p, micro_batch=micro_batch,
                    activation_checkpointing=activation_checkpointing)


def test_the_job_is_llama_3_70b_as_the_memory_grid_builds_it() -> None:
    assert JOB.shape == LLAMA3_70B
    assert (LLAMA3_70B.hidden, LLAMA3_70B.n_layers, LLAMA3_70B.n_heads, LLAMA3_70B.n_kv_heads,
            LLAMA3_70B.ffn_hidden, LLAMA3_70B.vocab_size) == (8192, 80, 64, 8, 28672, 128256)
    assert P == llama_params(LLAMA3_70B) == 70_553_706_496


def test_seventy_b_with_adamw_needs_1_13_tb_of_state_so_pure_ddp_cannot_fit() -> None:
    ddp = [q for q in PLANS if q.mesh == "64x1x1x1" and q.micro_batch <= 4]  # 8 x 64 > 256 sequences
    assert len(ddp) == 2 * 3
    assert all(q.rejected.startswith("needs ") and q.rejected.endswith("over 80 GB") for q in ddp)
    assert ddp[0].model_state_bytes == pytest.approx(16 * P)
    assert f"{16 * P / 1e12:.2f} TB" == "1.13 TB"


def test_sharding_within_one_node_cannot_hold_the_state() -> None:
    # 1.13 TB over the 8 GPUs of a node is 141 GB each: HSDP must shard over 2 nodes or more.
    in_node = [q for q in PLANS if q.pp == 1 and q.tp * q.dp_shard <= JOB.gpus_per_node
               and JOB.global_batch % (q.dp_replicate * q.dp_shard * q.micro_batch) == 0]
    assert in_node and all(q.rejected.startswith("needs ") for q in in_node)
    assert min(q.model_state_bytes for q in in_node) == pytest.approx(16 * P / 8)


def test_tensor_parallel_beyond_a_node_is_rejected() -> None:
    wide = [q for q in PLANS if q.tp > JOB.gpus_per_node]
    assert {q.tp for q in wide} == {16, 32, 64}
    assert all(q.rejected == f"TP {q.tp} does not fit in a node of 8 GPUs" for q in wide)


def test_pure_fsdp_fits_only_with_activation_checkpointing() -> None:
    fsdp = [q for q in PLANS if q.mesh == "1x64x1x1"]
    assert all(q.rejected for q in fsdp if not q.activation_checkpointing)
    assert any(not q.rejected for q in fsdp if q.activation_checkpointing)


def test_the_chosen_mesh_fits_keeps_tp_in_a_node_and_beats_pure_fsdp() -> None:
    best = PLANS[0]
    assert not best.rejected and best.memory_bytes <= 80 * GB
    assert best.tp <= JOB.gpus_per_node
    assert best.dp_replicate * best.dp_shard * best.tp * best.pp == 64
    assert all(q.step_time_s >= best.step_time_s for q in PLANS if not q.rejected)
    fsdp = next(q for q in PLANS if q.mesh == "1x64x1x1" and not q.rejected)
    assert best.step_time_s < fsdp.step_time_s


def test_pure_fsdp_memory_is_the_figure_certified_against_pytorchs_tracker() -> None:
    """Without TP or PP a plan's memory is the memory grid's `calc.memory` for Llama-3-70B
    on 64 FSDP2 ranks, which is within 1.2% of `FSDPMemTracker`'s measured peak."""
    grid = json.loads((ROOT / "docs" / "data" / "memory_grid.json").read_text(encoding="utf-8"))
    rows = {r["activation_checkpointing"]: r for r in grid["data"]["rows"]
            if r["shape"]["name"] == LLAMA3_70B.name and r["world_size"] == 64 and r.get("replicas", 1) == 1
            and r.get("tp", 1) == 1}
    for ac, row in rows.items():
        q = _plan("1x64x1x1", 1, ac)
        assert q.memory_bytes == pytest.approx(row["calculator"]["total_bytes"], rel=1e-12)
        assert abs(q.memory_bytes / row["tracker"]["Total"] - 1) < 0.012
    assert sorted(rows) == [False, True]
    assert [f"{_plan('1x64x1x1', 1, ac).memory_bytes / GB:.1f}" for ac in (False, True)] == ["166.2", "34.3"]
    assert [f"{rows[ac]['tracker']['Total'] / GB:.1f}" for ac in (False, True)] == ["166.7", "34.5"]


def test_model_state_of_tp8_fsdp8_by_hand() -> None:
    q = _plan("1x8x8x1")
    assert q.model_state_bytes == pytest.approx(P * 16 / 64)  # 17.6 GB: TP 8 x FSDP 8 share every byte


def test_fsdp_traffic_of_tp8_fsdp8_by_hand() -> None:
    q = _plan("1x8x8x1", micro_batch=4)
    microbatches = 256 // (8 * 4)
    per_microbatch = 3 * 7 / 8 * (P / 8) * 2 / 50e9  # 2 gathers + 1 reduce-scatter, bf16, across nodes
    assert q.microbatches == microbatches
    assert q.dp_comm_s == pytest.approx(microbatches * per_microbatch)  # 7.35 s


def test_fsdp_hides_under_compute_only_with_enough_tokens_per_micro_batch() -> None:
    # Per micro-batch FSDP moves 3 x 2 bytes per local parameter; compute is 6 FLOPs per local
    # parameter per token (plus attention). Traffic over compute = peak x efficiency / (bandwidth x tokens).
    attention_share = 6 * P / (6 * P + 12 * 80 * 8192 * 4096)
    for micro_batch in (1, 2, 4):
        q = _plan("1x8x8x1", micro_batch=micro_batch)
        ratio = 989e12 * 0.5 / (50e9 * 4096 * micro_batch) * 7 / 8 * attention_share
        assert q.dp_comm_s / q.compute_s == pytest.approx(ratio)
    assert 989e12 * 0.5 / 50e9 == pytest.approx(9890)  # tokens per micro-batch for traffic = compute


def test_the_trainers_default_grad_sync_hides_fsdp_from_fewer_tokens() -> None:
    """A reduce-scatter per micro-batch (6 bytes per parameter, what the search prices) hides
    above 9,890 tokens per micro-batch; the trainer's default `--fsdp-grad-sync last` leaves
    the two gathers (4 bytes) per micro-batch: 6,593 tokens."""
    from reference_impl.config import TrainConfig

    assert TrainConfig().fsdp_grad_sync == "last"
    assert f"{fsdp_hiding_tokens(JOB, 'every'):,.0f}" == "9,890"
    assert f"{fsdp_hiding_tokens(JOB, 'last'):,.0f}" == "6,593"
    assert fsdp_hiding_tokens(JOB) == fsdp_hiding_tokens(JOB, "every")
    with pytest.raises(ValueError, match=r"^grad_sync must be one of every, last, got 'first'$"):
        fsdp_hiding_tokens(JOB, "first")


def test_one_f_one_b_keeps_as_many_activations_as_the_unsplit_model() -> None:
    # p micro-batches in flight through L/p layers store what L layers of one store.
    piped, flat = _plan("1x1x8x8"), _plan("8x1x8x1")
    assert piped.microbatches >= 8 <= flat.microbatches
    assert piped.activation_bytes == pytest.approx(flat.activation_bytes)


def test_bubble_is_the_calculators_and_stretches_compute() -> None:
    q = _plan("1x2x8x4")
    assert q.bubble_fraction == pytest.approx(3 / (q.microbatches + 3))
    assert q.step_time_s >= (q.compute_s + q.tp_comm_s) / (1 - q.bubble_fraction) - 1e-12
    assert _plan("1x8x8x1").bubble_fraction == 0


@pytest.mark.parametrize("gpus_per_node", [1, 4, 8])
def test_a_group_is_inside_a_node_up_to_exactly_the_node_size(gpus_per_node: int) -> None:
    """A group spanning exactly one node's ranks uses the intra-node links; one rank more
    crosses to another node and gets the network's bandwidth."""
    job = dataclasses.replace(JOB, gpus_per_node=gpus_per_node)
    assert _bandwidth(job, 1) == _bandwidth(job, gpus_per_node) == JOB.intra_node_bandwidth
    assert _bandwidth(job, gpus_per_node + 1) == _bandwidth(job, 2 * gpus_per_node) == JOB.inter_node_bandwidth


def test_ten_times_the_gpus_send_the_same_bytes_over_slower_links() -> None:
    """An all-reduce over one node of 8 GPUs and over ten nodes: each GPU sends nearly the
    same bytes, but the ten-node group runs at the network's bandwidth, not the node's."""
    grads = P * 2
    one_node = calc.ring_allreduce(size_bytes=grads, world_size=8, bandwidth_bytes_per_s=_bandwidth(JOB, 8))
    ten_nodes = calc.ring_allreduce(size_bytes=grads, world_size=80, bandwidth_bytes_per_s=_bandwidth(JOB, 80))
    assert ten_nodes["bytes_per_rank"] / one_node["bytes_per_rank"] == pytest.approx((79 / 80) / (7 / 8))  # 1.13
    assert JOB.intra_node_bandwidth / JOB.inter_node_bandwidth == 8
    assert f"{ten_nodes['time_s'] / one_node['time_s']:.1f}" == "9.0"


def test_each_groups_bandwidth_follows_its_span_on_the_node_boundary() -> None:
    """In 1x8x8x1 the TP group spans 8 ranks (one node: 400 GB/s) and FSDP all 64 (the
    network: 50 GB/s). With nodes of 4 GPUs, FSDP over 2 x TP 2 fills one node exactly and
    stays on its links; FSDP over 2 x TP 4 spans two nodes; the replicas always cross."""
    q = _plan("1x8x8x1")
    tp_per_layer = 4 * 2 * 7 / 8 * 4096 * 8192 * 2  # four ring all-reduces of s x b x h in bf16
    assert q.tp_comm_s == pytest.approx(q.microbatches * 80 * tp_per_layer / 400e9)
    assert q.dp_comm_s == pytest.approx(q.microbatches * 3 * 7 / 8 * (P / 8) * 2 / 50e9)
    four = dataclasses.replace(JOB, gpus_per_node=4, n_gpus=16)
    full = _plan("4x2x2x1", job=four)
    fsdp_in_node = full.microbatches * 3 * 1 / 2 * (P / 2) * 2 / 400e9  # 2 gathers + 1 reduce-scatter
    replicas = 2 * 3 / 4 * (P / 2 / 2 * 2) / 50e9  # ring all-reduce of the shard's bf16 gradients
    assert full.dp_comm_s == pytest.approx(fsdp_in_node + replicas)
    assert full.tp_comm_s == pytest.approx(full.microbatches * 80 * 4 * 2 * 1 / 2 * 4096 * 8192 * 2 / 400e9)
    wide = _plan("2x2x4x1", job=four)
    fsdp_across = wide.microbatches * 3 * 1 / 2 * (P / 4) * 2 / 50e9
    assert wide.dp_comm_s == pytest.approx(fsdp_across + 2 * 1 / 2 * (P / 4 / 2 * 2) / 50e9)


def test_more_shards_less_memory_and_a_larger_micro_batch_more() -> None:
    by_shards = [_plan(f"{64 // (8 * s)}x{s}x8x1").memory_bytes for s in (1, 2, 4, 8)]
    assert by_shards == sorted(by_shards, reverse=True) and len(set(by_shards)) == 4
    by_batch = [_plan("1x8x8x1", micro_batch=b).memory_bytes for b in (1, 2, 4, 8)]
    assert by_batch == sorted(by_batch) and len(set(by_batch)) == 4


def test_checkpointing_trades_memory_for_a_third_more_compute_and_tp_traffic() -> None:
    off, on = _plan("1x8x8x1", 4, False), _plan("1x8x8x1", 4, True)
    assert on.memory_bytes < off.memory_bytes
    assert on.compute_s == pytest.approx(off.compute_s * 4 / 3)
    assert on.tp_comm_s == pytest.approx(off.tp_comm_s * 6 / 4)


def test_a_faster_network_never_slows_a_step_and_a_slow_one_exposes_fsdp() -> None:
    times = [_plan("1x64x1x1", 2, True, dataclasses.replace(JOB, inter_node_bandwidth=bw)).step_time_s
             for bw in (12.5e9, 25e9, 50e9, 100e9, 400e9)]
    assert times == sorted(times, reverse=True)
    slow = _plan("1x64x1x1", 2, True, dataclasses.replace(JOB, inter_node_bandwidth=12.5e9))
    assert slow.step_time_s == slow.dp_comm_s > slow.compute_s


def test_layers_and_batch_that_do_not_split_are_rejected() -> None:
    assert _plan("1x1x2x32").rejected == "80 layers do not split into 32 stages"
    assert _plan("1x64x1x1", micro_batch=8).rejected == "256 sequences do not split into micro-batches of 8 on 64 replicas"


def test_best_per_mesh_keeps_one_plan_per_mesh_in_order() -> None:
    best = best_per_mesh(PLANS)
    assert len({q.mesh for q in best}) == len(best) == len({q.mesh for q in PLANS})
    assert best[0] == PLANS[0]
    # A mesh that cannot run is shown by its smallest memory overrun, not a layout rejection.
    ddp = next(q for q in best if q.mesh == "64x1x1x1")
    assert ddp.rejected.startswith("needs ")


@pytest.mark.parametrize(("change", "message"), [
    ({"gpu_memory_bytes": 0}, "gpu_memory_bytes must be positive, got 0"),
    ({"seq_len": 2.5}, "seq_len must be a whole number >= 1, got 2.5"),
    ({"compute_efficiency": 1.5}, "compute_efficiency is a fraction and must not exceed 1, got 1.5"),
    ({"micro_batches": ()}, "micro_batches must name at least one micro-batch size"),
    ({"micro_batches": (1, 0)}, "micro_batches must be a whole number >= 1, got 0"),
])
def test_a_bad_job_is_refused_in_one_line(change: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        Job(**change)
    assert str(info.value) == message


def test_a_bad_mesh_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"^mesh 2x2x2x2 has 16 GPUs, the job has 64$"):
        _plan("2x2x2x2")
    with pytest.raises(ValueError, match=r"^tp must be a whole number >= 1, got 0$"):
        evaluate(JOB, dp_replicate=64, dp_shard=1, tp=0, pp=1, micro_batch=1, activation_checkpointing=False)
    with pytest.raises(ValueError, match=r"^activation_checkpointing must be true or false, got 'yes'$"):
        evaluate(JOB, dp_replicate=64, dp_shard=1, tp=1, pp=1, micro_batch=1, activation_checkpointing="yes")

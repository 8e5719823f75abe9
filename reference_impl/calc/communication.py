"""Bytes and time of the collectives each parallelism adds to a step."""

from __future__ import annotations

from reference_impl.calc.checks import count, flag, non_negative, positive


def ring_allreduce(*, size_bytes: float, world_size: int, bandwidth_bytes_per_s: float,
                   latency_s: float = 0.0) -> dict[str, float]:
    """Bytes and time of a ring all-reduce, the collective behind DDP's gradient sync.

    A reduce-scatter then an all-gather each move `(N - 1) / N x S` per rank, so every
    rank sends (and receives) `2 (N - 1) / N x S` bytes in `2 (N - 1)` steps. Time is
    `bytes / bandwidth + steps x latency`, assuming every rank sends at
    `bandwidth_bytes_per_s` at once and nothing else shares the links. The bus bandwidth
    is the algorithm bandwidth `S / time` times `2 (N - 1) / N`, the figure nccl-tests
    reports; with no latency it equals the link bandwidth.

    Args:
        size_bytes: Bytes reduced (for DDP: parameters x gradient bytes).
        world_size: Ranks N in the ring, at least 2.
        bandwidth_bytes_per_s: Bytes per second each rank sends.
        latency_s: Seconds per step of the ring (0 for the bandwidth term alone).

    Returns:
        `bytes_per_rank`, `steps`, `time_s`, `algorithm_bandwidth` and `bus_bandwidth`
        (bytes per second).

    Raises:
        ValueError: A non-positive size or bandwidth, a negative latency, or fewer than 2 ranks.
    """
    size = positive("size_bytes", size_bytes)
    n = count("world_size", world_size, 2)
    bandwidth = positive("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    latency = non_negative("latency_s", latency_s)
    factor = 2 * (n - 1) / n
    steps = 2 * (n - 1)
    time_s = factor * size / bandwidth + steps * latency
    return {"bytes_per_rank": factor * size, "steps": steps, "time_s": time_s,
            "algorithm_bandwidth": size / time_s, "bus_bandwidth": size / time_s * factor}


def fsdp_comm(*, params: float, world_size: int, bandwidth_bytes_per_s: float,
              param_bytes: float = 2, grad_bytes: float = 2,
              reshard_after_forward: bool = True) -> dict[str, float]:
    """Bytes each rank sends per step under FSDP (ZeRO-3), against DDP's all-reduce.

    FSDP all-gathers the parameters for forward and, when it frees them after forward
    (`reshard_after_forward`, the default), again for backward; then it reduce-scatters
    the gradients. Each of these moves `(N - 1) / N` of the full size per rank, so with
    equal dtypes FSDP sends 3 such transfers against DDP's 2 (the all-reduce): 1.5x DDP.
    Time assumes the transfers are not overlapped with compute.

    Args:
        params: Number of model parameters.
        world_size: Ranks N sharding the model, at least 2.
        bandwidth_bytes_per_s: Bytes per second each rank sends.
        param_bytes: Bytes per parameter gathered (2 for bf16 mixed precision).
        grad_bytes: Bytes per gradient element reduced (2 for bf16 reduction).
        reshard_after_forward: Free gathered parameters after forward (gather twice).

    Returns:
        Bytes per rank: `all_gather_bytes` (all gathers), `reduce_scatter_bytes`,
        `bytes_per_rank`, `ddp_bytes_per_rank` (a ring all-reduce of the gradients),
        `ratio_to_ddp`; and `time_s`.

    Raises:
        ValueError: A non-positive size or bandwidth, or fewer than 2 ranks.
    """
    p = positive("params", params)
    n = count("world_size", world_size, 2)
    bandwidth = positive("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    gather_bytes, reduce_bytes = positive("param_bytes", param_bytes), positive("grad_bytes", grad_bytes)
    gathers = 2 if flag("reshard_after_forward", reshard_after_forward) else 1
    share = (n - 1) / n
    all_gather = gathers * share * p * gather_bytes
    reduce_scatter = share * p * reduce_bytes
    total = all_gather + reduce_scatter
    ddp = 2 * share * p * reduce_bytes
    return {"all_gather_bytes": all_gather, "reduce_scatter_bytes": reduce_scatter,
            "bytes_per_rank": total, "ddp_bytes_per_rank": ddp, "ratio_to_ddp": total / ddp,
            "time_s": total / bandwidth}


def tp_comm(*, seq_len: int, micro_batch: int, hidden: int, n_layers: int, tp_degree: int,
            bandwidth_bytes_per_s: float, activation_bytes: float = 2) -> dict[str, float]:
    """Bytes each rank sends for Megatron-style tensor parallelism, per micro-batch.

    Each layer all-reduces its activations (`seq_len x micro_batch x hidden` elements)
    after attention and after the MLP in forward, and twice more in backward: 4 ring
    all-reduces over the `tp_degree` t ranks, each sending `2 (t - 1) / t` of its size.
    The volume scales with tokens, not parameters, and sits on the critical path; time
    assumes no overlap with compute.

    Args:
        seq_len: Tokens per sequence.
        micro_batch: Sequences per micro-batch.
        hidden: Hidden size of the model.
        n_layers: Transformer layers.
        tp_degree: Ranks t sharing each layer, at least 2.
        bandwidth_bytes_per_s: Bytes per second each rank sends (NVLink-class inside a node).
        activation_bytes: Bytes per activation element (2 for bf16).

    Returns:
        `allreduce_bytes` (the size of one all-reduce), `allreduces_per_layer`,
        `bytes_per_layer` and `bytes_per_microbatch` sent per rank, and `time_s`.

    Raises:
        ValueError: A non-positive size or bandwidth, or a TP degree below 2.
    """
    tokens = count("seq_len", seq_len) * count("micro_batch", micro_batch)
    h, layers = count("hidden", hidden), count("n_layers", n_layers)
    t = count("tp_degree", tp_degree, 2)
    bandwidth = positive("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    size = tokens * h * positive("activation_bytes", activation_bytes)
    per_layer = 4 * 2 * (t - 1) / t * size
    return {"allreduce_bytes": size, "allreduces_per_layer": 4, "bytes_per_layer": per_layer,
            "bytes_per_microbatch": layers * per_layer, "time_s": layers * per_layer / bandwidth}


def pp_comm(*, seq_len: int, micro_batch: int, hidden: int, stages: int, bandwidth_bytes_per_s: float,
            activation_bytes: float = 2) -> dict[str, float]:
    """Bytes a pipeline sends between its stages, per micro-batch (point to point).

    Each stage boundary carries the micro-batch's activations forward (`seq_len x
    micro_batch x hidden` elements, however many pipeline micro-batches they are cut into)
    and their gradient back, the same size. A stage inside the pipeline sends both; the
    first sends only activations and the last only gradients. The volume does not grow
    with the number of layers, which is why pipeline stages can sit on different nodes.

    Args:
        seq_len: Tokens per sequence.
        micro_batch: Sequences per micro-batch.
        hidden: Hidden size of the model.
        stages: Pipeline stages p, at least 2.
        bandwidth_bytes_per_s: Bytes per second each rank sends (often the network across nodes).
        activation_bytes: Bytes per activation element (2 for bf16).

    Returns:
        `boundary_bytes` (one direction across one boundary), `bytes_per_rank` (the most
        a stage sends), `total_bytes` (all boundaries, both directions) and `time_s` (the
        busiest stage's sends, not overlapped).

    Raises:
        ValueError: A non-positive size or bandwidth, or fewer than 2 stages.
    """
    tokens = count("seq_len", seq_len) * count("micro_batch", micro_batch)
    h, p = count("hidden", hidden), count("stages", stages, 2)
    bandwidth = positive("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    size = tokens * h * positive("activation_bytes", activation_bytes)
    per_rank = size * (2 if p > 2 else 1)
    return {"boundary_bytes": size, "bytes_per_rank": per_rank, "total_bytes": 2 * (p - 1) * size,
            "time_s": per_rank / bandwidth}



def moe_all_to_all(*, tokens: int, hidden: int, top_k: int, ep_degree: int, bandwidth_bytes_per_s: float,
                   activation_bytes: float = 2) -> dict[str, float]:
    """Bytes each rank sends and receives for the all-to-alls of one MoE layer under expert parallel.

    Each of a rank's `tokens` goes to `top_k` experts, so dispatch sends `tokens x top_k`
    rows of `hidden` elements and combine brings as many back; the backward runs the same
    two all-to-alls on the gradients: 4 per layer. With the load balanced over the
    `ep_degree` e ranks, a share `1 / e` of the rows goes to experts on the rank itself and
    never leaves it, so each rank sends (and receives) `(e - 1) / e` of the rows in each:
    `4 x tokens x top_k x hidden x activation_bytes x (e - 1) / e` per layer. Dropped
    tokens send less; an unbalanced router sends more from some ranks (at most all the
    rows) and so does a rank whose experts are popular. The exchange of the counts before
    dispatch (a few integers per expert) is left out. Time assumes no overlap with compute.

    Args:
        tokens: Tokens per rank entering the layer (sequence length x micro-batch).
        hidden: Hidden size of the model (the width of a row).
        top_k: Experts per token.
        ep_degree: Expert-parallel ranks e, at least 2.
        bandwidth_bytes_per_s: Bytes per second each rank sends (the all-to-all crosses nodes
            once `ep_degree` exceeds a node).
        activation_bytes: Bytes per activation element (2 for bf16).

    Returns:
        `buffer_bytes` (the rows one `all_to_all_single` takes in, the rank's own share
        included), `all_to_alls_per_layer` (4), `bytes_per_all_to_all` (sent to other
        ranks), `bytes_sent_per_layer`, `bytes_received_per_layer` and `time_s`.

    Raises:
        ValueError: A non-positive size or bandwidth, or an expert-parallel degree below 2.
    """
    rows = count("tokens", tokens) * count("top_k", top_k)
    h, e = count("hidden", hidden), count("ep_degree", ep_degree, 2)
    bandwidth = positive("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    buffer = rows * h * positive("activation_bytes", activation_bytes)
    per_call = buffer * (e - 1) / e
    return {"buffer_bytes": buffer, "all_to_alls_per_layer": 4, "bytes_per_all_to_all": per_call,
            "bytes_sent_per_layer": 4 * per_call, "bytes_received_per_layer": 4 * per_call,
            "time_s": 4 * per_call / bandwidth}

"""Back-of-the-envelope calculators for the interview, each the twin of a browser calculator.

Every function here has a JavaScript twin in `docs/javascripts/calculators.js`:
`reference_impl.calc.<name>(**inputs)` and `window.handbookCalc.<name>(inputs)` take the
same inputs, apply the same defaults, and return dicts with the same keys and (to 1e-9)
the same numbers; the browser tests compare them on hundreds of random inputs. Both
reject a bad input the same way: Python raises `ValueError`, JavaScript throws an `Error`
with the same message, which the page shows in place of the result.

Units are SI throughout: bytes (not GiB), seconds, bytes per second, FLOPs and FLOP/s.
The functions use only the standard library, so they run anywhere the handbook does.
"""

from __future__ import annotations

import math
from typing import Any

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
GRAD_SYNCS = ("last", "every")
# Pipeline schedule families with one bubble formula each (`pipeline_bubble`).
PIPELINE_SCHEDULES = ("1f1b", "zero_bubble", "zbv")
# Above this many MTBFs the failure model's exponentials overflow a double; such a job
# would practically never finish between failures anyway.
_MAX_COST_OVER_MTBF = 100.0


def _number(name: str, value: Any) -> float:
    # bool is an int in Python but not a number in JavaScript: reject it in both.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _positive(name: str, value: Any) -> float:
    if _number(name, value) <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return float(value)


def _non_negative(name: str, value: Any) -> float:
    if _number(name, value) < 0:
        raise ValueError(f"{name} must not be negative, got {value!r}")
    return float(value)


def _count(name: str, value: Any, minimum: int = 1) -> int:
    # A whole number given as a float (2.0) is accepted: JavaScript cannot tell them apart.
    if _number(name, value) != math.floor(value) or value < minimum:
        raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r}")
    return int(value)


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def memory(*, params: float, world_size: int, strategy: str, seq_len: int, micro_batch: int,
           hidden: int, n_heads: int, n_layers: int, activation_checkpointing: bool = False,
           stores_attention_scores: bool = False, param_bytes: float = 2, grad_bytes: float = 2,
           master_bytes: float = 4, optimizer_bytes: float = 8, ffn_hidden: int | None = None,
           gated_mlp: bool = False, n_kv_heads: int | None = None, vocab_size: int = 0,
           tp_degree: int = 1, pp_degree: int = 1, cp_degree: int = 1, sequence_parallel: bool = False,
           compute_bytes: float = 2, transients: bool = False, selective_recompute: bool = False,
           offload_optimizer: bool = False, grad_accum_steps: int = 1,
           fsdp_grad_sync: str = "last", compiled_loss: bool = False) -> dict[str, float]:
    """Memory per GPU for training with Adam: model state, sharded or not, plus activations.

    Model state is `params x (param_bytes + grad_bytes + master_bytes + optimizer_bytes)`,
    by default 2 + 2 + 4 + 8 = 16 bytes per parameter (bf16 weights and gradients, an fp32
    master copy, fp32 Adam first and second moments; Rajbhandari et al., *ZeRO*, 2020).
    PyTorch autocast keeps fp32 weights and gradients and no master copy: 4 + 4 + 0 + 8,
    also 16; FSDP2 with a bf16 `MixedPrecisionPolicy` keeps fp32 sharded weights and
    gradients, also 4 + 4 + 0 + 8. Sharding over `world_size` N divides by N:

    - `ddp`: nothing (every rank holds a full replica);
    - `zero1`: the master weights and the optimizer state;
    - `zero2`: those and the gradients;
    - `zero3` or `fsdp` (FSDP2 is ZeRO-3): everything.

    Tensor and pipeline parallelism divide the parameters a rank holds by
    `tp_degree x pp_degree` before that.

    Activations per transformer layer, `compute_bytes` (c) per element, T = `seq_len x
    micro_batch / cp_degree` tokens per rank, kv = `hidden x n_kv_heads / n_heads`, f =
    `ffn_hidden`:

    - a GPT block (`gated_mlp` off; Korthikanti et al., 2022, §4):
      `T x (c (6 hidden + 2 kv + 2 f) + 2 hidden)`, the last term the two dropout masks; with
      the defaults (c = 2, kv = hidden, f = 4 hidden) it is their `34 x T x hidden`;
    - a Llama block (`gated_mlp` on: RMSNorm, SwiGLU, no dropout), as PyTorch's autograd
      saves it: `T x (c (12 hidden + 2 kv + 4 f) + 4 n_heads + 8)`: the residual stream,
      the two RMSNorms' saved inputs and fp32 intermediates, q/k/v, the attention output and
      its contiguous copy, the three SwiGLU products, the attention's fp32 log-sum-exp and the
      norms' fp32 reciprocals.

    Both add `5 x n_heads x seq_len` bytes per token when `stores_attention_scores`
    (unfused attention keeps the scores; PyTorch's `scaled_dot_product_attention` does not).
    Tensor parallelism divides the parts inside the attention and the MLP by `tp_degree`;
    the hidden-sized tensors around them only with `sequence_parallel`. In the Llama block
    as PyTorch runs it (`parallelize_module`) one of the 12 hidden-sized tensors, the
    row-parallel output, is whole on every rank, so 10 sit around the parallel region; and
    sequence parallel keeps the all-gathered inputs of q/k/v, w1 and w3 (each its own copy,
    `3 c hidden` whole) where Megatron-LM gathers them again in backward. With full activation
    checkpointing every layer keeps only its input, `c x T x hidden`, and one layer's
    activations are live while it is recomputed. Under a pipeline the first stage holds
    `pp_degree` micro-batches of its `n_layers / pp_degree` layers (1F1B), as many as all
    layers of one micro-batch.

    Selective recompute (Korthikanti et al., §5) stores everything but the attention
    scores and recomputes them in backward: it removes the `5 x n_heads x seq_len` term
    (one layer's scores are live while recomputed) and changes nothing with fused
    attention, whose backward already recomputes the scores. Offloading the optimizer
    (ZeRO-Offload) moves the master copy and the optimizer state to host memory:
    `offloaded_bytes`, no longer counted per GPU.

    Gradient accumulation runs `grad_accum_steps` micro-batches per optimizer step. It
    does not change the activations (each micro-batch's are freed by its backward) or the
    model state; it multiplies the tokens per step. What it can change is the gradients:
    when the gradients are sharded (`zero2`, `zero3`, `fsdp`) and the reduce-scatter waits
    for the last micro-batch (`fsdp_grad_sync="last"`, FSDP2's
    `set_requires_gradient_sync(False)` and the trainer's default), every rank holds its
    gradients unsharded between micro-batches; `"every"` keeps them sharded and reduces
    on every micro-batch.

    With `transients` off (the default) the answer is that steady state: model state plus
    stored activations. With it on, `total_bytes` is the per-rank peak of a training step
    as PyTorch's `FSDPMemTracker` measures it, the largest of these moments:

    - the loss: every layer's activations, the unsharded root (embedding and output
      projection, `2 x vocab_size x hidden`, kept gathered through the step), the fp32
      log-softmax of the logits stored, and two fp32 logits-sized gradients (three under
      tensor parallel's `loss_parallel`, which keeps its sharded logits); a compiled loss
      (`compiled_loss`, the trainer's `--compile`; not applied to `loss_parallel`) fuses the upcast,
      log-softmax and their backward, so it keeps the logits at `compute_bytes` and writes
      their gradient at `compute_bytes`, 2c bytes per logit where eager holds 12;
    - the final norm's backward: the output projection's bf16 gradient and six fp32
      hidden-sized tensors (whole on every tensor-parallel rank without sequence parallel);
    - (`zero3`/`fsdp`) inside the SwiGLU backward of a block: the root and that block
      gathered (`unsharded_params_bytes`), the next block's all-gather buffer
      (`all_gather_bytes`), the block above's fp32 gradients on their way to the
      reduce-scatter (`reduce_scatter_bytes`), the sharded gradients of the blocks done,
      the block's activations (recomputed under checkpointing) less the product already
      consumed, and the gradients of four f-sized activations;
    - (`zero3`/`fsdp`) the end of a block's backward: its bf16 gradients (the attention's
      counted twice by the tracker) and their fp32 copy for the reduce-scatter.

    Each is taken at the blocks where it is largest (the first and last two to run
    backward), with the prefetch the tracker shows: none below block 0 and none in the
    first block to run backward, except inside its SwiGLU without recompute. On the
    certified grid (`python -m reference_impl.memory_grid`) the peak is within 5% of the
    tracker's, tensor parallel (with and without sequence parallel) inside FSDP2 included,
    against PyTorch's `MemTracker`; not modelled: tensor parallel of 4 or more without
    sequence parallel under recompute, where the peak moves into a block's RMSNorm backward
    (its fp32 tensors whole on every rank; 10% low on the reduced case). The pipeline and
    context-parallel terms are Megatron-LM's accounting, not certified. Not counted: the
    allocator's fragmentation and its cached free blocks, which depend on the order of
    allocations and on the allocator, not on sizes (PyTorch's `expandable_segments` makes
    them small).

    Args:
        params: Number of model parameters.
        world_size: Data-parallel ranks N that shard the state (ignored by `ddp`; under HSDP
            the shard group, not the replicas).
        strategy: One of `ddp`, `zero1`, `zero2`, `zero3`, `fsdp`.
        seq_len: Tokens per sequence.
        micro_batch: Sequences per micro-batch on one GPU.
        hidden: Hidden size of the model; a multiple of `n_heads`.
        n_heads: Attention heads per layer.
        n_layers: Transformer layers.
        activation_checkpointing: Recompute each layer in backward (keep only its input).
        stores_attention_scores: Count the `n_heads x seq_len^2` attention scores (unfused attention).
        param_bytes: Bytes per parameter of the weights the optimizer updates.
        grad_bytes: Bytes per parameter of the gradients (and of FSDP's reduce-scatter).
        master_bytes: Bytes per parameter of a separate master copy (0 when there is none).
        optimizer_bytes: Bytes per parameter of optimizer state (Adam's two fp32 moments: 8).
        ffn_hidden: Width of the MLP; `None` for `4 x hidden`.
        gated_mlp: A Llama block (SwiGLU's three matrices, RMSNorm, no dropout).
        n_kv_heads: Key/value heads (grouped-query attention); `None` for `n_heads`.
        vocab_size: Vocabulary of the untied embedding and output projection; 0 leaves both,
            and the logits, out.
        tp_degree: Tensor-parallel ranks; divides `n_heads` and `n_kv_heads`.
        pp_degree: Pipeline stages; divides `n_layers`.
        cp_degree: Context-parallel ranks; divides `seq_len`.
        sequence_parallel: Shard the hidden-sized activations over the tensor-parallel ranks too.
        compute_bytes: Bytes per element of gathered weights and of activations (bf16: 2).
        transients: Count what lives only at the step's peak (see above).
        selective_recompute: Recompute only the attention scores (excludes
            `activation_checkpointing`).
        offload_optimizer: Keep the master copy and the optimizer state in host memory.
        grad_accum_steps: Micro-batches per optimizer step.
        fsdp_grad_sync: With accumulation and sharded gradients, reduce-scatter on the
            `"last"` micro-batch only (unsharded gradients held) or on `"every"` one.
        compiled_loss: The cross-entropy is compiled (fused): it holds the logits and their
            gradient at `compute_bytes` instead of fp32 copies (with `transients`; not
            applied above `tp_degree` 1, where the peak certified is `loss_parallel`'s, eager).

    Returns:
        Bytes per GPU: `params_bytes`, `grads_bytes`, `master_bytes`, `optimizer_bytes`,
        their sum `model_state_bytes`, `activation_bytes_per_layer` (without
        checkpointing), `activation_bytes` (as configured; at the peak with `transients`)
        and `total_bytes`; and the tracker's categories at the peak:
        `sharded_params_bytes`, `sharded_grads_bytes`, `optimizer_state_bytes`,
        `unsharded_params_bytes`, `all_gather_bytes`, `reduce_scatter_bytes`,
        `temporary_bytes` and `input_bytes` (the token ids); `offloaded_bytes` in host
        memory per rank.

    Raises:
        ValueError: A non-positive size, an unknown strategy, or sizes that do not divide
            (`hidden` by `n_heads`, heads by key/value heads or by the TP degree, layers by
            pipeline stages, the sequence by the context-parallel degree), or both kinds of
            recompute at once.
    """
    p = _positive("params", params)
    n = _count("world_size", world_size)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    s, b = _count("seq_len", seq_len), _count("micro_batch", micro_batch)
    h, a, layers = _count("hidden", hidden), _count("n_heads", n_heads), _count("n_layers", n_layers)
    if h % a:
        raise ValueError(f"hidden ({h}) must be a multiple of n_heads ({a})")
    checkpointing = _flag("activation_checkpointing", activation_checkpointing)
    scores = _flag("stores_attention_scores", stores_attention_scores)
    sizes = {"params_bytes": _positive("param_bytes", param_bytes),
             "grads_bytes": _non_negative("grad_bytes", grad_bytes),
             "master_bytes": _non_negative("master_bytes", master_bytes),
             "optimizer_bytes": _non_negative("optimizer_bytes", optimizer_bytes)}
    f = 4 * h if ffn_hidden is None else _count("ffn_hidden", ffn_hidden)
    gated = _flag("gated_mlp", gated_mlp)
    kv_heads = a if n_kv_heads is None else _count("n_kv_heads", n_kv_heads)
    vocab = _count("vocab_size", vocab_size, 0)
    t, pp = _count("tp_degree", tp_degree), _count("pp_degree", pp_degree)
    cp = _count("cp_degree", cp_degree)
    sp = _flag("sequence_parallel", sequence_parallel)
    c = _positive("compute_bytes", compute_bytes)
    peak = _flag("transients", transients)
    selective = _flag("selective_recompute", selective_recompute)
    offload = _flag("offload_optimizer", offload_optimizer)
    compiled = _flag("compiled_loss", compiled_loss)
    accum = _count("grad_accum_steps", grad_accum_steps)
    if fsdp_grad_sync not in GRAD_SYNCS:
        raise ValueError(f"fsdp_grad_sync must be one of {', '.join(GRAD_SYNCS)}, got {fsdp_grad_sync!r}")
    if checkpointing and selective:
        raise ValueError("activation_checkpointing and selective_recompute exclude each other")
    if a % kv_heads:
        raise ValueError(f"Attention heads ({a}) must be a multiple of key/value heads ({kv_heads})")
    if a % t or kv_heads % t:
        raise ValueError(f"Attention heads ({a}) and key/value heads ({kv_heads}) must be multiples "
                         f"of the tensor-parallel degree ({t})")
    if layers % pp:
        raise ValueError(f"Layers ({layers}) must be a multiple of the pipeline stages ({pp})")
    if s % cp:
        raise ValueError(f"Sequence length ({s}) must be a multiple of the context-parallel degree ({cp})")

    sharded = {"ddp": (), "zero1": ("master_bytes", "optimizer_bytes"),
               "zero2": ("master_bytes", "optimizer_bytes", "grads_bytes")}.get(strategy, tuple(sizes))
    if accum > 1 and fsdp_grad_sync == "last":  # accumulated unsharded until the last micro-batch
        sharded = tuple(key for key in sharded if key != "grads_bytes")
    state = {key: p / (t * pp) * per_param / (n if key in sharded else 1) for key, per_param in sizes.items()}
    offloaded = state["master_bytes"] + state["optimizer_bytes"] if offload else 0.0
    if offload:
        state["master_bytes"] = state["optimizer_bytes"] = 0.0
    model_state = state["params_bytes"] + state["grads_bytes"] + state["master_bytes"] + state["optimizer_bytes"]

    tokens = s * b / cp
    kv = h // a * kv_heads
    sp_divisor = t if sp else 1
    gathered_inputs = 0.0
    if gated:  # 12 hidden-sized: q and the attention output inside TP's region, 10 around it
        around, inside = c * 10 * h + 8, c * (h + 2 * kv + h + 4 * f) + 4 * a
        if sp and t > 1:
            # DTensor's sequence parallel all-gathers the sequence before each column-parallel
            # projection, which saves the gathered input: q/k/v's and, each its own, w1's and
            # w3's, in place of the two sequence-sharded norm outputs.
            around, gathered_inputs = around - 2 * c * h, 3 * c * h
    else:  # Korthikanti's 10 sbh outside the tensor-parallel region, 24 sbh inside
        around, inside = c * 4 * h + 2 * h, c * (2 * h + 2 * kv + 2 * f)
    score_bytes = tokens * 5 * a * s / cp / t if scores else 0.0
    per_layer = tokens * (around / sp_divisor + gathered_inputs + inside / t) + score_bytes
    recomputed_scores = score_bytes if selective else 0.0  # one layer's, live while recomputed
    kept = per_layer - recomputed_scores
    stage_layers = layers // pp
    layer_input = c * tokens * h / sp_divisor
    # 1F1B: the first stage holds pp micro-batches of its layers, as many as n_layers of one.
    stored = stage_layers * pp * (layer_input if checkpointing else kept)
    activations = stored + (per_layer if checkpointing else recomputed_scores)
    out = {**state, "model_state_bytes": model_state, "activation_bytes_per_layer": per_layer,
           "activation_bytes": activations, "sharded_params_bytes": state["params_bytes"],
           "sharded_grads_bytes": state["grads_bytes"],
           "optimizer_state_bytes": state["master_bytes"] + state["optimizer_bytes"],
           "unsharded_params_bytes": 0.0, "all_gather_bytes": 0.0, "reduce_scatter_bytes": 0.0,
           "temporary_bytes": 0.0, "input_bytes": 0.0, "offloaded_bytes": offloaded,
           "total_bytes": model_state + activations}
    if not peak:
        return out

    gathered = strategy in ("zero3", "fsdp") and n > 1
    # Gradients held from earlier micro-batches when their reduce-scatter is deferred.
    held = state["grads_bytes"] if gathered and "grads_bytes" not in sharded else None
    block_params = (h * (h + 2 * kv) + h * h + (3 if gated else 2) * h * f) / t + 2 * h
    # Under a pipeline the last stage holds the output projection and the logits, the larger end.
    root_params = (2 if pp == 1 else 1) * vocab * h / t + (h if vocab else 0)
    logits = tokens * vocab / t
    # The embedding's output and the final norm's saved tensors; the output projection's input
    # whole (sequence parallel gathers it).
    around_root = 4 * layer_input + c * tokens * h if vocab else 0
    # Eager: the fp32 log-softmax kept, two fp32 logits-sized gradients; loss parallel (tensor
    # parallel) a third, exp(log-softmax). Compiled: the logits kept and their gradient.
    fused = compiled and t == 1
    kept_logits = c * logits if fused else 4 * logits
    loss_temporaries = c * logits if fused else (3 if t > 1 else 2) * 4 * logits
    loss = {"sharded_grads_bytes": 0.0 if gathered and held is None else state["grads_bytes"],
            "unsharded_params_bytes": c * root_params if gathered else 0.0,
            "all_gather_bytes": 0.0, "reduce_scatter_bytes": 0.0,
            "activation_bytes": stored + around_root + kept_logits, "temporary_bytes": loss_temporaries}
    moments = [loss]
    if vocab:
        # The final norm's backward: the loss is freed, the output projection's gradient kept;
        # the norm's gradient arrives whole (reduced over TP ranks without sequence parallel)
        # and its fp32 backward holds six hidden-sized fp32 tensors.
        moments.append({**loss, "activation_bytes": stored + 2 * layer_input,
                        "temporary_bytes": c * vocab * h / t + 6 * 4 * tokens * h / sp_divisor})
    if gathered:
        # Block `at` (0 nearest the input) in backward: the blocks above it are done (their
        # sharded gradients exist) and the output projection's bf16 gradient waits for the
        # root's reduce-scatter at the end of backward. The next block down is being
        # gathered, except below block 0 and, as the tracker shows, while the first block to
        # run backward finishes (or, with recompute, at any time in that block).
        recomputed = tokens * c * f / t
        attention_params = (h * (h + 2 * kv) + h * h) / t
        output_grad = c * vocab * h / t
        for at in sorted({0, min(1, stage_layers - 1), max(stage_layers - 2, 0), stage_layers - 1}):
            below = (at + 1) * pp * layer_input if checkpointing else at * pp * kept
            done = (stage_layers - 1 - at) * block_params * sizes["grads_bytes"] / n
            common = {"sharded_grads_bytes": done if held is None else held,
                      "unsharded_params_bytes": c * (root_params + block_params)}
            gathering = c * block_params if 0 < at < stage_layers - 1 else 0.0
            reducing = sizes["grads_bytes"] * block_params
            # Inside the SwiGLU's backward: the block's activations less its consumed product;
            # the block above's fp32 reduce-scatter input is still in flight.
            prefetched = c * block_params if at > 0 and not checkpointing else gathering
            moments.append({**common, "all_gather_bytes": prefetched,
                            "reduce_scatter_bytes": reducing if at < stage_layers - 1 else 0.0,
                            "activation_bytes": below + per_layer - recomputed,
                            "temporary_bytes": 4 * recomputed + (output_grad + layer_input if checkpointing else 0)})
            # The block's backward done: its bf16 gradients (the attention's twice) and their
            # fp32 copy for the reduce-scatter.
            moments.append({**common, "all_gather_bytes": gathering, "reduce_scatter_bytes": reducing,
                            "activation_bytes": below + 2 * layer_input,
                            "temporary_bytes": c * (block_params + attention_params) + output_grad
                            + 2 * layer_input})
    token_ids = 8 * tokens if vocab else 0.0  # int64
    worst = max(moments, key=lambda m: sum(m.values()))
    fixed = out["sharded_params_bytes"] + out["optimizer_state_bytes"] + token_ids
    return {**out, **worst, "input_bytes": token_ids, "total_bytes": fixed + sum(worst.values())}


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
    size = _positive("size_bytes", size_bytes)
    n = _count("world_size", world_size, 2)
    bandwidth = _positive("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    latency = _non_negative("latency_s", latency_s)
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
    p = _positive("params", params)
    n = _count("world_size", world_size, 2)
    bandwidth = _positive("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    gather_bytes, reduce_bytes = _positive("param_bytes", param_bytes), _positive("grad_bytes", grad_bytes)
    gathers = 2 if _flag("reshard_after_forward", reshard_after_forward) else 1
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
    tokens = _count("seq_len", seq_len) * _count("micro_batch", micro_batch)
    h, layers = _count("hidden", hidden), _count("n_layers", n_layers)
    t = _count("tp_degree", tp_degree, 2)
    bandwidth = _positive("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    size = tokens * h * _positive("activation_bytes", activation_bytes)
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
    tokens = _count("seq_len", seq_len) * _count("micro_batch", micro_batch)
    h, p = _count("hidden", hidden), _count("stages", stages, 2)
    bandwidth = _positive("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    size = tokens * h * _positive("activation_bytes", activation_bytes)
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
    rows = _count("tokens", tokens) * _count("top_k", top_k)
    h, e = _count("hidden", hidden), _count("ep_degree", ep_degree, 2)
    bandwidth = _positive("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    buffer = rows * h * _positive("activation_bytes", activation_bytes)
    per_call = buffer * (e - 1) / e
    return {"buffer_bytes": buffer, "all_to_alls_per_layer": 4, "bytes_per_all_to_all": per_call,
            "bytes_sent_per_layer": 4 * per_call, "bytes_received_per_layer": 4 * per_call,
            "time_s": 4 * per_call / bandwidth}

def pipeline_bubble(*, stages: int, microbatches: int, interleave: int = 1,
                    schedule: str = "1f1b") -> dict[str, float]:
    """Idle share of a pipeline-parallel step, for the schedules `torch.distributed.pipelining` ships.

    Time is counted in units of one forward of one model chunk; the backward for inputs
    (I) and for weights (W) take one unit each, so a full backward is two (the zero-bubble
    paper's assumption). With `p` stages, `m` micro-batches and `v` chunks per stage:

    - `"1f1b"` (GPipe, 1F1B, interleaved 1F1B, looped BFS): the bubble is `p - 1` slots
      of a chunk's forward and backward, `(p - 1) / (v m + p - 1)` of the step
      (Narayanan et al., SC 2021); `v` divides the bubble's duration.
    - `"zero_bubble"` (interleaved zero bubble, ZB1P of Qi et al., ICLR 2024): weight
      backwards fill the warm-up and cool-down, leaving `p - 1` units:
      `(p - 1) / (3 v m + p - 1)`.
    - `"zbv"` (ZBV zero bubble and DualPipeV: two chunks per stage in a V, `v` = 2):
      `b / (6 m + b)` with `b = max(p - 1, 2 (2 p - 1 - m))` idle units: with fewer than
      about `1.5 p` micro-batches the V cannot fill and each missing one costs two units.

    These are not approximations: they equal a replay of the action order each shipped
    schedule builds, with unit-time actions and free transfers, on every grid point of
    `tests/test_traces_certified.py`. Assumes equal stage times and ignores the
    point-to-point transfers.

    Args:
        stages: Pipeline stages p.
        microbatches: Micro-batches m per step.
        interleave: Model chunks v per stage (1: no interleaving). An interleaved
            schedule and `"zero_bubble"` need `m` to be a multiple of `p` (below `p`
            micro-batches torch's zero-bubble schedule idles more than the formula);
            `"zbv"` needs `v` = 2.
        schedule: `"1f1b"` (the default), `"zero_bubble"` or `"zbv"`.

    Returns:
        `bubble_fraction` (of the step), `bubble_over_ideal` (of the ideal compute time)
        and `efficiency` (1 - bubble_fraction).

    Raises:
        ValueError: A count below 1, an unknown schedule, interleaving or `"zero_bubble"`
            with `m` not a multiple of `p`, or `"zbv"` with `v` other than 2.
    """
    p, m = _count("stages", stages), _count("microbatches", microbatches)
    v = _count("interleave", interleave)
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, got {schedule!r}")
    if schedule == "zbv" and v != 2:
        raise ValueError(f"the zbv schedule runs 2 chunks per stage: interleave must be 2, got {v}")
    if schedule == "zero_bubble" and m % p:
        raise ValueError(f"the zero_bubble schedule needs microbatches ({m}) to be a multiple of stages ({p})")
    if schedule == "1f1b" and v > 1 and m % p:
        raise ValueError(f"an interleaved schedule needs microbatches ({m}) to be a multiple of stages ({p})")
    # Idle and busy time per stage: for "1f1b" in slots of a chunk's forward and backward
    # (today's formula, unchanged), for the zero-bubble schedules in units of a forward.
    if schedule == "1f1b":
        idle, busy = p - 1, v * m
    elif schedule == "zero_bubble":
        idle, busy = p - 1, 3 * v * m
    else:
        idle, busy = max(p - 1, 2 * (2 * p - 1 - m)), 6 * m
    bubble = idle / (busy + idle)
    return {"bubble_fraction": bubble, "bubble_over_ideal": idle / busy, "efficiency": 1 - bubble}


def checkpoint_interval(*, checkpoint_cost_s: float, mtbf_s: float,
                        restart_s: float = 0.0) -> dict[str, float]:
    """Optimum compute time between checkpoints: Young's first order and Daly's higher order.

    Young (CACM 1974): `tau = sqrt(2 C M)` for a blocking save cost `C` and a job mean
    time between failures `M`, with overhead `C / tau + tau / (2 M)` (saving plus the
    expected recomputation), about `sqrt(2 C / M)` at the optimum. Daly (FGCS 2006, eq. 37):
    `tau = sqrt(2 C M) (1 + sqrt(C / (2 M)) / 3 + C / (2 M) / 9) - C` while `C < 2 M`, else
    `tau = M`. Daly's complete model, with exponentially distributed failures and a
    restart time `R`, expects a wall time of `M e^(R/M) (e^((tau + C)/M) - 1) / tau` per
    unit of work; `daly_overhead_fraction` is that minus 1 at Daly's interval.

    Args:
        checkpoint_cost_s: Seconds a save blocks training (C).
        mtbf_s: Mean time between failures of the whole job in seconds (M).
        restart_s: Seconds from a failure to training again (R); only Daly's model uses it.

    Returns:
        `young_interval_s`, `young_overhead_fraction`, `daly_interval_s` and
        `daly_overhead_fraction`.

    Raises:
        ValueError: A non-positive cost or MTBF, a negative restart time, or a cost or
            restart time above 100 MTBFs.
    """
    c, m = _positive("checkpoint_cost_s", checkpoint_cost_s), _positive("mtbf_s", mtbf_s)
    r = _non_negative("restart_s", restart_s)
    if max(c, r) > _MAX_COST_OVER_MTBF * m:
        raise ValueError(f"checkpoint_cost_s and restart_s must not exceed {_MAX_COST_OVER_MTBF:g} x mtbf_s")
    young = math.sqrt(2 * c * m)
    ratio = c / (2 * m)
    daly = young * (1 + math.sqrt(ratio) / 3 + ratio / 9) - c if c < 2 * m else m
    daly_overhead = m * math.exp(r / m) * math.expm1((daly + c) / m) / daly - 1
    return {"young_interval_s": young, "young_overhead_fraction": c / young + young / (2 * m),
            "daly_interval_s": daly, "daly_overhead_fraction": daly_overhead}


def _exp_minus_one_minus_x(x: float) -> float:
    """`e^x - 1 - x` without the cancellation of `expm1(x) - x` near 0 (a series below |x| 0.5)."""
    if abs(x) >= 0.5:
        return math.expm1(x) - x
    term, total = x * x / 2, 0.0
    for k in range(3, 40):
        total += term
        term *= x / k
        if abs(term) <= 1e-17 * abs(total):
            break
    return total


def _optimal_work_over_mtbf(c: float) -> float:
    """The `y = lambda tau` that minimises `(e^(y + c) - 1) / y`, for `c = lambda C > 0`.

    Setting the derivative to zero gives `(1 - y) e^(y + c) = 1`; with `z = -ln(1 - y)` that
    is `g(z) = e^(-z) - 1 + z - c = 0`, increasing and convex in `z`, so Newton's method from
    a point right of the root walks down to it without overshooting. `z = 2 sqrt(c)` lies
    right of it while `c <= 0.5` (`g(z) >= z^2/2 - z^3/6`), `z = c + 1` always. Solved in `z`,
    the answer stays exact where `y` rounds to 1 (large `c`).
    """
    z = 2 * math.sqrt(c) if c <= 0.5 else c + 1
    for _ in range(100):
        step = (_exp_minus_one_minus_x(-z) - c) / -math.expm1(-z)
        if not step > 1e-16 * z:
            break
        z -= step
    return -math.expm1(-z)


def goodput(*, n_gpus: int, mtbf_gpu_hours: float, save_s: float, restart_s: float,
            interval_s: float | None = None) -> dict[str, float]:
    """Productive share of wall time for a job that checkpoints, fails and restarts.

    The process: the job computes for `interval_s` (tau), then a save blocks it for `save_s`
    (C), and so on. Failures arrive as a Poisson process at rate `lambda = n_gpus /
    mtbf_gpu_hours` (per hour; the job's MTBF is `M = 1 / lambda`) while the job computes or
    saves, never while it restarts. A failure loses everything since the last completed save
    (a save it interrupts included) and costs `restart_s` (R), after which the job resumes
    from that save.

    Expected value, exactly, by renewal-reward: cut wall time into cycles, each ending when a
    save completes; every cycle earns `tau` of kept work. A cycle tries `T = tau + C` of
    uninterrupted time; a try survives with probability `p = e^(-lambda T)`, so the number of
    failures before the success is geometric with mean `N = e^(lambda T) - 1`. A failed try
    lasts on average `E[X | X < T] = 1/lambda - T p / (1 - p)` and adds R; solving
    `E = p T + (1 - p)(E[X | X < T] + R + E)` gives the expected cycle length
    `E = (1/lambda + R)(e^(lambda T) - 1)`. The long-run shares of wall time are then
    `goodput = tau / E`, `save_fraction = C / E` (completed saves), `restart_fraction =
    N R / E` and `lost_fraction = (N / lambda - T) / E` (work and partial saves undone);
    they sum to 1. Daly's complete model (`checkpoint_interval`) lets failures strike
    during restarts too and has `e^(R/M)` where this has `1 + R/M`.

    With `interval_s=None` the interval is this model's optimum: `y = lambda tau` solving
    `(1 - y) e^(y + lambda C) = 1`, which Young's `sqrt(2 C M)` and Daly's higher-order
    formula approximate (the factor in R does not depend on tau, so Daly's model has the
    same optimum); both are returned beside it.

    Args:
        n_gpus: GPUs in the job; each fails independently.
        mtbf_gpu_hours: Mean time between failures of one GPU, with its share of the host,
            network and software failures, in hours (`M = mtbf_gpu_hours / n_gpus` hours).
        save_s: Seconds a checkpoint blocks training (C).
        restart_s: Seconds from a failure until training resumes (R): detection, rescheduling,
            start-up, restore.
        interval_s: Seconds of training between saves (tau); `None` for the optimum.

    Returns:
        `goodput` (productive share of wall time), `save_fraction`, `lost_fraction`,
        `restart_fraction`, `interval_s` (as given, or the optimum), `optimal_interval_s`,
        `optimal_goodput`, `young_interval_s`, `daly_interval_s`, `job_mtbf_s`,
        `failures_per_day` (of the job) and `failures_per_checkpoint` (N, per completed save).

    Raises:
        ValueError: A GPU count below 1, a non-positive MTBF, save cost or interval, a negative
            restart time, or a save, restart or interval above 100 job MTBFs.
    """
    n = _count("n_gpus", n_gpus)
    mtbf = _positive("mtbf_gpu_hours", mtbf_gpu_hours) * 3600 / n
    c, r = _positive("save_s", save_s), _non_negative("restart_s", restart_s)
    tau = None if interval_s is None else _positive("interval_s", interval_s)
    if max(c, r, tau or 0) > _MAX_COST_OVER_MTBF * mtbf:
        raise ValueError(f"save_s, restart_s and interval_s must not exceed {_MAX_COST_OVER_MTBF:g} x the job's "
                         "MTBF (mtbf_gpu_hours x 3600 / n_gpus)")
    rate = 1 / mtbf
    best = _optimal_work_over_mtbf(c * rate) * mtbf
    tau = best if tau is None else tau

    def shares(work: float) -> tuple[float, float, float, float, float]:
        failures = math.expm1(rate * (work + c))
        cycle = (mtbf + r) * failures
        lost = _exp_minus_one_minus_x(rate * (work + c)) * mtbf
        return work / cycle, c / cycle, lost / cycle, failures * r / cycle, failures

    kept, saving, lost, restarting, failures = shares(tau)
    young = math.sqrt(2 * c * mtbf)
    ratio = c / (2 * mtbf)
    return {"goodput": kept, "save_fraction": saving, "lost_fraction": lost, "restart_fraction": restarting,
            "interval_s": tau, "optimal_interval_s": best, "optimal_goodput": shares(best)[0],
            "young_interval_s": young,
            "daly_interval_s": young * (1 + math.sqrt(ratio) / 3 + ratio / 9) - c if c < 2 * mtbf else mtbf,
            "job_mtbf_s": mtbf, "failures_per_day": 86400 / mtbf, "failures_per_checkpoint": failures}


def mfu(*, flops_per_sample: float, samples_per_step: float, step_time_s: float, n_gpus: int,
        peak_flops_per_gpu: float) -> dict[str, float]:
    """Model FLOPs utilisation of a measured step, and the step time at 100% MFU.

    `MFU = flops_per_sample x samples_per_step / step_time_s / (n_gpus x peak)`. The model
    FLOPs are what training needs, about `6 x parameters` per token for a dense
    transformer plus attention (`reference_impl.model.flops_per_sample`); recomputation
    by activation checkpointing is not counted.

    Args:
        flops_per_sample: Training FLOPs (forward and backward) per sample.
        samples_per_step: Samples per optimizer step, over all GPUs (the global batch).
        step_time_s: Measured seconds per step.
        n_gpus: GPUs sharing the step.
        peak_flops_per_gpu: Dense peak FLOP/s of one GPU at the training precision.

    Returns:
        `samples_per_s`, `achieved_flops_per_gpu`, `mfu` (a fraction) and
        `ideal_step_time_s` (the step at peak).

    Raises:
        ValueError: A non-positive input.
    """
    work = _positive("flops_per_sample", flops_per_sample) * _positive("samples_per_step", samples_per_step)
    time_s, gpus = _positive("step_time_s", step_time_s), _count("n_gpus", n_gpus)
    peak = _positive("peak_flops_per_gpu", peak_flops_per_gpu)
    achieved = work / time_s / gpus
    return {"samples_per_s": samples_per_step / time_s, "achieved_flops_per_gpu": achieved,
            "mfu": achieved / peak, "ideal_step_time_s": work / (gpus * peak)}


def step_time(*, flops_per_sample: float, samples_per_step: float, n_gpus: int,
              peak_flops_per_gpu: float, mfu: float) -> dict[str, float]:
    """Step time predicted from an assumed MFU: the inverse of `mfu`.

    `step_time_s = flops_per_sample x samples_per_step / (n_gpus x peak x MFU)`.

    Args:
        flops_per_sample: Training FLOPs (forward and backward) per sample.
        samples_per_step: Samples per optimizer step, over all GPUs.
        n_gpus: GPUs sharing the step.
        peak_flops_per_gpu: Dense peak FLOP/s of one GPU at the training precision.
        mfu: Assumed model FLOPs utilisation, a fraction in (0, 1].

    Returns:
        `step_time_s`, `samples_per_s` and `achieved_flops_per_gpu`.

    Raises:
        ValueError: A non-positive input, or an MFU above 1.
    """
    work = _positive("flops_per_sample", flops_per_sample) * _positive("samples_per_step", samples_per_step)
    gpus, peak = _count("n_gpus", n_gpus), _positive("peak_flops_per_gpu", peak_flops_per_gpu)
    if _positive("mfu", mfu) > 1:
        raise ValueError(f"mfu must be at most 1, got {mfu!r}")
    time_s = work / (gpus * peak * mfu)
    return {"step_time_s": time_s, "samples_per_s": samples_per_step / time_s,
            "achieved_flops_per_gpu": peak * mfu}

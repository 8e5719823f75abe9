"""`memory`: bytes per rank of model state, activations and a step's transients, as named parts.

Each part is a function of the checked inputs (`MemoryInputs`) with a JavaScript twin of the
same name in `window.handbookCalcMemoryParts`; `memory` composes them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from reference_impl.calc.checks import count, flag, non_negative, positive

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
GRAD_SYNCS = ("last", "every")


# The model states in `memory`'s answer, in order; the strategies shard a subset of them.
MODEL_STATES = ("params_bytes", "grads_bytes", "master_bytes", "optimizer_bytes")


@dataclass(frozen=True)
class MemoryInputs:
    """`memory`'s inputs once checked, with `ffn_hidden` and `n_kv_heads` resolved.

    Each part of the memory model is a function of this record alone, so each can be read,
    tested and compared with its JavaScript twin by itself. The fields are `memory`'s
    keyword arguments (see there); the properties are sizes several parts share.
    """

    params: float
    world_size: int
    strategy: str
    seq_len: int
    micro_batch: int
    hidden: int
    n_heads: int
    n_layers: int
    activation_checkpointing: bool
    stores_attention_scores: bool
    param_bytes: float
    grad_bytes: float
    master_bytes: float
    optimizer_bytes: float
    ffn_hidden: int
    gated_mlp: bool
    n_kv_heads: int
    vocab_size: int
    tp_degree: int
    pp_degree: int
    cp_degree: int
    sequence_parallel: bool
    compute_bytes: float
    transients: bool
    selective_recompute: bool
    offload_optimizer: bool
    grad_accum_steps: int
    fsdp_grad_sync: str
    compiled_loss: bool

    @property
    def tokens(self) -> float:
        """T, a rank's tokens in one micro-batch: `seq_len x micro_batch / cp_degree`."""
        return self.seq_len * self.micro_batch / self.cp_degree

    @property
    def kv_width(self) -> int:
        """kv, the width of the keys (and of the values): `hidden / n_heads x n_kv_heads`."""
        return self.hidden // self.n_heads * self.n_kv_heads

    @property
    def sp_divisor(self) -> int:
        """What divides the tensors around the tensor-parallel region: `tp_degree` under
        sequence parallel, else 1."""
        return self.tp_degree if self.sequence_parallel else 1

    @property
    def layer_input(self) -> float:
        """A layer's input, `c x T x hidden`, sequence-sharded under sequence parallel."""
        return self.compute_bytes * self.tokens * self.hidden / self.sp_divisor

    @property
    def stage_layers(self) -> int:
        """Layers of one pipeline stage: `n_layers / pp_degree`."""
        return self.n_layers // self.pp_degree

    @property
    def gathered(self) -> bool:
        """Whether compute gathers the parameters: `zero3` or `fsdp` over 2 ranks or more."""
        return self.strategy in ("zero3", "fsdp") and self.world_size > 1


def memory_inputs(inputs: dict[str, Any]) -> MemoryInputs:
    """`memory`'s inputs, every one given (as `memory` passes them), checked in its order.

    Raises:
        ValueError: The first bad input, as `memory` documents.
    """
    x = inputs
    p, n, strategy = positive("params", x["params"]), count("world_size", x["world_size"]), x["strategy"]
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    s, b = count("seq_len", x["seq_len"]), count("micro_batch", x["micro_batch"])
    h, a, layers = count("hidden", x["hidden"]), count("n_heads", x["n_heads"]), count("n_layers", x["n_layers"])
    if h % a:
        raise ValueError(f"hidden ({h}) must be a multiple of n_heads ({a})")
    checkpointing = flag("activation_checkpointing", x["activation_checkpointing"])
    scores = flag("stores_attention_scores", x["stores_attention_scores"])
    weights, grads = positive("param_bytes", x["param_bytes"]), non_negative("grad_bytes", x["grad_bytes"])
    master = non_negative("master_bytes", x["master_bytes"])
    moments = non_negative("optimizer_bytes", x["optimizer_bytes"])
    f = 4 * h if x["ffn_hidden"] is None else count("ffn_hidden", x["ffn_hidden"])
    gated = flag("gated_mlp", x["gated_mlp"])
    kv_heads = a if x["n_kv_heads"] is None else count("n_kv_heads", x["n_kv_heads"])
    vocab = count("vocab_size", x["vocab_size"], 0)
    t, pp = count("tp_degree", x["tp_degree"]), count("pp_degree", x["pp_degree"])
    cp = count("cp_degree", x["cp_degree"])
    sp, c = flag("sequence_parallel", x["sequence_parallel"]), positive("compute_bytes", x["compute_bytes"])
    peak, selective = flag("transients", x["transients"]), flag("selective_recompute", x["selective_recompute"])
    offload, compiled = flag("offload_optimizer", x["offload_optimizer"]), flag("compiled_loss", x["compiled_loss"])
    accum, grad_sync = count("grad_accum_steps", x["grad_accum_steps"]), x["fsdp_grad_sync"]
    if grad_sync not in GRAD_SYNCS:
        raise ValueError(f"fsdp_grad_sync must be one of {', '.join(GRAD_SYNCS)}, got {grad_sync!r}")
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
    return MemoryInputs(p, n, strategy, s, b, h, a, layers, checkpointing, scores, weights, grads, master, moments,
                        f, gated, kv_heads, vocab, t, pp, cp, sp, c, peak, selective, offload, accum, grad_sync,
                        compiled)


def memory_sharded_states(m: MemoryInputs) -> tuple[str, ...]:
    """The model states divided over the `world_size` N ranks (Rajbhandari et al., *ZeRO*, 2020).

    `ddp` shards nothing (every rank holds a full replica); `zero1` the master weights and
    the optimizer state; `zero2` those and the gradients; `zero3` and `fsdp` (FSDP2 is
    ZeRO-3) everything. With accumulation (`grad_accum_steps` above 1) and the
    reduce-scatter waiting for the last micro-batch (`fsdp_grad_sync="last"`, FSDP2's
    `set_requires_gradient_sync(False)`, the trainer's default) every rank holds its
    gradients unsharded between micro-batches: they leave the list.
    """
    sharded = {"ddp": (), "zero1": ("master_bytes", "optimizer_bytes"),
               "zero2": ("master_bytes", "optimizer_bytes", "grads_bytes")}.get(m.strategy, MODEL_STATES)
    if m.grad_accum_steps > 1 and m.fsdp_grad_sync == "last":
        sharded = tuple(key for key in sharded if key != "grads_bytes")
    return sharded


def memory_model_state(m: MemoryInputs) -> dict[str, float]:
    """Model state per rank: `params / (tp_degree x pp_degree) x bytes / N` for each state.

    The bytes per parameter are `param_bytes` (weights), `grad_bytes`, `master_bytes` and
    `optimizer_bytes`; N is `world_size` for the states `memory_sharded_states` lists, else 1.
    By default 2 + 2 + 4 + 8 = 16 bytes per parameter (bf16 weights and gradients, an fp32
    master copy, Adam's two fp32 moments); PyTorch autocast and FSDP2 with a bf16
    `MixedPrecisionPolicy` keep fp32 weights and gradients and no master copy: 4 + 4 + 0 +
    8, also 16. Offloading the optimizer (ZeRO-Offload) moves the master copy and the
    optimizer state to host memory (`offloaded_bytes`), off the GPU.

    Returns:
        The four states, their sum `model_state_bytes`, and `offloaded_bytes`.
    """
    sharded = memory_sharded_states(m)
    per_param = (m.param_bytes, m.grad_bytes, m.master_bytes, m.optimizer_bytes)
    state = {key: m.params / (m.tp_degree * m.pp_degree) * size / (m.world_size if key in sharded else 1)
             for key, size in zip(MODEL_STATES, per_param, strict=True)}
    offloaded = state["master_bytes"] + state["optimizer_bytes"] if m.offload_optimizer else 0.0
    if m.offload_optimizer:
        state["master_bytes"] = state["optimizer_bytes"] = 0.0
    total = state["params_bytes"] + state["grads_bytes"] + state["master_bytes"] + state["optimizer_bytes"]
    return {**state, "model_state_bytes": total, "offloaded_bytes": offloaded}


def memory_attention_activations(m: MemoryInputs) -> dict[str, float]:
    """Bytes the attention keeps for backward, per token of T (`scores`: per layer).

    Per token, with c = `compute_bytes`, h = `hidden`, kv = `MemoryInputs.kv_width`: `inside`
    the tensor-parallel region (divided by `tp_degree`), `around` it (divided by it only
    under sequence parallel) and `gathered` (whole on every rank).

    - GPT (Korthikanti et al., 2022, §4): inside `c (2 h + 2 kv)` (q, k, v and the output
      projection's input), around `c h + h` (the q/k/v projection's input and the one-byte
      dropout mask of the output).
    - Llama (`gated_mlp`): inside `c (2 h + 2 kv) + 4 n_heads` (q, k, v, the attention
      output and its fp32 log-sum-exp per head), around `c h` (the q/k/v projection's
      input); under sequence parallel (`tp_degree` above 1) DTensor all-gathers that input
      and saves it whole: gathered `c h` instead.

    `scores`, unfused attention only (`stores_attention_scores`): `5 x n_heads x seq_len`
    bytes per token (scores, softmax, dropout mask), `T x 5 n_heads seq_len / (cp_degree x
    tp_degree)` per layer. PyTorch's `scaled_dot_product_attention` keeps none.
    """
    c, h, kv = m.compute_bytes, m.hidden, m.kv_width
    scores = m.tokens * 5 * m.n_heads * m.seq_len / m.cp_degree / m.tp_degree if m.stores_attention_scores else 0.0
    if not m.gated_mlp:
        return {"around": c * h + h, "gathered": 0.0, "inside": c * (2 * h + 2 * kv), "scores": scores}
    regathered = m.sequence_parallel and m.tp_degree > 1
    return {"around": 0.0 if regathered else c * h, "gathered": c * h if regathered else 0.0,
            "inside": c * (2 * h + 2 * kv) + 4 * m.n_heads, "scores": scores}


def memory_mlp_activations(m: MemoryInputs) -> dict[str, float]:
    """Bytes the MLP keeps for backward, per token, in the places of `memory_attention_activations`.

    With c = `compute_bytes`, h = `hidden`, f = `ffn_hidden`:

    - GPT MLP (Korthikanti §4): inside `2 c f` (the GeLU's input and output), around
      `c h + h` (the first projection's input and the one-byte dropout mask).
    - SwiGLU (`gated_mlp`): inside `4 c f` (w1's and w3's outputs, the SiLU of w1's and the
      product w2 takes in), around `c h` (the input of w1 and w3); under sequence parallel
      (`tp_degree` above 1) w1 and w3 each all-gather it and keep their own whole copy:
      gathered `2 c h` instead, where Megatron-LM gathers it again in backward.
    """
    c, h, f = m.compute_bytes, m.hidden, m.ffn_hidden
    if not m.gated_mlp:
        return {"around": c * h + h, "gathered": 0.0, "inside": c * 2 * f}
    regathered = m.sequence_parallel and m.tp_degree > 1
    return {"around": 0.0 if regathered else c * h, "gathered": 2 * c * h if regathered else 0.0,
            "inside": c * 4 * f}


def memory_norm_activations(m: MemoryInputs) -> dict[str, float]:
    """Bytes a block's two norms keep for backward, per token: all around the tensor-parallel region.

    GPT's LayerNorms keep their inputs, `2 c h`. Llama's RMSNorms, as PyTorch's autograd
    runs them in bf16, keep each an fp32 upcast input and an fp32 normalised product (2 c h
    each at c = 2) and a 4-byte reciprocal per token: `8 c h + 8`.
    """
    c, h = m.compute_bytes, m.hidden
    return {"around": c * 8 * h + 8 if m.gated_mlp else c * 2 * h, "gathered": 0.0, "inside": 0.0}


def memory_layer_activations(m: MemoryInputs) -> float:
    """One layer's stored activations, without recompute, summed over its parts.

    `T x (around / sp + gathered + inside / tp_degree) + scores`, where sp is `tp_degree`
    under sequence parallel and 1 otherwise, and around, gathered and inside are the sums
    of the attention's, the MLP's and the norms'. With the defaults (c = 2, kv = h, f =
    4 h) a GPT layer is Korthikanti's `34 T h` (+ `5 n_heads seq_len T` with the scores).
    """
    kinds = (memory_attention_activations(m), memory_mlp_activations(m), memory_norm_activations(m))
    around, gathered, inside = (sum(kind[key] for kind in kinds) for key in ("around", "gathered", "inside"))
    return m.tokens * (around / m.sp_divisor + gathered + inside / m.tp_degree) + kinds[0]["scores"]


def memory_stored_activations(m: MemoryInputs) -> dict[str, float]:
    """The activations the first pipeline stage holds at the end of forward, and the steady state.

    A layer keeps `memory_layer_activations`, less its attention scores under selective
    recompute (Korthikanti §5: recomputed in backward, one layer's live meanwhile; no
    change with fused attention, which recomputes them anyway). With full recompute
    (`activation_checkpointing`) a layer keeps only its input, `MemoryInputs.layer_input`,
    and one layer's activations are live while it is recomputed. Under a pipeline (1F1B)
    the first stage holds `pp_degree` micro-batches of its `n_layers / pp_degree` layers,
    as many as all layers of one micro-batch: `stored = n_layers x (kept or layer input)`.

    Returns:
        `activation_bytes_per_layer`, `kept_per_layer`, `stored_bytes`, and
        `activation_bytes`: the stored ones plus those live during a recompute.
    """
    per_layer = memory_layer_activations(m)
    recomputed_scores = memory_attention_activations(m)["scores"] if m.selective_recompute else 0.0
    kept = per_layer - recomputed_scores
    stored = m.stage_layers * m.pp_degree * (m.layer_input if m.activation_checkpointing else kept)
    return {"activation_bytes_per_layer": per_layer, "kept_per_layer": kept, "stored_bytes": stored,
            "activation_bytes": stored + (per_layer if m.activation_checkpointing else recomputed_scores)}


def memory_parameter_counts(m: MemoryInputs) -> dict[str, float]:
    """Parameters per tensor-parallel rank of what FSDP gathers, in elements.

    A `block`: `(h (h + 2 kv) + h^2 + k h f) / tp_degree + 2 h` (q/k/v, the output
    projection, the MLP's k = 2 or, gated, 3 matrices; then the two norms' weights, whole),
    its `attention` alone: `(h (h + 2 kv) + h^2) / tp_degree`, and the `root`: the
    embedding and the output projection, `2 vocab h / tp_degree` (only the output
    projection under a pipeline: the last stage, the larger end), and the final norm's `h`.
    """
    h, kv, f, t = m.hidden, m.kv_width, m.ffn_hidden, m.tp_degree
    return {"block": (h * (h + 2 * kv) + h * h + (3 if m.gated_mlp else 2) * h * f) / t + 2 * h,
            "attention": (h * (h + 2 * kv) + h * h) / t,
            "root": (2 if m.pp_degree == 1 else 1) * m.vocab_size * h / t + (h if m.vocab_size else 0)}


def memory_held_gradients(m: MemoryInputs) -> float | None:
    """Gradients a gathering strategy holds whole between micro-batches (their reduce-scatter
    deferred to the last: see `memory_sharded_states`), or None when it does not."""
    if m.gathered and "grads_bytes" not in memory_sharded_states(m):
        return memory_model_state(m)["grads_bytes"]
    return None


def memory_loss_activations(m: MemoryInputs) -> dict[str, float]:
    """What the embedding, the logits and the loss add at the loss, in bytes (0 without a vocabulary).

    With T tokens and the rank's `logits = T x vocab_size / tp_degree` (tensor parallel's
    `loss_parallel` keeps them sharded): `around_root` is the embedding's output and the
    final norm's saved tensors, `4 x layer_input`, plus the output projection's input whole,
    `c T h` (sequence parallel gathers it). Eager, the loss keeps the fp32 log-softmax
    (`kept_logits`, 4 bytes per logit) and makes two fp32 logits-sized gradients
    (`loss_temporaries`; three under `loss_parallel`). A compiled loss (`compiled_loss`,
    the trainer's `--compile`, at `tp_degree` 1) fuses the upcast, the log-softmax and
    their backward: it keeps the logits and writes their gradient at c bytes each.
    """
    c, logits = m.compute_bytes, m.tokens * m.vocab_size / m.tp_degree
    fused = m.compiled_loss and m.tp_degree == 1
    return {"around_root": 4 * m.layer_input + c * m.tokens * m.hidden if m.vocab_size else 0.0,
            "kept_logits": c * logits if fused else 4 * logits,
            "loss_temporaries": c * logits if fused else (3 if m.tp_degree > 1 else 2) * 4 * logits}


def memory_loss_moments(m: MemoryInputs) -> list[dict[str, float]]:
    """The step at the loss and, with a vocabulary, in the final norm's backward, by category.

    At the loss: every stored activation plus `memory_loss_activations`, the root gathered
    (`c x root` of `memory_parameter_counts`, under `zero3`/`fsdp`), and the sharded
    gradients (none yet under `zero3`/`fsdp` unless accumulated ones are held). In the
    final norm's backward the loss is freed and the output projection's gradient kept
    (`c vocab h / tp_degree`); the norm's gradient arrives whole and its fp32 backward holds
    six hidden-sized fp32 tensors, `24 T h / sp`.
    """
    c, grads, held = m.compute_bytes, memory_model_state(m)["grads_bytes"], memory_held_gradients(m)
    stored, loss = memory_stored_activations(m)["stored_bytes"], memory_loss_activations(m)
    at_loss = {"sharded_grads_bytes": 0.0 if m.gathered and held is None else grads,
               "unsharded_params_bytes": c * memory_parameter_counts(m)["root"] if m.gathered else 0.0,
               "all_gather_bytes": 0.0, "reduce_scatter_bytes": 0.0,
               "activation_bytes": stored + loss["around_root"] + loss["kept_logits"],
               "temporary_bytes": loss["loss_temporaries"]}
    if not m.vocab_size:
        return [at_loss]
    return [at_loss, {**at_loss, "activation_bytes": stored + 2 * m.layer_input,
                      "temporary_bytes": c * m.vocab_size * m.hidden / m.tp_degree
                      + 6 * 4 * m.tokens * m.hidden / m.sp_divisor}]


def memory_block_moments(m: MemoryInputs) -> list[dict[str, float]]:
    """Under `zero3`/`fsdp`, two moments of a block's backward, at the blocks where they peak.

    Block `at` (0 nearest the input; the first and last two of a stage to run backward):
    the blocks above it are done (their sharded gradients, `grad_bytes x block / N` each,
    exist), the root and the block are gathered (`c (root + block)`), and the block above's
    fp32 gradients wait for the reduce-scatter (`grad_bytes x block`). The next block down is
    being gathered (`c x block`), except below block 0 and, as FSDPMemTracker shows, while
    the first block to run backward finishes (with recompute, anywhere in it).

    - Inside the SwiGLU's backward: the block's activations less the consumed product
      (f-sized), and the gradients of four f-sized activations (fp32); with recompute also
      the output projection's gradient and the block's input.
    - The block's backward done: its bf16 gradients (the attention's counted twice by the
      tracker) and their fp32 copy for the reduce-scatter.
    """
    if not m.gathered:
        return []
    c, layers, layer_input = m.compute_bytes, m.stage_layers, m.layer_input
    counts, acts, held = memory_parameter_counts(m), memory_stored_activations(m), memory_held_gradients(m)
    block, recomputed = counts["block"], m.tokens * c * m.ffn_hidden / m.tp_degree
    output_grad, reducing = c * m.vocab_size * m.hidden / m.tp_degree, m.grad_bytes * block
    moments = []
    for at in sorted({0, min(1, layers - 1), max(layers - 2, 0), layers - 1}):
        below = ((at + 1) * m.pp_degree * layer_input if m.activation_checkpointing
                 else at * m.pp_degree * acts["kept_per_layer"])
        done = (layers - 1 - at) * block * m.grad_bytes / m.world_size
        common = {"sharded_grads_bytes": done if held is None else held,
                  "unsharded_params_bytes": c * (counts["root"] + block)}
        gathering = c * block if 0 < at < layers - 1 else 0.0
        moments.append({**common, "all_gather_bytes": c * block if at > 0 and not m.activation_checkpointing
                        else gathering, "reduce_scatter_bytes": reducing if at < layers - 1 else 0.0,
                        "activation_bytes": below + acts["activation_bytes_per_layer"] - recomputed,
                        "temporary_bytes": 4 * recomputed + (output_grad + layer_input
                                                             if m.activation_checkpointing else 0)})
        moments.append({**common, "all_gather_bytes": gathering, "reduce_scatter_bytes": reducing,
                        "activation_bytes": below + 2 * layer_input,
                        "temporary_bytes": c * (block + counts["attention"]) + output_grad + 2 * layer_input})
    return moments


def memory_peak(m: MemoryInputs) -> dict[str, float]:
    """The step's per-rank peak, as PyTorch's `FSDPMemTracker` measures it, by its categories.

    The largest of `memory_loss_moments` and `memory_block_moments` by their sum, plus what
    every moment holds: the sharded parameters, the optimizer state, and the token ids
    (`input_bytes`: 8 bytes each, int64, with a vocabulary).
    """
    state = memory_model_state(m)
    token_ids = 8 * m.tokens if m.vocab_size else 0.0
    worst = max(memory_loss_moments(m) + memory_block_moments(m), key=lambda moment: sum(moment.values()))
    fixed = state["params_bytes"] + (state["master_bytes"] + state["optimizer_bytes"]) + token_ids
    return {**worst, "input_bytes": token_ids, "total_bytes": fixed + sum(worst.values())}


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

    The answer is composed of named parts, each with its formula: the model state
    (`memory_model_state`, sharded as `memory_sharded_states` says), the activations of a
    layer's attention, MLP and norms (`memory_attention_activations`,
    `memory_mlp_activations`, `memory_norm_activations`, summed by
    `memory_layer_activations`) as recompute and the pipeline store them
    (`memory_stored_activations`), and, with `transients`, the step's peak (`memory_peak`):
    the largest of the moments at the loss (`memory_loss_moments`, with the embedding and
    logits of `memory_loss_activations`) and inside a block's backward under `zero3`/`fsdp`
    (`memory_block_moments`, with the all-gather and reduce-scatter buffers).

    With `transients` off (the default) the answer is the steady state: model state plus
    stored activations. With it on, `total_bytes` is the per-rank peak of a training step
    as PyTorch's `FSDPMemTracker` measures it. Gradient accumulation changes neither the
    activations (each micro-batch's are freed by its backward) nor, unless the gradients
    are held unsharded between micro-batches, the model state.

    On the certified grid (`python -m reference_impl.calc.memory_grid`) the peak is within 5% of
    the tracker's, tensor parallel (with and without sequence parallel) inside FSDP2
    included, against PyTorch's `MemTracker`; not modelled: tensor parallel of 4 or more
    without sequence parallel under recompute, where the peak moves into a block's RMSNorm
    backward (its fp32 tensors whole on every rank; 10% low on the reduced case). The
    pipeline and context-parallel terms are Megatron-LM's accounting, not certified. Not
    counted: the allocator's fragmentation and its cached free blocks, which depend on the
    order of allocations and on the allocator, not on sizes (PyTorch's
    `expandable_segments` makes them small).

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
        transients: Count what lives only at the step's peak (`memory_peak`).
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
    m = memory_inputs(locals())
    state, activations = memory_model_state(m), memory_stored_activations(m)
    out = {**{key: state[key] for key in MODEL_STATES}, "model_state_bytes": state["model_state_bytes"],
           "activation_bytes_per_layer": activations["activation_bytes_per_layer"],
           "activation_bytes": activations["activation_bytes"], "sharded_params_bytes": state["params_bytes"],
           "sharded_grads_bytes": state["grads_bytes"],
           "optimizer_state_bytes": state["master_bytes"] + state["optimizer_bytes"],
           "unsharded_params_bytes": 0.0, "all_gather_bytes": 0.0, "reduce_scatter_bytes": 0.0,
           "temporary_bytes": 0.0, "input_bytes": 0.0, "offloaded_bytes": state["offloaded_bytes"],
           "total_bytes": state["model_state_bytes"] + activations["activation_bytes"]}
    return {**out, **memory_peak(m)} if m.transients else out

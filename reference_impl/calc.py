"""Back-of-the-envelope calculators for the interview, each the twin of a browser calculator.

Every function here has a JavaScript twin in `docs/javascripts/calculators.js`:
`reference_impl.calc.<name>(**inputs)` and `window.handbookCalc.<name>(inputs)` take the
same inputs, apply the same defaults, and return dicts with the same keys and (to 1e-9)
the same numbers; the browser tests compare them on hundreds of random inputs. Both
reject a bad input the same way: Python raises `ValueError`, JavaScript throws an `Error`
with the same message, which the page shows in place of the result. `memory` is composed of
named parts (`memory_model_state`, `memory_attention_activations`, ... `memory_peak`), each a
function of the checked inputs with a twin of the same name in
`window.handbookCalcMemoryParts`; the browser tests compare them part by part.

Units are SI throughout: bytes (not GiB), seconds, bytes per second, FLOPs and FLOP/s.
The functions use only the standard library, so they run anywhere the handbook does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
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
    p, n, strategy = _positive("params", x["params"]), _count("world_size", x["world_size"]), x["strategy"]
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    s, b = _count("seq_len", x["seq_len"]), _count("micro_batch", x["micro_batch"])
    h, a, layers = _count("hidden", x["hidden"]), _count("n_heads", x["n_heads"]), _count("n_layers", x["n_layers"])
    if h % a:
        raise ValueError(f"hidden ({h}) must be a multiple of n_heads ({a})")
    checkpointing = _flag("activation_checkpointing", x["activation_checkpointing"])
    scores = _flag("stores_attention_scores", x["stores_attention_scores"])
    weights, grads = _positive("param_bytes", x["param_bytes"]), _non_negative("grad_bytes", x["grad_bytes"])
    master = _non_negative("master_bytes", x["master_bytes"])
    moments = _non_negative("optimizer_bytes", x["optimizer_bytes"])
    f = 4 * h if x["ffn_hidden"] is None else _count("ffn_hidden", x["ffn_hidden"])
    gated = _flag("gated_mlp", x["gated_mlp"])
    kv_heads = a if x["n_kv_heads"] is None else _count("n_kv_heads", x["n_kv_heads"])
    vocab = _count("vocab_size", x["vocab_size"], 0)
    t, pp = _count("tp_degree", x["tp_degree"]), _count("pp_degree", x["pp_degree"])
    cp = _count("cp_degree", x["cp_degree"])
    sp, c = _flag("sequence_parallel", x["sequence_parallel"]), _positive("compute_bytes", x["compute_bytes"])
    peak, selective = _flag("transients", x["transients"]), _flag("selective_recompute", x["selective_recompute"])
    offload, compiled = _flag("offload_optimizer", x["offload_optimizer"]), _flag("compiled_loss", x["compiled_loss"])
    accum, grad_sync = _count("grad_accum_steps", x["grad_accum_steps"]), x["fsdp_grad_sync"]
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

    On the certified grid (`python -m reference_impl.memory_grid`) the peak is within 5% of
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

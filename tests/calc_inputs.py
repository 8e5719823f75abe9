"""Random valid calculator inputs, shared by the pinned answers and the browser twin tests."""

from __future__ import annotations

import math
import random

from reference_impl import calc


def log_uniform(rng: random.Random, low: float, high: float) -> float:
    """A number spread evenly in orders of magnitude between `low` and `high`."""
    return 10 ** rng.uniform(math.log10(low), math.log10(high))


def maybe(rng: random.Random, inputs: dict, **optional) -> dict:
    """Give each optional input half the time, so the JavaScript defaults are compared too."""
    return {**inputs, **{k: v for k, v in optional.items() if rng.random() < 0.5}}


def memory_inputs(rng: random.Random) -> dict:
    """Valid `calc.memory` inputs over every option: strategies, recompute, TP/PP/CP, peaks."""
    # Heads as a product of key/value heads, so grouped-query attention and TP degrees divide.
    kv_heads, group, tp = rng.choice([1, 2, 8]), rng.choice([1, 4, 8]), rng.choice([1, 1, 2, 8])
    heads, pp = kv_heads * group * tp, rng.choice([1, 1, 2, 4])
    recompute = rng.choice(["none", "selective", "full"])
    return maybe(rng, {
        "params": log_uniform(rng, 1e5, 2e12), "world_size": rng.randint(1, 4096),
        "strategy": rng.choice(calc.STRATEGIES), "seq_len": 2 ** rng.randint(2, 17),
        "micro_batch": rng.randint(1, 64), "hidden": heads * rng.randint(1, 256), "n_heads": heads,
        "n_layers": pp * rng.randint(1, 40)},
        activation_checkpointing=recompute == "full", selective_recompute=recompute == "selective",
        stores_attention_scores=rng.random() < 0.5, offload_optimizer=rng.random() < 0.5,
        grad_accum_steps=rng.choice([1, 2, 8]), fsdp_grad_sync=rng.choice(["last", "every"]),
        param_bytes=rng.choice([1, 2, 4]), grad_bytes=rng.choice([0, 2, 4]),
        master_bytes=rng.choice([0, 4]), optimizer_bytes=rng.choice([0, 4, 8, 12]),
        ffn_hidden=rng.randint(1, 65_536), gated_mlp=rng.random() < 0.5, n_kv_heads=kv_heads * tp,
        vocab_size=rng.choice([0, 32_000, 128_256]), tp_degree=tp, pp_degree=pp, cp_degree=rng.choice([1, 2, 4]),
        sequence_parallel=rng.random() < 0.5, compute_bytes=rng.choice([1, 2, 4]), transients=rng.random() < 0.5,
        compiled_loss=rng.random() < 0.5)

"""Numeric mock-interview questions: templates whose answers the calculators compute.

Each template is data: a question with `{placeholders}`, a few choices for each
parameter, the calculator of `reference_impl.calc` that answers it, how the parameters
become that calculator's inputs, which output to read and in which unit, and the
follow-ups that change one parameter and ask again ("now double the GPUs"). The same
data, written to `docs/data/mock/questions.json` by `python -m reference_impl.interview.mock_questions`,
drives the mock-interview page, which draws parameters afresh per attempt and computes
the answer with the browser twin of the same calculator (`window.handbookCalc`).

An input of a calculator is spelled in the data as:

- a number, a boolean, or a string not starting with `$`: that literal;
- `"$name"`: the parameter `name`;
- a list: the product of its items, each a number or a `"$name"` (for units:
  `["$params_b", 1e9]` is billions of parameters).

The answer is `calc.<calc>(**inputs)[key] / unit_scale`, graded within `tolerance`
(relative). Every combination of the choices is a distinct question; `bank_size()` counts
them (follow-ups not included).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from reference_impl import calc

JSON_PATH = Path(__file__).resolve().parents[2] / "docs" / "data" / "mock" / "questions.json"
# Most answers are back-of-the-envelope figures: within 10% is right.
TOLERANCE = 0.10

Template = dict[str, Any]
Params = dict[str, Any]

# Sizes that every memory question shares but does not ask about (activations are not
# part of model state, so they do not change the answers that read model state).
_GPT_SHAPE = {"seq_len": 2048, "micro_batch": 1, "hidden": 4096, "n_heads": 32, "n_layers": 32}
_BILLIONS = ["$params_b", 1e9]
_GB_PER_S = ["$bandwidth_gbps", 1e9]

TEMPLATES: list[Template] = [
    {
        "id": "zero3_model_state",
        "topic": "memory",
        "title": "Model state per GPU under FSDP (ZeRO-3)",
        "question": "A {params_b}B-parameter model trains with Adam in bf16 mixed precision, fully "
                    "sharded (FSDP / ZeRO-3) over {world_size} GPUs. How much model state (weights, "
                    "gradients, master copy, Adam moments) does each GPU hold?",
        "params": {"params_b": [1, 3, 7, 8, 13, 34, 70], "world_size": [8, 16, 32, 64, 128]},
        "calc": "memory",
        "inputs": {**_GPT_SHAPE, "params": _BILLIONS, "world_size": "$world_size", "strategy": "fsdp"},
        "key": "model_state_bytes", "unit": "GB", "unit_scale": 1e9,
        "formula": "16 bytes/param (2 + 2 + 4 + 8) x {params_b}e9 / {world_size} GPUs",
        "follow_ups": [{"param": "world_size", "op": "double", "say": "Now double the GPUs to {world_size}."},
                       {"param": "params_b", "op": "double", "say": "Keep {world_size} GPUs and double "
                                                                   "the model to {params_b}B."}],
    },
    {
        "id": "partial_sharding_state",
        "topic": "memory",
        "title": "Model state per GPU under DDP, ZeRO-1 and ZeRO-2",
        "question": "A {params_b}B-parameter model trains with Adam in bf16 mixed precision on "
                    "{world_size} GPUs with {strategy}. How much model state does each GPU hold?",
        "params": {"params_b": [1, 2, 3, 7], "world_size": [4, 8, 16, 64], "strategy": ["ddp", "zero1", "zero2"]},
        "calc": "memory",
        "inputs": {**_GPT_SHAPE, "params": _BILLIONS, "world_size": "$world_size", "strategy": "$strategy"},
        "key": "model_state_bytes", "unit": "GB", "unit_scale": 1e9,
        "formula": "ddp: 16 x P; zero1: (2 + 2) x P + 12 x P / N; zero2: 2 x P + 14 x P / N; "
                   "P = {params_b}e9, N = {world_size}",
        "follow_ups": [{"param": "world_size", "op": "double", "say": "Now double the GPUs to {world_size}."}],
    },
    {
        "id": "activations_per_layer",
        "topic": "memory",
        "title": "Activations of one GPT layer",
        "question": "A GPT block with hidden size {hidden} (32 heads, fused attention, bf16) runs "
                    "{micro_batch} sequences of {seq_len} tokens. How much activation memory does one "
                    "layer store for backward?",
        "params": {"seq_len": [1024, 2048, 4096, 8192], "micro_batch": [1, 2, 4, 8],
                   "hidden": [2048, 4096, 5120, 8192]},
        "calc": "memory",
        "inputs": {"params": 1e9, "world_size": 1, "strategy": "ddp", "seq_len": "$seq_len",
                   "micro_batch": "$micro_batch", "hidden": "$hidden", "n_heads": 32, "n_layers": 1},
        "key": "activation_bytes_per_layer", "unit": "GB", "unit_scale": 1e9,
        "formula": "34 x seq x batch x hidden bytes = 34 x {seq_len} x {micro_batch} x {hidden}",
        "follow_ups": [{"param": "seq_len", "op": "double", "say": "Now double the sequence to {seq_len} tokens."},
                       {"param": "micro_batch", "op": "double", "say": "And double the micro-batch to {micro_batch}."}],
    },
    {
        "id": "checkpointed_activations",
        "topic": "memory",
        "title": "Activations with full activation checkpointing",
        "question": "A {n_layers}-layer GPT model, hidden size {hidden} (32 heads, bf16), runs one "
                    "sequence of {seq_len} tokens with full activation checkpointing. How much "
                    "activation memory is live at the peak (the stored layer inputs plus one layer "
                    "being recomputed)?",
        "params": {"n_layers": [24, 32, 48, 80], "hidden": [4096, 8192], "seq_len": [2048, 4096, 8192]},
        "calc": "memory",
        "inputs": {"params": 1e9, "world_size": 1, "strategy": "ddp", "seq_len": "$seq_len", "micro_batch": 1,
                   "hidden": "$hidden", "n_heads": 32, "n_layers": "$n_layers",
                   "activation_checkpointing": True},
        "key": "activation_bytes", "unit": "GB", "unit_scale": 1e9,
        "formula": "2 x seq x hidden x {n_layers} layers + 34 x seq x hidden (one layer); "
                   "seq = {seq_len}, hidden = {hidden}",
        "follow_ups": [{"param": "n_layers", "op": "double", "say": "Now double the depth to {n_layers} layers."}],
    },
    {
        "id": "ddp_allreduce_bytes",
        "topic": "bytes moved",
        "title": "Bytes a rank sends in DDP's ring all-reduce",
        "question": "DDP all-reduces the bf16 gradients of a {params_b}B-parameter model with a ring over "
                    "{world_size} GPUs. How many bytes does each GPU send per step?",
        "params": {"params_b": [1, 3, 7, 13, 70], "world_size": [2, 4, 8, 16, 64]},
        "calc": "ring_allreduce",
        "inputs": {"size_bytes": ["$params_b", 2e9], "world_size": "$world_size", "bandwidth_bytes_per_s": 1e11},
        "key": "bytes_per_rank", "unit": "GB", "unit_scale": 1e9,
        "formula": "2 (N - 1) / N x 2 bytes x {params_b}e9, N = {world_size}",
        "follow_ups": [{"param": "world_size", "op": "double", "say": "Now double the ring to {world_size} GPUs."}],
    },
    {
        "id": "ddp_allreduce_time",
        "topic": "bytes moved",
        "title": "Time of DDP's ring all-reduce",
        "question": "DDP all-reduces the bf16 gradients of a {params_b}B-parameter model over {world_size} "
                    "GPUs, each sending at {bandwidth_gbps} GB/s, not overlapped with compute. How long "
                    "does the all-reduce take (bandwidth term only)?",
        "params": {"params_b": [1, 7, 13], "world_size": [8, 16, 64], "bandwidth_gbps": [25, 50, 100, 400]},
        "calc": "ring_allreduce",
        "inputs": {"size_bytes": ["$params_b", 2e9], "world_size": "$world_size",
                   "bandwidth_bytes_per_s": _GB_PER_S},
        "key": "time_s", "unit": "ms", "unit_scale": 1e-3,
        "formula": "2 (N - 1) / N x 2 x {params_b}e9 bytes / {bandwidth_gbps}e9 B/s, N = {world_size}",
        "follow_ups": [{"param": "bandwidth_gbps", "op": "halve",
                        "say": "The job moves to a slower fabric: {bandwidth_gbps} GB/s."}],
    },
    {
        "id": "fsdp_bytes",
        "topic": "bytes moved",
        "title": "Bytes a rank sends per step under FSDP",
        "question": "FSDP shards a {params_b}B-parameter model over {world_size} GPUs, gathering bf16 "
                    "weights and reduce-scattering bf16 gradients; reshard_after_forward is "
                    "{reshard_after_forward}. How many bytes does each GPU send per step?",
        "params": {"params_b": [1, 7, 13, 70], "world_size": [8, 16, 64], "reshard_after_forward": [True, False]},
        "calc": "fsdp_comm",
        "inputs": {"params": _BILLIONS, "world_size": "$world_size", "bandwidth_bytes_per_s": 1e11,
                   "reshard_after_forward": "$reshard_after_forward"},
        "key": "bytes_per_rank", "unit": "GB", "unit_scale": 1e9,
        "formula": "(2 gathers if resharding, else 1, + 1 reduce-scatter) x (N - 1) / N x 2 bytes x "
                   "{params_b}e9, N = {world_size}",
        "follow_ups": [{"param": "params_b", "op": "double", "say": "Now double the model to {params_b}B."}],
    },
    {
        "id": "tp_bytes",
        "topic": "bytes moved",
        "title": "Bytes a rank sends for tensor parallelism",
        "question": "Megatron-style tensor parallelism of degree {tp_degree} runs a {n_layers}-layer model "
                    "(hidden {hidden}, bf16) on a micro-batch of {micro_batch} x {seq_len} tokens. How many "
                    "bytes does each GPU send for one micro-batch, forward and backward?",
        "params": {"seq_len": [2048, 4096], "micro_batch": [1, 2], "hidden": [4096, 8192],
                   "n_layers": [32, 80], "tp_degree": [2, 4, 8]},
        "calc": "tp_comm",
        "inputs": {"seq_len": "$seq_len", "micro_batch": "$micro_batch", "hidden": "$hidden",
                   "n_layers": "$n_layers", "tp_degree": "$tp_degree", "bandwidth_bytes_per_s": 1e11},
        "key": "bytes_per_microbatch", "unit": "GB", "unit_scale": 1e9,
        "formula": "{n_layers} layers x 4 all-reduces x 2 (t - 1) / t x 2 bytes x {micro_batch} x {seq_len} "
                   "x {hidden}, t = {tp_degree}",
        "follow_ups": [{"param": "tp_degree", "op": "double", "say": "Now double the TP degree to {tp_degree}."}],
    },
    {
        "id": "pp_bytes",
        "topic": "bytes moved",
        "title": "Bytes the busiest pipeline stage sends",
        "question": "A pipeline of {stages} stages runs a model with hidden size {hidden} (bf16) on a batch "
                    "of {micro_batch} x {seq_len} tokens. How many bytes does the busiest stage send "
                    "per step (activations forward, gradients back)?",
        "params": {"seq_len": [2048, 4096, 8192], "micro_batch": [1, 4], "hidden": [4096, 8192],
                   "stages": [2, 4, 8]},
        "calc": "pp_comm",
        "inputs": {"seq_len": "$seq_len", "micro_batch": "$micro_batch", "hidden": "$hidden",
                   "stages": "$stages", "bandwidth_bytes_per_s": 1e11},
        "key": "bytes_per_rank", "unit": "MB", "unit_scale": 1e6,
        "formula": "2 bytes x {micro_batch} x {seq_len} x {hidden}, twice for a middle stage "
                   "(only once with 2 stages)",
        "follow_ups": [{"param": "hidden", "op": "double", "say": "Now double the hidden size to {hidden}."}],
    },
    {
        "id": "moe_all_to_all",
        "topic": "all-to-all",
        "title": "Bytes a rank sends in an MoE dispatch all-to-all",
        "question": "An MoE layer with expert parallelism over {ep} GPUs routes each of a GPU's {tokens} "
                    "tokens to its top-{top_k} experts (hidden {hidden}, bf16, routing uniform over "
                    "experts). How many bytes does each GPU send in the dispatch all-to-all?",
        "params": {"tokens": [4096, 8192, 16384], "top_k": [1, 2, 8], "hidden": [2048, 4096, 7168],
                   "ep": [8, 16, 32, 64]},
        "calc": "moe_all_to_all",
        "inputs": {"tokens": "$tokens", "hidden": "$hidden", "top_k": "$top_k", "ep_degree": "$ep",
                   "bandwidth_bytes_per_s": 1e11, "activation_bytes": 2},
        "key": "bytes_per_all_to_all", "unit": "MB", "unit_scale": 1e6,
        "formula": "(E - 1) / E x {tokens} tokens x top-{top_k} x {hidden} x 2 bytes, E = {ep}",
        "follow_ups": [{"param": "top_k", "op": "double", "say": "Now route each token to {top_k} experts."},
                       {"param": "ep", "op": "double", "say": "Spread the experts over {ep} GPUs."}],
    },
    {
        "id": "bubble_1f1b",
        "topic": "bubble",
        "title": "Pipeline bubble of 1F1B",
        "question": "A 1F1B pipeline has {stages} stages and {microbatches} micro-batches per step. What "
                    "fraction of the step is bubble?",
        "params": {"stages": [2, 4, 8, 16], "microbatches": [4, 8, 16, 32, 64]},
        "calc": "pipeline_bubble",
        "inputs": {"stages": "$stages", "microbatches": "$microbatches"},
        "key": "bubble_fraction", "unit": "%", "unit_scale": 0.01,
        "formula": "(p - 1) / (m + p - 1), p = {stages}, m = {microbatches}",
        "follow_ups": [{"param": "microbatches", "op": "double",
                        "say": "Now double the micro-batches to {microbatches}."}],
    },
    {
        "id": "bubble_schedules",
        "topic": "bubble",
        "title": "Pipeline bubble of interleaved and zero-bubble schedules",
        "question": "A pipeline of {stages} stages runs {microbatches} micro-batches with the {schedule} "
                    "schedule and {interleave} model chunk(s) per stage. What fraction of the step is "
                    "bubble (a backward costs two forwards)?",
        "params": {"stages": [4, 8], "microbatches": [8, 16, 32], "interleave": [1, 2, 4],
                   "schedule": ["1f1b", "zero_bubble"]},
        "calc": "pipeline_bubble",
        "inputs": {"stages": "$stages", "microbatches": "$microbatches", "interleave": "$interleave",
                   "schedule": "$schedule"},
        "key": "bubble_fraction", "unit": "%", "unit_scale": 0.01,
        "formula": "1f1b: (p - 1) / (v m + p - 1); zero_bubble: (p - 1) / (3 v m + p - 1); "
                   "p = {stages}, m = {microbatches}, v = {interleave}",
        "follow_ups": [{"param": "microbatches", "op": "double",
                        "say": "Now double the micro-batches to {microbatches}."}],
    },
    {
        "id": "young_interval",
        "topic": "checkpoint interval",
        "title": "Checkpoint interval (Young)",
        "question": "A save blocks training for {cost_s} s and the job fails on average every "
                    "{mtbf_h} h. How often should it checkpoint (Young's first-order optimum)?",
        "params": {"cost_s": [10, 30, 60, 120, 300], "mtbf_h": [1, 2, 4, 8, 24]},
        "calc": "checkpoint_interval",
        "inputs": {"checkpoint_cost_s": "$cost_s", "mtbf_s": ["$mtbf_h", 3600]},
        "key": "young_interval_s", "unit": "min", "unit_scale": 60,
        "formula": "sqrt(2 C M) = sqrt(2 x {cost_s} s x {mtbf_h} x 3600 s)",
        "follow_ups": [{"param": "mtbf_h", "op": "halve",
                        "say": "The job doubles its GPUs, so the MTBF halves to {mtbf_h} h."},
                       {"param": "cost_s", "op": "halve", "say": "An async save cuts the block to {cost_s} s."}],
    },
    {
        "id": "young_overhead",
        "topic": "checkpoint interval",
        "title": "Time lost to checkpoints and recomputation (Young)",
        "question": "A save blocks training for {cost_s} s and the job fails on average every {mtbf_h} h. "
                    "At Young's optimal interval, what fraction of time goes to saving plus recomputing "
                    "lost work?",
        "params": {"cost_s": [10, 30, 60, 120, 300], "mtbf_h": [1, 2, 4, 8, 24]},
        "calc": "checkpoint_interval",
        "inputs": {"checkpoint_cost_s": "$cost_s", "mtbf_s": ["$mtbf_h", 3600]},
        "key": "young_overhead_fraction", "unit": "%", "unit_scale": 0.01,
        "formula": "C / tau + tau / (2 M) = sqrt(2 C / M), C = {cost_s} s, M = {mtbf_h} x 3600 s",
        "follow_ups": [{"param": "cost_s", "op": "double", "say": "The checkpoint grows: saves take {cost_s} s."}],
    },
    {
        "id": "mfu_from_throughput",
        "topic": "MFU",
        "title": "MFU from measured throughput",
        "question": "A {params_b}B-parameter dense model trains on {n_gpus} GPUs with a dense bf16 peak "
                    "of 989 TFLOP/s each; each GPU processes {tokens_per_s} tokens/s. What is the MFU "
                    "(6 x parameters FLOPs per token, ignore attention)?",
        "params": {"params_b": [7, 8, 13], "tokens_per_s": [1000, 2000, 3000, 4000, 6000],
                   "n_gpus": [8, 64, 512]},
        # One second of the whole job as the "step": samples are tokens.
        "calc": "mfu",
        "inputs": {"flops_per_sample": [6, "$params_b", 1e9], "samples_per_step": ["$tokens_per_s", "$n_gpus"],
                   "step_time_s": 1, "n_gpus": "$n_gpus", "peak_flops_per_gpu": 989e12},
        "key": "mfu", "unit": "%", "unit_scale": 0.01,
        "formula": "6 x {params_b}e9 FLOPs x {tokens_per_s} tokens/s / 989e12 FLOP/s (the GPU count cancels)",
        "follow_ups": [{"param": "params_b", "op": "double",
                        "say": "A {params_b}B model reaches the same tokens/s per GPU."}],
    },
    {
        "id": "step_time_from_mfu",
        "topic": "MFU",
        "title": "Step time from an assumed MFU",
        "question": "Plan a run: a {params_b}B-parameter dense model, {tokens_m}M tokens per step, "
                    "{n_gpus} GPUs at {peak_tflops} TFLOP/s dense bf16 each, {mfu_pct}% MFU. How long "
                    "is a step (6 x parameters FLOPs per token)?",
        "params": {"params_b": [7, 13, 34, 70], "tokens_m": [1, 2, 4], "n_gpus": [64, 256, 1024],
                   "peak_tflops": [312, 989], "mfu_pct": [30, 40, 50]},
        "calc": "step_time",
        "inputs": {"flops_per_sample": [6, "$params_b", 1e9], "samples_per_step": ["$tokens_m", 1e6],
                   "n_gpus": "$n_gpus", "peak_flops_per_gpu": ["$peak_tflops", 1e12], "mfu": ["$mfu_pct", 0.01]},
        "key": "step_time_s", "unit": "s", "unit_scale": 1,
        "formula": "6 x {params_b}e9 x {tokens_m}e6 FLOPs / ({n_gpus} x {peak_tflops}e12 x {mfu_pct}%)",
        "follow_ups": [{"param": "n_gpus", "op": "double", "say": "Now double the GPUs to {n_gpus}."},
                       {"param": "params_b", "op": "double", "say": "And double the model to {params_b}B."}],
    },
]

_OPS = {"double": lambda v: v * 2, "halve": lambda v: v / 2}


def resolve(template: Template, params: Params) -> dict[str, Any]:
    """The calculator's keyword inputs for one draw of a template's parameters."""
    def value(spec: Any) -> Any:
        if isinstance(spec, list):
            return math.prod(value(item) for item in spec)
        if isinstance(spec, str) and spec.startswith("$"):
            return params[spec[1:]]
        return spec
    return {name: value(spec) for name, spec in template["inputs"].items()}


def answer(template: Template, params: Params) -> float:
    """The template's answer in its unit, computed by `reference_impl.calc`."""
    result = getattr(calc, template["calc"])(**resolve(template, params))
    return result[template["key"]] / template["unit_scale"]


def draw(template: Template, rng: random.Random) -> Params:
    """One question: a choice for each parameter."""
    return {name: rng.choice(choices) for name, choices in template["params"].items()}


def follow_up(template: Template, params: Params, index: int) -> Params:
    """The parameters after the template's follow-up `index` changes one of them."""
    step = template["follow_ups"][index]
    return {**params, step["param"]: _OPS[step["op"]](params[step["param"]])}


def combinations(template: Template) -> Iterator[Params]:
    """Every distinct question of a template: each combination of its choices."""
    names = list(template["params"])
    for values in itertools.product(*(template["params"][n] for n in names)):
        yield dict(zip(names, values, strict=True))


def bank_size() -> int:
    """Distinct questions over all templates (follow-ups not counted)."""
    return sum(math.prod(len(c) for c in t["params"].values()) for t in TEMPLATES)


def to_json() -> str:
    """The bank as the page reads it."""
    return json.dumps({"tolerance": TOLERANCE, "templates": TEMPLATES}, indent=1) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write the page's copy of the bank, or check that it is current (`--check`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the JSON file is stale")
    args = parser.parse_args(argv)
    if args.check:
        current = JSON_PATH.read_text() == to_json() if JSON_PATH.exists() else False
        fix = "stale: run python -m reference_impl.interview.mock_questions"
        print(f"{JSON_PATH}: {'current' if current else fix}")
        return 0 if current else 1
    JSON_PATH.write_text(to_json())
    print(f"wrote {JSON_PATH}: {len(TEMPLATES)} templates, {bank_size()} distinct questions")
    return 0


if __name__ == "__main__":
    sys.exit(main())

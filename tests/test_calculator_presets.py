"""The calculators' presets (docs/javascripts/calculator_presets.json) are inputs the Python
twins accept, with the models' real shapes, and reproduce the figures the handbook states.

The page's forms read the same file (docs/javascripts/calculators.js);
tests/browser/test_calculators.py checks that picking a preset fills each form with it.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

from reference_impl import calc
from reference_impl.config import TrainConfig
from reference_impl.calc.memory_grid import LLAMA3_70B, LLAMA3_405B, Shape, llama_params
from reference_impl.model import build_model

ROOT = Path(__file__).resolve().parents[1]
TABLE = json.loads((ROOT / "docs" / "javascripts" / "calculator_presets.json").read_text(encoding="utf-8"))
PRESETS = {p["name"]: p for p in TABLE["presets"]}
CALCULATORS = ("memory", "ring_allreduce", "fsdp_comm", "tp_comm", "pp_comm", "moe_all_to_all",
               "pipeline_bubble", "checkpoint_interval", "goodput", "mfu", "step_time")
NOT_ON_FORM = {"memory": {"compiled_loss"}}  # inputs no form field sets
LLAMA = {"Llama 3 8B on 8 GPUs": Shape("Llama-3 8B", 4096, 32, 32, 8, 14336, 128256),
         "Llama 3 70B on 64 GPUs": LLAMA3_70B, "Llama 3 405B on 16,384 GPUs": LLAMA3_405B}
CASES = [(p["name"], name) for p in TABLE["presets"] for name in p["inputs"]]


def test_every_calculator_has_a_preset_and_the_brief_models_are_there() -> None:
    assert {name for _, name in CASES} == set(CALCULATORS)
    assert {"GPT-2 small on one H100", *LLAMA} <= set(PRESETS)


@pytest.mark.parametrize(("preset", "name"), CASES)
def test_each_preset_gives_every_input_and_its_twin_accepts_it(preset: str, name: str) -> None:
    inputs = PRESETS[preset]["inputs"][name]
    keywords = set(inspect.signature(getattr(calc, name)).parameters) - NOT_ON_FORM.get(name, set())
    assert set(inputs) == keywords, f"{preset} / {name}: give every input the form has, no other"
    result = getattr(calc, name)(**inputs)
    assert result and all(v == v for v in result.values() if isinstance(v, float)), result  # no NaN


@pytest.mark.parametrize("preset", sorted(LLAMA))
def test_the_llama_presets_have_the_models_real_shapes(preset: str) -> None:
    shape = LLAMA[preset]
    memory = PRESETS[preset]["inputs"]["memory"]
    assert memory["params"] == llama_params(shape)
    assert (memory["hidden"], memory["n_layers"], memory["n_heads"], memory["n_kv_heads"], memory["ffn_hidden"],
            memory["vocab_size"], memory["gated_mlp"]) == (shape.hidden, shape.n_layers, shape.n_heads,
                                                           shape.n_kv_heads, shape.ffn_hidden, shape.vocab_size, True)
    for name in ("tp_comm", "pp_comm"):
        if name in PRESETS[preset]["inputs"]:
            assert PRESETS[preset]["inputs"][name]["hidden"] == shape.hidden


def test_the_llama_3_8b_70b_405b_shapes_are_the_published_ones() -> None:
    published = {"Llama 3 8B on 8 GPUs": (4096, 32, 32, 8, 14336), "Llama 3 70B on 64 GPUs": (8192, 80, 64, 8, 28672),
                 "Llama 3 405B on 16,384 GPUs": (16384, 126, 128, 8, 53248)}
    for preset, (d, layers, heads, kv, ffn) in published.items():
        m = PRESETS[preset]["inputs"]["memory"]
        assert (m["hidden"], m["n_layers"], m["n_heads"], m["n_kv_heads"], m["ffn_hidden"], m["vocab_size"]) == \
            (d, layers, heads, kv, ffn, 128256), preset
    assert PRESETS["Llama 3 405B on 16,384 GPUs"]["inputs"]["step_time"]["n_gpus"] == 16_384
    assert PRESETS["Llama 3 70B on 64 GPUs"]["inputs"]["step_time"]["n_gpus"] == 64
    assert PRESETS["Llama 3 8B on 8 GPUs"]["inputs"]["step_time"]["n_gpus"] == 8


def test_the_gpt2_preset_is_the_committed_h100_run() -> None:
    """Memory gives that run's predicted peak, MFU its measured MFU, on the trainer's model."""
    run = json.loads((ROOT / "docs" / "data" / "gpu_small.json").read_text(encoding="utf-8"))
    eager = next(s for s in run["data"]["steps"] if s["label"] == "eager")["result"]
    inputs = PRESETS["GPT-2 small on one H100"]["inputs"]
    memory = inputs["memory"]
    cfg = TrainConfig(model="transformer", d_model=memory["hidden"], n_layers=memory["n_layers"],
                      n_heads=memory["n_heads"], hidden_dim=memory["ffn_hidden"], vocab_size=memory["vocab_size"],
                      seq_len=memory["seq_len"], micro_batch_size=memory["micro_batch"])
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.hidden_dim) == (768, 12, 12, 3072)  # GPT-2 small
    assert memory["params"] == sum(p.numel() for p in build_model(cfg).parameters())
    assert memory["seq_len"] == eager["seq_len"] and memory["micro_batch"] == eager["global_batch_size"]
    peak_gib = calc.memory(**memory)["total_bytes"] / 2**30
    assert round(peak_gib, 3) == eager["ddp"]["predicted_memory_gib"]["peak"]
    mfu = inputs["mfu"]
    assert mfu["flops_per_sample"] == eager["flops_per_sample"]
    assert mfu["peak_flops_per_gpu"] == eager["peak_bf16_flops"]
    assert calc.mfu(**mfu)["mfu"] == pytest.approx(eager["ddp"]["mfu"], abs=5e-5)


def test_the_70b_preset_is_the_worked_searchs_fsdp_64_figure() -> None:
    """The playbook's 34.3 GB per GPU: FSDP over 64 with recompute, the memory grid's own row."""
    grid = json.loads((ROOT / "docs" / "data" / "memory_grid.json").read_text(encoding="utf-8"))
    row = next(r for r in grid["data"]["rows"] if r["config"] == "Llama-3 70B, 80 layers, FSDP 64, seq 4096, AC on")
    total = calc.memory(**PRESETS["Llama 3 70B on 64 GPUs"]["inputs"]["memory"])["total_bytes"]
    assert total == pytest.approx(row["calculator"]["total_bytes"], rel=1e-12)


def test_the_failure_rate_is_llama_3_405bs_per_gpu() -> None:
    """419 unexpected interruptions in 54 days on 16,384 GPUs, scaled to each cluster's size."""
    per_gpu_s = 54 * 24 * 3600 / 419 * 16_384
    for preset in PRESETS.values():
        interval = preset["inputs"].get("checkpoint_interval")
        if interval:
            gpus = next(v["n_gpus"] for k, v in preset["inputs"].items() if k in ("step_time", "mfu"))
            assert interval["mtbf_s"] == pytest.approx(per_gpu_s / gpus, abs=0.1), preset["name"]
    for preset in PRESETS.values():
        goodput = preset["inputs"].get("goodput")
        if goodput:
            assert goodput["mtbf_gpu_hours"] == pytest.approx(per_gpu_s / 3600, abs=0.1), preset["name"]

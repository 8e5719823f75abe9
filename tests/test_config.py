"""TrainConfig: validation, the CLI contract and a digest that is stable across processes."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from typing import Any, Literal, get_args, get_origin, get_type_hints

import pytest

from launch import REPO, python_module
from reference_impl.config import RESUMABLE_PARTS, ConfigError, TrainConfig, build_parser, field_docs


def test_every_field_is_documented_and_becomes_a_flag() -> None:
    docs = field_docs()
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    assert set(docs) == set(names), f"undocumented: {set(names) - set(docs)}"
    help_text = build_parser().format_help()
    for name in names:
        if name != "world_size":  # comes from torchrun's environment, not a flag
            assert "--" + name.replace("_", "-") in help_text


def test_global_batch_size_counts_micro_batches_accumulation_and_ranks() -> None:
    cfg = TrainConfig.from_cli(["--micro-batch-size", "8", "--grad-accum-steps", "4"], {"WORLD_SIZE": "2"})
    assert cfg.global_batch_size == 64


# A base where every field can change on its own to another valid value: FSDP and the
# transformer (so activation checkpointing, async saves and per-micro-batch sync are
# allowed), a checkpoint directory (so checkpoint_every is) and four ranks (so fail_rank 1 and
# dp_replicate 2, two replica groups of two shards, are).
DIGEST_BASE = TrainConfig(strategy="fsdp", model="transformer", checkpoint_dir="ckpt", world_size=4)
# A field valid away from its default only together with others (expert parallel needs the
# experts it splits and, here, a world of its size; an interleaved schedule's virtual stages need
# that schedule; a context-parallel style needs cp ranks) changes alone from a base that has them.
COMPANIONS: dict[str, dict[str, Any]] = {"ep_degree": {"n_experts": 4, "world_size": 2, "strategy": "ddp"},
                                         "pp_virtual_stages": {"pp_schedule": "interleaved-1f1b"},
                                         "cp_style": {"cp_degree": 2}}


def _base(name: str) -> TrainConfig:
    """The config that field `name` changes from: `DIGEST_BASE` with its companions set."""
    return dataclasses.replace(DIGEST_BASE, **COMPANIONS.get(name, {}))


def _alternatives(name: str, value: Any) -> list[Any]:
    """Candidate values for field `name` other than `value`, derived from its type."""
    hint = get_type_hints(TrainConfig)[name]
    if get_origin(hint) is Literal:
        return [c for c in get_args(hint) if c != value]
    if hint is bool:
        return [not value]
    if hint in (int, float):
        return [v for v in (value + 1, value * 2, value - 1, value / 2, value + 0.5) if v != value and type(v) is hint]
    if get_origin(hint) is tuple:
        item = get_args(hint)[0]
        pool = [1, 2, 5] if item is int else [*RESUMABLE_PARTS, *(f.name for f in dataclasses.fields(TrainConfig))]
        return [(v,) for v in pool if (v,) != value]
    return [v for v in ("elsewhere", None) if v != value]  # optional paths


def digest_variants() -> dict[str, TrainConfig]:
    """For each field of TrainConfig, its `_base` with only that field changed (validly)."""
    variants = {}
    for f in dataclasses.fields(TrainConfig):
        for candidate in _alternatives(f.name, getattr(_base(f.name), f.name)):
            try:
                variants[f.name] = dataclasses.replace(_base(f.name), **{f.name: candidate})
                break
            except ConfigError:
                continue
    return variants


def test_digest_changes_with_any_field_and_ignores_nothing() -> None:
    """Every field, changed alone to another valid value, changes the digest: a checkpoint's
    config identity cannot miss a field, including fields added later (they are found by
    `dataclasses.fields`, and a field with no valid alternative fails here)."""
    variants = digest_variants()
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    assert sorted(variants) == sorted(names), f"no valid alternative for {set(names) - set(variants)}"
    assert DIGEST_BASE.digest() == TrainConfig(**dataclasses.asdict(DIGEST_BASE)).digest()
    digests = {name: cfg.digest() for name, cfg in variants.items()}
    unchanged = [name for name, d in digests.items() if d == _base(name).digest()]
    assert not unchanged, f"the digest ignores {unchanged}"
    assert len(set(digests.values())) == len(digests), "two different configs share a digest"


def test_digest_is_identical_across_processes_with_different_hash_seeds() -> None:
    """Python's hash() is salted per process; a compatibility check built on it fails.
    Two processes with different salts rebuild every variant config from its fields (JSON,
    importing nothing but the config module) and give the digests this process gives."""
    variants = digest_variants()
    fields = json.dumps({name: dataclasses.asdict(cfg) for name, cfg in variants.items()})
    code = ("import json, sys; from reference_impl.config import TrainConfig;"
            "variants = json.loads(sys.stdin.read());"
            "print(json.dumps({n: TrainConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in f.items()})"
            ".digest() for n, f in variants.items()}), hash('salted'))")
    runs = [subprocess.run([sys.executable, "-c", code], input=fields, capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONHASHSEED": seed}, cwd=REPO) for seed in ("1", "2")]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    (d1, h1), (d2, h2) = (r.stdout.rsplit(maxsplit=1) for r in runs)
    assert h1 != h2, "the two processes really had different hash salts"
    assert json.loads(d1) == json.loads(d2) == {name: cfg.digest() for name, cfg in variants.items()}


BAD_FLAGS = [
    (["--micro-batch-size", "0"], "micro_batch_size must be >= 1"),
    (["--precision", "fp8"], "invalid choice: 'fp8'"),
    (["--grad-accum-steps", "0"], "grad_accum_steps must be >= 1"),
    (["--grad-accum-steps", "-2"], "grad_accum_steps must be >= 1"),
    (["--strategy", "zero3"], "invalid choice: 'zero3'"),
    (["--lr", "nan"], "lr must be a positive finite number"),
    (["--lr", "abc"], "invalid float value"),
    (["--max-steps", "0"], "max_steps must be >= 1"),
    (["--warmup-steps", "500", "--max-steps", "100"], "must not exceed max_steps"),
    (["--model", "transformer", "--d-model", "60", "--n-heads", "8"], "must divide d_model"),
    (["--dataset-size", "16", "--micro-batch-size", "32"], "smaller than one global batch"),
    (["--checkpoint-every", "10"], "checkpoint_every needs checkpoint_dir"),
    (["--fail-at-step", "500", "--max-steps", "100"], "fail_at_step must be in"),
    (["--dropout", "1.0"], "dropout must be in"),
    (["--num-workers", "-1"], "num_workers must be >= 0"),
    (["--fail-slow-s", "0"], "fail_slow_s must be a positive finite number"),
    (["--fail-slow-s", "inf"], "fail_slow_s must be a positive finite number"),
    (["--fail-slow-s", "4000"], "fail_slow_s must be at most 3600"),
    (["--straggler-threshold", "1"], "straggler_threshold must be above 1"),
    (["--straggler-threshold", "nan"], "straggler_threshold must be a positive finite number"),
    (["--straggler-window", "0"], "straggler_window must be >= 1"),
    (["--straggler-patience", "0"], "straggler_patience must be >= 1"),
    (["--fail-mode", "slowly"], "invalid choice: 'slowly'"),
    (["--nonfinite-policy", "ignore"], "invalid choice: 'ignore'"),
    (["--nonfinite-policy", "rollback"], "nonfinite_policy rollback needs checkpoint_dir"),
    (["--nonfinite-policy", "skip", "--precision", "fp16"], "need --precision fp32 or bf16"),
    (["--fail-mode", "nan", "--fail-at-step", "3", "--precision", "fp16"], "need --precision fp32 or bf16"),
    (["--no-such-flag"], "unrecognized arguments"),
]


@pytest.mark.parametrize("flags,message", BAD_FLAGS)
def test_bad_flag_raises_config_error(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        TrainConfig.from_cli(flags, {})


def test_fail_rank_is_checked_against_the_world_size() -> None:
    with pytest.raises(ConfigError, match="fail_rank"):
        TrainConfig.from_cli(["--fail-rank", "2"], {"WORLD_SIZE": "2"})


@pytest.mark.parametrize("flags,message", [BAD_FLAGS[0], BAD_FLAGS[1], BAD_FLAGS[2], BAD_FLAGS[-1],
                                           BAD_FLAGS[-5], BAD_FLAGS[-12]])
def test_cli_exits_2_with_one_line_before_any_process_group(flags: list[str], message: str) -> None:
    run = python_module(flags, timeout=60)
    assert run.returncode == 2
    assert run.stdout == "", "nothing started, so no event was printed"
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("reference_impl.train: error:")


def test_cli_rejects_bad_flags_under_torchrun_before_rendezvous() -> None:
    """Under torchrun WORLD_SIZE is set; a bad flag still fails before init_process_group."""
    run = python_module(["--micro-batch-size", "0"], timeout=60,
                        env={"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0",
                             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
    assert run.returncode == 2, run.stderr


TP_ERRORS = [
    (["--tp-degree", "3", "--model", "transformer"], "2", "tp_degree (3) must divide the world size (2)"),
    (["--tp-degree", "2"], "2", "needs --model transformer"),
    (["--tp-degree", "2", "--model", "transformer", "--n-heads", "1"], "2", "must divide n_heads (1)"),
    (["--tp-degree", "2", "--model", "transformer", "--seq-len", "33"], "2",
     "tp_degree (2) must divide seq_len (33): tensor parallel splits it evenly"),
    (["--tp-degree", "2", "--model", "transformer", "--vocab-size", "63"], "2",
     "tp_degree (2) must divide vocab_size (63): tensor parallel splits it evenly"),
    (["--tp-degree", "2", "--model", "transformer", "--hidden-dim", "127"], "2",
     "tp_degree (2) must divide hidden_dim (127): tensor parallel splits it evenly"),
    (["--tp-degree", "2", "--model", "transformer"], "4", "needs --strategy fsdp"),
]
PP = ["--model", "transformer", "--pp-degree", "2"]
PP_ERRORS = [
    (PP, "3", "pp_degree (2) x tp_degree (1) must divide the world size (3)"),
    (["--pp-degree", "2"], "2", "pp_degree above 1 needs --model transformer"),
    ([*PP, "--n-layers", "1"], "2", "pp_degree (2) must not exceed n_layers (1)"),
    ([*PP, "--pp-microbatches", "1"], "2", "pp_microbatches (1) must be at least pp_degree (2)"),
    ([*PP, "--pp-microbatches", "3", "--micro-batch-size", "8"], "2",
     "pp_microbatches (3) must divide micro_batch_size (8)"),
    ([*PP, "--precision", "fp16"], "2", "needs --precision fp32 or bf16"),
    ([*PP, "--nonfinite-policy", "skip"], "2", "need pp_degree 1"),
    ([*PP, "--fail-mode", "nan", "--fail-at-step", "2"], "2", "need pp_degree 1"),
    ([*PP, "--tp-degree", "2", "--strategy", "fsdp"], "4", "pp_degree and tp_degree cannot both be above 1"),
    (["--pp-microbatches", "4"], "1", "pp_microbatches needs --pp-degree above 1"),
    (PP, "4", "pipeline stages with more than one data-parallel rank need --strategy fsdp"),
    ([*PP, "--pp-virtual-stages", "3"], "2", "pp_virtual_stages needs --pp-schedule interleaved-1f1b"),
    ([*PP, "--pp-schedule", "interleaved-1f1b", "--pp-virtual-stages", "0"], "2", "pp_virtual_stages must be >= 1"),
    ([*PP, "--pp-schedule", "interleaved-1f1b", "--n-layers", "6"], "2",
     "n_layers (6) must be a multiple of pp_degree x pp_virtual_stages (4)"),
    ([*PP, "--pp-schedule", "interleaved-1f1b", "--n-layers", "4", "--pp-microbatches", "3",
      "--micro-batch-size", "6"], "2", "pp_microbatches (3) must be a multiple of pp_degree (2)"),
    ([*PP, "--pp-schedule", "interleaved-1f1b", "--n-layers", "4", "--strategy", "fsdp"], "4",
     "interleaved-1f1b runs with one data-parallel rank per stage"),
]
HSDP = ["--strategy", "fsdp", "--model", "transformer", "--dp-replicate", "2"]
HSDP_ERRORS = [
    (["--dp-replicate", "2"], "4", "dp_replicate above 1 needs --strategy fsdp"),
    (HSDP, "3", "dp_replicate (2) must divide the data-parallel size (3)"),
    (HSDP, "2", "dp_replicate (2) equals the data-parallel size"),
    ([*HSDP, "--tp-degree", "2"], "8", "dp_replicate above 1 runs with tp_degree and pp_degree 1"),
    (["--dp-replicate", "0"], "1", "dp_replicate must be >= 1"),
]

CP = ["--model", "transformer", "--cp-degree", "2"]
ULYSSES_HEADS = ([*CP, "--cp-style", "ulysses", "--n-heads", "1"], "2",
                 "cp_style ulysses needs cp_degree (2) to divide n_heads (1): each cp rank attends with whole heads")
CP_ERRORS = [
    (["--cp-degree", "2"], "2", "cp_degree above 1 needs --model transformer with dropout 0"),
    ([*CP, "--dropout", "0.1"], "2", "cp_degree above 1 needs --model transformer with dropout 0"),
    ([*CP, "--seq-len", "30"], "2", "2 x cp_degree (4) must divide seq_len (30)"),
    (CP, "3", "cp_degree (2) must divide the world size (3)"),
    ([*CP, "--tp-degree", "2", "--strategy", "fsdp"], "4", "cp_degree above 1 runs with tp_degree, pp_degree"),
    ([*CP, "--compile"], "2", "cp_degree above 1 runs without --compile"),
    (["--cp-degree", "0"], "1", "cp_degree must be >= 1"),
    ULYSSES_HEADS,
    (["--cp-style", "ulysses"], "1", "cp_style ulysses needs --cp-degree above 1"),
    ([*CP, "--cp-style", "star"], "2", "argument --cp-style: invalid choice: 'star' (choose from 'ring', 'ulysses')"),
]
MOE = ["--model", "transformer", "--n-experts", "4"]
EP_ERRORS = [
    (["--n-experts", "4"], "1", "n_experts needs --model transformer"),
    (["--n-experts", "-1"], "1", "n_experts must be >= 0"),
    (["--ep-degree", "2", "--model", "transformer"], "2", "ep_degree above 1 needs --n-experts"),
    ([*MOE, "--ep-degree", "0"], "1", "ep_degree must be >= 1"),
    ([*MOE, "--ep-degree", "3"], "3", "ep_degree (3) must divide n_experts (4)"),
    ([*MOE, "--ep-degree", "2"], "3", "ep_degree (2) must divide the data-parallel size (3)"),
    ([*MOE, "--ep-degree", "4"], "2", "ep_degree (4) must divide the data-parallel size (2)"),
    ([*MOE, "--ep-degree", "2", "--strategy", "fsdp"], "2", "ep_degree above 1 needs --strategy ddp"),
    ([*MOE, "--tp-degree", "2", "--strategy", "fsdp"], "2", "n_experts runs with tp_degree, pp_degree, cp_degree"),
    ([*MOE, "--cp-degree", "2"], "2", "n_experts runs with tp_degree, pp_degree, cp_degree"),
    ([*MOE, "--pp-degree", "2"], "2", "n_experts runs with tp_degree, pp_degree, cp_degree"),
    ([*MOE, "--strategy", "fsdp", "--dp-replicate", "2"], "4", "n_experts runs with tp_degree, pp_degree"),
    ([*MOE, "--compile"], "1", "n_experts runs without --compile, --fp8 and --activation-checkpointing"),
    ([*MOE, "--fp8"], "1", "n_experts runs without --compile, --fp8 and --activation-checkpointing"),
    ([*MOE, "--activation-checkpointing"], "1", "n_experts runs without --compile"),
    ([*MOE, "--moe-aux-loss-coef", "-0.1"], "1", "moe_aux_loss_coef must be a finite number >= 0"),
]


@pytest.mark.parametrize("flags,world,message", TP_ERRORS + PP_ERRORS + HSDP_ERRORS + CP_ERRORS + EP_ERRORS)
def test_a_mesh_that_does_not_fit_is_a_config_error(flags: list[str], world: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        TrainConfig.from_cli(flags, {"WORLD_SIZE": world})


def test_tensor_parallel_ranks_share_their_samples_in_the_global_batch() -> None:
    flags = ["--strategy", "fsdp", "--model", "transformer", "--tp-degree", "2", "--micro-batch-size", "8"]
    cfg = TrainConfig.from_cli(flags, {"WORLD_SIZE": "4"})
    assert cfg.data_parallel_size == 2 and cfg.global_batch_size == 16


def test_context_parallel_ranks_share_their_samples_in_the_global_batch() -> None:
    cfg = TrainConfig.from_cli([*CP, "--micro-batch-size", "8"], {"WORLD_SIZE": "4"})
    assert cfg.data_parallel_size == 2 and cfg.global_batch_size == 16


def test_expert_parallel_ranks_are_data_ranks_that_read_their_own_samples() -> None:
    """ep no longer multiplies the world: 4 ranks at ep 2 are 4 data ranks (two ep groups),
    with dropout allowed (each rank draws its own masks, as under DDP)."""
    cfg = TrainConfig.from_cli([*MOE, "--ep-degree", "2", "--micro-batch-size", "8", "--dropout", "0.1"],
                               {"WORLD_SIZE": "4"})
    assert cfg.data_parallel_size == 4 and cfg.global_batch_size == 32


def test_hsdp_keeps_the_global_batch_over_replicas_times_shards() -> None:
    cfg = TrainConfig.from_cli([*HSDP, "--micro-batch-size", "4", "--grad-accum-steps", "2"], {"WORLD_SIZE": "4"})
    assert cfg.data_parallel_size == 4 and cfg.global_batch_size == 32


def test_pipeline_stages_share_their_samples_and_default_to_one_micro_batch_each() -> None:
    cfg = TrainConfig.from_cli([*PP, "--strategy", "fsdp", "--micro-batch-size", "8"], {"WORLD_SIZE": "4"})
    assert cfg.data_parallel_size == 2 and cfg.global_batch_size == 16 and cfg.pipeline_microbatches == 2


@pytest.mark.parametrize("flags,message", [TP_ERRORS[0][::2], ULYSSES_HEADS[::2]],
                         ids=["tp_degree", "ulysses_heads"])
def test_a_bad_mesh_exits_2_under_torchrun_before_rendezvous(flags: list[str], message: str) -> None:
    """MASTER_PORT 1 has no store behind it: reaching init_process_group would fail otherwise."""
    run = python_module(flags, timeout=60, env={"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0",
                                                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines

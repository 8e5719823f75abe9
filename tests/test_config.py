"""TrainConfig: validation, the CLI contract and a digest that is stable across processes."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from launch import python_module, run_command
from reference_impl.config import ConfigError, TrainConfig, build_parser, field_docs


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


def test_digest_changes_with_any_field_and_ignores_nothing() -> None:
    base = TrainConfig()
    assert base.digest() == TrainConfig().digest()
    assert base.digest() != dataclasses.replace(base, lr=base.lr * 2).digest()
    assert base.digest() != dataclasses.replace(base, world_size=2).digest()


def test_digest_is_identical_across_processes_with_different_hash_seeds() -> None:
    """Python's hash() is salted per process; a compatibility check built on it fails."""
    code = ("from reference_impl.config import TrainConfig;"
            "print(TrainConfig(model='transformer').digest(), hash('salted'))")
    runs = [run_command([sys.executable, "-c", code], 60, env={"PYTHONHASHSEED": seed})
            for seed in ("1", "2")]
    (d1, h1), (d2, h2) = (r.stdout.split() for r in runs)
    assert h1 != h2, "the two processes really had different hash salts"
    assert d1 == d2


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
    (["--no-such-flag"], "unrecognized arguments"),
]


@pytest.mark.parametrize("flags,message", BAD_FLAGS)
def test_bad_flag_raises_config_error(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        TrainConfig.from_cli(flags, {})


def test_fail_rank_is_checked_against_the_world_size() -> None:
    with pytest.raises(ConfigError, match="fail_rank"):
        TrainConfig.from_cli(["--fail-rank", "2"], {"WORLD_SIZE": "2"})


@pytest.mark.parametrize("flags,message", [BAD_FLAGS[0], BAD_FLAGS[1], BAD_FLAGS[2], BAD_FLAGS[-1]])
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

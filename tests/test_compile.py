"""`--compile` on the CPU (inductor): the same losses as eager, one graph for the blocks and
one for the loss, and checkpoints that move freely between compiled and eager runs."""

from __future__ import annotations

import io
import shutil

import pytest
import torch

from reference_impl.config import ConfigError, TrainConfig
from reference_impl.distributed import DistContext
from reference_impl.launch import parse_events
from reference_impl.metrics import EventLog
from reference_impl.model import build_model
from reference_impl.parallel.registry import dims_of, parallelize
from reference_impl.state import state_digest
from reference_impl.train import train

# One block type, compiled once (dynamo traces the first block and reuses the graph for
# the second): the compile takes seconds, not the minutes a bigger model would.
TINY = dict(model="transformer", d_model=32, n_layers=2, n_heads=2, hidden_dim=64, seq_len=16,
            vocab_size=64, dataset_size=128, micro_batch_size=8, warmup_steps=1, log_every=1)


class Crash(Exception):
    pass


def crash_at(step: int):
    def on_step(state) -> None:
        if state.step == step:
            raise Crash(f"stopped at step {step}")
    return on_step


def run(on_step=None, **fields) -> tuple[dict[str, list[dict]], str]:
    """Train in this process; the events by name, and the final state's digest."""
    stream = io.StringIO()
    state = train(TrainConfig(**{**TINY, **fields}), DistContext(), EventLog(0, stream), on_step=on_step)
    events: dict[str, list[dict]] = {}
    for event in parse_events(stream.getvalue()):
        events.setdefault(event["event"], []).append(event)
    return events, state_digest(state.model, state.optimizer)


@pytest.mark.slow
def test_compiled_training_matches_eager_resumes_exactly_and_shares_its_checkpoints(tmp_path) -> None:
    from torch._dynamo.utils import counters

    counters.clear()
    eager, _ = run(max_steps=6)
    compiled, compiled_digest = run(max_steps=6, compile=True)
    losses = [[e["loss"] for e in r["step"]] for r in (eager, compiled)]
    # Inductor fuses and reorders float math: equal to rounding, not bit for bit.
    assert losses[1] == pytest.approx(losses[0], rel=1e-5), losses
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    # Two graphs: one traced once that serves both blocks, and the loss's.
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])

    # Stopped after step 5 (checkpoint at 3) and resumed compiled: bit-exact.
    ckpt = tmp_path / "ckpt"
    with pytest.raises(Crash):
        run(crash_at(5), max_steps=6, compile=True, checkpoint_dir=str(ckpt), checkpoint_every=3)
    shutil.copytree(ckpt, tmp_path / "copy")
    resumed, digest = run(max_steps=6, compile=True, checkpoint_dir=str(ckpt), checkpoint_every=3)
    assert [e["step"] for e in resumed["checkpoint_restored"]] == [3]
    assert digest == compiled_digest

    # The same compiled checkpoint resumes an eager run: same names, same state.
    eager_resumed, _ = run(max_steps=6, checkpoint_dir=str(tmp_path / "copy"), checkpoint_every=3)
    assert [e["step"] for e in eager_resumed["checkpoint_restored"]] == [3]
    assert eager_resumed["step"][-1]["loss"] == pytest.approx(losses[1][-1], rel=1e-5)


def test_compile_keeps_parameter_names_and_hooks_outside_the_compiled_code() -> None:
    cfg = TrainConfig(**TINY, compile=True)
    eager_names = list(build_model(TrainConfig(**TINY)).state_dict())
    model = parallelize(build_model(cfg), dims_of(cfg), cfg, DistContext())
    assert list(model.state_dict()) == eager_names, "no _orig_mod. prefix: checkpoints stay portable"
    block = model.get_submodule("blocks.0")
    assert hasattr(block.forward, "_torchdynamo_orig_callable"), "the block's forward is the compiled one"
    assert not hasattr(type(block).__call__, "_torchdynamo_orig_callable"), "__call__ (with hooks) stays eager"
    torch._dynamo.reset()


def test_compile_with_a_pipeline_is_refused() -> None:
    with pytest.raises(ConfigError, match="compile does not combine with pp_degree"):
        TrainConfig.from_cli(["--compile", "--pp-degree", "2", "--model", "transformer"], {"WORLD_SIZE": "2"})

"""The sampler contract: deterministic, disjoint, complete, resumable, world-size agnostic."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from reference_impl.data import ResumableDistributedSampler, SyntheticClassification
from reference_impl.options.training import SEED_STRIDE

ROOT = Path(__file__).resolve().parents[1]
# Standalone files a reader pastes into a notebook (torch alone), and the notebook generated
# from one: they cannot import the package's constant, so they spell it out.
STANDALONE = {"reference_impl/interview_core.py", "reference_impl/notebook.py", "notebooks/interview_trainer.ipynb"}

CASES = [(n, w, m, seed)
         for n in (1, 7, 64, 100, 1000, 1537)
         for w in (1, 2, 3, 8, 64)
         for m in (1, 3, 16)
         for seed in (0, 1234)
         if n >= w * m]


def shards(n: int, world: int, micro: int, seed: int, epoch: int) -> list[list[int]]:
    samplers = [ResumableDistributedSampler(n, world_size=world, rank=r, global_batch_size=world * micro,
                                            seed=seed) for r in range(world)]
    for s in samplers:
        s.set_epoch(epoch)
    return [list(s) for s in samplers]


@pytest.mark.parametrize("n,world,micro,seed", CASES)
def test_disjoint_complete_deterministic_reshuffled(n: int, world: int, micro: int, seed: int) -> None:
    gb = world * micro
    orders = []
    for epoch in (0, 1, 2):
        parts = shards(n, world, micro, seed, epoch)
        flat = list(itertools.chain(*parts))
        assert len(flat) == len(set(flat)), "a sample went to two ranks"
        assert len(flat) == (n // gb) * gb, "the epoch trains every sample but the dropped tail"
        assert n - len(flat) < gb, "the dropped tail is shorter than one global batch"
        assert len({len(p) for p in parts}) == 1, "every rank gets the same number of samples"
        assert parts == shards(n, world, micro, seed, epoch), "same (seed, epoch), same order"
        orders.append(flat)
    if n >= 8 and gb <= n // 2:
        assert orders[0] != orders[1] != orders[2], "each epoch reshuffles"


@pytest.mark.parametrize("world", [1, 2, 4, 64])
def test_step_consumes_a_contiguous_block_of_the_permutation(world: int) -> None:
    n, micro = 1000, 2
    gb = world * micro
    samplers = [ResumableDistributedSampler(n, world_size=world, rank=r, global_batch_size=gb, seed=3)
                for r in range(world)]
    perm = samplers[0].epoch_permutation().tolist()
    iters = [iter(s) for s in samplers]
    for step in range(5):
        block = {next(it) for it in iters for _ in range(micro)}
        assert block == set(perm[step * gb:(step + 1) * gb])


@pytest.mark.parametrize("world", [1, 2, 8])
@pytest.mark.parametrize("stop_after", [0, 1, 7])
def test_resume_mid_epoch_continues_exactly(world: int, stop_after: int) -> None:
    n, micro, gb = 200, 3, 3 * world
    for rank in range(world):
        straight = ResumableDistributedSampler(n, world_size=world, rank=rank, global_batch_size=gb, seed=5)
        straight.set_epoch(2)
        full = list(straight)
        first = ResumableDistributedSampler(n, world_size=world, rank=rank, global_batch_size=gb, seed=5)
        first.set_epoch(2)
        first.commit(stop_after * gb)
        resumed = ResumableDistributedSampler(n, world_size=world, rank=rank, global_batch_size=gb, seed=5)
        resumed.load_state_dict(first.state_dict())
        resumed.set_epoch(2)  # same epoch: progress is kept
        assert list(resumed) == full[stop_after * micro:]
        resumed.set_epoch(3)  # a new epoch starts from its beginning, not at the old offset
        assert len(list(resumed)) == len(full)


@pytest.mark.parametrize("old_world,new_world", [(2, 1), (1, 2), (4, 2), (2, 4)])
def test_world_size_change_trains_every_sample_exactly_once(old_world: int, new_world: int) -> None:
    n, gb, done_steps = 96, 8, 5
    before = [ResumableDistributedSampler(n, world_size=old_world, rank=r, global_batch_size=gb, seed=9)
              for r in range(old_world)]
    trained = []
    for s in before:
        trained += list(s)[: done_steps * gb // old_world]
        s.commit(done_steps * gb)
    state = before[0].state_dict()
    for r in range(new_world):
        after = ResumableDistributedSampler(n, world_size=new_world, rank=r, global_batch_size=gb, seed=9)
        after.load_state_dict(state)
        trained += list(after)
    assert sorted(trained) == sorted(before[0].epoch_permutation()[: (n // gb) * gb].tolist())


def test_state_dict_is_a_copy_and_rejects_foreign_data() -> None:
    s = ResumableDistributedSampler(100, world_size=2, rank=0, global_batch_size=10, seed=0)
    snapshot = s.state_dict()
    s.commit(10)
    assert snapshot["consumed"] == 0, "a live reference would let a loader snapshot run ahead"
    other = ResumableDistributedSampler(101, world_size=2, rank=0, global_batch_size=10, seed=0)
    with pytest.raises(ValueError, match="num_samples"):
        other.load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="step boundary"):
        s.load_state_dict({**s.state_dict(), "consumed": 5})


@pytest.mark.parametrize("num_workers", [0, 2])
def test_progress_counts_trained_samples_under_worker_prefetch(num_workers: int) -> None:
    """DataLoader workers pull indices ahead; progress must still equal what was trained."""
    n, micro, steps = 256, 4, 3
    data = SyntheticClassification(n, 4, 2, seed=0)

    def loader(sampler: ResumableDistributedSampler) -> DataLoader:
        return DataLoader(data, batch_size=micro, sampler=sampler, num_workers=num_workers)

    sampler = ResumableDistributedSampler(n, world_size=1, rank=0, global_batch_size=micro, seed=1)
    batches = iter(loader(sampler))
    seen = []
    for _ in range(steps):
        seen += next(batches)[2].tolist()
        sampler.commit(micro)
    state = sampler.state_dict()
    del batches
    assert state["consumed"] == steps * micro
    resumed = ResumableDistributedSampler(n, world_size=1, rank=0, global_batch_size=micro, seed=1)
    resumed.load_state_dict(state)
    rest = torch.cat([b[2] for b in loader(resumed)]).tolist()
    assert seen + rest == sampler.epoch_permutation()[: (n // micro) * micro].tolist()


def test_the_seed_stride_is_written_once() -> None:
    """`SEED_STRIDE` is defined in one place and imported wherever the package seeds an epoch;
    only the standalone files spell it out, and each of their samplers uses the same value."""
    stride = re.compile(r"(?<![\d_])" + "_?".join(str(SEED_STRIDE)) + r"(?![\d_])")
    folders = ("reference_impl", "tests", "docs", "notebooks", "scripts")
    files = [p for folder in folders for p in (ROOT / folder).rglob("*")
             if p.suffix in {".py", ".md", ".js", ".ipynb", ".sh", ".yml"}]
    holders = {p.relative_to(ROOT).as_posix(): len(stride.findall(p.read_text(encoding="utf-8"))) for p in files}
    holders = {path: n for path, n in holders.items() if n}
    assert set(holders) == STANDALONE | {"reference_impl/options/training.py"}
    assert holders["reference_impl/options/training.py"] == 1  # the definition
    for path in STANDALONE:
        spelled = re.findall(r"self\.seed \* ([\d_]+) \+ self\.epoch", (ROOT / path).read_text(encoding="utf-8"))
        assert spelled and {int(literal) for literal in spelled} == {SEED_STRIDE}, path

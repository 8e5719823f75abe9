import itertools

import numpy as np
import pytest
import torch
from torch import nn

from reference_impl.bio.collate import TokenBudgetBatchSampler, pad_batch, token_budget_batches

pytestmark = pytest.mark.bio


def random_lengths(seed: int, n: int = 200) -> list[int]:
    return np.random.default_rng(seed).integers(1, 120, size=n).tolist()


def test_mask_counts_equal_lengths_and_padding_holds_pad_id():
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(4, 30, (n,), generator=g) for n in (5, 1, 9, 3)]
    batch = pad_batch(seqs, pad_id=1)
    assert batch.tokens.shape == (4, 9)
    assert batch.mask.sum(dim=1).tolist() == [5, 1, 9, 3] == batch.lengths.tolist()
    assert torch.all(batch.tokens[~batch.mask] == 1)
    for i, s in enumerate(seqs):
        assert torch.equal(batch.tokens[i, : len(s)], s)


def test_padding_does_not_change_outputs_at_real_positions():
    torch.manual_seed(0)
    embed = nn.Embedding(33, 16)
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True).eval()
    seqs = [torch.randint(4, 33, (n,)) for n in (7, 2, 11)]
    batch = pad_batch(seqs)
    with torch.no_grad():
        # key_padding_mask is True = ignore: the opposite polarity of our mask.
        padded = layer(embed(batch.tokens), src_key_padding_mask=~batch.mask)
        wrong = layer(embed(batch.tokens), src_key_padding_mask=batch.mask)
        for i, s in enumerate(seqs):
            alone = layer(embed(s)[None])[0]
            assert torch.allclose(padded[i, : len(s)], alone, atol=1e-5)
        assert not torch.allclose(wrong[1, :2], layer(embed(seqs[1])[None])[0], atol=1e-3)


@pytest.mark.parametrize("max_tokens", [64, 256, 1000])
def test_token_budget_is_respected(max_tokens):
    lengths = random_lengths(1)
    batches = token_budget_batches(lengths, max_tokens)
    assert sorted(itertools.chain.from_iterable(batches)) == list(range(len(lengths)))
    for b in batches:
        assert max(lengths[i] for i in b) * len(b) <= max_tokens or len(b) == 1


def test_over_long_sequence_gets_its_own_batch():
    assert token_budget_batches([10, 500, 20], 100) == [[0, 2], [1]]


@pytest.mark.parametrize("policy", ["repeat", "drop"])
def test_every_rank_gets_the_same_number_of_batches(policy):
    for seed, epoch, world in itertools.product(range(4), range(3), range(1, 6)):
        lengths = random_lengths(seed, n=int(37 + 13 * seed))
        samplers = [
            TokenBudgetBatchSampler(lengths, 200, rank=r, world_size=world, seed=seed, policy=policy)
            for r in range(world)
        ]
        for s in samplers:
            s.set_epoch(epoch)
        counts = {len(list(s)) for s in samplers}
        assert counts == {len(samplers[0])}, (seed, epoch, world)
        seen = [i for s in samplers for b in s for i in b]
        if policy == "drop":
            assert len(seen) == len(set(seen))  # nothing twice
        else:
            assert set(seen) == set(range(len(lengths)))  # nothing missed


def test_same_seed_and_epoch_same_order_new_epoch_new_order():
    lengths = random_lengths(5)
    a = TokenBudgetBatchSampler(lengths, 300, rank=1, world_size=2, seed=9)
    b = TokenBudgetBatchSampler(lengths, 300, rank=1, world_size=2, seed=9)
    a.set_epoch(4)
    b.set_epoch(4)
    assert list(a) == list(b)
    first = list(a)
    a.set_epoch(5)
    assert list(a) != first


def test_ranks_share_the_global_order():
    lengths = random_lengths(6)
    world = 3
    per_rank = []
    for r in range(world):
        s = TokenBudgetBatchSampler(lengths, 300, rank=r, world_size=world, seed=2, policy="drop")
        s.set_epoch(1)
        per_rank.append(list(s))
    ref = TokenBudgetBatchSampler(lengths, 300, seed=2, policy="drop")
    ref.set_epoch(1)
    interleaved = [b for step in zip(*per_rank) for b in step]
    assert interleaved == list(ref)[: len(interleaved)]

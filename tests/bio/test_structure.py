import pytest
import torch
from torch import nn

from reference_impl.bio.curriculum import curriculum_length
from reference_impl.bio.geometry import VectorNorm, center_per_molecule
from reference_impl.bio.pair_memory import pair_memory

pytestmark = pytest.mark.bio

MiB, GiB = 2**20, 2**30


def random_rotation(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(3, 3, generator=g, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r))
    if torch.det(q) < 0:
        q[:, 0] = -q[:, 0]
    return q


def test_random_rotation_is_a_rotation():
    r = random_rotation(0)
    assert torch.allclose(r @ r.T, torch.eye(3, dtype=torch.float64), atol=1e-12)
    assert torch.det(r) == pytest.approx(1.0)


def rotation_error(layer: nn.Module, v: torch.Tensor, r: torch.Tensor) -> float:
    """max |layer(v R^T) - layer(v) R^T|: zero for a rotation-equivariant layer."""
    return (layer(v @ r.T) - layer(v) @ r.T).abs().max().item()


def test_batchnorm_over_coordinates_breaks_rotation_equivariance():
    """The equivariance measure has teeth: BatchNorm1d over x, y, z fails it by a wide
    margin on anisotropic coordinates, while the package's VectorNorm, on the same
    vectors and rotation, passes it to rounding error."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, generator=g, dtype=torch.float64) * torch.tensor([3.0, 1.0, 0.2], dtype=torch.float64)
    r = random_rotation(1)
    assert rotation_error(nn.BatchNorm1d(3).double().train(), x, r) > 0.1
    assert rotation_error(VectorNorm(1).double(), x.unsqueeze(1), r) < 1e-12


def test_vector_norm_is_rotation_equivariant():
    g = torch.Generator().manual_seed(0)
    v = torch.randn(64, 8, 3, generator=g, dtype=torch.float64) * torch.tensor([3.0, 1.0, 0.2], dtype=torch.float64)
    layer = VectorNorm(8).double()
    with torch.no_grad():
        layer.weight.copy_(torch.linspace(0.5, 2.0, 8))
    for seed in range(5):
        r = random_rotation(seed)
        err = (layer(v @ r.T) - layer(v) @ r.T).abs().max()
        assert err < 1e-12


def test_center_per_molecule_is_local_to_each_molecule():
    g = torch.Generator().manual_seed(0)
    pos = torch.randn(10, 3, generator=g, dtype=torch.float64)
    batch = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2, 2])
    centered = center_per_molecule(pos, batch, 3)
    for m in range(3):
        assert torch.allclose(centered[batch == m].mean(0), torch.zeros(3, dtype=torch.float64), atol=1e-12)
    moved = pos.clone()
    moved[batch == 1] += torch.tensor([5.0, -2.0, 7.0], dtype=torch.float64)
    assert torch.allclose(center_per_molecule(moved, batch, 3), centered, atol=1e-12)
    batch_centroid = moved - moved.mean(0)  # the wrong frame: depends on batch-mates
    assert not torch.allclose(batch_centroid[batch == 0], pos[batch == 0] - pos.mean(0))


@pytest.mark.parametrize("dtype,itemsize", [(torch.float32, 4), (torch.bfloat16, 2), (torch.float16, 2)])
@pytest.mark.parametrize("n,chunk", [(8, None), (12, None), (12, 4)])
def test_pair_memory_matches_real_tensors(dtype, itemsize, n, chunk):
    c_z, heads, c_head, c_mult, c_opm = 16, 4, 8, 12, 4
    est = pair_memory(n, c_z=c_z, heads=heads, c_mult=c_mult, c_opm=c_opm, dtype=dtype, chunk_rows=chunk)
    z = torch.randn(n, n, c_z).to(dtype)
    rows = n if chunk is None else chunk
    q = torch.randn(rows, n, heads, c_head).to(dtype)
    k = torch.randn(rows, n, heads, c_head).to(dtype)
    logits = torch.einsum("rihc,rjhc->rhij", q, k)  # triangle attention, starting node
    a = nn.Linear(c_z, c_mult).to(dtype)(z)
    m_a = torch.randn(5, n, c_opm).to(dtype)
    opm = torch.einsum("sic,sjd->ijcd", m_a, m_a)
    hidden = nn.Linear(c_z, 4 * c_z).to(dtype)(z)
    assert z.element_size() == itemsize
    assert est.pair == z.numel() * z.element_size()
    assert est.triangle_logits == logits.numel() * logits.element_size()
    assert est.triangle_mult_projection == a.numel() * a.element_size()
    assert est.outer_product == opm.numel() * opm.element_size()
    assert est.transition_hidden == hidden.numel() * hidden.element_size()


def test_pair_memory_worked_example_at_1024_residues():
    bf16 = pair_memory(1024)
    assert bf16.pair == 256 * MiB
    assert bf16.triangle_logits == 8 * GiB
    assert bf16.triangle_mult_projection == 256 * MiB
    assert bf16.outer_product == 2 * GiB
    assert bf16.transition_hidden == 1 * GiB
    assert pair_memory(1024, chunk_rows=4).triangle_logits == 32 * MiB
    fp32 = pair_memory(1024, dtype=torch.float32)
    assert fp32.pair == 512 * MiB and fp32.triangle_logits == 16 * GiB


def test_triangle_logits_grow_cubically_pair_quadratically():
    small, large = pair_memory(256), pair_memory(512)
    assert large.pair == 4 * small.pair
    assert large.triangle_logits == 8 * small.triangle_logits
    assert small.pair == 16 * MiB and small.triangle_logits == GiB // 8


def test_curriculum_length_ramps_and_holds():
    lengths = [curriculum_length(s, start=256, end=384, ramp_steps=1000) for s in range(0, 1500, 10)]
    assert lengths[0] == 256 and lengths[-1] == 384
    assert all(b >= a for a, b in zip(lengths, lengths[1:]))
    assert all(length % 8 == 0 for length in lengths)
    assert curriculum_length(10, start=128, end=512, ramp_steps=0) == 512
    with pytest.raises(ValueError):
        curriculum_length(0, start=512, end=128, ramp_steps=10)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(h))


@pytest.mark.parametrize("reentrant", [True, False])
def test_reentrant_checkpoint_loses_grads_behind_a_frozen_embedding(reentrant):
    """Behind a frozen embedding, reentrant checkpointing (the naive call) silently gives
    the block no gradient; the package's transformer, with its blocks checkpointed
    (`checkpoint_blocks`, non-reentrant), gives exactly the uncheckpointed gradients."""
    from torch.utils.checkpoint import checkpoint

    from reference_impl.config import TrainConfig
    from reference_impl.model import build_model

    if reentrant:
        torch.manual_seed(0)
        embed = nn.Embedding(20, 8).requires_grad_(False)  # frozen: its output needs no grad
        block, head = Block(), nn.Linear(8, 1)
        tokens = torch.randint(0, 20, (4, 6))
        with pytest.warns(UserWarning, match="None of the inputs have requires_grad"):
            h = checkpoint(block, embed(tokens), use_reentrant=True)
        head(h).sum().backward()  # the head still trains
        assert head.weight.grad is not None
        assert block.lin.weight.grad is None  # the block silently stops training
        return
    cfg = TrainConfig(model="transformer", n_layers=2)
    tokens = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    grads = []
    for checkpointed in (False, True):
        model = build_model(cfg)
        model.embed.requires_grad_(False)
        model.pos.requires_grad_(False)  # the blocks' input needs no grad at all
        model.checkpoint_blocks = checkpointed
        model(tokens).float().logsumexp(-1).mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if n.startswith("blocks.")})
    assert all(g is not None for g in grads[1].values()), "every checkpointed block trains"
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])

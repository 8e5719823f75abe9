"""Models: activation checkpointing changes memory, never the math; FLOP accounting; the logits
are not copied outside FSDP2."""

import pytest
import torch

from reference_impl.config import TrainConfig
from reference_impl.model import build_model, flops_per_sample, loss_fn
from reference_impl.train import build_dataset


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_activation_checkpointing_leaves_gradients_unchanged(dropout: float) -> None:
    """Recomputation replays dropout with the saved RNG state, so even dropout matches."""
    cfg = TrainConfig(model="transformer", dropout=dropout)
    x, y, _ = torch.utils.data.default_collate([build_dataset(cfg)[i] for i in range(8)])
    grads = []
    for checkpointed in (False, True):
        model = build_model(cfg)
        model.checkpoint_blocks = checkpointed
        torch.manual_seed(7)
        loss_fn(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_activation_checkpointing_stores_fewer_activations() -> None:
    cfg = TrainConfig(model="transformer", n_layers=4)
    x, _, _ = torch.utils.data.default_collate([build_dataset(cfg)[i] for i in range(8)])
    saved = []
    for checkpointed in (False, True):
        model = build_model(cfg)
        model.checkpoint_blocks = checkpointed
        count = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            count[0] += t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x).sum()
        saved.append(count[0])
    assert saved[1] < saved[0] / 2


def test_flops_per_sample_counts_six_flops_per_weight_per_token() -> None:
    cfg = TrainConfig(model="mlp", input_dim=4, hidden_dim=8, num_classes=2)
    assert flops_per_sample(cfg) == 6 * (4 * 8 + 8 * 8 + 8 * 2)
    tcfg = TrainConfig(model="transformer")
    matmul_params = sum(p.numel() for n, p in build_model(tcfg).named_parameters()
                        if p.dim() == 2 and not n.startswith(("embed", "pos")))
    attention = 12 * tcfg.n_layers * tcfg.d_model * tcfg.seq_len
    assert flops_per_sample(tcfg) == (6 * matmul_params + attention) * tcfg.seq_len


@pytest.mark.parametrize("n_experts", [1, 4])
def test_flops_per_sample_under_moe_counts_the_experts_a_token_visits(n_experts: int) -> None:
    """Each token runs through top-k of the experts (2, or 1 with one expert) and the router:
    the stacked expert weights count k / n_experts of their size, everything else whole."""
    cfg = TrainConfig(model="transformer", n_experts=n_experts)
    active = 0.0
    for name, p in build_model(cfg).named_parameters():
        if name.endswith((".w1", ".w2")):  # (experts, in, out): a token visits k of them
            active += p.numel() * min(2, n_experts) / n_experts
        elif p.dim() == 2 and not name.startswith(("embed", "pos")):
            active += p.numel()
    attention = 12 * cfg.n_layers * cfg.d_model * cfg.seq_len
    assert flops_per_sample(cfg) == (6 * active + attention) * cfg.seq_len
    assert flops_per_sample(cfg) > flops_per_sample(TrainConfig(model="transformer")), "k experts and a router"


def test_the_logits_are_not_copied_outside_fsdp2() -> None:
    """The output projection's result is returned as it is (a view of one matmul's output);
    only FSDP2's root, which warns on a view, copies it (`data_parallel.own_tensor`, checked by
    `tests/distributed/test_fsdp.py::test_the_root_module_returns_no_view_so_fsdp_does_not_warn`)."""
    from reference_impl.parallel.data_parallel import own_tensor

    cfg = TrainConfig(model="transformer")
    x, _, _ = torch.utils.data.default_collate([build_dataset(cfg)[i] for i in range(4)])
    logits = build_model(cfg)(x)
    assert logits._is_view(), "a copy of batch x seq x vocab values would cost memory and a pass"
    owned = own_tensor(torch.nn.Identity(), (x,), logits)
    assert not owned._is_view() and torch.equal(owned, logits)
    assert own_tensor(torch.nn.Identity(), (x,), owned) is owned, "a tensor of its own is not copied again"

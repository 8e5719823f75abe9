"""The mixture-of-experts block in one process, against a token-by-token loop.

The loop is the definition written plainly: softmax over the experts, the top k, gates
(the probability for k = 1, the pair renormalised for k = 2), first choices queued before
second choices, an expert full at `ceil(capacity_factor x tokens x k / n_experts)`
assignments, and the Switch/GShard loss `n_experts x sum_i f_i P_i`. Expert parallel is
proven equal to this block in tests/distributed/test_expert_parallel.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from reference_impl.parallel.experts import MoE, expert_capacity


def _loop(block: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    probs = torch.softmax(x @ block.router.weight.t(), dim=-1)
    tokens, n_experts = probs.shape
    k = block.top_k
    capacity = math.ceil(block.capacity_factor * tokens * k / n_experts)
    top_p, top_e = probs.topk(k, dim=-1)
    out, load, dropped = x.clone(), [0] * n_experts, 0
    for choice in range(k):
        for t in range(tokens):
            e = int(top_e[t, choice])
            if load[e] == capacity:
                dropped += 1
                continue
            load[e] += 1
            gate = top_p[t, choice] / (top_p[t].sum() if k == 2 else 1)
            out[t] += gate * (F.gelu(x[t] @ block.w1[e]) @ block.w2[e])
    share = torch.bincount(top_e.flatten(), minlength=n_experts).double() / (tokens * k)
    return out, n_experts * (share * probs.mean(dim=0)).sum(), dropped


# 0.9 and 0.55 give fractional capacities (7.2 and 8.8 slots): the block must round up as the loop does.
@pytest.mark.parametrize(("top_k", "capacity_factor"),
                         [(1, 1.0), (1, 2.0), (2, 1.0), (2, 0.5), (2, 4.0), (1, 0.9), (2, 0.55)])
def test_the_block_computes_what_the_token_loop_computes(top_k: int, capacity_factor: float) -> None:
    torch.manual_seed(0)
    block = MoE(8, 16, 4, top_k, capacity_factor).double()
    x = torch.randn(32, 8, dtype=torch.float64)
    out, aux_loss, dropped = block(x)
    expected_out, expected_aux, expected_dropped = _loop(block, x)
    torch.testing.assert_close(out, expected_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(aux_loss, expected_aux, rtol=0, atol=1e-12)
    assert dropped == expected_dropped
    assert (dropped > 0) == (capacity_factor <= 1.0), "the low capacities drop, the high ones do not"


def test_a_token_dropped_by_every_expert_passes_through_unchanged() -> None:
    """At capacity factor 0.25, 4 experts hold 2 of 32 tokens each: 24 tokens come out
    exactly as they went in (the residual), and the count says so."""
    torch.manual_seed(0)
    block = MoE(8, 16, 4, top_k=1, capacity_factor=0.25)
    x = torch.randn(32, 8)
    out, _, dropped = block(x)
    assert expert_capacity(32, 4, 1, 0.25) == 2
    unchanged = (out == x).all(dim=1)
    assert dropped == int(unchanged.sum()) == 24


def test_a_fractional_capacity_rounds_up_to_whole_slots() -> None:
    """Capacities are whole slots, rounded up: truncating 7.2 to 7 would drop a token the
    formula has room for."""
    assert expert_capacity(32, 4, 1, 0.9) == 8  # 7.2
    assert expert_capacity(30, 4, 1, 1.0) == 8  # 7.5
    assert expert_capacity(10, 4, 2, 1.25) == 7  # 6.25
    assert expert_capacity(32, 4, 1, 1.0) == 8  # whole: unchanged


def test_the_aux_loss_is_one_when_balanced_and_n_experts_when_collapsed() -> None:
    """Equal shares f_i = 1/E give exactly 1 whatever the probabilities (sum_i P_i = 1);
    every token on one expert with probability near 1 gives E, the maximum."""
    block = MoE(4, 8, 4, top_k=1)
    with torch.no_grad():
        block.router.weight.copy_(torch.eye(4))
    balanced = torch.eye(4).repeat(8, 1)  # token t prefers expert t mod 4
    assert block(balanced).aux_loss.item() == pytest.approx(1.0, abs=1e-6)
    collapsed = torch.zeros(32, 4)
    collapsed[:, 0] = 30.0
    assert block(collapsed).aux_loss.item() == pytest.approx(4.0, abs=1e-6)


def test_the_aux_loss_trains_the_router_and_the_gate_trains_it_too() -> None:
    """The router gets a gradient from the aux loss alone (through P_i) and from the output
    alone (through the gates): both halves of its learning signal are wired."""
    torch.manual_seed(0)
    block = MoE(8, 16, 4, top_k=1)
    x = torch.randn(16, 8)
    out, aux_loss, _ = block(x)
    from_aux = torch.autograd.grad(aux_loss, block.router.weight, retain_graph=True)[0]
    from_out = torch.autograd.grad(out.square().sum(), block.router.weight)[0]
    assert from_aux.abs().sum() > 0 and from_out.abs().sum() > 0


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="top_k must be 1 or 2"):
        MoE(8, 16, 4, top_k=3)
    with pytest.raises(ValueError, match="capacity_factor must be positive"):
        MoE(8, 16, 4, capacity_factor=0)

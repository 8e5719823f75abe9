"""The graph-break example: two breaks and their causes, then one graph with the same values."""

from __future__ import annotations

import pytest
import torch

from reference_impl.interview.graph_breaks import clip_then_relu, clip_then_relu_breaks, graph_breaks


@pytest.fixture
def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(4, 8), torch.randn(8, 8)


def test_item_and_print_each_break_the_graph(inputs) -> None:
    graphs, breaks, reasons = graph_breaks(clip_then_relu_breaks, *inputs)
    assert (graphs, breaks) == (3, 2)
    assert "Tensor.item()" in reasons[0]
    assert "builtin operator" in reasons[1]  # print


def test_the_fix_is_one_graph_with_the_same_values(inputs) -> None:
    assert graph_breaks(clip_then_relu, *inputs) == (1, 0, [])
    for scale in (1e-3, 1.0, 1e3):  # both sides of the branch
        x, w = inputs[0] * scale, inputs[1]
        assert torch.allclose(clip_then_relu(x, w), clip_then_relu_breaks(x, w))


def test_fullgraph_turns_a_break_into_an_error(inputs) -> None:
    """`fullgraph=True` is how a test or CI keeps a compiled region whole. (Under it torch 2.13
    traces the `.item()` as a symbolic scalar and then refuses the Python branch on it.)"""
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.TorchDynamoException, match=r"data-dependent"):
        torch.compile(clip_then_relu_breaks, fullgraph=True, backend="eager")(*inputs)
    torch._dynamo.reset()
    fixed = torch.compile(clip_then_relu, fullgraph=True, backend="eager")(*inputs)
    assert torch.allclose(fixed, clip_then_relu(*inputs))
    torch._dynamo.reset()

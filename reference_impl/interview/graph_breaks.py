"""A function that breaks torch.compile's graph twice, the same function without a break, and
the count that tells them apart.

Dynamo traces Python bytecode into one FX graph until it meets something it cannot put in
a graph; there it stops the graph, runs that code eagerly, and starts a new graph after it
(a graph break). Each break costs a return to Python, a kernel-fusion boundary and, with
CUDA graphs, a graph of its own. `clip_then_relu_breaks` has two: `.item()` copies a value
to the host so that Python can branch on it, and `print` is a side effect dynamo does not
trace. `clip_then_relu` keeps the branch on the device with `torch.where` and drops the
print: one graph, the same values.
"""

# --8<-- [start:imports]
from __future__ import annotations

import contextlib
import io
from collections.abc import Callable

import torch

# --8<-- [end:imports]


# --8<-- [start:breaks]
def clip_then_relu_breaks(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y = x @ w scaled to norm 1 when larger, then ReLU: written with two graph breaks."""
    y = x @ w
    norm = y.norm()
    if norm.item() > 1.0:  # break 1: a Python branch on a value copied to the host
        y = y / norm
    print("norm", norm)  # break 2: a side effect dynamo does not trace
    return torch.relu(y)
# --8<-- [end:breaks]


# --8<-- [start:fixed]
def clip_then_relu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The same values with no break: the branch is a select on the device, the log is gone."""
    y = x @ w
    norm = y.norm()
    y = torch.where(norm > 1.0, y / norm, y)
    return torch.relu(y)
# --8<-- [end:fixed]


# --8<-- [start:count]
def graph_breaks(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> tuple[int, int, list[str]]:
    """Trace `fn(*args)` with `torch._dynamo.explain`: (graphs, breaks, the first line of each
    break's reason). Nothing is compiled to kernels; what `fn` prints is swallowed."""
    torch._dynamo.reset()  # explain must trace afresh, not reuse a cached graph
    with contextlib.redirect_stdout(io.StringIO()):
        report = torch._dynamo.explain(fn)(*args)
    reasons = [str(b.reason).splitlines()[0] for b in report.break_reasons]
    return report.graph_count, report.graph_break_count, reasons
# --8<-- [end:count]

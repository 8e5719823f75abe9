"""A rank of the context-parallel tests (ring and Ulysses attention), in a module of its own:
a spawned child imports only torch and `reference_impl`, not the test module's imports.

Every rank draws the same full-sequence q, k, v and output gradient, computes full causal
attention and its gradients in this one process as the reference, then runs ring or Ulysses
attention on its own tokens and records how far its rows of the output and of dq, dk, dv
are from the reference's rows, and the bytes it sent.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from reference_impl.parallel.context_parallel import CommStats, parallelize, ring_attention, shard_sequence
from reference_impl.model import TinyTransformer
from reference_impl.parallel.ulysses import ulysses_attention

BATCH, HEADS, HEAD_DIM, CHUNK = 2, 2, 8, 4  # CHUNK tokens per chunk: diagonal blocks mask inside
# The transformer's cases: (load_balanced, attention).
MODEL_CASES = {"contiguous": (False, ring_attention), "load_balanced": (True, ring_attention),
               "ulysses": (True, ulysses_attention)}
ULYSSES_HEADS = 4  # Ulysses gives each rank whole heads: divisible by 2 and 4 ranks
# (load_balanced, query scale, dtype of the ring's inputs); the reference is computed in
# float64. In float64 a difference from it is a bug, not the rounding of another summation
# order. Scores of ~±100 overflow exp() in float32 unless the row maximum is subtracted
# first (in float64 that takes ~±710, where a near-one-hot softmax leaves dq to cancellation).
CASES = {"contiguous": (False, 1.0, torch.float64), "load_balanced": (True, 1.0, torch.float64),
         "sharp_scores": (True, 100.0, torch.float32)}


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


def _gloo(rank: int, world_size: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=60))


def _full_attention(case: str, seq_len: int, heads: int) -> tuple[list[torch.Tensor], torch.Tensor,
                                                                   list[torch.Tensor], torch.Tensor]:
    """The inputs of `case` (q, k, v in its dtype), the output gradient, and the float64
    reference: leaves holding dq, dk, dv of full causal attention, and its output."""
    _, sharpness, dtype = CASES[case]
    gen = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(BATCH, heads, seq_len, HEAD_DIM, generator=gen, dtype=dtype) for _ in range(4))
    inputs = [q * sharpness, k, v]
    full = [t.double().requires_grad_() for t in inputs]  # the reference in float64
    want = F.scaled_dot_product_attention(*full, is_causal=True)
    want.backward(grad.double())
    return inputs, grad, full, want.detach()


def _errors_of(attention: Callable[..., torch.Tensor], case: str, rank: int, world_size: int,
               heads: int) -> dict[str, float]:
    """The relative error of this rank's rows of out, dq, dk, dv from `attention` on its tokens."""
    load_balanced = CASES[case][0]
    inputs, grad, full, want = _full_attention(case, 2 * world_size * CHUNK, heads)

    def mine(x: torch.Tensor) -> torch.Tensor:
        return shard_sequence(x, rank, world_size, load_balanced, dim=2)

    local = [mine(t.detach()).requires_grad_() for t in inputs]
    got = attention(*local, load_balanced=load_balanced)
    got.backward(mine(grad))
    return {"out": _relative_error(got.detach(), mine(want)),
            **{f"d{n}": _relative_error(t.grad, mine(f.grad)) for n, t, f in zip("qkv", local, full, strict=True)}}


def compare_with_full_attention(rank: int, world_size: int, port: int, out_dir: str,
                                cases: tuple[str, ...] = tuple(CASES)) -> None:
    """Write rank<r>.json: per case (all of `CASES`, or those named), the relative error of
    out, dq, dk, dv and bytes sent."""
    _gloo(rank, world_size, port)
    try:
        results = {}
        for name in cases:
            stats, forward = CommStats(), []

            def ring(*qkv: torch.Tensor, load_balanced: bool, stats: CommStats = stats,
                     forward: list[int] = forward) -> torch.Tensor:
                out = ring_attention(*qkv, load_balanced=load_balanced, stats=stats)
                forward.append(stats.bytes_sent)
                return out

            errors = _errors_of(ring, name, rank, world_size, HEADS)
            results[name] = {**errors, "forward_bytes": forward[0], "total_bytes": stats.bytes_sent}
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def compare_ulysses_with_full_attention(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Write ulysses<r>.json: per case of `CASES`, with `ULYSSES_HEADS` heads, the relative
    error of out, dq, dk, dv, and the bytes handed to `all_to_all_single`, forward and in all."""
    _gloo(rank, world_size, port)
    sent, collective = [], dist.all_to_all_single

    def counted(output: torch.Tensor, input: torch.Tensor, *args: object, **kwargs: object) -> object:
        """The real collective, after noting the size of what it is asked to send."""
        sent.append(input.numel() * input.element_size())
        return collective(output, input, *args, **kwargs)

    dist.all_to_all_single = counted  # every all-to-all of this rank, forward and backward
    try:
        results = {}
        for name in CASES:
            sent.clear()
            forward: list[int] = []

            def ulysses(*qkv: torch.Tensor, load_balanced: bool, forward: list[int] = forward) -> torch.Tensor:
                out = ulysses_attention(*qkv, load_balanced=load_balanced)
                forward.append(sum(sent))
                return out

            errors = _errors_of(ulysses, name, rank, world_size, ULYSSES_HEADS)
            results[name] = {**errors, "forward_bytes": forward[0], "total_bytes": sum(sent), "calls": len(sent)}
        (Path(out_dir) / f"ulysses{rank}.json").write_text(json.dumps(results))
    finally:
        dist.all_to_all_single = collective
        dist.destroy_process_group()


def compare_transformer_with_one_process(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Write model<r>.json: per case of `MODEL_CASES`, the difference of the
    transformer's loss and of every parameter's gradient (averaged over the ranks, as data
    parallel would) from one process's over the whole sequence, in float64."""
    _gloo(rank, world_size, port)
    try:
        seq_len, results = 2 * world_size * CHUNK, {}
        torch.manual_seed(0)
        model = TinyTransformer(vocab_size=64, seq_len=seq_len, d_model=16, n_layers=2, n_heads=2,
                                hidden_dim=32, dropout=0.0).double()
        tokens, targets = torch.randint(0, 64, (3, seq_len)), torch.randint(0, 64, (3, seq_len))
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        want = {name: p.grad.clone() for name, p in model.named_parameters()}
        for case, (load_balanced, attention) in MODEL_CASES.items():
            cp_model = parallelize(copy.deepcopy(model), None, load_balanced, attention)
            cp_model.zero_grad()

            def mine(x: torch.Tensor, lb: bool = load_balanced) -> torch.Tensor:
                return shard_sequence(x, rank, world_size, lb, dim=-1)

            # The model finds its tokens' positions itself (parallelize's forward pre-hook).
            local = F.cross_entropy(cp_model(mine(tokens)).flatten(0, 1), mine(targets).flatten())
            local.backward()
            # Each rank's loss is the mean over its tokens; the ranks hold equally many.
            mean = local.detach().clone()
            dist.all_reduce(mean)
            errors = []
            for name, p in cp_model.named_parameters():
                dist.all_reduce(p.grad)
                errors.append(_relative_error(p.grad / world_size, want[name]))
            results[case] = {
                "loss": abs(mean.item() / world_size - loss.item()), "grad": max(errors),
                "parameters": len(errors)}
        (Path(out_dir) / f"model{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()

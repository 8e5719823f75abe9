"""A float8 linear layer: e4m3 inputs and weights forward, e5m2 gradients backward.

Every tensor that enters a matmul is cast to 8 bits with its own scale, recomputed on each
call from the tensor's largest magnitude (per-tensor dynamic scaling), and the matmul runs
through `torch._scaled_mm`, which multiplies the fp8 operands, accumulates in higher
precision and undoes both scales. The forward pass uses e4m3 (3 mantissa bits, range
+-448) for precision; gradients use e5m2 (2 mantissa bits, range +-57344) for range, since
they span more orders of magnitude than activations do.
`fake_quantize` is the round trip alone, with the scale shared per tensor, per row or per
block (MXFP8's 32 elements, optionally with its power-of-two scale), for comparing recipes.

The file imports only torch, so it can be pasted alone. `torch._scaled_mm` runs on CPU
(an emulation, slower than a bf16 matmul) and, on GPUs with FP8 tensor cores (H100 and
later), on the hardware. The code follows the GPU kernel's rules even where the CPU kernel
is laxer (torch 2.13's CPU kernel takes any layout and shape): the first operand row-major
and the second column-major, both dimensions of each weight a multiple of 16, scales as
fp32 scalars, and no e5m2 x e5m2 product. On the GPU the number of tokens must be a
multiple of 16 as well: it is the inner dimension of the weight-gradient matmul.
"""

# --8<-- [start:imports]
from __future__ import annotations

import torch
from torch import nn

# --8<-- [end:imports]


# --8<-- [start:cast]
E4M3 = torch.float8_e4m3fn  # forward: 3 mantissa bits, largest finite value 448
E5M2 = torch.float8_e5m2    # gradients: 2 mantissa bits, largest finite value 57344
ALIGN = 16  # the GPU kernel needs every operand dimension to be a multiple of 16


def to_float8(t: torch.Tensor, dtype: torch.dtype,
              scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast `t` to the fp8 `dtype` after multiplying by `scale`; return it and 1/scale.

    By default the scale maps the tensor's largest magnitude (amax) onto the format's
    largest finite value, so the full range is used whatever the tensor's magnitude.
    The returned inverse scale is what `torch._scaled_mm` multiplies the product by.
    """
    fmax = torch.finfo(dtype).max
    if scale is None:
        # An all-zero tensor has no amax: the floor keeps the scale finite.
        amax = t.detach().abs().max().float().clamp(min=1e-12)
        scale = fmax / amax
    scale = scale.float()
    # Saturate instead of overflowing: e5m2 would turn a too-large value into inf.
    t8 = (t.float() * scale).clamp(-fmax, fmax).to(dtype)
    return t8, scale.reciprocal()
# --8<-- [end:cast]


# --8<-- [start:blockwise]
MX_BLOCK = 32  # OCP Microscaling (MX) v1.0: 32 consecutive elements share one scale


def fake_quantize(t: torch.Tensor, dtype: torch.dtype = E4M3, block: int | None = None,
                  power_of_two: bool = False) -> torch.Tensor:
    """`t` cast to the fp8 `dtype` and back, with one scale per `block` consecutive elements
    of each row (`None`: one scale for the whole tensor, what `to_float8` does; the row
    length: rowwise). The values returned are what a matmul on the fp8 copy would see.

    A scale maps its group's largest magnitude onto the format's largest value. With
    `power_of_two` it is an MX scale instead, a bare exponent (E8M0): 2 to the power
    floor(log2(amax)) minus the format's largest exponent, so amax lands in the top
    binade and anything above the largest value saturates.
    """
    fmax = torch.finfo(dtype).max
    x = t.detach().float()
    groups = x.reshape(1, 1, -1) if block is None else x.reshape(-1, x.shape[-1] // block, block)
    amax = groups.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    if power_of_two:
        scale = torch.exp2(torch.floor(torch.log2(amax)) - torch.floor(torch.log2(torch.tensor(fmax))))
    else:
        scale = amax / fmax
    q = (groups / scale).clamp(-fmax, fmax).to(dtype)
    return (q.float() * scale).reshape(t.shape)
# --8<-- [end:blockwise]


# --8<-- [start:matmul]
def _mm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor,
        out_dtype: torch.dtype) -> torch.Tensor:
    """(a x a_inv) @ (b x b_inv) for fp8 `a` and `b`, in the layouts the GPU kernel takes."""
    b_col_major = b.t().contiguous().t()  # a no-op when b is already a transpose
    return torch._scaled_mm(a.contiguous(), b_col_major, scale_a=a_inv, scale_b=b_inv,
                            out_dtype=out_dtype)


class Float8Matmul(torch.autograd.Function):
    """y = x @ w.T with fp8 operands; saves the e4m3 copies (1 byte each) for backward."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor,
                w: torch.Tensor) -> torch.Tensor:
        x8, x_inv = to_float8(x, E4M3)
        w8, w_inv = to_float8(w, E4M3)
        ctx.save_for_backward(x8, x_inv, w8, w_inv)
        ctx.dtypes = (x.dtype, w.dtype)  # type: ignore[attr-defined]
        return _mm(x8, x_inv, w8.t(), w_inv, out_dtype=x.dtype)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx,
                 grad_y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x8, x_inv, w8, w_inv = ctx.saved_tensors  # type: ignore[attr-defined]
        x_dtype, w_dtype = ctx.dtypes  # type: ignore[attr-defined]
        g8, g_inv = to_float8(grad_y, E5M2)
        grad_x = _mm(g8, g_inv, w8, w_inv, out_dtype=x_dtype)          # (M,N) @ (N,K)
        grad_w = _mm(g8.t(), g_inv, x8, x_inv, out_dtype=w_dtype)      # (N,M) @ (M,K)
        return grad_x, grad_w
# --8<-- [end:matmul]


# --8<-- [start:module]
class Float8Linear(nn.Linear):
    """`nn.Linear` whose matmul runs in fp8; the weight itself stays in its own dtype.

    The optimizer keeps updating the full-precision weight; only each matmul's copy is
    8-bit. The bias is added after the matmul, in the output's dtype.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = Float8Matmul.apply(x.reshape(-1, x.shape[-1]), self.weight)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def swap_linears(model: nn.Module) -> int:
    """Replace each `nn.Linear` in `model` whose dimensions are multiples of 16 by a
    `Float8Linear` that shares its parameters; return how many were replaced.

    The parameters are the same objects, so an optimizer built before the swap still
    updates them. Layers with other shapes stay in full precision.
    """
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (type(child) is nn.Linear and child.in_features % ALIGN == 0
                    and child.out_features % ALIGN == 0):
                fp8 = Float8Linear(child.in_features, child.out_features,
                                   bias=child.bias is not None, device="meta")
                fp8.weight, fp8.bias = child.weight, child.bias
                setattr(parent, name, fp8)
                swapped += 1
    return swapped
# --8<-- [end:module]


# --8<-- [start:savings]
def savings(tokens: int, in_features: int, out_features: int,
            high_bytes: int = 2) -> dict[str, float]:
    """Bytes one linear layer moves and keeps per step, fp8 against `high_bytes` (bf16: 2).

    The three matmuls of a training step (y = x w^T, grad_x = g w, grad_w = g^T x) each
    read two operands: x (tokens x in), w (out x in) and g (tokens x out) are each read
    twice. Backward needs x and w saved. In fp8 each element is 1 byte, plus one fp32
    scale per tensor. Not counted: the casts (a read of the wide tensor and a 1-byte
    write, unless fused into the op that produced it) and the weight, its gradient and the
    optimizer state, which keep their own dtypes.
    """
    if min(tokens, in_features, out_features, high_bytes) < 1:
        raise ValueError("tokens, in_features, out_features and high_bytes must be >= 1")
    x, w, g = tokens * in_features, out_features * in_features, tokens * out_features
    read_high, read_fp8 = 2 * (x + w + g) * high_bytes, 2 * (x + w + g) + 3 * 4
    saved_high, saved_fp8 = (x + w) * high_bytes, (x + w) + 2 * 4
    return {"matmul_read_bytes_high": read_high, "matmul_read_bytes_fp8": read_fp8,
            "matmul_read_ratio": read_fp8 / read_high,
            "saved_bytes_high": saved_high, "saved_bytes_fp8": saved_fp8,
            "saved_ratio": saved_fp8 / saved_high}
# --8<-- [end:savings]

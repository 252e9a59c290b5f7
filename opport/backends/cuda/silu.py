"""silu in Triton: the shared elementwise launcher plus one line of math; its backward grad * silu'(x) likewise."""

import torch

from opport.backends.cuda._launch import (
    at,
    elementwise,
    elementwise_tile,
    f32,
    narrow,
    silu_f32,
    silu_grad_wide,
    tl,
    triton,
)
from opport.dispatch import impl
from opport.ops.silu import silu as spec


@triton.jit
def _silu_kernel(
    # pointers
    x_ptr, out_ptr,
    # shapes, strides
    n_rows, n_cols, n1, n2, x_s0, x_s1, x_s2, x_sc, o_s0, o_s1, o_s2, o_sc,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """out = x * sigmoid(x) in float32, rounded once; silu(-inf) = -0.0. One read, one write per element."""
    i0, i1, i2, cols, mask = elementwise_tile(n_rows, n_cols, n1, n2, BLOCK_M, BLOCK_N)
    x = f32(tl.load(x_ptr + at(i0, i1, i2, cols, x_s0, x_s1, x_s2, x_sc), mask=mask, other=0.0))
    y = narrow(silu_f32(x), out_ptr.dtype.element_ty)
    tl.store(out_ptr + at(i0, i1, i2, cols, o_s0, o_s1, o_s2, o_sc), y, mask=mask)


@impl(spec, "cuda")
def silu(x: torch.Tensor) -> torch.Tensor:
    return elementwise(_silu_kernel, [x], torch.empty(x.shape, dtype=x.dtype, device=x.device))


# --------------------------------------------------------------------------- backward


@triton.jit
def _silu_bwd_kernel(
    # pointers
    g_ptr, x_ptr, dx_ptr,
    # shapes, strides
    n_rows, n_cols, n1, n2, g_s0, g_s1, g_s2, g_sc, x_s0, x_s1, x_s2, x_sc, d_s0, d_s1, d_s2, d_sc,
    # meta-parameters
    PRECISE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dx = grad * silu'(x), rounded once. Two reads, one write per element.

    Notes: silu'(x) comes from `silu_grad_wide` (float32 accuracy, float64 range) and the product is taken in
    float64: where float32's exp(x) would be subnormal or flushed (x < -87) the product keeps its relative
    accuracy (grad near the float maximum meets silu'(-90) ~ 1e-37 in the edge cases), an infinite grad keeps
    its sign down to -745 where the reference's float64 silu' is 0 (and inf * 0 = NaN, as there), and
    grad * silu' cannot overflow before its rounding. PRECISE (float32 input): libdevice's expf on a GPU.
    """
    i0, i1, i2, cols, mask = elementwise_tile(n_rows, n_cols, n1, n2, BLOCK_M, BLOCK_N)
    g = f32(tl.load(g_ptr + at(i0, i1, i2, cols, g_s0, g_s1, g_s2, g_sc), mask=mask, other=0.0))
    x = f32(tl.load(x_ptr + at(i0, i1, i2, cols, x_s0, x_s1, x_s2, x_sc), mask=mask, other=0.0))
    dx = (g.to(tl.float64) * silu_grad_wide(x, PRECISE)).to(tl.float32)
    tl.store(dx_ptr + at(i0, i1, i2, cols, d_s0, d_s1, d_s2, d_sc), narrow(dx, dx_ptr.dtype.element_ty), mask=mask)


@impl(spec.backward_op, "cuda")
def silu_backward(grad: torch.Tensor, x: torch.Tensor):
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return (elementwise(_silu_bwd_kernel, [grad, x], dx, PRECISE=x.dtype == torch.float32),)

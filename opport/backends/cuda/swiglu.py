"""swiglu in Triton: silu(gate) * up through the shared elementwise launcher."""

import torch

from opport.backends.cuda._launch import (
    at,
    elementwise,
    elementwise_tile,
    exp_f32,
    f32,
    narrow,
    neg_zero_like,
    sigmoid_f32,
    tl,
    triton,
)
from opport.dispatch import impl
from opport.ops.swiglu import swiglu as spec

DEEP = tl.constexpr(64.0)  # below -DEEP, sigmoid(gate) heads for float32 subnormals (few significant bits)
EXP_NEG_DEEP = tl.constexpr(1.603810890548638e-28)  # exp(-DEEP), a float32 normal


@triton.jit
def _swiglu_kernel(
    # pointers
    gate_ptr, up_ptr, out_ptr,
    # shapes, strides
    n_rows, n_cols, n1, n2,
    g_s0, g_s1, g_s2, g_sc, u_s0, u_s1, u_s2, u_sc, o_s0, o_s1, o_s2, o_sc,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """out = silu(gate) * up in float32, rounded once, with the limits of the reference. Two reads, one write."""
    i0, i1, i2, cols, mask = elementwise_tile(n_rows, n_cols, n1, n2, BLOCK_M, BLOCK_N)
    g = f32(tl.load(gate_ptr + at(i0, i1, i2, cols, g_s0, g_s1, g_s2, g_sc), mask=mask, other=0.0))
    u = f32(tl.load(up_ptr + at(i0, i1, i2, cols, u_s0, u_s1, u_s2, u_sc), mask=mask, other=0.0))
    # gate * (sigmoid(gate) * up) overflows or underflows only where the exact product does; against an
    # infinite up the limit is gate * up (silu(gate) != 0 for finite gate != 0), and silu(-inf) = -0.0
    # for gate < -DEEP: sigmoid(gate) * up = (exp(gate + DEEP) * up) * exp(-DEEP), no subnormal in between
    su = tl.where(g < -DEEP, (exp_f32(g + DEEP, True) * u) * EXP_NEG_DEEP, sigmoid_f32(g) * u)
    y = tl.where((u == float("inf")) | (u == float("-inf")), g * u, g * su)
    y = tl.where(g == float("-inf"), neg_zero_like(u) * u, y)
    tl.store(out_ptr + at(i0, i1, i2, cols, o_s0, o_s1, o_s2, o_sc), narrow(y, out_ptr.dtype.element_ty), mask=mask)


@impl(spec, "cuda", dtypes=("float32", "float16", "bfloat16"))
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return elementwise(_swiglu_kernel, [gate, up], torch.empty(gate.shape, dtype=gate.dtype, device=gate.device))

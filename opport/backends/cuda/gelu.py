"""gelu in Triton, both forms, through the shared elementwise launcher."""

import torch

from opport.backends.cuda._launch import (
    at,
    elementwise,
    elementwise_tile,
    f32,
    narrow,
    neg_zero_like,
    sigmoid_f32,
    tl,
    triton,
)
from opport.dispatch import impl
from opport.ops.gelu import gelu as spec

SQRT1_2 = tl.constexpr(0.7071067811865476)
TANH_K = tl.constexpr(1.5957691216057308)  # 2 * sqrt(2 / pi): 1 + tanh(u) = 2 * sigmoid(2u)


@triton.jit
def _gelu_kernel(
    # pointers
    x_ptr, out_ptr,
    # shapes, strides
    n_rows, n_cols, n1, n2, x_s0, x_s1, x_s2, x_sc, o_s0, o_s1, o_s2, o_sc,
    # meta-parameters
    TANH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """"none": x/2 * (1 + erf(x/sqrt2)); "tanh": x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3)).

    Notes: float32 math, rounded once. The tanh form is written as a sigmoid, which has no
    cancellation for x << 0 and no overflow. 1 + erf cancels for x < -4 (an absolute error below
    3e-7, inside the activation tolerance). gelu(-inf) = -0.0 by the limit (the formula gives -inf * 0).
    """
    i0, i1, i2, cols, mask = elementwise_tile(n_rows, n_cols, n1, n2, BLOCK_M, BLOCK_N)
    x = f32(tl.load(x_ptr + at(i0, i1, i2, cols, x_s0, x_s1, x_s2, x_sc), mask=mask, other=0.0))
    if TANH:
        y = x * sigmoid_f32(TANH_K * (x + 0.044715 * x * x * x))
    else:
        y = 0.5 * x * (1.0 + tl.erf(x * SQRT1_2))
    y = tl.where(x == float("-inf"), neg_zero_like(x), y)
    tl.store(out_ptr + at(i0, i1, i2, cols, o_s0, o_s1, o_s2, o_sc), narrow(y, out_ptr.dtype.element_ty), mask=mask)


@impl(spec, "cuda", dtypes=("float32", "float16", "bfloat16"))
def gelu(x: torch.Tensor, approximate: str) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return elementwise(_gelu_kernel, [x], out, TANH=approximate == "tanh")

"""silu in Triton: the shared elementwise launcher plus one line of math."""

import torch

from opport.backends.cuda._launch import at, elementwise, elementwise_tile, f32, narrow, silu_f32, tl, triton
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


@impl(spec, "cuda", dtypes=("float32", "float16", "bfloat16"))
def silu(x: torch.Tensor) -> torch.Tensor:
    return elementwise(_silu_kernel, [x], torch.empty(x.shape, dtype=x.dtype, device=x.device))

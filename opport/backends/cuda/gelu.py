"""gelu in Triton, both forms, through the shared elementwise launcher; its backward grad * gelu'(x) likewise."""

import torch

from opport.backends.cuda._launch import (
    at,
    elementwise,
    elementwise_tile,
    exp_f32,
    f32,
    is_finite,
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


@impl(spec, "cuda")
def gelu(x: torch.Tensor, approximate: str) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return elementwise(_gelu_kernel, [x], out, TANH=approximate == "tanh")


# --------------------------------------------------------------------------- backward

TANH_K3 = tl.constexpr(0.21406444881780073)  # 3 * 0.044715 * 2 * sqrt(2 / pi): x 2u' = x (TANH_K + TANH_K3 x^2)
TANH_KC = tl.constexpr(0.07135481627260025)  # 0.044715 * 2 * sqrt(2 / pi): 2u = x (TANH_K + TANH_KC x^2)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
# Numerical Recipes `erfcc`: erfc(z) = t exp(-z^2 + P(t)), t = 1 / (1 + z/2), fractional error < 1.2e-7 for every
# z >= 0 (the cpu kernels' fit); P's coefficients, highest order first, for Horner's scheme
P9, P8, P7, P6, P5 = tl.constexpr(0.17087277), tl.constexpr(-0.82215223), tl.constexpr(1.48851587), \
    tl.constexpr(-1.13520398), tl.constexpr(0.27886807)
P4, P3, P2, P1, P0 = tl.constexpr(-0.18628806), tl.constexpr(0.09678418), tl.constexpr(0.37409196), \
    tl.constexpr(1.00002368), tl.constexpr(-1.26551223)
# Below -10 gelu' (both forms) is negative; float32's underflows to 0 near -13 (erf form) or -11 (tanh form), the
# reference's float64 one only at these x (the most negative float32 where it is nonzero): between, an infinite
# grad gives -grad there, not inf * 0 = NaN.
NONZERO_ERF, NONZERO_TANH = tl.constexpr(-38.575496673583984), tl.constexpr(-21.51662826538086)


@triton.jit
def _gelu_bwd_kernel(
    # pointers
    g_ptr, x_ptr, dx_ptr,
    # shapes, strides
    n_rows, n_cols, n1, n2, g_s0, g_s1, g_s2, g_sc, x_s0, x_s1, x_s2, x_sc, d_s0, d_s1, d_s2, d_sc,
    # meta-parameters
    TANH: tl.constexpr, PRECISE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dx = grad * gelu'(x) in float32, rounded once. Two reads, one write per element.

    Notes: the derivatives are the cpu kernels' careful forms (`_gelu_erf_grad`, `_gelu_tanh_grad`); their
    limits are gelu'(-inf) = 0 and gelu'(+inf) = 1. An infinite grad where float32's gelu' underflowed but
    float64's does not gives -grad (see NONZERO_ERF). PRECISE (float32 input): libdevice's expf on a GPU,
    whose 2 ULP stay inside the 8 ULP bound where the fast exp's argument-scaled error (~36 ULP near
    exp(-50), the density at x = -10) would not.
    """
    i0, i1, i2, cols, mask = elementwise_tile(n_rows, n_cols, n1, n2, BLOCK_M, BLOCK_N)
    g = f32(tl.load(g_ptr + at(i0, i1, i2, cols, g_s0, g_s1, g_s2, g_sc), mask=mask, other=0.0))
    x = f32(tl.load(x_ptr + at(i0, i1, i2, cols, x_s0, x_s1, x_s2, x_sc), mask=mask, other=0.0))
    if TANH:
        d = _gelu_tanh_grad(x, PRECISE)
        nonzero64 = NONZERO_TANH
    else:
        d = _gelu_erf_grad(x, PRECISE)
        nonzero64 = NONZERO_ERF
    dx = tl.where(~is_finite(g) & (g == g) & (x < -10.0) & (x >= nonzero64), -g, g * d)
    tl.store(dx_ptr + at(i0, i1, i2, cols, d_s0, d_s1, d_s2, d_sc), narrow(dx, dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_erf_grad(x, PRECISE: tl.constexpr):
    """gelu'(x) = Phi(x) + x phi(x) = H + s (|x| phi(x) - Phi(-|x|)), s = sign(x), H = 1 for x >= 0 else 0.

    Phi(-|x|) comes from the erfc fit (no 1 + erf cancellation in the tail), and phi from exp(-a^2/2) with a^2
    split as hi^2 + (a - hi)(a + hi), hi = a's top 12 significand bits: hi^2 is exact, so exp does not turn a
    rounded a^2 into a relative error of a^2 2^-24 (3e-6 at a = 10). |x| is clipped at 16, where both terms
    are 0 in float32 (NaN passes the clip).
    """
    a = tl.abs(x)
    a = tl.where(a > 16.0, 16.0, a)
    t = 1.0 / (1.0 + 0.5 * (a * SQRT1_2))
    p = P9
    p = p * t + P8
    p = p * t + P7
    p = p * t + P6
    p = p * t + P5
    p = p * t + P4
    p = p * t + P3
    p = p * t + P2
    p = p * t + P1
    p = p * t + P0
    hi = (a.to(tl.int32, bitcast=True) & -4096).to(tl.float32, bitcast=True)  # -4096 = 0xFFFFF000
    lo = ((a - hi) * (a + hi)) * -0.5
    e_hi = exp_f32(hi * hi * -0.5, PRECISE)
    density = exp_f32(lo, PRECISE) * e_hi * INV_SQRT_2PI
    tail = exp_f32(lo + p, PRECISE) * t * e_hi * 0.5
    s = tl.where(x < 0, -1.0, 1.0)
    return tl.where(x < 0, 0.0, 1.0) + s * (a * density - tail)


@triton.jit
def _gelu_tanh_grad(x, PRECISE: tl.constexpr):
    """d/dx x sigmoid(2u) = sigmoid(2u) + x 2u' sigmoid(2u) sigmoid(-2u), with 2u = sqrt(8/pi) (x + 0.044715 x^3)
    as in the forward, evaluated as q (num + x 2u' e q): e = exp(-|2u|), q = 1 / (1 + e), num = 1 (2u >= 0) or e.
    x is clipped to +-64 first (exp(-|2u|) is 0 beyond |x| = 11), so x 2u' e is 0, not inf * 0, at the infinities."""
    xc = tl.where(x > 64.0, 64.0, tl.where(x < -64.0, -64.0, x))
    x2 = xc * xc
    two_u = (x2 * TANH_KC + TANH_K) * xc
    slope = (x2 * TANH_K3 + TANH_K) * xc
    e = exp_f32(-tl.abs(two_u), PRECISE)
    q = 1.0 / (1.0 + e)
    return (slope * e * q + tl.where(two_u >= 0, 1.0, e)) * q


@impl(spec.backward_op, "cuda")
def gelu_backward(grad: torch.Tensor, x: torch.Tensor, approximate: str):
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return (elementwise(_gelu_bwd_kernel, [grad, x], dx, TANH=approximate == "tanh", PRECISE=x.dtype == torch.float32),)

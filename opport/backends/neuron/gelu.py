"""gelu on NKI: one ScalarE activation per tile (erf form or tanh form)."""

from __future__ import annotations

import numpy as np

from opport.backends.neuron import _host
from opport.backends.neuron._tiles import spans
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.backends.neuron.silu import infinite_limit
from opport.dispatch import impl
from opport.ops.gelu import gelu as spec

FMAX = 4096  # free-dim chunk: in, clamped and out tiles <= 48 KiB per partition (fp32), room to double-buffer
NEG_BIG = -3.4028234663852886e38  # -FLT_MAX: gelu(-FLT_MAX) = -0.0 = gelu(-inf), inside the activation's input range


@nki.jit
def _gelu_kernel(x_hbm, approximate):
    """Elementwise GELU of a [R, C] tensor, R on partitions, C on the free dimension.

    Dimensions:
        R: partitions in use (tiled by 128); C: elements per partition (chunks of FMAX).

    Args:
        x_hbm: [R, C] input in HBM, float32/float16/bfloat16.
        approximate: compile-time "none" (x * Phi(x), erf form) or "tanh".

    Returns:
        out_hbm: [R, C] in x's dtype.

    Notes:
        One ScalarE activation per tile (nl.gelu or nl.gelu_apprx_tanh), computed in float32 and
        cast to x's dtype on the write. The activation tables cover the reals only (-inf would give
        -inf * 0 = NaN), so a VectorE max first maps -inf to -FLT_MAX, whose GELU is the limit -0.0
        (NaN must pass through that max: IEEE maximum, checked in emulation only). Pure streaming:
        every element is read and written once. ScalarE adds its (zero) bias, which turns -0.0 into
        +0.0: two VectorE instructions copy x itself where x == 0 (gelu(+-0) = +-0).

    Pseudocode:
        for each [128, FMAX] tile: out = gelu(max(x, -FLT_MAX)); out[x == 0] = x
    """
    R, C = x_hbm.shape
    out_hbm = nl.ndarray((R, C), dtype=x_hbm.dtype, buffer=nl.shared_hbm)
    PMAX = nl.tile_size.pmax
    act = nl.gelu_apprx_tanh if approximate == "tanh" else nl.gelu
    for r0, p in spans(R, PMAX):
        for c0, f in spans(C, FMAX):
            x_sb = nl.ndarray((p, f), dtype=x_hbm.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=x_sb, src=x_hbm[r0:r0 + p, c0:c0 + f])
            xc_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=xc_sb, data=x_sb, op0=nl.maximum, operand0=NEG_BIG)
            out_sb = nl.ndarray((p, f), dtype=x_hbm.dtype, buffer=nl.sbuf)
            nisa.activation(dst=out_sb, op=act, data=xc_sb)
            zero_sb = nl.ndarray((p, f), dtype=nl.uint8, buffer=nl.sbuf)  # 1 where x == +-0
            nisa.tensor_scalar(dst=zero_sb, data=x_sb, op0=nl.equal, operand0=0.0)
            nisa.tensor_copy_predicated(dst=out_sb, src=x_sb, predicate=zero_sb)
            nisa.dma_copy(dst=out_hbm[r0:r0 + p, c0:c0 + f], src=out_sb)
    return out_hbm


@impl(spec, "neuron")
def gelu(x: np.ndarray, approximate: str) -> np.ndarray:
    """Host side: lay the flat input onto the partitions ([128, n/128] plus a [tail, 1] tail) and launch."""
    return _host.run_elementwise(_gelu_kernel, (x,), x.dtype.name, approximate)


# --------------------------------------------------------------------------- backward

GRAD_FMAX = 2048  # backward free-dim chunk: x, grad and ~9 fp32 temporaries <= 90 KiB per partition
TAIL_CLIP = 16.0  # |x| clipped here: Phi(-16) = 6e-58 and 16 phi(16) are 0 in float32, so +-inf give the limits 1, 0
HI_BITS = -4096  # 0xFFFFF000 as int32: a float32's sign, exponent and top 12 significand bits, so hi * hi is exact
HALF_INV_SQRT2 = 0.35355339059327373  # z / 2 = a / (2 sqrt 2): the fit's t = 1 / (1 + z/2) at z = a / sqrt 2
INV_SQRT_2PI = 0.3989422804014327  # phi(a) = exp(-a^2/2) / sqrt(2 pi)
# Numerical Recipes `erfcc`: erfc(z) = t exp(-z^2 + P(t)), relative error < 1.2e-7 for every z >= 0 (Chebyshev
# fit), the cpu kernel's float32 tail; P's coefficients, lowest order first
ERFC_P = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806,
          0.27886807, -1.13520398, 1.48851587, -0.82215223, 0.17087277)
SQRT_8_OVER_PI = 1.5957691216057308  # tanh form: 2u = sqrt(8/pi) (x + 0.044715 x^3)
TANH_CUBIC = 0.07135481627260025  # sqrt(8/pi) * 0.044715
TANH_SLOPE = 0.21406444881780076  # 3 sqrt(8/pi) * 0.044715: d(2u)/dx = sqrt(8/pi) + TANH_SLOPE x^2
TANH_CLIP = 64.0  # |x| clipped for the tanh form: exp(-|2u|) is 0 there in float32, the limits again
GELU_GRAD_ZERO64 = -38.57550048828125  # float32 x at and below which float64 gelu'(x) is 0: inf * 0 = NaN there
GELU_TANH_GRAD_ZERO64 = -21.516630172729492  # the same for the tanh form


def split_square(a_sb, p, f):
    """(hh, lo) with a * a = hh + lo, hh = hi * hi exact (hi = a's top 12 significand bits) and lo = (a - hi)
    (a + hi) small: exp(-a^2/2) as exp(-hh/2) exp(-lo/2) keeps the digits a rounded a * a would lose (that
    error, a^2 2^-24, becomes exp's relative error: 3e-6 at a = 10)."""
    hi_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=hi_sb.view(nl.int32), data=a_sb.view(nl.int32), op0=nl.bitwise_and, operand0=HI_BITS)
    hh_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=hh_sb, data1=hi_sb, data2=hi_sb, op=nl.multiply)
    lo_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=lo_sb, data1=a_sb, data2=hi_sb, op=nl.subtract)
    nisa.tensor_tensor(dst=hi_sb, data1=a_sb, data2=hi_sb, op=nl.add)
    nisa.tensor_tensor(dst=lo_sb, data1=lo_sb, data2=hi_sb, op=nl.multiply)
    return hh_sb, lo_sb


def erf_form_grad(d_sb, x_sb, p, f):
    """d = gelu'(x) = Phi(x) + x phi(x) of the erf form in float32, as H + s (a phi(a) - Phi(-a)) with a = |x|,
    s = sign(x) and H = 1 for x >= 0, else 0: Phi(-a) from the erfc fit (1 + erf cancels for x << 0; ScalarE
    has no erfc), so d keeps its relative accuracy into the tail. With E = exp(-a^2/2) = exp(-hh/2) exp(-lo/2)
    (split_square), Phi(-a) = t E exp(P(t)) / 2 and a phi(a) = a E / sqrt(2 pi):
    d = H + s E (a / sqrt(2 pi) - t exp(P(t)) / 2)."""
    a_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=a_sb, data=x_sb, op0=nl.abs, operand0=0.0, op1=nl.minimum, operand1=TAIL_CLIP)
    hh_sb, lo_sb = split_square(a_sb, p, f)
    t_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=t_sb, data=a_sb, op0=nl.multiply, operand0=HALF_INV_SQRT2, op1=nl.add, operand1=1.0)
    nisa.reciprocal(dst=t_sb, data=t_sb)
    q_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)  # P(t) - c0 by Horner
    nisa.tensor_scalar(dst=q_sb, data=t_sb, op0=nl.multiply, operand0=ERFC_P[9])
    for c in ERFC_P[8:0:-1]:
        nisa.scalar_tensor_tensor(dst=q_sb, data=q_sb, op0=nl.add, operand0=c, op1=nl.multiply, operand1=t_sb)
    c0_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)  # a [P, 1] bias: any generation
    nisa.memset(dst=c0_sb, value=ERFC_P[0])
    nisa.activation(dst=q_sb, op=nl.exp, data=q_sb, bias=c0_sb)  # exp(P(t))
    e_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=e_sb, op=nl.exp, data=hh_sb, scale=-0.5)  # hh/2 exact
    nisa.activation(dst=lo_sb, op=nl.exp, data=lo_sb, scale=-0.5)
    nisa.tensor_tensor(dst=e_sb, data1=e_sb, data2=lo_sb, op=nl.multiply)  # E = exp(-hh/2) exp(-lo/2)
    nisa.scalar_tensor_tensor(dst=q_sb, data=t_sb, op0=nl.multiply, operand0=0.5, op1=nl.multiply, operand1=q_sb)
    nisa.scalar_tensor_tensor(dst=q_sb, data=a_sb, op0=nl.multiply, operand0=INV_SQRT_2PI, op1=nl.subtract,
                              operand1=q_sb)
    nisa.tensor_tensor(dst=q_sb, data1=q_sb, data2=e_sb, op=nl.multiply)  # B = a phi(a) - Phi(-a)
    nisa.tensor_scalar(dst=d_sb, data=q_sb, op0=nl.add, operand0=1.0)
    nisa.tensor_scalar(dst=q_sb, data=q_sb, op0=nl.multiply, operand0=-1.0)
    neg_sb = nl.ndarray((p, f), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=neg_sb, data=x_sb, op0=nl.less, operand0=0.0)
    nisa.tensor_copy_predicated(dst=d_sb, src=q_sb, predicate=neg_sb)


def tanh_form_grad(d_sb, x_sb, p, f):
    """d = gelu'(x) of the tanh form in float32: with 2u = sqrt(8/pi) (x + 0.044715 x^3), gelu = x sigmoid(2u)
    and d = sigmoid(2u) (1 + x (2u)' sigmoid(-2u)); both sigmoids from ScalarE (no 1 - sigmoid cancellation),
    x clipped to +-TANH_CLIP so that +-inf give the limits 1 and 0 rather than inf * 0."""
    xc_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=xc_sb, data=x_sb, op0=nl.maximum, operand0=-TANH_CLIP, op1=nl.minimum, operand1=TANH_CLIP)
    x2_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=x2_sb, data1=xc_sb, data2=xc_sb, op=nl.multiply)
    u_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)  # 2u
    nisa.tensor_scalar(dst=u_sb, data=x2_sb, op0=nl.multiply, operand0=TANH_CUBIC, op1=nl.add, operand1=SQRT_8_OVER_PI)
    nisa.tensor_tensor(dst=u_sb, data1=u_sb, data2=xc_sb, op=nl.multiply)
    nisa.tensor_scalar(dst=x2_sb, data=x2_sb, op0=nl.multiply, operand0=TANH_SLOPE, op1=nl.add, operand1=SQRT_8_OVER_PI)
    nisa.tensor_tensor(dst=x2_sb, data1=x2_sb, data2=xc_sb, op=nl.multiply)  # x (2u)'
    sn_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=sn_sb, op=nl.sigmoid, data=u_sb, scale=-1.0)
    nisa.activation(dst=u_sb, op=nl.sigmoid, data=u_sb)
    nisa.tensor_tensor(dst=x2_sb, data1=x2_sb, data2=sn_sb, op=nl.multiply)
    nisa.scalar_tensor_tensor(dst=d_sb, data=x2_sb, op0=nl.add, operand0=1.0, op1=nl.multiply, operand1=u_sb)


@nki.jit
def _gelu_backward_kernel(g_hbm, x_hbm, approximate):
    """Gradient of GELU, dx = grad * gelu'(x), of [R, C] tensors, R on partitions, C on the free dimension.

    Dimensions:
        R: partitions in use (tiled by 128); C: elements per partition (chunks of GRAD_FMAX).

    Args:
        g_hbm: [R, C] upstream gradient in HBM, float32/float16/bfloat16.
        x_hbm: [R, C] the forward's input (saved), same dtype.
        approximate: compile-time "none" (erf form) or "tanh".

    Returns:
        dx_hbm: [R, C] in x's dtype.

    Notes:
        No activation table gives gelu' with its tail: the erf form builds it from the erfc fit on VectorE
        (a Horner polynomial) and two ScalarE exps (erf_form_grad), the tanh form from two ScalarE
        sigmoids (tanh_form_grad); float32 throughout, cast once on the final copy. An infinite grad
        that met a gelu' float32 rounds to 0 takes the float64 reference's limit (silu's infinite_limit).
        Pure streaming: grad and x read once, dx written once.

    Pseudocode:
        for each [128, GRAD_FMAX] tile:
            d = gelu'(x)                 (erf form: H + s (a phi(a) - Phi(-a)), a = min(|x|, 16))
            dx = g * d
            dx[dx is NaN, |g| = inf, x > x_zero] = -g
    """
    R, C = x_hbm.shape
    dx_hbm = nl.ndarray((R, C), dtype=x_hbm.dtype, buffer=nl.shared_hbm)
    PMAX = nl.tile_size.pmax
    x_zero = GELU_TANH_GRAD_ZERO64 if approximate == "tanh" else GELU_GRAD_ZERO64
    for r0, p in spans(R, PMAX):
        for c0, f in spans(C, GRAD_FMAX):
            x_sb = nl.ndarray((p, f), dtype=x_hbm.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=x_sb, src=x_hbm[r0:r0 + p, c0:c0 + f])
            g_sb = nl.ndarray((p, f), dtype=g_hbm.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=g_sb, src=g_hbm[r0:r0 + p, c0:c0 + f])
            d_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
            if approximate == "tanh":
                tanh_form_grad(d_sb, x_sb, p, f)
            else:
                erf_form_grad(d_sb, x_sb, p, f)
            nisa.tensor_tensor(dst=d_sb, data1=d_sb, data2=g_sb, op=nl.multiply)
            lim_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=lim_sb, data=g_sb, op0=nl.multiply, operand0=-1.0)
            infinite_limit(d_sb, x_sb, lim_sb, x_zero, p, f)
            dx_sb = nl.ndarray((p, f), dtype=x_hbm.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=dx_sb, src=d_sb)
            nisa.dma_copy(dst=dx_hbm[r0:r0 + p, c0:c0 + f], src=dx_sb)
    return dx_hbm


@impl(spec.backward_op, "neuron")
def gelu_backward(grad: np.ndarray, x: np.ndarray, approximate: str):
    """Host side: lay grad and x onto the partitions ([128, n/128] plus a [tail, 1] tail) and launch."""
    return (_host.run_elementwise(_gelu_backward_kernel, (grad, x), x.dtype.name, approximate),)

"""silu on NKI: one ScalarE activation per tile."""

from __future__ import annotations

import math

import numpy as np

from opport.backends.neuron import _host
from opport.backends.neuron._tiles import spans
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.dispatch import impl
from opport.ops.silu import silu as spec

FMAX = 8192  # free-dim chunk: in + out tiles <= 48 KiB per partition (fp32)


@nki.jit
def _silu_kernel(x_hbm):
    """Elementwise SiLU, x * sigmoid(x), of a [R, C] tensor, R on partitions, C on the free dimension.

    Dimensions:
        R: partitions in use (tiled by 128); C: elements per partition (chunks of FMAX).

    Args:
        x_hbm: [R, C] input in HBM, float32/float16/bfloat16.

    Returns:
        out_hbm: [R, C] in x's dtype.

    Notes:
        A single ScalarE nl.silu activation per tile, float32 inside, cast on the write; the
        activation table handles x = -inf (-0.0) where a naive x * sigmoid(x) would give NaN.
        ScalarE computes silu(x * scale + bias), and -0.0 + 0.0 is +0.0, so silu(-0.0) would come out
        +0.0: two VectorE instructions copy x itself where x == 0 (silu(+-0) = +-0).

    Pseudocode:
        for each [128, FMAX] tile: out = silu(x); out[x == 0] = x
    """
    R, C = x_hbm.shape
    out_hbm = nl.ndarray((R, C), dtype=x_hbm.dtype, buffer=nl.shared_hbm)
    PMAX = nl.tile_size.pmax
    for r0, p in spans(R, PMAX):
        for c0, f in spans(C, FMAX):
            x_sb = nl.ndarray((p, f), dtype=x_hbm.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=x_sb, src=x_hbm[r0:r0 + p, c0:c0 + f])
            out_sb = nl.ndarray((p, f), dtype=x_hbm.dtype, buffer=nl.sbuf)
            nisa.activation(dst=out_sb, op=nl.silu, data=x_sb)
            zero_sb = nl.ndarray((p, f), dtype=nl.uint8, buffer=nl.sbuf)  # 1 where x == +-0
            nisa.tensor_scalar(dst=zero_sb, data=x_sb, op0=nl.equal, operand0=0.0)
            nisa.tensor_copy_predicated(dst=out_sb, src=x_sb, predicate=zero_sb)
            nisa.dma_copy(dst=out_hbm[r0:r0 + p, c0:c0 + f], src=out_sb)
    return out_hbm


@impl(spec, "neuron")
def silu(x: np.ndarray) -> np.ndarray:
    """Host side: lay the flat input onto the partitions ([128, n/128] plus a [tail, 1] tail) and launch."""
    return _host.run_elementwise(_silu_kernel, (x,), x.dtype.name)


# --------------------------------------------------------------------------- backward

GRAD_FMAX = 2048  # backward free-dim chunk: x, grad and ~8 fp32 temporaries <= 80 KiB per partition
CLIP = 1024.0  # |x| clipped here where it multiplies sigmoid(-x): exp(-1024) is 0, so +-inf give the limits, not inf * 0
DEEP = 64.0  # below -DEEP, sigmoid(x) heads for float32 subnormals (exp(-87.3) = FLT_MIN), which hold few bits
EXP_NEG_DEEP = 1.603810890548638e-28  # exp(-DEEP), a float32 normal
ROOT_HI = -1.2784645557403564  # silu's root x0 = -1.27846454276107379... = float32 ROOT_HI + ROOT_LO
ROOT_LO = 1.297928265020314e-08  # the rest of x0, so x - x0 keeps its digits near the root
ROOT_EXP = 0.2784645427610738  # exp(x0) = -(1 + x0) (x0 solves 1 + x + exp(x) = 0)
ROOT_WINDOW = 0.5  # |x - x0| below this takes the root form of silu' (silu_grad): elsewhere the short form is closer
SILU_GRAD_ZERO64 = -745.1332397460938  # float32 x at and below which float64 silu'(x) is 0: inf * 0 = NaN there


def clipped(x_sb, p, f):
    """x clipped to +-CLIP in float32, for where x multiplies a factor that is 0 at +-inf (their limits, not
    inf * 0). NaN passes (IEEE maximum / minimum)."""
    xc_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=xc_sb, data=x_sb, op0=nl.maximum, operand0=-CLIP, op1=nl.minimum, operand1=CLIP)
    return xc_sb


def silu_grad(d_sb, sp_sb, x_sb, xc_sb, p, f):
    """d = silu'(x) in float32, given sp = sigmoid(x) and xc = x clipped (`clipped`: +-inf give the limits 1 and 0).

    sigmoid(x) (1 + x sigmoid(-x)), sigmoid(-x) straight from ScalarE (1 - sigmoid(x) cancels for x >> 0):
    three roundings. Around silu's root x0 = -1.27846 the bracket cancels to float32 noise (about 1e-7
    absolute, which a large grad * up turns into many ulps of swiglu's dgate). The same value is
    sigmoid(x) sigmoid(-x) (1 + x + exp(x)), and with h = x - x0 and exp(x0) = -(1 + x0):
    1 + x + exp(x) = h + exp(x0) expm1(h), two terms of one sign. expm1(h) = 2t / (1 - t) with t = tanh(h/2)
    keeps its relative accuracy for small h (ScalarE has no expm1), and h is exact near x0 (x0 held as two
    floats): every factor a few ulps, silu' too, right through the root. It takes more roundings, so only
    |h| < ROOT_WINDOW takes it (the window that measured best: <= 3.4 ulps, 0.69 ulps RMS on [-8, 0])."""
    sn_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=sn_sb, op=nl.sigmoid, data=x_sb, scale=-1.0)
    t_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=t_sb, data1=xc_sb, data2=sn_sb, op=nl.multiply)  # x sigmoid(-x)
    nisa.scalar_tensor_tensor(dst=d_sb, data=t_sb, op0=nl.add, operand0=1.0, op1=nl.multiply, operand1=sp_sb)

    h_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)  # x - x0, exact near x0 (Sterbenz)
    nisa.tensor_scalar(dst=h_sb, data=xc_sb, op0=nl.subtract, operand0=ROOT_HI, op1=nl.subtract, operand1=ROOT_LO)
    nisa.activation(dst=t_sb, op=nl.tanh, data=h_sb, scale=0.5)
    q_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=q_sb, data=t_sb, op0=nl.multiply, operand0=-1.0, op1=nl.add, operand1=1.0)
    nisa.reciprocal(dst=q_sb, data=q_sb)
    nisa.tensor_tensor(dst=q_sb, data1=t_sb, data2=q_sb, op=nl.multiply)  # expm1(h) / 2
    nisa.scalar_tensor_tensor(dst=q_sb, data=q_sb, op0=nl.multiply, operand0=2.0 * ROOT_EXP, op1=nl.add,
                              operand1=h_sb)
    nisa.tensor_tensor(dst=q_sb, data1=q_sb, data2=sp_sb, op=nl.multiply)
    nisa.tensor_tensor(dst=q_sb, data1=q_sb, data2=sn_sb, op=nl.multiply)
    near_sb = nl.ndarray((p, f), dtype=nl.uint8, buffer=nl.sbuf)  # |x - x0| < ROOT_WINDOW
    nisa.tensor_scalar(dst=near_sb, data=h_sb, op0=nl.abs, operand0=0.0, op1=nl.less, operand1=ROOT_WINDOW)
    nisa.tensor_copy_predicated(dst=d_sb, src=q_sb, predicate=near_sb)


def deep_factor(x_sb, g_sb, p, f):
    """(g exp(x + DEEP) in float32, the uint8 predicate x < -DEEP): the scaled start of g silu'(x) in the deep tail.

    Below -DEEP, 1 + exp(x) and sigmoid(-x) are 1 in float32, so silu'(x) = exp(x) (1 + x) exactly in form,
    and g silu'(x) = ((g exp(x + DEEP)) (1 + x)) exp(-DEEP): exp(x + DEEP) <= 1 is a normal number down to
    x = -151 where exp(x) would be subnormal (few significant bits) or 0, so a large g keeps its digits and
    the product cannot overflow before the final factor."""
    bias_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)  # a [P, 1] bias: any generation
    nisa.memset(dst=bias_sb, value=DEEP)
    eg_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=eg_sb, op=nl.exp, data=x_sb, bias=bias_sb)
    nisa.tensor_tensor(dst=eg_sb, data1=eg_sb, data2=g_sb, op=nl.multiply)
    is_deep_sb = nl.ndarray((p, f), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=is_deep_sb, data=x_sb, op0=nl.less, operand0=-DEEP)
    return eg_sb, is_deep_sb


def infinite_limit(dx_sb, x_sb, lim_sb, x_zero, p, f):
    """dx = lim where dx is NaN, lim is infinite and x_zero < x < inf: an infinite factor (grad, or swiglu's
    grad * up) met an f'(x) that float32 rounded to 0 but float64 does not (x > x_zero), where the
    reference's product is an infinity. lim carries its sign: -(the infinite factor), f' < 0 in the deep
    negative tail. Elsewhere a NaN is the reference's too (NaN inputs, inf * 0 past x_zero)."""
    nan_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)  # 1.0 where dx is NaN
    nisa.tensor_tensor(dst=nan_sb, data1=dx_sb, data2=dx_sb, op=nl.not_equal)
    inf_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)  # 1.0 where |lim| = inf
    nisa.tensor_scalar(dst=inf_sb, data=lim_sb, op0=nl.abs, operand0=0.0, op1=nl.equal, operand1=math.inf)
    nisa.tensor_tensor(dst=nan_sb, data1=nan_sb, data2=inf_sb, op=nl.multiply)
    pick_sb = nl.ndarray((p, f), dtype=nl.uint8, buffer=nl.sbuf)  # ... and x_zero < x < inf
    nisa.scalar_tensor_tensor(dst=pick_sb, data=x_sb, op0=nl.greater, operand0=x_zero, op1=nl.multiply,
                              operand1=nan_sb)
    nisa.tensor_copy_predicated(dst=dx_sb, src=lim_sb, predicate=pick_sb)


@nki.jit
def _silu_backward_kernel(g_hbm, x_hbm):
    """Gradient of SiLU, dx = grad * silu'(x), of [R, C] tensors, R on partitions, C on the free dimension.

    Dimensions:
        R: partitions in use (tiled by 128); C: elements per partition (chunks of GRAD_FMAX).

    Args:
        g_hbm: [R, C] upstream gradient in HBM, float32/float16/bfloat16.
        x_hbm: [R, C] the forward's input (saved), same dtype.

    Returns:
        dx_hbm: [R, C] in x's dtype.

    Notes:
        silu'(x) from two ScalarE sigmoids (of x and -x, so nothing cancels for x >> 0) and, near its root,
        a tanh that expresses silu' without the cancellation there (silu_grad); VectorE does the
        products, float32 throughout, cast once on the final copy.
        Where x < -DEEP the product g silu'(x) is recomputed scaled (deep_factor: subnormal sigmoids lose
        their digits against a large g), and an infinite g that met a silu' float32 rounds to 0 takes the
        float64 reference's limit (infinite_limit). Pure streaming: grad and x read once, dx
        written once.

    Pseudocode:
        for each [128, GRAD_FMAX] tile:
            dx = g * sigmoid(x) * (1 + clip(x) * sigmoid(-x))
            dx[x < -DEEP] = ((g * exp(x + DEEP)) * (1 + x)) * exp(-DEEP)
            dx[dx is NaN, |g| = inf, x > -745.13] = -g
    """
    R, C = x_hbm.shape
    dx_hbm = nl.ndarray((R, C), dtype=x_hbm.dtype, buffer=nl.shared_hbm)
    PMAX = nl.tile_size.pmax
    for r0, p in spans(R, PMAX):
        for c0, f in spans(C, GRAD_FMAX):
            x_sb = nl.ndarray((p, f), dtype=x_hbm.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=x_sb, src=x_hbm[r0:r0 + p, c0:c0 + f])
            g_sb = nl.ndarray((p, f), dtype=g_hbm.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=g_sb, src=g_hbm[r0:r0 + p, c0:c0 + f])
            xc_sb = clipped(x_sb, p, f)
            sp_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=sp_sb, op=nl.sigmoid, data=x_sb)
            d_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
            silu_grad(d_sb, sp_sb, x_sb, xc_sb, p, f)
            nisa.tensor_tensor(dst=d_sb, data1=d_sb, data2=g_sb, op=nl.multiply)
            eg_sb, is_deep_sb = deep_factor(x_sb, g_sb, p, f)
            deep_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)  # (1 + x) clipped: -inf gives g * 0
            nisa.scalar_tensor_tensor(dst=deep_sb, data=xc_sb, op0=nl.add, operand0=1.0, op1=nl.multiply,
                                      operand1=eg_sb)
            nisa.tensor_scalar(dst=deep_sb, data=deep_sb, op0=nl.multiply, operand0=EXP_NEG_DEEP)
            nisa.tensor_copy_predicated(dst=d_sb, src=deep_sb, predicate=is_deep_sb)
            lim_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=lim_sb, data=g_sb, op0=nl.multiply, operand0=-1.0)
            infinite_limit(d_sb, x_sb, lim_sb, SILU_GRAD_ZERO64, p, f)
            dx_sb = nl.ndarray((p, f), dtype=x_hbm.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=dx_sb, src=d_sb)
            nisa.dma_copy(dst=dx_hbm[r0:r0 + p, c0:c0 + f], src=dx_sb)
    return dx_hbm


@impl(spec.backward_op, "neuron")
def silu_backward(grad: np.ndarray, x: np.ndarray):
    """Host side: lay grad and x onto the partitions ([128, n/128] plus a [tail, 1] tail) and launch."""
    return (_host.run_elementwise(_silu_backward_kernel, (grad, x), x.dtype.name),)

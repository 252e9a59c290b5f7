"""Elementwise helpers for the NumPy activation kernels (silu, swiglu, gelu).

The block functions `fn(y, *xs)` take float32 or float64 blocks (16-bit inputs are upcast by
`elementwise`), write the result into `y` and never write their inputs (a float32 input may be a
view of the user's array, because `upcast` does not copy what is already float32). Each computes a
fast formula everywhere and recomputes with a careful one only the elements the fast one gets
wrong (NaN or -inf inputs, exp overflowing in a deep negative tail). One sum of the fast formula's
denominator tells whether a block has any (a NaN or inf sum; a sum that merely overflows only costs
a look for them). Every element's result depends on that element alone, never on its block.
"""

from __future__ import annotations

import math

import numpy as np

from opport.backends.cpu._common import _F32, PARALLEL_MIN, num_threads, parallel_rows, result_block, store, upcast


def elementwise(fn, *arrays: np.ndarray, outputs: int = 1):
    """`fn(*ys, *blocks)` over same-shape arrays in bounded blocks (about 256K elements) on the cpu threads.

    The `outputs` results have the first array's dtype and shape (returned as a tuple when more than one);
    float32/float64 outputs are written in place, 16-bit ones through a float32 block rounded once.
    `reshape(-1)` copies a non-contiguous input (never writes it); a 0-d array is one element.
    """
    loop = getattr(fn, "fused_loop", None)  # a fused block function (_fused.activation) gives its numba loop
    if loop is not None and arrays[0].size < PARALLEL_MIN:
        done = _direct(loop(), arrays, outputs)
        if done is not None:
            return done
    outs = [np.empty(arrays[0].shape, arrays[0].dtype) for _ in range(outputs)]
    flat = [a.reshape(-1) for a in arrays]
    o = [out.reshape(-1) for out in outs]

    def body(block):
        xs = [upcast(f[block]) for f in flat]
        dsts = [d[block] for d in o]
        ys = fn(*[result_block(d, xs[0]) for d in dsts], *xs)
        for d, y in zip(dsts, ys if outputs > 1 else (ys,)):
            store(d, y)

    parallel_rows(o[0].size, 1, body)
    return tuple(outs) if outputs > 1 else outs[0]


_NO_FLAGS = np.zeros(1, np.uint8)


def _direct(loop, arrays: tuple, outputs: int):
    """A small float32 call (one block, run inline by `parallel_rows` anyway) straight through the fused loop: the
    outputs, or None where an input is not contiguous float32 of the first one's shape or the loop left elements to
    the careful formula (the block path then runs). Saves the block machinery's fixed cost (about 5 us a call,
    more than the loop itself on a decode step's 14336 elements); the results are the block path's bits."""
    shape = arrays[0].shape
    for a in arrays:  # `is`: NumPy's float32 descriptor is one object (a byte-swapped one is not, and goes the long way)
        if a.dtype is not _F32 or a.shape != shape or not a.flags.c_contiguous:
            return None
    num_threads()  # validated on every call, as parallel_rows does
    if outputs == 1:
        out = np.empty(shape, _F32)
        if loop(*[a.reshape(-1) for a in arrays], out.reshape(-1), False, _NO_FLAGS):
            return None
        return out
    outs = [np.empty(shape, _F32) for _ in range(outputs)]
    if loop(*[a.reshape(-1) for a in arrays], *[o.reshape(-1) for o in outs], False, _NO_FLAGS):
        return None
    return tuple(outs)


def denominator(y: np.ndarray, x: np.ndarray):
    """y = 1 + exp(-x), the fast formulas' denominator; returns where it is NaN or inf, or None if nowhere.

    A sum, not a min/max, looks first: NumPy's min/max reductions hold the GIL, its sums do not.
    """
    np.negative(x, out=y)
    np.exp(y, out=y)
    y += 1
    if math.isfinite(y.sum()):  # the method and math.isfinite: half the fixed cost of np.sum / np.isfinite
        return None
    bad = ~np.isfinite(y)
    return bad if bad.any() else None


def select(neg: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a where `neg` (a 0/1 float mask) is 1, else b, for finite-or-NaN a and b, as neg * a + (1 - neg) * b.

    Exact (one term is a product with 0), NaN propagates, and 5-10x faster than np.where, whose
    data-dependent branches cost ~4 ns per element on a random mask.
    """
    out = np.multiply(neg, a)
    out += (1 - neg) * b
    return out


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)) without overflow: exp only ever sees -|x|, so it lies in [0, 1].

    The numerator is e below 0 and 1 above, taken as max(e, x >= 0) (e <= 1; NaN propagates): one
    pass where a select would take four. The same roundings as the float reference run at float32.
    """
    e = np.exp(-np.abs(x))
    num = np.maximum(e, x >= 0)
    return np.divide(num, np.add(e, 1, out=e), out=num)


# Below -C, sigmoid(x) = exp(x) is subnormal or near it (float32: exp(-87.3) = FLT_MIN); exp(-C) is normal.
DEEP = {np.dtype(np.float32): 64.0, np.dtype(np.float64): 512.0}


def sigmoid_times(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """sigmoid(x) * y without a subnormal sigmoid in between (it holds few significant bits).

    For x < -C, 1 + exp(x) == 1, and sigmoid(x) * y = (exp(x + C) * y) * exp(-C): exp(x + C) <= 1
    cannot overflow the product, and x + C is exact for x in [-2C, -C] (Sterbenz).
    """
    r = np.multiply(sigmoid(x), y)
    c = x.dtype.type(DEEP[x.dtype])
    deep = x < -c
    if deep.any():
        r[deep] = np.exp(x[deep] + c) * y[deep] * np.exp(-c)
    return r


def times_sigmoid(x: np.ndarray, s: np.ndarray) -> np.ndarray:
    """x * sigmoid(s), the careful way: -0.0 where x = -inf (the naive product is -inf * 0 = NaN)."""
    y = np.multiply(x, sigmoid(s))
    np.copyto(y, -0.0, where=np.isneginf(x))
    return y


def silu(y: np.ndarray, x: np.ndarray) -> np.ndarray:
    """x / (1 + exp(-x)) (silu(+inf) = inf / 1) where exp(-x) is finite; the careful formula elsewhere."""
    bad = denominator(y, x)
    np.divide(x, y, out=y)
    if bad is not None:
        y[bad] = times_sigmoid(x[bad], x[bad])
    return y


# --------------------------------------------------------------------------- gelu

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT2 = 1.0 / math.sqrt(2.0)

# Numerical Recipes `erfcc`: erfc(z) = t*exp(-z*z + P(t)), t = 1/(1 + z/2), z >= 0, with a fractional
# error below 1.2e-7 for every z (Chebyshev fit). P's coefficients, lowest order first.
_ERFC_P = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806,
           0.27886807, -1.13520398, 1.48851587, -0.82215223, 0.17087277)


def _neg_half_square_exp32(a: np.ndarray) -> tuple:
    """exp(-a*a/2) for float32 a >= 0 as a product of two factors, keeping a*a exact.

    a*a rounded to float32 errs by up to a*a*2^-24, which exp turns into that much relative error
    (1e-5 at a = 18). With `hi` = a's top 12 significand bits, hi*hi is exact and
    a*a = hi*hi + (a - hi)*(a + hi), the second term small enough to round harmlessly.
    """
    hi = (a.view(np.uint32) & np.uint32(0xFFFFF000)).view(np.float32)
    lo = (a - hi) * (a + hi)
    return np.exp(hi * hi * np.float32(-0.5)), lo * np.float32(-0.5)


def gaussian_tail(a: np.ndarray) -> np.ndarray:
    """Phi(-a) = erfc(a/sqrt(2))/2 for a >= 0 (or NaN), accurate in relative terms deep into the tail."""
    if a.dtype == np.float64:
        return np.asarray(_ERFC64(a * _INV_SQRT2), np.float64) * 0.5
    f = np.float32
    t, p, e_hi, lo = _erfc_fit32(np.minimum(a, f(16)))  # Phi(-16) = 6e-58 underflows float32 anyway; keeps inf out
    return f(0.5) * t * e_hi * np.exp(lo + p)


def _erfc_fit32(a: np.ndarray) -> tuple:
    """(t, P(t), exp(hi*hi*-0.5), lo) of the erfc fit at z = a/sqrt(2): erfc(z) = t exp(hi*hi*-0.5) exp(lo + P(t))."""
    f = np.float32
    z = a * f(_INV_SQRT2)
    t = f(1) / (f(1) + f(0.5) * z)
    p = np.full_like(t, _ERFC_P[-1])
    for c in _ERFC_P[-2::-1]:
        p *= t
        p += f(c)
    e_hi, lo = _neg_half_square_exp32(a)  # -z*z = -a*a/2
    return t, p, e_hi, lo


# The float32 fit's 1.2e-7 relative error is too coarse for float64 work, which takes libm's erfc
# (about 1 ulp) at one Python call per element: float64 is the slow, exact path.
_ERFC64 = np.frompyfunc(math.erfc, 1, 1)


def gelu_erf(y: np.ndarray, x: np.ndarray) -> np.ndarray:
    """x * Phi(x). Phi(x) for x < 0 comes straight from the tail (no 1 + erf cancellation)."""
    q = gaussian_tail(np.abs(x)).astype(x.dtype, copy=False)
    phi = select((x < 0).astype(x.dtype), q, 1 - q)
    np.multiply(x, phi, out=y)
    np.copyto(y, -0.0, where=np.isneginf(x))  # -inf * Phi(-inf) = -inf * 0
    return y


def gelu_tanh(y: np.ndarray, x: np.ndarray) -> np.ndarray:
    """0.5x(1 + tanh(u)) with u = sqrt(2/pi)(x + 0.044715x^3), evaluated as x / (1 + exp(-2u)).

    1 + tanh(u) = 2 sigmoid(2u) exactly, and the sigmoid form has no cancellation for u << 0. As for
    silu, elements where exp(-2u) overflows (x below about -10, -inf) or x is NaN take the careful formula.
    """
    t = x.dtype.type
    two_u = np.multiply(x, x)
    two_u *= t(2 * _SQRT_2_OVER_PI * 0.044715)
    two_u += t(2 * _SQRT_2_OVER_PI)
    two_u *= x
    bad = denominator(y, two_u)
    np.divide(x, y, out=y)
    if bad is not None:
        y[bad] = times_sigmoid(x[bad], two_u[bad])
    return y


# --------------------------------------------------------------------------- derivatives (backward kernels)
# Each writes f'(x) into `y` from float32/float64 blocks. Arguments that feed a product with exp(-|.|) are
# clipped first, far beyond where that exp is 0 in both dtypes: x * exp(-|x|) is then 0 there instead of
# inf * 0 = NaN at the infinities, which gives the limits (0 or 1) without a second pass. NaN propagates.

_CLIP = 1024.0  # exp(-1024) is 0 in float32 and float64


def _sigmoid_terms(y: np.ndarray, t: np.ndarray, z: np.ndarray, e: np.ndarray) -> np.ndarray:
    """y = sigmoid(z) + t sigmoid(z) sigmoid(-z), as q (num + t e q) with e = exp(-|z|), q = 1 / (1 + e) and
    num = max(e, z >= 0): no cancellation, no overflow. `t` and `e` are scratch blocks (overwritten); `y`
    may be `z` itself. Few live temporaries: more of them made glibc return and re-fault heap pages
    every block (measured 3-6x slower)."""
    np.abs(z, out=e)
    np.negative(e, out=e)
    np.exp(e, out=e)
    num = np.maximum(e, z >= 0)
    t *= e
    np.add(e, 1, out=e)
    np.reciprocal(e, out=e)  # q
    t *= e
    t += num
    return np.multiply(t, e, out=y)


def silu_grad(y: np.ndarray, x: np.ndarray) -> np.ndarray:
    """silu'(x) = sigmoid(x) + x sigmoid(x) sigmoid(-x)."""
    return _sigmoid_terms(y, np.clip(x, -_CLIP, _CLIP), x, np.empty_like(x))


# float64 work on float32 blocks goes in chunks of 32K elements: 256 KiB scratch stays in L2 and in glibc's heap
# (2 MiB float64 temporaries per block were returned to the OS and re-faulted every block: 2-3x slower)
_CHUNK64 = 1 << 15


def silu_grad_product64(y: np.ndarray, x: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """y = (silu'(x) a) b for float32 blocks, in float64 and rounded once: within half an ulp of the float64
    reference's value for x >= -C (below, exp(-x) overflows float64 near x = -709: callers redo those).

    float32's own silu' errs by up to 9 x 2^-24 relative over x in [-16, -0.9] (exp's 2.4 ulps, then the
    cancellation in 1 + x sigmoid(-x)) and without bound near its root x = -1.2785 (measured 1.3e7 ulps), which a
    large |a b| turns into dozens of ulps of y. About 1 ns per element more than the float32 formula.
    """
    n = x.size
    d, t = np.empty(min(n, _CHUNK64)), np.empty(min(n, _CHUNK64))
    for lo in range(0, n, _CHUNK64):
        hi = min(n, lo + _CHUNK64)
        s = _silu_grad64(d[:hi - lo], t[:hi - lo], x[lo:hi])
        s *= a[lo:hi]
        s *= b[lo:hi]
        y[lo:hi] = s
    return y


def _silu_grad64(e: np.ndarray, t: np.ndarray, x: np.ndarray) -> np.ndarray:
    """silu'(x) = (1 + x e / (1 + e)) / (1 + e) with e = exp(-x), into float64 scratch `t` (`e` is scratch too).

    x e / (1 + e) = x sigmoid(-x) without the cancellation of 1 - sigmoid(x) for x >> 0; +inf is clipped to
    1024, where e = 0 gives silu'(inf) = 1. Valid for x >= -709 (e finite); NaN propagates."""
    np.clip(x, -_CLIP, _CLIP, out=t)
    np.negative(t, out=e)
    np.exp(e, out=e)
    t *= e
    e += 1
    t /= e
    t += 1
    t /= e
    return t


def times_grad(deriv):
    """The block function grad * f'(x) of a derivative block function `deriv(y, x)`.

    Where that is NaN but neither x nor grad is, an infinite grad met an f'(x) that float32 rounds to 0
    (silu'(-110), gelu'(-20)): those elements take f'(x) in float64, where it is 0 only where the float64
    reference's is, so inf * f'(x) is the reference's signed inf (or its NaN)."""

    def fn(y: np.ndarray, x: np.ndarray, g: np.ndarray) -> np.ndarray:
        deriv(y, x)
        y *= g
        if y.dtype != np.float64 and math.isnan(y.sum()):
            bad = np.isnan(y) & ~np.isnan(x) & ~np.isnan(g)
            if bad.any():
                x64 = x[bad].astype(np.float64)
                y[bad] = g[bad] * deriv(np.empty_like(x64), x64)
        return y

    return fn


def gelu_tanh_grad(y: np.ndarray, x: np.ndarray) -> np.ndarray:
    """d/dx x sigmoid(2u) = sigmoid(2u) + x 2u' sigmoid(2u) sigmoid(-2u), with 2u = sqrt(8/pi) (x + 0.044715
    x^3) as in the forward and 2u' = sqrt(8/pi) (1 + 3 0.044715 x^2)."""
    t = x.dtype.type
    xc = np.clip(x, -64, 64)  # exp(-|2u|) is 0 beyond |x| = 11 in float32, 31 in float64
    x2 = np.multiply(xc, xc)
    np.multiply(x2, t(2 * _SQRT_2_OVER_PI * 0.044715), out=y)
    y += t(2 * _SQRT_2_OVER_PI)
    y *= xc  # 2u
    x2 *= t(6 * _SQRT_2_OVER_PI * 0.044715)
    x2 += t(2 * _SQRT_2_OVER_PI)
    x2 *= xc  # x 2u'
    return _sigmoid_terms(y, x2, y, xc)


_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_TAIL_CLIP = {np.dtype(np.float32): 16.0, np.dtype(np.float64): 40.0}  # Phi(-a) and a phi(a) are 0 beyond


def gelu_erf_grad(y: np.ndarray, x: np.ndarray) -> np.ndarray:
    """d/dx x Phi(x) = Phi(x) + x phi(x) = H + s (|x| phi(x) - Phi(-|x|)) with s = copysign(1, x) and H = 1 for
    s > 0, else 0: Phi(-|x|) from the tail (no cancellation in 1 + erf), phi with a*a kept exact in float32."""
    a = np.minimum(np.abs(x), x.dtype.type(_TAIL_CLIP[x.dtype]))
    tail, dens = _tail_and_density(a)
    dens *= a
    dens -= tail
    s = np.copysign(x.dtype.type(1), x)
    dens *= s
    np.maximum(s, 0, out=s)
    return np.add(s, dens, out=y)


def _tail_and_density(a: np.ndarray) -> tuple:
    """(Phi(-a), phi(a)) for a in [0, clip] or NaN."""
    if a.dtype == np.float64:
        return gaussian_tail(a), np.exp(a * a * -0.5) * _INV_SQRT_2PI
    t, p, e_hi, lo = _erfc_fit32(a)
    d = np.exp(lo)
    d *= e_hi
    tail = np.exp(lo + p)
    tail *= t
    tail *= e_hi
    tail *= np.float32(0.5)
    d *= np.float32(_INV_SQRT_2PI)
    return tail, d

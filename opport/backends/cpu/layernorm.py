"""layernorm on NumPy: float32 statistics for 16-bit inputs, over row blocks.

The mean is refined once (mean + mean(x - mean)), so rows whose mean is large next to their spread
are centred to float32 accuracy and constant rows centre to exactly 0. Rows of finite values whose
statistics overflowed are redone rescaled by a power of two (exact), so that sum(d*d) cannot overflow;
the common rows pay nothing for that.
"""

import numpy as np

from opport.arraymath import row_scale
from opport.backends.cpu._common import parallel_rows, result_block, row_mean, store, upcast
from opport.dispatch import impl
from opport.ops.layernorm import layernorm as spec

_SCALE_ABOVE = {np.dtype(np.float32): 2.0**40, np.dtype(np.float64): 2.0**400}  # n * max**2 stays finite


def _normalise(y: np.ndarray, xf: np.ndarray, eps: float) -> np.ndarray:
    """(x - mean) / sqrt(var + eps) of a 2-d float32/float64 block, into `y` (never `xf`)."""
    var = _centred_scaled(y, xf, xf.dtype.type(eps))
    overflowed = ~np.isfinite(var[:, 0])  # the mean or the sum of squares left the float range
    if overflowed.any():
        rows = np.flatnonzero(overflowed & np.isfinite(xf).all(axis=-1))
        if rows.size:
            xb = xf[rows]
            s = row_scale(xb, _SCALE_ABOVE[xf.dtype])
            # eps * s**2 may underflow, and a constant row (d == 0) must still give 0 / sqrt(tiny) = 0
            eps_s = np.maximum(eps * s * s, np.finfo(xf.dtype).tiny).astype(xf.dtype)
            d = np.empty_like(xb)
            _centred_scaled(d, xb * s, eps_s)
            y[rows] = d
    return y


def _centred_scaled(d: np.ndarray, xf: np.ndarray, eps) -> np.ndarray:
    """d = (xf - mean) / sqrt(var + eps); returns var."""
    mean = row_mean(xf)
    mean += row_mean(np.subtract(xf, mean, out=d))  # refined: d is small, its mean accurate
    np.subtract(xf, mean, out=d)
    var = row_mean(np.square(d))
    np.multiply(d, 1 / np.sqrt(var + eps), out=d)
    return var


@impl(spec, "cpu")
def layernorm(x: np.ndarray, weight, bias, eps: float) -> np.ndarray:
    out = np.empty(x.shape, x.dtype)
    n = x.shape[-1]
    if out.size == 0:
        return out
    x2, o2 = x.reshape(-1, n), out.reshape(-1, n)  # reshape copies a non-contiguous x, never writes it
    w = upcast(weight) if weight is not None else None
    b = upcast(bias) if bias is not None else None

    def body(rows):
        xf, dst = upcast(x2[rows]), o2[rows]
        y = _normalise(result_block(dst, xf), xf, eps)
        if w is not None:
            y *= w
        if b is not None:
            y += b
        store(dst, y)

    parallel_rows(x2.shape[0], n, body)
    return out

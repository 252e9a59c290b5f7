"""layernorm on NumPy: float32 statistics for 16-bit inputs, over row blocks.

The mean is refined once (mean + mean(x - mean)), so rows whose mean is large next to their spread
are centred to float32 accuracy and constant rows centre to exactly 0. Rows of finite values whose
statistics overflowed are redone rescaled by a power of two (exact), so that sum(d*d) cannot overflow;
the common rows pay nothing for that.
"""

import numpy as np

from opport.arraymath import row_scale
from opport.backends.cpu._common import block_rows, parallel_rows, result_block, row_mean, store, upcast
from opport.dispatch import impl
from opport.ops.layernorm import layernorm as spec

_SCALE_ABOVE = {np.dtype(np.float32): 2.0**40, np.dtype(np.float64): 2.0**400}  # n * max**2 stays finite


def _normalise(y: np.ndarray, xf: np.ndarray, eps: float) -> tuple:
    """(x - mean) / sqrt(var + eps) of a 2-d float32/float64 block, into `y` (never `xf`).

    Returns (y, f) with f = d(xhat)/d(x - mean) per row: 1/std, or s/std(x s) for rows rescaled by s.
    """
    var, f = _centred_scaled(y, xf, xf.dtype.type(eps))
    overflowed = ~np.isfinite(var[:, 0])  # the mean or the sum of squares left the float range
    if overflowed.any():
        rows = np.flatnonzero(overflowed & np.isfinite(xf).all(axis=-1))
        if rows.size:
            xb = xf[rows]
            s = row_scale(xb, _SCALE_ABOVE[xf.dtype])
            # eps * s**2 may underflow, and a constant row (d == 0) must still give 0 / sqrt(tiny) = 0
            eps_s = np.maximum(eps * s * s, np.finfo(xf.dtype).tiny).astype(xf.dtype)
            d = np.empty_like(xb)
            f[rows] = _centred_scaled(d, xb * s, eps_s)[1] * s
            y[rows] = d
    return y, f


def _centred_scaled(d: np.ndarray, xf: np.ndarray, eps) -> tuple:
    """d = (xf - mean) / sqrt(var + eps); returns var and 1 / sqrt(var + eps)."""
    mean = row_mean(xf)
    mean += row_mean(np.subtract(xf, mean, out=d))  # refined: d is small, its mean accurate
    np.subtract(xf, mean, out=d)
    var = row_mean(np.square(d))
    r = 1 / np.sqrt(var + eps)
    np.multiply(d, r, out=d)
    return var, r


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
        y = _normalise(result_block(dst, xf), xf, eps)[0]
        if w is not None:
            y *= w
        if b is not None:
            y += b
        store(dst, y)

    parallel_rows(x2.shape[0], n, body)
    return out


@impl(spec.backward_op, "cpu")
def layernorm_backward(grad: np.ndarray, x: np.ndarray, weight, bias, eps: float):
    """dx, dweight and dbias per bounded row block; mean and 1/std recomputed from the rows read anyway.
    dweight and dbias are summed per block (float32 for 16-bit inputs) and the block partials in order:
    the same bits for any thread count."""
    n = x.shape[-1]
    dx = np.empty(x.shape, x.dtype)
    rows = dx.size // n if n else 0
    x2, g2, d2 = x.reshape(rows, n), grad.reshape(rows, n), dx.reshape(rows, n)
    w = upcast(weight) if weight is not None else None
    acc = upcast(x.reshape(-1)[:0]).dtype
    step = block_rows(n)
    blocks = max(-(-rows // step), 1)
    pw = None if weight is None else np.zeros((blocks, n), acc)
    pb = None if bias is None else np.zeros((blocks, n), acc)

    def body(block):
        xf, gf = upcast(x2[block]), upcast(g2[block])
        dst = d2[block]
        y = result_block(dst, xf)
        xhat, f = _normalise(np.empty_like(xf), xf, eps)
        if pw is not None:
            pw[block.start // step] = np.add.reduce(gf * xhat, axis=0)
        if pb is not None:
            pb[block.start // step] = np.add.reduce(gf, axis=0)
        _dx_rows(y, gf if w is None else gf * w, xhat, f)
        if xf.dtype != np.float64 and not np.isfinite(np.add.reduce(y, axis=None)):
            _redo_in_float64(y, xf, gf, w, eps)
        store(dst, y)

    if dx.size:
        parallel_rows(rows, n, body)
    dw = None if pw is None else np.add.reduce(pw, axis=0).astype(weight.dtype)
    db = None if pb is None else np.add.reduce(pb, axis=0).astype(bias.dtype)
    return dx, dw, db


def _dx_rows(y: np.ndarray, g: np.ndarray, xhat: np.ndarray, f: np.ndarray) -> np.ndarray:
    """y = ((g - mean(g)) - xhat mean(g xhat)) f, the reference's order (xhat is overwritten)."""
    mgx = row_mean(g * xhat)
    np.subtract(g, row_mean(g), out=y)
    y -= np.multiply(xhat, mgx, out=xhat)
    y *= f
    return y


def _redo_in_float64(y: np.ndarray, xf: np.ndarray, gf: np.ndarray, w, eps: float) -> None:
    """Rows of a float32 block whose dx is not finite, again in float64: with inf or values near the float
    maximum in grad, grad * weight or the row sums overflow float32 where the reference's float64 ones do
    not, and the NaN / inf pattern of such rows then follows the order of overflows."""
    r = np.flatnonzero(~np.isfinite(y).all(axis=-1))
    x64, g64 = xf[r].astype(np.float64), gf[r].astype(np.float64)
    xhat, f = _normalise(np.empty_like(x64), x64, eps)
    y[r] = _dx_rows(np.empty_like(x64), g64 if w is None else g64 * w, xhat, f)

"""softmax on NumPy: max-subtracted exp and a float32 row sum for 16-bit inputs, over row blocks.

The reduction axis is moved last; when it was not last already, the result is computed in that
layout and copied back into a contiguous output of x's shape (one extra pass over the output).
"""

import numpy as np

from opport.backends.cpu import _fused
from opport.backends.cpu._common import parallel_rows, result_block, store, upcast
from opport.dispatch import impl
from opport.ops.softmax import softmax as spec


def _softmax_rows(e: np.ndarray, xf: np.ndarray) -> np.ndarray:
    """Row-wise softmax of a 2-d float32/float64 block into `e` (never `xf`).

    exp(x) / sum(exp(x)) without the max subtraction wherever a row's sum lies in [1, max float]:
    there no exp overflowed, and an exp that underflowed below the normal range belongs to an output
    that is itself below it (it is divided by >= 1), so the result is as accurate as the subtracted
    form, more so far from the max (x - max rounds, exp amplifies it). Two passes fewer, one of them
    a max, which holds the GIL. Other rows (large, tiny, -inf, +inf or NaN values) are redone as
    exp(x - max(x)) / sum(...), the reference's own formula.
    """
    np.exp(xf, out=e)
    s = np.sum(e, axis=-1, keepdims=True)
    redo = ~((s >= 1) & (s <= np.finfo(s.dtype).max))  # NaN fails both tests
    if redo.any():
        r = np.flatnonzero(redo[:, 0])
        xr = xf[r]
        er = np.subtract(xr, np.max(xr, axis=-1, keepdims=True))  # an all -inf row: -inf - -inf = NaN
        np.exp(er, out=er)
        e[r], s[r] = er, np.sum(er, axis=-1, keepdims=True)
    return np.divide(e, s, out=e)


@impl(spec, "cpu")
def softmax(x: np.ndarray, axis: int) -> np.ndarray:
    axis = axis % max(x.ndim, 1)
    moved = np.moveaxis(x, axis, -1) if x.ndim else x.reshape(1)
    out = np.empty(moved.shape, x.dtype)
    n = moved.shape[-1]
    if out.size:
        x2, o2 = moved.reshape(-1, n), out.reshape(-1, n)  # reshape copies a non-contiguous x, never writes it
        fused = _fused.enabled(x.dtype)

        def body(rows):
            xf, dst = upcast(x2[rows]), o2[rows]
            y = result_block(dst, xf)
            if fused:  # rows the fused loop leaves (exp out of range, sums outside [1, max]) by NumPy
                bad = _fused.softmax_forward(xf, y)
                if bad is not None:
                    y[bad] = _softmax_rows(np.empty((bad.size, n), y.dtype), xf[bad])
            else:
                _softmax_rows(y, xf)
            store(dst, y)

        parallel_rows(x2.shape[0], n, body)
    if x.ndim == 0:
        return out.reshape(())
    return out if axis == x.ndim - 1 else np.ascontiguousarray(np.moveaxis(out, -1, axis))


def _softmax_grad_rows(dst: np.ndarray, gf: np.ndarray, yf: np.ndarray) -> np.ndarray:
    """y (g - s), s = sum(g y), of 2-d float32/float64 blocks into `dst` (never `gf` or `yf`).

    For float32 blocks s is summed in float64 from exact products and applied as (g - s_hi) - s_lo: where
    g_i is close to s (dx_i cancels) g_i - s_hi is exact, so dx_i keeps its relative accuracy instead of
    an error of y_i |s| 2^-24 (a constant upstream gradient, whose exact dx is only the rounding of the
    saved y, would otherwise come out as noise). Rows whose result is not finite are redone as g y - y s,
    the reference's form: g - s can overflow where dx is finite, and 0 * inf = NaN at masked positions;
    rows with a real NaN or inf give it again.
    """
    t = np.multiply(gf, yf, dtype=np.float64)
    s = np.add.reduce(t, axis=-1, keepdims=True)
    if gf.dtype == np.float64:
        np.subtract(gf, s, out=dst)
    else:
        hi = s.astype(gf.dtype)
        np.subtract(gf, hi, out=dst)
        dst -= (s - hi).astype(gf.dtype)
    dst *= yf
    if not np.isfinite(np.add.reduce(dst, axis=None)):
        r = np.flatnonzero(~np.isfinite(dst).all(axis=-1))
        dst[r] = t[r] - yf[r] * s[r]
    return dst


@impl(spec.backward_op, "cpu")
def softmax_backward(grad: np.ndarray, out: np.ndarray, axis: int):
    """dx per bounded row block, the softmax axis moved last (as the forward): float32 for 16-bit inputs."""
    axis = axis % max(out.ndim, 1)
    g = np.moveaxis(grad, axis, -1) if out.ndim else grad.reshape(1)
    y = np.moveaxis(out, axis, -1) if out.ndim else out.reshape(1)
    dx = np.empty(y.shape, out.dtype)
    n = y.shape[-1]
    if dx.size:
        g2, y2, d2 = g.reshape(-1, n), y.reshape(-1, n), dx.reshape(-1, n)  # reshape copies views, never writes
        fused = _fused.enabled(out.dtype)

        def body(rows):
            gf, yf, dst = upcast(g2[rows]), upcast(y2[rows]), d2[rows]
            r = result_block(dst, gf)
            if fused:  # rows whose result is not finite by NumPy (the reference's form for those)
                bad = _fused.softmax_backward(gf, yf, r)
                if bad is not None:
                    r[bad] = _softmax_grad_rows(np.empty((bad.size, n), r.dtype), gf[bad], yf[bad])
            else:
                _softmax_grad_rows(r, gf, yf)
            store(dst, r)

        parallel_rows(g2.shape[0], n, body)
    if out.ndim == 0:
        return (dx.reshape(()),)
    return (dx if axis == out.ndim - 1 else np.ascontiguousarray(np.moveaxis(dx, -1, axis)),)

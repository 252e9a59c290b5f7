"""rmsnorm on NumPy: float32 statistics for 16-bit inputs, one pass over bounded row blocks."""

import numpy as np

from opport.backends.cpu._common import parallel_rows, result_block, row_mean, store, upcast
from opport.dispatch import impl
from opport.ops.rmsnorm import rmsnorm as spec


@impl(spec, "cpu")
def rmsnorm(x: np.ndarray, weight, eps: float) -> np.ndarray:
    out = np.empty(x.shape, x.dtype)
    n = x.shape[-1]
    if out.size == 0:
        return out
    x2, o2 = x.reshape(-1, n), out.reshape(-1, n)  # reshape copies a non-contiguous x, never writes it
    w = upcast(weight) if weight is not None else None

    def body(rows):
        xf = upcast(x2[rows])
        t = xf.dtype.type
        ms = row_mean(np.square(xf))
        dst = o2[rows]
        y = result_block(dst, xf)
        np.multiply(xf, 1 / np.sqrt(ms + t(eps)), out=y)
        _rescale_overflowed_rows(xf, ms, t(eps), y)
        if w is not None:
            y *= w
        store(dst, y)

    parallel_rows(x2.shape[0], n, body)
    return out


def _rescale_overflowed_rows(xf, ms, eps, y):
    """Rows of finite values whose sum of squares overflowed: redo them scaled by a power of two.

    x / sqrt(ms + eps) == (x s) / sqrt(ms s^2 + eps s^2) exactly for s = 2^-k, so the result of
    huge rows (e.g. bfloat16 near its 3.4e38 maximum) stays right instead of collapsing to 0.
    """
    bad = np.isinf(ms[:, 0])
    if not bad.any():  # the common case costs one look at the row statistics
        return
    bad[bad] = np.isfinite(xf[bad]).all(axis=-1)
    if not bad.any():
        return
    xb = xf[bad]
    s = np.ldexp(xf.dtype.type(1), -np.frexp(np.max(np.abs(xb), axis=-1, keepdims=True))[1])
    xs = xb * s
    ms_s = row_mean(np.square(xs))
    y[bad] = xs / np.sqrt(ms_s + eps * s * s)

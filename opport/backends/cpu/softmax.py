"""softmax on NumPy: max-subtracted exp and a float32 row sum for 16-bit inputs, over row blocks.

The reduction axis is moved last; when it was not last already, the result is computed in that
layout and copied back into a contiguous output of x's shape (one extra pass over the output).
"""

import numpy as np

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

        def body(rows):
            xf, dst = upcast(x2[rows]), o2[rows]
            store(dst, _softmax_rows(result_block(dst, xf), xf))

        parallel_rows(x2.shape[0], n, body)
    if x.ndim == 0:
        return out.reshape(())
    return out if axis == x.ndim - 1 else np.ascontiguousarray(np.moveaxis(out, -1, axis))

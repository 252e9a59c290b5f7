"""rope on NumPy: float32 arithmetic for 16-bit and float32 x, one pass over (batch, head) blocks."""

import numpy as np

from opport.arraymath import pair_views
from opport.backends.cpu import _fused
from opport.backends.cpu._common import one_block, parallel_rows, result_block, store, upcast
from opport.dispatch import impl
from opport.dtypes import acc_of
from opport.ops.rope import rope as spec


@impl(spec, "cpu")
def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> np.ndarray:
    """Rotate feature pairs of x [B, H, S, D] by the angles whose cos/sin are [S, D/2], [1, S, D/2] or [B, S, D/2].

    Notes: the tables are cast once to the compute dtype (float32, or float64 for float64 x), so a
    float64 table is rounded to float32 before use, as a GPU kernel would. The B*H heads are shared
    out over the cpu threads in bounded blocks; strided x is copied a block at a time, never whole.
    """
    acc = acc_of(x.dtype)
    return _rotate(x, cos.astype(acc, copy=False), sin.astype(acc, copy=False), interleaved)


def _rotate(x: np.ndarray, c: np.ndarray, sn: np.ndarray, interleaved: bool) -> np.ndarray:
    """(x1 c - x2 sn, x2 c + x1 sn) per pair, tables already in the compute dtype."""
    b, h, s, d = x.shape
    out = np.empty(x.shape, x.dtype)
    if c.ndim == 3 and c.shape[0] == 1:  # [1, S, D/2]: one table for every batch entry
        c, sn = c[0], sn[0]
    per_batch = c.ndim == 3
    fused = _fused.enabled(x.dtype)
    if fused:
        c, sn = np.ascontiguousarray(c), np.ascontiguousarray(sn)
        if x.flags.c_contiguous and x.size and one_block(x.reshape(b * h, s * d)):
            _fused.rope(x, c, sn, interleaved, out)  # one block: `rotate` on all of it, without parallel_rows
            return out

    def rotate(bs: slice, hs: slice) -> None:
        xb, dst = upcast(x[bs, hs]), out[bs, hs]  # a strided x is copied a block at a time
        y = result_block(dst, xb)
        if fused:  # one pass over x, products and sums in the NumPy kernel's order
            _fused.rope(xb, c[bs] if per_batch else c, sn[bs] if per_batch else sn, interleaved, y)
            store(dst, y)
            return
        cb, sb = (c[bs, None], sn[bs, None]) if per_batch else (c, sn)  # broadcast over heads (and batches)
        (x1, x2), (y1, y2) = pair_views(xb, interleaved), pair_views(y, interleaved)
        np.multiply(x1, cb, out=y1)
        y1 -= x2 * sb
        np.multiply(x2, cb, out=y2)
        y2 += x1 * sb
        store(dst, y)

    def body(rows: slice) -> None:
        """Rows of the flattened (batch, head) index, as runs of whole batches and parts of one."""
        r, stop = rows.start, rows.stop
        while r < stop:
            bi, h0 = divmod(r, h)
            if h0 == 0 and stop - r >= h:  # whole batches in one go: decode has many of one head-row each
                nb = (stop - r) // h
                rotate(slice(bi, bi + nb), slice(0, h))
                r += nb * h
            else:
                h1 = min(h, h0 + stop - r)
                rotate(slice(bi, bi + 1), slice(h0, h1))
                r += h1 - h0

    parallel_rows(b * h, s * d, body)
    return out


@impl(spec.backward_op, "cpu")
def rope_backward(grad: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool):
    """dx is grad rotated back: the forward's rotation by -angle, i.e. with -sin (negation is exact, so
    (g1 c + g2 s, g2 c - g1 s) comes out bit for bit as written)."""
    acc = acc_of(grad.dtype)
    return (_rotate(grad, cos.astype(acc, copy=False), -sin.astype(acc, copy=False), interleaved),)

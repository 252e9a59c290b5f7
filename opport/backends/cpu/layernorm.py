"""layernorm on NumPy: float32 statistics for 16-bit inputs, over row blocks.

Each row is shifted by its first element before its mean is taken (exact for values near it), so rows
whose mean is large next to their spread (1e6 + N(0, 1)) are centred to float32 accuracy, and constant
rows centre to exactly 0. Rows of finite values whose
statistics overflowed are redone rescaled by a power of two (exact), so that sum(d*d) cannot overflow;
the common rows pay nothing for that. The backward computes float32 inputs in float64 (its bracket
cancels terms ~1000x larger than the result).
"""

import threading

import numpy as np

from opport.arraymath import row_scale
from opport.backends.cpu import _fused
from opport.backends.cpu._common import (
    block_rows,
    one_block,
    parallel_rows,
    result_block,
    row_mean,
    store,
    upcast,
)
from opport.dispatch import impl
from opport.ops.layernorm import layernorm as spec

_SCALE_ABOVE = {np.dtype(np.float32): 2.0**40, np.dtype(np.float64): 2.0**400}  # n * max**2 stays finite


def _normalise(y: np.ndarray, xf: np.ndarray, eps: float, tmp=None) -> tuple:
    """(x - mean) / sqrt(var + eps) of a 2-d block, into `y` (never `xf`), in y's dtype (float32 or float64;
    the backward computes float32 blocks in float64). `tmp`: an optional scratch block like `y`.

    Returns (y, f) with f = d(xhat)/d(x - mean) per row: 1/std, or s/std(x s) for rows rescaled by s.
    """
    t = y.dtype.type
    var, f = _centred_scaled(y, xf, t(eps), tmp)
    overflowed = ~np.isfinite(var[:, 0])  # the mean or the sum of squares left the float range
    if overflowed.any():
        rows = np.flatnonzero(overflowed & np.isfinite(xf).all(axis=-1))
        if rows.size:
            xb = xf[rows].astype(y.dtype)  # a float32 mean that overflowed is redone in y's float64
            s = row_scale(xb, _SCALE_ABOVE[y.dtype])
            # eps * s**2 may underflow, and a constant row (d == 0) must still give 0 / sqrt(tiny) = 0
            eps_s = np.maximum(eps * s * s, np.finfo(y.dtype).tiny).astype(y.dtype)
            d = np.empty_like(xb)
            f[rows] = _centred_scaled(d, xb * s, eps_s)[1] * s
            y[rows] = d
    return y, f


def _centred_scaled(d: np.ndarray, xf: np.ndarray, eps, tmp=None) -> tuple:
    """d = (xf - mean) / sqrt(var + eps) in d's dtype (xf's, or float64 for float32 xf); returns var and
    1 / sqrt(var + eps).

    Each row is shifted by its first element x0 before any sum (docs/numerics.md 3.8): c = x - x0 is exact
    where x lies within a factor of 2 of x0 (Sterbenz) and otherwise errs by <= u |x - x0| <= 2u D,
    D = max|x - mean|; so d = c - mean(c) errs by <= (2 log2(n) + 6) u D to first order (NumPy's pairwise
    sums), whatever |mean|. Without the shift the mean alone is off by up to u |mean| / 2: 0.03 in every d
    of a float32 row 1e6 + N(0, 1).
    """
    np.subtract(xf, xf[:, :1].astype(d.dtype, copy=False), out=d)  # a constant row is exactly 0 from here on
    d -= row_mean(d)
    var = row_mean(np.square(d, out=tmp))
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
    fused = _fused.enabled(x.dtype)
    if fused and one_block(x2) and _fused.ln_forward(x2, w, b, eps, o2) is None:
        return out  # the block path's one block, without its machinery (rows it leaves: the block path below)

    def affine(y):
        if w is not None:
            y *= w
        if b is not None:
            y += b
        return y

    def body(rows):
        xf, dst = upcast(x2[rows]), o2[rows]
        if fused:  # one pass per statistic over rows in cache; rows it leaves (overflow, inf, NaN) by NumPy
            y = result_block(dst, xf)
            bad = _fused.ln_forward(xf, w, b, eps, y)
            if bad is not None:
                y[bad] = affine(_normalise(np.empty((bad.size, n), y.dtype), xf[bad], eps)[0])
        else:
            y = affine(_normalise(result_block(dst, xf), xf, eps)[0])
        store(dst, y)

    parallel_rows(x2.shape[0], n, body)
    return out


@impl(spec.backward_op, "cpu")
def layernorm_backward(grad: np.ndarray, x: np.ndarray, weight, bias, eps: float):
    """dx, dweight and dbias per bounded row block; mean and 1/std recomputed from the rows read anyway.
    dweight and dbias are summed per block (in the compute dtype) and the block partials in order: the same
    bits for any thread count.

    float32 inputs compute in float64. dx = f (g - mean(g) - xhat mean(g xhat)) cancels O(|g|) terms down to
    elements ~1000x smaller and multiplies by f = 1/std (up to 1/sqrt(eps)): float32 roundings of mean(g),
    xhat and the products left up to 4.6e-8 absolute in the bracket (1-2 ulps of its O(1) terms), over the
    1e-5 / f an element near 0 allows. Cost: about 1.7x the float32 time (0.70 -> 1.17 ms per 256K elements,
    one thread), with four float64 scratch blocks per thread reused over its blocks and no other temporaries.
    """
    n = x.shape[-1]
    dx = np.empty(x.shape, x.dtype)
    rows = dx.size // n if n else 0
    x2, g2, d2 = x.reshape(rows, n), grad.reshape(rows, n), dx.reshape(rows, n)
    ct = np.float64 if x.dtype in (np.float32, np.float64) else np.float32  # compute dtype
    w = None if weight is None else upcast(weight).astype(ct)
    fused = _fused.enabled(x.dtype)
    if fused and one_block(x2) and g2.dtype == np.float32 and g2.flags.c_contiguous:
        # one block on the calling thread: the fused loop on it directly, before the block path's allocations
        dw64, db64 = np.zeros(n), np.zeros(n)
        if _fused.ln_backward(x2, g2, w, eps, d2, dw64, db64) is None:  # else the block path redoes it all
            return (dx, None if weight is None else dw64.astype(weight.dtype),
                    None if bias is None else db64.astype(bias.dtype))
    step = block_rows(n)
    blocks = max(-(-rows // step), 1)
    pw = None if weight is None else np.zeros((blocks, n), ct)
    pb = None if bias is None else np.zeros((blocks, n), ct)
    local = threading.local()

    def body(block):
        if fused:
            return fused_body(block)
        xf, gf, dst = upcast(x2[block]), upcast(g2[block]), d2[block]
        xhat, tmp, *wide = _scratch(local, xf.shape, ct, 2 if xf.dtype == ct else 4)
        if wide:  # float32 rows as exact float64 copies: mixed-dtype ufuncs cast in small buffers (2-3x slower)
            xf, gf = _copy_into(wide[0], xf), _copy_into(wide[1], gf)
        f = _normalise(xhat, xf, eps, tmp)[1]
        if pb is not None:
            pb[block.start // step] = np.add.reduce(gf, axis=0)
        gx = np.multiply(gf, xhat, out=tmp)
        if pw is not None:
            pw[block.start // step] = np.add.reduce(gx, axis=0)
        if w is not None:
            gx *= w  # (grad xhat) w: the reference's (grad w) xhat up to one rounding
        c = row_mean(gx)
        y = dst if dst.dtype == ct else tmp  # dx last: tmp is free again
        if w is None:
            np.copyto(y, gf)
        else:
            np.multiply(gf, w, out=y)
        _dx_rows(y, xhat, c, f, eps)
        if ct == np.float32 and not np.isfinite(np.add.reduce(y, axis=None)):
            _redo_in_float64(y, xf, gf, w, eps)
        store(dst, y)

    def fused_body(block):
        """The fused loop in float64 on the block's rows; rows it leaves (non-finite statistics or dx, n == 2) run
        the NumPy body above on their own (their dweight/dbias sums added to the block's)."""
        xf, gf, dst = upcast(x2[block]), upcast(g2[block]), d2[block]
        y = result_block(dst, xf)
        dw64, db64 = np.zeros(n), np.zeros(n)
        bad = _fused.ln_backward(xf, gf, w, eps, y, dw64, db64)
        i = block.start // step
        if bad is not None:
            yb = np.zeros((bad.size, n), dst.dtype)
            wb, bb = _left_rows(x2[block][bad], g2[block][bad], yb)
            y[bad] = yb
            dw64 += wb
            db64 += bb
        if pw is not None:
            pw[i] = dw64
        if pb is not None:
            pb[i] = db64
        store(dst, y)

    def _left_rows(xr, gr, dst):
        """The NumPy body on rows `xr`, `gr` into `dst` (the output dtype); returns their dweight and dbias sums."""
        xf, gf = upcast(xr), upcast(gr)
        xhat, tmp = np.zeros(xf.shape, ct), np.zeros(xf.shape, ct)
        xf, gf = xf.astype(ct), gf.astype(ct)
        f = _normalise(xhat, xf, eps, tmp)[1]
        sb = np.add.reduce(gf, axis=0)
        gx = np.multiply(gf, xhat, out=tmp)
        sw = np.add.reduce(gx, axis=0)
        if w is not None:
            gx *= w
        c = row_mean(gx)
        y = gf.copy() if w is None else gf * w
        _dx_rows(y, xhat, c, f, eps)
        if ct == np.float32 and not np.isfinite(np.add.reduce(y, axis=None)):
            _redo_in_float64(y, xf, gf, w, eps)
        store(dst, y)
        return sw, sb

    if dx.size:
        parallel_rows(rows, n, body)
    dw = None if pw is None else np.add.reduce(pw, axis=0).astype(weight.dtype)
    db = None if pb is None else np.add.reduce(pb, axis=0).astype(bias.dtype)
    return dx, dw, db


def _scratch(local: threading.local, shape: tuple, dtype, k: int) -> list:
    """k scratch blocks of `shape` for this thread, reused over its blocks: fresh 2 MiB float64 blocks
    made glibc return and re-fault their pages every block (measured 3x slower)."""
    size = shape[0] * shape[1]
    bufs = getattr(local, "bufs", None)
    if bufs is None or bufs.shape[1] < size:
        local.bufs = bufs = np.empty((k, size), dtype)  # one allocation: 4 MiB and up get huge pages
    return [b[:size].reshape(shape) for b in bufs]


def _copy_into(buf: np.ndarray, a: np.ndarray) -> np.ndarray:
    np.copyto(buf, a)
    return buf


def _dx_rows(g: np.ndarray, xhat: np.ndarray, c: np.ndarray, f: np.ndarray, eps: float) -> np.ndarray:
    """g becomes ((g - mean(g)) - xhat c) f with c = mean(g xhat), the reference's order (xhat is overwritten).

    Two-element rows have xhat = (h, -h), and the bracket is (g - mean(g)) (1 - h^2) = (g - mean(g)) eps f^2
    exactly: the general form cancels to noise there (1 - h^2 ~ eps / var; measured 5% off in float32).
    """
    g -= row_mean(g)
    if g.shape[-1] == 2:
        g *= f * f * eps
    else:
        g -= np.multiply(xhat, c, out=xhat)
    g *= f
    return g


def _redo_in_float64(y: np.ndarray, xf: np.ndarray, gf: np.ndarray, w, eps: float) -> None:
    """Rows of a float32 block whose dx is not finite, again in float64: with inf or values near the float
    maximum in grad, grad * weight or the row sums overflow float32 where the reference's float64 ones do
    not, and the NaN / inf pattern of such rows then follows the order of overflows."""
    r = np.flatnonzero(~np.isfinite(y).all(axis=-1))
    x64, g64 = xf[r].astype(np.float64), gf[r].astype(np.float64)
    xhat, f = _normalise(np.empty_like(x64), x64, eps)
    g = g64 if w is None else g64 * w
    y[r] = _dx_rows(g, xhat, row_mean(g * xhat), f, eps)

"""rmsnorm on NumPy: float32 statistics for 16-bit inputs, one pass over bounded row blocks. The scale offset + weight
is formed once per call in the accumulation dtype (float32 for 16-bit inputs), never rounded to the weight's dtype."""

import numpy as np

from opport.backends.cpu import _fused
from opport.backends.cpu._common import block_rows, one_block, parallel_rows, result_block, row_mean, store, upcast
from opport.dispatch import impl
from opport.ops.rmsnorm import rmsnorm as spec


@impl(spec, "cpu")
def rmsnorm(x: np.ndarray, weight, eps: float, offset: float = 0.0) -> np.ndarray:
    out = np.empty(x.shape, x.dtype)
    n = x.shape[-1]
    if out.size == 0:
        return out
    x2, o2 = x.reshape(-1, n), out.reshape(-1, n)  # reshape copies a non-contiguous x, never writes it
    w = offset_weight(upcast(weight), offset) if weight is not None else None
    fused = _fused.enabled(x.dtype)
    if fused and one_block(x2) and _fused.rms_forward(x2, w, eps, o2) is None:
        return out  # the block path's one block, without its machinery (rows it leaves: the block path below)

    def body(rows):
        xf = upcast(x2[rows])
        dst = o2[rows]
        store(dst, normalize(xf, w, eps, result_block(dst, xf), fused))

    parallel_rows(x2.shape[0], n, body)
    return out


def offset_weight(w: np.ndarray, offset: float) -> np.ndarray:
    """offset + w in w's (upcast) dtype: float32 for 16-bit weights, float64 for float64; w itself for offset 0."""
    return w + w.dtype.type(offset) if offset else w


def normalize(xf: np.ndarray, w, eps: float, y: np.ndarray, fused: bool) -> np.ndarray:
    """normalize_rows, through the fused loop when `fused` (rows it leaves, e.g. overflowing ones, by NumPy)."""
    if not fused:
        return normalize_rows(xf, w, eps, y)
    bad = _fused.rms_forward(xf, w, eps, y)
    if bad is not None:
        y[bad] = normalize_rows(xf[bad], w, eps, np.empty((bad.size, xf.shape[1]), xf.dtype))
    return y


def normalize_rows(xf: np.ndarray, w, eps: float, y: np.ndarray) -> np.ndarray:
    """rmsnorm of a block of rows `xf` (in the accumulation dtype) into `y`, scaled by `w` (upcast) if given:
    the forward's arithmetic, shared with add_rmsnorm."""
    t = xf.dtype.type
    ms = row_mean(np.square(xf))
    np.multiply(xf, 1 / np.sqrt(ms + t(eps)), out=y)
    _rescale_overflowed_rows(xf, ms, t(eps), y)
    if w is not None:
        y *= w
    return y


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


@impl(spec.backward_op, "cpu")
def rmsnorm_backward(grad: np.ndarray, x: np.ndarray, weight, eps: float, offset: float = 0.0):
    """dx and dweight per bounded row block; 1/rms recomputed from the rows read anyway. dweight is summed
    per block (float32 for 16-bit inputs) and the block partials in order: the same bits for any thread count.
    float32 inputs are computed in float64: g - xhat (g . xhat) / n cancels terms far larger than dx in rows
    of small rms (measured: 3.1e-5 error on dx ~ 2.8, 2.3x its float32 tolerance, in float32 arithmetic)."""
    n = x.shape[-1]
    dx = np.empty(x.shape, x.dtype)
    rows = dx.size // n if n else 0
    x2, g2, d2 = x.reshape(rows, n), grad.reshape(rows, n), dx.reshape(rows, n)
    w = offset_weight(wide(weight), offset) if weight is not None else None
    step = block_rows(n)
    partial = None if w is None else np.zeros((max(-(-rows // step), 1), n), w.dtype)
    fused = _fused.enabled(x.dtype)

    def body(block):
        dst = d2[block]
        if fused:
            y, dw_rows = backward_fused(x2[block], g2[block], None, w, eps, dst)
        else:
            xf, gf = wide(x2[block]), wide(g2[block])
            y = result_block(dst, xf)
            dw_rows = backward_rows(xf, gf, w, eps, y)
        if dw_rows is not None:
            partial[block.start // step] = dw_rows
        store(dst, y)

    if dx.size:
        parallel_rows(rows, n, body)
    dw = None if w is None else np.add.reduce(partial, axis=0).astype(weight.dtype)
    return dx, dw


def backward_rows(xf: np.ndarray, gf: np.ndarray, w, eps: float, y: np.ndarray):
    """dx of a block of rows into `y` (all in the backward's working dtype, `_wide`), and the block's dweight
    partial (None without a weight): the backward's arithmetic, shared with add_rmsnorm. `w` is the scale the
    forward applied (offset + weight: offset_weight); dweight's sum of g xhat does not read it."""
    n = xf.shape[-1]
    t = xf.dtype.type
    s = _row_scales(xf)  # 1, or a power of two for finite rows whose squares overflow
    xs = xf if s is None else xf * s
    r = 1 / np.sqrt(row_mean(np.square(xs)) + (t(eps) if s is None else t(eps) * s * s))
    xhat = xs * r
    dw_rows = None
    if w is not None:
        dw_rows = np.add.reduce(gf * xhat, axis=0)
        gf = gf * w
    if n == 1:  # g - xhat (g xhat) = g eps r^2 exactly: the general form would cancel to float32 noise
        g_perp = gf * (t(eps) if s is None else t(eps) * s * s) * r * r + xf * 0  # (+ x * 0: NaN where x is not finite)
        np.multiply(g_perp, r if s is None else r * s, out=y)
    else:
        np.multiply(gf - xhat * row_mean(gf * xhat), r if s is None else r * s, out=y)
    return dw_rows


def backward_fused(x: np.ndarray, g: np.ndarray, h, w, eps: float, dst: np.ndarray) -> tuple:
    """(dx block, dweight partial) of the rows `x`, `g` (as stored) through the fused loop, which computes in
    float64 as backward_rows does; `h` (add_rmsnorm's grad of the sum, or None) is added to dx. Rows the loop
    leaves (sums of squares that overflow) go through backward_rows."""
    xf, gf = upcast(x), upcast(g)
    y = result_block(dst, xf)
    dw = None if w is None else np.zeros(xf.shape[1], np.float64)
    bad = _fused.rms_backward(xf, gf, w, eps, None if h is None else upcast(h), y, dw)
    if bad is not None:
        yb = np.empty((bad.size, xf.shape[1]), wide(xf[:1]).dtype)
        dwb = backward_rows(wide(x[bad]), wide(g[bad]), w, eps, yb)
        if h is not None:
            yb += wide(h[bad])
        y[bad] = yb
        if dw is not None:
            dw += dwb
    return y, None if dw is None else dw.astype(w.dtype, copy=False)


def wide(a: np.ndarray) -> np.ndarray:
    """The backward's working dtype: float64 for float32, else the accumulation dtype (add_rmsnorm's too)."""
    return a.astype(np.float64) if a.dtype == np.float32 else upcast(a)


def _row_scales(xf: np.ndarray):
    """None when no row's sum of squares overflows; else per-row powers of two (1 for the other rows)
    that bring finite overflowing rows' max|x| into [0.5, 1): the exact scaled form of the forward."""
    ms = np.add.reduce(np.square(xf), axis=-1, keepdims=True)
    bad = np.isinf(ms[:, 0]) & np.isfinite(xf).all(axis=-1)
    if not bad.any():
        return None
    s = np.ones_like(ms)
    s[bad] = np.ldexp(xf.dtype.type(1), -np.frexp(np.max(np.abs(xf[bad]), axis=-1, keepdims=True))[1])
    return s

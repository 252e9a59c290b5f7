"""add_rmsnorm on NumPy: the sum and rmsnorm in one pass over bounded row blocks (rmsnorm's arithmetic)."""

import numpy as np

from opport.backends.cpu import _fused
from opport.backends.cpu._common import block_rows, one_block, parallel_rows, result_block, store, upcast
from opport.backends.cpu.rmsnorm import backward_fused, backward_rows, normalize, wide
from opport.dispatch import impl
from opport.ops.add_rmsnorm import add_rmsnorm as spec


@impl(spec, "cpu")
def add_rmsnorm(x: np.ndarray, residual: np.ndarray, weight, eps: float):
    """Per block of rows: the sum in the accumulation dtype, rounded into the sum output (float32 arithmetic
    rounded once more to 16 bits is the correctly rounded 16-bit sum), then rmsnorm of the rounded block."""
    normed, total = np.empty(x.shape, x.dtype), np.empty(x.shape, x.dtype)
    n = x.shape[-1]
    if normed.size == 0:
        return normed, total
    x2, r2 = x.reshape(-1, n), residual.reshape(-1, n)  # reshape copies a non-contiguous input, never writes it
    o2, s2 = normed.reshape(-1, n), total.reshape(-1, n)
    w = upcast(weight) if weight is not None else None
    fused = _fused.enabled(x.dtype)
    if fused and one_block(x2) and r2.dtype == x2.dtype:  # float32, one block: the body's steps without parallel_rows
        np.add(x2, r2, out=s2)
        if _fused.rms_forward(s2, w, eps, o2) is None:
            return normed, total  # (rows it leaves: the block path below, from the start)

    def body(rows):
        xf = upcast(x2[rows])
        s_dst = s2[rows]
        s = result_block(s_dst, xf)
        np.add(xf, upcast(r2[rows]), out=s)
        if s is not s_dst:  # 16-bit: round into the output, then normalise the rounded values
            store(s_dst, s)
            s = upcast(s_dst)
        dst = o2[rows]
        store(dst, normalize(s, w, eps, result_block(dst, s), fused))

    parallel_rows(x2.shape[0], n, body)
    return normed, total


@impl(spec.backward_op, "cpu")
def add_rmsnorm_backward(grad_normed: np.ndarray, grad_sum: np.ndarray, total: np.ndarray, weight, eps: float):
    """rmsnorm's backward of grad_normed at the saved sum plus grad_sum, per bounded row block; dx and
    dresidual are the same array (one write). dweight is summed per block and the block partials in order:
    the same bits for any thread count."""
    n = total.shape[-1]
    dx = np.empty(total.shape, total.dtype)
    rows = dx.size // n if n else 0
    s2, g2, h2, d2 = total.reshape(rows, n), grad_normed.reshape(rows, n), grad_sum.reshape(rows, n), dx.reshape(rows, n)
    w = wide(weight) if weight is not None else None
    step = block_rows(n)
    partial = None if w is None else np.zeros((max(-(-rows // step), 1), n), w.dtype)
    fused = _fused.enabled(total.dtype)

    def body(block):
        dst = d2[block]
        if fused:
            y, dw_rows = backward_fused(s2[block], g2[block], h2[block], w, eps, dst)
        else:
            sf = wide(s2[block])
            y = result_block(dst, sf)
            dw_rows = backward_rows(sf, wide(g2[block]), w, eps, y)
            y += wide(h2[block])
        if dw_rows is not None:
            partial[block.start // step] = dw_rows
        store(dst, y)

    if dx.size:
        parallel_rows(rows, n, body)
    dw = None if w is None else np.add.reduce(partial, axis=0).astype(weight.dtype)
    return dx, dx, dw

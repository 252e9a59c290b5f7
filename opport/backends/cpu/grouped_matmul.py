"""grouped_matmul on NumPy: one BLAS matmul per expert with rows, in float32 for 16-bit inputs (float32 accumulation)."""

import numpy as np

from opport.backends.cpu._common import upcast, uses_blas
from opport.dispatch import impl
from opport.ops.grouped_matmul import grouped_matmul as spec


def _groups(offsets):
    """(expert, first row, end row) of every expert with rows: empty experts' weights are never touched."""
    o = [int(v) for v in offsets]
    return [(e, o[e], o[e + 1]) for e in range(len(o) - 1) if o[e + 1] > o[e]]


def _weights(w: np.ndarray, e: int, trans_w: bool) -> np.ndarray:
    """Expert e's weights as [K, N] in the accumulation dtype (a transposed view with trans_w: BLAS takes it as is)."""
    we = upcast(w[e])
    return we.T if trans_w else we


@impl(spec, "cpu")
@uses_blas()
def grouped_matmul(x: np.ndarray, w: np.ndarray, offsets: np.ndarray, trans_w: bool) -> np.ndarray:
    """out [M, N]: rows offsets[e]:offsets[e+1] of x times w[e], one np.matmul per expert with rows.

    Notes: only the rows' own slice of x and their expert's weights are upcast (float32 copies for 16-bit inputs,
    NumPy having no float32-accumulating half GEMM), so an unused expert is never read; K = 0 gives zeros.
    """
    n = w.shape[1] if trans_w else w.shape[2]
    acc = np.float64 if x.dtype == np.float64 else np.float32
    out = np.zeros((x.shape[0], n), acc)
    with np.errstate(invalid="ignore", over="ignore"):
        for e, lo, hi in _groups(offsets):
            np.matmul(upcast(x[lo:hi]), _weights(w, e, trans_w), out=out[lo:hi])
        return out.astype(x.dtype, copy=False)  # beyond the dtype's range -> inf, as the exact result rounds


@impl(spec.backward_op, "cpu")
@uses_blas()
def grouped_matmul_backward(grad: np.ndarray, x: np.ndarray, w: np.ndarray, offsets: np.ndarray, trans_w: bool):
    """dx_e = grad_e w[e]^T and dw[e] = x_e^T grad_e (grad_e^T x_e with trans_w), per expert with rows; an expert
    without rows keeps dw[e] = 0.

    Notes: each is one BLAS call on the expert's slices (transposed views, no copies beyond the 16-bit upcast);
    dw[e] sums only that expert's rows, in one call: deterministic, no expert sees another's rows.
    """
    acc = np.float64 if x.dtype == np.float64 else np.float32
    dx, dw = np.zeros(x.shape, acc), np.zeros(w.shape, acc)
    with np.errstate(invalid="ignore", over="ignore"):
        for e, lo, hi in _groups(offsets):
            g, xe = upcast(grad[lo:hi]), upcast(x[lo:hi])
            np.matmul(g, _weights(w, e, trans_w).T, out=dx[lo:hi])
            if trans_w:
                np.matmul(g.T, xe, out=dw[e])
            else:
                np.matmul(xe.T, g, out=dw[e])
        return dx.astype(x.dtype, copy=False), dw.astype(w.dtype, copy=False)

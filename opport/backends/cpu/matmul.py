"""matmul on NumPy: BLAS in float32 for 16-bit inputs (float32 accumulation), float64 stays float64."""

import math

import numpy as np

from opport.backends.cpu import _invariant
from opport.backends.cpu._common import gemm, upcast, uses_blas
from opport.dispatch import impl
from opport.ops.matmul import matmul as spec


def _work(a, b, *_) -> int:
    """An upper bound on the call's multiply-adds (batch x M x N x K, either operand's batch)."""
    return max(a.size * b.shape[-1], b.size * a.shape[-2])


@impl(spec, "cpu")
@uses_blas(work=_work)
def matmul(a: np.ndarray, b: np.ndarray, bias) -> np.ndarray:
    """a [..., M, K] @ b ([K, N] or [..., K, N]) (+ bias [N]), returned in a's dtype.

    Notes: 16-bit operands are upcast to float32 copies (2x their bytes) because NumPy has no
    float32-accumulating half/bfloat16 GEMM; np.matmul takes strided views as they are and
    returns zeros when K = 0. Under opport.batch_invariant() a shared b [K, N] multiplies a's rows with
    `_invariant.rows_matmul` (each row's bits independent of the others; BLAS's are not).
    """
    with np.errstate(invalid="ignore", over="ignore"):
        if b.ndim == 2 and _invariant.active():
            rows = math.prod(a.shape[:-1])  # (-1 cannot be inferred when K is 0)
            out = _invariant.rows_matmul(upcast(a).reshape(rows, a.shape[-1]), upcast(b)).reshape(
                *a.shape[:-1], b.shape[1])
        else:
            out = gemm(upcast(a), upcast(b))
        if bias is not None:
            out += upcast(bias)
        return out.astype(a.dtype, copy=False)  # beyond the dtype's range -> inf, as the exact result rounds


@impl(spec.backward_op, "cpu")
@uses_blas(work=lambda grad, a, b, *_: _work(a, b))
def matmul_backward(grad: np.ndarray, a: np.ndarray, b: np.ndarray, bias):
    """da = grad b^T, db = a^T grad (one product over every row of the batch when b is a shared [K, N]),
    dbias = grad summed over rows; each a BLAS call on transposed views, float32 for 16-bit inputs.

    Notes: the 16-bit operands are upcast copies, as in the forward; the row sum of dbias is NumPy's
    pairwise sum over a contiguous float32 copy: the same bits for any thread count.
    """
    k, n = b.shape[-2:]
    rows = math.prod(a.shape[:-1])  # (-1 cannot be inferred when K or N is 0)
    g, af, bf = upcast(grad), upcast(a), upcast(b)
    with np.errstate(invalid="ignore", over="ignore"):
        da = gemm(g, bf.swapaxes(-1, -2))
        if b.ndim == 2:
            db = gemm(af.reshape(rows, k).T, g.reshape(rows, n))
        else:
            db = gemm(af.swapaxes(-1, -2), g)
        dbias = None if bias is None else np.add.reduce(g.reshape(rows, n), axis=0)
        return da.astype(a.dtype, copy=False), db.astype(b.dtype, copy=False), \
            None if dbias is None else dbias.astype(bias.dtype, copy=False)

"""moe_unpermute on NumPy: the rows gathered back into token order through the inverse permutation, summed over k."""

import numpy as np

from opport.dispatch import impl
from opport.dtypes import acc_of
from opport.ops.moe_unpermute import moe_unpermute as spec


@impl(spec, "cpu")
def moe_unpermute(y: np.ndarray, source: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """out[t] = sum_j w[t, j] * y[row[t*k + j]], j in order, in float32 (float64 for float64), rounded once.

    The gather reads each row of y once (row = the inverse permutation of source); the weights multiply the
    [T, N] slabs of slot j in turn, so every output element is the same k-term sum in the same order as the
    other backends'.
    """
    t, k = weights.shape
    acc = acc_of(y.dtype)
    s = np.asarray(source).astype(np.intp)
    row = np.empty(s.size, np.intp)
    row[s] = np.arange(s.size)  # the inverse permutation: slot t*k + j's row of y
    rows = y[row].reshape(t, k, y.shape[1])
    w = weights.astype(acc)
    out = np.zeros((t, y.shape[1]), acc)
    with np.errstate(invalid="ignore", over="ignore"):
        for j in range(k):
            out += w[:, j, None] * rows[:, j].astype(acc)
    return out.astype(y.dtype)


@impl(spec.backward_op, "cpu")
def moe_unpermute_backward(grad: np.ndarray, y: np.ndarray, source: np.ndarray, weights: np.ndarray):
    """Row r of y belongs to slot s = source[r] = t*k + j: dy[r] = w[t, j] * grad[t] and dweights[t, j] = grad[t] . y[r]
    (float32 products and sums, float64 for float64), each written to its own place (no accumulation across rows)."""
    k = weights.shape[1]
    acc = acc_of(y.dtype)
    s = np.asarray(source).astype(np.int64)
    g = grad[s // k].astype(acc)
    with np.errstate(invalid="ignore", over="ignore"):
        dy = weights.reshape(-1)[s].astype(acc)[:, None] * g
        dw = np.empty(s.size, acc)
        dw[s] = np.einsum("rn,rn->r", g, y.astype(acc))
    return dy.astype(y.dtype), dw.reshape(weights.shape).astype(y.dtype)

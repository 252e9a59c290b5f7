"""moe_permute on NumPy: a stable sort of the flat slots by expert, then one gather of x's rows."""

import numpy as np

from opport.dispatch import impl
from opport.dtypes import acc_of
from opport.ops.moe_permute import moe_permute as spec


@impl(spec, "cpu")
def moe_permute(x: np.ndarray, top_k_index: np.ndarray, num_experts: int):
    """source = the slots sorted by expert (NumPy's stable sort), offsets = the prefix sums of the experts' counts,
    permuted = x[source // k] (a copy: bit for bit)."""
    k = top_k_index.shape[1]
    flat = np.asarray(top_k_index).reshape(-1)
    source = np.argsort(flat, kind="stable").astype(np.int32)
    offsets = np.zeros(num_experts + 1, np.int32)
    np.cumsum(np.bincount(flat.astype(np.intp), minlength=num_experts), out=offsets[1:])
    return np.take(x, source // k, axis=0), source, offsets


@impl(spec.backward_op, "cpu")
def moe_permute_backward(grad_permuted: np.ndarray, x: np.ndarray, top_k_index: np.ndarray, source: np.ndarray,
                         num_experts: int):
    """dx[t] = sum_j grad_permuted[row of slot t*k + j], j in order, in float32 (float64 for float64)."""
    t, k = top_k_index.shape
    s = np.asarray(source).astype(np.intp)
    row = np.empty(s.size, np.intp)
    row[s] = np.arange(s.size)  # the inverse permutation: slot -> row of grad_permuted
    rows = grad_permuted[row].reshape(t, k, grad_permuted.shape[1])
    acc = acc_of(x.dtype)
    dx = np.zeros((t, grad_permuted.shape[1]), acc)
    with np.errstate(invalid="ignore", over="ignore"):
        for j in range(k):
            dx += rows[:, j].astype(acc)
    return (dx.astype(x.dtype),)

"""moe_experts on NumPy: picks sorted by expert (stable), one pair of BLAS GEMMs per expert hit, float32 for 16-bit.

The T * k picks (flat slot s = t * k + j) are sorted by expert with a stable argsort, so each expert's rows are one
contiguous block of the gathered x; its two GEMMs run on that block and the results go back to their slots, where
the k picks of each token are summed in pick order (no scatter-add: a fixed order, the same bits every run).
"""

import numpy as np

from opport.backends.cpu import _invariant
from opport.backends.cpu._common import upcast, uses_blas
from opport.backends.cpu.swiglu import _swiglu, _swiglu_backward, _swiglu_backward32
from opport.dispatch import impl
from opport.dtypes import acc_of
from opport.ops.moe_experts import moe_experts as spec


def _sorted_picks(top_k_index: np.ndarray, n_experts: int) -> tuple:
    """(order, offsets): the flat slots sorted by expert (stable: slot order within an expert) and each expert's
    first row in that order, offsets [E + 1]."""
    flat = np.asarray(top_k_index).reshape(-1).astype(np.int64)
    order = np.argsort(flat, kind="stable")
    offsets = np.zeros(n_experts + 1, np.int64)
    np.cumsum(np.bincount(flat, minlength=n_experts), out=offsets[1:])
    return order, offsets


def _experts_hit(offsets: np.ndarray):
    """(e, rows) for every expert with rows, rows a slice of the sorted order."""
    for e in np.flatnonzero(np.diff(offsets)):
        yield int(e), slice(int(offsets[e]), int(offsets[e + 1]))


def _gate_up(xs: np.ndarray, w1: np.ndarray) -> tuple:
    """(gate, up) [n, I] of rows xs [n, H] against one expert's gate_up_proj [2I, H], in the compute dtype."""
    h = _invariant.dot(xs, upcast(w1).T)
    i = w1.shape[0] // 2
    return np.ascontiguousarray(h[:, :i]), np.ascontiguousarray(h[:, i:])


def _per_token(per_slot: np.ndarray, order: np.ndarray, t: int, k: int) -> np.ndarray:
    """Rows in sorted order back to their slots [T, k, N], summed over k in pick order (float32 / float64)."""
    slots = np.empty_like(per_slot)
    slots[order] = per_slot
    slots = slots.reshape(t, k, per_slot.shape[1])
    out = slots[:, 0].copy()
    for j in range(1, k):
        out += slots[:, j]
    return out


@impl(spec, "cpu")
@uses_blas()
def moe_experts(x, gate_up_proj, down_proj, top_k_index, top_k_weights) -> np.ndarray:
    """out [T, H]: per expert hit, silu(xs W1g^T) * (xs W1u^T) @ W2^T on its sorted rows xs, times the router weight.

    Notes: the gathered x and the per-pick outputs are [T k, H] in the compute dtype (float32 for 16-bit inputs,
    kept there until the single rounding of the sum over k); only the experts hit are read (and upcast).
    """
    t, h = x.shape
    k = top_k_index.shape[1]
    acc = acc_of(x.dtype)
    order, offsets = _sorted_picks(top_k_index, gate_up_proj.shape[0])
    xs = upcast(x)[order // k]
    ws = upcast(top_k_weights).reshape(-1)[order]
    ys = np.empty((t * k, h), acc)
    with np.errstate(invalid="ignore", over="ignore"):
        for e, rows in _experts_hit(offsets):
            gate, up = _gate_up(xs[rows], gate_up_proj[e])
            a = _swiglu(np.empty_like(gate), gate, up)
            ys[rows] = _invariant.dot(a, upcast(down_proj[e]).T)  # row-invariant under batch_invariant()
            ys[rows] *= ws[rows, None]
        return _per_token(ys, order, t, k).astype(x.dtype, copy=False)


@impl(spec.backward_op, "cpu")
@uses_blas()
def moe_experts_backward(grad, x, gate_up_proj, down_proj, top_k_index, top_k_weights) -> tuple:
    """dx, dgate_up_proj, ddown_proj, dtop_k_weights: per expert hit, gate and up recomputed on its sorted rows, then
    dA = g W2 (g: the rows' upstream gradients), dw = rowsum(dA * a), da = w dA, dW2 = (w g)^T a, [dgate, dup] from
    swiglu's backward, dW1 = [dgate, dup]^T xs, and per-pick dx rows [dgate, dup] W1 summed over k in pick order.

    Notes: dA * w is da = (w g) W2 without a second GEMM, and dA . a is g . (W2 a) = g . y without y. Experts no token
    picks get zero gradients without a read of their weights.
    """
    t, h = x.shape
    k = top_k_index.shape[1]
    acc = acc_of(x.dtype)
    order, offsets = _sorted_picks(top_k_index, gate_up_proj.shape[0])
    tokens = order // k
    xs, gs = upcast(x)[tokens], upcast(grad)[tokens]
    ws = upcast(top_k_weights).reshape(-1)[order]
    dxs = np.empty((t * k, h), acc)
    dws = np.empty(t * k, acc)
    dw1, dw2 = np.zeros(gate_up_proj.shape, acc), np.zeros(down_proj.shape, acc)
    swiglu_bwd = _swiglu_backward32 if x.dtype == np.float32 else _swiglu_backward
    with np.errstate(invalid="ignore", over="ignore"):
        for e, rows in _experts_hit(offsets):
            w1 = upcast(gate_up_proj[e])
            gate, up = _gate_up(xs[rows], w1)
            da = gs[rows] @ upcast(down_proj[e])  # dA = g W2, [n, I]
            a = _swiglu(np.empty_like(gate), gate, up)
            dws[rows] = np.einsum("ni,ni->n", da, a)
            w = ws[rows, None]
            dw2[e] = (gs[rows] * w).T @ a
            da *= w
            dh = np.empty((gate.shape[0], 2, gate.shape[1]), acc)  # [dgate, dup] per row
            dgate, dup = swiglu_bwd(np.empty(gate.size, acc), np.empty(gate.size, acc), gate.reshape(-1),
                                    up.reshape(-1), da.reshape(-1))  # swiglu's block functions take flat blocks
            dh[:, 0], dh[:, 1] = dgate.reshape(gate.shape), dup.reshape(gate.shape)
            dh = dh.reshape(gate.shape[0], -1)
            dw1[e] = dh.T @ xs[rows]
            dxs[rows] = dh @ w1
        dx = _per_token(dxs, order, t, k)
        dw = np.empty(t * k, acc)
        dw[order] = dws
    dt = x.dtype
    return (dx.astype(dt, copy=False), dw1.astype(dt, copy=False), dw2.astype(dt, copy=False),
            dw.reshape(t, k).astype(dt, copy=False))

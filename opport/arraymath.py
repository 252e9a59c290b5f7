"""NumPy helpers that both the float64 references (opport/ops/) and the cpu kernels use.

They live here, apart from the declarations, so that no kernel imports the code that judges it. Because
the oracle and the cpu kernels share them, a bug here would be invisible to the cpu conformance run:
each helper is therefore checked on its own, against hand-computed values (tests/test_arraymath.py).
"""

from __future__ import annotations

import numpy as np


def reduce_losses(loss: np.ndarray, ignored: np.ndarray, reduction: str):
    """Apply the reduction to per-row losses (ignored rows already 0); the mean divides by the kept rows."""
    if reduction == "none":
        return loss
    total = loss.sum()
    if reduction == "sum":
        return np.asarray(total)
    kept = int(ignored.size - np.count_nonzero(ignored))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.asarray(total / loss.dtype.type(kept))


def row_scale(x: np.ndarray, limit: float) -> np.ndarray:
    """Per-row power of two that brings max|x| of rows above `limit` into [0.5, 1); 1 for the other rows.

    Scaling by a power of two is exact (short of underflow far below the row's largest value), and
    the norms are scale invariant once eps is scaled along: eps * s**2.
    """
    amax = np.max(np.abs(x), axis=-1, keepdims=True)
    big = np.isfinite(amax) & (amax > limit)
    return np.where(big, np.ldexp(x.dtype.type(1), -np.frexp(amax)[1]), x.dtype.type(1))


def pair_views(a: np.ndarray, interleaved: bool):
    """Views of the two members of each rotated pair: (a[..., 0::2], a[..., 1::2]) or the two halves."""
    h = a.shape[-1] // 2
    return (a[..., 0::2], a[..., 1::2]) if interleaved else (a[..., :h], a[..., h:])

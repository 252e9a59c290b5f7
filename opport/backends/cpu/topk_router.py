"""topk_router on NumPy: a stable sort of each row's ranking keys, weights from the float32 (float64) scores."""

import numpy as np

from opport.dispatch import impl
from opport.dtypes import acc_of
from opport.ops.topk_router import topk_router as spec


def _sigmoid(x: np.ndarray) -> np.ndarray:
    """sigmoid exponentiating only -|x| (no overflow)."""
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0, e).astype(x.dtype) / (1.0 + e)


def _order(keys: np.ndarray, k: int) -> np.ndarray:
    """The k best columns per row: NaN first, then descending keys, ties to the lowest index. Each key becomes a
    signed integer of the same order (the float's bits, negatives' magnitude bits flipped; -0 as +0, every NaN
    as the largest), and a stable argsort of its negation keeps equal keys in index order."""
    keys = np.where(keys == 0, 0.0, keys).astype(keys.dtype)
    ints = np.int64 if keys.dtype == np.float64 else np.int32
    bits = keys.view(ints).astype(np.int64)
    top = (1 << (63 if ints is np.int64 else 31)) - 1
    ordered = np.where(bits >= 0, bits, bits ^ top)
    ordered = np.where(np.isnan(keys), top, ordered)  # (no non-NaN key maps to the int64 minimum: -x is safe)
    return np.argsort(-ordered, axis=1, kind="stable")[:, :k]


@impl(spec, "cpu")
def topk_router(logits: np.ndarray, k: int, renormalize: bool, scoring: str, bias):
    t, e = logits.shape
    acc = acc_of(logits.dtype)
    x = logits.astype(acc)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        score = _sigmoid(x) if scoring == "sigmoid" else None
        keys = score + np.asarray(bias, acc) if bias is not None else x
        idx = _order(keys, k) if t else np.zeros((0, k), np.int64)
        rows = np.arange(t)[:, None]
        if scoring == "softmax":
            z = np.exp(x - np.max(x, axis=1, keepdims=True)) if t else x
            w = z[rows, idx] / (1.0 if renormalize else np.sum(z, axis=1, keepdims=True))
        else:
            w = score[rows, idx]
        if renormalize:
            w = w / np.sum(w, axis=1, keepdims=True)
    return w.astype(logits.dtype), idx.astype(np.int32)


@impl(spec.backward_op, "cpu")
def topk_router_backward(grad_weights: np.ndarray, logits: np.ndarray, indices: np.ndarray, k: int, renormalize: bool,
                         scoring: str):
    """dlogits from the recomputed scores at the saved indices (see the spec), in float64 for every dtype: c sums k
    products that G - c may cancel (a large upstream gradient), and float64 keeps that cancellation's rounding
    below every dtype's tolerance."""
    t, e = logits.shape
    acc = np.float64
    x = logits.astype(acc)
    g = grad_weights.astype(acc)
    idx = np.asarray(indices).astype(np.intp)
    rows = np.arange(t)[:, None]
    chosen = np.zeros((t, e), bool)
    chosen[rows, idx] = True
    big_g = np.zeros((t, e), acc)
    big_g[rows, idx] = g
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        if scoring == "softmax":
            z = np.exp(x - np.max(x, axis=1, keepdims=True)) if t else x
            if not renormalize:
                p = z / np.sum(z, axis=1, keepdims=True)
                c = np.sum(g * p[rows, idx], axis=1, keepdims=True)
                d = p * (big_g - c)
            else:
                zs = np.where(chosen, z, 0.0)
                w = zs / np.sum(zs, axis=1, keepdims=True)
                c = np.sum(g * w[rows, idx], axis=1, keepdims=True)
                d = np.where(chosen, w * (big_g - c), 0.0)
        else:
            s = _sigmoid(x)
            slope = s * _sigmoid(-x)
            if not renormalize:
                d = np.where(chosen, slope * big_g, 0.0)
            else:
                total = np.sum(s[rows, idx], axis=1, keepdims=True)
                c = np.sum(g * s[rows, idx], axis=1, keepdims=True) / total
                d = np.where(chosen, slope * (big_g - c) / total, 0.0)
    return (d.astype(logits.dtype),)

"""Sampling filters on NumPy, shared by the sample and sampling_probs kernels: each row's order by a stable sort
of its logits, the filters as prefixes of that order, float32 weights (float64 for float64 logits), float64 cumulative masses."""

from __future__ import annotations

import numpy as np

from opport.dtypes import acc_of


def _ordered(x: np.ndarray) -> np.ndarray:
    """Descending logit, ties to the lowest index (-0 ties +0): a stable argsort of the negated logits."""
    return np.argsort(-np.where(x == 0, 0, x), axis=1, kind="stable")


def filtered(logits: np.ndarray, temperature, top_k, top_p, min_p):
    """(w [B, V] kept weights, zero elsewhere, in the accumulation dtype; status [B]: 0 sampled, 1 greedy (w is
    one-hot at the argmax), -1 invalid (NaN, +inf, or all -inf))."""
    acc = acc_of(logits.dtype)
    x = logits.astype(acc)
    b, v = x.shape
    status = np.zeros(b, np.int64)
    w = np.zeros((b, v), acc)
    if b == 0:
        return w, status
    with np.errstate(invalid="ignore", over="ignore", under="ignore", divide="ignore"):
        bad = np.isnan(x).any(axis=1) | np.isposinf(x).any(axis=1) | np.isneginf(x).all(axis=1)
        m = np.max(np.where(bad[:, None], 0, x), axis=1, keepdims=True)
        t = np.asarray(temperature, acc)[:, None]
        g = t[:, 0] == 0
        status[g] = 1
        status[bad] = -1
        live = ~bad & ~g
        z = np.exp((x - m) / np.where(live[:, None], t, 1))
        z[~live] = 0
        order = _ordered(np.where(live[:, None], x, 0))
        zs = np.take_along_axis(z, order, axis=1)
        cs = np.cumsum(zs, axis=1, dtype=np.float64)  # float64 masses: no rounding grows with V
        k = np.asarray(top_k, np.int64)
        kk = np.where((k > 0) & (k < v), k, v)
        rows = np.arange(b)
        s_k = cs[rows, kk - 1]
        tp = np.asarray(top_p, acc)
        # the first position whose cumulative mass reaches top_p * s_k (top_p = 1: none cut)
        reach = cs >= (tp * s_k)[:, None]
        n_p = np.where(tp < 1, np.where(reach.any(axis=1), np.argmax(reach, axis=1) + 1, v), v)
        keep_n = np.minimum(kk, n_p)
        pos = np.arange(v)[None, :]
        keep_sorted = (pos < keep_n[:, None]) & (zs >= np.asarray(min_p, acc)[:, None])
        np.put_along_axis(w, order, np.where(keep_sorted, zs, 0), axis=1)
        gi = np.flatnonzero(g & ~bad)
        if gi.size:
            w[gi, np.argmax(x[gi] == m[gi], axis=1)] = 1
    return w, status

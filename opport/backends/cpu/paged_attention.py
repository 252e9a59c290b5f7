"""paged_attention on NumPy: per sequence, its visited blocks gathered in chunks, with an online softmax."""

import math

import numpy as np

from opport.arraymath import gather, visible
from opport.backends.cpu._common import store, upcast, uses_blas
from opport.dispatch import impl
from opport.ops.paged_attention import paged_attention as spec

CHUNK_KEYS = 2048  # keys gathered per step: [chunk, Hkv, D] temporaries of a few MiB at D = 128, Hkv = 8


@impl(spec, "cpu")
@uses_blas()
def paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                    context_lens: np.ndarray, scale, softcap, sliding_window) -> np.ndarray:
    """out[b] = softmax(q[b] k_b^T · scale, softcapped) v_b over sequence b's visible positions.

    Dimensions: q [B, Hq, D], caches [num_blocks, bs, Hkv, D/Dv], block_tables [B, max_blocks], out [B, Hq, Dv].
    Notes: only the positions a sequence sees are gathered (its window of its own blocks), CHUNK_KEYS at a
    time, so unseen slots (NaN or not) never enter and memory stays bounded at long contexts. 16-bit inputs
    compute in float32. GQA: q is viewed [Hkv, g, D] so each KV head serves its g query heads by broadcasting.
    Pseudocode, per chunk: s = q k^T·scale; s = c·tanh(s/c); m' = max(m, rowmax s); p = exp(s - m');
    l = l·exp(m - m') + rowsum p; acc = acc·exp(m - m') + p v.  out = acc / l (0 where l == 0).
    """
    bsz, hq, d = q.shape
    hkv, dv = k_cache.shape[2], v_cache.shape[3]
    out = np.empty((bsz, hq, dv), q.dtype)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    for b in range(bsz):
        lo, hi = visible(int(context_lens[b]), sliding_window)
        qb = upcast(q[b]).reshape(hkv, hq // hkv, d)
        store(out[b], _one(qb, k_cache, v_cache, block_tables[b], lo, hi, scale, softcap).reshape(hq, dv))
    return out


def _one(qb, k_cache, v_cache, table, lo, hi, scale, softcap):
    """One sequence's [Hkv, g, Dv] output (accumulation dtype) over positions lo .. hi - 1."""
    hkv, g, _ = qb.shape
    dv = v_cache.shape[3]
    acc = np.zeros((hkv, g, dv), qb.dtype)
    m = np.full((hkv, g, 1), -np.inf, qb.dtype)
    l_sum = np.zeros((hkv, g, 1), qb.dtype)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for c0 in range(lo, hi, CHUNK_KEYS):
            c1 = min(hi, c0 + CHUNK_KEYS)
            k = upcast(gather(k_cache, table, c0, c1)).transpose(1, 2, 0)  # [Hkv, D, n]
            v = upcast(gather(v_cache, table, c0, c1)).transpose(1, 0, 2)  # [Hkv, n, Dv]
            s = (qb @ k) * qb.dtype.type(scale)
            if softcap is not None:
                s = qb.dtype.type(softcap) * np.tanh(s / qb.dtype.type(softcap))
            m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
            m_safe = np.where(m_new == -np.inf, 0, m_new)  # nothing finite seen yet: exp(-inf - 0) = 0
            alpha = np.exp(m - m_safe)
            p = np.exp(s - m_safe)
            l_sum = l_sum * alpha + p.sum(axis=-1, keepdims=True)
            acc = acc * alpha + p @ v
            m = m_new
        return np.where(l_sum == 0, 0, acc / np.where(l_sum == 0, 1, l_sum))

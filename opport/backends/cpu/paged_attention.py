"""paged_attention on NumPy: groups of sequences at once, their visited positions gathered in chunks, with an online
softmax."""

import math

import numpy as np

from opport.arraymath import per_token_scales, scale_rows
from opport.backends.cpu._common import store, upcast, uses_blas
from opport.dispatch import impl
from opport.ops.paged_attention import paged_attention as spec

CHUNK_KEYS = 256  # positions gathered per step for every row of a group
ROWS = 16  # sequences per group: [ROWS, CHUNK_KEYS, Hkv, D + Dv] float32 temporaries, 32 MiB at Hkv = 8, D = 128


@impl(spec, "cpu")
@uses_blas()
def paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                    context_lens: np.ndarray, scale, softcap, sliding_window, k_scale=None, v_scale=None) -> np.ndarray:
    """out[b] = softmax(q[b] k_b^T · scale, softcapped) v_b over sequence b's visible positions.

    Dimensions: q [B, Hq, D], caches [num_blocks, bs, Hkv, D/Dv], block_tables [B, max_blocks], out [B, Hq, Dv].
    Notes: `decode_rows` for all sequences at once (see there). An fp8 cache is read as codes x scales
    (`kv_rows`), in the accumulation dtype.
    """
    lens = np.asarray(context_lens, np.int64)
    lo = np.zeros_like(lens) if sliding_window is None else np.maximum(lens - sliding_window, 0)
    out = np.empty((q.shape[0], q.shape[1], v_cache.shape[3]), q.dtype)
    decode_rows(out, q, k_cache, v_cache, np.asarray(block_tables), lo, lens, scale, softcap, k_scale, v_scale)
    return out


def kv_rows(cache, scale, blk, off, dt):
    """The cache's rows at slots (blk, off) in the accumulation dtype `dt`; an fp8 cache's codes times their float32
    scales (per tensor, or per slot and head), one rounding to dt."""
    rows = cache[blk, off]
    if scale is None:
        return upcast(rows)
    return rows.astype(dt) * scale_rows(scale[blk, off] if per_token_scales(scale) else scale).astype(dt)


def gather_kv(cache, scale, table, lo: int, hi: int, dt):
    """Positions lo .. hi - 1 of one sequence, [hi - lo, Hkv, D] in `dt` (arraymath.gather, scales applied)."""
    pos = np.arange(lo, hi)
    bs = cache.shape[1]
    return kv_rows(cache, scale, np.asarray(table)[pos // bs].astype(np.int64), pos % bs, dt)


def decode_rows(out, q, k_cache, v_cache, tables, lo, hi, scale, softcap, k_scale=None, v_scale=None) -> None:
    """out[b] (stored in out's dtype) = attention of one query token q[b] [Hq, D] over positions lo[b] .. hi[b] - 1
    of its table tables[b], ROWS sequences at a time, CHUNK_KEYS positions per step of an online softmax.

    Notes: the rows of a group gather the same positions (by their own tables) in one fancy index and run one
    batched q k^T and p v, instead of one small problem per sequence (~75 us each). A position outside a row's
    range gets score -inf and value 0 (whatever its slot holds, NaN included: it is never used, and table entries
    past a row's last block are replaced by block 0 before the gather). Chunks are aligned to multiples of
    CHUNK_KEYS from position 0, so a row's additions do not depend on the other rows (batch invariance): a chunk
    outside a row's range adds exactly 0 to it. 16-bit inputs compute in float32. GQA: q is viewed [Hkv, g, D].
    Pseudocode, per chunk: s = q k^T·scale; s = c·tanh(s/c); m' = max(m, rowmax s); p = exp(s - m');
    l = l·exp(m - m') + rowsum p; acc = acc·exp(m - m') + p v.  out = acc / l (0 where l == 0).
    """
    bsz, hq, d = q.shape
    hkv, dv = k_cache.shape[2], v_cache.shape[3]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    for r0 in range(0, bsz, ROWS):
        rows = slice(r0, min(bsz, r0 + ROWS))
        qb = upcast(q[rows]).reshape(-1, hkv, hq // hkv, d)
        o = _rows(qb, (k_cache, k_scale), (v_cache, v_scale), tables[rows], lo[rows], hi[rows], scale, softcap)
        store(out[rows], o.reshape(-1, hq, dv))


def _rows(qb, k_kv, v_kv, tables, lo, hi, scale, softcap):
    """[R, Hkv, g, Dv] (accumulation dtype) for R query rows qb [R, Hkv, g, D]; k_kv and v_kv: (cache, scale)."""
    (k_cache, k_scale), (v_cache, v_scale) = k_kv, v_kv
    n_rows, hkv, g, _ = qb.shape
    bs = k_cache.shape[1]
    dt = qb.dtype.type
    acc = np.zeros((n_rows, hkv, g, v_cache.shape[3]), qb.dtype)
    m = np.full((n_rows, hkv, g, 1), -np.inf, qb.dtype)
    l_sum = np.zeros((n_rows, hkv, g, 1), qb.dtype)
    if n_rows == 0 or hi.max(initial=0) <= 0:
        return acc
    first = int(lo[hi > lo].min(initial=0)) // CHUNK_KEYS * CHUNK_KEYS
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for c0 in range(first, int(hi.max()), CHUNK_KEYS):
            pos = np.arange(c0, min(int(hi.max()), c0 + CHUNK_KEYS))
            seen = (pos[None, :] >= lo[:, None]) & (pos[None, :] < hi[:, None])  # [R, n]
            blk = np.where(seen, tables[:, np.minimum(pos // bs, tables.shape[1] - 1)], 0).astype(np.int64)
            k = kv_rows(k_cache, k_scale, blk, pos % bs, dt).transpose(0, 2, 3, 1)  # [R, Hkv, D, n]
            v = np.where(seen[:, :, None, None], kv_rows(v_cache, v_scale, blk, pos % bs, dt), 0).transpose(0, 2, 1, 3)
            s = (qb @ k) * dt(scale)
            if softcap is not None:
                s = dt(softcap) * np.tanh(s / dt(softcap))
            s = np.where(seen[:, None, None, :], s, -np.inf)
            m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
            m_safe = np.where(m_new == -np.inf, 0, m_new)  # nothing seen yet: exp(-inf - 0) = 0
            alpha = np.exp(m - m_safe)
            p = np.exp(s - m_safe)
            l_sum = l_sum * alpha + p.sum(axis=-1, keepdims=True)
            acc = acc * alpha + p @ v
            m = m_new
        return np.where(l_sum == 0, 0, acc / np.where(l_sum == 0, 1, l_sum)).astype(qb.dtype, copy=False)

"""attention on NumPy: flash-style blocks over queries and keys with an online softmax (float32 for 16-bit).

Memory: per step the temporaries are a [n, g·bq, bk] score block (n KV heads, of one batch entry or,
for contiguous inputs, of several; g query heads per KV head; bq = min(Sq, B) query rows with B = BLOCK_Q, or
BLOCK_Q_MASKED under a causal mask or a window, and bk = BLOCK_K · B / bq keys) plus the [n, g·bq, Dv] accumulator,
with n chosen so a score block stays under SCORE_BUDGET bytes; nothing grows with Sq·Sk. GQA reads each KV head once
for its g query heads through broadcasting matmuls, so K and V are never repeated in memory.
"""

import math

import numpy as np

from opport.backends.cpu import _attn_tasks, _fused
from opport.backends.cpu._common import _F32, store, upcast, uses_blas
from opport.dispatch import impl
from opport.dtypes import acc_of
from opport.ops.attention import attention as spec

BLOCK_Q = 128  # query rows per block (per query head); 128 x 256 measured 10-25% faster than 64 x 128
# under a causal mask or a window, 64: each block then skips the keys none of its rows sees, and its score block stays
# in L2 (1 MB a core here). A tiny Llama's q [4, 4, 128, 64] (GQA 2, causal): forward 2.7 -> 1.4 ms, backward 4.9 ->
# 3.4-4.5 ms; S 256: backward 8.0 -> 4.9 ms; S 512-2048 within noise (docs/performance.md). Without a mask 64 loses
# (S 128: forward 1.06 -> 1.17, backward 4.7 -> 5.5 ms), so full attention keeps 128.
BLOCK_Q_MASKED = 64
# the backward of a masked call of at most BACKWARD_SHORT query rows: 32 (the diagonal blocks' masked half is less of
# the work). q [4, 4, S, 64] causal, GQA 2, one thread, 2026-12-04: S 128 backward 2.69 -> 2.42 ms, S 256 8.7 -> 8.2;
# S 512 even (29.0), S 1024 slower (103 -> 109); the forward lost at 256 and beyond (3.3 -> 3.6 ms) and gained
# nothing at 128, so it keeps 64.
BLOCK_Q_MASKED_BACKWARD = 32
BACKWARD_SHORT = 256
BLOCK_K = 256  # keys per block, for full query blocks; fewer query rows take proportionally more keys
SCORE_BUDGET = 4 << 20  # bytes of one float32 score block; bounds n, the KV heads done at once
# the backward's: its block holds four score-sized arrays (P, dP in float64, dS) where the forward's holds one or two;
# at 4 MB they left L2 (1 MB a core here) and the backward ran 1.5-1.8x slower (docs/cpu.md). It sets the heads per
# step only: each head's arithmetic, and so its bits, do not depend on it.
BACKWARD_SCORE_BUDGET = 256 << 10


# the compiled tasks' blocks (_attn_tasks.py): no Python between blocks, so smaller ones cost only their BLAS calls
TASK_BLOCK_Q = 128
TASK_BLOCK_Q_MASKED = 32
TASK_BLOCK_Q_BACKWARD = 32
TASK_BLOCK_K_BACKWARD = 128


def _blocks(sq: int, sk: int, g: int, itemsize: int, bq: int, budget: int = 0) -> tuple:
    """(keys per block, KV heads per step) for query blocks of min(sq, bq) rows.

    A query block of fewer rows (decode: one) takes bq / rows times the keys, so that a score block
    holds about as many elements as a full one and a decode step is a few large NumPy calls instead of
    many small ones; the heads per step then fill `budget` bytes (SCORE_BUDGET by default).
    """
    rows = max(1, min(sq, bq))
    bk = max(1, min(sk, BLOCK_K * max(1, bq // rows)))
    return bk, max(1, (budget or SCORE_BUDGET) // (g * rows * bk * itemsize))


def _block_rows(mask, backward: bool = False, sq: int = 0) -> int:
    """Query rows per block: fewer under a mask (BLOCK_Q_MASKED: why), fewer still in a short masked backward."""
    if not (mask.causal or mask.window is not None):
        return BLOCK_Q
    return BLOCK_Q_MASKED_BACKWARD if backward and sq <= BACKWARD_SHORT else BLOCK_Q_MASKED


MERGE_COPY_MAX = 16 << 20  # bytes of inputs copied so that the batch merges (_batch_heads_merge)


def _views_merged(a: np.ndarray) -> bool:
    """Whether [B, H, ...] `a` views its batch and head axes as one B*H axis (a reshape that does not copy)."""
    return a.shape[0] == 1 or a.shape[1] == 1 or a.strides[0] == a.shape[1] * a.strides[1]


def _batch_heads_merge(*arrays):
    """The [B, H, ...] arrays, each viewing its batch and head axes as one B*H axis, or None.

    Arrays that do not (a model's [B, S, H, D] projections seen as [B, H, S, D]: v, and the gradient of the
    output) are copied while the copies stay under MERGE_COPY_MAX bytes: one problem over B*H heads makes a few
    large matmuls where the loop over the batch makes B times as many small ones (a tiny Llama's attention
    [4, 4, 128, 64]: forward 1.6 -> 1.25 ms, backward 3.2 -> 2.9). Each head's arithmetic is the same either way."""
    if arrays[0].shape[0] == 1:
        return None
    copy = [i for i, a in enumerate(arrays) if not _views_merged(a)]
    if sum(arrays[i].nbytes for i in copy) > MERGE_COPY_MAX:
        return None
    return tuple(np.ascontiguousarray(a) if i in copy else a for i, a in enumerate(arrays))


def _work(q, k, v, *_) -> int:
    """Multiply-adds of the two products, B Hq Sq Sk (D + Dv): at most BLAS_INLINE, BLAS's limit is left alone (as
    matmul's: OpenBLAS runs products that small on the calling thread; a decode step's are)."""
    return q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * (q.shape[3] + v.shape[3])


@impl(spec, "cpu")
@uses_blas(work=_work)
def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool, scale, softcap=None,
              sliding_window=None) -> np.ndarray:
    """softmax(q k^T · scale, bottom-right causal mask) v, out [B, Hq, Sq, Dv] in q's dtype.

    Dimensions: q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv], g = Hq / Hkv.
    Notes: rows that see no key (or only -inf scores) end with a zero softmax denominator and
    output 0. Key blocks that no row of a query block can see are never read; inside a partly
    masked block masked scores become -inf (so NaN in masked k cannot leak) and, if that block of
    v holds non-finite values, each row multiplies only its visible prefix (0·NaN would leak).
    A sliding window W also skips the key blocks before the block's first row's window, and masks keys
    j <= i + Sk - Sq - W like the causal mask; a soft cap c turns s into c·tanh(s / c) in place.
    Pseudocode, per (query block, key block): s = q k^T·scale; m' = max(m, rowmax s);
    p = exp(s - m'); l = l·exp(m - m') + rowsum p; acc = acc·exp(m - m') + p v; out = acc / l.
    """
    done = _decode(q, k, v, causal, scale, softcap, sliding_window)  # decode: one query row per head, one loop
    if done is not None:
        return done[0]
    return _attention(q, k, v, causal, scale, None, softcap, sliding_window)


def _decode(q, k, v, causal: bool, scale, softcap, window):
    """The fused loop's (output, lse) for one query row per head (float32, any layout: a [B, S, H, D] cache's views
    give the contiguous copy's bits), or None (the blocks run). The forward and the training forward both take it:
    their outputs stay the same bits."""
    if q.shape[2] != 1 or not (q.dtype is k.dtype is v.dtype is _F32) or not _fused.enabled(_F32):  # `is`: one object
        return None
    call = decode_call(q, k, v, causal, scale, softcap, window)
    return None if call is None else _fused.attention_decode(q, k, v, call[0], softcap, call[1], call[2])


def decode_call(q, k, v, causal: bool, scale, softcap, window) -> tuple | None:
    """(scale, kstart, kend) of a call of one query row per head that the decode loop takes (keys to see, at most
    _fused.DECODE_MAX multiply-adds), else None. Shapes only (NumPy arrays or torch tensors): the kernel's `_decode`
    and the native extension's decode path (opport/integrations/torch_native.py) both ask here."""
    kstart, kend = _Mask(1, k.shape[2], causal, window, softcap).keys(0, 1)
    b, hq, _, d = q.shape
    if kend <= kstart or b * hq * (kend - kstart) * (d + v.shape[3]) > _fused.DECODE_MAX:
        return None
    return (1.0 / math.sqrt(d) if scale is None else scale), kstart, kend


@impl(spec.train_forward, "cpu")
@uses_blas(work=_work)
def attention_forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool, scale, softcap=None,
                      sliding_window=None) -> tuple:
    """The forward plus each row's log-sum-exp m + log(l) [B, Hq, Sq] (float32; float64 for float64 inputs),
    from the online softmax's running max and sum: -inf for rows that see no key or only -inf scores."""
    done = _decode(q, k, v, causal, scale, softcap, sliding_window)  # as the forward: the same loop, the same bits
    if done is not None:
        return done
    lse = np.empty(q.shape[:3], acc_of(q.dtype))
    return _attention(q, k, v, causal, scale, lse, softcap, sliding_window), lse


def _attention(q, k, v, causal: bool, scale, lse, softcap=None, window=None):
    """The forward over (batch, KV-head chunk, query block); `lse` (if not None) receives the row statistics."""
    b, hq, sq, d = q.shape
    hkv, dv = k.shape[1], v.shape[3]
    g = hq // hkv
    out = np.empty((b, hq, sq, dv), q.dtype)
    if _attn_tasks.covers(q, k, v, softcap, window):  # float32: the compiled tasks, on torch's pool as its guest
        rows = lse if lse is not None else np.empty(q.shape[:3], np.float32)
        bq = TASK_BLOCK_Q_MASKED if causal else TASK_BLOCK_Q
        if _attn_tasks.forward(q, k, v, causal, 1.0 / math.sqrt(d) if scale is None else scale, bq, BLOCK_K, out, rows):
            return out
    acc_t = acc_of(q.dtype)
    scale = acc_t.type(1.0 / math.sqrt(d) if scale is None else scale)
    mask = _Mask(sq, k.shape[2], causal, window, None if softcap is None else acc_t.type(softcap))
    merged = _batch_heads_merge(q, k, v)
    if merged is not None:  # batch entries are independent: one [1, B*H] problem
        q, k, v = merged
        sk = k.shape[2]
        b, hkv, q, k, v = 1, b * hkv, q.reshape(1, b * hq, sq, d), k.reshape(1, b * hkv, sk, d), v.reshape(1, b * hkv, sk, dv)
    # [B, Hq, ...] viewed as [B, Hkv, g, ...] (splitting an axis never copies): query head kv·g + j reads KV head kv
    qg, og = q.reshape(b, hkv, g, sq, d), out.reshape(b, hkv, g, sq, dv)
    lg = None if lse is None else lse.reshape(b, hkv, g, sq)  # lse is ours, contiguous: a view
    bq = _block_rows(mask)
    bk, step = _blocks(sq, k.shape[2], g, acc_t.itemsize, bq)
    with np.errstate(over="ignore"):
        for bi in range(b):
            for h0 in range(0, hkv, step):
                heads = slice(h0, min(h0 + step, hkv))
                for i0 in range(0, sq, bq):
                    i1 = min(i0 + bq, sq)
                    o, l_rows = _query_block(qg[bi, heads, :, i0:i1], k[bi, heads], v[bi, heads], i0, mask, scale, bk)
                    store(og[bi, heads, :, i0:i1], o)
                    if lg is not None:
                        lg[bi, heads, :, i0:i1] = l_rows
    return out


class _Mask:
    """Which keys each query row sees (bottom-right causal mask, sliding window) and the soft cap."""

    def __init__(self, sq: int, sk: int, causal: bool, window, softcap):
        self.sk, self.off, self.causal, self.window, self.softcap = sk, sk - sq, causal, window, softcap

    def keys(self, i0: int, bq: int) -> tuple:
        """The key range [start, end) that rows i0..i0+bq-1 see between them."""
        end = min(self.sk, i0 + bq + self.off) if self.causal else self.sk  # the last row sees keys < end
        start = 0 if self.window is None else max(0, i0 + self.off + 1 - self.window)  # the first row's first key
        return start, max(end, start)

    def ranges(self, i0: int, bq: int, j0: int, j1: int):
        """Per row, the visible keys of block [j0, j1) as (a, b) relative to j0; None if all rows see all."""
        whole = not (self.causal and j1 - 1 > i0 + self.off)  # no row of the block misses a key at its end
        if self.window is not None:
            whole = whole and j0 > i0 + bq - 1 + self.off - self.window  # nor one at its start
        if whole:
            return None
        limit = np.arange(i0, i0 + bq) + self.off + 1 - j0  # one past each row's last visible key
        b = np.clip(limit, 0, j1 - j0)
        a = np.zeros_like(b) if self.window is None else np.minimum(np.clip(limit - self.window, 0, j1 - j0), b)
        return a, b

    def cap(self, s, slope: bool = False):
        """s -> c·tanh(s / c) in place; with `slope`, returns the cap's derivative 1 - tanh² (the backward's)."""
        s /= self.softcap
        np.tanh(s, out=s)
        d = 1 - s * s if slope else None
        s *= self.softcap
        return d


def _hidden(vis, width: int) -> np.ndarray:
    """[bq, width] True where a row does not see a key of the block, from its visible range (a, b)."""
    cols = np.arange(width)[None, :]
    return (cols < vis[0][:, None]) | (cols >= vis[1][:, None])


def _query_block(qb, k, v, i0: int, mask: _Mask, scale, bk: int):
    """Online softmax of one block of query rows [n, g, bq, D] over the keys it can see, bk keys at a time:
    (output rows [n, g, bq, Dv], their log-sum-exp [n, g, bq])."""
    n, g, bq, _ = qb.shape
    dv = v.shape[2]
    q2 = upcast(qb).reshape(n, g * bq, -1)  # all g heads' rows share the KV head: one matmul per key block
    acc_t = q2.dtype
    m = np.full((n, g * bq, 1), -np.inf, acc_t)
    den = acc = None  # set by the first key block, which has nothing to rescale
    kstart, kend = mask.keys(i0, bq)
    fast = _fused.enabled(acc_t) and acc_t == _F32 and mask.softcap is None  # float32 blocks: the fused loop
    with np.errstate(invalid="ignore", over="ignore"):
        for j0 in range(kstart, kend, bk):
            j1 = min(j0 + bk, kend)
            s = np.matmul(q2, upcast(k[:, j0:j1]).swapaxes(-1, -2))  # [n, g·bq, bk], then in place
            vb = upcast(v[:, j0:j1])
            nvis = mask.ranges(i0, bq, j0, j1)
            fused = _fused.attention_softmax(s, scale, nvis, bq, m) if fast else None
            if fused is not None:  # the same steps in one loop: s is P
                m_new, psum = fused
                m_ref = np.where(m_new == -np.inf, 0, m_new)
            else:
                m_new, m_ref = _softmax_block(s, scale, nvis, mask, n, g, bq, m)
                psum = s.sum(axis=-1, keepdims=True)
            p = s
            if acc is None:
                den, acc = psum, _pv(p, vb, nvis, g)
            else:
                alpha = np.exp(m - m_ref)
                den *= alpha
                den += psum
                acc *= alpha
                acc += _pv(p, vb, nvis, g)
            m = m_new
        if acc is None:  # no row of the block sees a key
            return np.zeros((n, g, bq, dv), acc_t), np.full((n, g, bq), -np.inf, acc_t)
        with np.errstate(divide="ignore"):  # log(0) = -inf: the rows that saw no finite score
            lse = np.where(m == -np.inf, 0, m) + np.log(den)
        empty = den == 0  # rows that saw no key, or only -inf scores: output 0
        if empty.any():
            den[empty] = 1
            acc /= den
            np.copyto(acc, 0, where=empty)
        else:
            acc /= den
        return acc.reshape(n, g, bq, dv), lse.reshape(n, g, bq)


def _softmax_block(s, scale, nvis, mask: _Mask, n: int, g: int, bq: int, m) -> tuple:
    """The NumPy steps of one key block: s -> exp(s scale - m_ref) in place, masked keys -inf first; (m_new, m_ref)."""
    s *= scale
    if mask.softcap is not None:
        mask.cap(s)
    if nvis is not None:  # some row of this block cannot see some key of it
        hidden = _hidden(nvis, s.shape[-1])  # [bq, bk], the same for every head
        np.copyto(s.reshape(n, g, bq, -1), -np.inf, where=hidden)  # NaN scores of masked keys too
    m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
    m_ref = np.where(m_new == -np.inf, 0, m_new)  # nothing seen yet: keep exp() at 0, not NaN
    np.exp(np.subtract(s, m_ref, out=s), out=s)
    return m_new, m_ref


def _pv(p, vb, nvis, g: int):
    """p [n, g·bq, bk] @ v [n, bk, Dv] without letting non-finite values of masked v rows leak through 0·v."""
    if nvis is None or np.isfinite(vb).all():
        return np.matmul(p, vb)
    n, _, dv = vb.shape
    bq = nvis[0].size
    p4 = p.reshape(n, g, bq, -1)
    out = np.empty((n, g, bq, dv), p.dtype)
    for r, (a, c) in enumerate(zip(*nvis)):  # rare path: per row, only its visible keys
        out[:, :, r] = np.matmul(p4[:, :, r, None, a:c], vb[:, None, a:c])[:, :, 0]
    return out.reshape(n, g * bq, dv)


# --------------------------------------------------------------------------- backward


@impl(spec.backward_op, "cpu")
@uses_blas()
def attention_backward(grad, q, k, v, out, lse, causal: bool, scale, softcap=None, sliding_window=None) -> tuple:
    """dq, dk, dv from the saved output and log-sum-exp: FlashAttention-2's backward in NumPy blocks.

    Dimensions: grad, out [B, Hq, Sq, Dv]; lse [B, Hq, Sq] float32; q, k, v as in the forward.
    Notes: per (query block, key block) of the forward's sizes, P = exp(s·scale - lse) is recomputed, so
    nothing grows with Sq·Sk; dk and dv accumulate over the query blocks (and over each KV head's g query
    heads, stacked as in the forward) in accumulators of k's and v's size, dq over the key blocks, all in
    float32 for 16-bit inputs. Rows with lse = -inf (no visible key, or only -inf scores) take no part:
    their q and dO are zeroed, their dq written 0. Masked P and dS are 0; where a partly masked block holds
    non-finite q, k or dO, each row multiplies only its visible prefix (0·NaN would leak).
    dP - D is formed in float64 whatever the dtype: where attention concentrates on one key (O ≈ v_j;
    a row with one visible key has dq = 0 exactly), float32 leaves eps·|dO|·|v| of cancellation in it,
    far beyond the norm-wise tolerance of a dq near 0 (heavy-tailed v, Sk = 1: 4e-5 against 1e-5); the
    float64 dP matmul costs the backward about 1.5x.
    A soft cap multiplies dS by its slope 1 - tanh²(s / c); a sliding window masks and skips as the forward.
    Pseudocode: D = rowsum(dO·O); per block: P = exp(s - lse); dV += P^T dO; dS = P (dO V^T - D);
    dQ += dS K; dK += dS^T Q; finally dQ and dK times scale.
    """
    hkv, g = k.shape[1], q.shape[1] // k.shape[1]
    acc_t = acc_of(q.dtype)
    scale = acc_t.type(1.0 / math.sqrt(q.shape[3]) if scale is None else scale)
    mask = _Mask(q.shape[2], k.shape[2], causal, sliding_window, None if softcap is None else acc_t.type(softcap))
    result = np.empty(q.shape, q.dtype), np.empty(k.shape, k.dtype), np.empty(v.shape, v.dtype)
    if _attn_tasks.covers(q, k, v, softcap, sliding_window) and grad.dtype is _F32 and out.dtype is _F32 \
            and lse.dtype is _F32 and _attn_tasks.backward(grad, q, k, v, out, lse, causal, scale, TASK_BLOCK_Q_BACKWARD,
                                                         TASK_BLOCK_K_BACKWARD, *result):
        return result
    arrays = (q, k, v, grad, out, lse, *result)
    merged = _batch_heads_merge(q, k, v, grad, out)
    if merged is not None:  # as the forward: one [1, B*H] problem
        arrays, hkv = [_merged(a) for a in merged + arrays[5:]], hkv * q.shape[0]
    q, k, v, grad, out, lse, dq, dk, dv = arrays
    b, sq = q.shape[0], q.shape[2]
    qg, gg, og, lg, dqg = (a.reshape(b, hkv, g, *a.shape[2:]) for a in (q, grad, out, lse, dq))
    bq = _block_rows(mask, backward=True, sq=sq)
    bk, step = _blocks(sq, k.shape[2], g, acc_t.itemsize, bq, BACKWARD_SCORE_BUDGET)
    with np.errstate(over="ignore", invalid="ignore"):
        for bi in range(b):
            for h0 in range(0, hkv, step):
                hs = slice(h0, min(h0 + step, hkv))
                dk_acc, dv_acc = np.zeros(k[bi, hs].shape, acc_t), np.zeros(v[bi, hs].shape, acc_t)
                v64 = v[bi, hs].astype(np.float64)  # dP's operand, once for all query blocks (as big as dv_acc twice)
                for i0 in range(0, sq, bq):
                    r = slice(i0, min(i0 + bq, sq))
                    rows = (qg[bi, hs, :, r], gg[bi, hs, :, r], og[bi, hs, :, r], lg[bi, hs, :, r])
                    dq_rows = _backward_block(*rows, k[bi, hs], v64, i0, mask, scale, bk, dk_acc, dv_acc)
                    store(dqg[bi, hs, :, r], dq_rows)
                dk_acc *= scale
                store(dk[bi, hs], dk_acc)
                store(dv[bi, hs], dv_acc)
    return result


def _merged(a: np.ndarray) -> np.ndarray:
    """[B, H, ...] as [1, B*H, ...]: a view for the arrays _batch_heads_merge accepts and for fresh outputs."""
    return a.reshape(1, a.shape[0] * a.shape[1], *a.shape[2:])


def _backward_block(qb, gb, ob, lb, k, v64, i0: int, mask: _Mask, scale, bk: int, dk_acc, dv_acc):
    """One block of query rows [n, g, bq, ...] against the keys it can see (v64: v in float64): adds its dK
    (unscaled) and dV into the accumulators [n, Sk, ...] and returns its dQ [n, g, bq, D]."""
    n, g, bq, d = qb.shape
    dv = v64.shape[2]
    q2, do2 = upcast(qb).reshape(n, g * bq, d), upcast(gb).reshape(n, g * bq, dv)
    do64 = do2.astype(np.float64, copy=False)  # dP - D is formed in float64: see attention_backward
    big_d = np.add.reduce(do64 * ob.reshape(n, g * bq, dv), axis=-1, keepdims=True)  # D = rowsum(dO·O)
    lse = lb.reshape(n, g * bq, 1).astype(q2.dtype)
    dead = lse == -np.inf  # rows with output 0: no gradient, and their q and dO must not reach dK, dV
    if dead.any():
        q2, do2, big_d = np.where(dead, 0, q2), np.where(dead, 0, do2), np.where(dead, 0, big_d)
        do64 = np.where(dead, 0, do64)
        lse = np.where(dead, np.inf, lse)  # exp(s - inf) = 0
    dq = np.zeros((n, g * bq, d), q2.dtype)
    kstart, kend = mask.keys(i0, bq)
    fast = _fused.enabled(q2.dtype) and q2.dtype == _F32 and mask.softcap is None  # the fused loop (float32 blocks)
    for j0 in range(kstart, kend, bk):
        j1 = min(j0 + bk, kend)
        kb = upcast(k[:, j0:j1])
        p = np.matmul(q2, kb.swapaxes(-1, -2))  # [n, g·bq, bk], then in place: s, s - lse, P
        dp = np.matmul(do64, v64[:, j0:j1].swapaxes(-1, -2))  # dP, then dP - D
        nvis = mask.ranges(i0, bq, j0, j1)
        ds = _fused.attention_grad_scores(p, scale, nvis, bq, lse, dp, big_d) if fast else None
        if ds is None:
            ds = _grad_scores(p, dp, big_d, scale, lse, nvis, mask, n, g, bq)
        if nvis is not None and not (np.isfinite(q2).all() and np.isfinite(do2).all() and np.isfinite(kb).all()):
            _prefix_products(p, ds, q2, do2, kb, nvis, dq, dk_acc[:, j0:j1], dv_acc[:, j0:j1])
        else:
            dv_acc[:, j0:j1] += np.matmul(p.swapaxes(-1, -2), do2)
            dk_acc[:, j0:j1] += np.matmul(ds.swapaxes(-1, -2), q2)
            dq += np.matmul(ds, kb)
    dq *= scale
    if dead.any():
        np.copyto(dq, 0, where=dead)  # (0 · a non-finite visible k)
    return dq.reshape(n, g, bq, d)


def _grad_scores(p, dp, big_d, scale, lse, nvis, mask: _Mask, n: int, g: int, bq: int):
    """The NumPy steps of one key block: p (the scores) -> P = exp(s scale - lse) in place; dS = (dP - D) P, both 0 at
    masked keys (times the soft cap's slope where there is one)."""
    p *= scale
    slope = None if mask.softcap is None else mask.cap(p, slope=True)
    p -= lse
    np.exp(p, out=p)
    dp -= big_d
    ds = dp.astype(p.dtype, copy=False)
    ds *= p
    if slope is not None:
        ds *= slope
    if nvis is not None:  # some row of this block cannot see some key of it
        hidden = _hidden(nvis, p.shape[-1])  # [bq, bk], the same for every head
        np.copyto(p.reshape(n, g, bq, -1), 0, where=hidden)  # (exp of a masked NaN score is NaN)
        np.copyto(ds.reshape(n, g, bq, -1), 0, where=hidden)  # (0 · inf of a masked v is NaN)
    return ds


def _prefix_products(p, ds, q2, do2, kb, nvis, dq, dk_blk, dv_blk) -> None:
    """The block's three products row by row, each over its visible keys only (the rare path: non-finite values
    in a partly masked block, where 0 · NaN would carry them past the mask)."""
    n, bq = p.shape[0], nvis[0].size
    p4, ds4 = p.reshape(n, -1, bq, p.shape[-1]), ds.reshape(n, -1, bq, ds.shape[-1])
    q4, do4, dq4 = (a.reshape(n, -1, bq, a.shape[-1]) for a in (q2, do2, dq))
    for r, (a, c) in enumerate(zip(*nvis)):
        if c > a:
            dq4[:, :, r] += np.matmul(ds4[:, :, r, a:c], kb[:, a:c])  # [n, g, c] @ [n, c, D]
            dk_blk[:, a:c] += np.matmul(ds4[:, :, r, a:c].swapaxes(-1, -2), q4[:, :, r])  # [n, c, g] @ [n, g, D]
            dv_blk[:, a:c] += np.matmul(p4[:, :, r, a:c].swapaxes(-1, -2), do4[:, :, r])

"""attention on NKI: flash-style forward, queries on the partitions, keys streamed in 512-wide score tiles."""

from __future__ import annotations

import math

import numpy as np

from opport.backends.neuron import _host
from opport.backends.neuron._softmax_steps import inverse_sum, online_step, running_state
from opport.backends.neuron._tiles import cdiv, spans
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.dispatch import impl
from opport.dtypes import np_dtype
from opport.ops.attention import attention as spec

Q_ROWS = 128  # queries per tile: the partitions (and the stationary free size of the score matmul)
KT = 512  # keys per score tile: [128, 512] float32 scores fill one 2 KiB PSUM bank
KP = 128  # keys per P @ V matmul: the contraction runs over the partitions
D_MAX = 128  # head dim: the contraction of q @ k^T runs over the partitions
DV_MAX = 512  # value dim: the P @ V accumulator is one PSUM bank of float32
KV_RESIDENT = 96 * 1024  # bytes per partition for one KV head's k^T and v tiles kept across query tiles


def _load_kT(kT_sb, k_hbm, b, g, k0, kt, D):
    """kT_sb[0:D, 0:kt] = k[b, g, k0:k0+kt, :]^T, 128 keys at a time through TensorE transposes."""
    for j0, kp in spans(kt, KP):
        k_sb = nl.ndarray((kp, D), dtype=k_hbm.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=k_sb, src=k_hbm[b, g, k0 + j0:k0 + j0 + kp, 0:D])
        kT_psum = nl.ndarray((D, kp), dtype=k_hbm.dtype, buffer=nl.psum)
        nisa.nc_transpose(dst=kT_psum, data=k_sb)
        nisa.tensor_copy(dst=kT_sb[0:D, j0:j0 + kp], src=kT_psum)


def _load_v(v_hbm, b, g, k0, kt, Dv):
    """The [<=128 keys, Dv] tiles of v[b, g, k0:k0+kt, :] (keys on the partitions: the P @ V contraction)."""
    tiles = []
    for j0, kp in spans(kt, KP):
        v_sb = nl.ndarray((kp, Dv), dtype=v_hbm.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=v_sb, src=v_hbm[b, g, k0 + j0:k0 + j0 + kp, 0:Dv])
        tiles.append(v_sb)
    return tiles


@nki.jit
def _attention_kernel(q_hbm, k_hbm, v_hbm, causal, scale, q_rows, softcap=0.0, window=0):
    """Scaled dot-product attention with GQA and a bottom-right causal mask, flash-style (one pass over keys).

    Dimensions:
        B: batch; Hq / Hkv: query / KV heads (query head h reads KV head h // (Hq / Hkv));
        Sq: queries (tiles of q_rows on the partitions); Sk: keys (score tiles of 512 on the free dim,
        128-key pieces for P @ V); D <= 128: head dim; Dv <= 512: value dim.

    Args:
        q_hbm: [B, Hq, Sq, D]; k_hbm: [B, Hkv, Sk, D]; v_hbm: [B, Hkv, Sk, Dv]; all float32/float16/bfloat16.
        causal: compile-time bool; query i sees key j iff j <= i + Sk - Sq.
        scale: compile-time float multiplying the scores.
        q_rows: compile-time queries per tile: 128, or 1 to cut every row's keys exactly at its first and last
            visible key (used when v holds inf/NaN: TensorE computes 0 * inf = NaN for masked keys).
        softcap: compile-time float c > 0 (0.0: none): the scaled scores become c * tanh(s / c).
        window: compile-time int W >= 1 (0: none; only with causal): query i sees key j iff
            i + Sk - Sq - W < j <= i + Sk - Sq.

    Returns:
        out_hbm: [B, Hq, Sq, Dv] in q's dtype; rows that see no key (or whose visible scores are all
        -inf) are 0.

    Notes:
        Per query tile: qT (D on the partitions) comes from a TensorE transpose; per 512-key tile, one
        nc_matmul writes the [rows, 512] scores to a PSUM bank, ScalarE evicts them with the scale
        applied, GpSimd affine_select writes -inf where key > row + Sk - Sq (only on tiles the diagonal
        crosses; key tiles past the tile's last visible key are never computed; with a window, a second
        affine_select writes -inf before each row's first visible key, and key tiles wholly before the tile's
        first row's window are never loaded nor computed), VectorE takes the row
        max, and one ScalarE activation computes p = exp(s - m) and its row sum together. The running
        max starts at -FLT_MAX, so fully masked rows give exp(-inf) = 0 and never NaN; l and o are
        rescaled by exp(m_old - m_new). p is transposed in 128-key pieces on TensorE and P @ V
        accumulates in one float32 PSUM bank, which VectorE folds into o with the rescale in one
        scalar_tensor_tensor. k^T and v of a KV head are built once and reused by all its query heads
        and query tiles when they fit KV_RESIDENT bytes per partition, else re-read per query tile.
        Statistics and accumulators are float32; p is rounded to q's dtype for the P @ V matmul.

    Pseudocode:
        for b, KV head g, query head h of g, query tile rows:
            m = -FLT_MAX; l = 0; o = 0
            for key tile j (up to the tile's last visible key):
                s = scale * q @ k_j^T; s = c * tanh(s / c) (soft cap); s[masked] = -inf
                m' = max(m, rowmax(s)); p = exp(s - m'); c = exp(m - m')
                l = l * c + rowsum(p); o = o * c + p @ v_j; m = m'
            out = o / max(l, FLT_MIN)
    """
    return _attention(q_hbm, k_hbm, v_hbm, causal, scale, q_rows, False, softcap, window)


@nki.jit
def _attention_forward_kernel(q_hbm, k_hbm, v_hbm, causal, scale, q_rows, softcap=0.0, window=0):
    """The training forward: _attention_kernel's output plus each query row's log-sum-exp, saved for the backward.

    Dimensions:
        as _attention_kernel.

    Args:
        as _attention_kernel.

    Returns:
        (out_hbm, lse_hbm): the output as _attention_kernel's, and lse_hbm float32 [B, Hq, Sq] = m + log(l) of
        each row's visible scaled scores (-inf for a row that sees no key or only -inf scores).

    Notes:
        The same single pass: the running max m and sum l of the online softmax are at hand when a query
        tile is written, so the log-sum-exp costs one ScalarE log and one VectorE add per tile and a [p]
        float32 store; the backward recomputes the probabilities from it instead of storing them.

    Pseudocode:
        as _attention_kernel, and per query tile: lse = m + log(l)
    """
    return _attention(q_hbm, k_hbm, v_hbm, causal, scale, q_rows, True, softcap, window)


def _attention(q_hbm, k_hbm, v_hbm, causal, scale, q_rows, with_lse, softcap, window):
    """Both kernels' body: the flash forward over every (batch, KV head, query head, query tile)."""
    B, Hq, Sq, D = q_hbm.shape
    Hkv, Sk = k_hbm.shape[1], k_hbm.shape[2]
    Dv = v_hbm.shape[3]
    group = Hq // Hkv
    off = Sk - Sq
    exact = q_rows == 1
    out_hbm = nl.ndarray((B, Hq, Sq, Dv), dtype=q_hbm.dtype, buffer=nl.shared_hbm)
    if with_lse:
        lse_hbm = nl.ndarray((B, Hq, Sq), dtype=nl.float32, buffer=nl.shared_hbm)
    item = 4 if q_hbm.dtype == nl.float32 else 2
    resident = Sk * item + cdiv(Sk, KP) * Dv * item <= KV_RESIDENT
    if exact and window > 0:  # exact rows need tiles starting at each row's first key, not at 512-key boundaries
        resident = False

    for b in range(B):
        for g in range(Hkv):
            kT_tiles = []
            v_tiles = []
            if resident:
                for k0, kt in spans(Sk, KT):
                    if k0 + kt <= window_start(window, 0, off, Sk):  # before every row's window: never loaded
                        kT_tiles.append(None)
                        v_tiles.append(None)
                        continue
                    kT_sb = nl.ndarray((D, kt), dtype=k_hbm.dtype, buffer=nl.sbuf)
                    _load_kT(kT_sb, k_hbm, b, g, k0, kt, D)
                    kT_tiles.append(kT_sb)
                    v_tiles.append(_load_v(v_hbm, b, g, k0, kt, Dv))
            for hh in range(group):
                h = g * group + hh
                for q0, p in spans(Sq, q_rows):
                    k_end = min(Sk, max(0, q0 + p + off)) if causal else Sk  # keys past the last row's view: skipped
                    k_lo = window_start(window, q0, off, k_end)  # keys before the first row's window: skipped
                    if resident:
                        k_lo = k_lo // KT * KT
                    o_sb = nl.ndarray((p, Dv), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.memset(dst=o_sb, value=0.0)
                    m_sb, l_sb = running_state(p)
                    if k_end > k_lo:
                        q_sb = nl.ndarray((p, D), dtype=q_hbm.dtype, buffer=nl.sbuf)
                        nisa.dma_copy(dst=q_sb, src=q_hbm[b, h, q0:q0 + p, 0:D])
                        qT_psum = nl.ndarray((D, p), dtype=q_hbm.dtype, buffer=nl.psum)
                        nisa.nc_transpose(dst=qT_psum, data=q_sb)
                        qT_sb = nl.ndarray((D, p), dtype=q_hbm.dtype, buffer=nl.sbuf)
                        nisa.tensor_copy(dst=qT_sb, src=qT_psum)
                    for k0, kt in spans(k_end, KT, k_lo):
                        if resident:
                            kT_sb = kT_tiles[k0 // KT]
                            v_list = v_tiles[k0 // KT]
                        else:
                            kT_sb = nl.ndarray((D, kt), dtype=k_hbm.dtype, buffer=nl.sbuf)
                            _load_kT(kT_sb, k_hbm, b, g, k0, kt, D)
                            v_list = _load_v(v_hbm, b, g, k0, kt, Dv)
                        # scores s = scale * q @ k^T, masked
                        s_psum = nl.ndarray((p, kt), dtype=nl.float32, buffer=nl.psum)
                        nisa.nc_matmul(dst=s_psum, stationary=qT_sb, moving=kT_sb[0:D, 0:kt])
                        s_sb = nl.ndarray((p, kt), dtype=nl.float32, buffer=nl.sbuf)
                        _scores(s_sb, s_psum, scale, softcap)
                        if causal and k0 + kt - 1 > q0 + off:  # the diagonal crosses this tile
                            nisa.affine_select(dst=s_sb, pattern=[[-1, kt]], channel_multiplier=1, on_true_tile=s_sb,
                                               on_false_value=-math.inf, cmp_op=nl.greater_equal, offset=q0 + off - k0)
                        edge = window_edge(window, q0, p, k0, off)
                        if edge != None:  # noqa: E711 (NKI kernels compare with None by value)
                            nisa.affine_select(dst=s_sb, pattern=[[1, kt]], channel_multiplier=-1, on_true_tile=s_sb,
                                               on_false_value=-math.inf, cmp_op=nl.greater_equal, offset=edge)
                        # online softmax: new max, correction, probabilities (in q's dtype) and their row sum
                        m_new_sb, corr_sb, p_sb = online_step(m_sb, l_sb, s_sb, q_hbm.dtype)
                        # o = o * corr + p @ v
                        pv_psum = nl.ndarray((p, Dv), dtype=nl.float32, buffer=nl.psum)
                        for j, (j0, kp) in enumerate(spans(kt, KP)):
                            pT_psum = nl.ndarray((kp, p), dtype=q_hbm.dtype, buffer=nl.psum)
                            nisa.nc_transpose(dst=pT_psum, data=p_sb[0:p, j0:j0 + kp])
                            pT_sb = nl.ndarray((kp, p), dtype=q_hbm.dtype, buffer=nl.sbuf)
                            nisa.tensor_copy(dst=pT_sb, src=pT_psum)
                            nisa.nc_matmul(dst=pv_psum, stationary=pT_sb, moving=v_list[j][0:kp, 0:Dv])
                        nisa.scalar_tensor_tensor(dst=o_sb, data=o_sb, op0=nl.multiply, operand0=corr_sb, op1=nl.add,
                                                  operand1=pv_psum)
                        m_sb = m_new_sb
                    # out = o / max(l, FLT_MIN)
                    inv_sb = inverse_sum(l_sb)
                    out_sb = nl.ndarray((p, Dv), dtype=q_hbm.dtype, buffer=nl.sbuf)
                    if exact:
                        # a row whose visible scores are all -inf has p = 0, and 0 * inf in v is NaN: write 0 there
                        res_sb = nl.ndarray((p, Dv), dtype=nl.float32, buffer=nl.sbuf)
                        nisa.tensor_scalar(dst=res_sb, data=o_sb, op0=nl.multiply, operand0=inv_sb)
                        seen_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
                        nisa.tensor_scalar(dst=seen_sb, data=l_sb, op0=nl.equal, operand0=0.0)
                        zero_sb = nl.ndarray((p, Dv), dtype=nl.float32, buffer=nl.sbuf)
                        nisa.memset(dst=zero_sb, value=0.0)
                        pred_sb = nl.ndarray((p, Dv), dtype=nl.uint8, buffer=nl.sbuf)
                        nisa.tensor_scalar(dst=pred_sb, data=zero_sb, op0=nl.add, operand0=seen_sb)
                        nisa.tensor_copy_predicated(dst=res_sb, src=zero_sb, predicate=pred_sb)
                        nisa.tensor_copy(dst=out_sb, src=res_sb)
                    else:
                        nisa.tensor_scalar(dst=out_sb, data=o_sb, op0=nl.multiply, operand0=inv_sb)
                    nisa.dma_copy(dst=out_hbm[b, h, q0:q0 + p, 0:Dv], src=out_sb)
                    if with_lse:  # m + log(l): -FLT_MAX + log(0) = -inf for rows that saw no finite score
                        lse_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
                        nisa.activation(dst=lse_sb, op=nl.log, data=l_sb)
                        nisa.tensor_tensor(dst=lse_sb, data1=lse_sb, data2=m_sb, op=nl.add)
                        nisa.dma_copy(dst=lse_hbm[b, h, q0:q0 + p], src=lse_sb)
    return (out_hbm, lse_hbm) if with_lse else out_hbm


def window_start(window, q0, off, k_end):
    """The first key the tile's first row q0 sees under a window W (0: none), at most k_end."""
    return min(k_end, max(0, q0 + off + 1 - window)) if window > 0 else 0


def window_edge(window, q0, p, k0, off):
    """affine_select's offset where the window's start crosses the tile from key k0 (the last row q0+p-1 misses
    key k0), else None: key k0+j is visible to row q0+r iff (k0 - q0 - off + W - 1) - r + j >= 0."""
    if window > 0 and k0 <= q0 + p - 1 + off - window:
        return k0 - q0 - off + window - 1
    return None


def _scores(s_sb, s_psum, scale, softcap):
    """s = scale * (q @ k^T) evicted from PSUM on ScalarE; with a soft cap c, s = c * tanh(scale / c * (q @ k^T))."""
    if softcap > 0:
        nisa.activation(dst=s_sb, op=nl.tanh, data=s_psum, scale=float(scale) / softcap)
        nisa.tensor_scalar(dst=s_sb, data=s_sb, op0=nl.multiply, operand0=float(softcap))
    else:
        nisa.activation(dst=s_sb, op=nl.copy, data=s_psum, scale=float(scale))


def declines(q, k, v, causal, scale, softcap=None, sliding_window=None):
    """Why the kernels cannot take these head dims (the backward's too), else None."""
    if q.shape[3] > D_MAX:
        return f"head dim {q.shape[3]} > {D_MAX}: q @ k^T contracts over the 128 partitions"
    if v.shape[3] > DV_MAX:
        return f"value dim {v.shape[3]} > {DV_MAX}: the P @ V accumulator is one 2 KiB PSUM bank of float32"
    return None


@impl(spec, "neuron", supports=declines)
def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool, scale, softcap=None,
              sliding_window=None) -> np.ndarray:
    """Host side: contiguous inputs, the default scale, and exact row cuts when v is not all finite under a causal mask."""
    b, hq, sq, d = q.shape
    out_shape = (b, hq, sq, v.shape[3])
    if math.prod(out_shape) == 0:
        return np.empty(out_shape, q.dtype)
    if k.shape[2] == 0:  # no keys: every row sees nothing and is 0 by definition
        return np.zeros(out_shape, np_dtype(q.dtype.name))
    s = 1.0 / math.sqrt(d) if scale is None else float(scale)
    # masked keys must add exactly nothing; with inf/NaN in v only an exact per-row key range guarantees that
    q_rows = 1 if causal and not np.isfinite(v).all() else Q_ROWS
    args = (_host.contiguous(q), _host.contiguous(k), _host.contiguous(v), bool(causal), s, q_rows,
            *cap_window(softcap, sliding_window))
    return _host.as_dtype(_host.run(_attention_kernel, *args), q.dtype.name, out_shape)


def cap_window(softcap, sliding_window) -> tuple:
    """The kernels' compile-time (softcap, window): 0.0 and 0 for none."""
    return (0.0 if softcap is None else float(softcap)), (0 if sliding_window is None else int(sliding_window))


@impl(spec.train_forward, "neuron", supports=declines)
def attention_forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool, scale, softcap=None,
                      sliding_window=None) -> tuple:
    """Host side of the training forward: as attention's, plus lse [B, Hq, Sq] (float32)."""
    b, hq, sq, d = q.shape
    out_shape = (b, hq, sq, v.shape[3])
    if math.prod(out_shape) == 0 or k.shape[2] == 0:  # no rows, or no keys: out 0 and lse -inf by definition
        return attention(q, k, v, causal, scale, softcap, sliding_window), np.full((b, hq, sq), -np.inf, np.float32)
    s = 1.0 / math.sqrt(d) if scale is None else float(scale)
    q_rows = 1 if causal and not np.isfinite(v).all() else Q_ROWS  # as the forward
    args = (_host.contiguous(q), _host.contiguous(k), _host.contiguous(v), bool(causal), s, q_rows,
            *cap_window(softcap, sliding_window))
    out, lse = _host.run(_attention_forward_kernel, *args)
    return _host.as_dtype(out, q.dtype.name, out_shape), _host.as_dtype(lse, "float32", (b, hq, sq))

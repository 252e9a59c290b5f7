"""paged_attention on NKI: per (sequence, KV head), the visited cache rows gathered by block-table indirection."""

from __future__ import annotations

import math

import numpy as np

from opport.arraymath import visible
from opport.backends.neuron import _host
from opport.backends.neuron._softmax_steps import inverse_sum, online_step, running_state
from opport.backends.neuron._tiles import spans
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.dispatch import impl
from opport.ops.paged_attention import paged_attention as spec

KP = 128  # positions per tile: the P @ V contraction and the k transpose run over the 128 partitions
D_MAX = 128  # head dim: q @ k^T contracts over the partitions
DV_MAX = 512  # value dim: the P @ V accumulator is one 2 KiB PSUM bank of float32
G_MAX = 128  # query heads per KV head: the rows of the score tile, on the partitions


def _gather_rows(dst_sb, cache_hbm, ids_sb, jj, a, e, bs, h, row, width):
    """dst_sb[0:e-a] = cache[block ids_sb[jj], a % bs .. (e-1) % bs, h, 0:width]: one DMA whose source block is
    read from the table tile (vector_offset), so only this block's rows move."""
    src = cache_hbm.ap([[bs * row, 1], [row, e - a], [1, width]], offset=(a % bs) * row + h * width,
                       vector_offset=ids_sb[jj:jj + 1, 0:1], indirect_dim=0)
    nisa.dma_copy(dst=dst_sb, src=src)


@nki.jit
def _paged_attention_kernel(q_hbm, kc_hbm, vc_hbm, bt_hbm, lens, window, scale, softcap):
    """Decode attention over a paged KV cache: one query token per sequence, GQA heads as the tile's rows.

    Dimensions:
        B: sequences; Hq / Hkv: query / KV heads, G = Hq / Hkv <= 128 rows per tile; D <= 128; Dv <= 512;
        positions in tiles of 128 (the partitions of the gathered k and v).

    Args:
        q_hbm: [B, Hq, D]; kc_hbm: [num_blocks, bs, Hkv, D]; vc_hbm: [num_blocks, bs, Hkv, Dv] (q's dtype);
        bt_hbm: [B * max_blocks, 1] int32, the block tables as one column (an entry per partition when loaded).
        lens: compile-time tuple of context lengths (NKI loop bounds and DMA sizes are static: one compiled
        kernel per set of lengths); window: compile-time W or None; scale, softcap: compile-time floats (None: no cap).

    Returns:
        out_hbm: [B, Hq, Dv] in q's dtype; 0 for a sequence of length 0.

    Notes:
        Memory traffic: per (sequence, KV head), the block ids its visible positions use are DMA'd from the
        table onto partitions; each block's visible rows then come from HBM in one DMA whose source block is
        that id (`vector_offset`), k and v alike. Positions outside [max(0, len - W), len) are never read, so
        the bytes moved are the visited rows plus q, the table entries and out; NaN in unseen slots cannot
        reach the output. k is transposed on TensorE (D on the partitions) for s = q k^T; ScalarE scales (and
        caps: c tanh(s / c)) while evicting PSUM; the online softmax keeps float32 statistics; p and v are
        float32 for P @ V (v widened on VectorE), so 16-bit outputs carry one rounding.

    Pseudocode:
        for b, KV head h: ids = table[b, blocks of lo..len]
            for each 128 positions: k, v = cache[ids[pos // bs], pos % bs, h]; s = cap(scale * q k^T)
                m' = max(m, rowmax s); p = exp(s - m'); c = exp(m - m'); l = l c + rowsum p; o = o c + p v
            out = o / max(l, FLT_MIN)
    """
    B, Hq, D = q_hbm.shape
    _, bs, Hkv, _ = kc_hbm.shape
    Dv = vc_hbm.shape[3]
    G = Hq // Hkv
    max_blocks = bt_hbm.shape[0] // B
    out_hbm = nl.ndarray((B, Hq, Dv), dtype=q_hbm.dtype, buffer=nl.shared_hbm)
    for b in range(B):
        lo, hi = visible(lens[b], window)
        for h in range(Hkv):
            out_sb = nl.ndarray((G, Dv), dtype=q_hbm.dtype, buffer=nl.sbuf)
            if hi <= lo:
                nisa.memset(dst=out_sb, value=0.0)
            else:
                _one(out_sb, q_hbm, kc_hbm, vc_hbm, bt_hbm, b * max_blocks, b, h, G, D, Dv, bs, lo, hi, scale, softcap)
            nisa.dma_copy(dst=out_hbm[b, h * G:(h + 1) * G, 0:Dv], src=out_sb)
    return out_hbm


def gather_tile(kc_hbm, vc_hbm, bt_hbm, row0, t0, n, h):
    """(k [n, D], v [n, Dv]) in SBUF: KV head h's rows of positions t0 .. t0 + n - 1 of the sequence whose table
    starts at row row0 of bt_hbm; the table entries of those blocks first, then one DMA per block and cache."""
    _, bs, Hkv, D = kc_hbm.shape
    Dv = vc_hbm.shape[3]
    t1 = t0 + n
    j0, j1 = t0 // bs, (t1 - 1) // bs + 1
    ids_sb = nl.ndarray((j1 - j0, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=ids_sb, src=bt_hbm[row0 + j0:row0 + j1, 0:1])
    k_sb = nl.ndarray((n, D), dtype=kc_hbm.dtype, buffer=nl.sbuf)
    v_sb = nl.ndarray((n, Dv), dtype=vc_hbm.dtype, buffer=nl.sbuf)
    for j in range(j0, j1):
        a, e = max(t0, j * bs), min(t1, (j + 1) * bs)
        _gather_rows(k_sb[a - t0:e - t0, 0:D], kc_hbm, ids_sb, j - j0, a, e, bs, h, Hkv * D, D)
        _gather_rows(v_sb[a - t0:e - t0, 0:Dv], vc_hbm, ids_sb, j - j0, a, e, bs, h, Hkv * Dv, Dv)
    return k_sb, v_sb


def _one(out_sb, q_hbm, kc_hbm, vc_hbm, bt_hbm, row0, b, h, G, D, Dv, bs, lo, hi, scale, softcap):
    """out_sb [G, Dv] = attention of sequence b's KV head h over positions lo .. hi - 1."""
    q_sb = nl.ndarray((G, D), dtype=q_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=q_sb, src=q_hbm[b, h * G:(h + 1) * G, 0:D])
    qT_sb, o_sb, m_sb, l_sb = query_state(q_sb, Dv)
    for t0, n in spans(hi, KP, lo):
        k_sb, v_sb = gather_tile(kc_hbm, vc_hbm, bt_hbm, row0, t0, n, h)
        _tile(o_sb, m_sb, l_sb, qT_sb, k_sb, v_sb, G, n, D, Dv, scale, softcap)
    nisa.tensor_scalar(dst=out_sb, data=o_sb, op0=nl.multiply, operand0=inverse_sum(l_sb))


def query_state(q_sb, Dv):
    """(q^T [D, rows], o = 0 [rows, Dv], m, l) for query rows q [rows, D] in SBUF: an online softmax's start."""
    rows = q_sb.shape[0]
    o_sb = nl.ndarray((rows, Dv), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=o_sb, value=0.0)
    m_sb, l_sb = running_state(rows)
    return transposed(q_sb), o_sb, m_sb, l_sb


def _tile(o_sb, m_sb, l_sb, qT_sb, k_sb, v_sb, G, n, D, Dv, scale, softcap):
    """One tile of n positions of the online softmax, in place on o, m, l."""
    fold(o_sb, m_sb, l_sb, scores(qT_sb, transposed(k_sb), scale, softcap), widened_v(v_sb))


def transposed(x_sb):
    """x^T [D, n] in SBUF from x [n, D] (a TensorE transpose through PSUM): q's and k's, D on the partitions."""
    n, D = x_sb.shape
    xT_psum = nl.ndarray((D, n), dtype=x_sb.dtype, buffer=nl.psum)
    nisa.nc_transpose(dst=xT_psum, data=x_sb)
    xT_sb = nl.ndarray((D, n), dtype=x_sb.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=xT_sb, src=xT_psum)
    return xT_sb


def widened_v(v_sb):
    """v [n, Dv] as float32 (VectorE): P @ V runs on float32 p and v, so 16-bit outputs carry one rounding."""
    v32_sb = nl.ndarray(v_sb.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=v32_sb, src=v_sb)
    return v32_sb


def scores(qT_sb, kT_sb, scale, softcap):
    """s [rows, n] float32 = scale * q k^T (c * tanh(scale * q k^T / c) with a soft cap c), evicted by ScalarE."""
    rows, n = qT_sb.shape[1], kT_sb.shape[1]
    s_psum = nl.ndarray((rows, n), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=s_psum, stationary=qT_sb, moving=kT_sb)
    s_sb = nl.ndarray((rows, n), dtype=nl.float32, buffer=nl.sbuf)
    if softcap is None:
        nisa.activation(dst=s_sb, op=nl.copy, data=s_psum, scale=float(scale))
    else:  # c * tanh(scale * s / c)
        nisa.activation(dst=s_sb, op=nl.tanh, data=s_psum, scale=float(scale) / float(softcap))
        nisa.tensor_scalar(dst=s_sb, data=s_sb, op0=nl.multiply, operand0=float(softcap))
    return s_sb


def fold(o_sb, m_sb, l_sb, s_sb, v32_sb):
    """Folds scores s [rows, n] and their values v [n, Dv] (float32) into o, m, l: o = o corr + p v."""
    rows, n = s_sb.shape
    Dv = v32_sb.shape[1]
    m_new_sb, corr_sb, p_sb = online_step(m_sb, l_sb, s_sb)
    pT_psum = nl.ndarray((n, rows), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_transpose(dst=pT_psum, data=p_sb)
    pT_sb = nl.ndarray((n, rows), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=pT_sb, src=pT_psum)
    pv_psum = nl.ndarray((rows, Dv), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=pv_psum, stationary=pT_sb, moving=v32_sb)
    nisa.scalar_tensor_tensor(dst=o_sb, data=o_sb, op0=nl.multiply, operand0=corr_sb, op1=nl.add, operand1=pv_psum)
    nisa.tensor_copy(dst=m_sb, src=m_new_sb)


def _supports(q, k_cache, v_cache, block_tables, context_lens, scale, softcap, sliding_window):
    if q.shape[2] > D_MAX:
        return f"head dim {q.shape[2]} > {D_MAX}: q @ k^T contracts over the 128 partitions"
    if v_cache.shape[3] > DV_MAX:
        return f"value dim {v_cache.shape[3]} > {DV_MAX}: the P @ V accumulator is one 2 KiB PSUM bank of float32"
    if q.shape[1] // k_cache.shape[2] > G_MAX:
        return f"{q.shape[1] // k_cache.shape[2]} query heads per KV head > {G_MAX}: they are the tile's partitions"
    return None


@impl(spec, "neuron", supports=_supports)
def paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                    context_lens: np.ndarray, scale, softcap, sliding_window) -> np.ndarray:
    """Host side: contiguous inputs, the table as one int32 column, lengths and scalars as compile-time values."""
    bsz, hq, d = q.shape
    out_shape = (bsz, hq, v_cache.shape[3])
    if math.prod(out_shape) == 0:
        return np.empty(out_shape, q.dtype)
    s = 1.0 / math.sqrt(d) if scale is None else float(scale)
    lens = tuple(int(n) for n in context_lens)
    table = np.ascontiguousarray(block_tables, dtype=np.int32).reshape(-1, 1)
    args = (_host.contiguous(q), _host.contiguous(k_cache), _host.contiguous(v_cache), table, lens,
            None if sliding_window is None else int(sliding_window), s, None if softcap is None else float(softcap))
    return _host.as_dtype(_host.run(_paged_attention_kernel, *args), q.dtype.name, out_shape)

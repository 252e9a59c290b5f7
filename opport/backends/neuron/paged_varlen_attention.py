"""paged_varlen_attention on NKI: per (sequence, KV head, tile of new tokens), the positions its tokens see gathered
by block-table indirection, once for all the query heads of the KV head. fp8 caches as paged_attention's."""

from __future__ import annotations

import math

import numpy as np

from opport.arraymath import gather, paged_spans
from opport.backends.neuron import _host
from opport.backends.neuron._softmax_steps import inverse_sum
from opport.backends.neuron._tiles import spans
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.backends.neuron.paged_attention import (
    D_MAX,
    DV_MAX,
    KP,
    fold,
    gather_tile,
    kv_args,
    kv_scales,
    query_state,
    scores,
    transposed,
)
from opport.dispatch import impl
from opport.ops.paged_varlen_attention import paged_varlen_attention as spec

Q_ROWS = 128  # new tokens per tile: the partitions of the score tile


@nki.jit
def _paged_varlen_attention_kernel(q_hbm, kc_hbm, vc_hbm, bt_hbm, ks_hbm, vs_hbm, seqs, window, scale, softcap, fp8):
    """Attention of a mixed batch's new tokens over a paged KV cache (decodes and prefill chunks in one kernel).

    Dimensions:
        T: new tokens of all sequences; Hq / Hkv: query / KV heads, G = Hq / Hkv; D <= 128; Dv <= 512; new tokens
        in tiles of up to 128 rows (the partitions), positions in tiles of 128 (the gathered k and v).

    Args:
        q_hbm: [T, Hq, D]; kc_hbm: [num_blocks, bs, Hkv, D]; vc_hbm: [num_blocks, bs, Hkv, Dv] (q's dtype, or fp8
        codes: uint8 bytes for float8_e4m3fn before NeuronCore-v4);
        bt_hbm: [B * max_blocks, 1] int32, the block tables as one column.
        ks_hbm, vs_hbm: None, or the fp8 caches' float32 scales, [1] or [num_blocks, bs, Hkv].
        seqs: compile-time tuple of (first token in q, new tokens n, context length ctx, rows per tile) per
        sequence (NKI loop bounds and DMA sizes are static: one compiled kernel per batch composition); rows
        per tile is 128, or 1 where a value the sequence's tokens see is not finite (below).
        window: compile-time W or None; scale, softcap: compile-time floats (None: no cap).
        fp8: compile-time None (caches in q's dtype), "codes" (fp8 operands) or "bits" (e4m3fn bytes, decoded).

    Returns:
        out_hbm: [T, Hq, Dv] in q's dtype.

    Notes:
        Token i of a sequence sits at position p = ctx - n + i and sees positions (p - W, p]. Per (sequence,
        KV head, token tile) the positions from the first row's window start to the last row's position are
        gathered 128 at a time (block ids from the table, then one DMA per block by `vector_offset`, as
        paged_attention), k transposed and v widened once for the G query heads; per query head the scores
        are masked by GpSimd affine_select, -inf where a key is after the row's position (only on tiles the
        diagonal crosses) or before its window (only on tiles the window's start crosses), and folded into
        that head's online softmax. A masked key's weight is exactly 0, but TensorE computes 0 * inf = NaN in
        P @ V: a sequence whose visible values hold inf or NaN runs one row per tile, whose gathered
        positions are exactly the row's own (no mask at all). fp8 caches: each gathered tile is dequantised once
        for the G heads (code * scale in float32 on VectorE, the scales gathered with the rows per token or
        broadcast once per tensor: paged_attention's `gather_tile`), and q^T is float32.

    Pseudocode:
        for b, KV head h, token tile rows: for each 128 positions: k, v = cache[table[b, pos // bs], pos % bs, h]
            for each query head g of h: s = mask(cap(scale * q_g k^T)); online softmax into o_g
        out = o_g / l_g
    """
    T, Hq, D = q_hbm.shape
    _, bs, Hkv, _ = kc_hbm.shape
    Dv = vc_hbm.shape[3]
    G = Hq // Hkv
    max_blocks = bt_hbm.shape[0] // len(seqs)
    out_hbm = nl.ndarray((T, Hq, Dv), dtype=q_hbm.dtype, buffer=nl.shared_hbm)
    kv = kv_scales(ks_hbm, vs_hbm, fp8)
    for b in range(len(seqs)):
        t_first, n_new, ctx, q_rows = seqs[b]
        for h in range(Hkv):
            for i0, p in spans(n_new, q_rows):
                first = ctx - n_new + i0  # the tile's first token's position
                lo = 0 if window is None else max(0, first + 1 - window)
                heads = []
                for g in range(G):
                    heads.append(_head_state(q_hbm, t_first + i0, p, h * G + g, Dv, kv))
                for k0, n in spans(first + p, KP, lo):
                    k_sb, v32_sb = gather_tile(kc_hbm, vc_hbm, bt_hbm, kv, b * max_blocks, k0, n, h, heads[0][0].dtype)
                    kT_sb = transposed(k_sb)
                    for g in range(G):
                        qT_sb, o_sb, m_sb, l_sb = heads[g]
                        s_sb = scores(qT_sb, kT_sb, scale, softcap)
                        _mask(s_sb, first, k0, p, n, window)
                        fold(o_sb, m_sb, l_sb, s_sb, v32_sb)
                for g in range(G):
                    _, o_sb, _, l_sb = heads[g]
                    out_sb = nl.ndarray((p, Dv), dtype=q_hbm.dtype, buffer=nl.sbuf)
                    nisa.tensor_scalar(dst=out_sb, data=o_sb, op0=nl.multiply, operand0=inverse_sum(l_sb))
                    nisa.dma_copy(dst=out_hbm[t_first + i0:t_first + i0 + p, h * G + g, 0:Dv], src=out_sb)
    return out_hbm


def _head_state(q_hbm, t0, p, head, Dv, kv):
    """query_state of tokens t0 .. t0 + p - 1 of one query head: (q^T [D, p], o, m, l)."""
    D = q_hbm.shape[2]
    q_sb = nl.ndarray((p, D), dtype=q_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=q_sb, src=q_hbm[t0:t0 + p, head, 0:D])
    return query_state(q_sb, Dv, kv)


def _mask(s_sb, first, k0, p, n, window):
    """-inf where key k0 + j is after row i's position first + i, or (with a window W) at or before first + i - W."""
    if k0 + n - 1 > first:  # the diagonal crosses this tile: keep (first - k0) + i - j >= 0
        nisa.affine_select(dst=s_sb, pattern=[[-1, n]], channel_multiplier=1, on_true_tile=s_sb,
                           on_false_value=-math.inf, cmp_op=nl.greater_equal, offset=first - k0)
    if window is not None and k0 <= first + p - 1 - window:  # the last row misses key k0: keep (k0 - first + W - 1) - i + j >= 0
        nisa.affine_select(dst=s_sb, pattern=[[1, n]], channel_multiplier=-1, on_true_tile=s_sb,
                           on_false_value=-math.inf, cmp_op=nl.greater_equal, offset=k0 - first + window - 1)


def _supports(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, softcap, sliding_window,
              k_scale=None, v_scale=None):
    """paged_attention's head-size limits; its group limit does not apply (the rows of a tile are tokens)."""
    if q.shape[2] > D_MAX:
        return f"head dim {q.shape[2]} > {D_MAX}: q @ k^T contracts over the 128 partitions"
    if v_cache.shape[3] > DV_MAX:
        return f"value dim {v_cache.shape[3]} > {DV_MAX}: the P @ V accumulator is one 2 KiB PSUM bank of float32"
    return None


@impl(spec, "neuron", supports=_supports)
def paged_varlen_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                           cu_seqlens_q: np.ndarray, context_lens: np.ndarray, scale, softcap,
                           sliding_window, k_scale=None, v_scale=None) -> np.ndarray:
    """Host side: contiguous inputs, the table as one int32 column, per sequence (first token, new tokens, context,
    rows per tile) and the scalars as compile-time values; fp8 caches as paged_attention's (`kv_args`), their
    values (code * scale) checked for the one-row variant."""
    t, hq, d = q.shape
    out_shape = (t, hq, v_cache.shape[3])
    if math.prod(out_shape) == 0:
        return np.empty(out_shape, q.dtype)
    seqs = []
    for b, (ts, lo, ctx) in enumerate(paged_spans(cu_seqlens_q, context_lens, sliding_window)):
        finite = np.isfinite(_values(v_cache, v_scale, block_tables[b], lo, ctx)).all()
        seqs.append((ts.start, ts.stop - ts.start, ctx, Q_ROWS if finite else 1))
    s = 1.0 / math.sqrt(d) if scale is None else float(scale)
    table = np.ascontiguousarray(block_tables, dtype=np.int32).reshape(-1, 1)
    kc, vc, ks, vs, fp8 = kv_args(k_cache, v_cache, k_scale, v_scale)
    args = (_host.contiguous(q), kc, vc, table, ks, vs, tuple(seqs),
            None if sliding_window is None else int(sliding_window), s, None if softcap is None else float(softcap), fp8)
    return _host.as_dtype(_host.run(_paged_varlen_attention_kernel, *args), q.dtype.name, out_shape)


def _values(cache, scale, table, lo: int, hi: int) -> np.ndarray:
    """Positions lo .. hi - 1 of one sequence as the kernel reads them: the rows, times their float32 scales
    (per tensor or per token and head) for an fp8 cache, in float32 as the kernel computes them."""
    rows = gather(cache, table, lo, hi)
    if scale is None:
        return rows
    s = np.asarray(scale, np.float32)
    s = gather(s, table, lo, hi)[..., None] if s.size > 1 else s.reshape(())
    with np.errstate(over="ignore", invalid="ignore"):
        return rows.astype(np.float32) * s

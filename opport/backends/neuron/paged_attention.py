"""paged_attention on NKI: per (sequence, KV head), the visited cache rows gathered by block-table indirection.

fp8 caches (float8_e4m3fn / float8_e5m2 codes with float32 scales, per tensor [1] or per token and head
[num_blocks, block_size, Hkv]) are gathered as codes, with their scale rows, and dequantised on chip to float32.
float8_e5m2 is an operand on every generation; float8_e4m3fn only on NeuronCore-v4 (trn3: neuronx-cc refuses
F8E4M3FN operands on trn1 / trn2, NCC_EVRF051, quantize_fp8.py), so there the host hands the codes over as uint8
bytes and VectorE decodes their bits (`e4m3fn_bits`).
"""

from __future__ import annotations

import math

import numpy as np

from opport.arraymath import visible
from opport.backends.neuron import _host
from opport.backends.neuron._softmax_steps import inverse_sum, online_step, running_state
from opport.backends.neuron._tiles import load_row_broadcast, spans
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.backends.neuron.quantize_fp8 import target_version
from opport.dispatch import impl
from opport.ops.paged_attention import paged_attention as spec

KP = 128  # positions per tile: the P @ V contraction and the k transpose run over the 128 partitions
D_MAX = 128  # head dim: q @ k^T contracts over the partitions
DV_MAX = 512  # value dim: the P @ V accumulator is one 2 KiB PSUM bank of float32
G_MAX = 128  # query heads per KV head: the rows of the score tile, on the partitions
E4M3FN_SCALE = 2.0 ** 120  # e4m3fn bits placed in a float32's exponent and mantissa read 2^-120 times the code
E4M3FN_NAN_BITS = 0x7F << 20  # the e4m3fn NaN code (0x7F / 0xFF) in that placement


def _gather_rows(dst_sb, cache_hbm, ids_sb, jj, a, e, bs, h, row, width):
    """dst_sb[0:e-a] = cache[block ids_sb[jj], a % bs .. (e-1) % bs, h, 0:width]: one DMA whose source block is
    read from the table tile (vector_offset), so only this block's rows move."""
    src = cache_hbm.ap([[bs * row, 1], [row, e - a], [1, width]], offset=(a % bs) * row + h * width,
                       vector_offset=ids_sb[jj:jj + 1, 0:1], indirect_dim=0)
    nisa.dma_copy(dst=dst_sb, src=src)


@nki.jit
def _paged_attention_kernel(q_hbm, kc_hbm, vc_hbm, bt_hbm, ks_hbm, vs_hbm, lens, window, scale, softcap, fp8):
    """Decode attention over a paged KV cache: one query token per sequence, GQA heads as the tile's rows.

    Dimensions:
        B: sequences; Hq / Hkv: query / KV heads, G = Hq / Hkv <= 128 rows per tile; D <= 128; Dv <= 512;
        positions in tiles of 128 (the partitions of the gathered k and v).

    Args:
        q_hbm: [B, Hq, D]; kc_hbm: [num_blocks, bs, Hkv, D]; vc_hbm: [num_blocks, bs, Hkv, Dv] (q's dtype, or fp8
        codes: uint8 bytes for float8_e4m3fn before NeuronCore-v4);
        bt_hbm: [B * max_blocks, 1] int32, the block tables as one column (an entry per partition when loaded).
        ks_hbm, vs_hbm: None, or the fp8 caches' float32 scales, [1] or [num_blocks, bs, Hkv].
        lens: compile-time tuple of context lengths (NKI loop bounds and DMA sizes are static: one compiled
        kernel per set of lengths); window: compile-time W or None; scale, softcap: compile-time floats (None: no cap);
        fp8: compile-time None (caches in q's dtype), "codes" (fp8 operands) or "bits" (e4m3fn bytes, decoded).

    Returns:
        out_hbm: [B, Hq, Dv] in q's dtype; 0 for a sequence of length 0.

    Notes:
        Memory traffic: per (sequence, KV head), the block ids its visible positions use are DMA'd from the
        table onto partitions; each block's visible rows then come from HBM in one DMA whose source block is
        that id (`vector_offset`), k and v alike. Positions outside [max(0, len - W), len) are never read, so
        the bytes moved are the visited rows plus q, the table entries and out; NaN in unseen slots cannot
        reach the output. k is transposed on TensorE (D on the partitions) for s = q k^T; ScalarE scales (and
        caps: c tanh(s / c)) while evicting PSUM; the online softmax keeps float32 statistics; p and v are
        float32 for P @ V (v widened on VectorE), so 16-bit outputs carry one rounding. fp8 caches: per-token
        scale rows come with each block's rows (one more DMA per block and cache, 4 bytes a position), a per-tensor
        scale is broadcast to the partitions once (`kv_scales`); k and v are dequantised on VectorE as
        code * scale in float32 (one instruction each, the scale a [P, 1] operand: positions are on the
        partitions), and q is widened to float32 for q k^T (float32 with float32 on TensorE).

    Pseudocode:
        for b, KV head h: ids = table[b, blocks of lo..len]
            for each 128 positions: k, v = cache[ids[pos // bs], pos % bs, h] (* scale[ids[pos // bs], pos % bs, h]
                for fp8); s = cap(scale * q k^T)
                m' = max(m, rowmax s); p = exp(s - m'); c = exp(m - m'); l = l c + rowsum p; o = o c + p v
            out = o / max(l, FLT_MIN)
    """
    B, Hq, D = q_hbm.shape
    _, bs, Hkv, _ = kc_hbm.shape
    Dv = vc_hbm.shape[3]
    G = Hq // Hkv
    max_blocks = bt_hbm.shape[0] // B
    out_hbm = nl.ndarray((B, Hq, Dv), dtype=q_hbm.dtype, buffer=nl.shared_hbm)
    kv = kv_scales(ks_hbm, vs_hbm, fp8)
    for b in range(B):
        lo, hi = visible(lens[b], window)
        for h in range(Hkv):
            out_sb = nl.ndarray((G, Dv), dtype=q_hbm.dtype, buffer=nl.sbuf)
            if hi <= lo:
                nisa.memset(dst=out_sb, value=0.0)
            else:
                _one(out_sb, q_hbm, kc_hbm, vc_hbm, bt_hbm, kv, b * max_blocks, b, h, G, Dv, lo, hi, scale, softcap)
            nisa.dma_copy(dst=out_hbm[b, h * G:(h + 1) * G, 0:Dv], src=out_sb)
    return out_hbm


def kv_scales(ks_hbm, vs_hbm, fp8):
    """The fp8 dequantisation state shared by a kernel's tiles: None for caches in q's dtype, else
    (ks_hbm, vs_hbm, k_sb, v_sb, bits, per_token) with a per-tensor scale broadcast to [128, 1] float32 tiles once
    (`load_row_broadcast`: one DMA and a K = 1 matmul, exact), None there for per-token scales (gathered per tile)."""
    if fp8 == None:  # noqa: E711 (NKI kernels compare with None by value)
        return None
    PMAX = nl.tile_size.pmax
    k_sb, v_sb = None, None
    per_token = len(ks_hbm.shape) == 3
    if not per_token:
        k_sb = nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        load_row_broadcast(k_sb, ks_hbm, 0, 1, PMAX)
        v_sb = nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        load_row_broadcast(v_sb, vs_hbm, 0, 1, PMAX)
    return ks_hbm, vs_hbm, k_sb, v_sb, fp8 == "bits", per_token


def gather_tile(kc_hbm, vc_hbm, bt_hbm, kv, row0, t0, n, h, k_dtype):
    """(k [n, D] in k_dtype, v [n, Dv] float32) in SBUF: KV head h's rows of positions t0 .. t0 + n - 1 of the
    sequence whose table starts at row row0 of bt_hbm; the table entries of those blocks first, then one DMA per
    block and cache (and per block and scale array for per-token fp8 scales). Caches in q's dtype: k as stored
    (k_dtype is q's), v widened; fp8 (kv from `kv_scales`): both dequantised, code * scale (`dequantised`)."""
    _, bs, Hkv, D = kc_hbm.shape
    Dv = vc_hbm.shape[3]
    t1 = t0 + n
    j0, j1 = t0 // bs, (t1 - 1) // bs + 1
    ids_sb = nl.ndarray((j1 - j0, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=ids_sb, src=bt_hbm[row0 + j0:row0 + j1, 0:1])
    k_sb = nl.ndarray((n, D), dtype=kc_hbm.dtype, buffer=nl.sbuf)
    v_sb = nl.ndarray((n, Dv), dtype=vc_hbm.dtype, buffer=nl.sbuf)
    per_token = kv != None and kv[5]  # noqa: E711 (NKI kernels compare with None by value)
    if per_token:
        ks_sb = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.sbuf)
        vs_sb = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.sbuf)
    for j in range(j0, j1):
        a, e = max(t0, j * bs), min(t1, (j + 1) * bs)
        _gather_rows(k_sb[a - t0:e - t0, 0:D], kc_hbm, ids_sb, j - j0, a, e, bs, h, Hkv * D, D)
        _gather_rows(v_sb[a - t0:e - t0, 0:Dv], vc_hbm, ids_sb, j - j0, a, e, bs, h, Hkv * Dv, Dv)
        if per_token:
            _gather_rows(ks_sb[a - t0:e - t0, 0:1], kv[0], ids_sb, j - j0, a, e, bs, h, Hkv, 1)
            _gather_rows(vs_sb[a - t0:e - t0, 0:1], kv[1], ids_sb, j - j0, a, e, bs, h, Hkv, 1)
    if kv == None:  # noqa: E711 (NKI kernels compare with None by value)
        return k_sb, widened_v(v_sb)
    if not per_token:
        ks_sb, vs_sb = kv[2][0:n, 0:1], kv[3][0:n, 0:1]
    return dequantised(k_sb, ks_sb, k_dtype, kv[4]), dequantised(v_sb, vs_sb, nl.float32, kv[4])


def dequantised(codes_sb, s_sb, dtype, bits):
    """codes [n, f] * s [n, 1] in dtype: one VectorE tensor_scalar (float32 math, the fp8 codes widened exactly);
    e4m3fn bytes (bits) are decoded first (`e4m3fn_bits`), their 2^120 folded into the same instruction, and
    NaN codes set after it."""
    out_sb = nl.ndarray(codes_sb.shape, dtype=dtype, buffer=nl.sbuf)
    if bits:
        x_sb, nan_sb = e4m3fn_bits(codes_sb)
        nisa.tensor_scalar(dst=out_sb, data=x_sb, op0=nl.multiply, operand0=E4M3FN_SCALE, op1=nl.multiply,
                           operand1=s_sb)
        nisa.tensor_copy_predicated(dst=out_sb, src=float("nan"), predicate=nan_sb)
    else:
        nisa.tensor_scalar(dst=out_sb, data=codes_sb, op0=nl.multiply, operand0=s_sb)
    return out_sb


def e4m3fn_bits(b_sb):
    """(x [n, f] float32, nan [n, f] uint8) for float8_e4m3fn codes given as uint8 bytes b [n, f], for
    NeuronCore-v2/v3, which have no e4m3fn operands: the 7 magnitude bits shifted to a float32's exponent and
    mantissa (bits 20-26) and the sign to bit 31 (integer VectorE ops on uint32) make x = code * 2^-120 exactly,
    for normal codes (2^(e-7) (1 + m/8)) and subnormal ones (m 2^-9, a float32 subnormal); nan marks the NaN
    code (0x7F), which x does not represent. 5 instructions, then `dequantised`'s multiply and NaN copy."""
    n, f = b_sb.shape
    w_sb = nl.ndarray((n, f), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=w_sb, src=b_sb)
    mag_sb = nl.ndarray((n, f), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=mag_sb, data=w_sb, op0=nl.bitwise_and, operand0=0x7F, op1=nl.left_shift, operand1=20)
    sign_sb = nl.ndarray((n, f), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=sign_sb, data=w_sb, op0=nl.bitwise_and, operand0=0x80, op1=nl.left_shift, operand1=24)
    bits_sb = nl.ndarray((n, f), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=bits_sb, data1=mag_sb, data2=sign_sb, op=nl.bitwise_or)
    nan_sb = nl.ndarray((n, f), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=nan_sb, data=mag_sb, op0=nl.equal, operand0=float(E4M3FN_NAN_BITS))
    return bits_sb.view(nl.float32), nan_sb


def _one(out_sb, q_hbm, kc_hbm, vc_hbm, bt_hbm, kv, row0, b, h, G, Dv, lo, hi, scale, softcap):
    """out_sb [G, Dv] = attention of sequence b's KV head h over positions lo .. hi - 1."""
    D = q_hbm.shape[2]
    q_sb = nl.ndarray((G, D), dtype=q_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=q_sb, src=q_hbm[b, h * G:(h + 1) * G, 0:D])
    qT_sb, o_sb, m_sb, l_sb = query_state(q_sb, Dv, kv)
    for t0, n in spans(hi, KP, lo):
        k_sb, v32_sb = gather_tile(kc_hbm, vc_hbm, bt_hbm, kv, row0, t0, n, h, qT_sb.dtype)
        fold(o_sb, m_sb, l_sb, scores(qT_sb, transposed(k_sb), scale, softcap), v32_sb)
    nisa.tensor_scalar(dst=out_sb, data=o_sb, op0=nl.multiply, operand0=inverse_sum(l_sb))


def query_state(q_sb, Dv, kv):
    """(q^T [D, rows], o = 0 [rows, Dv], m, l) for query rows q [rows, D] in SBUF: an online softmax's start. With
    fp8 caches (kv not None) q^T is float32, as the dequantised k it meets on TensorE."""
    rows = q_sb.shape[0]
    o_sb = nl.ndarray((rows, Dv), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=o_sb, value=0.0)
    m_sb, l_sb = running_state(rows)
    if kv != None and q_sb.dtype != nl.float32:  # noqa: E711 (NKI kernels compare with None by value)
        q_sb = widened_v(q_sb)
    return transposed(q_sb), o_sb, m_sb, l_sb


def transposed(x_sb):
    """x^T [D, n] in SBUF from x [n, D] (a TensorE transpose through PSUM): q's and k's, D on the partitions."""
    n, D = x_sb.shape
    xT_psum = nl.ndarray((D, n), dtype=x_sb.dtype, buffer=nl.psum)
    nisa.nc_transpose(dst=xT_psum, data=x_sb)
    xT_sb = nl.ndarray((D, n), dtype=x_sb.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=xT_sb, src=xT_psum)
    return xT_sb


def widened_v(v_sb):
    """v [n, Dv] as float32 (VectorE): P @ V runs on float32 p and v, so 16-bit outputs carry one rounding (also
    q's widening for fp8 caches)."""
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


def _supports(q, k_cache, v_cache, block_tables, context_lens, scale, softcap, sliding_window, k_scale=None,
              v_scale=None):
    if q.shape[2] > D_MAX:
        return f"head dim {q.shape[2]} > {D_MAX}: q @ k^T contracts over the 128 partitions"
    if v_cache.shape[3] > DV_MAX:
        return f"value dim {v_cache.shape[3]} > {DV_MAX}: the P @ V accumulator is one 2 KiB PSUM bank of float32"
    if q.shape[1] // k_cache.shape[2] > G_MAX:
        return f"{q.shape[1] // k_cache.shape[2]} query heads per KV head > {G_MAX}: they are the tile's partitions"
    return None


@impl(spec, "neuron", supports=_supports)
def paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                    context_lens: np.ndarray, scale, softcap, sliding_window, k_scale=None,
                    v_scale=None) -> np.ndarray:
    """Host side: contiguous inputs, the table as one int32 column, lengths and scalars as compile-time values;
    fp8 caches with their scales (`kv_args`)."""
    bsz, hq, d = q.shape
    out_shape = (bsz, hq, v_cache.shape[3])
    if math.prod(out_shape) == 0:
        return np.empty(out_shape, q.dtype)
    s = 1.0 / math.sqrt(d) if scale is None else float(scale)
    lens = tuple(int(n) for n in context_lens)
    table = np.ascontiguousarray(block_tables, dtype=np.int32).reshape(-1, 1)
    kc, vc, ks, vs, fp8 = kv_args(k_cache, v_cache, k_scale, v_scale)
    args = (_host.contiguous(q), kc, vc, table, ks, vs, lens,
            None if sliding_window is None else int(sliding_window), s, None if softcap is None else float(softcap), fp8)
    return _host.as_dtype(_host.run(_paged_attention_kernel, *args), q.dtype.name, out_shape)


def kv_args(k_cache, v_cache, k_scale, v_scale):
    """(k_cache, v_cache, k_scale, v_scale, fp8) as the kernels take them: contiguous caches; for fp8 caches
    float32 scales ([1] or [num_blocks, bs, Hkv]) and the mode, "codes", or "bits" with the caches as their uint8
    bytes (a view, no copy) for float8_e4m3fn before NeuronCore-v4."""
    kc, vc = _host.contiguous(k_cache), _host.contiguous(v_cache)
    if k_scale is None:
        return kc, vc, None, None, None
    ks = _host.contiguous(np.asarray(k_scale, np.float32))
    vs = _host.contiguous(np.asarray(v_scale, np.float32))
    if ks.size == 1:
        ks, vs = ks.reshape(1), vs.reshape(1)
    if kc.dtype.name == "float8_e4m3fn" and target_version() < 4:
        return kc.view(np.uint8), vc.view(np.uint8), ks, vs, "bits"
    return kc, vc, ks, vs, "codes"

"""scaled_matmul on NKI: fp8 operands straight into TensorE (nc_matmul), float32 PSUM sums per K group, scales
applied on VectorE as each group's sum is evicted.

float8_e4m3fn is a matmul input from NeuronCore-v4 (trn3) only: on trn1/trn2 `supports()` declines it with
quantize_fp8's reason (Neuron's own float8_e4m3 is another format). float8_e5m2 runs on every generation.
"""

from __future__ import annotations

import math

import numpy as np

from opport.arraymath import BLOCK
from opport.backends.neuron import _host
from opport.backends.neuron._tiles import cdiv, spans
from opport.backends.neuron.matmul import TILE_K, TILE_M, TILE_N, _transposed_row_tile
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.backends.neuron.quantize_fp8 import fp8_unsupported
from opport.dispatch import impl
from opport.ops.scaled_matmul import scaled_matmul as spec


@nki.jit
def _scaled_matmul_kernel(a_hbm, b_hbm, sa_hbm, sb_hbm, bias_hbm, out_dtype):
    """out = sum over K groups g of (a[:, g] @ b[g, :]) * sa[:, g] * sb[g, :] (+ bias), rounded once to out_dtype.

    Dimensions:
        M: rows (tiles of 128: the stationary free dim, then the output partitions); K: contraction (tiles of 128
        on the partitions), in G groups of K / G (128 for block scales, all of K otherwise); N: columns (tiles of
        512, one PSUM bank of float32).

    Args:
        a_hbm: [1, M, K] fp8; b_hbm: [K, N] fp8 (the same format); sa_hbm: [M, G] float32 (per tensor or per row:
        the host repeats the value); sb_hbm: [G, N] float32, one scale per column (the host expands per-tensor
        and 128-column block scales); bias_hbm: [1, N] in out_dtype, or None; out_dtype: the nl dtype of the output.

    Returns:
        out_hbm: [M, N] in out_dtype.

    Notes:
        fp8 products are exact and PSUM sums them in float32. Each [128, 128] block of a is transposed on
        TensorE (nc_transpose, bit-exact, fp8 in and out) into the stationary aT tiles of a row tile; each
        [128, 512] tile of b is DMA'd and multiplied. A group's PSUM sum is evicted by one VectorE
        scalar_tensor_tensor, (sum * sa[row]) * sb[col] with sb's row replicated across the partitions by a
        K = 1 matmul (exact), and added to a float32 SBUF accumulator; the last step adds the bias and casts.
        b is read once per row tile (no row blocking as in matmul's kernel: a known performance gap).

    Pseudocode:
        for each row tile m, column tile n: acc = 0
            for each group g: p = sum_{k in g} aT[m, k].T @ b[k, n]; acc += p * sa[m, g] * sb[g, n]
            out[m, n] = acc + bias[n]
    """
    M, K = a_hbm.shape[1], a_hbm.shape[2]
    N = b_hbm.shape[1]
    G = sa_hbm.shape[1]
    out_hbm = nl.ndarray((M, N), dtype=out_dtype, buffer=nl.shared_hbm)
    n_k = cdiv(K, TILE_K)
    for m0, mt in spans(M, TILE_M):
        aT_tiles = _transposed_row_tile(a_hbm, 0, m0, mt, n_k)
        sa_sb = nl.ndarray((mt, G), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=sa_sb, src=sa_hbm[m0:m0 + mt, 0:G])
        for n0, nt in spans(N, TILE_N):
            _output_tile(b_hbm, sb_hbm, bias_hbm, out_hbm, aT_tiles, sa_sb, m0, mt, n0, nt)
    return out_hbm


def _output_tile(b_hbm, sb_hbm, bias_hbm, out_hbm, aT_tiles, sa_sb, m0, mt, n0, nt):
    """out[m0:m0+mt, n0:n0+nt]: the K groups' PSUM sums, each scaled into the float32 accumulator, then the bias."""
    K = b_hbm.shape[0]
    G = sb_hbm.shape[0]
    tiles_per_group = len(aT_tiles) // G
    acc_sb = nl.ndarray((mt, nt), dtype=nl.float32, buffer=nl.sbuf)
    for g in range(G):
        part_psum = nl.ndarray((mt, nt), dtype=nl.float32, buffer=nl.psum)
        for k in range(g * tiles_per_group, (g + 1) * tiles_per_group):
            k0, kt = spans(K, TILE_K)[k]
            b_sb = nl.ndarray((kt, nt), dtype=b_hbm.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=b_sb, src=b_hbm[k0:k0 + kt, n0:n0 + nt])
            nisa.nc_matmul(dst=part_psum, stationary=aT_tiles[k], moving=b_sb)
        sbcast_sb = nl.ndarray((mt, nt), dtype=nl.float32, buffer=nl.sbuf)
        _row_broadcast(sbcast_sb, sb_hbm, g, n0, nt, mt)
        if g == 0:
            nisa.scalar_tensor_tensor(dst=acc_sb, data=part_psum, op0=nl.multiply, operand0=sa_sb[0:mt, g:g + 1],
                                      op1=nl.multiply, operand1=sbcast_sb)
        else:
            scaled_sb = nl.ndarray((mt, nt), dtype=nl.float32, buffer=nl.sbuf)
            nisa.scalar_tensor_tensor(dst=scaled_sb, data=part_psum, op0=nl.multiply, operand0=sa_sb[0:mt, g:g + 1],
                                      op1=nl.multiply, operand1=sbcast_sb)
            nisa.tensor_tensor(dst=acc_sb, data1=acc_sb, data2=scaled_sb, op=nl.add)
    res_sb = nl.ndarray((mt, nt), dtype=out_hbm.dtype, buffer=nl.sbuf)
    if bias_hbm != None:  # noqa: E711 (NKI kernels compare with None by value)
        bias_row_sb = nl.ndarray((mt, nt), dtype=nl.float32, buffer=nl.sbuf)
        _row_broadcast(bias_row_sb, bias_hbm, 0, n0, nt, mt)
        nisa.tensor_tensor(dst=res_sb, data1=acc_sb, data2=bias_row_sb, op=nl.add)
    else:
        nisa.tensor_copy(dst=res_sb, src=acc_sb)
    nisa.dma_copy(dst=out_hbm[m0:m0 + mt, n0:n0 + nt], src=res_sb)


def _row_broadcast(dst_sb, rows_hbm, r, c0, f, p):
    """dst_sb[0:p, 0:f] (float32) = rows_hbm[r, c0:c0+f] on every partition: one DMA of the row, then a K = 1
    matmul (ones[1, p]^T @ row through PSUM) replicates it exactly (x * 1.0, one term)."""
    row_sb = nl.ndarray((1, f), dtype=rows_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=row_sb, src=rows_hbm[r:r + 1, c0:c0 + f])
    ones_sb = nl.ndarray((1, p), dtype=rows_hbm.dtype, buffer=nl.sbuf)
    nisa.memset(dst=ones_sb, value=1.0)
    rep_psum = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=rep_psum, stationary=ones_sb, moving=row_sb)
    nisa.tensor_copy(dst=dst_sb, src=rep_psum)


def _supports(a_q, b_q, scale_a, scale_b, bias, out_dtype):
    return fp8_unsupported(a_q.dtype)


def _host_scales(scale_a, scale_b, rows: int, n: int) -> tuple:
    """sa [rows, G] and sb [G, N] float32, G the number of K groups (1, or K / 128 when either scale is per block):
    a scale that does not vary along K is repeated over the groups, sb expanded to one scale per column."""
    groups = max(scale_a.shape[-1], scale_b.shape[0])
    sa = np.broadcast_to(scale_a.reshape(-1, scale_a.shape[-1]), (rows, groups))
    sb = scale_b if scale_b.shape[1] in (1, n) else np.repeat(scale_b, BLOCK, axis=1)[:, :n]
    return np.ascontiguousarray(sa, np.float32), np.ascontiguousarray(np.broadcast_to(sb, (groups, n)), np.float32)


@impl(spec, "neuron", supports=_supports)
def scaled_matmul(a_q: np.ndarray, b_q: np.ndarray, scale_a: np.ndarray, scale_b: np.ndarray, bias, out_dtype: str):
    """Host side: a's batch dims fold into M; a and b contiguous (a copy only for a strided view); the scales
    expanded to [M, G] and [G, N] float32 (G = K / 128 with block scales, else 1: 1/32 of b's bytes at most)."""
    k, n = b_q.shape
    lead = tuple(a_q.shape[:-1])
    rows = math.prod(lead)
    if rows * n == 0:
        return np.empty((*lead, n), _host.np_dtype(out_dtype))
    if k == 0:  # an empty sum: zeros, plus the bias; there is nothing for TensorE to contract
        out = np.zeros((*lead, n), _host.np_dtype(out_dtype))
        return out if bias is None else (out + bias).astype(out.dtype)
    a3 = _host.contiguous(a_q).reshape(1, rows, k)
    sa, sb = _host_scales(scale_a, scale_b, rows, n)
    c = None if bias is None else _host.contiguous(bias).reshape(1, n)
    out = _host.run(_scaled_matmul_kernel, a3, _host.contiguous(b_q), sa, sb, c, getattr(nl, out_dtype))
    return _host.as_dtype(out, out_dtype, (*lead, n))

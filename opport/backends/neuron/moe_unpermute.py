"""moe_unpermute on NKI: the inverse permutation by an indirect DMA scatter, then tokens on the partitions gathering
their k rows of y by indirect DMA (one row index per partition)."""

from __future__ import annotations

import numpy as np

from opport.backends.neuron import _host
from opport.backends.neuron._tiles import spans
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.dispatch import impl
from opport.ops.moe_unpermute import moe_unpermute as spec

FMAX = 2048  # columns per chunk: a few [128, 2048] float32 tiles (8 KiB per partition each) stay far inside SBUF
MAX_ROWS = 2**31 - 1  # row indices travel as int32 (the indirect DMA's offsets)


def _inverse_rows(src_hbm, row_hbm):
    """row[source[r]] = r for every row r of y: per 128 rows, the row numbers from iota (one per partition) scattered
    by an indirect DMA whose destination offsets are the rows' slots. source is a permutation (checked on the host
    before the launch), so no two partitions write the same element."""
    TK = src_hbm.shape[0]
    for r0, p in spans(TK, nl.tile_size.pmax):
        slot_sb = nl.ndarray((p, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=slot_sb, src=src_hbm[r0:r0 + p, 0:1])
        rownum_sb = nl.ndarray((p, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.iota(dst=rownum_sb, pattern=[[0, 1]], offset=r0, channel_multiplier=1)
        nisa.dma_copy(dst=row_hbm.ap([[1, p], [1, 1]], offset=0, vector_offset=slot_sb, indirect_dim=0), src=rownum_sb)


def _token_rows(row_hbm, t0, p, K):
    """The rows of y of tokens t0..t0+p, [p, K] int32: token t's slots t*K..t*K+K-1 are contiguous in row."""
    idx_sb = nl.ndarray((p, K), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=idx_sb, src=row_hbm.ap([[K, p], [1, K]], offset=t0 * K))
    return idx_sb


@nki.jit
def _moe_unpermute_kernel(y_hbm, src_hbm, w_hbm):
    """out[t] = sum_j w[t, j] * y[row of slot t*k + j], tokens on the partitions.

    Dimensions:
        T: tokens (tiled by 128 onto the partitions); K: slots per token; N: columns (free dim, chunks of FMAX);
        T*K rows of y.

    Args:
        y_hbm: [T*K, N] expert rows in HBM, float32/float16/bfloat16.
        src_hbm: [T*K, 1] int32, the flat slot t*K + j of each row of y (a permutation, checked on the host).
        w_hbm: [T, K] router weights, y's dtype.

    Returns:
        out_hbm: [T, N] in y's dtype.

    Notes:
        First the inverse permutation row[s] (an int32 scratch in HBM) by one indirect-DMA scatter per 128 rows
        (_inverse_rows). Then per 128-token tile its [128, K] row indices are loaded once and each slot j's rows
        of y arrive by one indirect-DMA gather ([128, 1] offsets, one row per partition): y is read once, out
        written once. VectorE accumulates in float32 in the order j = 0..K-1 (w[:, j] a per-partition scalar),
        one rounding to y's dtype on the copy out. [U] The scatter and the gathers address the same scratch
        through indirect offsets: that the compiler orders them by the tensor they share is assumed (the
        emulator runs the instructions in program order).

    Pseudocode:
        row[source[r]] = r for all r
        for each 128-token tile, each FMAX column chunk:
            acc = w[:, 0] * y[row[t*K + 0]]; acc += w[:, j] * y[row[t*K + j]] for j = 1..K-1; out = acc
    """
    TK, N = y_hbm.shape
    T, K = w_hbm.shape
    out_hbm = nl.ndarray((T, N), dtype=y_hbm.dtype, buffer=nl.shared_hbm)
    row_hbm = nl.ndarray((TK, 1), dtype=nl.int32, buffer=nl.shared_hbm)  # scratch: the inverse permutation
    _inverse_rows(src_hbm, row_hbm)
    for t0, p in spans(T, nl.tile_size.pmax):
        idx_sb = _token_rows(row_hbm, t0, p, K)
        w_sb = nl.ndarray((p, K), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=w_sb, src=w_hbm[t0:t0 + p, 0:K])
        for n0, f in spans(N, FMAX):
            acc_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
            for j in range(K):
                y_sb = nl.ndarray((p, f), dtype=y_hbm.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=y_sb, src=y_hbm.ap([[N, p], [1, f]], offset=n0, vector_offset=idx_sb[0:p, j:j + 1],
                                                     indirect_dim=0))
                if j == 0:
                    nisa.tensor_scalar(dst=acc_sb, data=y_sb, op0=nl.multiply, operand0=w_sb[0:p, 0:1])
                else:
                    nisa.scalar_tensor_tensor(dst=acc_sb, data=y_sb, op0=nl.multiply, operand0=w_sb[0:p, j:j + 1],
                                              op1=nl.add, operand1=acc_sb)
            out_sb = nl.ndarray((p, f), dtype=y_hbm.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=out_sb, src=acc_sb)
            nisa.dma_copy(dst=out_hbm[t0:t0 + p, n0:n0 + f], src=out_sb)
    return out_hbm


@nki.jit
def _moe_unpermute_backward_kernel(grad_hbm, y_hbm, src_hbm, w_hbm):
    """dy[row of slot t*k + j] = w[t, j] * grad[t] and dweights[t, j] = grad[t] . y[row], tokens on the partitions.

    Dimensions:
        T: tokens (tiled by 128 onto the partitions); K: slots per token; N: columns (chunks of FMAX).

    Args:
        grad_hbm: [T, N] upstream gradient, y's dtype.
        y_hbm: [T*K, N] the forward's expert rows, float32/float16/bfloat16.
        src_hbm: [T*K, 1] int32 flat slot of each row of y (a permutation).
        w_hbm: [T, K] router weights, y's dtype.

    Returns:
        dy_hbm: [T*K, N] and dw_hbm: [T, K], in y's dtype.

    Notes:
        The forward's inverse permutation, then per token tile and column chunk: grad's chunk is loaded once and
        serves all K slots; slot j's rows of y arrive by an indirect-DMA gather and dy's rows leave by an
        indirect-DMA scatter to the same rows (distinct: a permutation). The dot products are a VectorE multiply
        and a free-dim add reduction per chunk, summed over the chunks in float32 in order. Traffic: grad and y
        read once, dy written once, the weights and dweights once each.

    Pseudocode:
        row[source[r]] = r for all r
        for each 128-token tile, each FMAX column chunk c, each j:
            yr = y[row[t*K + j], c]; dy[row[t*K + j], c] = w[:, j] * grad[t, c]; dw[:, j] += sum(grad[t, c] * yr)
    """
    TK, N = y_hbm.shape
    T, K = w_hbm.shape
    dy_hbm = nl.ndarray((TK, N), dtype=y_hbm.dtype, buffer=nl.shared_hbm)
    dw_hbm = nl.ndarray((T, K), dtype=w_hbm.dtype, buffer=nl.shared_hbm)
    row_hbm = nl.ndarray((TK, 1), dtype=nl.int32, buffer=nl.shared_hbm)  # scratch: the inverse permutation
    _inverse_rows(src_hbm, row_hbm)
    for t0, p in spans(T, nl.tile_size.pmax):
        idx_sb = _token_rows(row_hbm, t0, p, K)
        w_sb = nl.ndarray((p, K), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=w_sb, src=w_hbm[t0:t0 + p, 0:K])
        dw_sb = nl.ndarray((p, K), dtype=nl.float32, buffer=nl.sbuf)
        for n0, f in spans(N, FMAX):
            g_sb = nl.ndarray((p, f), dtype=grad_hbm.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=g_sb, src=grad_hbm[t0:t0 + p, n0:n0 + f])
            for j in range(K):
                rows = idx_sb[0:p, j:j + 1]
                y_sb = nl.ndarray((p, f), dtype=y_hbm.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=y_sb, src=y_hbm.ap([[N, p], [1, f]], offset=n0, vector_offset=rows, indirect_dim=0))
                dy_sb = nl.ndarray((p, f), dtype=y_hbm.dtype, buffer=nl.sbuf)
                nisa.tensor_scalar(dst=dy_sb, data=g_sb, op0=nl.multiply, operand0=w_sb[0:p, j:j + 1])
                nisa.dma_copy(dst=dy_hbm.ap([[N, p], [1, f]], offset=n0, vector_offset=rows, indirect_dim=0), src=dy_sb)
                prod_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
                nisa.tensor_tensor(dst=prod_sb, data1=g_sb, data2=y_sb, op=nl.multiply)
                if n0 == 0:
                    nisa.tensor_reduce(dst=dw_sb[0:p, j:j + 1], op=nl.add, data=prod_sb, axis=1)
                else:
                    part_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.tensor_reduce(dst=part_sb, op=nl.add, data=prod_sb, axis=1)
                    nisa.tensor_tensor(dst=dw_sb[0:p, j:j + 1], data1=dw_sb[0:p, j:j + 1], data2=part_sb, op=nl.add)
        dwo_sb = nl.ndarray((p, K), dtype=w_hbm.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=dwo_sb, src=dw_sb)
        nisa.dma_copy(dst=dw_hbm[t0:t0 + p, 0:K], src=dwo_sb)
    return dy_hbm, dw_hbm


def _supports(y, source, weights):
    if y.shape[0] > MAX_ROWS:
        return f"T*k = {y.shape[0]} rows: the indirect DMA offsets are int32"
    return None


def _slots(source: np.ndarray) -> np.ndarray:
    """source as the kernels take it: int32 [T*k, 1], contiguous (values were checked to lie in [0, T*k))."""
    return np.ascontiguousarray(source, dtype=np.int32).reshape(-1, 1)


@impl(spec, "neuron", supports=_supports)
def moe_unpermute(y: np.ndarray, source: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Host side: contiguous y and weights, source as int32 [T*k, 1], launch."""
    t, n = weights.shape[0], y.shape[1]
    if t * n == 0:
        return np.zeros((t, n), y.dtype)
    out = _host.run(_moe_unpermute_kernel, _host.contiguous(y), _slots(source), _host.contiguous(weights))
    return _host.as_dtype(out, y.dtype.name, (t, n))


@impl(spec.backward_op, "neuron", supports=lambda grad, y, source, weights: _supports(y, source, weights))
def moe_unpermute_backward(grad: np.ndarray, y: np.ndarray, source: np.ndarray, weights: np.ndarray):
    """Host side: contiguous grad, y and weights, source as int32 [T*k, 1], launch (no columns: dweights are 0)."""
    if y.size == 0:
        return np.zeros(y.shape, y.dtype), np.zeros(weights.shape, weights.dtype)
    dy, dw = _host.run(_moe_unpermute_backward_kernel, _host.contiguous(grad), _host.contiguous(y), _slots(source),
                       _host.contiguous(weights))
    return _host.as_dtype(dy, y.dtype.name, y.shape), _host.as_dtype(dw, weights.dtype.name, weights.shape)

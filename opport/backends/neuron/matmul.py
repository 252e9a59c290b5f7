"""matmul on NKI: TensorE tiles (K, M <= 128, N <= 512) with float32 PSUM accumulation over K."""

from __future__ import annotations

import math

import numpy as np

from opport.backends.neuron import _host
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.backends.neuron.rmsnorm import load_row_broadcast
from opport.dtypes import np_dtype
from opport.ops.matmul import matmul as spec

TILE_K = 128  # contraction rows per nc_matmul (the partition dim of both operands)
TILE_M = 128  # stationary free size (nl.tile_size.gemm_stationary_fmax)
TILE_N = 512  # moving free size: one 2 KiB PSUM bank of float32 (nl.tile_size.gemm_moving_fmax)


@nki.jit
def _matmul_kernel(a_hbm, b_hbm, bias_hbm):
    """Batched a @ b (+ bias) with a [G, M, K], b [G, K, N] or [1, K, N] (shared), bias [N] or None.

    Dimensions:
        G: batch; M: output rows (tiles of 128, the stationary free dim and the output partitions);
        K: contraction (tiles of 128 on the partitions); N: output columns (tiles of 512, one PSUM bank).

    Args:
        a_hbm: [G, M, K] in HBM, float32/float16/bfloat16.
        b_hbm: [G, K, N] or [1, K, N] (one b for every batch entry), a's dtype.
        bias_hbm: [N] in a's dtype, or None.

    Returns:
        out_hbm: [G, M, N] in a's dtype.

    Notes:
        nc_matmul computes stationary.T @ moving with the contraction on the partitions, so each
        [128, 128] block of a is loaded row-major (contiguous DMA) and transposed on TensorE
        (nc_transpose, bit-exact from NeuronCore-v3, so NaN/inf stay in their row) into aT tiles that
        stay in SBUF for the whole row block. For each 512-wide column tile, the K tiles of b stream
        in and accumulate into one float32 PSUM bank (the first matmul overwrites, the rest add).
        The eviction PSUM -> SBUF adds the bias (replicated across the partitions by a K = 1 matmul,
        load_row_broadcast) and casts to the output dtype in the same VectorE instruction. b is re-read once per 128-row
        block of a (the tutorial's "hoisted lhsT" schedule).

    Pseudocode:
        for g, each 128-row block m of a:
            aT[k] = transpose(a[g, m, k]) for each 128-wide k tile
            for each 512-wide column tile n:
                acc = sum_k aT[k].T @ b[g, k, n]          (PSUM, float32)
                out[g, m, n] = acc + bias[n]
    """
    G, M, K = a_hbm.shape
    N = b_hbm.shape[2]
    shared_b = b_hbm.shape[0] == 1
    out_hbm = nl.ndarray((G, M, N), dtype=a_hbm.dtype, buffer=nl.shared_hbm)
    has_bias = bias_hbm != None  # noqa: E711 (NKI kernels compare with None by value)
    n_k = (K + TILE_K - 1) // TILE_K

    for g in range(G):
        gb = 0 if shared_b else g
        for m0 in range(0, M, TILE_M):
            mt = min(TILE_M, M - m0)
            aT_tiles = []
            for k in range(n_k):
                k0 = k * TILE_K
                kt = min(TILE_K, K - k0)
                a_sb = nl.ndarray((mt, kt), dtype=a_hbm.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=a_sb, src=a_hbm[g, m0:m0 + mt, k0:k0 + kt])
                aT_psum = nl.ndarray((kt, mt), dtype=a_hbm.dtype, buffer=nl.psum)
                nisa.nc_transpose(dst=aT_psum, data=a_sb)
                aT_sb = nl.ndarray((kt, mt), dtype=a_hbm.dtype, buffer=nl.sbuf)
                nisa.tensor_copy(dst=aT_sb, src=aT_psum)
                aT_tiles.append(aT_sb)
            for n0 in range(0, N, TILE_N):
                nt = min(TILE_N, N - n0)
                acc_psum = nl.ndarray((mt, nt), dtype=nl.float32, buffer=nl.psum)
                for k in range(n_k):
                    k0 = k * TILE_K
                    kt = min(TILE_K, K - k0)
                    b_sb = nl.ndarray((kt, nt), dtype=b_hbm.dtype, buffer=nl.sbuf)
                    nisa.dma_copy(dst=b_sb, src=b_hbm[gb, k0:k0 + kt, n0:n0 + nt])
                    nisa.nc_matmul(dst=acc_psum, stationary=aT_tiles[k], moving=b_sb)
                res_sb = nl.ndarray((mt, nt), dtype=a_hbm.dtype, buffer=nl.sbuf)
                if has_bias:
                    bias_sb = nl.ndarray((mt, nt), dtype=bias_hbm.dtype, buffer=nl.sbuf)
                    load_row_broadcast(bias_sb, bias_hbm, n0, nt, mt)
                    nisa.tensor_tensor(dst=res_sb, data1=acc_psum, data2=bias_sb, op=nl.add)
                else:
                    nisa.tensor_copy(dst=res_sb, src=acc_psum)
                nisa.dma_copy(dst=out_hbm[g, m0:m0 + mt, n0:n0 + nt], src=res_sb)
    return out_hbm


@spec.impl("neuron", dtypes=("float32", "float16", "bfloat16"))
def matmul(a: np.ndarray, b: np.ndarray, bias) -> np.ndarray:
    """Host side: a shared b folds a's batch dims into M (one [1, B*M, K] call); a batched b loops in-kernel."""
    batch = a.shape[:-2]
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    out_shape = batch + (m, n)
    if math.prod(out_shape) == 0:
        return np.empty(out_shape, a.dtype)
    if k == 0:  # an empty sum: zeros, plus the bias; there is nothing for TensorE to contract
        out = np.zeros(out_shape, np_dtype(a.dtype.name))
        return out if bias is None else (out + bias).astype(a.dtype)
    if b.ndim == 2:
        a3 = _host.contiguous(a).reshape(1, -1, k)
        b3 = _host.contiguous(b).reshape(1, k, n)
    else:
        a3 = _host.contiguous(a).reshape(-1, m, k)
        b3 = _host.contiguous(b).reshape(-1, k, n)
    bias1 = None if bias is None else _host.contiguous(bias)
    return _host.as_dtype(_host.run(_matmul_kernel, a3, b3, bias1), a.dtype.name, out_shape)

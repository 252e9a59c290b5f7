"""rmsnorm on NKI: rows on the 128 partitions, features on the free dimension, float32 statistics."""

from __future__ import annotations

import numpy as np

from opport.backends.neuron import _host
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.ops.rmsnorm import rmsnorm as spec

FMAX = 4096  # free-dim chunk: input chunk + fp32 scratch <= 32 KiB per partition
RESIDENT = 16384  # rows up to this length stay in SBUF between the statistics and the output pass


def _load_row_broadcast(dst_sb, vec_hbm, c0, f, p):
    """DMA vec[c0:c0+f] into all p partitions of dst_sb (a stride-0 partition access pattern)."""
    nisa.dma_copy(dst=dst_sb, src=vec_hbm.ap(pattern=[[0, p], [1, f]], offset=c0))


@nki.jit
def _rmsnorm_kernel(x_hbm, w_hbm, eps):
    """RMS normalisation of a [R, N] tensor over N, with an optional per-feature weight.

    Dimensions:
        R: rows (tiled by 128 onto the partitions); N: features (free dim, chunks of FMAX).

    Args:
        x_hbm: [R, N] input in HBM, float32/float16/bfloat16.
        w_hbm: [N] weight in x's dtype, or None.
        eps: compile-time float added to the mean square.

    Returns:
        out_hbm: [R, N] in x's dtype, x * rsqrt(mean(x**2) + eps) * w.

    Notes:
        One ScalarE instruction per chunk squares x and sums the squares into a float32 column
        (fused activation-with-reduce); one more turns the row sum into rsqrt(sum/N + eps) (scale and
        bias are free on ScalarE). The output is one VectorE scalar_tensor_tensor per chunk:
        (x * rstd) * w. The weight is DMA'd once into the partitions in use through a stride-0
        partition access pattern. Rows up to RESIDENT elements stay in SBUF, so x is read once.

    Pseudocode:
        w_sb[p, :] = w for every partition p in use
        for each 128-row tile:
            ss = sum over chunks of sum(x_c ** 2)
            rstd = rsqrt(ss / N + eps)
            for each chunk c: out_c = (x_c * rstd) * w_c
    """
    R, N = x_hbm.shape
    out_hbm = nl.ndarray((R, N), dtype=x_hbm.dtype, buffer=nl.shared_hbm)
    PMAX = nl.tile_size.pmax
    n_chunks = (N + FMAX - 1) // FMAX
    resident = N <= RESIDENT
    has_weight = w_hbm != None  # noqa: E711 (NKI kernels compare with None by value)
    p_all = min(PMAX, R)

    eps_sb = nl.ndarray((p_all, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=eps_sb, value=float(eps))
    w_tiles = []
    if has_weight and resident:
        for c in range(n_chunks):
            c0 = c * FMAX
            f = min(FMAX, N - c0)
            w_sb = nl.ndarray((p_all, f), dtype=w_hbm.dtype, buffer=nl.sbuf)
            _load_row_broadcast(w_sb, w_hbm, c0, f, p_all)
            w_tiles.append(w_sb)

    for r0 in range(0, R, PMAX):
        p = min(PMAX, R - r0)
        x_tiles = []
        ss_parts_sb = nl.ndarray((p, n_chunks), dtype=nl.float32, buffer=nl.sbuf)
        for c in range(n_chunks):
            c0 = c * FMAX
            f = min(FMAX, N - c0)
            x_sb = nl.ndarray((p, f), dtype=x_hbm.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=x_sb, src=x_hbm[r0:r0 + p, c0:c0 + f])
            if resident:
                x_tiles.append(x_sb)
            sq_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=sq_sb, op=nl.square, data=x_sb, reduce_op=nl.add, reduce_res=ss_parts_sb[0:p, c:c + 1],
                            reduce_cmd=nisa.reduce_cmd.reset_reduce)
        ss_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=ss_sb, op=nl.add, data=ss_parts_sb, axis=1, keepdims=True)
        rstd_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=rstd_sb, op=nl.rsqrt, data=ss_sb, scale=1.0 / N, bias=eps_sb[0:p, 0:1])

        for c in range(n_chunks):
            c0 = c * FMAX
            f = min(FMAX, N - c0)
            if resident:
                x_sb = x_tiles[c]
            else:
                x_sb = nl.ndarray((p, f), dtype=x_hbm.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=x_sb, src=x_hbm[r0:r0 + p, c0:c0 + f])
            out_sb = nl.ndarray((p, f), dtype=x_hbm.dtype, buffer=nl.sbuf)
            if has_weight:
                if resident:
                    w_sb = w_tiles[c]
                else:
                    w_sb = nl.ndarray((p, f), dtype=w_hbm.dtype, buffer=nl.sbuf)
                    _load_row_broadcast(w_sb, w_hbm, c0, f, p)
                nisa.scalar_tensor_tensor(dst=out_sb, data=x_sb, op0=nl.multiply, operand0=rstd_sb, op1=nl.multiply,
                                          operand1=w_sb[0:p, 0:f])
            else:
                nisa.tensor_scalar(dst=out_sb, data=x_sb, op0=nl.multiply, operand0=rstd_sb)
            nisa.dma_copy(dst=out_hbm[r0:r0 + p, c0:c0 + f], src=out_sb)
    return out_hbm


@spec.impl("neuron", dtypes=("float32", "float16", "bfloat16"))
def rmsnorm(x: np.ndarray, weight, eps: float) -> np.ndarray:
    """Host side: flatten leading dims to rows and launch; empty inputs have nothing to compute."""
    if x.size == 0:
        return np.empty(x.shape, x.dtype)
    w = None if weight is None else _host.contiguous(weight)
    return _host.as_dtype(_host.run(_rmsnorm_kernel, _host.rows(x), w, float(eps)), x.dtype.name, x.shape)

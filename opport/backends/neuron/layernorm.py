"""layernorm on NKI: rows on the 128 partitions, features on the free dimension, bn_stats/bn_aggr statistics."""

from __future__ import annotations

import numpy as np

from opport.backends.neuron import _host
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.backends.neuron.rmsnorm import load_row_broadcast, scaled_rows
from opport.dispatch import impl
from opport.ops.layernorm import layernorm as spec

FMAX = 4096  # free-dim chunk: input chunk + fp32 scratch <= 32 KiB per partition
BN = 512  # bn_stats reads at most 512 elements per partition (nl.tile_size.bn_stats_fmax)
RESIDENT = 8192  # rows up to this length stay in SBUF (input + scaled float32 copy <= 64 KiB per partition)


def _scaled(x_hbm, r0, p, c0, f, s_sb):
    """x[r0:r0+p, c0:c0+f] * s in float32 (loaded, then rescaled per row on VectorE)."""
    x_sb = nl.ndarray((p, f), dtype=x_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=x_sb, src=x_hbm[r0:r0 + p, c0:c0 + f])
    xs_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=xs_sb, data=x_sb, op0=nl.multiply, operand0=s_sb)
    return xs_sb


@nki.jit
def _layernorm_kernel(x_hbm, w_hbm, b_hbm, eps):
    """Layer normalisation of a [R, N] tensor over N, with optional per-feature weight and bias.

    Dimensions:
        R: rows (tiled by 128 onto the partitions); N: features (free dim, chunks of FMAX).

    Args:
        x_hbm: [R, N] input in HBM, float32/float16/bfloat16.
        w_hbm: [N] weight in x's dtype, or None.
        b_hbm: [N] bias in x's dtype, or None.
        eps: compile-time float added to the variance.

    Returns:
        out_hbm: [R, N] in x's dtype, (x - mean) * rsqrt(var + eps) * w + b (population variance).

    Notes:
        Rows are first rescaled by an exact power of two s (from max|x|, one VectorE
        tensor_scalar_reduce per chunk and a few [P, 1] instructions: exponent bits, reciprocal),
        so rows beyond 2^40 cannot overflow the float32 statistics; layernorm is scale invariant
        once eps becomes max(eps * s^2, FLT_MIN). VectorE bn_stats then computes (count, mean, M2)
        for each 512-element slice in float32 and one bn_aggr merges them into the row mean and
        variance: one pass, no E[x^2] - E[x]^2 cancellation. rstd = rsqrt(var + eps) is one ScalarE
        activation. The affine part is one or two VectorE instructions per chunk:
        scalar_tensor_tensor((x - mean) * w) then scalar_tensor_tensor(. * rstd + b). Weight and bias
        are read from HBM once and replicated across the partitions on TensorE (load_row_broadcast). Rows up
        to RESIDENT elements stay in SBUF (the scaled float32 copy), so x is read from HBM once.

    Pseudocode:
        for each 128-row tile:
            s = power of two with max|x * s| < 2^40 (1 if max|x| < 2^40); xs = x * s
            mean, var = bn_aggr([bn_stats(xs[:, j:j+512]) for each 512-slice])
            rstd = rsqrt(var + max(eps * s^2, FLT_MIN))
            for each chunk c: out_c = ((xs_c - mean) * w_c) * rstd + b_c
    """
    R, N = x_hbm.shape
    out_hbm = nl.ndarray((R, N), dtype=x_hbm.dtype, buffer=nl.shared_hbm)
    PMAX = nl.tile_size.pmax
    n_chunks = (N + FMAX - 1) // FMAX
    n_slices = (N + BN - 1) // BN
    resident = N <= RESIDENT
    has_w = w_hbm != None  # noqa: E711 (NKI kernels compare with None by value)
    has_b = b_hbm != None  # noqa: E711
    p_all = min(PMAX, R)

    w_tiles = []
    b_tiles = []
    if resident:
        for c in range(n_chunks):
            c0 = c * FMAX
            f = min(FMAX, N - c0)
            if has_w:
                w_sb = nl.ndarray((p_all, f), dtype=w_hbm.dtype, buffer=nl.sbuf)
                load_row_broadcast(w_sb, w_hbm, c0, f, p_all)
                w_tiles.append(w_sb)
            if has_b:
                b_sb = nl.ndarray((p_all, f), dtype=b_hbm.dtype, buffer=nl.sbuf)
                load_row_broadcast(b_sb, b_hbm, c0, f, p_all)
                b_tiles.append(b_sb)

    for r0 in range(0, R, PMAX):
        p = min(PMAX, R - r0)
        # row scale from max|x|
        x_tiles, s_sb, eps_sb = scaled_rows(x_hbm, r0, p, resident, eps)

        # statistics of the scaled rows
        xs_tiles = []
        stats_sb = nl.ndarray((p, 6 * n_slices), dtype=nl.float32, buffer=nl.sbuf)
        for c in range(n_chunks):
            c0 = c * FMAX
            f = min(FMAX, N - c0)
            if resident:
                xs_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
                nisa.tensor_scalar(dst=xs_sb, data=x_tiles[c], op0=nl.multiply, operand0=s_sb)
                xs_tiles.append(xs_sb)
            else:
                xs_sb = _scaled(x_hbm, r0, p, c0, f, s_sb)
            for s0 in range(0, f, BN):
                j = (c0 + s0) // BN
                nisa.bn_stats(dst=stats_sb[0:p, 6 * j:6 * j + 6], data=xs_sb[0:p, s0:min(s0 + BN, f)])
        mv_sb = nl.ndarray((p, 2), dtype=nl.float32, buffer=nl.sbuf)
        nisa.bn_aggr(dst=mv_sb, data=stats_sb)
        rstd_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=rstd_sb, op=nl.rsqrt, data=mv_sb[0:p, 1:2], bias=eps_sb)
        mean_sb = mv_sb[0:p, 0:1]

        for c in range(n_chunks):
            c0 = c * FMAX
            f = min(FMAX, N - c0)
            xs_sb = xs_tiles[c] if resident else _scaled(x_hbm, r0, p, c0, f, s_sb)
            if has_w:
                if resident:
                    w_sb = w_tiles[c]
                else:
                    w_sb = nl.ndarray((p, f), dtype=w_hbm.dtype, buffer=nl.sbuf)
                    load_row_broadcast(w_sb, w_hbm, c0, f, p)
            if has_b:
                if resident:
                    b_sb = b_tiles[c]
                else:
                    b_sb = nl.ndarray((p, f), dtype=b_hbm.dtype, buffer=nl.sbuf)
                    load_row_broadcast(b_sb, b_hbm, c0, f, p)
            out_sb = nl.ndarray((p, f), dtype=x_hbm.dtype, buffer=nl.sbuf)
            if has_w:
                xw_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
                nisa.scalar_tensor_tensor(dst=xw_sb, data=xs_sb, op0=nl.subtract, operand0=mean_sb, op1=nl.multiply,
                                          operand1=w_sb[0:p, 0:f])
                if has_b:
                    nisa.scalar_tensor_tensor(dst=out_sb, data=xw_sb, op0=nl.multiply, operand0=rstd_sb, op1=nl.add,
                                              operand1=b_sb[0:p, 0:f])
                else:
                    nisa.tensor_scalar(dst=out_sb, data=xw_sb, op0=nl.multiply, operand0=rstd_sb)
            elif has_b:
                y_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
                nisa.tensor_scalar(dst=y_sb, data=xs_sb, op0=nl.subtract, operand0=mean_sb, op1=nl.multiply,
                                   operand1=rstd_sb)
                nisa.tensor_tensor(dst=out_sb, data1=y_sb, data2=b_sb[0:p, 0:f], op=nl.add)
            else:
                nisa.tensor_scalar(dst=out_sb, data=xs_sb, op0=nl.subtract, operand0=mean_sb, op1=nl.multiply,
                                   operand1=rstd_sb)
            nisa.dma_copy(dst=out_hbm[r0:r0 + p, c0:c0 + f], src=out_sb)
    return out_hbm


@impl(spec, "neuron", dtypes=("float32", "float16", "bfloat16"))
def layernorm(x: np.ndarray, weight, bias, eps: float) -> np.ndarray:
    """Host side: flatten leading dims to rows and launch; empty inputs have nothing to compute."""
    if x.size == 0:
        return np.empty(x.shape, x.dtype)
    w = None if weight is None else _host.contiguous(weight)
    b = None if bias is None else _host.contiguous(bias)
    return _host.as_dtype(_host.run(_layernorm_kernel, _host.rows(x), w, b, float(eps)), x.dtype.name, x.shape)

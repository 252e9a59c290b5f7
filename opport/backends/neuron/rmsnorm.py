"""rmsnorm on NKI: rows on the 128 partitions, features on the free dimension, float32 statistics."""

from __future__ import annotations

import numpy as np

from opport.backends.neuron import _host
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.dispatch import impl
from opport.ops.rmsnorm import rmsnorm as spec

FMAX = 4096  # free-dim chunk: input chunk + fp32 scratch <= 32 KiB per partition
RESIDENT = 16384  # rows up to this length stay in SBUF between the statistics and the output pass
EXP_BITS = 0x7F800000  # float32 exponent field: amax & EXP_BITS = 2^floor(log2 amax) (subnormal -> 0)
SCALE_TO = 2.0**39  # rows with max|x| >= 2^40 are scaled to [2^39, 2^40): n * max^2 stays far below FLT_MAX
PSUM_FMAX = 512  # float32 columns per PSUM bank: the partition broadcast goes 512 columns per matmul
FLT_MAX = 3.4028234663852886e38  # max|x| is clamped here: an inf row keeps s = 2^-88 and its inf (not s = 1/inf = 0)
TINY = 1.1754943508222875e-38  # FLT_MIN: eps * s^2 may underflow; a zero row must still give 0 * rsqrt(tiny) = 0


def load_row_broadcast(dst_sb, vec_hbm, c0, f, p):
    """dst_sb[0:p, 0:f] = vec[c0:c0+f] on every partition: one DMA of the row, then a K = 1 TensorE matmul
    (ones[1, p]^T @ row, 512 columns at a time through PSUM) replicates it, exactly (x * 1.0, one term),
    so HBM is read once instead of once per partition."""
    row_sb = nl.ndarray((1, f), dtype=vec_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=row_sb, src=vec_hbm[c0:c0 + f])
    ones_sb = nl.ndarray((1, p), dtype=vec_hbm.dtype, buffer=nl.sbuf)
    nisa.memset(dst=ones_sb, value=1.0)
    for j0 in range(0, f, PSUM_FMAX):
        fj = min(PSUM_FMAX, f - j0)
        rep_psum = nl.ndarray((p, fj), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=rep_psum, stationary=ones_sb, moving=row_sb[0:1, j0:j0 + fj])
        nisa.tensor_copy(dst=dst_sb[0:p, j0:j0 + fj], src=rep_psum)


def row_scale(s_sb, amax_sb, p):
    """s = min(1, 2^39 / 2^floor(log2 max|x|)) per row: a power of two (so x * s is exact) that brings rows
    with max|x| >= 2^40 to [2^39, 2^40), where n * max^2 cannot overflow float32; 1 for every other row.
    max|x| is clamped to FLT_MAX first, so a row holding inf keeps its inf (and NaN stays NaN)."""
    fin_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=fin_sb, data=amax_sb, op0=nl.minimum, operand0=FLT_MAX)
    pow_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)  # its mantissa bits cleared: 2^floor(log2)
    nisa.tensor_scalar(dst=pow_sb.view(nl.int32), data=fin_sb.view(nl.int32), op0=nl.bitwise_and, operand0=EXP_BITS)
    inv_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(dst=inv_sb, data=pow_sb)
    nisa.tensor_scalar(dst=s_sb, data=inv_sb, op0=nl.multiply, operand0=SCALE_TO, op1=nl.minimum, operand1=1.0)


def scaled_eps(eps_sb, s_sb, eps):
    """max(eps * s^2, FLT_MIN): eps in the scaled problem; it may underflow, and a zero row must stay 0 / sqrt(>0)."""
    nisa.scalar_tensor_tensor(dst=eps_sb, data=s_sb, op0=nl.multiply, operand0=float(eps), op1=nl.multiply,
                              operand1=s_sb)
    nisa.tensor_scalar(dst=eps_sb, data=eps_sb, op0=nl.maximum, operand0=TINY)


def load_chunk(x_hbm, r0, p, c0, f):
    """x_hbm[r0:r0+p, c0:c0+f] DMA'd into a new SBUF tile (the streaming pass of rows too long to keep)."""
    x_sb = nl.ndarray((p, f), dtype=x_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=x_sb, src=x_hbm[r0:r0 + p, c0:c0 + f])
    return x_sb


def scaled_rows(x_hbm, r0, p, keep, eps):
    """Rows r0:r0+p of x_hbm, FMAX columns at a time: their max|x| gives the row scale s (row_scale) and
    eps * s^2 (scaled_eps), shared by rmsnorm and layernorm. Returns (the chunks, kept in SBUF when `keep`,
    else [] and the caller streams them again; s_sb [p, 1]; eps_sb [p, 1])."""
    N = x_hbm.shape[1]
    n_chunks = (N + FMAX - 1) // FMAX
    x_tiles = []
    amax_parts_sb = nl.ndarray((p, n_chunks), dtype=nl.float32, buffer=nl.sbuf)
    for c in range(n_chunks):
        c0 = c * FMAX
        f = min(FMAX, N - c0)
        x_sb = load_chunk(x_hbm, r0, p, c0, f)
        if keep:
            x_tiles.append(x_sb)
        abs_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar_reduce(dst=abs_sb, data=x_sb, op0=nl.abs, operand0=0.0, reduce_op=nl.maximum,
                                  reduce_res=amax_parts_sb[0:p, c:c + 1])
    amax_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=amax_sb, op=nl.maximum, data=amax_parts_sb, axis=1, keepdims=True)
    s_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    row_scale(s_sb, amax_sb, p)
    eps_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    scaled_eps(eps_sb, s_sb, eps)
    return x_tiles, s_sb, eps_sb


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
        Rows are rescaled by an exact power of two s (from max|x|: one VectorE tensor_scalar_reduce
        per chunk, then a few [P, 1] instructions on the exponent bits), so a float32 sum of squares
        cannot overflow for |x| up to FLT_MAX; rmsnorm is scale invariant once eps becomes eps * s^2.
        The scale is free on ScalarE: one activation per chunk computes (s * x)^2 and sums it into a
        float32 column (fused activation-with-reduce), one more turns the row sum into
        rsqrt(sum/N + eps s^2) (scale and bias are free too). The output is one VectorE
        scalar_tensor_tensor per chunk: (x * (s * rstd)) * w. The weight is read from HBM once and
        replicated across the partitions in use by a K = 1 TensorE matmul against a ones row
        (load_row_broadcast). Rows up to RESIDENT elements stay in SBUF, so x is read once too.

    Pseudocode:
        w_sb[p, :] = w for every partition p in use
        for each 128-row tile:
            s = power of two with max|x * s| < 2^40 (1 if max|x| < 2^40)
            ss = sum over chunks of sum((s * x_c) ** 2)
            k = s * rsqrt(ss / N + max(eps * s^2, FLT_MIN))
            for each chunk c: out_c = (x_c * k) * w_c
    """
    R, N = x_hbm.shape
    out_hbm = nl.ndarray((R, N), dtype=x_hbm.dtype, buffer=nl.shared_hbm)
    PMAX = nl.tile_size.pmax
    n_chunks = (N + FMAX - 1) // FMAX
    resident = N <= RESIDENT
    has_weight = w_hbm != None  # noqa: E711 (NKI kernels compare with None by value)
    p_all = min(PMAX, R)

    w_tiles = []
    if has_weight and resident:
        for c in range(n_chunks):
            c0 = c * FMAX
            f = min(FMAX, N - c0)
            w_sb = nl.ndarray((p_all, f), dtype=w_hbm.dtype, buffer=nl.sbuf)
            load_row_broadcast(w_sb, w_hbm, c0, f, p_all)
            w_tiles.append(w_sb)

    for r0 in range(0, R, PMAX):
        p = min(PMAX, R - r0)
        # row scale from max|x|
        x_tiles, s_sb, eps_sb = scaled_rows(x_hbm, r0, p, resident, eps)

        # sum of (s x)^2, then k = s * rsqrt(sum / N + eps s^2)
        ss_parts_sb = nl.ndarray((p, n_chunks), dtype=nl.float32, buffer=nl.sbuf)
        for c in range(n_chunks):
            c0 = c * FMAX
            f = min(FMAX, N - c0)
            x_sb = x_tiles[c] if resident else load_chunk(x_hbm, r0, p, c0, f)
            sq_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=sq_sb, op=nl.square, data=x_sb, scale=s_sb, reduce_op=nl.add,
                            reduce_res=ss_parts_sb[0:p, c:c + 1], reduce_cmd=nisa.reduce_cmd.reset_reduce)
        ss_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=ss_sb, op=nl.add, data=ss_parts_sb, axis=1, keepdims=True)
        rstd_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=rstd_sb, op=nl.rsqrt, data=ss_sb, scale=1.0 / N, bias=eps_sb)
        k_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=k_sb, data1=rstd_sb, data2=s_sb, op=nl.multiply)

        for c in range(n_chunks):
            c0 = c * FMAX
            f = min(FMAX, N - c0)
            x_sb = x_tiles[c] if resident else load_chunk(x_hbm, r0, p, c0, f)
            out_sb = nl.ndarray((p, f), dtype=x_hbm.dtype, buffer=nl.sbuf)
            if has_weight:
                if resident:
                    w_sb = w_tiles[c]
                else:
                    w_sb = nl.ndarray((p, f), dtype=w_hbm.dtype, buffer=nl.sbuf)
                    load_row_broadcast(w_sb, w_hbm, c0, f, p)
                nisa.scalar_tensor_tensor(dst=out_sb, data=x_sb, op0=nl.multiply, operand0=k_sb, op1=nl.multiply,
                                          operand1=w_sb[0:p, 0:f])
            else:
                nisa.tensor_scalar(dst=out_sb, data=x_sb, op0=nl.multiply, operand0=k_sb)
            nisa.dma_copy(dst=out_hbm[r0:r0 + p, c0:c0 + f], src=out_sb)
    return out_hbm


@impl(spec, "neuron", dtypes=("float32", "float16", "bfloat16"))
def rmsnorm(x: np.ndarray, weight, eps: float) -> np.ndarray:
    """Host side: flatten leading dims to rows and launch; empty inputs have nothing to compute."""
    if x.size == 0:
        return np.empty(x.shape, x.dtype)
    w = None if weight is None else _host.contiguous(weight)
    return _host.as_dtype(_host.run(_rmsnorm_kernel, _host.rows(x), w, float(eps)), x.dtype.name, x.shape)

"""rmsnorm on NKI: rows on the 128 partitions, features on the free dimension, float32 statistics.

add_rmsnorm (neuron/add_rmsnorm.py) runs the same kernels with a residual: the forward adds it as x's chunks
load (load_chunk), writes that sum rounded to the dtype and normalises it; the backward adds grad_sum to dx.

rmsnorm's offset (Gemma's 1 + weight) is a compile-time float: each replicated weight chunk becomes offset + w in
float32 on VectorE as it is loaded (weight_tile), never rounded to the weight's dtype; offset 0 keeps w's own tile."""

from __future__ import annotations

import numpy as np

from opport.backends.neuron import _host
from opport.backends.neuron._tiles import cdiv, load_row_broadcast, spans
from opport.backends.neuron._two_float import (
    divide_two_float,
    dot_two_float,
    fast_two_sum,
    fold_two_float,
    two_product,
    two_product_col,
    two_sum,
)
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.dispatch import impl
from opport.ops.rmsnorm import rmsnorm as spec

FMAX = 4096  # free-dim chunk: input chunk + fp32 scratch <= 32 KiB per partition
RESIDENT = 16384  # rows up to this length stay in SBUF between the statistics and the output pass
EXP_BITS = 0x7F800000  # float32 exponent field: amax & EXP_BITS = 2^floor(log2 amax) (subnormal -> 0)
SCALE_TO = 2.0**39  # rows with max|x| >= 2^40 are scaled to [2^39, 2^40): n * max^2 stays far below FLT_MAX
FLT_MAX = 3.4028234663852886e38  # max|x| is clamped here: an inf row keeps s = 2^-88 and its inf (not s = 1/inf = 0)
TINY = 1.1754943508222875e-38  # FLT_MIN: eps * s^2 may underflow; a zero row must still give 0 * rsqrt(tiny) = 0


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


def load_chunk(x_hbm, r0, p, c0, f, r_hbm=None, sum_hbm=None):
    """x_hbm[r0:r0+p, c0:c0+f] DMA'd into a new SBUF tile (the streaming pass of rows too long to keep). With
    r_hbm (add_rmsnorm): x + r, computed in float32 by VectorE and rounded once into an x-typed tile (the
    correctly rounded sum), also DMA'd to sum_hbm when given (the first pass over the chunk)."""
    x_sb = nl.ndarray((p, f), dtype=x_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=x_sb, src=x_hbm[r0:r0 + p, c0:c0 + f])
    if r_hbm != None:  # noqa: E711 (NKI kernels compare with None by value)
        r_sb = nl.ndarray((p, f), dtype=r_hbm.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=r_sb, src=r_hbm[r0:r0 + p, c0:c0 + f])
        t_sb = nl.ndarray((p, f), dtype=x_hbm.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=t_sb, data1=x_sb, data2=r_sb, op=nl.add)
        if sum_hbm != None:  # noqa: E711
            nisa.dma_copy(dst=sum_hbm[r0:r0 + p, c0:c0 + f], src=t_sb)
        x_sb = t_sb
    return x_sb


def scaled_rows(x_hbm, r0, p, keep, eps, r_hbm=None, sum_hbm=None):
    """Rows r0:r0+p of x_hbm, FMAX columns at a time: their max|x| gives the row scale s (row_scale) and
    eps * s^2 (scaled_eps), shared by rmsnorm and layernorm. Returns (the chunks, kept in SBUF when `keep`,
    else [] and the caller streams them again; s_sb [p, 1]; eps_sb [p, 1]). With r_hbm the rows are the
    rounded sums x + r, written to sum_hbm (load_chunk)."""
    N = x_hbm.shape[1]
    n_chunks = cdiv(N, FMAX)
    x_tiles = []
    amax_parts_sb = nl.ndarray((p, n_chunks), dtype=nl.float32, buffer=nl.sbuf)
    for c, (c0, f) in enumerate(spans(N, FMAX)):
        x_sb = load_chunk(x_hbm, r0, p, c0, f, r_hbm, sum_hbm)
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


def weight_tile(w_hbm, c0, f, p, offset=0.0):
    """w[c0:c0+f] replicated on p partitions (load_row_broadcast); with a nonzero offset (a compile-time float),
    offset + w in a float32 tile (one VectorE tensor_scalar: exact for 16-bit weights and small offsets, one float32
    rounding otherwise), never rounded back to w's dtype."""
    w_sb = nl.ndarray((p, f), dtype=w_hbm.dtype, buffer=nl.sbuf)
    load_row_broadcast(w_sb, w_hbm, c0, f, p)
    if offset == 0.0:
        return w_sb
    wo_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=wo_sb, data=w_sb, op0=nl.add, operand0=float(offset))
    return wo_sb


@nki.jit
def _rmsnorm_kernel(x_hbm, w_hbm, eps, offset):
    """RMS normalisation of a [R, N] tensor over N, with an optional per-feature weight.

    Dimensions:
        R: rows (tiled by 128 onto the partitions); N: features (free dim, chunks of FMAX).

    Args:
        x_hbm: [R, N] input in HBM, float32/float16/bfloat16.
        w_hbm: [N] weight in x's dtype, or None.
        eps: compile-time float added to the mean square.
        offset: compile-time float added to the weight (in float32; 0.0 without a weight).

    Returns:
        out_hbm: [R, N] in x's dtype, x * rsqrt(mean(x**2) + eps) * (offset + w).

    Notes:
        Rows are rescaled by an exact power of two s (from max|x|: one VectorE tensor_scalar_reduce
        per chunk, then a few [P, 1] instructions on the exponent bits), so a float32 sum of squares
        cannot overflow for |x| up to FLT_MAX; rmsnorm is scale invariant once eps becomes eps * s^2.
        The scale is free on ScalarE: one activation per chunk computes (s * x)^2 and sums it into a
        float32 column (fused activation-with-reduce), one more turns the row sum into
        rsqrt(sum/N + eps s^2) (scale and bias are free too). The output is one VectorE
        scalar_tensor_tensor per chunk: (x * (s * rstd)) * w. The weight is read from HBM once and
        replicated across the partitions in use by a K = 1 TensorE matmul against a ones row
        (load_row_broadcast), then offset added in float32 (weight_tile; skipped for offset 0). Rows up
        to RESIDENT elements stay in SBUF, so x is read once too.

    Pseudocode:
        w_sb[p, :] = offset + w for every partition p in use
        for each 128-row tile:
            s = power of two with max|x * s| < 2^40 (1 if max|x| < 2^40)
            ss = sum over chunks of sum((s * x_c) ** 2)
            k = s * rsqrt(ss / N + max(eps * s^2, FLT_MIN))
            for each chunk c: out_c = (x_c * k) * w_c
    """
    return forward_body(x_hbm, w_hbm, eps, None, offset)


def forward_body(x_hbm, w_hbm, eps, r_hbm, offset=0.0):
    """The forward's body (see _rmsnorm_kernel), shared with add_rmsnorm's kernel: with r_hbm the rows are the
    rounded sums x + r, returned too, (out_hbm, sum_hbm). The scale is offset + w (rmsnorm's offset)."""
    R, N = x_hbm.shape
    out_hbm = nl.ndarray((R, N), dtype=x_hbm.dtype, buffer=nl.shared_hbm)
    add = r_hbm != None  # noqa: E711 (NKI kernels compare with None by value)
    sum_hbm = nl.ndarray((R, N), dtype=x_hbm.dtype, buffer=nl.shared_hbm) if add else None
    PMAX = nl.tile_size.pmax
    n_chunks = cdiv(N, FMAX)
    resident = N <= RESIDENT
    has_weight = w_hbm != None  # noqa: E711 (NKI kernels compare with None by value)
    p_all = min(PMAX, R)

    w_tiles = []
    if has_weight and resident:
        for c0, f in spans(N, FMAX):
            w_tiles.append(weight_tile(w_hbm, c0, f, p_all, offset))

    for r0, p in spans(R, PMAX):
        # row scale from max|x|
        x_tiles, s_sb, eps_sb = scaled_rows(x_hbm, r0, p, resident, eps, r_hbm, sum_hbm)

        # sum of (s x)^2, then k = s * rsqrt(sum / N + eps s^2)
        ss_parts_sb = nl.ndarray((p, n_chunks), dtype=nl.float32, buffer=nl.sbuf)
        for c, (c0, f) in enumerate(spans(N, FMAX)):
            x_sb = x_tiles[c] if resident else load_chunk(x_hbm, r0, p, c0, f, r_hbm)  # the sum again: the same bits
            sq_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=sq_sb, op=nl.square, data=x_sb, scale=s_sb, reduce_op=nl.add,
                            reduce_res=ss_parts_sb[0:p, c:c + 1], reduce_cmd=nisa.reduce_cmd.reset_reduce)
        ss_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=ss_sb, op=nl.add, data=ss_parts_sb, axis=1, keepdims=True)
        rstd_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=rstd_sb, op=nl.rsqrt, data=ss_sb, scale=1.0 / N, bias=eps_sb)
        k_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=k_sb, data1=rstd_sb, data2=s_sb, op=nl.multiply)

        for c, (c0, f) in enumerate(spans(N, FMAX)):
            x_sb = x_tiles[c] if resident else load_chunk(x_hbm, r0, p, c0, f, r_hbm)
            out_sb = nl.ndarray((p, f), dtype=x_hbm.dtype, buffer=nl.sbuf)
            if has_weight:
                if resident:
                    w_sb = w_tiles[c]
                else:
                    w_sb = weight_tile(w_hbm, c0, f, p, offset)
                nisa.scalar_tensor_tensor(dst=out_sb, data=x_sb, op0=nl.multiply, operand0=k_sb, op1=nl.multiply,
                                          operand1=w_sb[0:p, 0:f])
            else:
                nisa.tensor_scalar(dst=out_sb, data=x_sb, op0=nl.multiply, operand0=k_sb)
            nisa.dma_copy(dst=out_hbm[r0:r0 + p, c0:c0 + f], src=out_sb)
    if add:
        return out_hbm, sum_hbm
    return out_hbm


@impl(spec, "neuron")
def rmsnorm(x: np.ndarray, weight, eps: float, offset: float = 0.0) -> np.ndarray:
    """Host side: flatten leading dims to rows and launch; empty inputs have nothing to compute."""
    if x.size == 0:
        return np.empty(x.shape, x.dtype)
    w = None if weight is None else _host.contiguous(weight)
    return _host.as_dtype(_host.run(_rmsnorm_kernel, _host.rows(x), w, float(eps), float(offset)), x.dtype.name,
                          x.shape)


# --------------------------------------------------------------------------- backward

GRAD_RESIDENT = 8192  # rows up to this length keep x, grad and weight in SBUF for the three passes (<= 96 KiB fp32)
SUB = 1024  # columns per block of the float32 two-float work: ~14 fp32 temporaries <= 56 KiB per partition


def chunk(tiles, t_hbm, r0, p, c):
    """Chunk c (FMAX columns) of rows r0:r0+p: the kept SBUF tile, or loaded again (rows too long to keep)."""
    if tiles:
        return tiles[c]
    c0, f = spans(t_hbm.shape[1], FMAX)[c]
    return load_chunk(t_hbm, r0, p, c0, f)


def weight_chunk(w_tiles, w_hbm, c, p, offset=0.0):
    """Chunk c of the weight (offset + w with a nonzero offset: weight_tile) replicated on p partitions (kept, or
    replicated again)."""
    if w_tiles:
        return w_tiles[c]
    c0, f = spans(w_hbm.shape[0], FMAX)[c]
    return weight_tile(w_hbm, c0, f, p, offset)


def weighted(g_sb, w_tiles, w_hbm, c, p, f, offset=0.0):
    """g * (offset + w) (float32) of chunk c, or g itself without a weight."""
    if w_hbm == None:  # noqa: E711 (NKI kernels compare with None by value)
        return g_sb
    gw_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=gw_sb, data1=g_sb, data2=weight_chunk(w_tiles, w_hbm, c, p, offset)[0:p, 0:f],
                       op=nl.multiply)
    return gw_sb


def column_sums(dw_psum, prod_sb, p, c0, f):
    """dw_psum[m, b] += sum over the p partitions of prod[:, j] for each column j = c0 + 128 b + m - c0 of the
    chunk: TensorE with prod's 128-column blocks as the stationary operand against a moving ones column
    (prod[:, block]^T @ ones[p, 1]), so the sums come out on the partitions, column b of one PSUM bank per
    128 features, accumulating there over every row tile (a PSUM element's first matmul write assigns,
    later ones add). [1, N] sums (ones as the stationary) would need N / 512 banks held for the whole
    kernel: all 8 at N = 4096."""
    ones_sb = nl.ndarray((p, 1), dtype=prod_sb.dtype, buffer=nl.sbuf)  # matmul operands pair fp32 with fp32 only
    nisa.memset(dst=ones_sb, value=1.0)
    PMAX = nl.tile_size.pmax
    for j0, w in spans(f, PMAX):
        b = (c0 + j0) // PMAX
        nisa.nc_matmul(dst=dw_psum[0:w, b:b + 1], stationary=prod_sb[0:p, j0:j0 + w], moving=ones_sb)


def store_column_sums(dw_hbm, dw_psum):
    """dw[128 b + m] = dw_psum[m, b], cast to dw's dtype: full 128-feature blocks in one DMA (partition m to
    element m of each block), the last partial block in another."""
    PMAX = nl.tile_size.pmax
    N = dw_hbm.shape[0]
    nb = cdiv(N, PMAX)
    dw_sb = nl.ndarray((PMAX, nb), dtype=dw_hbm.dtype, buffer=nl.sbuf)
    full = N // PMAX
    if full > 0:
        nisa.tensor_copy(dst=dw_sb[0:PMAX, 0:full], src=dw_psum[0:PMAX, 0:full])
        nisa.dma_copy(dst=dw_hbm.ap(pattern=[[1, PMAX], [PMAX, full]], offset=0), src=dw_sb[0:PMAX, 0:full])
    rest = N - full * PMAX
    if rest > 0:
        nisa.tensor_copy(dst=dw_sb[0:rest, full:full + 1], src=dw_psum[0:rest, full:full + 1])
        nisa.dma_copy(dst=dw_hbm.ap(pattern=[[1, rest], [1, 1]], offset=full * PMAX), src=dw_sb[0:rest, full:full + 1])


def rms_factor(k_sb, x_tiles, x_hbm, r0, p, s_sb, eps_sb):
    """k = s * rsqrt(sum((s x)^2) / N + eps s^2) per row, the forward's statistics: xhat = x * k."""
    N = x_hbm.shape[1]
    n_chunks = cdiv(N, FMAX)
    ss_parts_sb = nl.ndarray((p, n_chunks), dtype=nl.float32, buffer=nl.sbuf)
    for c in range(n_chunks):
        x_sb = chunk(x_tiles, x_hbm, r0, p, c)
        sq_sb = nl.ndarray(x_sb.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=sq_sb, op=nl.square, data=x_sb, scale=s_sb, reduce_op=nl.add,
                        reduce_res=ss_parts_sb[0:p, c:c + 1], reduce_cmd=nisa.reduce_cmd.reset_reduce)
    ss_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=ss_sb, op=nl.add, data=ss_parts_sb, axis=1, keepdims=True)
    rstd_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=rstd_sb, op=nl.rsqrt, data=ss_sb, scale=1.0 / N, bias=eps_sb)
    nisa.tensor_tensor(dst=k_sb, data1=rstd_sb, data2=s_sb, op=nl.multiply)
    return rstd_sb


def gw_parts(g_sb, w_sb, p, f):
    """(gh, gl) with gh + gl = g w exactly (two_product), or (g, None) without a weight (w_sb None)."""
    if w_sb == None:  # noqa: E711 (NKI kernels compare with None by value)
        return g_sb, None
    gh_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
    gl_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
    two_product(gh_sb, gl_sb, g_sb, w_sb, p, f)
    return gh_sb, gl_sb


def weight_cols(w_tiles, w_hbm, c, p, j0, f, offset=0.0):
    """Columns j0:j0+f of weight chunk c (offset + w) on p partitions, or None without a weight."""
    if w_hbm == None:  # noqa: E711
        return None
    return weight_chunk(w_tiles, w_hbm, c, p, offset)[0:p, j0:j0 + f]


def precise_sums(sums_sb, x_sb, g_sb, w_tiles, w_hbm, c, s_sb, p, offset=0.0):
    """float32 inputs: chunk c's sums of (x s)^2 and g w (x s) in SUB-column blocks, exact products folded as two
    floats (softmax's dot_two_float), into sums_sb [p, 4 n_sub]: highs of (x s)^2 then of g w x s, then their
    error parts in the same order."""
    n_sub = sums_sb.shape[1] // 4
    f = x_sb.shape[1]
    for j0, fj in spans(f, SUB):
        j = (c * FMAX + j0) // SUB
        xs_sb = nl.ndarray((p, fj), dtype=nl.float32, buffer=nl.sbuf)  # x s: exact (s a power of two)
        nisa.tensor_scalar(dst=xs_sb, data=x_sb[0:p, j0:j0 + fj], op0=nl.multiply, operand0=s_sb)
        dot_two_float(sums_sb[0:p, j:j + 1], sums_sb[0:p, 2 * n_sub + j:2 * n_sub + j + 1], xs_sb, None, xs_sb, None,
                      p, fj)
        gh_sb, gl_sb = gw_parts(g_sb[0:p, j0:j0 + fj], weight_cols(w_tiles, w_hbm, c, p, j0, fj, offset), p, fj)
        dot_two_float(sums_sb[0:p, n_sub + j:n_sub + j + 1], sums_sb[0:p, 3 * n_sub + j:3 * n_sub + j + 1], xs_sb,
                      None, gh_sb, gl_sb, p, fj)


def grad_projection(dw_psum, g_hbm, x_tiles, x_hbm, w_tiles, w_hbm, r0, p, k_sb, s_sb, resident, offset=0.0):
    """Pass 2 over rows r0:r0+p: -mean(g w xhat) per row ([p, 1]) and, with a weight, the rows' g xhat summed
    into dw_psum (column_sums); for float32 inputs also precise_sums' two-float sums. Returns (the grad chunks,
    kept when `resident`; -mean(g w xhat); the two-float sums, or None)."""
    N = x_hbm.shape[1]
    n_chunks = cdiv(N, FMAX)
    g_tiles = []
    c_parts_sb = nl.ndarray((p, n_chunks), dtype=nl.float32, buffer=nl.sbuf)
    sums_sb = None
    if x_hbm.dtype == nl.float32 and N > 1:
        sums_sb = nl.ndarray((p, 4 * cdiv(N, SUB)), dtype=nl.float32, buffer=nl.sbuf)
    for c, (c0, f) in enumerate(spans(N, FMAX)):
        g_sb = load_chunk(g_hbm, r0, p, c0, f)
        if resident:
            g_tiles.append(g_sb)
        x_sb = chunk(x_tiles, x_hbm, r0, p, c)
        if sums_sb != None:  # noqa: E711 (NKI kernels compare with None by value); first: its scratch is freed
            precise_sums(sums_sb, x_sb, g_sb, w_tiles, w_hbm, c, s_sb, p, offset)
        xhat_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=xhat_sb, data=x_sb, op0=nl.multiply, operand0=k_sb)
        prod_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=prod_sb, data1=weighted(g_sb, w_tiles, w_hbm, c, p, f, offset), data2=xhat_sb,
                           op=nl.multiply)
        nisa.tensor_reduce(dst=c_parts_sb[0:p, c:c + 1], op=nl.add, data=prod_sb, axis=1, keepdims=True)
        if w_hbm != None:  # noqa: E711
            nisa.tensor_tensor(dst=prod_sb, data1=g_sb, data2=xhat_sb, op=nl.multiply)
            column_sums(dw_psum, prod_sb, p, c0, f)
    mc_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=mc_sb, op=nl.add, data=c_parts_sb, axis=1, keepdims=True)
    nisa.tensor_scalar(dst=mc_sb, data=mc_sb, op0=nl.multiply, operand0=-1.0 / N)
    return g_tiles, mc_sb, sums_sb


def precise_projection(pf_sb, sums_sb, s_sb, eps, eps_lo, N, p):
    """pf [p, 2] = sum(g w x s) / (sum((x s)^2) + N eps s^2) as two floats, so that xhat mean(g w xhat) =
    (x s) pf with every factor of the row accurate to about 2^-44: the bracket g w - xhat mean(g w xhat)
    cancels O(|g|) terms, and float32 xhat and rstd (6e-8 relative, times 1/rms up to 1/sqrt(eps)) had left
    3.7x the tolerance (full tier, eps 1e-6, |x| ~ 1e-3). eps enters as eps + eps_lo (eps rounded to float32
    plus the rest)."""
    n_sub = sums_sb.shape[1] // 4
    part_sb = nl.ndarray((p, 4), dtype=nl.float32, buffer=nl.sbuf)  # (S2 hi, S2 lo, M hi, M lo)
    for i in range(2):
        h_sb = sums_sb[0:p, i * n_sub:(i + 1) * n_sub]
        e_sb = sums_sb[0:p, (2 + i) * n_sub:(3 + i) * n_sub]
        fold_two_float(h_sb, e_sb, p, n_sub)
        fast_two_sum(part_sb[0:p, 2 * i:2 * i + 1], part_sb[0:p, 2 * i + 1:2 * i + 2], h_sb[0:p, 0:1], e_sb[0:p, 0:1], p)
    n_sb = nl.ndarray((p, 2), dtype=nl.float32, buffer=nl.sbuf)  # N, float32(eps)
    nisa.memset(dst=n_sb[0:p, 0:1], value=float(N))
    nisa.memset(dst=n_sb[0:p, 1:2], value=eps)
    ne_sb = nl.ndarray((p, 2), dtype=nl.float32, buffer=nl.sbuf)  # N eps s^2 as two floats (s^2 exact)
    two_product(ne_sb[0:p, 0:1], ne_sb[0:p, 1:2], n_sb[0:p, 0:1], n_sb[0:p, 1:2], p, 1)
    nisa.tensor_scalar(dst=ne_sb[0:p, 1:2], data=ne_sb[0:p, 1:2], op0=nl.add, operand0=N * eps_lo)
    s2_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=s2_sb, data1=s_sb, data2=s_sb, op=nl.multiply)
    nisa.tensor_scalar(dst=ne_sb, data=ne_sb, op0=nl.multiply, operand0=s2_sb)
    den_sb = nl.ndarray((p, 2), dtype=nl.float32, buffer=nl.sbuf)
    u_sb = nl.ndarray((p, 2), dtype=nl.float32, buffer=nl.sbuf)
    two_sum(u_sb[0:p, 0:1], u_sb[0:p, 1:2], part_sb[0:p, 0:1], ne_sb[0:p, 0:1], den_sb[0:p, 0:1])
    nisa.tensor_tensor(dst=u_sb[0:p, 1:2], data1=u_sb[0:p, 1:2], data2=part_sb[0:p, 1:2], op=nl.add)
    nisa.tensor_tensor(dst=u_sb[0:p, 1:2], data1=u_sb[0:p, 1:2], data2=ne_sb[0:p, 1:2], op=nl.add)
    fast_two_sum(den_sb[0:p, 0:1], den_sb[0:p, 1:2], u_sb[0:p, 0:1], u_sb[0:p, 1:2], p)
    divide_two_float(pf_sb, part_sb[0:p, 2:4], den_sb, p)


def precise_bracket(d_sb, x_sb, g_sb, w_sb, s_sb, pf_sb, p, f):
    """d = g w - (x s) pf for float32 inputs, exact up to its last rounding where it cancels: g w and (x s) pf
    as two floats each (two_product, two_product_col), the high parts subtracted first (exact there, Sterbenz)."""
    xs_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=xs_sb, data=x_sb, op0=nl.multiply, operand0=s_sb)
    gh_sb, gl_sb = gw_parts(g_sb, w_sb, p, f)
    th_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
    tl_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
    two_product_col(th_sb, tl_sb, xs_sb, pf_sb[0:p, 0:1], p, f)
    nisa.scalar_tensor_tensor(dst=tl_sb, data=xs_sb, op0=nl.multiply, operand0=pf_sb[0:p, 1:2], op1=nl.add,
                              operand1=tl_sb)
    nisa.tensor_tensor(dst=d_sb, data1=gh_sb, data2=th_sb, op=nl.subtract)
    if gl_sb != None:  # noqa: E711 (NKI kernels compare with None by value)
        nisa.tensor_tensor(dst=tl_sb, data1=gl_sb, data2=tl_sb, op=nl.subtract)
        nisa.tensor_tensor(dst=d_sb, data1=d_sb, data2=tl_sb, op=nl.add)
    else:
        nisa.tensor_tensor(dst=d_sb, data1=d_sb, data2=tl_sb, op=nl.subtract)


def plain_bracket(d_sb, x_sb, g_sb, w_sb, k_sb, mc_sb, N):
    """d = g w + xhat * (-mean(g w xhat)) in float32, xhat = x k (one-element rows: g w + x * 0, which keeps a
    non-finite x's NaN; their k holds the exact form's factor, see rows_backward). w_sb may be None."""
    gw_sb = g_sb
    if w_sb != None:  # noqa: E711 (NKI kernels compare with None by value)
        gw_sb = nl.ndarray(d_sb.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=gw_sb, data1=g_sb, data2=w_sb, op=nl.multiply)
    if N == 1:
        nisa.scalar_tensor_tensor(dst=d_sb, data=x_sb, op0=nl.multiply, operand0=0.0, op1=nl.add, operand1=gw_sb)
    else:
        nisa.tensor_scalar(dst=d_sb, data=x_sb, op0=nl.multiply, operand0=k_sb)  # xhat
        nisa.scalar_tensor_tensor(dst=d_sb, data=d_sb, op0=nl.multiply, operand0=mc_sb, op1=nl.add, operand1=gw_sb)


def write_dx(dx_hbm, x_tiles, x_hbm, g_tiles, g_hbm, w_tiles, w_hbm, r0, p, k_sb, mc_sb, precise, h_hbm=None,
             offset=0.0):
    """Pass 3: dx = bracket * k per SUB block (plain_bracket), cast on the last multiply, one DMA per chunk.
    precise = (s, pf) for float32 inputs: precise_bracket, and the float32 bracket where that is not finite
    (a row holding inf or NaN). h_hbm (add_rmsnorm's grad_sum): dx = bracket * k + h, in the same instruction."""
    N = x_hbm.shape[1]
    for c, (c0, f) in enumerate(spans(N, FMAX)):
        x_sb = chunk(x_tiles, x_hbm, r0, p, c)
        g_sb = chunk(g_tiles, g_hbm, r0, p, c)
        h_sb = None if h_hbm == None else load_chunk(h_hbm, r0, p, c0, f)  # noqa: E711
        dx_sb = nl.ndarray((p, f), dtype=x_hbm.dtype, buffer=nl.sbuf)
        for j0, fj in spans(f, SUB):
            w_sb = weight_cols(w_tiles, w_hbm, c, p, j0, fj, offset)
            d_sb = nl.ndarray((p, fj), dtype=nl.float32, buffer=nl.sbuf)
            plain_bracket(d_sb, x_sb[0:p, j0:j0 + fj], g_sb[0:p, j0:j0 + fj], w_sb, k_sb, mc_sb, N)
            if precise != None:  # noqa: E711 (NKI kernels compare with None by value)
                pd_sb = nl.ndarray((p, fj), dtype=nl.float32, buffer=nl.sbuf)
                precise_bracket(pd_sb, x_sb[0:p, j0:j0 + fj], g_sb[0:p, j0:j0 + fj], w_sb, precise[0], precise[1], p, fj)
                ok_sb = nl.ndarray((p, fj), dtype=nl.uint8, buffer=nl.sbuf)  # 1 where finite: pd * 0 == 0
                nisa.tensor_scalar(dst=ok_sb, data=pd_sb, op0=nl.multiply, operand0=0.0, op1=nl.equal, operand1=0.0)
                nisa.tensor_copy_predicated(dst=d_sb, src=pd_sb, predicate=ok_sb)
            if h_sb != None:  # noqa: E711
                nisa.scalar_tensor_tensor(dst=dx_sb[0:p, j0:j0 + fj], data=d_sb, op0=nl.multiply, operand0=k_sb,
                                          op1=nl.add, operand1=h_sb[0:p, j0:j0 + fj])
            else:
                nisa.tensor_scalar(dst=dx_sb[0:p, j0:j0 + fj], data=d_sb, op0=nl.multiply, operand0=k_sb)
        nisa.dma_copy(dst=dx_hbm[r0:r0 + p, c0:c0 + f], src=dx_sb)


def rows_backward(dx_hbm, dw_psum, g_hbm, x_hbm, w_tiles, w_hbm, r0, p, eps, eps_lo, resident, h_hbm=None,
                  offset=0.0):
    """dx of rows r0:r0+p and their dweight partials into dw_psum: the kernel's loop body, a function so that
    the row tile's SBUF tiles are dead once it returns, before the next tile's are allocated."""
    x_tiles, s_sb, eps_sb = scaled_rows(x_hbm, r0, p, resident, eps)
    k_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    rstd_sb = rms_factor(k_sb, x_tiles, x_hbm, r0, p, s_sb, eps_sb)
    g_tiles, mc_sb, sums_sb = grad_projection(dw_psum, g_hbm, x_tiles, x_hbm, w_tiles, w_hbm, r0, p, k_sb, s_sb,
                                              resident, offset)
    precise = None
    if sums_sb != None:  # noqa: E711 (NKI kernels compare with None by value)
        pf_sb = nl.ndarray((p, 2), dtype=nl.float32, buffer=nl.sbuf)
        precise_projection(pf_sb, sums_sb, s_sb, eps, eps_lo, x_hbm.shape[1], p)
        precise = (s_sb, pf_sb)
    if x_hbm.shape[1] == 1:  # g w - xhat (g w xhat) = g w eps' r^2 exactly: the factor becomes eps' r^2 k
        nisa.scalar_tensor_tensor(dst=k_sb, data=rstd_sb, op0=nl.multiply, operand0=eps_sb, op1=nl.multiply,
                                  operand1=k_sb)
        nisa.tensor_tensor(dst=k_sb, data1=k_sb, data2=rstd_sb, op=nl.multiply)
    write_dx(dx_hbm, x_tiles, x_hbm, g_tiles, g_hbm, w_tiles, w_hbm, r0, p, k_sb, mc_sb, precise, h_hbm, offset)


@nki.jit
def _rmsnorm_backward_kernel(g_hbm, x_hbm, w_hbm, eps, eps_lo, offset):
    """Gradients of rmsnorm for x and weight from grad and the saved x (and weight), [R, N] over N.

    Dimensions:
        R: rows (tiled by 128 onto the partitions); N: features (free dim, chunks of FMAX).

    Args:
        g_hbm: [R, N] upstream gradient in HBM, float32/float16/bfloat16.
        x_hbm: [R, N] the forward's input (saved), same dtype.
        w_hbm: [N] weight in x's dtype, or None.
        eps: compile-time float added to the mean square.
        eps_lo: compile-time float, eps - float32(eps): the float32 path's exact statistics add eps as two floats.
        offset: compile-time float added to the weight (in float32, weight_tile; 0.0 without a weight).

    Returns:
        dx_hbm: [R, N] in x's dtype, k (g w - xhat mean(g w xhat)) with xhat = x k, k = s / rms(s x), w here
            standing for offset + w;
        dw_hbm: [N] in w's dtype, sum over rows of g xhat (only with a weight).

    Notes:
        The row statistics are recomputed from x exactly as the forward computes them (scaled_rows'
        power-of-two row scale s against overflow, then rms_factor), in float32. Per chunk, VectorE forms
        xhat, g w and the row sum of g w xhat; dx is one scalar_tensor_tensor and one tensor_scalar. The
        weight gradient sums g xhat over rows on TensorE (column_sums: (g xhat)[:, block]^T @ ones, the
        sums landing on the partitions of one PSUM bank that accumulates over all row tiles, float32),
        cast once at the end. float32 inputs: the bracket cancels O(|g|) terms that 1/rms magnifies (up to
        1/sqrt(eps)), beyond float32 (the cpu kernel's float32 fails such rows too), so it is recomputed
        exact up to its last rounding from two-float row sums (precise_sums, precise_projection,
        precise_bracket: xhat mean(g w xhat) = (x s) sum(g w x s) / (sum((x s)^2) + N eps s^2)).
        One-element rows take dx = g w eps s^2 r^2 k (the general form cancels to float32 noise there:
        1 - xhat^2 = eps s^2 r^2). Rows up to GRAD_RESIDENT keep x, grad and the replicated weight in
        SBUF, so every tensor is read once and every gradient written once: the minimum traffic.

    Pseudocode:
        for each 128-row tile:
            s, eps' = scaled_rows(x); k = s * rsqrt(sum((s x)^2) / N + eps'); xhat = x * k
            c = mean(g w xhat); dw += sum over rows of g xhat (TensorE)
            dx = (g w - xhat c) * k          (N = 1: g w eps' r^2 k; float32: two-float bracket)
        dw = cast(dw)
    """
    return backward_body(g_hbm, x_hbm, w_hbm, eps, eps_lo, None, offset)


def backward_body(g_hbm, x_hbm, w_hbm, eps, eps_lo, h_hbm, offset=0.0):
    """The backward's body (see _rmsnorm_backward_kernel), shared with add_rmsnorm's: h_hbm (grad_sum) is added
    to dx. The scale is offset + w (rmsnorm's offset); dweight sums g xhat, which does not read it."""
    R, N = x_hbm.shape
    dx_hbm = nl.ndarray((R, N), dtype=x_hbm.dtype, buffer=nl.shared_hbm)
    PMAX = nl.tile_size.pmax
    n_chunks = cdiv(N, FMAX)
    resident = N <= GRAD_RESIDENT
    has_weight = w_hbm != None  # noqa: E711 (NKI kernels compare with None by value)
    p_all = min(PMAX, R)
    w_tiles = []
    if has_weight and resident:
        for c in range(n_chunks):
            w_tiles.append(weight_chunk([], w_hbm, c, p_all, offset))
    dw_psum = nl.ndarray((PMAX, cdiv(N, PMAX)), dtype=nl.float32, buffer=nl.psum)

    for r0, p in spans(R, PMAX):
        rows_backward(dx_hbm, dw_psum, g_hbm, x_hbm, w_tiles, w_hbm, r0, p, eps, eps_lo, resident, h_hbm, offset)

    if not has_weight:
        return dx_hbm
    dw_hbm = nl.ndarray((N,), dtype=w_hbm.dtype, buffer=nl.shared_hbm)
    store_column_sums(dw_hbm, dw_psum)
    return dx_hbm, dw_hbm


@impl(spec.backward_op, "neuron")
def rmsnorm_backward(grad: np.ndarray, x: np.ndarray, weight, eps: float, offset: float = 0.0):
    """Host side: flatten leading dims to rows and launch; empty inputs have nothing to compute."""
    n = x.shape[-1]
    if x.size == 0:  # no rows: dweight sums nothing (0); no features: nothing at all
        return np.empty(x.shape, x.dtype), None if weight is None else np.zeros(n, weight.dtype)
    w = None if weight is None else _host.contiguous(weight)
    eps_lo = float(eps) - float(np.float32(eps))  # the float32 kernel's exact path adds eps as two floats
    out = _host.run(_rmsnorm_backward_kernel, _host.rows(grad), _host.rows(x), w, float(eps), eps_lo, float(offset))
    dx, dw = (out, None) if weight is None else out
    return _host.as_dtype(dx, x.dtype.name, x.shape), None if dw is None else _host.as_dtype(dw, weight.dtype.name, (n,))

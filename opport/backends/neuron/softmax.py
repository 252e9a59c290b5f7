"""softmax on NKI: rows on the 128 partitions, the softmax axis on the free dimension."""

from __future__ import annotations

import numpy as np

from opport.backends.neuron import _host
from opport.backends.neuron._softmax_steps import online_step, running_state
from opport.backends.neuron._tiles import cdiv, spans
from opport.backends.neuron._two_float import fast_two_sum, fold_two_float, two_product
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.dispatch import impl
from opport.ops.softmax import softmax as spec

FMAX = 4096  # free-dim chunk: a 4096-wide input chunk plus its fp32 exp is <= 32 KiB per partition
RESIDENT = 16384  # rows up to this length stay in SBUF between the two passes (<= 64 KiB fp32)


@nki.jit
def _softmax_kernel(x_hbm):
    """Row softmax of a [R, N] tensor, rows on partitions, N on the free dimension.

    Dimensions:
        R: rows (tiled by 128 onto the partitions); N: softmax length (free dim, chunks of FMAX).

    Args:
        x_hbm: [R, N] input in HBM, float32/float16/bfloat16.

    Returns:
        out_hbm: [R, N] in x's dtype, exp(x - max) / sum(exp(x - max)) per row.

    Notes:
        Statistics are float32. A row that fits one chunk takes one pass: max (negated for free on
        VectorE), then one ScalarE activation computing exp(x - max) and its row sum together, then
        a multiply by the reciprocal. Longer rows use an online pass that keeps a running max and a
        rescaled running sum, then a second pass writing exp(x - m) / s; rows up to RESIDENT
        elements stay in SBUF so the input is read from HBM once. A row of all -inf gives NaN
        (0/0, as torch.softmax); a +inf gives NaN through inf - inf, as the reference.

    Pseudocode:
        for each 128-row tile:
            if N <= FMAX: m = max(x); e = exp(x - m); s = sum(e); out = e * (1/s)
            else:
                m = -FLT_MAX; s = 0
                for each chunk c: m' = max(m, max(x_c)); s = s * exp(m - m') + sum(exp(x_c - m')); m = m'
                for each chunk c: out_c = exp(x_c - m) * (1/s)
    """
    R, N = x_hbm.shape
    out_hbm = nl.ndarray((R, N), dtype=x_hbm.dtype, buffer=nl.shared_hbm)
    PMAX = nl.tile_size.pmax
    n_chunks = cdiv(N, FMAX)

    for r0, p in spans(R, PMAX):
        if n_chunks == 1:
            x_sb = nl.ndarray((p, N), dtype=x_hbm.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=x_sb, src=x_hbm[r0:r0 + p, 0:N])
            neg_max_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=neg_max_sb, op=nl.maximum, data=x_sb, axis=1, negate=True, keepdims=True)
            e_sb = nl.ndarray((p, N), dtype=nl.float32, buffer=nl.sbuf)
            sum_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=e_sb, op=nl.exp, data=x_sb, bias=neg_max_sb, reduce_op=nl.add, reduce_res=sum_sb,
                            reduce_cmd=nisa.reduce_cmd.reset_reduce)
            inv_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.reciprocal(dst=inv_sb, data=sum_sb)
            out_sb = nl.ndarray((p, N), dtype=x_hbm.dtype, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=out_sb, data=e_sb, op0=nl.multiply, operand0=inv_sb)
            nisa.dma_copy(dst=out_hbm[r0:r0 + p, 0:N], src=out_sb)
        else:
            # pass 1: online max and rescaled sum over the chunks
            resident = N <= RESIDENT
            x_tiles = []
            m_sb, s_sb = running_state(p)
            for c0, f in spans(N, FMAX):
                x_sb = nl.ndarray((p, f), dtype=x_hbm.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=x_sb, src=x_hbm[r0:r0 + p, c0:c0 + f])
                if resident:
                    x_tiles.append(x_sb)
                m_sb = online_step(m_sb, s_sb, x_sb)[0]  # e is dead at once: only its row sum is kept
            # pass 2: out = exp(x - m) * (1/s)
            neg_m_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=neg_m_sb, data=m_sb, op0=nl.multiply, operand0=-1.0)
            inv_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.reciprocal(dst=inv_sb, data=s_sb)
            for c, (c0, f) in enumerate(spans(N, FMAX)):
                if resident:
                    x_sb = x_tiles[c]
                else:
                    x_sb = nl.ndarray((p, f), dtype=x_hbm.dtype, buffer=nl.sbuf)
                    nisa.dma_copy(dst=x_sb, src=x_hbm[r0:r0 + p, c0:c0 + f])
                e_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
                nisa.activation(dst=e_sb, op=nl.exp, data=x_sb, bias=neg_m_sb)
                out_sb = nl.ndarray((p, f), dtype=x_hbm.dtype, buffer=nl.sbuf)
                nisa.tensor_scalar(dst=out_sb, data=e_sb, op0=nl.multiply, operand0=inv_sb)
                nisa.dma_copy(dst=out_hbm[r0:r0 + p, c0:c0 + f], src=out_sb)
    return out_hbm


@impl(spec, "neuron")
def softmax(x: np.ndarray, axis: int) -> np.ndarray:
    """Host side: move `axis` last (a copy when it is not already last), flatten to rows, launch."""
    if x.ndim == 0:
        x1 = x.reshape(1, 1)
        return _host.as_dtype(_host.run(_softmax_kernel, x1), x.dtype.name, ())
    last = np.moveaxis(x, axis, -1)
    if last.size == 0:
        return np.empty(x.shape, x.dtype)
    out = _host.as_dtype(_host.run(_softmax_kernel, _host.rows(last)), x.dtype.name, last.shape)
    return np.ascontiguousarray(np.moveaxis(out, -1, axis))


# --------------------------------------------------------------------------- backward

GRAD_RESIDENT = 8192  # elements per partition kept in SBUF between the row sum and dx (y + g <= 64 KiB fp32)
FMAX_2F = 1024  # free-dim chunk of the two-float passes: y, g and ~12 fp32 temporaries <= 64 KiB per partition


def load_block(t_hbm, base, stride, p, c0, f):
    """t_hbm's elements base + i * stride + c0 + j (i < p on partitions, j < f) DMA'd into a new SBUF tile: a
    row tile (stride = the row length) or one row spread over the partitions (stride = its share)."""
    t_sb = nl.ndarray((p, f), dtype=t_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t_sb, src=t_hbm.ap(pattern=[[stride, p], [1, f]], offset=base + c0))
    return t_sb


def block_dot(y_hbm, g_hbm, base, stride, p, n, keep):
    """Pass 1 over a [p, n] block (load_block's addressing): sum(y * g) per partition as two floats h + e.

    Each chunk's products are exact as two floats (two_product; 16-bit products are exact in float32
    already, their error part 0), folded to one (fold_two_float), and the chunks' sums folded in turn.
    Returns (y tiles, g tiles: kept for the dx pass when `keep`, else [] and that pass reads them again;
    h [p, 1]; e [p, 1])."""
    n_chunks = cdiv(n, FMAX_2F)
    h_sb = nl.ndarray((p, n_chunks), dtype=nl.float32, buffer=nl.sbuf)
    e_sb = nl.ndarray((p, n_chunks), dtype=nl.float32, buffer=nl.sbuf)
    y_tiles = []
    g_tiles = []
    for c, (c0, f) in enumerate(spans(n, FMAX_2F)):
        y_sb = load_block(y_hbm, base, stride, p, c0, f)
        g_sb = load_block(g_hbm, base, stride, p, c0, f)
        ph_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
        pl_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
        if y_hbm.dtype == nl.float32:
            two_product(ph_sb, pl_sb, y_sb, g_sb, p, f)
        else:
            nisa.tensor_tensor(dst=ph_sb, data1=y_sb, data2=g_sb, op=nl.multiply)
            nisa.memset(dst=pl_sb, value=0.0)
        fold_two_float(ph_sb, pl_sb, p, f)
        nisa.tensor_copy(dst=h_sb[0:p, c:c + 1], src=ph_sb[0:p, 0:1])
        nisa.tensor_copy(dst=e_sb[0:p, c:c + 1], src=pl_sb[0:p, 0:1])
        if keep:
            y_tiles.append(y_sb)
            g_tiles.append(g_sb)
    fold_two_float(h_sb, e_sb, p, n_chunks)
    return y_tiles, g_tiles, h_sb[0:p, 0:1], e_sb[0:p, 0:1]


def block_dx(dx_hbm, y_hbm, g_hbm, base, stride, p, n, s_sb, y_tiles, g_tiles):
    """Pass 2 over the block with s_sb [p, 3] = (h, s_hi, s_lo): the row sum in float32 and as two floats.

    dx = ((g - s_hi) - s_lo) * y, the cpu kernel's form: where g_i is close to s (dx_i cancels) g - s_hi is
    exact, so dx keeps its relative accuracy where y (g - s) with a float32 s would err by y |s| 2^-24 (a
    constant grad's dx is only the rounding of the saved y: c y (1 - sum y)). Elements where that is not
    finite take the reference's form y * g - y * h (g - s can overflow where dx does not; 0 * inf at
    y = 0; a row with inf or NaN has them in h as the reference's sum has)."""
    for c, (c0, f) in enumerate(spans(n, FMAX_2F)):
        if y_tiles:
            y_sb = y_tiles[c]
            g_sb = g_tiles[c]
        else:
            y_sb = load_block(y_hbm, base, stride, p, c0, f)
            g_sb = load_block(g_hbm, base, stride, p, c0, f)
        d_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=d_sb, data=g_sb, op0=nl.subtract, operand0=s_sb[0:p, 1:2], op1=nl.subtract,
                           operand1=s_sb[0:p, 2:3])
        nisa.tensor_tensor(dst=d_sb, data1=d_sb, data2=y_sb, op=nl.multiply)
        yg_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=yg_sb, data1=y_sb, data2=g_sb, op=nl.multiply)
        ref_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=ref_sb, data=y_sb, op0=nl.multiply, operand0=s_sb[0:p, 0:1], op1=nl.subtract,
                                  operand1=yg_sb, reverse1=True)
        bad_sb = nl.ndarray((p, f), dtype=nl.uint8, buffer=nl.sbuf)  # 1 where d is inf or NaN: d * 0 != 0
        nisa.tensor_scalar(dst=bad_sb, data=d_sb, op0=nl.multiply, operand0=0.0, op1=nl.not_equal, operand1=0.0)
        nisa.tensor_copy_predicated(dst=d_sb, src=ref_sb, predicate=bad_sb)
        dx_sb = nl.ndarray((p, f), dtype=dx_hbm.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=dx_sb, src=d_sb)
        nisa.dma_copy(dst=dx_hbm.ap(pattern=[[stride, p], [1, f]], offset=base + c0), src=dx_sb)


def row_sums(s_sb, h_sb, e_sb, p):
    """s_sb [p, 3] = (h, s_hi, s_lo) from a folded sum h + e: the dx pass's row statistics."""
    nisa.tensor_copy(dst=s_sb[0:p, 0:1], src=h_sb)
    fast_two_sum(s_sb[0:p, 1:2], s_sb[0:p, 2:3], h_sb, e_sb, p)


def spread_row_sums(s_sb, parts):
    """s_sb [128, 3]: a spread row's statistics (row_sums) on every partition, from its partitions' two-float
    sums `parts` ((h, e) of the [128, 1] share and of the [t, 1] rest). A float32 matmul across partitions
    would round, so the partials are transposed onto one partition (TensorE, bit-exact), folded there
    (fold_two_float), and the [1, 3] statistics broadcast back by a K = 1 matmul against a ones row (one term
    per output: exact)."""
    PMAX = nl.tile_size.pmax
    n = 0
    for h_sb, _ in parts:
        n += h_sb.shape[0]
    h_row_sb = nl.ndarray((1, n), dtype=nl.float32, buffer=nl.sbuf)
    e_row_sb = nl.ndarray((1, n), dtype=nl.float32, buffer=nl.sbuf)
    j0 = 0
    for h_sb, e_sb in parts:
        k = h_sb.shape[0]
        for src_sb, dst_sb in ((h_sb, h_row_sb), (e_sb, e_row_sb)):
            t_psum = nl.ndarray((1, k), dtype=nl.float32, buffer=nl.psum)
            nisa.nc_transpose(dst=t_psum, data=src_sb)
            nisa.tensor_copy(dst=dst_sb[0:1, j0:j0 + k], src=t_psum)
        j0 += k
    fold_two_float(h_row_sb, e_row_sb, 1, n)
    stat_sb = nl.ndarray((1, 3), dtype=nl.float32, buffer=nl.sbuf)
    row_sums(stat_sb, h_row_sb[0:1, 0:1], e_row_sb[0:1, 0:1], 1)
    ones_sb = nl.ndarray((1, PMAX), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones_sb, value=1.0)
    stat_psum = nl.ndarray((PMAX, 3), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=stat_psum, stationary=ones_sb, moving=stat_sb)
    nisa.tensor_copy(dst=s_sb, src=stat_psum)


def row_tile_backward(dx_hbm, y_hbm, g_hbm, r0, p):
    """dx of rows r0:r0+p, kept in SBUF between the passes (a function: its tiles are dead once it returns)."""
    N = y_hbm.shape[1]
    y_tiles, g_tiles, h_sb, e_sb = block_dot(y_hbm, g_hbm, r0 * N, N, p, N, True)
    s_sb = nl.ndarray((p, 3), dtype=nl.float32, buffer=nl.sbuf)
    row_sums(s_sb, h_sb, e_sb, p)
    block_dx(dx_hbm, y_hbm, g_hbm, r0 * N, N, p, N, s_sb, y_tiles, g_tiles)


def spread_row_backward(dx_hbm, y_hbm, g_hbm, r):
    """dx of row r spread over the partitions: [128, N // 128] and the [N % 128, 1] rest, summed across the
    partitions by spread_row_sums."""
    PMAX = nl.tile_size.pmax
    N = y_hbm.shape[1]
    m = N // PMAX
    t = N - m * PMAX
    y_tiles, g_tiles, h_sb, e_sb = block_dot(y_hbm, g_hbm, r * N, m, PMAX, m, m <= GRAD_RESIDENT)
    parts = [(h_sb, e_sb)]
    if t > 0:
        ty_tiles, tg_tiles, th_sb, te_sb = block_dot(y_hbm, g_hbm, r * N + m * PMAX, 1, t, 1, True)
        parts.append((th_sb, te_sb))
    s_sb = nl.ndarray((PMAX, 3), dtype=nl.float32, buffer=nl.sbuf)
    spread_row_sums(s_sb, parts)
    block_dx(dx_hbm, y_hbm, g_hbm, r * N, m, PMAX, m, s_sb, y_tiles, g_tiles)
    if t > 0:
        block_dx(dx_hbm, y_hbm, g_hbm, r * N + m * PMAX, 1, t, 1, s_sb[0:t, 0:3], ty_tiles, tg_tiles)


@nki.jit
def _softmax_backward_kernel(g_hbm, y_hbm):
    """Gradient of row softmax from its output, dx = y * (g - sum(g * y)), of [R, N] tensors.

    Dimensions:
        R: rows; N: softmax length. Rows up to GRAD_RESIDENT go 128 to a tile on the partitions (N on the
        free dim, in chunks); a longer row is spread over the 128 partitions itself ([128, N // 128], the
        N % 128 rest one element per partition).

    Args:
        g_hbm: [R, N] upstream gradient in HBM, float32/float16/bfloat16.
        y_hbm: [R, N] the forward's output (saved), same dtype.

    Returns:
        dx_hbm: [R, N] in y's dtype.

    Notes:
        Where dx cancels (a constant grad: dx = y c (1 - sum y)) the row sum needs more digits than a
        float32 sum keeps, for 16-bit inputs too (their small dx lands in subnormals), as the cpu kernel's
        float64 sum has: pass 1 sums y * g exactly as two floats on VectorE (two_product for float32,
        fold_two_float), pass 2 writes ((g - s_hi) - s_lo) * y (block_dx). A spread row's partials meet
        on one partition through TensorE transposes (spread_row_sums). Rows (or a spread row's share) up
        to GRAD_RESIDENT elements stay in SBUF, so y and g are read once and dx written once: the minimum
        traffic.

    Pseudocode:
        for each 128-row tile (or each spread row):
            s_hi + s_lo = sum(y * g) per row, exact products and TwoSum folds (partials across partitions
                          on one partition for a spread row)
            dx = ((g - s_hi) - s_lo) * y     (y * g - y * s where that is not finite)
    """
    R, N = y_hbm.shape
    dx_hbm = nl.ndarray((R, N), dtype=y_hbm.dtype, buffer=nl.shared_hbm)
    PMAX = nl.tile_size.pmax
    if N <= GRAD_RESIDENT:
        for r0, p in spans(R, PMAX):
            row_tile_backward(dx_hbm, y_hbm, g_hbm, r0, p)
    else:
        for r in range(R):
            spread_row_backward(dx_hbm, y_hbm, g_hbm, r)
    return dx_hbm


@impl(spec.backward_op, "neuron")
def softmax_backward(grad: np.ndarray, out: np.ndarray, axis: int):
    """Host side: move `axis` last (a copy when it is not already last), flatten to rows, launch."""
    if out.ndim == 0:
        dx = _host.run(_softmax_backward_kernel, grad.reshape(1, 1), out.reshape(1, 1))
        return (_host.as_dtype(dx, out.dtype.name, ()),)
    g, y = np.moveaxis(grad, axis, -1), np.moveaxis(out, axis, -1)
    if y.size == 0:
        return (np.zeros(out.shape, out.dtype),)
    dx = _host.as_dtype(_host.run(_softmax_backward_kernel, _host.rows(g), _host.rows(y)), out.dtype.name, y.shape)
    return (np.ascontiguousarray(np.moveaxis(dx, -1, axis)),)

"""grouped_matmul on NKI: each expert's rows in 128-row tiles against its own weights, float32 PSUM accumulation.

The tile loops, TensorE transposes and row-block reuse are matmul's (opport/backends/neuron/matmul.py), applied per
expert: a group's rows are walked in tiles of 128 with a partial last tile, so no tile straddles two experts.
"""

from __future__ import annotations

import numpy as np

from opport.backends.neuron import _host
from opport.backends.neuron._tiles import cdiv, spans
from opport.backends.neuron.matmul import (
    DA_TILES,
    DB_CHUNKS,
    ROWS_BUDGET,
    TILE_K,
    TILE_M,
    TILE_N,
    _b_rows,
    _b_transposed,
    _rows_of,
    _transposed_row_tile,
    _transposed_sb,
    rows_per_block,
)
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.dispatch import impl
from opport.dtypes import np_dtype
from opport.ops.grouped_matmul import grouped_matmul as spec


@nki.jit
def _grouped_matmul_kernel(x_hbm, w_hbm, offsets, trans_w):
    """out[r] = x[r] @ w[e] for the rows r of every expert e, with w [E, K, N] or (trans_w) [E, N, K].

    Dimensions:
        M: rows of x (tiles of up to 128 inside each expert's group: the stationary free dim and the output
        partitions); K: contraction (tiles of 128 on the partitions); N: output columns (tiles of 512, one PSUM
        bank); E: experts.

    Args:
        x_hbm: [1, M, K] in HBM, float32/float16/bfloat16 (matmul's row-tile helpers index a batch entry).
        w_hbm: [E, K, N], or [E, N, K] with trans_w, x's dtype.
        offsets: compile-time tuple of E + 1 ints (validated: 0 = offsets[0] <= ... <= offsets[E] = M); NKI loop
            bounds and DMA sizes are static, so a kernel is traced per routing.
        trans_w: compile-time bool.

    Returns:
        out_hbm: [M, N] in x's dtype.

    Notes:
        Per expert with rows, matmul's schedule on its group: rows in blocks of rows_per_block 128-row tiles
        (the last tile of a group partial, mt = what remains, so boundaries need no mask and no tile mixes two
        experts), each row tile of x loaded row-major and transposed on TensorE (bit-exact) into xT tiles kept
        for the block; for each 512-wide column tile every [128, 512] tile of w[e] is read once per block and
        multiplied into every row tile's float32 PSUM bank. With trans_w, w[e] is [N, K] (N on the partitions as
        loaded), so its [<=128, 128] pieces are transposed on TensorE into the [K, N] moving tile. An empty expert
        has no rows and its weights are never read; w[e] is read cdiv(rows_e, 128 * rows_per_block) times.
        Each output element sums its K tiles in order, rounded once on eviction.

    Pseudocode:
        for e, each block of row tiles m_1..m_r of rows offsets[e]:offsets[e+1]:
            xT[i][k] = transpose(x[m_i, k])
            for each 512-wide column tile n:
                for each k tile: w_k = w[e][k, n] (trans_w: transpose(w[e][n, k])); acc_i += xT[i][k].T @ w_k
                out[m_i, n] = acc_i
    """
    K = x_hbm.shape[2]
    M = x_hbm.shape[1]
    N = w_hbm.shape[1] if trans_w else w_hbm.shape[2]
    out_hbm = nl.ndarray((M, N), dtype=x_hbm.dtype, buffer=nl.shared_hbm)
    block_rows = TILE_M * rows_per_block(K, 4 if x_hbm.dtype == nl.float32 else 2)
    for e in range(len(offsets) - 1):
        for r0 in range(offsets[e], offsets[e + 1], block_rows):
            _row_block(x_hbm, w_hbm, out_hbm, e, r0, min(r0 + block_rows, offsets[e + 1]), trans_w)
    return out_hbm


def _row_block(x_hbm, w_hbm, out_hbm, e, r0, r1, trans_w):
    """Rows r0:r1 of expert e: their xT tiles, then every column tile. A function of its own, so that one block's tiles
    are released before the next block's are allocated."""
    K = x_hbm.shape[2]
    N = out_hbm.shape[1]
    n_k = cdiv(K, TILE_K)
    row_tiles, xT_tiles = [], []
    for m0, mt in spans(r1, TILE_M, r0):
        row_tiles.append((m0, mt))
        xT_tiles.append(_transposed_row_tile(x_hbm, 0, m0, mt, n_k))
    for n0, nt in spans(N, TILE_N):
        accs = []
        for i in range(len(row_tiles)):
            accs.append(nl.ndarray((row_tiles[i][1], nt), dtype=nl.float32, buffer=nl.psum))
        for k, (k0, kt) in enumerate(spans(K, TILE_K)):
            w_sb = _weight_tile(w_hbm, e, k0, kt, n0, nt, trans_w)
            for i in range(len(row_tiles)):
                nisa.nc_matmul(dst=accs[i], stationary=xT_tiles[i][k], moving=w_sb)
        for i in range(len(row_tiles)):
            m0, mt = row_tiles[i]
            res_sb = nl.ndarray((mt, nt), dtype=out_hbm.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=res_sb, src=accs[i])
            nisa.dma_copy(dst=out_hbm[m0:m0 + mt, n0:n0 + nt], src=res_sb)


def _weight_tile(w_hbm, e, k0, kt, n0, nt, trans_w):
    """w[e]'s [kt, nt] tile with K on the partitions: one DMA from [E, K, N]; from [E, N, K] (trans_w), its rows
    n0:n0+nt loaded row-major (up to 128 per DMA) and transposed on TensorE."""
    if trans_w:
        return _b_transposed(_b_rows(w_hbm, e, n0, nt, k0, kt), 0, kt, nt)
    w_sb = nl.ndarray((kt, nt), dtype=w_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=w_sb, src=w_hbm[e, k0:k0 + kt, n0:n0 + nt])
    return w_sb


def _nki_args(x: np.ndarray, w: np.ndarray, offsets: np.ndarray) -> tuple:
    """x as [1, M, K] and w, contiguous (copies only of strided views); the offsets as compile-time ints, which
    must be what the op validated (0 first, never decreasing, M last): the kernel unrolls over them at trace time,
    and garbage offsets (a host reading a strided offsets view wrongly) would trace an unbounded kernel. The op's
    check_offsets says the same with its typed error; a kernel file takes only its op's spec from opport.ops
    (tests/test_layers.py), so this guard is the kernel's own assertion of it."""
    offs = tuple(int(v) for v in offsets)
    if offs[0] != 0 or offs[-1] != x.shape[0] or any(b < a for a, b in zip(offs, offs[1:])):
        raise ValueError(f"grouped_matmul (neuron): offsets {offs[:8]}... are not 0 ... {x.shape[0]}, nondecreasing")
    return _host.contiguous(x)[None], _host.contiguous(w), offs


@impl(spec, "neuron")
def grouped_matmul(x: np.ndarray, w: np.ndarray, offsets: np.ndarray, trans_w: bool) -> np.ndarray:
    """Host side: contiguous x and w, the offsets as compile-time ints; empty outputs and K = 0 (zeros: nothing for
    TensorE to contract) are answered here."""
    m, k = x.shape
    n = w.shape[1] if trans_w else w.shape[2]
    if m * n == 0 or k == 0:
        return np.zeros((m, n), np_dtype(x.dtype.name))
    out = _host.run(_grouped_matmul_kernel, *_nki_args(x, w, offsets), bool(trans_w))
    return _host.as_dtype(out, x.dtype.name, (m, n))


# --------------------------------------------------------------------------- backward

ZERO_COLS = 2048  # columns of the zero tile an empty expert's dw is written from: 8 KiB per partition in float32


@nki.jit
def _grouped_matmul_backward_kernel(g_hbm, x_hbm, w_hbm, offsets, trans_w):
    """Gradients of grouped_matmul: dx_e = grad_e W_e^T and dw[e] = x_e^T grad_e (grad_e^T x_e with trans_w).

    Dimensions:
        M: rows (tiles of up to 128 inside each expert's group: the partitions of grad, x and dx, and the
        contraction of dw); K: x's columns; N: grad's columns (the contraction of dx in 128-wide tiles); E: experts.

    Args:
        g_hbm: [1, M, N] upstream gradient, float32/float16/bfloat16.
        x_hbm: [1, M, K] in grad's dtype.
        w_hbm: [E, K, N], or [E, N, K] with trans_w, in grad's dtype.
        offsets: compile-time tuple of E + 1 ints (validated), as the forward's.
        trans_w: compile-time bool.

    Returns:
        (dx_hbm [M, K], dw_hbm shaped as w) in grad's dtype.

    Notes:
        Per expert, matmul's backward on its group of rows. dx contracts over N, which lies on the free axis of grad:
        each 128-wide slice of a grad row tile is transposed on TensorE; W_e^T's [128 n, 512 k] moving tile is w[e]'s
        own layout with trans_w ([N, K]: one DMA), else pieces of w[e] [K, N] transposed on TensorE, each serving
        up to DA_TILES row tiles' PSUM accumulators. dw contracts over the group's rows, which already lie on the
        partitions: row tiles of x and grad go in as loaded (a partial last tile contracts over fewer partitions),
        every row tile of the expert accumulating into the same float32 PSUM banks, in row order: dw[e] sums that
        expert's rows only. The group's rows of x and grad stay in SBUF for both passes when they fit ROWS_BUDGET
        bytes per partition. An expert without rows writes dw[e] = 0 from a zeroed tile and reads nothing.

    Pseudocode:
        for e with rows (rows = x, grad in 128-row tiles of the group, kept in SBUF if they fit):
            for each block of <= 6 row tiles, each 512-wide k chunk:
                for each 128-wide n tile: WT = W_e^T[n, k chunk]; acc_i += transpose(grad_i[:, n]) .T @ WT
                dx[rows_i, k chunk] = acc_i
            (a, b) = (x, grad), or (grad, x) with trans_w
            for each 128-wide p tile of a's columns, each panel of 3 x 512 of b's:
                acc_c = sum over row tiles of a_i[:, p]^T @ b_i[:, c]; dw[e, p, c] = acc_c
        for e without rows: dw[e] = 0
    """
    M, N = g_hbm.shape[1], g_hbm.shape[2]
    K = x_hbm.shape[2]
    dx_hbm = nl.ndarray((M, K), dtype=g_hbm.dtype, buffer=nl.shared_hbm)
    dw_hbm = nl.ndarray(w_hbm.shape, dtype=g_hbm.dtype, buffer=nl.shared_hbm)
    item = 4 if g_hbm.dtype == nl.float32 else 2
    for e in range(len(offsets) - 1):
        r0, r1 = offsets[e], offsets[e + 1]
        if r1 == r0:
            _zero_expert(dw_hbm, e)
            continue
        resident = cdiv(r1 - r0, TILE_M) * (K + N) * item <= ROWS_BUDGET
        tiles = []  # (first row, rows, x tile or None, grad tile or None)
        for m0, mt in spans(r1, TILE_M, r0):
            x_sb = _rows_of(x_hbm, None, 0, m0, mt, 0, K) if resident else None
            g_sb = _rows_of(g_hbm, None, 0, m0, mt, 0, N) if resident else None
            tiles.append((m0, mt, x_sb, g_sb))
        _dx_pass(g_hbm, w_hbm, dx_hbm, e, tiles, trans_w)
        _dw_pass(g_hbm, x_hbm, dw_hbm, e, tiles, trans_w)
    return dx_hbm, dw_hbm


def _dx_pass(g_hbm, w_hbm, dx_hbm, e, tiles, trans_w):
    """dx[rows of e] = grad W_e^T: per block of DA_TILES row tiles and 512-wide chunk of K, accumulate over N in PSUM."""
    N, K = g_hbm.shape[2], dx_hbm.shape[1]
    for i0 in range(0, len(tiles), DA_TILES):
        block = tiles[i0:i0 + DA_TILES]
        for kc0, kc in spans(K, TILE_N):
            accs = []
            for t in block:
                accs.append(nl.ndarray((t[1], kc), dtype=nl.float32, buffer=nl.psum))
            for nb0, nb in spans(N, TILE_N):
                w_tiles = None if trans_w else _b_rows(w_hbm, e, kc0, kc, nb0, nb)
                for nt0, nt in spans(nb0 + nb, TILE_K, nb0):
                    wT_sb = _weight_rows(w_hbm, e, nt0, nt, kc0, kc) if trans_w else \
                        _b_transposed(w_tiles, nt0 - nb0, nt, kc)
                    for i in range(len(block)):
                        m0, mt, _, g_sb = block[i]
                        gT_sb = _transposed_sb(_rows_of(g_hbm, g_sb, 0, m0, mt, nt0, nt))
                        nisa.nc_matmul(dst=accs[i], stationary=gT_sb, moving=wT_sb)
            for i in range(len(block)):
                m0, mt = block[i][0], block[i][1]
                dx_sb = nl.ndarray((mt, kc), dtype=dx_hbm.dtype, buffer=nl.sbuf)
                nisa.tensor_copy(dst=dx_sb, src=accs[i])
                nisa.dma_copy(dst=dx_hbm[m0:m0 + mt, kc0:kc0 + kc], src=dx_sb)


def _weight_rows(w_hbm, e, n0, nt, k0, kc):
    """w[e, n0:n0+nt, k0:k0+kc] of an [E, N, K] w: W_e^T's tile with N on the partitions, one DMA."""
    w_sb = nl.ndarray((nt, kc), dtype=w_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=w_sb, src=w_hbm[e, n0:n0 + nt, k0:k0 + kc])
    return w_sb


def _dw_pass(g_hbm, x_hbm, dw_hbm, e, tiles, trans_w):
    """dw[e] = a^T b over the rows of e, (a, b) = (x, grad), or (grad, x) with trans_w: per [128, DB_CHUNKS x 512]
    panel, every row tile of the expert summed in one set of PSUM accumulators."""
    a_hbm, b_hbm, a_pos, b_pos = (g_hbm, x_hbm, 3, 2) if trans_w else (x_hbm, g_hbm, 2, 3)
    P, Q = a_hbm.shape[2], b_hbm.shape[2]
    for p0, pt in spans(P, TILE_K):
        for c_start in range(0, Q, TILE_N * DB_CHUNKS):
            chunks = spans(min(Q, c_start + TILE_N * DB_CHUNKS), TILE_N, c_start)
            width = chunks[-1][0] + chunks[-1][1] - c_start
            accs = []
            for _, qc in chunks:
                accs.append(nl.ndarray((pt, qc), dtype=nl.float32, buffer=nl.psum))
            for t in tiles:
                m0, mt = t[0], t[1]
                a_sb = _rows_of(a_hbm, t[a_pos], 0, m0, mt, p0, pt)
                b_sb = _rows_of(b_hbm, t[b_pos], 0, m0, mt, c_start, width)
                for c in range(len(chunks)):
                    cols = b_sb[0:mt, chunks[c][0] - c_start:chunks[c][0] - c_start + chunks[c][1]]
                    nisa.nc_matmul(dst=accs[c], stationary=a_sb, moving=cols)
            for c in range(len(chunks)):
                c0, qc = chunks[c]
                dw_sb = nl.ndarray((pt, qc), dtype=dw_hbm.dtype, buffer=nl.sbuf)
                nisa.tensor_copy(dst=dw_sb, src=accs[c])
                nisa.dma_copy(dst=dw_hbm[e, p0:p0 + pt, c0:c0 + qc], src=dw_sb)


def _zero_expert(dw_hbm, e):
    """dw[e] = 0 (an expert without rows): one zeroed SBUF tile DMA'd over [128, ZERO_COLS] pieces."""
    P, Q = dw_hbm.shape[1], dw_hbm.shape[2]
    zero_sb = nl.ndarray((min(P, TILE_K), min(Q, ZERO_COLS)), dtype=dw_hbm.dtype, buffer=nl.sbuf)
    nisa.memset(dst=zero_sb, value=0.0)
    for p0, pt in spans(P, TILE_K):
        for c0, qc in spans(Q, ZERO_COLS):
            nisa.dma_copy(dst=dw_hbm[e, p0:p0 + pt, c0:c0 + qc], src=zero_sb[0:pt, 0:qc])


@impl(spec.backward_op, "neuron")
def grouped_matmul_backward(grad: np.ndarray, x: np.ndarray, w: np.ndarray, offsets: np.ndarray, trans_w: bool):
    """Host side: contiguous grad, x and w, the offsets as compile-time ints. Empty sums (no rows, K = 0 or N = 0)
    are zeros, answered here."""
    dt = np_dtype(x.dtype.name)
    if grad.size == 0 or x.size == 0:
        return np.zeros(x.shape, dt), np.zeros(w.shape, dt)
    x3, w3, offs = _nki_args(x, w, offsets)
    dx, dw = _host.run(_grouped_matmul_backward_kernel, _host.contiguous(grad)[None], x3, w3, offs, bool(trans_w))
    return _host.as_dtype(dx, x.dtype.name, x.shape), _host.as_dtype(dw, x.dtype.name, w.shape)

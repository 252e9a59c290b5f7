"""matmul on NKI: TensorE tiles (K, M <= 128, N <= 512) with float32 PSUM accumulation over K."""

from __future__ import annotations

import math

import numpy as np

from opport.backends.neuron import _host
from opport.backends.neuron._tiles import cdiv, load_row_broadcast, spans
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.dispatch import impl
from opport.dtypes import np_dtype
from opport.ops.matmul import matmul as spec

TILE_K = 128  # contraction rows per nc_matmul (the partition dim of both operands)
TILE_M = 128  # stationary free size (nl.tile_size.gemm_stationary_fmax)
TILE_N = 512  # moving free size: one 2 KiB PSUM bank of float32 (nl.tile_size.gemm_moving_fmax)
ACC_BANKS = 6  # row tiles accumulated at once, one PSUM bank each (of 8: the bias broadcast needs one more)
AT_BUDGET = 128 << 10  # SBUF bytes per partition for a row block's transposed a tiles (trn1 has 176 KiB, trn2 208)


def rows_per_block(K: int, itemsize: int) -> int:
    """Row tiles of a kept in SBUF together: b is read once per block of them, so more rows per block
    means fewer passes over b, up to ACC_BANKS PSUM accumulators and AT_BUDGET bytes of aT per partition."""
    n_k = cdiv(K, TILE_K)
    return max(1, min(ACC_BANKS, AT_BUDGET // (n_k * TILE_M * itemsize)))


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
        stay in SBUF for a block of up to ACC_BANKS row tiles (rows_per_block: as many as AT_BUDGET
        holds). For each 512-wide column tile, each [128, 512] tile of b is DMA'd once per row block
        and multiplied into every row tile's float32 PSUM bank (the first matmul overwrites, the rest
        add), so b is read M / (128 * rows_per_block) times, not M / 128: a 512 x 512 x 512 float32
        matmul reads it once (HBM traffic 1.00x the minimum, was 2.00x), a 4096-row bf16 one at
        K = 4096 6 times instead of 32. The eviction PSUM -> SBUF adds the bias (replicated across the
        partitions by a K = 1 matmul, load_row_broadcast, once per row block and column tile) and casts
        to the output dtype in the same VectorE instruction. Each output element sums its K tiles in
        the same order as with one row tile at a time.

    Pseudocode:
        for g, each block of row tiles m_1..m_r of a:
            aT[i][k] = transpose(a[g, m_i, k]) for each row tile and 128-wide k tile
            for each 512-wide column tile n:
                for each k tile: b_k = b[g, k, n]; acc_i += aT[i][k].T @ b_k for every i   (PSUM, float32)
                out[g, m_i, n] = acc_i + bias[n]
    """
    G, M, K = a_hbm.shape
    N = b_hbm.shape[2]
    shared_b = b_hbm.shape[0] == 1
    out_hbm = nl.ndarray((G, M, N), dtype=a_hbm.dtype, buffer=nl.shared_hbm)
    block_rows = TILE_M * rows_per_block(K, 4 if a_hbm.dtype == nl.float32 else 2)

    for g in range(G):
        gb = 0 if shared_b else g
        for r0 in range(0, M, block_rows):
            _row_block(a_hbm, b_hbm, bias_hbm, out_hbm, g, gb, r0, block_rows)
    return out_hbm


def _row_block(a_hbm, b_hbm, bias_hbm, out_hbm, g, gb, r0, block_rows):
    """Rows r0:r0+block_rows of out[g]: their aT tiles, then every column tile. A function of its own, so
    that one block's tiles are released before the next block's are allocated."""
    M, K = a_hbm.shape[1], a_hbm.shape[2]
    N = b_hbm.shape[2]
    n_k = cdiv(K, TILE_K)
    row_tiles, aT_tiles = [], []  # plain loops and appends, as elsewhere in opport's kernels
    for m0, mt in spans(min(M, r0 + block_rows), TILE_M, r0):  # block_rows: whole row tiles
        row_tiles.append((m0, mt))
        aT_tiles.append(_transposed_row_tile(a_hbm, g, m0, mt, n_k))
    for n0, nt in spans(N, TILE_N):
        _column_tile(b_hbm, bias_hbm, out_hbm, g, gb, row_tiles, aT_tiles, n0, nt)


def _column_tile(b_hbm, bias_hbm, out_hbm, g, gb, row_tiles, aT_tiles, n0, nt):
    """out[g, rows, n0:n0+nt] for every row tile of the block: each tile of b is DMA'd once and multiplied
    into every row tile's PSUM accumulator; then the accumulators are evicted with the bias added."""
    K = b_hbm.shape[1]
    has_bias = bias_hbm != None  # noqa: E711 (NKI kernels compare with None by value)
    accs = []
    for i in range(len(row_tiles)):
        accs.append(nl.ndarray((row_tiles[i][1], nt), dtype=nl.float32, buffer=nl.psum))
    for k, (k0, kt) in enumerate(spans(K, TILE_K)):
        b_sb = nl.ndarray((kt, nt), dtype=b_hbm.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=b_sb, src=b_hbm[gb, k0:k0 + kt, n0:n0 + nt])
        for i in range(len(row_tiles)):
            nisa.nc_matmul(dst=accs[i], stationary=aT_tiles[i][k], moving=b_sb)
    if has_bias:
        bias_sb = nl.ndarray((row_tiles[0][1], nt), dtype=bias_hbm.dtype, buffer=nl.sbuf)
        load_row_broadcast(bias_sb, bias_hbm, n0, nt, row_tiles[0][1])
    for i in range(len(row_tiles)):
        m0, mt = row_tiles[i]
        res_sb = nl.ndarray((mt, nt), dtype=out_hbm.dtype, buffer=nl.sbuf)
        if has_bias:
            nisa.tensor_tensor(dst=res_sb, data1=accs[i], data2=bias_sb[0:mt, 0:nt], op=nl.add)
        else:
            nisa.tensor_copy(dst=res_sb, src=accs[i])
        nisa.dma_copy(dst=out_hbm[g, m0:m0 + mt, n0:n0 + nt], src=res_sb)


def _transposed_row_tile(a_hbm, g, m0, mt, n_k):
    """The aT tiles [kt, mt] of rows m0:m0+mt of a[g], one per 128-wide k tile: a row-major DMA each,
    transposed on TensorE through PSUM into SBUF."""
    K = a_hbm.shape[2]
    tiles = []
    for k0, kt in spans(K, TILE_K):
        a_sb = nl.ndarray((mt, kt), dtype=a_hbm.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=a_sb, src=a_hbm[g, m0:m0 + mt, k0:k0 + kt])
        aT_psum = nl.ndarray((kt, mt), dtype=a_hbm.dtype, buffer=nl.psum)
        nisa.nc_transpose(dst=aT_psum, data=a_sb)
        aT_sb = nl.ndarray((kt, mt), dtype=a_hbm.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=aT_sb, src=aT_psum)
        tiles.append(aT_sb)
    return tiles


@impl(spec, "neuron")
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


# --------------------------------------------------------------------------- backward

DA_TILES = 6  # row tiles whose da accumulators (one PSUM bank each) share every loaded tile of b, as in the forward
DB_CHUNKS = 3  # 512-column chunks of db accumulated at once (plus as many of dbias): 6 PSUM banks
ROWS_BUDGET = 96 * 1024  # SBUF bytes per partition for one batch entry's rows of a and grad, kept for both products


@nki.jit
def _matmul_backward_kernel(g_hbm, a_hbm, b_hbm, with_bias):
    """Gradients of a @ b + bias: da = grad b^T, db = a^T grad, dbias = grad summed over rows.

    Dimensions:
        G: batch entries (1 when b is shared: the host folds a's batch into the rows); M: rows (tiles of 128,
        the partitions of grad, a and da, and the contraction of db); K: a's columns (the contraction of the
        forward; da's 512-column chunks, db's 128-row tiles); N: grad's columns (the contraction of da in
        128-wide tiles; db's and dbias's 512-column chunks).

    Args:
        g_hbm: [G, M, N] upstream gradient, float32/float16/bfloat16.
        a_hbm: [G, M, K] and b_hbm: [G, K, N] in grad's dtype, or both None when K = 0 (dbias only).
        with_bias: compile-time bool: also return dbias.

    Returns:
        (da_hbm [G, M, K], db_hbm [G, K, N], dbias_hbm [1, N] or None) in grad's dtype; (dbias_hbm,) when a is None.

    Notes:
        nc_matmul contracts over the partitions. db = a^T grad contracts over rows, which already lie on
        the partitions: the row-major tiles of a (stationary) and grad (moving) go in as loaded, and every
        row tile of the batch entry accumulates into the same float32 PSUM banks. dbias is the same product
        with an all-ones column as the stationary: the reduction across partitions runs on TensorE. da = grad
        b^T contracts over N, so each 128-wide slice of grad and each [128 k, 128 n] piece of b (loaded 512
        columns per DMA) is transposed on TensorE; each transposed piece of b serves up to DA_TILES row tiles'
        accumulators (b is read once per DA_TILES * 128 rows, as the forward reads its b). The rows of a
        and grad of a batch entry stay in SBUF for both products when they fit ROWS_BUDGET bytes per
        partition: then grad and a are read once (else re-read by each pass and each db panel). Sums over
        rows keep a fixed order.

    Pseudocode:
        for g:
            rows = a[g], grad[g] in 128-row tiles (kept in SBUF if they fit)
            for each block of <= 6 row tiles, each 512-wide k chunk:
                for each 128-wide n tile: bT = b[g, k chunk, n tile]^T; acc_i += grad_i[:, n tile] @ bT
                da[g, rows_i, k chunk] = acc_i
            for each 128-wide k tile, each panel of 3 x 512 n columns:
                acc_c = sum over row tiles of a_i[:, k]^T @ grad_i[:, c]; (k = 0) bias_c += ones^T @ grad_i[:, c]
                db[g, k, c] = acc_c
        dbias = sum over g of bias
    """
    G, M, N = g_hbm.shape
    has_ab = a_hbm != None  # noqa: E711 (NKI kernels compare with None by value)
    if has_ab:
        K = a_hbm.shape[2]
        da_hbm = nl.ndarray((G, M, K), dtype=g_hbm.dtype, buffer=nl.shared_hbm)
        db_hbm = nl.ndarray((G, K, N), dtype=g_hbm.dtype, buffer=nl.shared_hbm)
    item = 4 if g_hbm.dtype == nl.float32 else 2
    n_rt = cdiv(M, TILE_M)
    resident = n_rt * ((K if has_ab else 0) + N) * item <= ROWS_BUDGET
    bias_sb = None
    if with_bias:
        bias_sb = nl.ndarray((1, N), dtype=nl.float32, buffer=nl.sbuf)  # dbias summed over the batch entries
        nisa.memset(dst=bias_sb, value=0.0)
    for g in range(G):
        tiles = []  # (first row, rows, a tile or None, grad tile or None)
        for m0, mt in spans(M, TILE_M):
            a_sb = _rows_of(a_hbm, None, g, m0, mt, 0, K) if resident and has_ab else None
            g_sb = _rows_of(g_hbm, None, g, m0, mt, 0, N) if resident else None
            tiles.append((m0, mt, a_sb, g_sb))
        if has_ab:
            _da_pass(g_hbm, b_hbm, da_hbm, g, tiles)
        _db_pass(g_hbm, a_hbm, db_hbm if has_ab else None, bias_sb, g, tiles)
    dbias_hbm = None
    if with_bias:
        dbias_hbm = nl.ndarray((1, N), dtype=g_hbm.dtype, buffer=nl.shared_hbm)
        cast_sb = nl.ndarray((1, N), dtype=g_hbm.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=cast_sb, src=bias_sb)
        nisa.dma_copy(dst=dbias_hbm, src=cast_sb)
    if has_ab:
        return da_hbm, db_hbm, dbias_hbm
    return (dbias_hbm,)


def _rows_of(x_hbm, x_sb, g, m0, mt, c0, c):
    """x[g, m0:m0+mt, c0:c0+c]: a view of the resident row tile x_sb, or (x_sb None) a tile loaded by one DMA."""
    if x_sb != None:  # noqa: E711
        return x_sb[0:mt, c0:c0 + c]
    t_sb = nl.ndarray((mt, c), dtype=x_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t_sb, src=x_hbm[g, m0:m0 + mt, c0:c0 + c])
    return t_sb


def _da_pass(g_hbm, b_hbm, da_hbm, g, tiles):
    """da[g] = grad[g] b[g]^T: per block of DA_TILES row tiles and 512-wide chunk of K, accumulate over N in PSUM."""
    N, K = g_hbm.shape[2], b_hbm.shape[1]
    for i0 in range(0, len(tiles), DA_TILES):
        block = tiles[i0:i0 + DA_TILES]
        for kc0, kc in spans(K, TILE_N):
            accs = []
            for t in block:
                accs.append(nl.ndarray((t[1], kc), dtype=nl.float32, buffer=nl.psum))
            for nb0, nb in spans(N, TILE_N):
                b_tiles = _b_rows(b_hbm, g, kc0, kc, nb0, nb)
                for nt0, nt in spans(nb0 + nb, TILE_K, nb0):
                    bT_sb = _b_transposed(b_tiles, nt0 - nb0, nt, kc)
                    for i in range(len(block)):
                        m0, mt, _, g_sb = block[i]
                        gT_sb = _transposed_sb(_rows_of(g_hbm, g_sb, g, m0, mt, nt0, nt))
                        nisa.nc_matmul(dst=accs[i], stationary=gT_sb, moving=bT_sb)
            for i in range(len(block)):
                m0, mt = block[i][0], block[i][1]
                da_sb = nl.ndarray((mt, kc), dtype=da_hbm.dtype, buffer=nl.sbuf)
                nisa.tensor_copy(dst=da_sb, src=accs[i])
                nisa.dma_copy(dst=da_hbm[g, m0:m0 + mt, kc0:kc0 + kc], src=da_sb)


def _b_rows(b_hbm, g, kc0, kc, nb0, nb):
    """b[g, kc0:kc0+kc, nb0:nb0+nb] as row-major [<=128, nb] tiles: one DMA each of up to 512 columns (2 KiB per
    partition in float32, where [128, 128] loads would move 512 B per partition per transfer)."""
    tiles = []
    for j0, kj in spans(kc, TILE_K):
        b_sb = nl.ndarray((kj, nb), dtype=b_hbm.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=b_sb, src=b_hbm[g, kc0 + j0:kc0 + j0 + kj, nb0:nb0 + nb])
        tiles.append(b_sb)
    return tiles


def _b_transposed(b_tiles, c0, nt, kc):
    """Columns c0:c0+nt of the [kc, nb] block held by b_tiles, transposed to [nt, kc] in SBUF on TensorE."""
    bT_sb = nl.ndarray((nt, kc), dtype=b_tiles[0].dtype, buffer=nl.sbuf)
    for j in range(len(b_tiles)):
        kj = b_tiles[j].shape[0]
        bT_psum = nl.ndarray((nt, kj), dtype=bT_sb.dtype, buffer=nl.psum)
        nisa.nc_transpose(dst=bT_psum, data=b_tiles[j][0:kj, c0:c0 + nt])
        nisa.tensor_copy(dst=bT_sb[0:nt, j * TILE_K:j * TILE_K + kj], src=bT_psum)
    return bT_sb


def _transposed_sb(x_sb):
    """x^T in SBUF through a TensorE transpose (bit-exact from NeuronCore-v3)."""
    p, f = x_sb.shape[0], x_sb.shape[1]
    xT_psum = nl.ndarray((f, p), dtype=x_sb.dtype, buffer=nl.psum)
    nisa.nc_transpose(dst=xT_psum, data=x_sb)
    xT_sb = nl.ndarray((f, p), dtype=x_sb.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=xT_sb, src=xT_psum)
    return xT_sb


def _db_pass(g_hbm, a_hbm, db_hbm, bias_sb, g, tiles):
    """db[g] = a[g]^T grad[g] per [128, DB_CHUNKS x 512] panel, and (bias_sb not None) bias_sb += ones^T grad[g],
    each summed over every row tile in one set of PSUM accumulators."""
    N = g_hbm.shape[2]
    K = a_hbm.shape[2] if db_hbm != None else 0  # noqa: E711
    ones_sb = nl.ndarray((TILE_M, 1), dtype=g_hbm.dtype, buffer=nl.sbuf)
    nisa.memset(dst=ones_sb, value=1.0)
    for kt0 in range(0, max(K, 1), TILE_K):  # K = 0 (dbias only): one sweep without db
        kt = min(TILE_K, K - kt0)
        for n0 in range(0, N, TILE_N * DB_CHUNKS):
            chunks = spans(min(N, n0 + TILE_N * DB_CHUNKS), TILE_N, n0)  # whole TILE_N chunks but the last
            want_bias = bias_sb != None and kt0 == 0  # noqa: E711
            db_accs, bias_accs = [], []
            for _, nc in chunks:
                if kt > 0:
                    db_accs.append(nl.ndarray((kt, nc), dtype=nl.float32, buffer=nl.psum))
                if want_bias:
                    bias_accs.append(nl.ndarray((1, nc), dtype=nl.float32, buffer=nl.psum))
            for m0, mt, a_sb, g_sb in tiles:
                g_t_sb = _rows_of(g_hbm, g_sb, g, m0, mt, n0, chunks[-1][0] + chunks[-1][1] - n0)
                a_t_sb = _rows_of(a_hbm, a_sb, g, m0, mt, kt0, kt) if kt > 0 else None
                for c in range(len(chunks)):
                    cols = g_t_sb[0:mt, chunks[c][0] - n0:chunks[c][0] - n0 + chunks[c][1]]
                    if kt > 0:
                        nisa.nc_matmul(dst=db_accs[c], stationary=a_t_sb, moving=cols)
                    if want_bias:
                        nisa.nc_matmul(dst=bias_accs[c], stationary=ones_sb[0:mt, 0:1], moving=cols)
            for c in range(len(chunks)):
                c0, nc = chunks[c]
                if kt > 0:
                    db_sb = nl.ndarray((kt, nc), dtype=db_hbm.dtype, buffer=nl.sbuf)
                    nisa.tensor_copy(dst=db_sb, src=db_accs[c])
                    nisa.dma_copy(dst=db_hbm[g, kt0:kt0 + kt, c0:c0 + nc], src=db_sb)
                if want_bias:
                    nisa.tensor_tensor(dst=bias_sb[0:1, c0:c0 + nc], data1=bias_sb[0:1, c0:c0 + nc], data2=bias_accs[c],
                                       op=nl.add)


@impl(spec.backward_op, "neuron")
def matmul_backward(grad: np.ndarray, a: np.ndarray, b: np.ndarray, bias) -> tuple:
    """Host side: a shared b folds a's batch into the rows (db sums over all of them in-kernel); a batched b keeps
    its batch. Empty sums (no rows, or N = 0) are zeros; with K = 0 only dbias has terms."""
    k, n = b.shape[-2:]
    rows = math.prod(a.shape[:-1])
    dt = np_dtype(a.dtype.name)
    if rows == 0 or n == 0:
        return np.zeros(a.shape, dt), np.zeros(b.shape, dt), None if bias is None else np.zeros(bias.shape, dt)
    g3 = _host.contiguous(grad).reshape(1, rows, n) if b.ndim == 2 else _host.contiguous(grad).reshape(-1, a.shape[-2], n)
    if k == 0:
        dbias = None if bias is None else _host.run(_matmul_backward_kernel, g3, None, None, True)[0]
        return np.zeros(a.shape, dt), np.zeros(b.shape, dt), \
            None if dbias is None else _host.as_dtype(dbias, a.dtype.name, bias.shape)
    a3 = _host.contiguous(a).reshape(g3.shape[0], g3.shape[1], k)
    b3 = _host.contiguous(b).reshape(-1, k, n)
    da, db, dbias = _host.run(_matmul_backward_kernel, g3, a3, b3, bias is not None)
    return (_host.as_dtype(da, a.dtype.name, a.shape), _host.as_dtype(db, a.dtype.name, b.shape),
            None if bias is None else _host.as_dtype(dbias, a.dtype.name, bias.shape))

"""linear_cross_entropy on NKI: logit tiles made on TensorE in PSUM, folded into the loss there, never in HBM.

Rows (tokens) lie on the 128 partitions; the vocabulary is walked in tiles on the free dimension. A logit
tile [rows, vocab tile] is hT[k]^T @ wT[k] accumulated over 128-wide k tiles of H in float32 PSUM; the host
hands the kernels hidden^T [H, N] and weight^T [H, V] contiguous (a layout copy of each, so both operands'
contraction dim H lies on the partitions without TensorE transposes per tile). Extra memory on the device:
SBUF tiles and the [N] loss/lse; the N x V logits never exist.
"""

from __future__ import annotations

import numpy as np

from opport.backends.neuron import _host
from opport.backends.neuron._loss_rows import (
    column_hits,
    column_iota,
    declines,
    gradient_rows,
    loss_sum,
    store_loss,
    store_reduced_loss,
    target_tile,
    targets32,
)
from opport.backends.neuron._softmax_steps import online_step, running_state
from opport.backends.neuron._tiles import load_row_broadcast, spans
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.dispatch import impl
from opport.ops.linear_cross_entropy import linear_cross_entropy as spec

TILE_K = 128  # contraction (H) rows per nc_matmul: the partitions
TILE_V = 512  # forward vocabulary tile: one 2 KiB PSUM bank of float32 (gemm_moving_fmax)
TILE_VB = 128  # backward vocabulary tile: dlogits is a stationary operand (free size <= 128) for dweight
TILE_H = 512  # dhidden / dweight column chunk: one PSUM bank


def _logit_tile(hT_tiles, wT_hbm, b_hbm, v0, vt, p, softcap, scale=1.0):
    """(z, tanh(logits / softcap) or None): float32 [p, vt] logits of one row tile's hT tiles against weight rows
    v0:v0+vt, plus the bias (replicated across partitions by load_row_broadcast), softcapped on ScalarE, times
    `scale` (linear_logprobs' 1 / temperature: z = softcap · tanh(a / softcap) · scale)."""
    H = wT_hbm.shape[0]
    z_psum = nl.ndarray((p, vt), dtype=nl.float32, buffer=nl.psum)
    for k, (k0, kt) in enumerate(spans(H, TILE_K)):
        wT_sb = nl.ndarray((kt, vt), dtype=wT_hbm.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=wT_sb, src=wT_hbm[k0:k0 + kt, v0:v0 + vt])
        nisa.nc_matmul(dst=z_psum, stationary=hT_tiles[k], moving=wT_sb)
    z_sb = nl.ndarray((p, vt), dtype=nl.float32, buffer=nl.sbuf)
    if b_hbm != None:  # noqa: E711 (NKI kernels compare with None by value)
        b_sb = nl.ndarray((p, vt), dtype=b_hbm.dtype, buffer=nl.sbuf)
        load_row_broadcast(b_sb, b_hbm, v0, vt, p)
        nisa.tensor_tensor(dst=z_sb, data1=z_psum, data2=b_sb, op=nl.add)
    else:
        nisa.tensor_copy(dst=z_sb, src=z_psum)
    if softcap == None:  # noqa: E711
        if scale != 1.0:
            nisa.tensor_scalar(dst=z_sb, data=z_sb, op0=nl.multiply, operand0=float(scale))
        return z_sb, None
    th_sb = nl.ndarray((p, vt), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=th_sb, op=nl.tanh, data=z_sb, scale=1.0 / softcap)
    nisa.tensor_scalar(dst=z_sb, data=th_sb, op0=nl.multiply, operand0=float(softcap) * float(scale))
    return z_sb, th_sb


def _hT_tiles(hT_hbm, r0, p):
    """hidden^T [kt, p] tiles of rows r0:r0+p, one per 128-wide k tile of H (the stationary operands)."""
    H = hT_hbm.shape[0]
    tiles = []
    for k0, kt in spans(H, TILE_K):
        t_sb = nl.ndarray((kt, p), dtype=hT_hbm.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t_sb, src=hT_hbm[k0:k0 + kt, r0:r0 + p])
        tiles.append(t_sb)
    return tiles


@nki.jit
def _linear_cross_entropy_forward_kernel(hT_hbm, wT_hbm, b_hbm, target_hbm, ignore_index, reduction, label_smoothing, softcap):
    """The loss of hidden @ weight.T (+ bias), softcapped, against int32 targets, and each row's logsumexp.

    Dimensions:
        N: rows (tiles of 128 on the partitions); H: hidden (the contraction, 128-row k tiles);
        V: vocabulary (512-column tiles on the free dim, one PSUM bank each).

    Args:
        hT_hbm: [H, N] hidden transposed (a host layout copy), float32/float16/bfloat16.
        wT_hbm: [H, V] weight transposed, hidden's dtype.
        b_hbm: [V] bias in hidden's dtype, or None.
        target_hbm: [N] int32 class indices (clipped to +-(2^24 + 1) by the host).
        ignore_index, reduction, label_smoothing, softcap: compile-time, as the op's.

    Returns:
        (out_hbm, lse_hbm): float32 loss [N, 1] for "none", else [1, 1]; lse [N, 1] float32.

    Notes:
        Per row tile the hT tiles are loaded once; per vocabulary tile the logits accumulate over k in one
        PSUM bank (float32), the eviction adds the bias, ScalarE applies tanh for the softcap, then the tile
        is folded into the running max m (start -FLT_MAX: no exp(-inf + inf)), the running sum s of
        exp(z - m) (one ScalarE exp with its row sum, the old sum rescaled by exp(m_old - m)), the target's
        logit (an iota/is_equal one-hot times z, reduced) and for smoothing the row sum of z. Loss =
        (m - z_t) + log(s), smoothed (1 - eps) loss + eps ((m - sum(z)/V) + log(s)); out-of-range targets NaN,
        ignored rows 0 (predicated copies). "sum"/"mean" reduce [loss, kept] across partitions on TensorE.

    Pseudocode:
        for each 128-row tile: hT = hidden^T tiles; m = -FLT_MAX; s = 0
            for each 512-wide vocabulary tile: z = sum_k hT[k]^T wT[k, tile] (+ b) (softcap)
                m' = max(m, max z); s = s exp(m - m') + sum exp(z - m'); z_t += sum(z [col == t])
            loss = (m - z_t) + log(s) (smoothed); NaN / 0 rows; store or accumulate
    """
    H, N = hT_hbm.shape
    V = wT_hbm.shape[1]
    PMAX = nl.tile_size.pmax
    p_all = min(PMAX, N)
    out_hbm = nl.ndarray((N, 1) if reduction == "none" else (1, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    lse_hbm = nl.ndarray((N, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    cols_sb = column_iota(p_all, min(TILE_V, V))
    acc = None if reduction == "none" else loss_sum(p_all)
    for r0, p in spans(N, PMAX):
        t_f_sb = target_tile(target_hbm, r0, p)
        loss_sb, lse_sb = _row_tile_loss(hT_hbm, wT_hbm, b_hbm, cols_sb, t_f_sb, r0, p, float(label_smoothing),
                                         softcap)
        nisa.dma_copy(dst=lse_hbm[r0:r0 + p, 0:1], src=lse_sb)
        store_loss(out_hbm, acc, loss_sb, t_f_sb, ignore_index, V, r0, p)
    if reduction != "none":
        store_reduced_loss(out_hbm, acc, reduction)
    return out_hbm, lse_hbm


def _row_tile_loss(hT_hbm, wT_hbm, b_hbm, cols_sb, t_f_sb, r0, p, eps, softcap):
    """(loss, lse) float32 [p, 1] of one row tile, before the NaN / ignored-row fixes (the forward's Notes)."""
    V = wT_hbm.shape[1]
    hT_tiles = _hT_tiles(hT_hbm, r0, p)
    m_sb, s_sb = running_state(p)
    zt_sb, zsum_sb = (nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf) for _ in range(2))
    for t_sb in (zt_sb, zsum_sb):
        nisa.memset(dst=t_sb, value=0.0)
    for v0, vt in spans(V, TILE_V):
        z_sb, _ = _logit_tile(hT_tiles, wT_hbm, b_hbm, v0, vt, p, softcap)
        pick_sb = nl.ndarray((p, vt), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=pick_sb, data1=z_sb, data2=column_hits(cols_sb, t_f_sb, v0, p, vt), op=nl.multiply)
        part_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=part_sb, op=nl.add, data=pick_sb, axis=1, keepdims=True)
        nisa.tensor_tensor(dst=zt_sb, data1=zt_sb, data2=part_sb, op=nl.add)
        if eps > 0.0:
            nisa.tensor_reduce(dst=part_sb, op=nl.add, data=z_sb, axis=1, keepdims=True)
            nisa.tensor_tensor(dst=zsum_sb, data1=zsum_sb, data2=part_sb, op=nl.add)
        m_sb = online_step(m_sb, s_sb, z_sb)[0]  # e is dead at once: only its row sum is kept
    log_s_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=log_s_sb, op=nl.log, data=s_sb)
    lse_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=lse_sb, data1=m_sb, data2=log_s_sb, op=nl.add)
    loss_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)  # (m - z_t) + log(s)
    nisa.tensor_tensor(dst=loss_sb, data1=m_sb, data2=zt_sb, op=nl.subtract)
    nisa.tensor_tensor(dst=loss_sb, data1=loss_sb, data2=log_s_sb, op=nl.add)
    if eps > 0.0:  # (1 - eps) loss + eps ((m - sum(z) / V) + log(s)): not lse - mean, which loses log(s) at |m| ~ 1e35
        smooth_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=smooth_sb, data=zsum_sb, op0=nl.multiply, operand0=-1.0 / V, op1=nl.add,
                                  operand1=m_sb)
        nisa.tensor_tensor(dst=smooth_sb, data1=smooth_sb, data2=log_s_sb, op=nl.add)
        nisa.tensor_scalar(dst=smooth_sb, data=smooth_sb, op0=nl.multiply, operand0=eps)
        nisa.scalar_tensor_tensor(dst=loss_sb, data=loss_sb, op0=nl.multiply, operand0=1.0 - eps, op1=nl.add,
                                  operand1=smooth_sb)
    return loss_sb, lse_sb


def _supports(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, softcap):
    if hidden.shape[1] == 0:
        return "H = 0: an empty contraction, nothing for TensorE to accumulate (the cpu kernel gives the bias' loss)"
    return declines(weight.shape[0], ignore_index)


def _layouts(hidden, weight, bias) -> tuple:
    """hidden^T [H, N] and weight^T [H, V] contiguous (H on the partitions for both operands), bias contiguous."""
    return (np.ascontiguousarray(hidden.T), np.ascontiguousarray(weight.T),
            None if bias is None else _host.contiguous(bias))


@impl(spec, "neuron", supports=_supports)
def linear_cross_entropy(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, softcap):
    return linear_cross_entropy_forward(hidden, weight, target, bias, ignore_index, reduction, label_smoothing,
                                        softcap)[0]


@impl(spec.train_forward, "neuron", supports=_supports)
def linear_cross_entropy_forward(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, softcap):
    """Host side: the transposed layouts, int32 targets, launch; no rows: an empty "none", 0 sum, NaN mean."""
    n = hidden.shape[0]
    if n == 0:
        loss = np.empty(0, np.float32) if reduction == "none" else np.full((), 0.0 if reduction == "sum" else np.nan,
                                                                           np.float32)
        return loss, np.empty(0, np.float32)
    hT, wT, b = _layouts(hidden, weight, bias)
    out, lse = _host.run(_linear_cross_entropy_forward_kernel, hT, wT, b, targets32(target), int(ignore_index), reduction,
                         float(label_smoothing), None if softcap is None else float(softcap))
    return _host.as_dtype(out, "float32", (n,) if reduction == "none" else ()), _host.as_dtype(lse, "float32", (n,))


# --------------------------------------------------------------------------- backward


@nki.jit
def _linear_cross_entropy_backward_kernel(grad_hbm, h_hbm, hT_hbm, w_hbm, wT_hbm, b_hbm, target_hbm, lse_hbm,
                                          ignore_index, reduction, label_smoothing, softcap):
    """dhidden, dweight, dbias of linear_cross_entropy from the saved lse, the logits recomputed tile by tile.

    Dimensions:
        N: rows (128-row tiles on the partitions); H: hidden (128-row k tiles of the logits' contraction,
        512-column chunks of the gradients); V: vocabulary (128-column tiles: dlogits is a stationary operand).

    Args:
        grad_hbm: float32 upstream gradient, [N] for "none", else [1].
        h_hbm: [N, H] hidden; hT_hbm: [H, N] its transpose; w_hbm: [V, H] weight; wT_hbm: [H, V] its transpose;
        b_hbm: [V] bias or None; all in hidden's dtype.
        target_hbm: [N] int32; lse_hbm: [N] float32, the training forward's logsumexp.
        ignore_index, reduction, label_smoothing, softcap: compile-time, as the op's.

    Returns:
        (dh_hbm [N, H], dw_hbm [V, H], db_hbm [1, V] or None) in hidden's dtype.

    Notes:
        dlogits of a [rows, 128] tile: the logits as the forward's (PSUM over k, bias, tanh), then
        c (exp(z - lse) - (1 - eps) [col == t] - eps/V) (1 - tanh²), ignored rows 0 by a predicated copy
        (after the softcap factor, so NaN logits there cannot leak), c NaN for targets outside [0, V); c is
        grad[i], or grad (/ kept rows for "mean", counted on TensorE) as cross_entropy's backward.
        Two sweeps, each recomputing the logits once (no dlogits in HBM, no atomics): rows outside for
        dhidden = dlogits @ weight (dlogits transposed on TensorE to put the vocabulary on the partitions;
        weight rows as loaded), accumulated over vocabulary tiles in a float32 SBUF row [p, H]; vocabulary
        tiles outside for dweight = dlogits^T @ hidden and dbias = dlogits^T @ ones (rows already on the
        partitions), accumulated over row tiles in a float32 SBUF tile [128, H]. The gradient products run
        in float32 (the 16-bit operand widened in SBUF): dlogits rounded to 16 bits would cost the gradients
        10-20x the RMSE of one rounding (measured on the cuda kernel). Sums keep a fixed order.

    Pseudocode:
        c = grad, or grad / max(1, kept)
        for each row tile: for each vocabulary tile: d = dlogits(tile); dh[rows] += d @ w[tile]
        for each vocabulary tile: for each row tile: d = dlogits(tile); dw[tile] += d^T h[rows]; db[tile] += d^T 1
    """
    H, N = hT_hbm.shape
    V = wT_hbm.shape[1]
    dh_hbm = nl.ndarray((N, H), dtype=h_hbm.dtype, buffer=nl.shared_hbm)
    dw_hbm = nl.ndarray((V, H), dtype=h_hbm.dtype, buffer=nl.shared_hbm)
    has_bias = b_hbm != None  # noqa: E711
    cols_sb = column_iota(min(nl.tile_size.pmax, N), TILE_VB)
    rows = gradient_rows(grad_hbm, target_hbm, lse_hbm, ignore_index, reduction, V)  # (r0, p, t, c, ignored, -lse)
    dlogits = (_dlogits, (wT_hbm, b_hbm, cols_sb, float(label_smoothing), softcap))
    for row in rows:
        dhidden_rows(row, h_hbm, hT_hbm, w_hbm, dh_hbm, dlogits)
    if has_bias:
        db_hbm = nl.ndarray((1, V), dtype=h_hbm.dtype, buffer=nl.shared_hbm)
    else:
        db_hbm = None
    for v0, vt in spans(V, TILE_VB):
        dweight_tile(rows, v0, vt, h_hbm, hT_hbm, dw_hbm, db_hbm, dlogits)
    return dh_hbm, dw_hbm, db_hbm


def _dlogits(row, hT_tiles, v0, vt, wT_hbm, b_hbm, cols_sb, eps, softcap):
    """float32 dlogits [p, vt] of one row tile and vocabulary tile (the backward's Notes)."""
    V = wT_hbm.shape[1]
    _, p, t_f_sb, c_sb, ign_sb, neg_lse_sb = row
    z_sb, th_sb = _logit_tile(hT_tiles, wT_hbm, b_hbm, v0, vt, p, softcap)
    d_sb = nl.ndarray((p, vt), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=d_sb, op=nl.exp, data=z_sb, bias=neg_lse_sb)
    nisa.scalar_tensor_tensor(dst=d_sb, data=column_hits(cols_sb, t_f_sb, v0, p, vt), op0=nl.multiply,
                              operand0=eps - 1.0, op1=nl.add, operand1=d_sb)
    nisa.tensor_scalar(dst=d_sb, data=d_sb, op0=nl.subtract, operand0=eps / V, op1=nl.multiply, operand1=c_sb)
    if th_sb != None:  # noqa: E711 (times 1 - tanh², before the ignored rows are zeroed)
        sq_sb = nl.ndarray((p, vt), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=sq_sb, data1=th_sb, data2=th_sb, op=nl.multiply)
        nisa.tensor_scalar(dst=sq_sb, data=sq_sb, op0=nl.multiply, operand0=-1.0, op1=nl.add, operand1=1.0)
        nisa.tensor_tensor(dst=d_sb, data1=d_sb, data2=sq_sb, op=nl.multiply)
    nisa.tensor_copy_predicated(dst=d_sb, src=0.0, predicate=ign_sb.broadcast(1, vt))
    return d_sb


def _widened(src_hbm, r0, p, c0, c):
    """src[r0:r0+p, c0:c0+c] as a float32 SBUF tile (one DMA, one VectorE copy)."""
    t_sb = nl.ndarray((p, c), dtype=src_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t_sb, src=src_hbm[r0:r0 + p, c0:c0 + c])
    w_sb = nl.ndarray((p, c), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=w_sb, src=t_sb)
    return w_sb


def dhidden_rows(row, h_hbm, hT_hbm, w_hbm, dh_hbm, dlogits):
    """dh[rows] = sum over vocabulary tiles of dlogits @ weight[tile], in a float32 SBUF row accumulator.
    dlogits = (fn, args): fn(row, hT_tiles, v0, vt, *args) gives the float32 [p, vt] tile (shared with
    linear_logprobs, whose dlogits differ)."""
    r0, p = row[0], row[1]
    H, V = h_hbm.shape[1], w_hbm.shape[0]
    hT_tiles = _hT_tiles(hT_hbm, r0, p)
    acc_sb = nl.ndarray((p, H), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=acc_sb, value=0.0)
    for v0, vt in spans(V, TILE_VB):
        d_sb = dlogits[0](row, hT_tiles, v0, vt, *dlogits[1])
        dT_psum = nl.ndarray((vt, p), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_transpose(dst=dT_psum, data=d_sb)
        dT_sb = nl.ndarray((vt, p), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=dT_sb, src=dT_psum)
        for h0, hc in spans(H, TILE_H):
            part_psum = nl.ndarray((p, hc), dtype=nl.float32, buffer=nl.psum)
            nisa.nc_matmul(dst=part_psum, stationary=dT_sb, moving=_widened(w_hbm, v0, vt, h0, hc))
            nisa.tensor_tensor(dst=acc_sb[0:p, h0:h0 + hc], data1=acc_sb[0:p, h0:h0 + hc], data2=part_psum, op=nl.add)
    out_sb = nl.ndarray((p, H), dtype=dh_hbm.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=out_sb, src=acc_sb)
    nisa.dma_copy(dst=dh_hbm[r0:r0 + p, 0:H], src=out_sb)


def dweight_tile(rows, v0, vt, h_hbm, hT_hbm, dw_hbm, db_hbm, dlogits):
    """dw[v0:v0+vt] = sum over row tiles of dlogits^T @ hidden[rows] (and db = dlogits^T @ ones), float32 in SBUF;
    dlogits as dhidden_rows'."""
    H = h_hbm.shape[1]
    acc_sb = nl.ndarray((vt, H), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=acc_sb, value=0.0)
    has_bias = db_hbm != None  # noqa: E711
    if has_bias:
        bacc_sb = nl.ndarray((vt, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=bacc_sb, value=0.0)
        ones_sb = nl.ndarray((rows[0][1], 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=ones_sb, value=1.0)
    for row in rows:
        r0, p = row[0], row[1]
        d_sb = dlogits[0](row, _hT_tiles(hT_hbm, r0, p), v0, vt, *dlogits[1])
        for h0, hc in spans(H, TILE_H):
            part_psum = nl.ndarray((vt, hc), dtype=nl.float32, buffer=nl.psum)
            nisa.nc_matmul(dst=part_psum, stationary=d_sb, moving=_widened(h_hbm, r0, p, h0, hc))
            nisa.tensor_tensor(dst=acc_sb[0:vt, h0:h0 + hc], data1=acc_sb[0:vt, h0:h0 + hc], data2=part_psum, op=nl.add)
        if has_bias:
            b_psum = nl.ndarray((vt, 1), dtype=nl.float32, buffer=nl.psum)
            nisa.nc_matmul(dst=b_psum, stationary=d_sb, moving=ones_sb[0:p, 0:1])
            nisa.tensor_tensor(dst=bacc_sb, data1=bacc_sb, data2=b_psum, op=nl.add)
    out_sb = nl.ndarray((vt, H), dtype=dw_hbm.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=out_sb, src=acc_sb)
    nisa.dma_copy(dst=dw_hbm[v0:v0 + vt, 0:H], src=out_sb)
    if has_bias:  # [vt, 1] on the partitions -> the row db[0, v0:v0+vt] through a TensorE transpose
        bT_psum = nl.ndarray((1, vt), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_transpose(dst=bT_psum, data=bacc_sb)
        brow_sb = nl.ndarray((1, vt), dtype=db_hbm.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=brow_sb, src=bT_psum)
        nisa.dma_copy(dst=db_hbm[0:1, v0:v0 + vt], src=brow_sb)


def _supports_backward(grad, hidden, weight, target, lse, bias, ignore_index, reduction, label_smoothing, softcap):
    return _supports(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, softcap)


@impl(spec.backward_op, "neuron", supports=_supports_backward)
def linear_cross_entropy_backward(grad, hidden, weight, target, lse, bias, ignore_index, reduction, label_smoothing,
                                  softcap):
    """Host side: layouts (hidden, weight and their transposes), grad as a float32 vector, launch; no rows: zeros."""
    (n, h), v = hidden.shape, weight.shape[0]
    dt = hidden.dtype
    if n == 0:
        return np.zeros((n, h), dt), np.zeros((v, h), dt), None if bias is None else np.zeros(v, dt)
    hT, wT, b = _layouts(hidden, weight, bias)
    g = _host.contiguous(np.asarray(grad, np.float32).reshape(-1))
    dh, dw, db = _host.run(_linear_cross_entropy_backward_kernel, g, _host.contiguous(hidden), hT,
                           _host.contiguous(weight), wT, b, targets32(target), _host.contiguous(lse), int(ignore_index),
                           reduction, float(label_smoothing), None if softcap is None else float(softcap))
    return (_host.as_dtype(dh, dt.name, (n, h)), _host.as_dtype(dw, dt.name, (v, h)),
            None if bias is None else _host.as_dtype(db, dt.name, (v,)))



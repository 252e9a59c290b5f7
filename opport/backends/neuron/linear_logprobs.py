"""linear_logprobs on NKI: linear_cross_entropy's logit tiles (TensorE into PSUM, bias, tanh on ScalarE) scaled by
1/T, folded into the online logsumexp plus the entropy's running sum; the backward runs linear_cross_entropy's two
sweeps (dhidden by row tiles, dweight/dbias by vocabulary tiles) with this op's dlogits. Never N x V in HBM.
"""

from __future__ import annotations

import numpy as np

from opport.backends.neuron import _host
from opport.backends.neuron._loss_rows import column_hits, column_iota, mark_rows, target_tile, targets32
from opport.backends.neuron._softmax_steps import online_step, running_state
from opport.backends.neuron._tiles import spans
from opport.backends.neuron.linear_cross_entropy import (
    TILE_V,
    TILE_VB,
    _hT_tiles,
    _layouts,
    _logit_tile,
    _supports,
    dhidden_rows,
    dweight_tile,
)
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.dispatch import impl
from opport.ops.linear_logprobs import linear_logprobs as spec


def _col(p, value=None):
    """A float32 [p, 1] SBUF column (memset to `value` when given)."""
    t_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    if value != None:  # noqa: E711
        nisa.memset(dst=t_sb, value=value)
    return t_sb


@nki.jit
def _linear_logprobs_forward_kernel(hT_hbm, wT_hbm, b_hbm, target_hbm, inv_t, softcap, ignore_index):
    """Per-token log p(target) and entropy of softmax(cap(hidden @ weight.T + bias) / T), and each row's logsumexp.

    Dimensions:
        N: rows (tiles of 128 on the partitions); H: hidden (128-row k tiles); V: vocabulary (512-column tiles).

    Args:
        hT_hbm: [H, N] hidden transposed (a host layout copy); wT_hbm: [H, V] weight transposed; b_hbm: [V] or None.
        target_hbm: [N] int32 (clipped by the host); inv_t, softcap, ignore_index: compile-time.

    Returns:
        (logp_hbm, ent_hbm, lse_hbm): float32 [N, 1] each.

    Notes:
        Per vocabulary tile: z = logits · (1/T) (`_logit_tile`'s scale), folded by `online_step` into the running
        max m and sum s; u = sum exp(z - m)(z - m) follows: rescaled to the new max as (u + (m - m') s) corr, plus the
        tile's sum of e (z - m') (VectorE). logp = (z_t - m) - log s, entropy = log s - u / s: terms of the order
        of log V. Out-of-range targets give a NaN logp, ignored rows 0 (predicated copies).

    Pseudocode:
        for each 128-row tile: m = -FLT_MAX; s = u = z_t = 0
            for each 512-wide vocabulary tile: z = (sum_k hT[k]^T wT[k, tile] (+ b)) (softcap) / T
                m', corr, e = online(m, s, z); u = (u + (m - m') s_old) corr + sum e (z - m'); z_t += sum(z [col == t])
            logp, entropy, lse from m, s, u, z_t
    """
    H, N = hT_hbm.shape
    V = wT_hbm.shape[1]
    PMAX = nl.tile_size.pmax
    logp_hbm = nl.ndarray((N, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    ent_hbm = nl.ndarray((N, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    lse_hbm = nl.ndarray((N, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    cols_sb = column_iota(min(PMAX, N), min(TILE_V, V))
    for r0, p in spans(N, PMAX):
        t_f_sb = target_tile(target_hbm, r0, p)
        logp_sb, ent_sb, lse_sb = _row_tile(hT_hbm, wT_hbm, b_hbm, cols_sb, t_f_sb, r0, p, inv_t, softcap)
        ign_sb = mark_rows(logp_sb, t_f_sb, ignore_index, V, p)
        nisa.tensor_copy_predicated(dst=logp_sb, src=0.0, predicate=ign_sb)
        nisa.tensor_copy_predicated(dst=ent_sb, src=0.0, predicate=ign_sb)
        nisa.dma_copy(dst=logp_hbm[r0:r0 + p, 0:1], src=logp_sb)
        nisa.dma_copy(dst=ent_hbm[r0:r0 + p, 0:1], src=ent_sb)
        nisa.dma_copy(dst=lse_hbm[r0:r0 + p, 0:1], src=lse_sb)
    return logp_hbm, ent_hbm, lse_hbm


def _row_tile(hT_hbm, wT_hbm, b_hbm, cols_sb, t_f_sb, r0, p, inv_t, softcap):
    """(logp, entropy, lse) float32 [p, 1] of one row tile, before the NaN / ignored-row fixes."""
    V = wT_hbm.shape[1]
    hT_tiles = _hT_tiles(hT_hbm, r0, p)
    m_sb, s_sb = running_state(p)
    u_sb, zt_sb = _col(p, 0.0), _col(p, 0.0)
    for i, (v0, vt) in enumerate(spans(V, TILE_V)):
        z_sb, _ = _logit_tile(hT_tiles, wT_hbm, b_hbm, v0, vt, p, softcap, inv_t)
        pick_sb = nl.ndarray((p, vt), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=pick_sb, data1=z_sb, data2=column_hits(cols_sb, t_f_sb, v0, p, vt), op=nl.multiply)
        part_sb = _col(p)
        nisa.tensor_reduce(dst=part_sb, op=nl.add, data=pick_sb, axis=1, keepdims=True)
        nisa.tensor_tensor(dst=zt_sb, data1=zt_sb, data2=part_sb, op=nl.add)
        s_old_sb = _col(p)
        nisa.tensor_copy(dst=s_old_sb, src=s_sb)
        m_new_sb, corr_sb, e_sb = online_step(m_sb, s_sb, z_sb)
        if i > 0:  # u = (u + (m - m') s_old) corr; on the first tile u and s_old are 0 (and m - m' may overflow)
            shift_sb = _col(p)
            nisa.tensor_tensor(dst=shift_sb, data1=m_sb, data2=m_new_sb, op=nl.subtract)
            nisa.scalar_tensor_tensor(dst=u_sb, data=shift_sb, op0=nl.multiply, operand0=s_old_sb, op1=nl.add,
                                      operand1=u_sb)
            nisa.tensor_scalar(dst=u_sb, data=u_sb, op0=nl.multiply, operand0=corr_sb)
        neg_m_sb = _col(p)
        nisa.tensor_scalar(dst=neg_m_sb, data=m_new_sb, op0=nl.multiply, operand0=-1.0)
        w_sb = nl.ndarray((p, vt), dtype=nl.float32, buffer=nl.sbuf)  # e (z - m')
        nisa.scalar_tensor_tensor(dst=w_sb, data=z_sb, op0=nl.add, operand0=neg_m_sb, op1=nl.multiply, operand1=e_sb)
        nisa.tensor_reduce(dst=part_sb, op=nl.add, data=w_sb, axis=1, keepdims=True)
        nisa.tensor_tensor(dst=u_sb, data1=u_sb, data2=part_sb, op=nl.add)
        m_sb = m_new_sb
    log_s_sb = _col(p)
    nisa.activation(dst=log_s_sb, op=nl.log, data=s_sb)
    lse_sb = _col(p)
    nisa.tensor_tensor(dst=lse_sb, data1=m_sb, data2=log_s_sb, op=nl.add)
    logp_sb = _col(p)  # (z_t - m) - log s
    nisa.tensor_tensor(dst=logp_sb, data1=zt_sb, data2=m_sb, op=nl.subtract)
    nisa.tensor_tensor(dst=logp_sb, data1=logp_sb, data2=log_s_sb, op=nl.subtract)
    inv_s_sb = _col(p)
    nisa.reciprocal(dst=inv_s_sb, data=s_sb)
    ent_sb = _col(p)  # log s - u / s
    nisa.tensor_tensor(dst=ent_sb, data1=u_sb, data2=inv_s_sb, op=nl.multiply)
    nisa.tensor_tensor(dst=ent_sb, data1=log_s_sb, data2=ent_sb, op=nl.subtract)
    return logp_sb, ent_sb, lse_sb


def _supports_forward(hidden, weight, target, bias, temperature, softcap, ignore_index):
    return _supports(hidden, weight, target, bias, ignore_index, "none", 0.0, softcap)


@impl(spec, "neuron", supports=_supports_forward)
def linear_logprobs(hidden, weight, target, bias, temperature, softcap, ignore_index):
    return linear_logprobs_forward(hidden, weight, target, bias, temperature, softcap, ignore_index)[:2]


@impl(spec.train_forward, "neuron", supports=_supports_forward)
def linear_logprobs_forward(hidden, weight, target, bias, temperature, softcap, ignore_index):
    """Host side: the transposed layouts, int32 targets, launch; no rows: empty outputs."""
    n = hidden.shape[0]
    if n == 0:
        return np.empty(0, np.float32), np.empty(0, np.float32), np.empty(0, np.float32)
    hT, wT, b = _layouts(hidden, weight, bias)
    outs = _host.run(_linear_logprobs_forward_kernel, hT, wT, b, targets32(target), 1.0 / float(temperature),
                     None if softcap is None else float(softcap), int(ignore_index))
    return tuple(_host.as_dtype(o, "float32", (n,)) for o in outs)


# --------------------------------------------------------------------------- backward


@nki.jit
def _linear_logprobs_backward_kernel(gl_hbm, ge_hbm, h_hbm, hT_hbm, w_hbm, wT_hbm, b_hbm, target_hbm, ent_hbm, lse_hbm,
                                     inv_t, softcap, ignore_index):
    """dhidden, dweight, dbias of linear_logprobs from the saved lse and entropy, the logits recomputed tile by tile.

    Dimensions: as linear_cross_entropy's backward (128-row tiles, 128-column vocabulary tiles, 512-column H chunks).

    Args:
        gl_hbm, ge_hbm: [N] float32 upstream gradients of logps and entropy.
        h_hbm [N, H], hT_hbm [H, N], w_hbm [V, H], wT_hbm [H, V], b_hbm [V] or None: hidden's dtype.
        target_hbm: [N] int32; ent_hbm, lse_hbm: [N] float32; inv_t, softcap, ignore_index: compile-time.

    Returns:
        (dh_hbm [N, H], dw_hbm [V, H], db_hbm [1, V] or None) in hidden's dtype.

    Notes:
        Per row tile: g_l and g_e scaled by 1/T once (dlogits is linear in them), g_l NaN where the target is
        outside [0, V). dlogits of a tile: zl = z - lse, p = exp(zl), d = -p (g_l + g_e (zl + H)) + g_l [col == t],
        times 1 - tanh² with a softcap, ignored rows 0 by a predicated copy. The sweeps are linear_cross_entropy's
        (`dhidden_rows`, `dweight_tile`): float32 SBUF accumulators, fixed order, no atomics.

    Pseudocode:
        for each row tile: for each vocabulary tile: d = dlogits(tile); dh[rows] += d @ w[tile]
        for each vocabulary tile: for each row tile: d = dlogits(tile); dw[tile] += d^T h[rows]; db[tile] += d^T 1
    """
    H, N = hT_hbm.shape
    V = wT_hbm.shape[1]
    dh_hbm = nl.ndarray((N, H), dtype=h_hbm.dtype, buffer=nl.shared_hbm)
    dw_hbm = nl.ndarray((V, H), dtype=h_hbm.dtype, buffer=nl.shared_hbm)
    if b_hbm != None:  # noqa: E711
        db_hbm = nl.ndarray((1, V), dtype=h_hbm.dtype, buffer=nl.shared_hbm)
    else:
        db_hbm = None
    cols_sb = column_iota(min(nl.tile_size.pmax, N), TILE_VB)
    rows = []
    for r0, p in spans(N, nl.tile_size.pmax):
        rows.append(_row_setup(gl_hbm, ge_hbm, target_hbm, ent_hbm, lse_hbm, r0, p, inv_t, ignore_index, V))
    dlogits = (_dlogits, (wT_hbm, b_hbm, cols_sb, inv_t, softcap))
    for row in rows:
        dhidden_rows(row, h_hbm, hT_hbm, w_hbm, dh_hbm, dlogits)
    for v0, vt in spans(V, TILE_VB):
        dweight_tile(rows, v0, vt, h_hbm, hT_hbm, dw_hbm, db_hbm, dlogits)
    return dh_hbm, dw_hbm, db_hbm


def _row_setup(gl_hbm, ge_hbm, target_hbm, ent_hbm, lse_hbm, r0, p, inv_t, ignore_index, V):
    """(r0, p, t, g_l / T, ignored, -lse, g_e / T, H) of one row tile: float32 [p, 1] tiles, the predicate uint8."""
    t_f_sb = target_tile(target_hbm, r0, p)
    cols = []
    for src, sign in ((gl_hbm, inv_t), (ge_hbm, inv_t), (lse_hbm, -1.0), (ent_hbm, 1.0)):
        c_sb = _col(p)
        nisa.dma_copy(dst=c_sb, src=src[r0:r0 + p])
        if sign != 1.0:
            nisa.tensor_scalar(dst=c_sb, data=c_sb, op0=nl.multiply, operand0=float(sign))
        cols.append(c_sb)
    gl_sb, ge_sb, neg_lse_sb, ent_sb = cols
    ign_sb = mark_rows(gl_sb, t_f_sb, ignore_index, V, p)
    return (r0, p, t_f_sb, gl_sb, ign_sb, neg_lse_sb, ge_sb, ent_sb)


def _dlogits(row, hT_tiles, v0, vt, wT_hbm, b_hbm, cols_sb, inv_t, softcap):
    """float32 dlogits [p, vt] of one row tile and vocabulary tile (the backward's Notes)."""
    _, p, t_f_sb, gl_sb, ign_sb, neg_lse_sb, ge_sb, ent_sb = row
    z_sb, th_sb = _logit_tile(hT_tiles, wT_hbm, b_hbm, v0, vt, p, softcap, inv_t)
    zl_sb = nl.ndarray((p, vt), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=zl_sb, data=z_sb, op0=nl.add, operand0=neg_lse_sb)
    p_sb = nl.ndarray((p, vt), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=p_sb, op=nl.exp, data=zl_sb)
    q_sb = nl.ndarray((p, vt), dtype=nl.float32, buffer=nl.sbuf)  # g_l + g_e (zl + H)
    nisa.tensor_scalar(dst=q_sb, data=zl_sb, op0=nl.add, operand0=ent_sb, op1=nl.multiply, operand1=ge_sb)
    nisa.tensor_scalar(dst=q_sb, data=q_sb, op0=nl.add, operand0=gl_sb)
    d_sb = nl.ndarray((p, vt), dtype=nl.float32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=d_sb, data=p_sb, op0=nl.multiply, operand0=-1.0, op1=nl.multiply, operand1=q_sb)
    nisa.scalar_tensor_tensor(dst=d_sb, data=column_hits(cols_sb, t_f_sb, v0, p, vt), op0=nl.multiply,
                              operand0=gl_sb, op1=nl.add, operand1=d_sb)
    if th_sb != None:  # noqa: E711 (times 1 - tanh², before the ignored rows are zeroed)
        sq_sb = nl.ndarray((p, vt), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=sq_sb, data1=th_sb, data2=th_sb, op=nl.multiply)
        nisa.tensor_scalar(dst=sq_sb, data=sq_sb, op0=nl.multiply, operand0=-1.0, op1=nl.add, operand1=1.0)
        nisa.tensor_tensor(dst=d_sb, data1=d_sb, data2=sq_sb, op=nl.multiply)
    nisa.tensor_copy_predicated(dst=d_sb, src=0.0, predicate=ign_sb.broadcast(1, vt))
    return d_sb


def _supports_backward(grad_logps, grad_entropy, hidden, weight, target, entropy, lse, bias, temperature, softcap,
                       ignore_index):
    return _supports_forward(hidden, weight, target, bias, temperature, softcap, ignore_index)


@impl(spec.backward_op, "neuron", supports=_supports_backward)
def linear_logprobs_backward(grad_logps, grad_entropy, hidden, weight, target, entropy, lse, bias, temperature, softcap,
                             ignore_index):
    """Host side: layouts (hidden, weight and their transposes), launch; no rows: zeros."""
    (n, h), v = hidden.shape, weight.shape[0]
    dt = hidden.dtype
    if n == 0:
        return np.zeros((n, h), dt), np.zeros((v, h), dt), None if bias is None else np.zeros(v, dt)
    hT, wT, b = _layouts(hidden, weight, bias)
    c = _host.contiguous
    dh, dw, db = _host.run(_linear_logprobs_backward_kernel, c(grad_logps), c(grad_entropy), c(hidden), hT, c(weight),
                           wT, b, targets32(target), c(entropy), c(lse), 1.0 / float(temperature),
                           None if softcap is None else float(softcap), int(ignore_index))
    return (_host.as_dtype(dh, dt.name, (n, h)), _host.as_dtype(dw, dt.name, (v, h)),
            None if bias is None else _host.as_dtype(db, dt.name, (v,)))

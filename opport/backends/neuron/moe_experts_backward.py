"""moe_experts' backward on NKI: the forward's expert sort and row tiles, gate and up recomputed, no state saved."""

from __future__ import annotations

import numpy as np

from opport.backends.neuron import _host
from opport.backends.neuron._tiles import spans
from opport.backends.neuron.moe_experts import (
    PSUM_N,
    TILE,
    gate_up_tile,
    gather_rows,
    gathered_transposed,
    router_weights,
    row_indices,
    sorted_picks,
    sum_over_k,
    swiglu_tile,
    transposed,
)
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.backends.neuron.silu import clipped, silu_grad
from opport.dispatch import impl
from opport.dtypes import np_dtype
from opport.ops.moe_experts import moe_experts as spec


@nki.jit
def _moe_experts_backward_kernel(g_hbm, x_hbm, w1_hbm, w2_hbm, rw_hbm, tok_hbm, slot_hbm, groups):
    """Gradients of the routed experts for x, gate_up_proj, down_proj and the router weights.

    Dimensions:
        T: tokens; H: hidden; I: expert intermediate; E: experts; k: picks per token; T k sorted rows in 128-row
        tiles per expert (the forward's).

    Args:
        g_hbm: [T, H] upstream gradient; x_hbm: [T, H]; w1_hbm: [E, 2I, H]; w2_hbm: [E, H, I]; rw_hbm: [T k, 1] router
        weights by slot: all in x's dtype (float32/float16/bfloat16).
        tok_hbm, slot_hbm: [T k, 1] int32 token and slot of each expert-sorted row; groups: compile-time
        ((e, first row, rows), ...) of the experts hit (the forward's).

    Returns:
        (dx_hbm [T, H], dw1_hbm [E, 2I, H], dw2_hbm [E, H, I], dw_hbm [T k, 1] by slot), in x's dtype.

    Notes:
        Pass 1, per row tile: x and grad rows gathered (indirect DMA) and transposed on TensorE; per I tile gate^T
        and up^T recomputed and dA^T = down_proj[e]^T grad^T [I tile, rows] (down_proj's [H, I] tiles are the
        stationary operand as stored: no transpose). With I on the partitions the row's router weight varies
        along the free axis: it is replicated across partitions by a K = 1 matmul. dw = sum_i dA a is a
        reduction across partitions: a matmul against a ones column, accumulated over I tiles in PSUM.
        dgate = (w dA up) silu'(gate) (silu's float32 silu' with its limits), dup = silu(gate) w dA. dx per slot
        = [dgate, dup] gate_up_proj[e] takes dh^T as the stationary operand and gate_up_proj's rows as stored;
        it is scattered to its slot's row of a float32 scratch and summed over k in pick order at the end, as
        the forward's output. a and dh go to HBM scratches in sorted-row order (transposed back on TensorE).
        Pass 2, per expert hit: ddown_proj[e] = sum over rows (w grad)^T a and dgate_up_proj[e] = sum dh^T x,
        contractions over rows, which lie on the partitions as loaded (matmul's db): one PSUM accumulator per
        output tile over the expert's row tiles, in order. Experts no token picks get zeros, their weights
        unread. w grad is rounded to x's dtype for TensorE (a and dh are too).

    Pseudocode:
        for (e, first, n) in groups, each row tile r:
            for each I tile i: g, u = W1[e, i] x_r^T; dA = W2[e, :, i]^T grad_r^T; a = swiglu(g, u)
                dw_r += ones^T (dA a); da = w_r dA; dh_r[i] = da u silu'(g); dh_r[I + i] = silu(g) da
            dxs[slot[r]] = dh_r^T W1[e]
        for (e, ...) in groups: dW2[e] = sum_r (w_r grad_r)^T a_r; dW1[e] = sum_r dh_r^T x_r
        dx[t] = sum_j dxs[t k + j]
    """
    T, H = x_hbm.shape
    E, I2 = w1_hbm.shape[0], w1_hbm.shape[1]
    I = I2 // 2  # noqa: E741 (the contract's name)
    k = tok_hbm.shape[0] // T
    dt = x_hbm.dtype
    dx_hbm = nl.ndarray((T, H), dtype=dt, buffer=nl.shared_hbm)
    dw1_hbm = nl.ndarray((E, I2, H), dtype=dt, buffer=nl.shared_hbm)
    dw2_hbm = nl.ndarray((E, H, I), dtype=dt, buffer=nl.shared_hbm)
    dw_hbm = nl.ndarray((T * k, 1), dtype=dt, buffer=nl.shared_hbm)
    # scratches (shared_hbm tensors other than inputs and outputs are named): a and dh by sorted row, dx by slot
    a_hbm = nl.ndarray((T * k, I), dtype=dt, buffer=nl.shared_hbm, name="moe_experts_bwd_a")
    dh_hbm = nl.ndarray((T * k, I2), dtype=dt, buffer=nl.shared_hbm, name="moe_experts_bwd_dh")
    dxs_hbm = nl.ndarray((T * k, H), dtype=nl.float32, buffer=nl.shared_hbm, name="moe_experts_bwd_dxs")
    for e, first, n in groups:
        for r0, p in spans(first + n, TILE, first):
            _row_tile(g_hbm, x_hbm, w1_hbm, w2_hbm, rw_hbm, tok_hbm, slot_hbm, a_hbm, dh_hbm, dxs_hbm, dw_hbm, e, r0, p)
    hit = []
    for e, first, n in groups:
        hit.append(e)
        _weight_grads(g_hbm, x_hbm, rw_hbm, tok_hbm, slot_hbm, a_hbm, dh_hbm, dw1_hbm, dw2_hbm, e, first, n)
    _zero_unpicked(dw1_hbm, dw2_hbm, hit)
    sum_over_k(dxs_hbm, dx_hbm, k)
    return dx_hbm, dw1_hbm, dw2_hbm, dw_hbm


def _row_tile(g_hbm, x_hbm, w1_hbm, w2_hbm, rw_hbm, tok_hbm, slot_hbm, a_hbm, dh_hbm, dxs_hbm, dw_hbm, e, r0, p):
    """Pass 1 for sorted rows r0..r0+p of expert e: a and dh rows to their scratches, dw and dx rows to their slots."""
    H = x_hbm.shape[1]
    I = w1_hbm.shape[1] // 2  # noqa: E741
    dt = x_hbm.dtype
    tok_sb, slot_sb = row_indices(tok_hbm, slot_hbm, r0, p)
    xT_tiles = gathered_transposed(x_hbm, tok_sb, p)
    gT_tiles = gathered_transposed(g_hbm, tok_sb, p)
    wb_sb = _weights_across_partitions(router_weights(rw_hbm, slot_sb, p), min(I, TILE), p)
    ones_sb = nl.ndarray((TILE, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones_sb, value=1.0)
    dw_psum = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.psum)
    dgate_tiles, dup_tiles = [], []
    for i0, it in spans(I, TILE):
        g_sb, u_sb = gate_up_tile(w1_hbm, xT_tiles, e, i0, it, p)
        da_sb = _down_grad_tile(w2_hbm, gT_tiles, e, i0, it, p)  # dA^T, before the router weight
        a32_sb = nl.ndarray((it, p), dtype=nl.float32, buffer=nl.sbuf)
        swiglu_tile(a32_sb, g_sb, u_sb, it, p)
        prod_sb = nl.ndarray((it, p), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=prod_sb, data1=da_sb, data2=a32_sb, op=nl.multiply)
        nisa.nc_matmul(dst=dw_psum, stationary=prod_sb, moving=ones_sb[0:it, 0:1])
        nisa.tensor_tensor(dst=da_sb, data1=da_sb, data2=wb_sb[0:it, 0:p], op=nl.multiply)
        dgate_sb = nl.ndarray((it, p), dtype=dt, buffer=nl.sbuf)
        _gate_grad(dgate_sb, g_sb, u_sb, da_sb, it, p)
        dup_sb = nl.ndarray((it, p), dtype=dt, buffer=nl.sbuf)
        swiglu_tile(dup_sb, g_sb, da_sb, it, p)
        a_sb = nl.ndarray((it, p), dtype=dt, buffer=nl.sbuf)
        nisa.tensor_copy(dst=a_sb, src=a32_sb)
        nisa.dma_copy(dst=a_hbm[r0:r0 + p, i0:i0 + it], src=transposed(a_sb))
        nisa.dma_copy(dst=dh_hbm[r0:r0 + p, i0:i0 + it], src=transposed(dgate_sb))
        nisa.dma_copy(dst=dh_hbm[r0:r0 + p, I + i0:I + i0 + it], src=transposed(dup_sb))
        dgate_tiles.append(dgate_sb)
        dup_tiles.append(dup_sb)
    dw_sb = nl.ndarray((p, 1), dtype=dt, buffer=nl.sbuf)
    nisa.tensor_copy(dst=dw_sb, src=dw_psum)
    nisa.dma_copy(dst=dw_hbm.ap([[1, p], [1, 1]], offset=0, vector_offset=slot_sb, indirect_dim=0), src=dw_sb)
    for c0, c in spans(H, PSUM_N):  # dx rows: dh^T as stationary, gate_up_proj[e]'s rows as stored
        dx_psum = nl.ndarray((p, c), dtype=nl.float32, buffer=nl.psum)
        for j, (i0, it) in enumerate(spans(I, TILE)):
            for half, tiles in ((0, dgate_tiles), (I, dup_tiles)):
                w_sb = nl.ndarray((it, c), dtype=dt, buffer=nl.sbuf)
                nisa.dma_copy(dst=w_sb, src=w1_hbm[e, half + i0:half + i0 + it, c0:c0 + c])
                nisa.nc_matmul(dst=dx_psum, stationary=tiles[j], moving=w_sb)
        dx_sb = nl.ndarray((p, c), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=dx_sb, src=dx_psum)
        nisa.dma_copy(dst=dxs_hbm.ap([[H, p], [1, c]], offset=c0, vector_offset=slot_sb, indirect_dim=0), src=dx_sb)


def _weights_across_partitions(w_sb, parts, p):
    """The rows' router weights w [p, 1] float32 laid along the free axis of `parts` partitions, [parts, p]: a
    transpose to one row, then a K = 1 matmul against ones replicates it (x * 1.0, exact)."""
    wT_sb = transposed(w_sb)  # [1, p]
    ones_sb = nl.ndarray((1, parts), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones_sb, value=1.0)
    rep_psum = nl.ndarray((parts, p), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=rep_psum, stationary=ones_sb, moving=wT_sb)
    wb_sb = nl.ndarray((parts, p), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=wb_sb, src=rep_psum)
    return wb_sb


def _down_grad_tile(w2_hbm, gT_tiles, e, i0, it, p):
    """dA^T [it, p] float32 = down_proj[e][:, i0:i0+it]^T grad^T, accumulated over H tiles: down_proj's [128 H, it]
    tiles are the stationary operand as stored."""
    H = w2_hbm.shape[1]
    da_psum = nl.ndarray((it, p), dtype=nl.float32, buffer=nl.psum)
    for j, (h0, kt) in enumerate(spans(H, TILE)):
        w_sb = nl.ndarray((kt, it), dtype=w2_hbm.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=w_sb, src=w2_hbm[e, h0:h0 + kt, i0:i0 + it])
        nisa.nc_matmul(dst=da_psum, stationary=w_sb, moving=gT_tiles[j])
    da_sb = nl.ndarray((it, p), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=da_sb, src=da_psum)
    return da_sb


def _gate_grad(dgate_sb, g_sb, u_sb, da_sb, pp, f):
    """dgate = (da up) silu'(gate) into dgate_sb (its dtype): silu' in float32 with the limits 0 and 1 at -inf and
    +inf (silu's silu_grad on the clipped gate)."""
    sp_sb = nl.ndarray((pp, f), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=sp_sb, op=nl.sigmoid, data=g_sb)
    d_sb = nl.ndarray((pp, f), dtype=nl.float32, buffer=nl.sbuf)
    silu_grad(d_sb, sp_sb, g_sb, clipped(g_sb, pp, f), pp, f)
    du_sb = nl.ndarray((pp, f), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=du_sb, data1=da_sb, data2=u_sb, op=nl.multiply)
    nisa.tensor_tensor(dst=dgate_sb, data1=du_sb, data2=d_sb, op=nl.multiply)


def _weight_grads(g_hbm, x_hbm, rw_hbm, tok_hbm, slot_hbm, a_hbm, dh_hbm, dw1_hbm, dw2_hbm, e, first, n):
    """Pass 2 for expert e: ddown_proj[e] = sum over its rows (w grad)^T a and dgate_up_proj[e] = sum dh^T x, one
    PSUM accumulator per [128, 512] output tile over the row tiles in order (rows on the partitions, as loaded)."""
    H = x_hbm.shape[1]
    I2 = dh_hbm.shape[1]
    I = I2 // 2  # noqa: E741
    dt = x_hbm.dtype
    rows = spans(first + n, TILE, first)
    for h0, ht in spans(H, TILE):
        for c0, c in spans(I, PSUM_N):
            acc_psum = nl.ndarray((ht, c), dtype=nl.float32, buffer=nl.psum)
            for r0, p in rows:
                tok_sb, slot_sb = row_indices(tok_hbm, slot_hbm, r0, p)
                gw_sb = gather_rows(g_hbm, tok_sb, p, h0, ht)
                nisa.tensor_scalar(dst=gw_sb, data=gw_sb, op0=nl.multiply, operand0=router_weights(rw_hbm, slot_sb, p))
                a_sb = nl.ndarray((p, c), dtype=dt, buffer=nl.sbuf)
                nisa.dma_copy(dst=a_sb, src=a_hbm[r0:r0 + p, c0:c0 + c])
                nisa.nc_matmul(dst=acc_psum, stationary=gw_sb, moving=a_sb)
            _store_tile(dw2_hbm, acc_psum, e, h0, ht, c0, c)
    for j0, jt in spans(I2, TILE):
        for c0, c in spans(H, PSUM_N):
            acc_psum = nl.ndarray((jt, c), dtype=nl.float32, buffer=nl.psum)
            for r0, p in rows:
                tok_sb, _ = row_indices(tok_hbm, slot_hbm, r0, p)
                dh_sb = nl.ndarray((p, jt), dtype=dt, buffer=nl.sbuf)
                nisa.dma_copy(dst=dh_sb, src=dh_hbm[r0:r0 + p, j0:j0 + jt])
                nisa.nc_matmul(dst=acc_psum, stationary=dh_sb, moving=gather_rows(x_hbm, tok_sb, p, c0, c))
            _store_tile(dw1_hbm, acc_psum, e, j0, jt, c0, c)


def _store_tile(dw_hbm, acc_psum, e, r0, r, c0, c):
    """Evict one weight-gradient tile from PSUM, rounded once to the gradient's dtype."""
    res_sb = nl.ndarray((r, c), dtype=dw_hbm.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=res_sb, src=acc_psum)
    nisa.dma_copy(dst=dw_hbm[e, r0:r0 + r, c0:c0 + c], src=res_sb)


def _zero_unpicked(dw1_hbm, dw2_hbm, hit):
    """Zeros for the weight gradients of the experts no token picks (their weights are never read): each run of
    consecutive unpicked experts is one block of rows of dw viewed as [E R, C], written 128 rows at a time."""
    E = dw1_hbm.shape[0]
    zero_sb = nl.ndarray((TILE, PSUM_N), dtype=dw1_hbm.dtype, buffer=nl.sbuf)
    nisa.memset(dst=zero_sb, value=0.0)
    runs, start = [], None
    for e in range(E + 1):
        picked = e == E or e in hit
        if not picked and start is None:
            start = e
        if picked and start is not None:
            runs.append((start, e))
            start = None
    for e0, e1 in runs:
        for dw_hbm in (dw1_hbm, dw2_hbm):
            R, C = dw_hbm.shape[1], dw_hbm.shape[2]
            for r0, r in spans(e1 * R, TILE, e0 * R):
                for c0, c in spans(C, PSUM_N):
                    nisa.dma_copy(dst=dw_hbm.ap([[C, r], [1, c]], offset=r0 * C + c0), src=zero_sb[0:r, 0:c])


@impl(spec.backward_op, "neuron")
def moe_experts_backward(grad, x, gate_up_proj, down_proj, top_k_index, top_k_weights) -> tuple:
    """Host side: the forward's expert sort, contiguous operands, router weights as [T k, 1]; T = 0 gives zero weight
    gradients without a launch."""
    t, h = x.shape
    k = top_k_index.shape[1]
    dt = np_dtype(x.dtype.name)
    if t == 0:
        return np.empty((0, h), dt), np.zeros(gate_up_proj.shape, dt), np.zeros(down_proj.shape, dt), np.empty((0, k), dt)
    tok, slot, groups = sorted_picks(top_k_index, gate_up_proj.shape[0])
    dx, dw1, dw2, dw = _host.run(_moe_experts_backward_kernel, _host.contiguous(grad), _host.contiguous(x),
                                 _host.contiguous(gate_up_proj), _host.contiguous(down_proj),
                                 _host.contiguous(top_k_weights).reshape(-1, 1), tok, slot, groups)
    name = x.dtype.name
    return (_host.as_dtype(dx, name, (t, h)), _host.as_dtype(dw1, name, gate_up_proj.shape),
            _host.as_dtype(dw2, name, down_proj.shape), _host.as_dtype(dw, name, (t, k)))
